"""Every counter, declared once, and the per-process rows that count them.

Each process adds to its own row (one row per process slot, padded so no two writers share
a cache line); readers sum the rows and the archive. When a slot is claimed again after
its process has gone, its row is folded into the archive first, so no total ever goes
backwards across restarts. ``inspect``, ``/metrics`` and the docs render from ``Counter``.
"""

from __future__ import annotations

import enum
import os
import time

from ankusa_shm._atomics import AtomicView
from ankusa_shm.shm import layout as L
from ankusa_shm.shm.pids import pid_alive


class Counter(enum.Enum):
    """(family, labels, help). Families are Prometheus names without ``ankusa_``/``_total``."""

    REQUESTS = ("requests", (), "Hooks handled by request workers.")
    ADMIT_OK = ("admit", (("result", "ok"),), "Admission decisions, by result.")
    ADMIT_DUPLICATE = ("admit", (("result", "duplicate"),), "")
    ADMIT_RATE_LIMITED = ("admit", (("result", "rate_limited"),), "")
    ADMIT_DEDUPE_PENDING = ("admit", (("result", "dedupe_pending"),), "")
    RATE_LIMIT_REJECTED = ("rate_limit_rejected", (), "Hooks refused by a tenant rate limit.")
    LIMITER_TABLE_FULL = (
        "limiter_table_full",
        (),
        "Hooks admitted unmetered: no node limiter slot could be had.",
    )
    FALLBACK_RATE_LIMIT = (
        "fleet_fallback",
        (("kind", "rate_limit"),),
        "Hooks answered node-local instead of by the fleet store, by kind.",
    )
    FALLBACK_DEDUPE = ("fleet_fallback", (("kind", "dedupe"),), "")
    STORE_OK = ("fleet_store_calls", (("result", "ok"),), "Fleet store calls, by outcome.")
    STORE_ERROR = ("fleet_store_calls", (("result", "error"),), "")
    STORE_TIMEOUT = ("fleet_store_calls", (("result", "timeout"),), "")
    BREAKER_TO_OPEN = (
        "fleet_breaker_transitions",
        (("to", "open"),),
        "Breaker transitions, by the state entered.",
    )
    BREAKER_TO_PROBING = ("fleet_breaker_transitions", (("to", "probing"),), "")
    BREAKER_TO_CLOSED = ("fleet_breaker_transitions", (("to", "closed"),), "")
    SETTLE_ENQUEUED = ("fleet_settle_enqueued", (), "Settle operations queued.")
    SETTLE_DROPPED = (
        "fleet_settle_dropped",
        (),
        "Settle operations dropped because the queue was full.",
    )
    SETTLE_ABANDONED = (
        "fleet_settle_abandoned",
        (),
        "Queue slots skipped: a producer died between reserving and publishing.",
    )
    SETTLE_EXPIRED = (
        "fleet_settle_expired",
        (),
        "Settle operations not sent: their pending claim had certainly expired.",
    )
    SETTLED_PROMOTE = ("fleet_settled", (("op", "promote"),), "Settle operations sent, by op.")
    SETTLED_RELEASE = ("fleet_settled", (("op", "release"),), "")
    DRAIN_ROUND_TRIPS = ("fleet_drain_round_trips", (), "Drainer round trips to the store.")
    DRAIN_ERRORS = ("fleet_drain_errors", (), "Drainer round trips that failed.")

    def __init__(self, family: str, labels: tuple[tuple[str, str], ...], help: str) -> None:
        self.family = family
        self.labels = labels
        self.help = help
        self.offset = len(type(self).__members__) * L.WORD

    @property
    def label(self) -> str:
        return label(self.family, self.labels)


def label(family: str, labels: tuple[tuple[str, str], ...]) -> str:
    """``family{k="v"}``, the name people see (and Prometheus's own spelling)."""
    if not labels:
        return family
    return family + "{" + ",".join(f'{k}="{v}"' for k, v in labels) + "}"


def family_help(family: str) -> str:
    """The help text of a family: the first member that carries one."""
    return next(c.help for c in Counter if c.family == family and c.help)


class CounterRow:
    """This process's row; ``add`` is one fetch-add on a line no other process writes."""

    def __init__(self, view: AtomicView, lay: L.Layout, slot: int) -> None:
        if not 0 <= slot < lay.params.process_slots:
            raise IndexError(f"process slot {slot} outside 0..{lay.params.process_slots - 1}")
        self._view = view
        self._base = lay.offset("counters") + slot * lay.counter_row

    def add(self, counter: Counter, n: int = 1) -> None:
        self._view.add(self._base + counter.offset, n)

    def get(self, counter: Counter) -> int:
        return self._view.load(self._base + counter.offset)


def fold(view: AtomicView, lay: L.Layout, slot: int) -> None:
    """Move a gone process's row into the archive (before its slot is reused).

    Adds before it zeroes: a folder that dies midway over-counts one counter once rather
    than letting a total go backwards. One fold runs at a time; a dead folder's turn is
    taken over.
    """
    fold_word = lay.offset("archive") + L.AR_FOLD
    me = os.getpid()
    while True:
        w = view.load(fold_word)
        holder = w & L.PID_MASK
        if holder and holder != me and pid_alive(holder):
            time.sleep(0.0005)
            continue
        if view.cas(fold_word, w, (w & ~L.PID_MASK) | me):
            break
    row = lay.offset("counters") + slot * lay.counter_row
    totals = lay.offset("archive") + L.AR_TOTALS
    for c in Counter:
        v = view.load(row + c.offset)
        if v:
            view.add(totals + c.offset, v)
            view.store(row + c.offset, 0)
    w = view.load(fold_word)
    view.store(fold_word, ((w >> L.PID_BITS) + 1) << L.PID_BITS)


def totals(view: AtomicView, lay: L.Layout, patience_s: float = 0.2) -> dict[Counter, int]:
    """Archive plus every row, summed again if a fold ran meanwhile."""
    fold_word = lay.offset("archive") + L.AR_FOLD
    deadline = time.monotonic() + patience_s
    while True:
        before = view.load(fold_word)
        out = {c: view.load(lay.offset("archive") + L.AR_TOTALS + c.offset) for c in Counter}
        base = lay.offset("counters")
        for slot in range(lay.params.process_slots):
            row = base + slot * lay.counter_row
            for c in Counter:
                v = view.load(row + c.offset)
                if v:
                    out[c] += v
        stable = (before & L.PID_MASK) == 0 and view.load(fold_word) == before
        if stable or time.monotonic() > deadline:
            return out
        time.sleep(0.001)
