"""Every counter, declared once, and the per-slot rows that count them.

Each process adds to the row of the process slot it holds (padded so no two writers share
a cache line); a total is the sum of the rows. A row belongs to its slot, not to the
process: it is never zeroed or moved, and the next holder of the slot keeps adding to it.
So there is nothing to fold when a process dies and nothing a death can leave half-done:
a total is exact at every instant and never goes backwards across restarts. What one
process counted itself is its row less the baseline recorded when it claimed the slot
(``procs``). ``inspect``, ``/metrics`` and the docs render from ``Counter``.
"""

from __future__ import annotations

import enum

from ankusa_shm._atomics import AtomicView
from ankusa_shm.shm import layout as L


class Counter(enum.Enum):
    """(family, labels, help). Families are Prometheus names without ``ankusa_``/``_total``."""

    REQUESTS = ("requests", (), "Hooks handled by request workers.")
    SHED_IDLE = (
        "connections_shed",
        (("closed", "idle"),),
        "Client connections closed by a worker at server.max_connections: the longest-idle "
        "keep-alive one to make room for a new one, or the new one when none was idle.",
    )
    SHED_NEW = ("connections_shed", (("closed", "new"),), "")
    ADMIT_OK = ("admit", (("result", "ok"),), "Admission decisions, by result.")
    ADMIT_DUPLICATE = ("admit", (("result", "duplicate"),), "")
    ADMIT_RATE_LIMITED = ("admit", (("result", "rate_limited"),), "")
    ADMIT_DEDUPE_PENDING = ("admit", (("result", "dedupe_pending"),), "")
    STORE_DUPLICATE = (
        "store_duplicates",
        (),
        "Hooks found in the store's own dedupe index, answered as duplicates: every "
        "duplicate in node scope, and in fleet scope one Redis did not catch; also a resend "
        "that admission refused (rate limited, or pending in the fleet) of a hook stored here.",
    )
    RATE_LIMIT_REJECTED = (
        "rate_limit_rejected",
        (),
        "Hooks refused by a tenant rate limit at admission (a resend of a hook stored here "
        "is still answered as its duplicate).",
    )
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
    SETTLE_CORRUPT = (
        "fleet_settle_corrupt",
        (),
        "Queue slots skipped: the record failed its check (torn, a lap stale, or damaged).",
    )
    SETTLE_EXPIRED = (
        "fleet_settle_expired",
        (),
        "Settle operations not sent: their pending claim had certainly expired.",
    )
    SETTLED_PROMOTE = ("fleet_settled", (("op", "promote"),), "Settle operations sent, by op.")
    SETTLED_RELEASE = ("fleet_settled", (("op", "release"),), "")
    REPROMOTED = (
        "fleet_repromoted",
        (),
        "Hooks promoted again from the store: after the fleet store lost its data, the "
        "settle queue dropped operations, or a worker or supervisor died (those go through "
        "the settle queue, and are in fleet_settle_enqueued too).",
    )
    SETTLE_DROPS_RECOVERED = (
        "fleet_settle_drops_recovered",
        (),
        "Settle operations dropped for a full queue that were made good: the hooks stored "
        "since the drops began were promoted again from the store.",
    )
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
    """A slot's row; ``add`` is one fetch-add on a line no other live process writes."""

    def __init__(self, view: AtomicView, lay: L.Layout, slot: int) -> None:
        if not 0 <= slot < lay.params.process_slots:
            raise IndexError(f"process slot {slot} outside 0..{lay.params.process_slots - 1}")
        self._view = view
        self._base = lay.offset("counters") + slot * lay.counter_row

    def add(self, counter: Counter, n: int = 1) -> None:
        self._view.add(self._base + counter.offset, n)

    def get(self, counter: Counter) -> int:
        return self._view.load(self._base + counter.offset)


def claimed_slots(view: AtomicView, lay: L.Layout) -> list[int]:
    """The process slots ever claimed: only their rows can hold anything, and on a host
    they are a handful of the table's hundreds, so summing reads only these."""
    base = lay.offset("processes") + L.PS_CLAIMS
    return [
        i for i in range(lay.params.process_slots) if view.load(base + i * L.PROCESS_SLOT_BYTES)
    ]


def summed_rows(
    view: AtomicView, lay: L.Layout, region: str, row_bytes: int, words: int
) -> list[int]:
    """The first ``words`` words of ``region``'s per-process rows, each summed over the
    claimed slots: how every table of per-process counts (counters, requests,
    histograms) is read as one."""
    base = lay.offset(region)
    out = [0] * words
    for slot in claimed_slots(view, lay):
        row = base + slot * row_bytes
        for i in range(words):
            v = view.load(row + i * L.WORD)
            if v:
                out[i] += v
    return out


def totals(view: AtomicView, lay: L.Layout) -> dict[Counter, int]:
    """Every row summed. Rows only grow, so a later sum is never below an earlier one."""
    sums = summed_rows(view, lay, "counters", lay.counter_row, len(Counter))
    return {c: sums[c.offset // L.WORD] for c in Counter}
