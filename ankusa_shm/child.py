"""What every child process of the supervisor does as it starts, before it serves."""

from __future__ import annotations

import gc


def settle_heap() -> None:
    """Keep garbage collection off the request path's clock.

    Everything alive once start-up is done (modules, config, the segment's objects) lives
    until the process exits; ``gc.freeze`` moves it out of the collector's sight, so an
    old-generation collection scans only what the request path allocated since -- the
    pauses that pushed admits past their budget were full scans of the start-up heap.
    """
    gc.collect()
    gc.freeze()
