"""Counters: one row per process slot, summed on read, exact and never going backwards
across restarts and deaths at any point."""

from __future__ import annotations

import itertools
import os
import signal
import sys
import time
from multiprocessing.synchronize import Barrier, Event
from types import FrameType

import pytest
from proc_helpers import CTX, TIMEOUT_S, Children, run_children

from ankusa_shm._atomics import AtomicView
from ankusa_shm.shm import counters, procs
from ankusa_shm.shm import layout as L
from ankusa_shm.shm.counters import Counter, CounterRow
from ankusa_shm.shm.procs import Role
from ankusa_shm.shm.segment import Segment

N_PROCS = 4
M_ADDS = 20_000


def test_every_counter_has_its_own_word_in_the_row(seg: Segment) -> None:
    offsets = [c.offset for c in Counter]
    assert len(set(offsets)) == len(offsets)
    assert all(o % L.WORD == 0 and 0 <= o < seg.layout.counter_row for o in offsets)
    assert seg.layout.counter_row % L.LINE == 0


def test_labels_and_help() -> None:
    assert Counter.REQUESTS.label == "requests"
    assert Counter.ADMIT_OK.label == 'admit{result="ok"}'
    assert Counter.BREAKER_TO_OPEN.label == 'fleet_breaker_transitions{to="open"}'
    assert len({c.label for c in Counter}) == len(Counter)
    for c in Counter:
        assert counters.family_help(c.family)  # every family has its help text somewhere


def test_row_add_get_and_totals(seg: Segment) -> None:
    last = seg.layout.params.process_slots - 1
    a = procs.claim(seg.view, seg.layout, procs.Role.TOOL, index=0).counters
    b = procs.claim(seg.view, seg.layout, procs.Role.TOOL, index=last).counters
    a.add(Counter.REQUESTS)
    a.add(Counter.REQUESTS, 4)
    b.add(Counter.REQUESTS, 10)
    b.add(Counter.SETTLE_DROPPED, 2)
    assert a.get(Counter.REQUESTS) == 5
    assert b.get(Counter.REQUESTS) == 10
    assert a.get(Counter.SETTLE_DROPPED) == 0
    t = counters.totals(seg.view, seg.layout)
    assert t[Counter.REQUESTS] == 15
    assert t[Counter.SETTLE_DROPPED] == 2
    assert sum(t.values()) == 17
    with pytest.raises(IndexError):
        CounterRow(seg.view, seg.layout, seg.layout.params.process_slots)
    with pytest.raises(IndexError):
        CounterRow(seg.view, seg.layout, -1)


def _add_through_slot(i: int, name: str, m: int, start: Barrier) -> int:
    with Segment.attach(name) as s:
        slot = procs.claim(s.view, s.layout, Role.WORKER)
        start.wait(60)
        for _ in range(m):
            slot.counters.add(Counter.REQUESTS)
            slot.counters.add(Counter.ADMIT_OK, 2)
        return slot.index


def test_counter_adds_across_processes(seg: Segment) -> None:
    slots = run_children(N_PROCS, _add_through_slot, seg.name, M_ADDS, CTX.Barrier(N_PROCS))
    assert len(set(slots)) == N_PROCS  # live processes never share a row
    t = counters.totals(seg.view, seg.layout)
    assert t[Counter.REQUESTS] == N_PROCS * M_ADDS
    assert t[Counter.ADMIT_OK] == 2 * N_PROCS * M_ADDS


def _claim_add_exit(i: int, name: str, index: int, n: int) -> int:
    with Segment.attach(name) as s:
        slot = procs.claim(s.view, s.layout, Role.WORKER, index=index)
        slot.counters.add(Counter.REQUESTS, n)
        slot.counters.add(Counter.SETTLE_DROPPED, 1)
        return slot.index  # exits without releasing: a crash, as far as the slot knows


def _claim_and_read(i: int, name: str, index: int) -> tuple[int, int]:
    with Segment.attach(name) as s:
        slot = procs.claim(s.view, s.layout, Role.WORKER, index=index)
        return slot.requests(), slot.counters.get(Counter.REQUESTS)


def test_counters_survive_a_slot_being_claimed_again(seg: Segment) -> None:
    assert run_children(1, _claim_add_exit, seg.name, 3, 7) == [3]
    before = counters.totals(seg.view, seg.layout)
    assert before[Counter.REQUESTS] == 7
    assert before[Counter.SETTLE_DROPPED] == 1

    # A new process takes the dead one's slot: the row keeps the 7, the newcomer has
    # served none of them, the totals stand.
    assert run_children(1, _claim_and_read, seg.name, 3) == [(0, 7)]
    assert counters.totals(seg.view, seg.layout) == before

    # And again, in this process this time, after more counting in the slot.
    assert run_children(1, _claim_add_exit, seg.name, 3, 5) == [3]
    slot = procs.claim(seg.view, seg.layout, Role.WORKER, index=3)
    assert slot.requests() == 0
    t = counters.totals(seg.view, seg.layout)
    assert t[Counter.REQUESTS] == 12
    assert t[Counter.SETTLE_DROPPED] == 2
    slot.counters.add(Counter.REQUESTS)
    assert counters.totals(seg.view, seg.layout)[Counter.REQUESTS] == 13
    assert slot.requests() == 1
    assert procs.read(seg.view, seg.layout)[0].requests == 1


def _reclaim_loop(name: str, per_round: int, go: Event, stop: Event) -> int:
    rounds = 0
    with Segment.attach(name) as s:
        go.set()
        while not stop.is_set():
            slot = procs.claim(s.view, s.layout, Role.WORKER, index=0)
            slot.counters.add(Counter.REQUESTS, per_round)
            rounds += 1
            time.sleep(0.0005)
    return rounds * per_round


def test_totals_never_go_backwards_while_slots_are_claimed_again(seg: Segment) -> None:
    go, stop = CTX.Event(), CTX.Event()
    seen: list[int] = []
    with Children() as kids:
        kids.start(_reclaim_loop, seg.name, 10, go, stop)
        assert go.wait(60)
        # Read for as long as it takes to see the claims go by (a sum of the claimed
        # slots alone is fast: a fixed number of reads can end before the first round).
        deadline = time.monotonic() + 30
        while (len(set(seen)) <= 20 or len(seen) < 500) and time.monotonic() < deadline:
            seen.append(counters.totals(seg.view, seg.layout)[Counter.REQUESTS])
        stop.set()
        (added,) = kids.collect()
        kids.join()
    final = counters.totals(seg.view, seg.layout)[Counter.REQUESTS]
    assert final == added
    assert len(set(seen)) > 10, "the reader did not overlap the claims"
    assert all(a <= b for a, b in itertools.pairwise(seen)), "a total went backwards"
    assert max(seen) <= final, "something was counted twice"


_WRITES = ("add", "store", "cas")


def _claim_killed_after_write(name: str, index: int, k: int) -> None:
    """Claim slot ``index`` and SIGKILL this process right after its k-th write to the
    segment: a real death at that exact point."""
    with Segment.attach(name) as s:
        writes = 0

        def after(frame: FrameType, event: str, arg: object) -> None:
            nonlocal writes
            if event != "c_return" or getattr(arg, "__name__", "") not in _WRITES:
                return
            if isinstance(getattr(arg, "__self__", None), AtomicView):
                writes += 1
                if writes == k:
                    os.kill(os.getpid(), signal.SIGKILL)

        sys.setprofile(after)
        procs.claim(s.view, s.layout, Role.WORKER, index=index)
        sys.setprofile(None)


def test_totals_stay_exact_when_a_claimer_dies_at_any_point(seg: Segment) -> None:
    """A claimer killed after each of its writes in turn; the slot's earlier counts must be
    in the totals exactly once, however the claim was cut short."""
    assert run_children(1, _claim_add_exit, seg.name, 2, 9) == [2]
    want = counters.totals(seg.view, seg.layout)
    for k in range(1, 40):
        p = CTX.Process(target=_claim_killed_after_write, args=(seg.name, 2, k))
        p.start()
        p.join(TIMEOUT_S)
        assert counters.totals(seg.view, seg.layout) == want, f"killed after write {k}"
        if p.exitcode == 0:
            break  # the claim finished before a k-th write: every point has been tried
        assert p.exitcode == -signal.SIGKILL
    else:
        raise AssertionError("the claim never finished")
    assert k > 3  # it was killed at several points first
    started = time.monotonic()
    slot = procs.claim(seg.view, seg.layout, Role.WORKER, index=2)
    assert time.monotonic() - started < 10  # no wait on any of the dead
    assert slot.requests() == 0
    assert counters.totals(seg.view, seg.layout) == want
