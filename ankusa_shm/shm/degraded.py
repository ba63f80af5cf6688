"""Per-kind "answered node-local" flags, and what the log says of them, host-wide.

A flag is written only when it changes, so the common case (healthy, flag already 0) is
two loads and no cache-line traffic between workers.

The log says an outage and its end once each, whichever process sees them: the first
failure is warned about at once (again once a minute while it lasts), and the end is
said by the first call answered a whole breaker window after the last failure. Calls
flapping between failing and answering within a window never make the log say the fleet
answers again while it does not; an outage after a line that said so is warned about at
once.
"""

from __future__ import annotations

from ankusa_shm._atomics import AtomicView
from ankusa_shm.shm import layout as L

WARN_EVERY_MS = 60_000
_FAILED_EVERY_MS = 100  # the last failure's time is written at most this often


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

    def is_set(self, kind: str) -> bool:
        return self._view.load(self._line(kind) + L.DG_FLAG) != 0

    def failed(self, kind: str, now_ms: int) -> bool:
        """A hook of ``kind`` is answered node-local: set the flag. True for the one
        caller that is to warn: the first since the log last said the fleet answers (or
        ever), or the first of another minute."""
        v, line = self._view, self._line(kind)
        if v.load(line + L.DG_FLAG) == 0:
            v.cas(line + L.DG_FLAG, 0, 1)
        now_ms = max(now_ms, 1)  # 0 means never
        last_failed = v.load(line + L.DG_FAILED_MS)
        if now_ms - last_failed >= _FAILED_EVERY_MS:
            v.cas(line + L.DG_FAILED_MS, last_failed, now_ms)
        warned = v.load(line + L.DG_WARNED_MS)
        if v.load(line + L.DG_SAID) == 0:
            if not v.cas(line + L.DG_SAID, 0, 1):
                return False
        elif now_ms - warned < WARN_EVERY_MS:
            return False
        return v.cas(line + L.DG_WARNED_MS, warned, now_ms)

    def answered(self, kind: str, now_ms: int, stable_ms: int) -> bool:
        """A call answered: clear the flag. True for the one caller that is to say the
        fleet answers again: a warning stands, and the last failure is ``stable_ms`` old."""
        v, line = self._view, self._line(kind)
        if v.load(line + L.DG_FLAG) != 0:
            v.cas(line + L.DG_FLAG, 1, 0)
        if v.load(line + L.DG_SAID) == 0:
            return False
        if now_ms - v.load(line + L.DG_FAILED_MS) < stable_ms:
            return False
        return v.cas(line + L.DG_SAID, 1, 0)
