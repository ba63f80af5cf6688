"""The store writers take the lock in the order they asked for it (``shm.turns`` and
``store.lock``), and a writer that died waiting holds the others up once, briefly."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

from fleet_helpers import wait_until
from proc_helpers import CTX, TIMEOUT_S

from ankusa_shm.shm import layout as L
from ankusa_shm.shm.segment import Segment
from ankusa_shm.shm.turns import Turns
from ankusa_shm.store.lock import WriteLock


def tickets_taken(seg: Segment) -> int:
    return seg.view.load(seg.layout.offset("store") + L.ST_TICKETS)


def serving(seg: Segment) -> int:
    """The ticket whose turn it is; every ticket below it has had its turn."""
    return seg.view.load(seg.layout.offset("store") + L.ST_SERVING)


def test_tickets_are_served_in_order_and_the_queue_never_moves_back(seg: Segment) -> None:
    turns = Turns(seg.view, seg.layout)
    assert [turns.ticket() for _ in range(3)] == [0, 1, 2]
    assert serving(seg) == 0
    turns.served(0)
    assert serving(seg) == 1
    turns.served(2)  # ticket 1 died waiting; 2 waited it out and had its turn
    assert serving(seg) == 3
    turns.served(1)  # late news of a turn long passed moves nothing
    assert serving(seg) == 3


def _take_in_turn(seg_name: str, lock_file: str, log: str) -> None:
    seg = Segment.attach(seg_name)
    try:
        lock = WriteLock(Path(lock_file), Turns(seg.view, seg.layout), turn_wait_s=TIMEOUT_S)
        lock.acquire()
        with open(log, "a") as f:
            f.write("waiter\n")
        lock.release()
        lock.close()
    finally:
        seg.close()


def test_a_holder_that_wants_the_lock_again_waits_behind_the_writer_already_waiting(
    seg: Segment, tmp_path: Path
) -> None:
    """Plain flock lets the holder take the lock straight back; in turns it cannot."""
    turns = Turns(seg.view, seg.layout)
    lock_file, log = tmp_path / "db.lock", tmp_path / "order"
    mine = WriteLock(lock_file, turns, turn_wait_s=TIMEOUT_S)
    mine.acquire()
    child = CTX.Process(target=_take_in_turn, args=(seg.name, str(lock_file), str(log)))
    child.start()
    try:
        wait_until(lambda: tickets_taken(seg) == 2, "the waiter's ticket")
        time.sleep(0.05)  # the waiter is in flock by now, or about to be
        mine.release()
        mine.acquire()  # the waiter's turn comes first
        with open(log, "a") as f:
            f.write("holder again\n")
        mine.release()
        child.join(TIMEOUT_S)
        assert child.exitcode == 0
        assert log.read_text().splitlines() == ["waiter", "holder again"]
        assert serving(seg) == 3
    finally:
        if child.is_alive():
            child.kill()
        mine.close()


def _wait_forever(seg_name: str, lock_file: str) -> None:
    seg = Segment.attach(seg_name)
    WriteLock(Path(lock_file), Turns(seg.view, seg.layout), turn_wait_s=TIMEOUT_S).acquire()


def test_a_writer_killed_while_waiting_for_its_turn_costs_the_next_one_its_wait_once(
    seg: Segment, tmp_path: Path
) -> None:
    turns = Turns(seg.view, seg.layout)
    lock_file = tmp_path / "db.lock"
    holder = WriteLock(lock_file, turns)
    holder.acquire()  # ticket 0
    child = CTX.Process(target=_wait_forever, args=(seg.name, str(lock_file)))
    child.start()
    wait_until(lambda: tickets_taken(seg) == 2, "the child's ticket")  # ticket 1
    os.kill(child.pid or 0, signal.SIGKILL)
    child.join(TIMEOUT_S)
    holder.release()
    assert serving(seg) == 1  # the dead writer's turn, which never comes

    late = WriteLock(lock_file, turns, turn_wait_s=0.1)
    began = time.monotonic()
    late.acquire()  # ticket 2 waits out the dead turn, then takes the lock
    assert time.monotonic() - began >= 0.1
    late.release()
    assert serving(seg) == 3  # healed: the next ticket's turn has come
    late.acquire()
    late.release()
    assert serving(seg) == 4
    holder.close()
    late.close()


def test_a_bounded_wait_takes_its_turn_and_gives_it_up_when_it_times_out(
    seg: Segment, tmp_path: Path
) -> None:
    """The admin process's writes wait within a bound (``wait_within``), in the same
    queue as the workers' writers; one that gives up lets the queue move on past it."""
    turns = Turns(seg.view, seg.layout)
    lock_file = tmp_path / "db.lock"
    holder = WriteLock(lock_file, turns)
    holder.acquire()  # ticket 0
    bounded = WriteLock(lock_file, turns, turn_wait_s=TIMEOUT_S)
    assert bounded.wait_within(0.1) is False  # ticket 1: its turn never came in time
    assert serving(seg) == 2  # given up: it is nobody's turn to wait for
    holder.release()
    assert serving(seg) == 2
    assert bounded.wait_within(TIMEOUT_S) is True  # ticket 2: its turn, and the lock
    assert serving(seg) == 2
    bounded.release()
    assert serving(seg) == 3
    holder.close()
    bounded.close()
