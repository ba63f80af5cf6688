"""Real forked processes for tests: start them, collect what they return, leave none behind.

Every child is a ``fork`` of the test process (``multiprocessing``'s fork context, which
ends the child with ``os._exit``), attaches to the segment by name itself and closes it.
Results travel back through one ``multiprocessing`` queue as ``(index, ok, value)``; a
child that raised sends its traceback, and the test fails with it.
"""

from __future__ import annotations

import multiprocessing
import os
import queue
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from multiprocessing.process import BaseProcess
from multiprocessing.queues import Queue
from types import TracebackType
from typing import Any, TypeVar

R = TypeVar("R")

CTX = multiprocessing.get_context("fork")
TIMEOUT_S = 60.0  # generous: a loaded 2-core machine may be slow, never this slow


def _child(
    results: Queue[tuple[int, bool, Any]],
    index: int,
    target: Callable[..., Any],
    args: tuple[object, ...],
) -> None:
    try:
        value = target(*args)
    except BaseException:
        results.put((index, False, traceback.format_exc()))
        raise
    results.put((index, True, value))


class Children:
    """Forked children sharing one result queue; any still running on exit are killed."""

    def __init__(self) -> None:
        self.procs: list[BaseProcess] = []
        self._results: Queue[tuple[int, bool, Any]] = CTX.Queue()

    def start(self, target: Callable[..., object], *args: object) -> BaseProcess:
        """Fork a child that runs ``target(*args)`` and reports its return value."""
        p = CTX.Process(target=_child, args=(self._results, len(self.procs), target, args))
        p.daemon = True
        p.start()
        self.procs.append(p)
        return p

    def collect(self, indexes: list[int] | None = None, timeout: float = TIMEOUT_S) -> list[Any]:
        """The return values of the given children (default: all), in start order."""
        want = set(range(len(self.procs)) if indexes is None else indexes)
        got: dict[int, Any] = {}
        deadline = time.monotonic() + timeout
        while want - got.keys():  # results of children not asked about are kept, unchecked
            try:
                index, ok, value = self._results.get(timeout=0.2)
            except queue.Empty:
                missing = want - got.keys()
                dead = [i for i in missing if self.procs[i].exitcode is not None]
                if dead:  # a child that exited has flushed its result: one more look
                    try:
                        index, ok, value = self._results.get(timeout=2)
                    except queue.Empty:
                        codes = {i: self.procs[i].exitcode for i in dead}
                        raise AssertionError(f"children exited without a result: {codes}") from None
                elif time.monotonic() > deadline:
                    raise AssertionError(f"children {sorted(missing)} did not finish") from None
                else:
                    continue
            if not ok and index in want:
                raise AssertionError(f"child {index} failed:\n{value}")
            got[index] = value
        return [got[i] for i in sorted(want)]

    def join(self, timeout: float = TIMEOUT_S) -> None:
        """Wait for every child and require a clean exit."""
        deadline = time.monotonic() + timeout
        for p in self.procs:
            p.join(max(0.0, deadline - time.monotonic()))
        codes = [p.exitcode for p in self.procs]
        assert codes == [0] * len(codes), f"child exit codes: {codes}"

    def kill_all(self) -> None:
        for p in self.procs:
            if p.is_alive():
                p.kill()
            p.join(10)
        self._results.close()
        self._results.join_thread()

    def __enter__(self) -> Children:
        return self

    def __exit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.kill_all()


def run_children(n: int, target: Callable[..., R], *args: object) -> list[R]:
    """Fork ``n`` children running ``target(i, *args)``; their return values, by ``i``."""
    with Children() as kids:
        for i in range(n):
            kids.start(target, i, *args)
        results = kids.collect()
        kids.join()
    return results


def _nothing() -> None:
    pass


def dead_pid() -> int:
    """The pid of a child that has exited and been reaped."""
    p = CTX.Process(target=_nothing)
    p.start()
    p.join(TIMEOUT_S)
    assert p.exitcode == 0 and p.pid is not None
    return p.pid


def _sleep_forever() -> None:
    time.sleep(3600)


@contextmanager
def live_pid() -> Iterator[int]:
    """The pid of a child that stays alive until the block ends."""
    p = CTX.Process(target=_sleep_forever, daemon=True)
    p.start()
    try:
        assert p.pid is not None
        yield p.pid
    finally:
        p.kill()
        p.join(10)


NS_LAST_PID = "/proc/sys/kernel/ns_last_pid"


def _start_with_pid(
    pid: int, target: Callable[..., object], args: tuple[object, ...]
) -> BaseProcess:
    """Fork a child that runs ``target(*args)`` and gets exactly ``pid``, which must be free.

    As root, ns_last_pid names the pid the next fork goes after; another process forking
    at the same moment can take it first, so try again. Where it cannot be written, fork
    and reap short-lived children until the pid counter comes round.
    """
    deadline = time.monotonic() + TIMEOUT_S
    while time.monotonic() < deadline:
        try:
            with open(NS_LAST_PID, "w") as f:
                f.write(str(pid - 1))
        except OSError:
            _cycle_pids_to(pid - 1, deadline)
        p = CTX.Process(target=target, args=args, daemon=True)
        p.start()
        if p.pid == pid:
            return p
        p.kill()
        p.join(10)
    raise AssertionError(f"pid {pid} never came round")


def _cycle_pids_to(last: int, deadline: float) -> None:
    while time.monotonic() < deadline:
        child = os.fork()
        if child == 0:
            os._exit(0)
        os.waitpid(child, 0)
        if child == last:
            return


@contextmanager
def reused_pid(pid: int) -> Iterator[BaseProcess]:
    """A new, live process that has been given ``pid`` -- real pid reuse -- until the block
    ends. ``pid`` must be free: its last process has exited and been reaped."""
    # Start times are clock ticks (10 ms here): a pid given out again within the same tick
    # would look like the same process. Only ns_last_pid can reuse a pid that fast; the
    # kernel's own counter takes a whole lap of pid_max to come round.
    time.sleep(3 / os.sysconf("SC_CLK_TCK"))
    p = _start_with_pid(pid, _sleep_forever, ())
    try:
        yield p
    finally:
        p.kill()
        p.join(10)


@contextmanager
def zombie(work: Callable[[], object] | None = None) -> Iterator[int]:
    """The pid of a child that ran ``work`` and exited and is not yet reaped (a zombie),
    until the block ends; then it is reaped, and ``work`` must have succeeded."""
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            if work is not None:
                work()
            code = 0
        finally:
            os._exit(code)
    try:
        deadline = time.monotonic() + TIMEOUT_S
        while state_of(pid) != "Z":
            assert time.monotonic() < deadline, f"child {pid} never became a zombie"
            time.sleep(0.005)
        yield pid
    finally:
        _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, f"the zombie's work failed: {status}"


def state_of(pid: int) -> str:
    """The state letter of ``/proc/<pid>/stat`` (Z: zombie, T: stopped)."""
    with open(f"/proc/{pid}/stat", "rb") as f:
        return f.read().rpartition(b")")[2].split()[0].decode()


def claimed_row(seg: Any, slot: int) -> Any:
    """Slot ``slot``'s counter row, with the slot marked as once claimed -- a reader sums
    only the rows of slots some process has held -- without claiming it for this one."""
    from ankusa_shm.shm import layout as L
    from ankusa_shm.shm.counters import CounterRow

    seg.view.add(seg.layout.offset("processes") + slot * L.PROCESS_SLOT_BYTES + L.PS_CLAIMS, 1)
    return CounterRow(seg.view, seg.layout, slot)
