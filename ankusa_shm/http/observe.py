"""What a request worker records about each answer, into its rows of the segment: the
count by source and status, and the request's latency. A few hundred nanoseconds an
answer; ``server.request_metrics = false`` turns it off."""

from __future__ import annotations

import time

from ankusa_shm.shm import requests
from ankusa_shm.shm.histograms import Histogram, HistogramRow
from ankusa_shm.shm.requests import RequestRow
from ankusa_shm.shm.segment import Segment

HOOKS_PREFIX = b"/hooks/"


class Observer:
    def __init__(
        self,
        rows: RequestRow,
        histograms: HistogramRow,
        source_rows: dict[str, int],
    ) -> None:
        # On the request path's clock: one dict lookup, one fetch-add and one C call an
        # answer, with every offset worked out here.
        self._view = rows.view
        self._unrouted = rows.offset(requests.UNROUTED)
        self._rows = {HOOKS_PREFIX + s.encode(): rows.offset(r) for s, r in source_rows.items()}
        self._histograms = histograms
        self._latency = histograms.base + Histogram.REQUEST.offset
        self._latency_bounds = Histogram.REQUEST.bounds  # the row's own, not a copy

    @classmethod
    def of_slot(cls, seg: Segment, slot: int, source_ids: list[str]) -> Observer:
        """The observer writing into process slot ``slot``'s rows of ``seg``."""
        return cls(
            RequestRow(seg.view, seg.layout, slot),
            HistogramRow(seg.view, seg.layout, slot),
            requests.source_rows(seg.blob("sources"), source_ids),
        )

    def answered(self, path: bytes, status: int, started_ns: int) -> None:
        """The HTTP server's observer: one answer, just before it is written."""
        view = self._view
        row = self._rows.get(path, self._unrouted)
        view.add(row + requests.COLUMN_OFFSETS.get(status, requests.OTHER_OFFSET), 1)
        view.observe(self._latency, self._latency_bounds, time.monotonic_ns() - started_ns)

    def committed(self, waited_ns: int) -> None:
        """The request path: one hook's commit answered after ``waited_ns``."""
        self._histograms.observe(Histogram.COMMIT, waited_ns)

    def transaction(self, hooks: int, waited_ns: int, held_ns: int) -> None:
        """The store's writer thread: one transaction of ``hooks`` committed, after waiting
        ``waited_ns`` for the writers' lock and holding it ``held_ns``."""
        self._histograms.observe(Histogram.BATCH, hooks)
        self._histograms.observe(Histogram.LOCK_WAIT, waited_ns)
        self._histograms.observe(Histogram.LOCK_HELD, held_ns)
