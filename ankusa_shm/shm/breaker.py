"""The fleet store's circuit breaker, shared by every process through the segment.

closed   calls are made; each outcome lands in a 32-bucket sliding window. When at least
         ``min_calls`` calls fell in the last ``window_ms`` and the failed share reached
         ``failure_rate`` -- or ``min_calls`` calls in a row failed, whatever the window
         holds -- the first process to notice swaps the state word to open. The run
         matters when Redis stops: a window full of the last seconds' successes would
         keep it closed for about half a window, and meanwhile every reconnect makes its
         callers wait out their budget.
open     no calls at all for ``open_ms``; then exactly one process wins the swap to
         probing and makes the probe call.
probing  everyone else stays node-local. The probe's success closes the breaker and
         clears the window; its failure re-opens it. A probe whose process died, or that
         has run past ``probe_timeout_ms``, is taken over by the next caller.

Every transition is one compare-and-swap on one word holding state, owner pid and the
time it was entered, so two processes can never both believe they won. The window has the
resolution of one bucket (window_ms / 32); a bucket that has counted 65 535 calls stops
sampling, which keeps the failed share it saw (that is 210 000 calls a second per host
with the default 10 s window).

Clocks race. A process reads the clock, is preempted, and meanwhile another one swaps the
state word or starts a new bucket with a later reading; the stored times are kept modulo
a power of two, so the first process's ``now - since`` is negative, and masked it would
be huge -- a probe granted at once, a live probe taken over, the newest bucket taken for
one that left the window. A time older than the one stored is therefore zero elapsed,
and a bucket newer than ``now`` is in the window.

Opening is judged after every failure, and after a success only while it could matter:
once calls reach ``min_calls``, a success only lowers the failed share, so what a success
can do is bring the count up to ``min_calls`` with failures enough already counted. A
failure that finds exactly that (too few calls, failures enough) sets the re-check word;
successes scan the window only while it is set. The hot path stays one bucket update and
one load.
"""

from __future__ import annotations

import enum
import os
from dataclasses import dataclass

from ankusa_shm._atomics import BREAKER_FORMAT, AtomicView
from ankusa_shm.shm import layout as L
from ankusa_shm.shm.counters import Counter, CounterRow
from ankusa_shm.shm.pids import pid_alive

_SINCE_HALF = (L.BR_SINCE_MASK + 1) >> 1
_EPOCH_HALF = (L.BK_EPOCH_MASK + 1) >> 1

_FORMAT = (L.BK_VALID, L.BK_EPOCH_SHIFT, L.BK_EPOCH_MASK, L.BK_FAIL_SHIFT, L.BK_COUNT_MASK)
if BREAKER_FORMAT != _FORMAT:
    raise ImportError(f"_atomics breaker format {BREAKER_FORMAT} is not layout.py's {_FORMAT}")


class State(enum.IntEnum):
    CLOSED = 0
    OPEN = 1
    PROBING = 2


@dataclass(frozen=True)
class Policy:
    failure_rate: float
    min_calls: int
    window_ms: int
    open_ms: int
    probe_timeout_ms: int


@dataclass(frozen=True)
class Permit:
    """What ``allow`` decided. A probe permit carries the state word it installed, so only
    that probe can finish it."""

    call: bool
    probe: bool = False
    word: int = 0


DENY = Permit(call=False)
CALL = Permit(call=True)

_TRANSITION = {
    State.OPEN: Counter.BREAKER_TO_OPEN,
    State.PROBING: Counter.BREAKER_TO_PROBING,
    State.CLOSED: Counter.BREAKER_TO_CLOSED,
}


def pack(state: State, pid: int, since_ms: int) -> int:
    return (int(state) << L.BR_STATE_SHIFT) | (pid << L.BR_PID_SHIFT) | (since_ms & L.BR_SINCE_MASK)


def unpack(word: int) -> tuple[State, int, int]:
    return (
        State(word >> L.BR_STATE_SHIFT),
        (word >> L.BR_PID_SHIFT) & L.PID_MASK,
        word & L.BR_SINCE_MASK,
    )


class Breaker:
    def __init__(
        self, view: AtomicView, lay: L.Layout, policy: Policy, row: CounterRow | None = None
    ) -> None:
        self._view = view
        self._state = lay.offset("breaker") + L.BR_STATE
        self._recheck = lay.offset("breaker") + L.BR_RECHECK_UNTIL_MS
        self._run = lay.offset("breaker") + L.BR_FAILURE_RUN
        self._buckets = lay.offset("breaker") + L.BR_BUCKETS
        self._policy = policy
        self._width = max(1, -(-policy.window_ms // L.BREAKER_BUCKETS))
        self._row = row
        self._pid = os.getpid()

    def state(self) -> State:
        return State(self._view.load(self._state) >> L.BR_STATE_SHIFT)

    def closed(self) -> bool:
        """``state() is State.CLOSED``, without building an enum member: every call asks."""
        return self._view.load(self._state) >> L.BR_STATE_SHIFT == State.CLOSED

    def word(self) -> int:
        return self._view.load(self._state)

    def allow(self, now_ms: int) -> Permit:
        """May this caller use the store now, and is its call the probe?"""
        w = self._view.load(self._state)
        state = w >> L.BR_STATE_SHIFT
        if state == State.CLOSED:
            return CALL
        elapsed = (now_ms - (w & L.BR_SINCE_MASK)) & L.BR_SINCE_MASK
        if elapsed >= _SINCE_HALF:
            elapsed = 0  # our clock reading predates the swap that wrote ``since``
        if state == State.OPEN:
            if elapsed < self._policy.open_ms:
                return DENY
        else:
            owner = (w >> L.BR_PID_SHIFT) & L.PID_MASK
            if elapsed < self._policy.probe_timeout_ms and (owner == self._pid or pid_alive(owner)):
                return DENY
        new = pack(State.PROBING, self._pid, now_ms)
        if not self._view.cas(self._state, w, new):
            return DENY
        self._count(State.PROBING)
        return Permit(call=True, probe=True, word=new)

    def record(self, ok: bool, now_ms: int) -> None:
        """An ordinary (non-probe) call's outcome: it may open the breaker."""
        self._bump(now_ms, failed=not ok)
        p = self._policy
        if ok:
            if self._view.load(self._run):  # a load, not a store, on the hot path
                self._view.store(self._run, 0)
            until = self._view.load(self._recheck)
            if now_ms >= until:
                return
        else:
            until = 0
            run = self._failed_in_a_row(now_ms)
        w = self._view.load(self._state)
        if w >> L.BR_STATE_SHIFT != State.CLOSED:
            return
        if not ok and run >= p.min_calls:
            self._swap(w, State.OPEN, now_ms)
            return
        calls, failures = self.window(now_ms)
        if calls >= p.min_calls:
            if failures >= p.failure_rate * calls:
                self._swap(w, State.OPEN, now_ms)
            elif ok:
                self._view.cas(self._recheck, until, 0)  # from here successes only dilute
        elif not ok and failures >= p.failure_rate * p.min_calls:
            self._view.store(self._recheck, now_ms + p.window_ms)

    def _failed_in_a_row(self, now_ms: int) -> int:
        """Count one more failure in the current run; how long the run is now. The run
        word packs the time of its last failure with its length, so a run whose last
        failure left the window starts again (nine failures an hour ago and one now are
        not ten in a row)."""
        v, p = self._view, self._policy
        while True:
            w = v.load(self._run)
            last, n = w >> 16, w & 0xFFFF
            n = min(n + 1, 0xFFFF) if w and now_ms - last < p.window_ms else 1
            if v.cas(self._run, w, (now_ms & L.BR_SINCE_MASK) << 16 | n):
                return n

    def finish_probe(self, permit: Permit, ok: bool, now_ms: int) -> bool:
        """The probe's outcome: close (and forget the window) or open again. A probe that
        was taken over meanwhile changes nothing (and gets False)."""
        if not permit.probe:
            raise ValueError("finish_probe needs a probe permit")
        if ok:
            # Forget the window before closing, not after: a failure recorded the moment
            # the state reads closed must not be judged with the failures that opened it.
            # Only while this probe still holds the state: a taken-over one touches nothing.
            if self._view.load(self._state) == permit.word:
                self.clear_window()
            return self._swap(permit.word, State.CLOSED, now_ms)
        return self._swap(permit.word, State.OPEN, now_ms)

    def window(self, now_ms: int) -> tuple[int, int]:
        """(calls, failures) in the last ``window_ms``: buckets less than a window old, or
        newer than ``now_ms`` (started by a process whose clock reading came later). Summed
        in C: every failed call reads the whole window."""
        epoch = (now_ms // self._width) & L.BK_EPOCH_MASK
        return self._view.breaker_window(self._buckets, L.BREAKER_BUCKETS, epoch)

    def clear_window(self) -> None:
        for i in range(L.BREAKER_BUCKETS):
            self._view.store(self._buckets + i * L.WORD, 0)
        self._view.store(self._recheck, 0)
        self._view.store(self._run, 0)

    def _bump(self, now_ms: int, failed: bool) -> None:
        epoch_full = now_ms // self._width
        epoch = epoch_full & L.BK_EPOCH_MASK
        off = self._buckets + (epoch_full % L.BREAKER_BUCKETS) * L.WORD
        fresh = L.BK_VALID | (epoch << L.BK_EPOCH_SHIFT) | (failed << L.BK_FAIL_SHIFT) | 1
        while True:
            w = self._view.load(off)
            seen = (w >> L.BK_EPOCH_SHIFT) & L.BK_EPOCH_MASK
            if w & L.BK_VALID and seen == epoch:
                if w & L.BK_COUNT_MASK == L.BK_COUNT_MASK:
                    return  # a full bucket stops sampling; the share it saw stands
                new = w + 1 + (failed << L.BK_FAIL_SHIFT)
            elif w & L.BK_VALID and (seen - epoch) & L.BK_EPOCH_MASK < _EPOCH_HALF:
                return  # a whole window newer than our clock reading: ours is long gone
            else:
                new = fresh
            if self._view.cas(off, w, new):
                return

    def _swap(self, old: int, to: State, now_ms: int) -> bool:
        if not self._view.cas(self._state, old, pack(to, 0, now_ms)):
            return False
        self._count(to)
        return True

    def _count(self, to: State) -> None:
        if self._row is not None:
            self._row.add(_TRANSITION[to])
