"""GCRA limits: one definition of what "rate and burst" mean, for node and fleet alike.

A tenant may send ``burst`` hooks at once and then one every ``interval_us``. A bucket
remembers its theoretical arrival time (TAT); a hook is admitted when pushing the TAT one
interval ahead keeps it within ``burst`` intervals of now. A denial changes nothing.
"""

from __future__ import annotations

from dataclasses import dataclass, field

MAX_SPAN_US = 1 << 46  # ~2.2 years: room to spare in the node table's 49-bit time field


@dataclass(frozen=True)
class Limit:
    interval_us: int
    burst: int
    span_us: int = field(init=False)  # how far ahead of now a TAT may be and still admit

    def __post_init__(self) -> None:
        object.__setattr__(self, "span_us", self.interval_us * self.burst)

    @classmethod
    def of(cls, rate: float, burst: int) -> Limit:
        """Validate ``rate`` (hooks/s, may be fractional) and ``burst``; ValueError says why."""
        if isinstance(rate, bool) or not isinstance(rate, int | float) or not rate > 0:
            raise ValueError(f"rate must be a positive number of hooks per second, not {rate!r}")
        if isinstance(burst, bool) or not isinstance(burst, int) or burst < 1:
            raise ValueError(f"burst must be a whole number of at least 1, not {burst!r}")
        exact = 1_000_000 / rate
        if exact > MAX_SPAN_US:  # also inf, for a subnormal rate: round() would overflow
            raise ValueError(
                f"rate {rate} is below the supported {1_000_000 / MAX_SPAN_US:.3g} hooks "
                "per second: one interval would span more than about 2.2 years"
            )
        interval = round(exact)
        if interval < 1:
            raise ValueError(f"rate {rate} is above the supported 1000000 hooks per second")
        if interval * burst > MAX_SPAN_US:
            raise ValueError(
                f"burst {burst} at rate {rate} spans {interval * burst} us, "
                f"more than the supported {MAX_SPAN_US} us (about 2.2 years)"
            )
        return cls(interval, burst)


def retry_ms(excess_us: int) -> int:
    """Milliseconds until a denied hook would be admitted: the ceiling, at least 1."""
    return max(1, -(-excess_us // 1000))
