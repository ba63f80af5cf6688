"""The settle queue: a bounded MPSC ring in the segment that no dead process can wedge.

Producers and the consumer are real forked processes where it matters. Time for the
abandonment grace period is injected (``now_ms``), so nothing waits on a real clock --
except in the kill loops (``kill_loop.py``), whose consumers run as the drainer does.
"""

from __future__ import annotations

import os
import signal
import time
from multiprocessing.synchronize import Barrier, Event
from typing import cast

import kill_loop
import pytest
from conftest import SMALL
from kill_loop import origin, rec
from proc_helpers import CTX, Children, dead_pid, run_children, state_of

from ankusa_shm import config
from ankusa_shm._atomics import AtomicView
from ankusa_shm.fleet.redis_store import RedisStore
from ankusa_shm.shm import counters, procs, settle_queue
from ankusa_shm.shm import layout as L
from ankusa_shm.shm import segment as segmod
from ankusa_shm.shm.counters import Counter
from ankusa_shm.shm.segment import Segment
from ankusa_shm.shm.settle_queue import (
    ConsumerTaken,
    Op,
    Pushed,
    Record,
    RecordTooLarge,
    SettleQueue,
)

GRACE_MS = 200
PRODUCERS = 3
PER_PRODUCER = 20_000
# Consumers SIGKILLed by the kill loop; scripts/settle_kill_loop.py runs it longer.
KILLS = int(os.environ.get("ANKUSA_QUEUE_KILLS", "300"))


def queue(seg: Segment, grace_ms: int = settle_queue.ABANDON_GRACE_MS) -> SettleQueue:
    return SettleQueue(seg.view, seg.buf, seg.layout, grace_ms=grace_ms)


def drain(q: SettleQueue, now_ms: int = 0) -> list[Record]:
    """Everything published, peeked and committed."""
    out: list[Record] = []
    while True:
        batch, skipped = q.peek(100, now_ms)
        assert skipped == 0
        if not batch.records:
            return out
        out += batch.records
        q.commit(batch)


# -- one process --------------------------------------------------------------------------


def test_round_trip_preserves_every_field(seg: Segment) -> None:
    q = queue(seg)
    records = [
        Record(Op.RELEASE, "ключ:{t}:dd".encode(), os.urandom(16), b"01J0-hook", -1, 2**62, 0),
        Record(Op.PROMOTE, b"", bytes(16), b"", 0, -(2**63), 2**63 - 1),
        Record(Op.PROMOTE, b"k" * (L.RECORD_MAX_PAYLOAD - 255), b"\xff" * 16, b"h" * 255, 1, 2, 3),
    ]
    for r in records:
        assert q.push(r) is Pushed.OK
    assert q.depth() == 3
    q.become_consumer()
    batch, skipped = q.peek(10, now_ms=0)
    assert skipped == 0
    assert batch.records == records
    assert (batch.start, batch.end) == (0, 3)


def test_record_too_large_names_the_limit(seg: Segment) -> None:
    q = queue(seg)
    limit = L.RECORD_MAX_PAYLOAD
    too_big = Record(Op.PROMOTE, b"k" * (limit - 9), bytes(16), b"h" * 10, 0, 0, 0)
    with pytest.raises(RecordTooLarge, match=f"{limit + 1} bytes.*{limit}-byte"):
        q.push(too_big)
    with pytest.raises(RecordTooLarge):
        q.push(Record(Op.PROMOTE, b"k", bytes(16), b"h" * 256, 0, 0, 0))
    with pytest.raises(ValueError):  # a claim token is 16 bytes
        q.push(Record(Op.PROMOTE, b"k", bytes(15), b"h", 0, 0, 0))
    assert q.depth() == 0  # a refused record reserves nothing
    assert q.push(Record(Op.PROMOTE, b"k" * (limit - 10), bytes(16), b"h" * 10, 0, 0, 0)).value
    assert q.depth() == 1


def test_full_ring_refuses_exactly_the_overflow(seg: Segment) -> None:
    q = queue(seg)
    cap = SMALL.queue_capacity
    results = [q.push(rec(i)) for i in range(cap + 7)]
    assert results.count(Pushed.OK) == cap
    assert results[cap:] == [Pushed.FULL] * 7
    assert q.depth() == cap
    q.become_consumer()
    batch, _ = q.peek(3, now_ms=0)
    assert q.push(rec(9999)) is Pushed.FULL  # peeked is not freed
    q.commit(batch)
    assert [q.push(rec(cap + i)) for i in range(4)] == [Pushed.OK] * 3 + [Pushed.FULL]
    got = drain(q)
    assert [origin(r)[1] for r in got] == list(range(3, cap + 3))


def test_peek_twice_loses_nothing_before_commit(seg: Segment) -> None:
    q = queue(seg)
    for i in range(10):
        q.push(rec(i))
    q.become_consumer()
    first, _ = q.peek(4, now_ms=0)
    again, _ = q.peek(4, now_ms=0)
    assert first.records == again.records == [rec(i) for i in range(4)]
    assert q.depth() == 10
    q.commit(first)
    assert q.depth() == 6
    rest, _ = q.peek(100, now_ms=0)
    assert rest.records == [rec(i) for i in range(4, 10)]
    q.commit(rest)
    assert q.depth() == 0
    empty, skipped = q.peek(100, now_ms=0)
    assert (empty.records, skipped) == ([], 0)


def test_ring_wraps_many_times(seg: Segment) -> None:
    q = queue(seg)
    q.become_consumer()
    seq = 0
    for _ in range(5):
        for _ in range(SMALL.queue_capacity - 1):
            assert q.push(rec(seq)) is Pushed.OK
            seq += 1
        assert [origin(r)[1] for r in drain(q)] == list(range(seq - SMALL.queue_capacity + 1, seq))
    assert q.depth() == 0


def test_a_stale_enqueue_position_is_not_a_full_ring(seg: Segment) -> None:
    """A producer that read the enqueue position just before another producer reserved
    it, and then finds that producer copying into the slot, must move on to the next
    position: the ring is nearly empty, not full."""

    class StaleFirstRead:
        def __init__(self, view: AtomicView, enq: int) -> None:
            self._view, self._enq, self._stale = view, enq, True

        def load(self, offset: int) -> int:
            value = self._view.load(offset)
            if offset == self._enq and self._stale:
                self._stale = False
                return value - 1
            return value

        def __getattr__(self, name: str) -> object:
            return getattr(self._view, name)

    base = seg.layout.offset("queue")
    # Another producer has reserved position 0 and is copying its record in.
    seg.view.store(base + L.Q_ENQUEUE, 1)
    seg.view.store(base + L.Q_SLOTS + L.QS_SEQ, 0 | L.QS_WRITING)
    stale = cast(AtomicView, StaleFirstRead(seg.view, base + L.Q_ENQUEUE))
    q = SettleQueue(stale, seg.buf, seg.layout)
    assert q.push(rec(1)) is Pushed.OK
    assert seg.view.load(base + L.Q_ENQUEUE) == 2


# -- the consumer role ----------------------------------------------------------------------


def _consume_some_then_die(name: str) -> int:
    with Segment.attach(name) as s:
        q = queue(s)
        q.become_consumer()
        batch, _ = q.peek(3, now_ms=0)
        q.commit(batch)
        q.peek(4, now_ms=0)  # delivered maybe, never committed: then killed
        return q.consumer_pid()


def test_a_new_consumer_starts_where_the_dead_one_committed(seg: Segment) -> None:
    q = queue(seg)
    for i in range(10):
        q.push(rec(i))
    (child_pid,) = run_children(1, lambda i, name: _consume_some_then_die(name), seg.name)
    assert q.consumer_pid() == child_pid  # it never resigned
    assert q.depth() == 7
    q.become_consumer()
    assert q.consumer_pid() == os.getpid()
    assert [origin(r)[1] for r in drain(q)] == list(range(3, 10))


def _hold_consumer(name: str, holding: Event, release: Event) -> None:
    with Segment.attach(name) as s:
        q = queue(s)
        q.become_consumer()
        holding.set()
        release.wait(60)


def test_one_consumer_at_a_time(seg: Segment) -> None:
    q = queue(seg)
    holding, release = CTX.Event(), CTX.Event()
    with Children() as kids:
        child = kids.start(_hold_consumer, seg.name, holding, release)
        assert holding.wait(60)
        with pytest.raises(ConsumerTaken, match=str(child.pid)):
            q.become_consumer()
        release.set()
        kids.collect()
        kids.join()
    q.become_consumer()  # its holder is gone
    q.become_consumer()  # and again: it is ours
    assert q.consumer_pid() == os.getpid()
    q.resign_consumer()
    assert q.consumer_pid() == 0


def test_a_dead_consumer_is_replaced(seg: Segment) -> None:
    q = queue(seg)
    seg.view.store(seg.layout.offset("queue") + L.Q_CONSUMER, dead_pid())
    q.become_consumer()
    assert q.consumer_pid() == os.getpid()


# -- many producers -----------------------------------------------------------------------


def _produce(i: int, name: str, n: int, retry: bool, start: Barrier) -> tuple[int, int, int]:
    """Push n records; returns (pushes attempted, FULL answers, records given up)."""
    attempts = fulls = dropped = 0
    with Segment.attach(name) as s:
        q = queue(s)
        start.wait(60)
        for seq in range(n):
            r = rec(seq, i)
            while True:
                attempts += 1
                result = q.push(r)
                if result is Pushed.OK:
                    break
                assert result is Pushed.FULL, result
                fulls += 1
                if not retry:
                    dropped += 1
                    break
                os.sched_yield()
    return attempts, fulls, dropped


def _consume_concurrently(seg: Segment, kids: Children, expected: int) -> dict[int, list[int]]:
    q = queue(seg)
    q.become_consumer()
    got: dict[int, list[int]] = {p: [] for p in range(PRODUCERS)}
    n = 0
    deadline = time.monotonic() + 120
    while n < expected:
        batch, skipped = q.peek(500, now_ms=0)  # a still clock: nothing is ever abandoned
        assert skipped == 0
        for r in batch.records:
            p, seq = origin(r)
            assert r == rec(seq, p)
            got[p].append(seq)
        q.commit(batch)
        n += len(batch.records)
        if not batch.records:
            assert time.monotonic() < deadline, f"consumed {n} of {expected}"
            if not any(p.is_alive() for p in kids.procs) and q.depth() == 0:
                break
            time.sleep(0.0005)
    return got


@pytest.mark.parametrize("retry", [True, False], ids=["retry-on-full", "drop-on-full"])
def test_producers_and_consumer_concurrently(seg: Segment, retry: bool) -> None:
    with Children() as kids:
        start = CTX.Barrier(PRODUCERS)
        for p in range(PRODUCERS):
            kids.start(_produce, p, seg.name, PER_PRODUCER, retry, start)
        got = _consume_concurrently(seg, kids, PRODUCERS * PER_PRODUCER)
        results = kids.collect()
        kids.join()
    attempted = sum(a for a, _, _ in results)
    fulls = sum(f for _, f, _ in results)
    consumed = sum(len(v) for v in got.values())
    assert consumed + fulls == attempted
    for p, (_, _, dropped) in enumerate(results):
        seqs = got[p]
        assert seqs == sorted(set(seqs)), f"producer {p}: out of order or twice"
        assert len(seqs) + dropped == PER_PRODUCER
        if retry:
            assert seqs == list(range(PER_PRODUCER))
    assert queue(seg).depth() == 0
    assert seg.view.load(seg.layout.offset("queue") + L.Q_ENQUEUE) > 2 * SMALL.queue_capacity


def test_concurrent_producers_never_see_a_false_full(seg_name: str) -> None:
    per = 3000
    params = segmod.make_params(queue_capacity=PRODUCERS * per, gcra_slots=16, process_slots=8)
    with Segment.create(seg_name, params) as s:
        results = run_children(PRODUCERS, _produce, s.name, per, False, CTX.Barrier(PRODUCERS))
        assert [f for _, f, _ in results] == [0] * PRODUCERS  # room for all: never full
        q = queue(s)
        assert q.depth() == PRODUCERS * per
        q.become_consumer()
        got = drain(q)
    for p in range(PRODUCERS):
        assert [seq for prod, seq in map(origin, got) if prod == p] == list(range(per))


# -- producers that die or stall between reserving and publishing --------------------------


def _push_once_asleep(name: str) -> None:
    """Push one record once the consumer has said it is asleep."""
    with Segment.attach(name) as s:
        sleeping = s.layout.offset("queue") + L.Q_SLEEPING
        deadline = time.monotonic() + 60
        while not s.view.load(sleeping):
            assert time.monotonic() < deadline, "the consumer never fell asleep"
            time.sleep(0.001)
        assert queue(s).push(rec(0)) is Pushed.OK


def test_a_sleeping_consumer_is_woken_by_another_process_s_push(seg: Segment) -> None:
    q = queue(seg)
    q.become_consumer()
    with Children() as kids:
        kids.start(_push_once_asleep, seg.name)
        t0 = time.monotonic()
        assert q.wait_for_records(30.0)
        took = time.monotonic() - t0
        kids.join()
    assert took < 10.0, took  # woken, not timed out
    assert drain(q) == [rec(0)]
    assert not seg.view.load(seg.layout.offset("queue") + L.Q_SLEEPING)


def test_a_consumer_does_not_sleep_with_a_record_published_or_reserved(seg: Segment) -> None:
    q = queue(seg)
    q.become_consumer()
    assert q.push(rec(0)) is Pushed.OK
    t0 = time.monotonic()
    assert q.wait_for_records(30.0)
    drain(q)
    with Children() as kids:  # reserved, never published: its producer may be dead
        reserved = CTX.Event()
        kids.start(_reserve_and_hang, seg.name, reserved)
        assert reserved.wait(60)
        assert q.wait_for_records(30.0)
    assert time.monotonic() - t0 < 10.0


def test_a_consumer_with_nothing_coming_wakes_at_its_timeout(seg: Segment) -> None:
    q = queue(seg)
    q.become_consumer()
    t0 = time.monotonic()
    assert not q.wait_for_records(0.2)
    assert time.monotonic() - t0 >= 0.2


def _produce_in_bursts(i: int, name: str, n: int, start: Barrier) -> None:
    """Push n records in bursts of 50 with a pause after each, so that the consumer falls
    asleep between bursts again and again."""
    with Segment.attach(name) as s:
        q = queue(s)
        start.wait(60)
        for seq in range(n):
            while q.push(rec(seq, i)) is not Pushed.OK:
                os.sched_yield()
            if seq % 50 == 49:
                time.sleep(0.0005 * (1 + i))


def test_producers_never_leave_the_consumer_asleep(seg: Segment) -> None:
    """Every time the consumer finds nothing it sleeps (up to 10 s); each burst must wake
    it. A wake-up lost between its last look and its sleep would show as a timeout."""
    n = 5_000
    q = queue(seg)
    q.become_consumer()
    got: dict[int, list[int]] = {p: [] for p in range(PRODUCERS)}
    sleeps = timeouts = 0
    with Children() as kids:
        start = CTX.Barrier(PRODUCERS)
        for p in range(PRODUCERS):
            kids.start(_produce_in_bursts, p, seg.name, n, start)
        consumed = 0
        while consumed < PRODUCERS * n:
            batch, skipped = q.peek(500, now_ms=0)
            assert skipped == 0
            for r in batch.records:
                p, seq = origin(r)
                got[p].append(seq)
            q.commit(batch)
            consumed += len(batch.records)
            if not batch.records:
                sleeps += 1
                if not q.wait_for_records(10.0):
                    timeouts += 1
        kids.join()
    assert timeouts == 0
    assert sleeps > 100  # it did fall asleep between bursts, many times
    assert all(got[p] == list(range(n)) for p in range(PRODUCERS))


def _reserve_and_hang(name: str, reserved: Event) -> None:
    def pause() -> None:
        reserved.set()
        time.sleep(3600)  # until SIGKILL

    with Segment.attach(name) as s:
        settle_queue._pause_after_reserve = pause
        queue(s).push(rec(0, 9))


def _push_records(i: int, name: str, seqs: list[int]) -> list[str]:
    with Segment.attach(name) as s:
        q = queue(s)
        return [q.push(rec(seq, 1)).value for seq in seqs]


def test_a_producer_killed_after_reserving_does_not_wedge_the_queue(seg: Segment) -> None:
    reserved = CTX.Event()
    with Children() as kids:
        victim = kids.start(_reserve_and_hang, seg.name, reserved)
        assert reserved.wait(60)
        victim.kill()
        victim.join(60)
    assert queue(seg).check() is None
    assert run_children(1, _push_records, seg.name, [1, 2, 3]) == [["ok"] * 3]

    row = procs.claim(seg.view, seg.layout, procs.Role.TOOL).counters
    q = queue(seg, grace_ms=GRACE_MS)
    q.become_consumer()
    assert q.depth() == 4
    t = 50_000
    for now in (t, t + GRACE_MS - 1):  # within the grace period: wait for the producer
        batch, skipped = q.peek(10, now)
        assert (batch.records, skipped) == ([], 0)
    batch, skipped = q.peek(10, t + GRACE_MS)
    assert skipped == 1
    row.add(Counter.SETTLE_ABANDONED, skipped)
    assert batch.records == [rec(s, 1) for s in (1, 2, 3)]
    q.commit(batch)
    assert q.depth() == 0
    assert counters.totals(seg.view, seg.layout)[Counter.SETTLE_ABANDONED] == 1
    # The slot went back into the ring: the queue keeps working, laps included.
    for lap in range(2):
        for i in range(SMALL.queue_capacity):
            assert q.push(rec(i, lap)) is Pushed.OK
        assert [origin(r) for r in drain(q, t + GRACE_MS)] == [
            (lap, i) for i in range(SMALL.queue_capacity)
        ]


def test_a_producer_killed_while_copying_does_not_wedge_the_queue(seg: Segment) -> None:
    base = seg.layout.offset("queue")
    # What a producer leaves when it dies halfway through copying its record.
    seg.view.store(base + L.Q_ENQUEUE, 1)
    seg.view.store(base + L.Q_SLOTS + L.QS_SEQ, 0 | L.QS_WRITING)
    q = queue(seg, grace_ms=GRACE_MS)
    assert q.check() is None
    assert q.push(rec(1)) is Pushed.OK
    q.become_consumer()
    assert q.peek(10, 0)[0].records == []
    batch, skipped = q.peek(10, GRACE_MS)
    assert (batch.records, skipped) == ([rec(1)], 1)


def _reserve_and_wait(name: str, reserved: Event, resume: Event) -> str:
    def pause() -> None:
        reserved.set()
        assert resume.wait(60)

    with Segment.attach(name) as s:
        settle_queue._pause_after_reserve = pause
        return queue(s).push(rec(7, 5)).value


def test_a_producer_stalled_past_the_grace_period_is_told_abandoned(seg: Segment) -> None:
    reserved, resume = CTX.Event(), CTX.Event()
    q = queue(seg, grace_ms=GRACE_MS)
    q.become_consumer()
    with Children() as kids:
        kids.start(_reserve_and_wait, seg.name, reserved, resume)
        assert reserved.wait(60)
        assert q.peek(10, 0) == (q.peek(10, GRACE_MS - 1)[0], 0)
        batch, skipped = q.peek(10, GRACE_MS)
        assert (batch.records, skipped) == ([], 1)
        resume.set()
        assert kids.collect() == ["abandoned"]
        kids.join()
    # Its record is not delivered, and the queue carries on.
    assert q.push(rec(8)) is Pushed.OK
    assert drain(q, 10 * GRACE_MS) == [rec(8)]
    assert q.depth() == 0


def test_a_producer_that_resumes_within_the_grace_period_is_delivered(seg: Segment) -> None:
    reserved, resume = CTX.Event(), CTX.Event()
    q = queue(seg, grace_ms=GRACE_MS)
    q.become_consumer()
    with Children() as kids:
        kids.start(_reserve_and_wait, seg.name, reserved, resume)
        assert reserved.wait(60)
        assert q.peek(10, 0)[0].records == []
        assert q.peek(10, GRACE_MS - 1)[0].records == []
        resume.set()
        assert kids.collect() == ["ok"]
        kids.join()
    # Published before the consumer gave up on it: delivered, however late it looks now.
    batch, skipped = q.peek(10, 100 * GRACE_MS)
    assert (batch.records, skipped) == ([rec(7, 5)], 0)


# -- records that fail their check ------------------------------------------------------------


def slot_at(seg: Segment, pos: int) -> int:
    """Where the slot of position ``pos`` (its sequence word first) is in the segment."""
    slot = pos % seg.layout.params.queue_capacity
    return seg.layout.offset("queue") + L.Q_SLOTS + slot * L.QUEUE_SLOT_BYTES


def record_at(seg: Segment, pos: int) -> int:
    """Where the record of position ``pos`` starts in the segment."""
    return slot_at(seg, pos) + L.QS_RECORD


def damage(seg: Segment, at: int) -> None:
    seg.buf[at] ^= 0xFF


RECORD_BYTES = {
    "check": 0,
    "op": L.RECORD_CHECK.size,
    "key length": L.RECORD_CHECK.size + 3,  # its high byte: a length past the slot's end
    "token": L.RECORD.size - 1,
    "key": L.RECORD.size + 5,
}


@pytest.mark.parametrize("where", ["head", "middle"])
@pytest.mark.parametrize("byte", RECORD_BYTES, ids=list(RECORD_BYTES))
def test_a_damaged_record_is_skipped_and_counted(seg: Segment, byte: str, where: str) -> None:
    q = queue(seg)
    q.become_consumer()
    for i in range(3):
        assert q.push(rec(i, 1)) is Pushed.OK
    bad = 0 if where == "head" else 1
    damage(seg, record_at(seg, bad) + RECORD_BYTES[byte])
    batch, skipped = q.peek(10, now_ms=0)
    assert (batch.records, batch.corrupt, batch.corrupt_skipped, skipped) == (
        [rec(i, 1) for i in range(3) if i != bad],
        0 if where == "head" else 1,  # counted once its commit is made
        1 if where == "head" else 0,  # freed, and counted, by the peek
        0,
    )
    q.commit(batch)
    assert q.depth() == 0
    # Its slot went back into the ring with the others: a whole lap goes through.
    for i in range(SMALL.queue_capacity):
        assert q.push(rec(i, 2)) is Pushed.OK
    assert drain(q) == [rec(i, 2) for i in range(SMALL.queue_capacity)]


def test_a_damaged_record_in_a_batch_is_reported_until_the_batch_is_committed(
    seg: Segment,
) -> None:
    """So a consumer counts it after its commit, as it counts what it delivered: one
    killed before committing leaves the count to the next, which makes it once. One at
    the head is freed by the peek that reports it, and reported once."""
    q = queue(seg)
    q.become_consumer()
    for i in range(4):
        assert q.push(rec(i, 1)) is Pushed.OK
    damage(seg, record_at(seg, 0))
    damage(seg, record_at(seg, 2))
    first, _ = q.peek(10, now_ms=0)
    again, _ = queue(seg).peek(10, now_ms=0)  # as the next consumer would, uncommitted
    assert (first.corrupt_skipped, again.corrupt_skipped) == (1, 0)
    assert (first.corrupt, again.corrupt) == (1, 1)
    assert first.records == again.records == [rec(1, 1), rec(3, 1)]
    q.commit(again)
    batch, _ = q.peek(10, now_ms=0)
    assert (batch.records, batch.corrupt, batch.corrupt_skipped, q.depth()) == ([], 0, 0, 0)


def test_a_record_from_the_last_lap_is_not_read_as_this_laps(seg_name: str) -> None:
    with tiny_ring(seg_name) as seg:
        q = queue(seg)
        q.become_consumer()
        cap = seg.layout.params.queue_capacity
        assert q.push(rec(0, 1)) is Pushed.OK
        at = record_at(seg, 0)
        first = bytes(seg.buf[at : at + L.QUEUE_SLOT_BYTES - L.QS_RECORD])  # its whole record
        assert drain(q) == [rec(0, 1)]
        for i in range(cap):  # a lap: position ``cap`` is the first record's slot again
            assert q.push(rec(i, 2)) is Pushed.OK
        at = record_at(seg, cap)
        seg.buf[at : at + len(first)] = first  # the last lap's record, whole
        batch, _ = q.peek(2 * cap, now_ms=0)
        assert (batch.records, batch.corrupt) == ([rec(i, 2) for i in range(cap - 1)], 1)
        q.commit(batch)
        for i in range(cap):  # another lap: position ``2 * cap`` is that slot again
            assert q.push(rec(i, 3)) is Pushed.OK
        at = record_at(seg, 2 * cap)
        seg.buf[at : at + len(first) // 2] = first[: len(first) // 2]  # torn halfway
        batch, _ = q.peek(2 * cap, now_ms=0)
        assert (batch.records, batch.corrupt) == ([rec(i, 3) for i in range(cap - 1)], 1)


def _freeze_while_writing(name: str) -> str:
    def freeze() -> None:
        os.kill(os.getpid(), signal.SIGSTOP)

    with Segment.attach(name) as s:
        settle_queue._pause_while_writing = freeze
        return queue(s).push(rec(7, 5)).value


def test_a_producer_frozen_mid_copy_for_a_lap_never_gets_its_record_delivered(
    seg_name: str,
) -> None:
    """SIGSTOP between marking its slot written and copying, given up on, the ring lapped
    over its slot, then SIGCONT: its copy lands on the newer record, which is lost and
    counted -- never delivered as the stale one or a mix of the two."""
    with tiny_ring(seg_name) as seg:
        q = queue(seg, grace_ms=GRACE_MS)
        q.become_consumer()
        cap = seg.layout.params.queue_capacity
        with Children() as kids:
            pid = kids.start(_freeze_while_writing, seg.name).pid
            assert pid is not None
            deadline = time.monotonic() + 60
            while state_of(pid) != "T":
                assert time.monotonic() < deadline
                time.sleep(0.01)
            assert q.peek(10, 0)[0].records == []
            batch, skipped = q.peek(10, GRACE_MS)
            assert (batch.records, skipped) == ([], 1)
            for i in range(1, cap + 1):  # position ``cap`` reuses the frozen one's slot
                assert q.push(rec(i, 1)) is Pushed.OK
            os.kill(pid, signal.SIGCONT)
            assert kids.collect() == ["abandoned"]
            kids.join()
        batch, skipped = q.peek(2 * cap, 2 * GRACE_MS)
        assert (batch.records, batch.corrupt, skipped) == ([rec(i, 1) for i in range(1, cap)], 1, 0)


# -- consumers killed at any instruction ------------------------------------------------------


def tiny_ring(seg_name: str, capacity: int = 8) -> Segment:
    params = segmod.make_params(queue_capacity=capacity, gcra_slots=16, process_slots=8)
    return Segment.create(seg_name, params)


def _commit_and_die(name: str, die_at: int) -> None:
    kill_loop.die_in_commit(die_at)
    with Segment.attach(name) as s:
        q = queue(s)
        q.become_consumer()
        q.commit(q.peek(100, now_ms=0)[0])


@pytest.mark.parametrize("die_at", [0, 1, 5, 7])
def test_a_consumer_killed_inside_commit_loses_nothing(seg_name: str, die_at: int) -> None:
    """SIGKILLed inside commit after freeing ``die_at`` of its 8 slots: the ring never
    lends more than its capacity, and the next consumer goes on at once -- no grace
    period, nothing skipped, nothing of the next lap erased."""
    cap = 8
    with tiny_ring(seg_name, cap) as s:
        q = queue(s, grace_ms=GRACE_MS)
        assert [q.push(rec(i)) for i in range(cap)] == [Pushed.OK] * cap
        with Children() as kids:
            kids.start(_commit_and_die, s.name, die_at).join(60)
            assert kids.procs[0].exitcode == -signal.SIGKILL
        assert q.check() is None  # a state the queue's own code leaves: not damage
        pushed = [q.push(rec(cap + i)) for i in range(cap)]
        told_ok = [rec(cap + i) for i, p in enumerate(pushed) if p is Pushed.OK]
        assert q.depth() <= cap
        q.become_consumer()
        got = drain(q)  # the clock stands still: no grace period passes, and none is needed
        assert [r for r in got if r in told_ok] == told_ok
        assert not set(got) - set(told_ok) - {rec(i) for i in range(cap)}  # or redelivered
        assert [q.push(rec(2 * cap + i)) for i in range(cap)] == [Pushed.OK] * cap
        assert q.depth() == cap
        assert drain(q) == [rec(2 * cap + i) for i in range(cap)]


@pytest.mark.parametrize("head_moved", [False, True], ids=["marked", "head-moved"])
def test_a_consumer_killed_while_abandoning_a_slot_is_finished_by_the_next(
    seg_name: str, head_moved: bool
) -> None:
    """What a consumer leaves when killed inside an abandonment: the slot marked but the
    head not moved past it, or the head moved but the slot not yet freed. The successor
    finishes either at once, counts the slot once (only if the head had not moved: that
    consumer never returned its count), and the ring lends no slot before it is freed."""
    cap = 8
    with tiny_ring(seg_name, cap) as s:
        base = s.layout.offset("queue")
        q = queue(s, grace_ms=GRACE_MS)
        assert [q.push(rec(i)) for i in range(2)] == [Pushed.OK] * 2
        s.view.store(base + L.Q_SLOTS, 0 | L.QS_ABANDONED)
        if head_moved:
            s.view.store(base + L.Q_DEQUEUE, 1)
        assert q.check() is None
        pushed = [q.push(rec(2 + i)) for i in range(cap)]
        assert pushed == [Pushed.OK] * 6 + [Pushed.FULL] * 2  # slot 0 is not free yet
        q.become_consumer()
        batch, skipped = q.peek(100, now_ms=0)
        assert (batch.records, skipped) == ([rec(i) for i in range(1, 8)], 0 if head_moved else 1)
        q.commit(batch)
        assert [q.push(rec(8 + i)) for i in range(cap + 1)] == [Pushed.OK] * cap + [Pushed.FULL]
        assert drain(q) == [rec(8 + i) for i in range(cap)]


def test_consumers_killed_at_random_lose_nothing(seg_name: str) -> None:
    params = segmod.make_params(queue_capacity=256, gcra_slots=16, process_slots=8)
    with Segment.create(seg_name, params) as s:
        t = kill_loop.run(s, KILLS)
    figures = t.figures()
    assert t.kills == KILLS and t.told_ok > KILLS, figures
    assert t.killed_in_commit == len(range(0, KILLS, 3)), figures
    assert (t.lost, t.phantom, t.corrupt) == (0, 0, 0), figures
    assert (t.depth_over_capacity, t.damaged) == (0, 0), figures
    assert (t.abandoned, t.told_abandoned) == (0, 0), figures  # no producer died or stalled


def test_producers_killed_mid_push_are_the_only_abandoned(seg_name: str) -> None:
    params = segmod.make_params(queue_capacity=256, gcra_slots=16, process_slots=8)
    with Segment.create(seg_name, params) as s:
        t = kill_loop.run(s, kills=30, victims=3, grace_ms=GRACE_MS, seed=7)
    figures = t.figures()
    assert t.victims == 3, figures
    assert (t.lost, t.phantom, t.corrupt, t.depth_over_capacity) == (0, 0, 0, 0), figures
    assert t.damaged == 0, figures
    # A producer stalled past the grace period is told so; nothing else is abandoned.
    assert t.abandoned == t.victims + t.told_abandoned, figures


# -- a ring damaged from outside ---------------------------------------------------------------


def _wrapped_ring_with(s: Segment, published: int) -> SettleQueue:
    """A ring of 8 that has gone round a few laps, ``published`` records waiting in it:
    positions 21 .. 21 + published - 1, across a wrap."""
    q = queue(s)
    q.become_consumer()
    for i in range(21):
        assert q.push(rec(1000 + i)) is Pushed.OK
        drain(q)
    assert [q.push(rec(i)) for i in range(published)] == [Pushed.OK] * published
    return q


@pytest.mark.parametrize(
    ("enqueue", "dequeue"),
    [(21 + 8 + 1, 21), (20, 21), (2**62, 21), (21, 2**40)],
    ids=["over-capacity", "head-past-tail", "huge-tail", "huge-head"],
)
def test_positions_no_ring_can_have_are_damage_and_rebuilding_keeps_every_record(
    seg_name: str, enqueue: int, dequeue: int
) -> None:
    with tiny_ring(seg_name) as s:
        q = _wrapped_ring_with(s, 5)
        assert q.check() is None
        base = s.layout.offset("queue")
        s.view.store(base + L.Q_ENQUEUE, enqueue)
        s.view.store(base + L.Q_DEQUEUE, dequeue)
        found = q.check()
        assert found is not None and "position" in found
        assert q.rebuild() == (5, 0)
        assert q.check() is None
        assert q.depth() == 5
        assert drain(q) == [rec(i) for i in range(5)]  # in their order, across the wrap
        for lap in range(3):  # and the ring works on, lap after lap
            assert [q.push(rec(i, lap)) for i in range(8)] == [Pushed.OK] * 8
            assert q.push(rec(8, lap)) is Pushed.FULL
            assert drain(q) == [rec(i, lap) for i in range(8)]


@pytest.mark.parametrize("slot", ["free", "published"])
def test_a_slot_word_no_state_reads_as_is_damage_and_only_its_record_is_lost(
    seg_name: str, slot: str
) -> None:
    with tiny_ring(seg_name) as s:
        q = _wrapped_ring_with(s, 5)
        pos = 21 + 7 if slot == "free" else 21 + 2
        s.view.store(slot_at(s, pos), 0x5EED_F00D_0BAD_CAFE)
        found = q.check()
        assert found is not None and f"slot {pos % 8} " in found
        kept = [rec(i) for i in range(5) if slot == "free" or i != 2]
        assert q.rebuild() == (len(kept), 1)
        assert q.check() is None
        assert drain(q) == kept


def test_a_record_that_fails_its_check_is_not_rebuilt(seg_name: str) -> None:
    with tiny_ring(seg_name) as s:
        q = _wrapped_ring_with(s, 3)
        damage(s, record_at(s, 21 + 1) + L.RECORD.size)  # a byte of its key
        s.view.store(s.layout.offset("queue") + L.Q_ENQUEUE, 2**50)
        assert q.check() is not None
        assert q.rebuild() == (2, 1)
        assert drain(q) == [rec(0), rec(2)]


# -- limits -------------------------------------------------------------------------------------


def test_a_ring_of_one_slot_is_refused(seg_name: str) -> None:
    """With one slot, "published" (pos + 1) and "free on the next lap" (pos + capacity)
    are the same sequence number: every push would overwrite the unread record."""
    with pytest.raises(ValueError, match="queue_capacity=1 is below 2"):
        L.Layout.of(L.Params(counters=1, statuses=1, histogram_words=1, queue_capacity=1))
    with pytest.raises(ValueError, match="queue_capacity=1 is below 2"):
        Segment.create(seg_name, segmod.make_params(queue_capacity=1))
    with tiny_ring(seg_name, 2) as s:  # two slots are a ring
        q = queue(s)
        q.become_consumer()
        for lap in range(3):
            assert [q.push(rec(i, lap)) for i in range(3)] == [Pushed.OK] * 2 + [Pushed.FULL]
            assert drain(q) == [rec(0, lap), rec(1, lap)]


def _config(prefix: str, source: str, tenant: str) -> config.Config:
    raw = {"fleet": {"key_prefix": prefix}, "sources": [{"id": source, "tenant": tenant}]}
    return config.parse(raw, "limits.toml")


def test_the_largest_record_a_valid_config_allows_round_trips(seg: Segment) -> None:
    name = "n" * L.MAX_NAME
    cfg = _config(name, name, name)
    for bad in (name + "n", name + "\n"):  # one character longer is refused, each name
        for names, setting in [((bad, name, name), "key_prefix"), ((name, bad, name), "id")]:
            with pytest.raises(config.ConfigError, match=setting):
                _config(*names)
        with pytest.raises(config.ConfigError, match="tenant"):
            _config(name, name, bad)
    source = cfg.sources[0]
    store = RedisStore.from_config(cfg.fleet)
    key = store.dedupe_key(source.tenant, source.id, b"e" * L.MAX_EVENT_KEY)
    assert len(key) == L.MAX_DEDUPE_KEY
    assert len(store.dedupe_key(source.tenant, source.id, b"e" * 10_000)) < L.MAX_DEDUPE_KEY
    biggest = Record(Op.PROMOTE, key, os.urandom(16), b"h" * L.MAX_HOOK_ID, 1, 2, 3)
    q = queue(seg)
    assert q.push(biggest) is Pushed.OK
    q.become_consumer()
    assert q.peek(1, now_ms=0)[0].records == [biggest]
