"""The host's commit word: bumped after every store transaction by whichever worker made
it, so a process waiting for new hooks (a consumer's long-poll) learns of one by loading
a word instead of querying the database."""

from __future__ import annotations

from ankusa_shm._atomics import AtomicView
from ankusa_shm.shm import layout as L


class CommitWord:
    def __init__(self, view: AtomicView, lay: L.Layout) -> None:
        self._view = view
        self._offset = lay.offset("store") + L.ST_COMMITS

    def bump(self) -> None:
        self._view.add(self._offset, 1)

    def load(self) -> int:
        return self._view.load(self._offset)
