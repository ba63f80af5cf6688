"""The steady wall clock retention goes by: a forward step of the wall clock is not taken
for time gone by, a step back is."""

from __future__ import annotations

from ankusa_shm.clock import SteadyWall


class Clocks:
    """A wall clock and a monotonic clock (ms) that the test moves."""

    def __init__(self) -> None:
        self.wall = 1_700_000_000_000
        self.mono = 5_000

    def tick(self, ms: int) -> None:
        self.wall += ms
        self.mono += ms


def test_the_steady_wall_follows_the_wall_clock_until_it_is_stepped_forward() -> None:
    c = Clocks()
    steady = SteadyWall(lambda: c.wall, lambda: c.mono)
    c.tick(60_000)
    assert steady() == c.wall and steady.ahead_ms() == 0
    c.wall += 86_400_000  # NTP corrects a host that booted a day behind
    assert steady() == c.wall - 86_400_000
    assert steady.ahead_ms() == 86_400_000
    c.tick(1_000)  # and goes on with the monotonic clock from there
    assert steady() == c.wall - 86_400_000


def test_a_step_back_is_believed_at_once() -> None:
    c = Clocks()
    steady = SteadyWall(lambda: c.wall, lambda: c.mono)
    c.wall -= 3_600_000
    assert steady() == c.wall and steady.ahead_ms() == 0
