"""The host's commit word: bumped after every store transaction by whichever worker made
it, so a process waiting for new hooks (a consumer's long-poll) learns of one by sleeping
on a word instead of querying the database, or polling the word. A waiter counts itself
in ``ST_WATCHERS`` while it sleeps, and a commit makes the wake system call only then."""

from __future__ import annotations

from ankusa_shm._atomics import AtomicView
from ankusa_shm.shm import layout as L


class CommitWord:
    def __init__(self, view: AtomicView, lay: L.Layout) -> None:
        self._view = view
        self._offset = lay.offset("store") + L.ST_COMMITS
        self._watchers = lay.offset("store") + L.ST_WATCHERS

    def bump(self) -> None:
        self._view.add(self._offset, 1)
        if self._view.load(self._watchers) > 0:
            self._view.wake(self._offset)

    def load(self) -> int:
        return self._view.load(self._offset)

    def wait_past(self, seen: int, timeout_s: float) -> bool:
        """Sleep, without the GIL, until the word is past ``seen`` (True), ``wake`` or
        ``timeout_s``. Blocks: call it from a thread, not an event loop."""
        self._view.add(self._watchers, 1)
        try:
            return self._view.wait_at_least(self._offset, seen + 1, int(timeout_s * 1e9))
        finally:
            self._view.add(self._watchers, -1)

    def wake(self) -> None:
        """Cut every ``wait_past`` short (a process stopping wakes its own waiter)."""
        self._view.wake(self._offset)
