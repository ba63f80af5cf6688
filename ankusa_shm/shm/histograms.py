"""Latency and size histograms, kept in the segment as the counters are: one row per
process slot, summed on read, so a process killed mid-run loses none of its observations.

Each histogram is a fixed list of upper bounds. An observation adds one to the first
bucket whose bound is at least the value (the last bucket has none: +Inf) and the value
to the sum: two fetch-adds on the observer's own line. Buckets are kept per bucket, not
cumulative, so each observation touches one of them; Prometheus's cumulative counts and
the total are made on read, and can never disagree with each other. The sum can, by one
observation: a process killed between the two fetch-adds leaves its last one counted
without its value (Prometheus does not promise ``_sum`` and ``_count`` agree either).
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass

from ankusa_shm._atomics import AtomicView
from ankusa_shm.shm import layout as L
from ankusa_shm.shm.counters import summed_rows

_MS = 1_000_000  # ns
_LATENCY_MS = (0.25, 0.5, 1, 2.5, 5, 10, 25, 50, 100, 250, 500, 1_000, 2_500, 5_000, 10_000)
LATENCY_BOUNDS_NS = tuple(int(ms * _MS) for ms in _LATENCY_MS)
# For what takes a fraction of a millisecond to a few: a wait for the writers' lock
# (mostly nothing, or a part of another worker's transaction), a transaction holding it,
# a fleet store call on a near network.
SHORT_BOUNDS_NS = tuple(int(ms * _MS) for ms in (0.05, 0.1, *_LATENCY_MS))
BATCH_BOUNDS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)


class Histogram(enum.Enum):
    """(family, help, bounds in integer units, integer units per exported unit). Family
    names are Prometheus's without ``ankusa_``."""

    REQUEST = (
        "request_duration_seconds",
        "Hook requests, from their first byte to their answer.",
        LATENCY_BOUNDS_NS,
        1e9,
    )
    COMMIT = (
        "store_commit_duration_seconds",
        "How long a hook waited for its store transaction to commit.",
        LATENCY_BOUNDS_NS,
        1e9,
    )
    BATCH = (
        "store_batch_hooks",
        "Hooks per store transaction, resends its index found stored included.",
        BATCH_BOUNDS,
        1.0,
    )
    LOCK_WAIT = (
        "store_lock_wait_seconds",
        "How long a hook transaction waited for the writers' lock (another writer held it).",
        SHORT_BOUNDS_NS,
        1e9,
    )
    LOCK_HELD = (
        "store_lock_held_seconds",
        "How long a hook transaction held the writers' lock: its statements and its COMMIT.",
        SHORT_BOUNDS_NS,
        1e9,
    )
    FLEET_CALL = (
        "fleet_store_call_duration_seconds",
        "How long each hook's admission waited for its fleet store call: to the answer,"
        " the failure or the end of the budget.",
        SHORT_BOUNDS_NS,
        1e9,
    )

    def __init__(self, family: str, help: str, bounds: tuple[int, ...], per_unit: float) -> None:
        self.family = family
        self.help = help
        self.bounds = bounds
        self.per_unit = per_unit
        # buckets (one per bound, then +Inf) and a sum word, after the histograms before it
        self.offset = sum(len(h.bounds) + 2 for h in type(self)) * L.WORD
        self.sum_offset = self.offset + (len(bounds) + 1) * L.WORD


WORDS = sum(len(h.bounds) + 2 for h in Histogram)


class HistogramRow:
    """A process slot's row: ``observe`` is one C call (the bucket search and two
    fetch-adds on lines only this process writes)."""

    def __init__(self, view: AtomicView, lay: L.Layout, slot: int) -> None:
        self.view = view
        self.base = lay.offset("histograms") + slot * lay.histogram_row

    def observe(self, h: Histogram, value: int) -> None:
        self.view.observe(self.base + h.offset, h.bounds, value)


@dataclass(frozen=True)
class Totals:
    """One histogram summed over every row: per-bucket counts (the last is +Inf) and the
    sum, in the histogram's integer unit."""

    histogram: Histogram
    buckets: tuple[int, ...]
    sum: int

    @property
    def count(self) -> int:
        return sum(self.buckets)

    def cumulative(self) -> list[tuple[float, int]]:
        """(upper bound in exported units, observations at or below it), +Inf last."""
        out: list[tuple[float, int]] = []
        running = 0
        bounds = [b / self.histogram.per_unit for b in self.histogram.bounds] + [float("inf")]
        for bound, n in zip(bounds, self.buckets, strict=True):
            running += n
            out.append((bound, running))
        return out

    def quantile(self, q: float) -> float | None:
        return quantile(self.cumulative(), q)


def quantile(cumulative: Sequence[tuple[float, int]], q: float) -> float | None:
    """The q-quantile of (le, cumulative count) buckets, interpolated inside its bucket
    as Prometheus's ``histogram_quantile`` does; None without observations. One that
    falls in the +Inf bucket is reported as the largest finite bound."""
    total = cumulative[-1][1] if cumulative else 0
    if not total:
        return None
    rank = q * total
    lower, below = 0.0, 0
    for bound, running in cumulative:
        if running >= rank and running > below:
            if bound == float("inf"):
                return lower
            return lower + (bound - lower) * (rank - below) / (running - below)
        lower, below = bound, running
    return lower


def totals(view: AtomicView, lay: L.Layout) -> dict[Histogram, Totals]:
    sums = summed_rows(view, lay, "histograms", lay.histogram_row, WORDS)
    out = {}
    for h in Histogram:
        first = h.offset // L.WORD
        buckets = tuple(sums[first : first + len(h.bounds) + 1])
        out[h] = Totals(h, buckets, sums[h.sum_offset // L.WORD])
    return out
