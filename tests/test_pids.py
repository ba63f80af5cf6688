"""Liveness: a pid, its start time, zombies, real pid reuse, and words that name nobody."""

from __future__ import annotations

import os
from multiprocessing.connection import Connection

import pytest
from proc_helpers import CTX, Children, dead_pid, live_pid, reused_pid, zombie

from ankusa_shm.shm import layout as L
from ankusa_shm.shm import pids
from ankusa_shm.shm.segment import Segment
from ankusa_shm.shm.settle_queue import ConsumerTaken, Op, Record, SettleQueue

NOBODY = [0, -1, -(2**63), L.PID_MASK + 1, 0xFFFFFFFF, 2**40, 2**63 - 1, 2**100]


@pytest.mark.parametrize("pid", NOBODY)
def test_a_word_outside_the_pid_range_is_nobody_never_an_error(pid: int) -> None:
    assert pids.pid_alive(pid) is False
    assert pids.pid_alive(pid, 12345) is False
    assert pids.start_ticks(pid) is None


def test_a_live_process_is_alive_only_with_its_own_start_time() -> None:
    assert pids.pid_alive(os.getpid(), pids.my_start())
    with live_pid() as pid:
        start = pids.start_ticks(pid)
        assert start is not None and start > 0
        assert pids.pid_alive(pid)
        assert pids.pid_alive(pid, start)
        assert pids.pid_alive(pid, start & L.START_MASK)  # as the segment keeps it
        assert not pids.pid_alive(pid, start + 1)
    assert not pids.pid_alive(pid)
    assert not pids.pid_alive(dead_pid())


def test_a_zombie_is_not_alive() -> None:
    with zombie() as pid:
        assert os.path.exists(f"/proc/{pid}")  # the pid still exists: not reaped
        assert not pids.pid_alive(pid)
        assert pids.start_ticks(pid) is None


def _rename_and_wait(conn: Connection, comm: str) -> None:
    before = pids.my_start()
    with open("/proc/self/comm", "w") as f:
        f.write(comm)
    conn.send(before)
    conn.recv()


@pytest.mark.parametrize("comm", ["a) (b c", "x y) 1 2 3 (", ")))"])
def test_start_time_read_past_a_command_name_with_spaces_and_parentheses(comm: str) -> None:
    ours, theirs = CTX.Pipe()
    with Children() as kids:
        child = kids.start(_rename_and_wait, theirs, comm)
        start = ours.recv()
        assert child.pid is not None
        with open(f"/proc/{child.pid}/comm") as f:
            assert f.read().strip() == comm
        assert pids.start_ticks(child.pid) == start
        assert pids.pid_alive(child.pid, start)
        ours.send(None)
        kids.collect()


def test_a_reused_pid_is_not_the_process_that_had_it() -> None:
    with live_pid() as pid:
        start = pids.start_ticks(pid)
    assert start is not None
    with reused_pid(pid) as newcomer:
        assert newcomer.pid == pid
        assert pids.pid_alive(pid)  # someone has the pid ...
        assert not pids.pid_alive(pid, start)  # ... but not the process recorded


def _rec(i: int) -> Record:
    return Record(Op.PROMOTE, f"k{i}".encode(), bytes(16), f"h{i}".encode(), 1, 2, 3)


def _consume_and_exit(_: int, name: str) -> int:
    with Segment.attach(name) as s:
        q = SettleQueue(s.view, s.buf, s.layout)
        q.become_consumer()
        batch, _ = q.peek(2, now_ms=0)
        q.commit(batch)
        return os.getpid()  # exits holding the role, as a killed drainer does


def test_a_consumer_whose_pid_was_reused_is_replaced(seg: Segment) -> None:
    q = SettleQueue(seg.view, seg.buf, seg.layout)
    for i in range(5):
        q.push(_rec(i))
    with Children() as kids:
        kids.start(_consume_and_exit, 0, seg.name)
        (gone,) = kids.collect()
        kids.join()
    assert q.consumer_pid() == gone
    with reused_pid(gone):
        q.become_consumer()  # not ConsumerTaken: the process now at that pid is another
        assert q.consumer_pid() == os.getpid()
        batch, skipped = q.peek(10, now_ms=0)
        assert (skipped, [r.key for r in batch.records]) == (0, [b"k2", b"k3", b"k4"])
    q.resign_consumer()
    assert q.consumer_pid() == 0


def test_a_live_consumer_keeps_the_role(seg: Segment) -> None:
    q = SettleQueue(seg.view, seg.buf, seg.layout)
    with live_pid() as pid:
        start = pids.start_ticks(pid)
        assert start is not None
        ident = seg.layout.offset("queue") + L.Q_CONSUMER_ID
        seg.view.store(ident, (start & L.START_MASK) << L.PID_BITS | pid)
        with pytest.raises(ConsumerTaken, match=str(pid)):
            q.become_consumer()
    q.become_consumer()  # and once it is gone, the role is free
    assert q.consumer_pid() == os.getpid()
