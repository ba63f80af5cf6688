"""Node-scope rate limits: GCRA buckets in the segment, shared by every process.

Time is injected (``now_us``); nothing here waits on a real clock.
"""

from __future__ import annotations

import hashlib
import math
import os
import subprocess
import sys
from multiprocessing.synchronize import Barrier

import pytest
from proc_helpers import CTX, claimed_row, run_children

from ankusa_shm.limits import MAX_SPAN_US, Limit, retry_ms
from ankusa_shm.shm import counters
from ankusa_shm.shm import segment as segmod
from ankusa_shm.shm.counters import Counter, CounterRow
from ankusa_shm.shm.gcra import GcraTable, tenant_hash
from ankusa_shm.shm.segment import Segment

NOW = 7_000_000_000  # any monotonic us
PROCS = 4
HITS = 50


def _table(seg: Segment) -> tuple[GcraTable, CounterRow]:
    row = claimed_row(seg, 0)
    return GcraTable(seg.view, seg.buf, seg.layout, row), row


def _region(seg: Segment) -> bytes:
    start, size = seg.layout.regions["gcra"]
    return bytes(seg.buf[start : start + size])


def test_fresh_bucket_admits_burst_then_refuses(seg: Segment) -> None:
    t, _ = _table(seg)
    limit = Limit.of(rate=10, burst=3)
    assert limit.interval_us == 100_000
    assert [t.take("acme", limit, NOW) for _ in range(4)] == [0, 0, 0, 100]
    assert t.take("other", limit, NOW) == 0  # buckets are per tenant


def test_retry_after_is_the_ceiling_in_ms_and_at_least_one(seg: Segment) -> None:
    t, _ = _table(seg)
    three = Limit.of(rate=3, burst=1)
    assert t.take("a", three, NOW) == 0
    assert t.take("a", three, NOW) == 334  # 333.333 ms, rounded up
    assert t.take("a", three, NOW + 333_000) == 1  # 333 us left: still a whole ms
    fast = Limit.of(rate=1000, burst=1)
    assert t.take("b", fast, NOW) == 0
    assert t.take("b", fast, NOW) == 1
    assert t.take("b", fast, NOW + 999) == 1  # 1 us left
    assert retry_ms(1) == 1 and retry_ms(1000) == 1 and retry_ms(1001) == 2


def test_a_denial_writes_nothing(seg: Segment) -> None:
    t, _ = _table(seg)
    limit = Limit.of(rate=1, burst=2)
    assert t.take("acme", limit, NOW) == 0
    assert t.take("acme", limit, NOW) == 0
    before = _region(seg)
    assert t.take("acme", limit, NOW) == 1000
    assert t.take("acme", limit, NOW + 10_000) == 990
    assert _region(seg) == before


def test_refill_admits_one_per_interval(seg: Segment) -> None:
    t, _ = _table(seg)
    limit = Limit.of(rate=2, burst=5)
    assert [t.take("acme", limit, NOW) for _ in range(6)] == [0] * 5 + [500]
    later = NOW + limit.interval_us - 1
    assert t.take("acme", limit, later) == 1
    later += 1
    assert t.take("acme", limit, later) == 0
    assert t.take("acme", limit, later) == 500
    # Long idle: a full bucket again, never more than burst.
    idle = later + 100 * limit.interval_us
    assert [t.take("acme", limit, idle) for _ in range(6)] == [0] * 5 + [500]


@pytest.mark.parametrize(
    ("rate", "interval_us"), [(0.5, 2_000_000), (2.5, 400_000), (0.001, 10**9), (1 / 3, 3_000_000)]
)
def test_fractional_rates(seg: Segment, rate: float, interval_us: int) -> None:
    t, _ = _table(seg)
    limit = Limit.of(rate=rate, burst=1)
    assert limit.interval_us == interval_us
    assert t.take("acme", limit, NOW) == 0
    assert t.take("acme", limit, NOW) == math.ceil(interval_us / 1000)
    assert t.take("acme", limit, NOW + interval_us - 1) == 1
    assert t.take("acme", limit, NOW + interval_us) == 0


def test_time_wraps_the_49_bit_field(seg: Segment) -> None:
    t, _ = _table(seg)
    limit = Limit(interval_us=100, burst=1)
    start = (1 << 49) - 50
    assert t.take("acme", limit, start) == 0
    assert t.take("acme", limit, start + 99) == 1
    assert t.take("acme", limit, start + 100) == 0  # past 2**49: the TAT word wrapped
    assert t.take("acme", limit, start + 100) == 1
    assert t.take("acme", limit, start + 200) == 0


def test_refund_gives_back_one_hook_never_more_than_the_bucket_holds(seg: Segment) -> None:
    t, _ = _table(seg)
    limit = Limit.of(rate=10, burst=3)
    assert [t.take("acme", limit, NOW) for _ in range(4)] == [0, 0, 0, 100]
    t.refund("acme", limit, NOW)
    assert [t.take("acme", limit, NOW) for _ in range(2)] == [0, 100]
    for _ in range(5):  # more refunds than charges: the bucket is full, and no fuller
        t.refund("acme", limit, NOW)
    assert [t.take("acme", limit, NOW) for _ in range(4)] == [0, 0, 0, 100]
    t.refund("nobody", limit, NOW)  # no bucket: nothing to give back, nothing claimed
    assert t.usage(NOW) == (1, 1)


def test_reset_gives_a_fresh_bucket(seg: Segment) -> None:
    t, _ = _table(seg)
    limit = Limit.of(rate=1, burst=2)
    assert [t.take("acme", limit, NOW) for _ in range(3)] == [0, 0, 1000]
    assert t.reset("acme") is True
    assert [t.take("acme", limit, NOW) for _ in range(3)] == [0, 0, 1000]
    assert t.reset("never-seen") is False


def _hit(i: int, name: str, n: int, now: int, start: Barrier) -> list[int]:
    with Segment.attach(name) as s:
        t = GcraTable(s.view, s.buf, s.layout)
        limit = Limit.of(rate=0.001, burst=50)
        start.wait(60)
        return [t.take("acme", limit, now) for _ in range(n)]


def test_processes_share_one_bucket(seg: Segment) -> None:
    got = run_children(PROCS, _hit, seg.name, HITS, NOW, CTX.Barrier(PROCS))
    answers = [a for per in got for a in per]
    assert len(answers) == PROCS * HITS
    assert answers.count(0) == 50  # exactly the burst, across all processes
    assert set(answers) - {0} == {1_000_000}  # every denial: one interval (1000 s) to wait
    # One interval later, exactly one more -- again across all processes.
    limit = Limit.of(rate=0.001, burst=50)
    got = run_children(PROCS, _hit, seg.name, 5, NOW + limit.interval_us, CTX.Barrier(PROCS))
    assert [a for per in got for a in per].count(0) == 1


def test_full_table_admits_and_counts_then_reuses_a_drained_slot(seg_name: str) -> None:
    params = segmod.make_params(queue_capacity=16, gcra_slots=16, process_slots=4)
    with Segment.create(seg_name, params) as s:
        t, row = _table(s)
        slow = Limit.of(rate=1, burst=5)
        for i in range(16):
            assert t.take(f"tenant-{i}", slow, NOW) == 0
        assert t.usage(NOW) == (16, 16)  # every slot held, every bucket still filling

        # No slot to be had: admitted, unmetered, and counted -- never refused.
        assert [t.take("newcomer", Limit.of(rate=1, burst=1), NOW) for _ in range(5)] == [0] * 5
        assert counters.totals(s.view, s.layout)[Counter.LIMITER_TABLE_FULL] == 5
        assert row.get(Counter.LIMITER_TABLE_FULL) == 5
        assert t.usage(NOW) == (16, 16)

        # A second later every bucket has drained: the newcomer takes one of those slots,
        # starts from a fresh bucket and is held to its own limit.
        later = NOW + slow.interval_us
        assert t.usage(later) == (16, 0)
        two = Limit.of(rate=1, burst=2)
        assert [t.take("newcomer", two, later) for _ in range(3)] == [0, 0, 1000]
        assert counters.totals(s.view, s.layout)[Counter.LIMITER_TABLE_FULL] == 5
        assert t.usage(later) == (16, 1)
        assert t.reset("newcomer") is True  # it has a slot of its own now


def test_usage_finds_the_few_slots_in_use_of_a_full_size_table(seg_name: str) -> None:
    """A default table (65,536 slots) with three tenants scattered through it: each is
    found, filling until its bucket drains, whatever its slot."""
    with Segment.create(seg_name, segmod.make_params()) as s:
        _usage_of_three(_table(s)[0])


def _usage_of_three(t: GcraTable) -> None:
    assert t.slots == 65_536
    assert t.usage(NOW) == (0, 0)
    slow = Limit.of(rate=1, burst=5)
    late = next(x for x in map(str, range(10_000)) if tenant_hash(x)[0] % t.slots > 60_000)
    tenants = ["alpha", "beta", late]  # one near the table's end, not only near its start
    for x in tenants:
        assert t.take(x, slow, NOW) == 0
    assert t.usage(NOW) == (3, 3)
    assert t.usage(NOW + slow.interval_us) == (3, 0)


def test_tenant_hash_is_stable_across_interpreters() -> None:
    key, tag = tenant_hash("acme")
    assert key == tenant_hash("acme")[0] and 0 < key < 1 << 63 and 0 < tag < 1 << 14
    expected = int.from_bytes(hashlib.blake2b(b"acme", digest_size=8).digest(), "little")
    assert key == expected & ((1 << 63) - 1)
    code = "from ankusa_shm.shm.gcra import tenant_hash; print(tenant_hash('acme')[0])"
    env = {**os.environ, "PYTHONHASHSEED": "12345"}  # unlike hash(), not seeded
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True
    )
    assert int(out.stdout) == key


# -- Limit.of -------------------------------------------------------------------------------


def test_limit_of_valid() -> None:
    assert Limit.of(100, 200) == Limit(10_000, 200)
    assert Limit.of(100, 200).span_us == 2_000_000
    assert Limit.of(1_000_000, 1).interval_us == 1


@pytest.mark.parametrize(
    ("rate", "burst", "match"),
    [
        (0.001, 10**8, "spans"),  # interval * burst past the 49-bit table
        (1e-7, 1_000_000, "spans|below"),
        (1e-9, 1, "spans|below"),
        (1e-320, 1, "below"),  # 1e6 / rate is infinite
        (0, 1, "positive"),
        (-1, 1, "positive"),
        (float("nan"), 1, "positive"),
        (True, 1, "positive"),
        ("5", 1, "positive"),
        (5e6, 1, "above"),
        (float("inf"), 1, "above"),
        (1, 0, "burst"),
        (1, -3, "burst"),
        (1, 1.5, "burst"),
        (1, True, "burst"),
    ],
)
def test_limit_of_refuses(rate: object, burst: object, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        Limit.of(rate, burst)  # type: ignore[arg-type]


def test_limit_span_fits_the_table() -> None:
    edge = Limit.of(1, MAX_SPAN_US // 1_000_000)
    assert edge.span_us <= MAX_SPAN_US
    with pytest.raises(ValueError):
        Limit.of(1, MAX_SPAN_US // 1_000_000 + 1)
