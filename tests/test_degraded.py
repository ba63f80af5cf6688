"""Degraded flags per kind, and what the log says of them, host-wide."""

from __future__ import annotations

from multiprocessing.synchronize import Barrier

import pytest
from proc_helpers import CTX, run_children

from ankusa_shm.shm.degraded import WARN_EVERY_MS, Degraded
from ankusa_shm.shm.segment import Segment

T0 = 5_000_000
STABLE = 10_000


def test_flags_per_kind(seg: Segment) -> None:
    d = Degraded(seg.view, seg.layout)
    assert not d.is_set("rate_limit") and not d.is_set("dedupe")
    d.failed("rate_limit", T0)
    assert d.is_set("rate_limit") and not d.is_set("dedupe")
    other = Degraded(seg.view, seg.layout)  # another process's view of the same flags
    assert other.is_set("rate_limit")
    other.answered("rate_limit", T0 + 1, STABLE)  # cleared at once, said or not
    assert not d.is_set("rate_limit")
    d.failed("dedupe", T0)
    assert d.is_set("dedupe") and not d.is_set("rate_limit")
    with pytest.raises(ValueError):
        d.is_set("nonsense")


def test_an_outage_is_said_at_once_then_once_a_minute(seg: Segment) -> None:
    d = Degraded(seg.view, seg.layout)
    assert d.failed("dedupe", T0) is True
    assert d.failed("dedupe", T0) is False
    assert d.failed("dedupe", T0 + WARN_EVERY_MS - 1) is False
    assert d.failed("rate_limit", T0 + 1) is True  # each kind on its own
    assert d.failed("dedupe", T0 + WARN_EVERY_MS) is True
    assert d.failed("dedupe", T0 + WARN_EVERY_MS + 1) is False
    assert d.failed("dedupe", T0 + 2 * WARN_EVERY_MS) is True


def test_the_end_is_said_once_answered_a_whole_window_after_the_last_failure(
    seg: Segment,
) -> None:
    """Calls flapping within the window never make the log say the fleet answers again
    (an audit saw that line in the same millisecond as the failure after it, and the
    minute's gate then kept the failure unsaid)."""
    d = Degraded(seg.view, seg.layout)
    assert d.answered("dedupe", T0, STABLE) is False  # nothing was said
    assert d.failed("dedupe", T0) is True
    for t in range(T0 + 1, T0 + 5_000, 500):  # flapping
        assert d.answered("dedupe", t, STABLE) is False
        assert d.failed("dedupe", t + 200) is False
    last = T0 + 4_701
    assert d.answered("dedupe", last + STABLE - 200, STABLE) is False
    assert d.answered("dedupe", last + STABLE, STABLE) is True
    assert d.answered("dedupe", last + STABLE + 1, STABLE) is False  # said once
    # The next outage, seconds later, is said at once: the last line said it was over.
    assert d.failed("dedupe", last + STABLE + 2_000) is True
    assert d.failed("dedupe", last + STABLE + 2_001) is False


def test_a_failure_at_time_zero_still_counts(seg: Segment) -> None:
    d = Degraded(seg.view, seg.layout)
    assert d.failed("dedupe", 0) is True
    assert d.failed("dedupe", 1) is False


def _fail(i: int, name: str, now: int, start: Barrier) -> bool:
    with Segment.attach(name) as s:
        d = Degraded(s.view, s.layout)
        start.wait(60)
        return d.failed("rate_limit", now)


def _answer(i: int, name: str, now: int, start: Barrier) -> bool:
    with Segment.attach(name) as s:
        d = Degraded(s.view, s.layout)
        start.wait(60)
        return d.answered("rate_limit", now, STABLE)


@pytest.mark.parametrize("n", [2, 6])
def test_racing_processes_one_line(seg: Segment, n: int) -> None:
    said = run_children(n, _fail, seg.name, T0, CTX.Barrier(n))
    assert sorted(said) == [False] * (n - 1) + [True]
    said = run_children(n, _fail, seg.name, T0 + WARN_EVERY_MS, CTX.Barrier(n))
    assert said.count(True) == 1
    said = run_children(n, _answer, seg.name, T0 + WARN_EVERY_MS + STABLE, CTX.Barrier(n))
    assert said.count(True) == 1
