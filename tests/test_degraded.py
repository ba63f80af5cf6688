"""Degraded flags per kind, and the host-wide once-a-minute warning gate."""

from __future__ import annotations

from multiprocessing.synchronize import Barrier

import pytest
from proc_helpers import CTX, run_children

from ankusa_shm.shm.degraded import WARN_EVERY_MS, Degraded
from ankusa_shm.shm.segment import Segment

T0 = 5_000_000


def test_flags_per_kind(seg: Segment) -> None:
    d = Degraded(seg.view, seg.layout)
    assert not d.is_set("rate_limit") and not d.is_set("dedupe")
    assert d.set("rate_limit", True) is True
    assert d.set("rate_limit", True) is False  # already set: no change, no write
    assert d.is_set("rate_limit")
    assert not d.is_set("dedupe")
    other = Degraded(seg.view, seg.layout)  # another process's view of the same flags
    assert other.is_set("rate_limit")
    assert other.set("rate_limit", False) is True
    assert not d.is_set("rate_limit")
    assert d.set("dedupe", True) is True
    assert d.is_set("dedupe") and not d.is_set("rate_limit")
    with pytest.raises(ValueError):
        d.is_set("nonsense")


def test_clearing_says_whether_a_warning_was_logged(seg: Segment) -> None:
    """Only the process that clears a flag someone warned about is told to say it is back:
    one line each way, however often the flag flaps within the minute."""
    d = Degraded(seg.view, seg.layout)
    assert d.clear("dedupe") is False  # already off
    d.set("dedupe", True)
    assert d.clear("dedupe") is False  # on, but nobody warned
    d.set("dedupe", True)
    assert d.claim_warning("dedupe", T0) is True
    assert d.is_set("dedupe") and d.set("dedupe", True) is False
    assert d.clear("dedupe") is True
    assert d.clear("dedupe") is False and not d.is_set("dedupe")
    d.set("dedupe", True)  # flapping within the minute: no warning, so no "back" either
    assert d.claim_warning("dedupe", T0 + 1) is False
    assert d.clear("dedupe") is False


def test_warning_at_most_once_a_minute(seg: Segment) -> None:
    d = Degraded(seg.view, seg.layout)
    assert d.claim_warning("dedupe", T0) is True
    assert d.claim_warning("dedupe", T0) is False
    assert d.claim_warning("dedupe", T0 + WARN_EVERY_MS - 1) is False
    assert d.claim_warning("rate_limit", T0 + 1) is True  # each kind has its own minute
    assert d.claim_warning("dedupe", T0 + WARN_EVERY_MS) is True
    assert d.claim_warning("dedupe", T0 + WARN_EVERY_MS + 1) is False
    assert d.claim_warning("dedupe", T0 + 2 * WARN_EVERY_MS - 1) is False
    assert d.claim_warning("dedupe", T0 + 2 * WARN_EVERY_MS) is True


def test_warning_at_time_zero_still_counts(seg: Segment) -> None:
    d = Degraded(seg.view, seg.layout)
    assert d.claim_warning("dedupe", 0) is True
    assert d.claim_warning("dedupe", 1) is False  # 0 means "never warned": not reused


def _claim(i: int, name: str, now: int, start: Barrier) -> bool:
    with Segment.attach(name) as s:
        d = Degraded(s.view, s.layout)
        start.wait(60)
        return d.claim_warning("rate_limit", now)


@pytest.mark.parametrize("n", [2, 6])
def test_racing_processes_one_warning(seg: Segment, n: int) -> None:
    won = run_children(n, _claim, seg.name, T0, CTX.Barrier(n))
    assert sorted(won) == [False] * (n - 1) + [True]
    won = run_children(n, _claim, seg.name, T0 + WARN_EVERY_MS, CTX.Barrier(n))
    assert won.count(True) == 1
