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


def wall_of(mono_ms: int | None) -> int | None:
    """A moment on the monotonic clock (ms), moved to the wall clock."""
    return None if mono_ms is None else wall_ms() - (monotonic_ms() - mono_ms)


class SteadyWall:
    """The wall clock, but never ahead of where it stood when this was made plus the
    monotonic time since: for deciding what is old enough to delete. A host that booted
    with a bad clock has it stepped forward by NTP later, and by the wall clock alone
    every hook then looked old at once. A step back is believed: it only keeps more."""

    def __init__(self, wall: WallClock = wall_ms, mono: Callable[[], int] = monotonic_ms) -> None:
        self._wall, self._mono = wall, mono
        self._base = wall() - mono()

    def __call__(self) -> int:
        return min(self._wall(), self._base + self._mono())

    def ahead_ms(self) -> int:
        """How far the wall clock has run ahead of the steady one: a forward step."""
        return max(0, self._wall() - (self._base + self._mono()))
