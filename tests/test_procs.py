"""Process slots: claiming, heartbeats, release, and taking over the slots of the dead."""

from __future__ import annotations

import os
import random
import time
from multiprocessing.synchronize import Barrier, Event

import pytest
from conftest import SMALL
from proc_helpers import CTX, Children, reused_pid, run_children, zombie

from ankusa_shm.shm import layout as L
from ankusa_shm.shm import pids, procs
from ankusa_shm.shm import segment as segmod
from ankusa_shm.shm.counters import Counter
from ankusa_shm.shm.procs import NoFreeSlot, Role
from ankusa_shm.shm.segment import Segment


def _hold_slot(name: str, index: int | None, held: Event, done: Event) -> int:
    with Segment.attach(name) as s:
        slot = procs.claim(s.view, s.layout, Role.DRAINER, index=index, now_ms=123)
        held.set()
        done.wait(60)
        return slot.index


def test_claim_publishes_pid_role_state_and_heartbeat(seg: Segment) -> None:
    slot = procs.claim(seg.view, seg.layout, Role.WORKER, now_ms=1000)
    assert slot.index == 0
    (info,) = procs.read(seg.view, seg.layout)
    assert (info.slot, info.pid, info.role, info.state) == (0, os.getpid(), "worker", "running")
    assert info.heartbeat_ms == 1000
    assert info.claims == 1
    assert info.alive
    assert info.started_ns > 0
    slot.heartbeat(2500)
    assert procs.read(seg.view, seg.layout)[0].heartbeat_ms == 2500
    slot.set_state(procs.SlotState.STOPPING)
    assert procs.read(seg.view, seg.layout)[0].state == "stopping"
    assert info.requests == 0
    slot.counters.add(Counter.REQUESTS, 3)
    assert procs.read(seg.view, seg.layout)[0].requests == 3  # its own row, not a total


def test_release_frees_the_slot(seg: Segment) -> None:
    slot = procs.claim(seg.view, seg.layout, Role.SUPERVISOR, index=4)
    assert [p.slot for p in procs.read(seg.view, seg.layout)] == [4]
    slot.release()
    assert procs.read(seg.view, seg.layout) == []
    again = procs.claim(seg.view, seg.layout, Role.TOOL, index=4)
    assert procs.read(seg.view, seg.layout)[0].claims == 2
    assert procs.read(seg.view, seg.layout)[0].role == "tool"
    again.release()


def test_a_live_process_keeps_its_slot(seg: Segment) -> None:
    held, done = CTX.Event(), CTX.Event()
    with Children() as kids:
        child = kids.start(_hold_slot, seg.name, None, held, done)
        assert held.wait(60)
        (info,) = procs.read(seg.view, seg.layout)
        assert (info.pid, info.role, info.heartbeat_ms) == (child.pid, "drainer", 123)
        with pytest.raises(NoFreeSlot, match="slot 0"):
            procs.claim(seg.view, seg.layout, Role.WORKER, index=0)
        mine = procs.claim(seg.view, seg.layout, Role.WORKER)
        assert mine.index == 1  # the first free one, not the live child's
        done.set()
        assert kids.collect() == [0]
        kids.join()
    # The child is gone: its slot may be taken, and read() says it is not alive.
    info = next(p for p in procs.read(seg.view, seg.layout) if p.slot == 0)
    assert not info.alive
    assert procs.claim(seg.view, seg.layout, Role.WORKER, index=0).index == 0


def test_force_takes_a_slot_from_a_live_pid(seg: Segment) -> None:
    held, done = CTX.Event(), CTX.Event()
    with Children() as kids:
        kids.start(_hold_slot, seg.name, 2, held, done)
        assert held.wait(60)
        slot = procs.claim(seg.view, seg.layout, Role.WORKER, index=2, force=True)
        assert procs.read(seg.view, seg.layout)[0].pid == os.getpid()
        assert slot.index == 2
        done.set()
        kids.collect()


def test_no_free_slot(seg_name: str) -> None:
    params = segmod.make_params(queue_capacity=16, gcra_slots=16, process_slots=2)
    with Segment.create(seg_name, params) as s, Children() as kids:
        done = CTX.Event()
        for _ in range(2):
            held = CTX.Event()
            kids.start(_hold_slot, seg_name, None, held, done)
            assert held.wait(60)
        with pytest.raises(NoFreeSlot, match="any slot of 2"):
            procs.claim(s.view, s.layout, Role.WORKER)
        done.set()
        assert sorted(kids.collect()) == [0, 1]
        kids.join()
        assert procs.claim(s.view, s.layout, Role.WORKER).index == 0


def _claim_at_once(i: int, name: str, start: Barrier) -> tuple[int, int]:
    with Segment.attach(name) as s:
        start.wait(60)
        slot = procs.claim(s.view, s.layout, Role.WORKER)
        start.wait(60)  # all hold their slots until every one has claimed
        return slot.index, os.getpid()


def test_racing_claims_get_distinct_slots(seg: Segment) -> None:
    n = 6
    got = run_children(n, _claim_at_once, seg.name, CTX.Barrier(n))
    assert sorted(i for i, _ in got) == list(range(n))
    assert {p.pid for p in procs.read(seg.view, seg.layout)} == {pid for _, pid in got}


def test_claim_out_of_range(seg: Segment) -> None:
    with pytest.raises(IndexError):
        procs.claim(seg.view, seg.layout, Role.WORKER, index=SMALL.process_slots)


def _claim_count_exit(name: str, index: int, n: int) -> int:
    with Segment.attach(name) as s:
        slot = procs.claim(s.view, s.layout, Role.WORKER, index=index)
        slot.counters.add(Counter.REQUESTS, n)
        return os.getpid()  # exits holding the slot, as a killed worker does


def test_a_slot_whose_holders_pid_was_reused_is_claimed_at_once(seg: Segment) -> None:
    with Children() as kids:
        kids.start(_claim_count_exit, seg.name, 3, 7)
        (gone,) = kids.collect()
        kids.join()
    with reused_pid(gone):
        started = time.monotonic()
        slot = procs.claim(seg.view, seg.layout, Role.WORKER, index=3)  # not NoFreeSlot
        assert time.monotonic() - started < 10  # and no waiting on the newcomer
        (info,) = procs.read(seg.view, seg.layout)
        assert (info.pid, info.start_ticks, info.alive) == (os.getpid(), pids.my_start(), True)
        assert (slot.requests(), info.requests) == (0, 0)  # the dead holder's 7 are not ours
        slot.counters.add(Counter.REQUESTS, 2)
        assert slot.requests() == procs.read(seg.view, seg.layout)[0].requests == 2


def test_a_zombie_holder_is_not_alive(seg: Segment) -> None:
    def hold() -> None:
        with Segment.attach(seg.name) as s:
            procs.claim(s.view, s.layout, Role.WORKER, index=5)

    with zombie(hold) as pid:
        (info,) = procs.read(seg.view, seg.layout)
        assert (info.slot, info.pid, info.alive) == (5, pid, False)
        assert procs.claim(seg.view, seg.layout, Role.WORKER, index=5).index == 5


def test_read_tolerates_any_slot_contents(seg: Segment) -> None:
    rng = random.Random(7)
    words = [0xFFFFFFFF, -1, 2**63 - 1, -(2**63), 2**40, 3 << L.PS_STATE_SHIFT]
    words += [rng.getrandbits(64) - 2**63 for _ in range(40)]
    base = seg.layout.offset("processes")
    for i, w in enumerate(words):
        b = base + i * L.PROCESS_SLOT_BYTES
        seg.view.store(b + L.PS_HEADER, w)
        for off in (L.PS_STARTED_NS, L.PS_HEARTBEAT_MS, L.PS_CLAIMS, L.PS_REQUESTS_BASE):
            seg.view.store(b + off, rng.getrandbits(64) - 2**63)
    shown = procs.read(seg.view, seg.layout)
    assert {p.slot for p in shown} <= set(range(len(words)))
    assert len(shown) > len(words) // 2
    assert not any(p.alive for p in shown)  # nobody real is named by random words


def test_release_dead_frees_only_a_gone_holders_slots(seg: Segment) -> None:
    held, done = CTX.Event(), CTX.Event()
    with Children() as kids:
        child = kids.start(_hold_slot, seg.name, 2, held, done)
        assert held.wait(60) and child.pid is not None
        mine = procs.claim(seg.view, seg.layout, Role.WORKER, index=0)
        assert procs.release_dead(seg.view, seg.layout, child.pid) == 0  # alive: kept
        assert procs.release_dead(seg.view, seg.layout, os.getpid()) == 0
        done.set()
        assert kids.collect() == [2]
        kids.join()
    assert procs.release_dead(seg.view, seg.layout, child.pid) == 1  # reaped: freed
    assert [p.slot for p in procs.read(seg.view, seg.layout)] == [0]
    mine.release()
