"""Per-kind "answered node-local" flags, and a host-wide once-a-minute warning gate.

A flag is written only when it changes, so the common case (healthy, flag already 0) is
one load and no cache-line traffic between workers. A flag whose warning was logged says
so, so that the process that clears it says the host is back: one line each way at most
once a minute, however often calls flap between failing and answering.
"""

from __future__ import annotations

from ankusa_shm._atomics import AtomicView
from ankusa_shm.shm import layout as L

WARN_EVERY_MS = 60_000
_OFF, _ON, _WARNED = 0, 1, 2  # answered from the fleet; node-local; node-local and said so


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
        return (old != _OFF) != on and self._view.cas(off, old, _ON if on else _OFF)

    def clear(self, kind: str) -> bool:
        """Set the flag off; True if this call did, and a warning had said it was on."""
        off = self._line(kind) + L.DG_FLAG
        old = self._view.load(off)
        return old != _OFF and self._view.cas(off, old, _OFF) and old == _WARNED

    def is_set(self, kind: str) -> bool:
        return self._view.load(self._line(kind) + L.DG_FLAG) != _OFF

    def claim_warning(self, kind: str, now_ms: int) -> bool:
        """True for exactly one caller per ``WARN_EVERY_MS`` per host, whichever process;
        the flag, if on, then records that it was warned about."""
        line = self._line(kind)
        last = self._view.load(line + L.DG_WARNED_MS)
        if last and now_ms - last < WARN_EVERY_MS:
            return False
        if not self._view.cas(line + L.DG_WARNED_MS, last, max(now_ms, 1)):
            return False
        self._view.cas(line + L.DG_FLAG, _ON, _WARNED)
        return True
