"""Per-kind "answered node-local" flags, and a host-wide once-a-minute warning gate.

A flag is written only when it changes, so the common case (healthy, flag already 0) is
one load and no cache-line traffic between workers.
"""

from __future__ import annotations

from ankusa_shm._atomics import AtomicView
from ankusa_shm.shm import layout as L

WARN_EVERY_MS = 60_000


class Degraded:
    def __init__(self, view: AtomicView, lay: L.Layout) -> None:
        self._view = view
        base = lay.offset("degraded")
        self._lines = {kind: base + i * L.LINE for i, kind in enumerate(L.KINDS)}

    def _line(self, kind: str) -> int:
        try:
            return self._lines[kind]
        except KeyError:
            raise ValueError(f"no degraded flag of kind {kind!r}") from None

    def set(self, kind: str, on: bool) -> bool:
        """Set the flag; True if this call changed it."""
        off = self._line(kind) + L.DG_FLAG
        old = self._view.load(off)
        return old != on and self._view.cas(off, old, int(on))

    def is_set(self, kind: str) -> bool:
        return self._view.load(self._line(kind) + L.DG_FLAG) == 1

    def claim_warning(self, kind: str, now_ms: int) -> bool:
        """True for exactly one caller per ``WARN_EVERY_MS`` per host, whichever process."""
        off = self._line(kind) + L.DG_WARNED_MS
        last = self._view.load(off)
        if last and now_ms - last < WARN_EVERY_MS:
            return False
        return self._view.cas(off, last, max(now_ms, 1))
