"""Real forked processes for tests: start them, collect what they return, leave none behind.

Every child is a ``fork`` of the test process (``multiprocessing``'s fork context, which
ends the child with ``os._exit``), attaches to the segment by name itself and closes it.
Results travel back through one ``multiprocessing`` queue as ``(index, ok, value)``; a
child that raised sends its traceback, and the test fails with it.
"""

from __future__ import annotations

import multiprocessing
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
