"""Requests answered, by source and status: a row of words per process slot, summed on
read like the counters.

Sources are named at run time, so the segment holds their table (the ``sources`` blob):
the supervisor appends every source id it configures and never removes or reorders one,
so a row counts one source for the life of the segment, across reloads and restarts.
Row 0 counts requests that named no configured source (404s, unreadable requests), row 1
the sources that found the table full.
"""

from __future__ import annotations

from ankusa_shm._atomics import AtomicView
from ankusa_shm.shm import layout as L
from ankusa_shm.shm.blob import Blob
from ankusa_shm.shm.counters import summed_rows

STATUSES = (201, 400, 401, 404, 405, 408, 409, 413, 429, 431, 500, 503)
OTHER_STATUS = len(STATUSES)  # the column of any status not listed
COLUMNS = len(STATUSES) + 1
UNROUTED = 0
OVERFLOW = 1
FIRST_SOURCE_ROW = 2
# Byte offsets within a source's row: of each listed status's word, and of "other".
COLUMN_OFFSETS = {s: i * L.WORD for i, s in enumerate(STATUSES)}
OTHER_OFFSET = OTHER_STATUS * L.WORD


def status_label(column: int) -> str:
    return str(STATUSES[column]) if column < len(STATUSES) else "other"


def row_label(names: list[str], row: int) -> str:
    """The source label of a row: "" for unrouted requests, ``L.OVERFLOW_LABEL`` past the
    table."""
    if row == UNROUTED:
        return ""
    if row == OVERFLOW:
        return L.OVERFLOW_LABEL
    return names[row - FIRST_SOURCE_ROW]


def assign(table: Blob, source_ids: list[str]) -> list[str]:
    """Append the source ids not yet in the table (supervisor only); the table after.
    Ids that find it full are counted on the overflow row."""
    names = source_names(table)
    room = L.SOURCE_ROWS - FIRST_SOURCE_ROW - len(names)
    new = [s for s in source_ids if s not in names][: max(room, 0)]
    if new:
        names = names + new
        table.write(names)
    return names


def source_names(table: Blob) -> list[str]:
    doc = table.read()
    if not isinstance(doc, list) or not all(isinstance(n, str) for n in doc):
        return []
    return list(doc[: L.SOURCE_ROWS - FIRST_SOURCE_ROW])


def source_rows(table: Blob, source_ids: list[str]) -> dict[str, int]:
    """Each configured source's row (``OVERFLOW`` for one the table had no room for)."""
    index = {n: FIRST_SOURCE_ROW + i for i, n in enumerate(source_names(table))}
    return {s: index.get(s, OVERFLOW) for s in source_ids}


class RequestRow:
    """A process slot's rows: ``add`` is one fetch-add on lines only it writes. A hot
    caller keeps ``offset(row)`` and adds ``COLUMN_OFFSETS`` to it itself."""

    def __init__(self, view: AtomicView, lay: L.Layout, slot: int) -> None:
        self.view = view
        self._base = lay.offset("requests") + slot * lay.request_row

    def offset(self, row: int) -> int:
        return self._base + row * COLUMNS * L.WORD

    def add(self, row: int, status: int) -> None:
        self.view.add(self.offset(row) + COLUMN_OFFSETS.get(status, OTHER_OFFSET), 1)


def totals(view: AtomicView, lay: L.Layout) -> dict[tuple[int, int], int]:
    """(source row, status column) -> requests, for every cell that counted any."""
    sums = summed_rows(view, lay, "requests", lay.request_row, L.SOURCE_ROWS * COLUMNS)
    return {divmod(cell, COLUMNS): n for cell, n in enumerate(sums) if n}
