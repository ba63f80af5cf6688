"""The clocks: monotonic, shared by every process on a host, for every pause and deadline;
and the wall clock, for what is kept (a hook's receipt) or said to people."""

from __future__ import annotations

import time
from collections.abc import Callable

Clock = Callable[[], int]
"""Returns monotonic nanoseconds; tests inject their own."""


def monotonic_ns() -> int:
    return time.monotonic_ns()


def monotonic_ms() -> int:
    return time.monotonic_ns() // 1_000_000


WallClock = Callable[[], int]
"""Returns wall-clock milliseconds since the epoch; tests inject their own."""


def wall_ms() -> int:
    """For what outlives the host's monotonic clock: a hook's received-at, Redis's TTLs,
    what the store keeps across reboots."""
    return time.time_ns() // 1_000_000
