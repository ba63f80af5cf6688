"""Counters: one row per process, summed on read, never going backwards across restarts."""

from __future__ import annotations

import itertools
import threading
import time
from multiprocessing.synchronize import Barrier, Event

import pytest
from proc_helpers import CTX, Children, dead_pid, live_pid, run_children

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
    a = CounterRow(seg.view, seg.layout, 0)
    b = CounterRow(seg.view, seg.layout, seg.layout.params.process_slots - 1)
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


def _claim_and_read(i: int, name: str, index: int) -> dict[str, int]:
    with Segment.attach(name) as s:
        slot = procs.claim(s.view, s.layout, Role.WORKER, index=index)
        return {c.name: slot.counters.get(c) for c in Counter}


def test_counters_survive_a_slot_being_claimed_again(seg: Segment) -> None:
    assert run_children(1, _claim_add_exit, seg.name, 3, 7) == [3]
    before = counters.totals(seg.view, seg.layout)
    assert before[Counter.REQUESTS] == 7
    assert before[Counter.SETTLE_DROPPED] == 1

    # A new process takes the dead one's slot: its row starts at 0, the totals stand.
    (row,) = run_children(1, _claim_and_read, seg.name, 3)
    assert set(row.values()) == {0}
    assert counters.totals(seg.view, seg.layout) == before
    archive = seg.layout.offset("archive") + L.AR_TOTALS
    assert seg.view.load(archive + Counter.REQUESTS.offset) == 7

    # And again, in this process this time, after more counting in the slot.
    assert run_children(1, _claim_add_exit, seg.name, 3, 5) == [3]
    slot = procs.claim(seg.view, seg.layout, Role.WORKER, index=3)
    assert slot.counters.get(Counter.REQUESTS) == 0
    t = counters.totals(seg.view, seg.layout)
    assert t[Counter.REQUESTS] == 12
    assert t[Counter.SETTLE_DROPPED] == 2
    slot.counters.add(Counter.REQUESTS)
    assert counters.totals(seg.view, seg.layout)[Counter.REQUESTS] == 13


def _reclaim_loop(name: str, per_round: int, go: Event, stop: Event) -> int:
    rounds = 0
    with Segment.attach(name) as s:
        go.set()
        while not stop.is_set():
            # Each claim folds the row (this process's own, from the last round) into the
            # archive: the moment a careless reader counts it twice or not at all.
            slot = procs.claim(s.view, s.layout, Role.WORKER, index=0)
            slot.counters.add(Counter.REQUESTS, per_round)
            rounds += 1
            time.sleep(0.0005)  # a restart is rare; a reader must get through between folds
    return rounds * per_round


def test_totals_never_go_backwards_while_rows_are_folded(seg: Segment) -> None:
    go, stop = CTX.Event(), CTX.Event()
    seen: list[int] = []
    with Children() as kids:
        kids.start(_reclaim_loop, seg.name, 10, go, stop)
        assert go.wait(60)
        for _ in range(500):
            seen.append(counters.totals(seg.view, seg.layout, patience_s=30)[Counter.REQUESTS])
        stop.set()
        (added,) = kids.collect()
        kids.join()
    final = counters.totals(seg.view, seg.layout)[Counter.REQUESTS]
    assert final == added
    assert len(set(seen)) > 10, "the reader did not overlap the folds"
    assert all(a <= b for a, b in itertools.pairwise(seen)), "a total went backwards"
    assert max(seen) <= final, "a fold was counted twice"


def test_a_dead_folders_turn_is_taken_over(seg: Segment) -> None:
    fold_word = seg.layout.offset("archive") + L.AR_FOLD
    seg.view.store(fold_word, (7 << L.PID_BITS) | dead_pid())  # died halfway through a fold
    assert run_children(1, _claim_add_exit, seg.name, 5, 4) == [5]  # its claim folds: no hang
    assert seg.view.load(fold_word) == 8 << L.PID_BITS  # released, one version on
    slot = procs.claim(seg.view, seg.layout, Role.WORKER, index=5)
    assert slot.counters.get(Counter.REQUESTS) == 0
    assert seg.view.load(fold_word) == 9 << L.PID_BITS
    assert counters.totals(seg.view, seg.layout)[Counter.REQUESTS] == 4


def test_totals_wait_out_a_fold_in_progress(seg: Segment) -> None:
    row = CounterRow(seg.view, seg.layout, 2)
    row.add(Counter.REQUESTS, 5)
    fold_word = seg.layout.offset("archive") + L.AR_FOLD
    in_archive = seg.layout.offset("archive") + L.AR_TOTALS + Counter.REQUESTS.offset
    in_row = seg.layout.offset("counters") + 2 * seg.layout.counter_row + Counter.REQUESTS.offset
    result: list[int] = []

    def read() -> None:
        result.append(counters.totals(seg.view, seg.layout, patience_s=60)[Counter.REQUESTS])

    with live_pid() as folder:
        # A live process is halfway through folding row 2: added to the archive, row not
        # yet zeroed. A sum taken now would count the 5 twice.
        seg.view.store(fold_word, (3 << L.PID_BITS) | folder)
        seg.view.add(in_archive, 5)
        reader = threading.Thread(target=read)
        reader.start()
        time.sleep(0.2)
        assert reader.is_alive(), f"totals returned {result} in the middle of a fold"
        seg.view.store(in_row, 0)
        seg.view.store(fold_word, 4 << L.PID_BITS)
        reader.join(60)
    assert result == [5]
