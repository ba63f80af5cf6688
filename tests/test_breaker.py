"""The shared circuit breaker: window, opening, one probe, take-overs, transition counts.

Time is injected (``now_ms``); nothing here waits on a real clock.
"""

from __future__ import annotations

import os
import random
import time
from multiprocessing.synchronize import Barrier

import pytest
from proc_helpers import CTX, claimed_row, dead_pid, live_pid, run_children, zombie

from ankusa_shm.clock import monotonic_ms
from ankusa_shm.shm import breaker, counters, procs
from ankusa_shm.shm import layout as L
from ankusa_shm.shm.breaker import Breaker, Policy, State
from ankusa_shm.shm.counters import Counter, CounterRow
from ankusa_shm.shm.segment import Segment

POLICY = Policy(
    failure_rate=0.5, min_calls=10, window_ms=10_000, open_ms=5_000, probe_timeout_ms=1_000
)
BUCKET_MS = -(-POLICY.window_ms // L.BREAKER_BUCKETS)  # the window's granularity
T0 = 1_000_000  # any monotonic ms; the breaker never reads a clock of its own
RACERS = 6

TRANSITIONS = (Counter.BREAKER_TO_OPEN, Counter.BREAKER_TO_PROBING, Counter.BREAKER_TO_CLOSED)


def _breaker(seg: Segment, slot: int = 0) -> tuple[Breaker, CounterRow]:
    row = claimed_row(seg, slot)
    return Breaker(seg.view, seg.layout, POLICY, row), row


def _transitions(seg: Segment) -> tuple[int, ...]:
    t = counters.totals(seg.view, seg.layout)
    return tuple(t[c] for c in TRANSITIONS)


def _state_word_offset(seg: Segment) -> int:
    return seg.layout.offset("breaker") + L.BR_STATE


def _open(b: Breaker, at: int) -> None:
    for _ in range(POLICY.min_calls):
        b.record(False, at)
    assert b.state() == State.OPEN


def test_fresh_breaker_is_closed_and_allows(seg: Segment) -> None:
    b, _ = _breaker(seg)
    assert b.state() == State.CLOSED
    assert b.allow(T0) == breaker.CALL
    assert b.window(T0) == (0, 0)


def test_pack_unpack() -> None:
    w = breaker.pack(State.PROBING, (1 << L.PID_BITS) - 1, T0)
    assert breaker.unpack(w) == (State.PROBING, (1 << L.PID_BITS) - 1, T0)
    assert w > 0  # a non-negative int64


def test_does_not_open_below_min_calls(seg: Segment) -> None:
    b, _ = _breaker(seg)
    for i in range(POLICY.min_calls - 1):
        b.record(False, T0 + i)
    assert b.window(T0 + 10) == (9, 9)
    assert b.state() == State.CLOSED
    assert b.allow(T0 + 10).call


def test_opens_at_min_calls_when_the_failed_share_reaches_the_rate(seg: Segment) -> None:
    b, _ = _breaker(seg)
    for _ in range(5):
        b.record(True, T0)
    for _ in range(4):
        b.record(False, T0)
    assert b.state() == State.CLOSED  # 9 calls: below min_calls
    b.record(False, T0 + 1)  # 10 calls, 5 failed: exactly the rate
    assert b.state() == State.OPEN
    state, owner, since = breaker.unpack(b.word())
    assert (state, owner, since) == (State.OPEN, 0, T0 + 1)
    assert _transitions(seg) == (1, 0, 0)


def test_does_not_open_below_the_rate(seg: Segment) -> None:
    b, _ = _breaker(seg)
    for _ in range(6):
        b.record(True, T0)
    for _ in range(4):
        b.record(False, T0)  # 10 calls, 40% failed
    assert b.state() == State.CLOSED
    for _ in range(50):
        b.record(True, T0)
    for i in range(29):
        b.record(False, T0)
        if i % 9 == 8:
            b.record(True, T0)  # so that no run of failures reaches min_calls
    assert b.window(T0) == (92, 33)  # still below half
    assert b.state() == State.CLOSED
    assert _transitions(seg) == (0, 0, 0)


def test_failures_outside_the_window_do_not_count(seg: Segment) -> None:
    b, _ = _breaker(seg)
    for _ in range(9):
        b.record(False, T0)
    # One bucket past the window: the nine old failures have left it.
    later = T0 + POLICY.window_ms + BUCKET_MS
    assert b.window(later) == (0, 0)
    b.record(False, later)
    assert b.window(later) == (1, 1)
    assert b.state() == State.CLOSED


def test_min_calls_failures_in_a_row_open_whatever_the_window_holds(seg: Segment) -> None:
    """Redis stops while the window is full of successes: a run of min_calls failures
    opens at once instead of after half a window; a success in between resets the run."""
    b, _ = _breaker(seg)
    for _ in range(1_000):
        b.record(True, T0)
    for _ in range(POLICY.min_calls - 1):
        b.record(False, T0 + 1)
    b.record(True, T0 + 1)
    for _ in range(POLICY.min_calls - 1):
        b.record(False, T0 + 2)
    assert b.state() == State.CLOSED  # two runs of min_calls - 1, not one of min_calls
    b.record(False, T0 + 2)
    assert b.state() == State.OPEN
    assert _transitions(seg) == (1, 0, 0)


def test_failures_inside_the_window_count(seg: Segment) -> None:
    b, _ = _breaker(seg)
    for _ in range(9):
        b.record(False, T0)
    # Still inside the window (less its one-bucket granularity): they all count.
    later = T0 + POLICY.window_ms - BUCKET_MS
    assert b.window(later) == (9, 9)
    b.record(False, later)
    assert b.state() == State.OPEN


def test_open_denies_until_open_ms_then_exactly_one_probe(seg: Segment) -> None:
    b, _ = _breaker(seg)
    _open(b, T0)
    for t in (T0, T0 + 1, T0 + POLICY.open_ms - 1):
        assert b.allow(t) == breaker.DENY
    permit = b.allow(T0 + POLICY.open_ms)
    assert permit.call and permit.probe
    assert b.word() == permit.word
    assert breaker.unpack(permit.word) == (State.PROBING, os.getpid(), T0 + POLICY.open_ms)
    # Everyone else -- another breaker object, this process again -- stays node-local.
    other, _ = _breaker(seg, 1)
    assert other.allow(T0 + POLICY.open_ms) == breaker.DENY
    assert b.allow(T0 + POLICY.open_ms + 1) == breaker.DENY
    assert _transitions(seg) == (1, 1, 0)


def test_probe_success_closes_and_clears_the_window(seg: Segment) -> None:
    b, _ = _breaker(seg)
    _open(b, T0)
    permit = b.allow(T0 + POLICY.open_ms)
    b.finish_probe(permit, True, T0 + POLICY.open_ms + 3)
    assert b.state() == State.CLOSED
    assert b.window(T0 + POLICY.open_ms + 3) == (0, 0)
    assert b.allow(T0 + POLICY.open_ms + 4) == breaker.CALL
    assert _transitions(seg) == (1, 1, 1)
    b.record(False, T0 + POLICY.open_ms + 5)  # a fresh start: one failure does not reopen
    assert b.state() == State.CLOSED


def test_probe_failure_reopens_with_a_new_since(seg: Segment) -> None:
    b, _ = _breaker(seg)
    _open(b, T0)
    t1 = T0 + POLICY.open_ms
    b.finish_probe(b.allow(t1), False, t1 + 7)
    assert breaker.unpack(b.word()) == (State.OPEN, 0, t1 + 7)
    assert b.allow(t1 + 7 + POLICY.open_ms - 1) == breaker.DENY
    permit = b.allow(t1 + 7 + POLICY.open_ms)
    assert permit.probe
    b.finish_probe(permit, True, t1 + 7 + POLICY.open_ms)
    assert b.state() == State.CLOSED
    assert _transitions(seg) == (2, 2, 1)


def test_finish_probe_needs_a_probe_permit(seg: Segment) -> None:
    b, _ = _breaker(seg)
    with pytest.raises(ValueError):
        b.finish_probe(breaker.CALL, True, T0)


def test_a_dead_probers_probe_is_taken_over(seg: Segment) -> None:
    b, _ = _breaker(seg)
    seg.view.store(_state_word_offset(seg), breaker.pack(State.PROBING, dead_pid(), T0))
    permit = b.allow(T0 + 1)  # well within probe_timeout_ms: only the death lets it in
    assert permit.probe
    assert breaker.unpack(b.word())[1] == os.getpid()
    assert b.allow(T0 + 2) == breaker.DENY  # and now it is ours: one probe at a time
    b.finish_probe(permit, True, T0 + 3)
    assert b.state() == State.CLOSED


def test_a_live_but_overrun_probe_is_taken_over(seg: Segment) -> None:
    b, _ = _breaker(seg)
    with live_pid() as pid:
        seg.view.store(_state_word_offset(seg), breaker.pack(State.PROBING, pid, T0))
        assert b.allow(T0 + POLICY.probe_timeout_ms - 1) == breaker.DENY
        permit = b.allow(T0 + POLICY.probe_timeout_ms)
        assert permit.probe
        assert breaker.unpack(b.word()) == (
            State.PROBING,
            os.getpid(),
            T0 + POLICY.probe_timeout_ms,
        )


def test_a_late_finish_from_a_taken_over_probe_changes_nothing(seg: Segment) -> None:
    first, _ = _breaker(seg, 0)
    second, _ = _breaker(seg, 1)
    _open(first, T0)
    t = T0 + POLICY.open_ms
    stale = first.allow(t)
    assert stale.probe
    taken = second.allow(t + POLICY.probe_timeout_ms)  # the first probe overran
    assert taken.probe and taken.word != stale.word
    transitions = _transitions(seg)

    for ok in (True, False):
        first.finish_probe(stale, ok, t + POLICY.probe_timeout_ms + 1)
        assert first.word() == taken.word
    assert _transitions(seg) == transitions

    # The one live probe still decides; and after it a stale finish cannot touch the
    # new window either.
    second.finish_probe(taken, True, t + POLICY.probe_timeout_ms + 2)
    assert second.state() == State.CLOSED
    second.record(False, t + POLICY.probe_timeout_ms + 3)
    first.finish_probe(stale, True, t + POLICY.probe_timeout_ms + 4)
    first.finish_probe(stale, False, t + POLICY.probe_timeout_ms + 4)
    assert second.state() == State.CLOSED
    assert second.window(t + POLICY.probe_timeout_ms + 4) == (1, 1)


def test_a_failure_racing_a_successful_probe_sees_a_clean_window(seg: Segment) -> None:
    """Another worker's failure landing just as the probe closes the breaker must be
    judged against the new, empty window, not the one that opened the breaker."""
    prober, _ = _breaker(seg, 0)
    other, _ = _breaker(seg, 1)
    _open(prober, T0)
    t = T0 + POLICY.open_ms
    permit = prober.allow(t)
    clear = prober.clear_window

    def failure_meanwhile() -> None:
        other.record(False, t + 1)  # in the middle of finish_probe
        clear()

    prober.clear_window = failure_meanwhile  # type: ignore[method-assign]
    prober.finish_probe(permit, True, t + 1)
    assert prober.state() == State.CLOSED
    assert _transitions(seg) == (1, 1, 1)


def test_transitions_counted_once_per_transition(seg: Segment) -> None:
    b, row = _breaker(seg)
    t = T0
    for cycle in range(3):
        _open(b, t)
        t += POLICY.open_ms
        b.finish_probe(b.allow(t), cycle == 2, t)
        if cycle < 2:
            t += POLICY.open_ms
            b.finish_probe(b.allow(t), True, t)
        t += 1
    # cycle 0 and 1: open, probe, reopen, probe, close; cycle 2: open, probe, close.
    assert _transitions(seg) == (5, 5, 3)
    assert row.get(Counter.BREAKER_TO_OPEN) == 5
    assert Breaker(seg.view, seg.layout, POLICY).allow(t).call  # without a row: no counts


def _probe_race(i: int, name: str, now: int, start: Barrier, done: Barrier) -> bool:
    with Segment.attach(name) as s:
        slot = procs.claim(s.view, s.layout, procs.Role.WORKER)
        b = Breaker(s.view, s.layout, POLICY, slot.counters)
        start.wait(60)
        probe = b.allow(now).probe
        done.wait(60)  # the winner stays alive until all have asked: a dead one is taken over
        return probe


def test_racing_processes_get_exactly_one_probe(seg: Segment) -> None:
    b, _ = _breaker(seg)
    _open(b, T0)
    now = T0 + POLICY.open_ms
    barriers = CTX.Barrier(RACERS), CTX.Barrier(RACERS)
    probes = run_children(RACERS, _probe_race, seg.name, now, *barriers)
    assert sorted(probes) == [False] * (RACERS - 1) + [True]
    assert _transitions(seg) == (1, 1, 0)


def _failure_race(i: int, name: str, now: int, start: Barrier) -> State:
    with Segment.attach(name) as s:
        slot = procs.claim(s.view, s.layout, procs.Role.WORKER)
        b = Breaker(s.view, s.layout, POLICY, slot.counters)
        start.wait(60)
        for _ in range(20):
            b.record(False, now)
        return b.state()


def test_racing_failures_open_it_exactly_once(seg: Segment) -> None:
    b, _ = _breaker(seg)
    for _ in range(POLICY.min_calls - 1):
        b.record(False, T0)
    states = run_children(RACERS, _failure_race, seg.name, T0, CTX.Barrier(RACERS))
    assert states == [State.OPEN] * RACERS
    assert _transitions(seg) == (1, 0, 0)
    assert b.window(T0) == (POLICY.min_calls - 1 + 20 * RACERS,) * 2


def test_a_clock_reading_older_than_the_state_word_is_no_time_elapsed(seg: Segment) -> None:
    """A caller that read the clock just before another process swapped the word sees a
    ``since`` ahead of its ``now``: that is no time at all, not a wrapped eternity."""
    b, _ = _breaker(seg)
    _open(b, T0)
    for behind in (1, 50, POLICY.open_ms):
        assert b.allow(T0 - behind) == breaker.DENY  # no early probe
    with live_pid() as pid:
        seg.view.store(_state_word_offset(seg), breaker.pack(State.PROBING, pid, T0))
        for behind in (1, 50, POLICY.probe_timeout_ms):
            assert b.allow(T0 - behind) == breaker.DENY  # a live probe is not taken over
        assert b.allow(T0 + POLICY.probe_timeout_ms).probe  # but an overrun one is


def test_a_zombie_probe_is_taken_over(seg: Segment) -> None:
    b, _ = _breaker(seg)
    _open(b, T0)
    t = T0 + POLICY.open_ms

    def take_probe_and_exit() -> None:
        with Segment.attach(seg.name) as s:
            assert Breaker(s.view, s.layout, POLICY).allow(t).probe

    with zombie(take_probe_and_exit) as pid:
        assert breaker.unpack(b.word())[:2] == (State.PROBING, pid)
        permit = b.allow(t + 1)  # well within probe_timeout_ms: only the death lets it in
        assert permit.probe
        assert breaker.unpack(b.word())[1] == os.getpid()


def test_successes_that_bring_enough_failures_to_min_calls_open_it(seg: Segment) -> None:
    policy = Policy(0.5, min_calls=20, window_ms=10_000, open_ms=5_000, probe_timeout_ms=1_000)
    b = Breaker(seg.view, seg.layout, policy)
    for i in range(10):
        b.record(False, T0 + i)
    for i in range(9):
        b.record(True, T0 + 10 + i)
    assert b.state() == State.CLOSED  # 19 calls: below min_calls
    b.record(True, T0 + 20)  # 20 calls, 10 failed: exactly the rate
    assert b.state() == State.OPEN
    assert breaker.unpack(b.word()) == (State.OPEN, 0, T0 + 20)


def test_successes_do_not_open_it_below_the_rate(seg: Segment) -> None:
    policy = Policy(0.5, min_calls=20, window_ms=10_000, open_ms=5_000, probe_timeout_ms=1_000)
    b = Breaker(seg.view, seg.layout, policy)
    for i in range(9):
        b.record(False, T0 + i)
    for i in range(40):
        b.record(True, T0 + 10 + i)
    assert b.window(T0 + 50) == (49, 9)
    assert b.state() == State.CLOSED
    # Once min_calls was reached without opening, further successes only dilute.
    for _ in range(10):
        b.record(False, T0 + 60)
    assert b.window(T0 + 60) == (59, 19)
    assert b.state() == State.CLOSED


def test_a_bucket_newer_than_now_is_in_the_window(seg: Segment) -> None:
    """Another process with a later clock reading has started the next bucket: a caller
    whose reading is a bucket behind still counts it."""
    b, _ = _breaker(seg)
    for _ in range(POLICY.min_calls - 1):
        b.record(False, T0 + BUCKET_MS)
    assert b.window(T0) == (POLICY.min_calls - 1,) * 2
    b.record(False, T0)
    assert b.state() == State.OPEN


RACE = Policy(0.5, min_calls=10, window_ms=10_000, open_ms=4, probe_timeout_ms=600_000)
RACE_PERIODS = 300
GRANT, REOPEN = 0, 1  # sort order within one millisecond: a probe's reopen follows it


def _probe_loop(i: int, name: str, n: int, start: Barrier) -> list[tuple[int, int]]:
    """Ask for the probe as fast as possible; fail every probe at once (a new open
    period). Sometimes yield between reading the clock and asking, as a preempted worker
    does. Returns (ms, GRANT | REOPEN) events."""
    rng = random.Random(i)
    events: list[tuple[int, int]] = []
    with Segment.attach(name) as s:
        slot = procs.claim(s.view, s.layout, procs.Role.WORKER)
        b = Breaker(s.view, s.layout, RACE, slot.counters)
        start.wait(60)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            now = monotonic_ms()
            if rng.random() < 0.5:
                os.sched_yield()
            permit = b.allow(now)
            if not permit.probe:
                continue
            events.append((now, GRANT))
            done = monotonic_ms()
            if b.finish_probe(permit, False, done):
                events.append((done, REOPEN))
            if counters.totals(s.view, s.layout)[Counter.BREAKER_TO_PROBING] >= n:
                break
    return events


def test_racing_processes_get_one_probe_per_open_period_never_early(seg: Segment) -> None:
    b = Breaker(seg.view, seg.layout, RACE)
    t0 = monotonic_ms()
    for _ in range(RACE.min_calls):
        b.record(False, t0)
    assert b.state() == State.OPEN
    n = 4
    got = run_children(n, _probe_loop, seg.name, RACE_PERIODS, CTX.Barrier(n))
    events = sorted([(t0, REOPEN)] + [e for child in got for e in child])
    # Open periods, each from a reopen to the next: exactly one probe each, and not
    # before open_ms has passed.
    probes_per_period: list[int] = []
    early = 0
    opened = t0
    for t, kind in events:
        if kind == REOPEN:
            probes_per_period.append(0)
            opened = t
        else:
            probes_per_period[-1] += 1
            early += t - opened < RACE.open_ms
    assert len(probes_per_period) >= RACE_PERIODS // 2
    extra = [p for p in probes_per_period[:-1] if p != 1]
    assert (extra, early) == ([], 0), f"{len(extra)} periods without one probe, {early} early"
    assert probes_per_period[-1] in (0, 1)
