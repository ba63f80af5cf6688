"""Fleet admission against a real redis-server: one limit and one dedupe window for several
hosts, the scopes, round trips as the server counts them, and what faults do."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import re
import time
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from pathlib import Path

import pytest
import uvloop
from cut_proxy import cut_proxy
from fleet_helpers import (
    TENANT,
    TEST_TRAFFIC,
    FakeClock,
    Job,
    Worker,
    admit,
    await_until,
    bare,
    committed_values,
    dd_key,
    drain_all,
    fleet_config,
    fleet_raw,
    forked,
    open_fleet,
    pending_value,
    reset_stats,
    rl_key,
    run,
    run_workers,
    segments,
    stopped,
    total,
    totals,
    wait_until,
)
from redis_server import RedisServer, free_port

from ankusa_shm import config
from ankusa_shm.config import Config
from ankusa_shm.fleet.admission import (
    Admit,
    Admitted,
    Claim,
    DedupePending,
    Duplicate,
    Fleet,
    RateLimited,
)
from ankusa_shm.fleet.redis_store import RedisStore
from ankusa_shm.fleet.settle import NO_TOKEN
from ankusa_shm.hooks import Committed, NotStored
from ankusa_shm.shm import histograms, procs
from ankusa_shm.shm.counters import Counter
from ankusa_shm.shm.histograms import Histogram
from ankusa_shm.shm.procs import Role
from ankusa_shm.shm.segment import Segment
from ankusa_shm.shm.settle_queue import Op, Record

STORE_CALLS = (Counter.STORE_OK, Counter.STORE_ERROR, Counter.STORE_TIMEOUT)
SCRIPT_INNER = frozenset({"get", "set", "pttl", "time", "del"})  # counted inside scripts
FALLBACKS = (Counter.FALLBACK_RATE_LIMIT, Counter.FALLBACK_DEDUPE)


def claim_of(answer: Admitted) -> Claim:
    assert isinstance(answer, Admit), answer
    assert answer.claim is not None, answer
    return answer.claim


def promote_only(answer: Admitted, key: str) -> Claim:
    """Admitted with no call made (the breaker open): a claim on ``key`` with nothing in
    Redis to release, for the promote that follows a commit."""
    claim = claim_of(answer)
    assert (claim.key, claim.token) == (dd_key(key), NO_TOKEN), claim
    return claim


# -- one limit, one window ------------------------------------------------------------------


def test_one_limit_for_the_fleet(redis_server: RedisServer) -> None:
    burst = 25
    with segments(3) as segs:

        async def burst_of_40(w: Worker) -> list[Admitted]:
            return list(await asyncio.gather(*(w.admit(f"w{w.index}-{i}") for i in range(40))))

        cfgs = [fleet_config(redis_server.url, bare(s), rate=0.001, burst=burst) for s in segs]
        two_per_host = [Job(c, burst_of_40) for c in cfgs for _ in range(2)]
        answers = [a for got in run_workers(two_per_host) for a in got]

        assert len(answers) == 3 * 2 * 40
        admitted = [a for a in answers if isinstance(a, Admit)]
        assert len(admitted) == burst
        assert all(a.claim is not None for a in admitted)
        refused = [a for a in answers if not isinstance(a, Admit)]
        assert all(isinstance(a, RateLimited) and a.retry_ms >= 1 for a in refused), refused
        assert total(segs, Counter.ADMIT_OK) == burst
        assert total(segs, Counter.RATE_LIMIT_REJECTED) == len(refused)
        assert total(segs, Counter.STORE_OK) == len(answers)
        assert all(total(segs, c) == 0 for c in FALLBACKS)
    with redis_server.client() as r:  # a limited hook claimed nothing
        assert len(r.keys(b"*:dd:*")) == burst


def test_one_dedupe_window(redis_server: RedisServer) -> None:
    with segments(3) as segs:
        cfgs = [fleet_config(redis_server.url, bare(s)) for s in segs]

        async def race(w: Worker) -> list[Admitted]:
            return [await w.admit("evt-promote"), await w.admit("evt-release")]

        rounds = run_workers([Job(c, race) for c in cfgs])
        winners: dict[str, tuple[int, Claim]] = {}
        for k, key in enumerate(("evt-promote", "evt-release")):
            answers = [got[k] for got in rounds]
            won = [i for i, a in enumerate(answers) if isinstance(a, Admit)]
            assert len(won) == 1, answers
            claim = claim_of(answers[won[0]])
            assert claim.key == dd_key(key)
            losers = [a for i, a in enumerate(answers) if i != won[0]]
            assert all(isinstance(a, DedupePending) and a.retry_ms >= 1 for a in losers), answers
            winners[key] = (won[0], claim)

        async def settle_and_retry() -> None:
            async with AsyncExitStack() as stack:
                fleets = [
                    await stack.enter_async_context(open_fleet(c, s))
                    for c, s in zip(cfgs, segs, strict=True)
                ]
                host_p, claim_p = winners["evt-promote"]
                host_r, claim_r = winners["evt-release"]
                fleets[host_p].settle(claim_p, Committed("hook-1"))
                fleets[host_r].settle(claim_r, NotStored("disk full"))
                for c, s in zip(cfgs, segs, strict=True):
                    await drain_all(c, s)
                for f, c in zip(fleets, cfgs, strict=True):
                    assert await admit(f, c, "evt-promote") == Duplicate("hook-1")
                retrier = (host_r + 1) % 3
                retry = claim_of(await admit(fleets[retrier], cfgs[retrier], "evt-release"))
                assert retry.token != claim_r.token
                with redis_server.client() as r:
                    assert r.get(dd_key("evt-release")) == pending_value(retry.token)
                for i in range(3):
                    if i != retrier:
                        answer = await admit(fleets[i], cfgs[i], "evt-release")
                        assert isinstance(answer, DedupePending)

        run(settle_and_retry())


def test_unsettled_claim_expires(redis_server: RedisServer) -> None:
    with segments(2) as segs:
        cfgs = [fleet_config(redis_server.url, bare(s), pending_ttl_ms=1000) for s in segs]

        async def body() -> None:
            async with open_fleet(cfgs[0], segs[0]) as a, open_fleet(cfgs[1], segs[1]) as b:
                first = claim_of(await admit(a, cfgs[0], "evt"))
                held = await admit(b, cfgs[1], "evt")
                assert isinstance(held, DedupePending) and 1 <= held.retry_ms <= 1000
                await asyncio.sleep(1.2)
                second = claim_of(await admit(b, cfgs[1], "evt"))
                assert second.token != first.token
                with redis_server.client() as r:
                    assert r.get(dd_key("evt")) == pending_value(second.token)
                # The first host stored the hook after all: its late promote outlived its
                # claim and writes committed over b's pending claim, and b's own promote
                # then leaves the original in place.
                store = RedisStore.from_config(cfgs[0].fleet)
                try:
                    late = Record(Op.PROMOTE, first.key, first.token, b"late", 60_000, 0, 0)
                    assert await store.settle([late], 0) == (1, 0)
                    again = Record(Op.PROMOTE, second.key, second.token, b"b-copy", 60_000, 0, 0)
                    assert await store.settle([again], 0) == (0, 0)
                finally:
                    await store.close()
                with redis_server.client() as r:
                    assert r.get(dd_key("evt")) == b"c:late"
                assert await admit(b, cfgs[1], "evt") == Duplicate("late")

        run(body())


def test_duplicates_and_pending_are_not_charged(redis_server: RedisServer) -> None:
    with segments(2) as segs:
        cfgs = [fleet_config(redis_server.url, bare(s), rate=0.001, burst=3) for s in segs]

        async def body() -> None:
            async with open_fleet(cfgs[0], segs[0]) as a, open_fleet(cfgs[1], segs[1]) as b:
                done = claim_of(await admit(a, cfgs[0], "k1"))  # charge 1
                a.settle(done, Committed("hook-k1"))
                await drain_all(cfgs[0], segs[0])
                claim_of(await admit(a, cfgs[0], "k2"))  # charge 2, left pending
                for _ in range(5):
                    assert await admit(b, cfgs[1], "k1") == Duplicate("hook-k1")
                    assert isinstance(await admit(b, cfgs[1], "k2"), DedupePending)
                claim_of(await admit(b, cfgs[1], "k3"))  # charge 3: the burst
                for f, c in ((a, cfgs[0]), (b, cfgs[1])):
                    limited = await admit(f, c, "k4")
                    assert isinstance(limited, RateLimited) and limited.retry_ms >= 1

        run(body())
        with redis_server.client() as r:
            assert r.exists(dd_key("k4")) == 0  # a rate-limited hook claims nothing
        assert total(segs, Counter.ADMIT_DUPLICATE) == 5
        assert total(segs, Counter.ADMIT_DEDUPE_PENDING) == 5
        assert total(segs, Counter.RATE_LIMIT_REJECTED) == 2


def test_one_turns_hooks_are_answered_as_calls_of_their_own(redis_server: RedisServer) -> None:
    """Hooks admitted in one turn of the loop share a script call per tenant, and each gets
    the answer a call of its own, made in that order, would have: a committed key is a
    duplicate and a pending one is pending (neither charged), the same key twice is
    claimed once, the tenant's burst admits exactly that many, a limited hook claims
    nothing, and a hook without a key is charged and claims nothing. Another tenant's
    hooks in the same turn have their own bucket."""
    with segments(1) as (seg,):
        cfg = fleet_config(
            redis_server.url, bare(seg), rate=0.001, burst=5, tenants=("acme", "beta")
        )

        async def body() -> list[Admitted]:
            async with open_fleet(cfg, seg) as fleet:
                with redis_server.client() as r:
                    r.set(dd_key("done"), b"c:hook-done", px=60_000)
                    r.set(dd_key("held"), pending_value(b"x" * 16), px=60_000)
                    reset_stats(r)
                keys = ["done", "held", "k1", "k1", None, "k2", "k3", "k4", "k5", "k6"]
                acme = [admit(fleet, cfg, k) for k in keys]
                beta = [admit(fleet, cfg, f"b{i}", "beta") for i in range(3)]
                return list(await asyncio.gather(*acme, *beta))

        answers = run(body())
        assert answers[0] == Duplicate("hook-done")
        assert isinstance(answers[1], DedupePending) and answers[1].retry_ms > 50_000
        assert isinstance(answers[3], DedupePending)  # k1 again: claimed a moment ago
        assert answers[4] == Admit(None)  # no key: charged (#2), nothing claimed
        claims = [claim_of(a) for a in answers[5:8]]  # k2..k4: charges 3 to 5, the burst
        assert [c.key for c in claims] == [dd_key(k) for k in ("k2", "k3", "k4")]
        for limited in answers[8:10]:
            assert isinstance(limited, RateLimited) and limited.retry_ms >= 1
        assert all(isinstance(a, Admit) and a.claim for a in answers[10:])  # beta's own bucket
        stats = redis_server.commandstats()
        assert stats["evalsha"] == 2  # one call per tenant
        with redis_server.client() as r:
            assert r.exists(dd_key("k5"), dd_key("k6")) == 0  # limited hooks claim nothing
            assert r.get(dd_key("k1")) == pending_value(claim_of(answers[2]).token)
        assert totals(seg)[Counter.RATE_LIMIT_REJECTED] == 2


def test_long_event_keys_and_hooks_without_a_key(redis_server: RedisServer) -> None:
    long_key, edge_key = "x" * 300, "y" * 200
    hashed = b"sha256:" + hashlib.sha256(long_key.encode()).hexdigest().encode()
    with segments(2) as segs:
        cfgs = [fleet_config(redis_server.url, bare(s), rate=0.001, burst=4) for s in segs]

        async def body() -> None:
            async with open_fleet(cfgs[0], segs[0]) as a, open_fleet(cfgs[1], segs[1]) as b:
                long_claim = claim_of(await admit(a, cfgs[0], long_key))
                assert long_claim.key == dd_key("") + hashed
                assert claim_of(await admit(a, cfgs[0], edge_key)).key == dd_key(edge_key)
                a.settle(long_claim, Committed("hook-long"))
                await drain_all(cfgs[0], segs[0])
                assert await admit(b, cfgs[1], long_key) == Duplicate("hook-long")
                # no event key: nothing to claim, nothing to settle, but charged
                assert await admit(b, cfgs[1], None) == Admit(None)
                assert await admit(a, cfgs[0], None) == Admit(None)
                assert isinstance(await admit(b, cfgs[1], None), RateLimited)

        run(body())
        assert all(s.queue_depth() == 0 for s in segs)
        with redis_server.client() as r:
            assert sorted(r.keys(b"*:dd:*")) == sorted([dd_key("") + hashed, dd_key(edge_key)])


# -- scopes ---------------------------------------------------------------------------------


def test_rate_node_dedupe_fleet(redis_server: RedisServer) -> None:
    with segments(2) as segs:
        cfgs = [
            fleet_config(redis_server.url, bare(s), rate_scope="node", rate=0.001, burst=2)
            for s in segs
        ]

        async def body() -> None:
            async with open_fleet(cfgs[0], segs[0]) as a, open_fleet(cfgs[1], segs[1]) as b:
                assert a.state() == "closed"
                claim_of(await admit(a, cfgs[0], "k1"))
                claim_of(await admit(a, cfgs[0], "k2"))
                refused = await admit(a, cfgs[0], "k3")  # this host's bucket is empty
                assert isinstance(refused, RateLimited) and refused.retry_ms >= 1
                assert segs[0].queue_depth() == 1  # its claim is given back...
                with redis_server.client() as r:
                    assert r.get(dd_key("k3")).startswith(b"p:")
                await drain_all(cfgs[0], segs[0])
                with redis_server.client() as r:
                    assert r.exists(dd_key("k3")) == 0  # ...and released
                    assert r.exists(rl_key()) == 0  # no fleet bucket is kept
                # dedupe is still the fleet's; the other host's own bucket is full
                assert isinstance(await admit(b, cfgs[1], "k1"), DedupePending)
                claim_of(await admit(b, cfgs[1], "k3"))

        run(body())
        assert totals(segs[0])[Counter.SETTLED_RELEASE] == 1
        assert totals(segs[0])[Counter.RATE_LIMIT_REJECTED] == 1


def test_keyless_hook_with_node_rate_makes_no_store_call(redis_server: RedisServer) -> None:
    """Dedupe is the fleet's but the hook has no event key, and its rate limit is the
    host's: there is nothing to ask Redis, so nothing is asked."""
    with segments(1) as (seg,):
        cfg = fleet_config(redis_server.url, bare(seg), rate_scope="node", burst=2)
        with redis_server.client() as r:
            reset_stats(r)

        async def body() -> None:
            async with open_fleet(cfg, seg) as fleet:
                assert await admit(fleet, cfg, None) == Admit(None)
                assert await admit(fleet, cfg, None) == Admit(None)
                assert isinstance(await admit(fleet, cfg, None), RateLimited)

        run(body())
        assert set(redis_server.commandstats()) <= TEST_TRAFFIC
        assert all(totals(seg)[c] == 0 for c in (*STORE_CALLS, *FALLBACKS))


def test_rate_fleet_dedupe_node(redis_server: RedisServer) -> None:
    with segments(2) as segs:
        cfgs = [
            fleet_config(redis_server.url, bare(s), dedupe_scope="node", rate=0.001, burst=2)
            for s in segs
        ]

        async def body() -> None:
            async with open_fleet(cfgs[0], segs[0]) as a, open_fleet(cfgs[1], segs[1]) as b:
                assert await admit(a, cfgs[0], "k1") == Admit(None)
                assert await admit(b, cfgs[1], "k1") == Admit(None)  # the store's index decides
                limited = await admit(b, cfgs[1], "k2")  # one bucket for both hosts
                assert isinstance(limited, RateLimited) and limited.retry_ms >= 1
                a.settle(None, Committed("nothing to settle"))
                assert segs[0].queue_depth() == 0

        run(body())
        with redis_server.client() as r:
            assert r.keys(b"*:dd:*") == []
            assert r.exists(rl_key()) == 1


def test_both_node_makes_no_store_call(redis_server: RedisServer) -> None:
    with segments(1) as (seg,):
        cfg = fleet_config(
            redis_server.url, bare(seg), rate_scope="node", dedupe_scope="node", burst=2
        )
        with redis_server.client() as r:
            reset_stats(r)

        async def body() -> None:
            store = RedisStore.from_config(cfg.fleet)  # given, and never used
            async with open_fleet(cfg, seg, store=store) as fleet:
                assert fleet.state() == "down"
                assert not fleet.degraded("rate_limit") and not fleet.degraded("dedupe")
                assert await admit(fleet, cfg, "k1") == Admit(None)
                assert await admit(fleet, cfg, "k1") == Admit(None)
                limited = await admit(fleet, cfg, "k2")
                assert isinstance(limited, RateLimited) and limited.retry_ms >= 1

        run(body())
        assert set(redis_server.commandstats()) <= TEST_TRAFFIC
        assert all(totals(seg)[c] == 0 for c in STORE_CALLS)


def test_reset_tenant_forgets_fleet_and_node_buckets(redis_server: RedisServer) -> None:
    with segments(1) as (seg,):
        cfg = fleet_config(redis_server.url, bare(seg), rate=0.001, burst=1)

        async def body() -> None:
            async with open_fleet(cfg, seg) as fleet:
                claim_of(await admit(fleet, cfg, "k1"))
                assert isinstance(await admit(fleet, cfg, "k2"), RateLimited)
                await fleet.reset_tenant("acme")
                claim_of(await admit(fleet, cfg, "k2"))

        run(body())


def test_a_bucket_left_ahead_by_a_clock_step_holds_a_tenant_one_interval(
    redis_server: RedisServer,
) -> None:
    """The bucket is kept in the server's microseconds: after its clock is stepped back
    an hour, a tenant's TAT stands an hour and a burst ahead of it, and every host refused
    the tenant for the hour. It counts as a full burst ahead: one interval."""
    with segments(1) as (seg,):
        cfg = fleet_config(redis_server.url, bare(seg), rate=10, burst=5)  # 100 ms apart
        with redis_server.client() as r:
            seconds, micros = r.time()
            r.set(rl_key(), seconds * 1_000_000 + micros + 3_600_000_000 + 500_000)

        async def body() -> tuple[Admitted, Admitted]:
            async with open_fleet(cfg, seg) as fleet:
                limited = await admit(fleet, cfg, "k1")
                await asyncio.sleep(0.15)
                return limited, await admit(fleet, cfg, "k2")

        limited, later = run(body())
        assert isinstance(limited, RateLimited) and limited.retry_ms <= 101, limited
        claim_of(later)


# -- round trips as the server counts them ----------------------------------------------------


def test_one_evalsha_per_hook_at_most_and_one_per_turn(redis_server: RedisServer) -> None:
    """A hook admitted alone costs one script call; the hooks of one turn of the loop
    share one."""
    with segments(1) as (seg,):
        cfg = fleet_config(redis_server.url, bare(seg))

        async def body() -> None:
            async with open_fleet(cfg, seg) as fleet:
                claim_of(await admit(fleet, cfg, "warm"))  # loads the script
                with redis_server.client() as r:
                    reset_stats(r)
                for i in range(20):
                    claim_of(await admit(fleet, cfg, f"k{i}"))
                await asyncio.gather(*(admit(fleet, cfg, f"g{i}") for i in range(20)))

        run(body())
        stats = redis_server.commandstats()
        assert stats.pop("evalsha") == 20 + 1
        assert set(stats) <= TEST_TRAFFIC | SCRIPT_INNER  # no EVAL, nothing outside a script


def test_ten_thousand_settlements_in_few_round_trips(redis_server: RedisServer) -> None:
    n = 10_000
    with segments(1, queue_capacity=16_384) as (seg,):
        cfg = fleet_config(redis_server.url, bare(seg), settle_batch_max=1000)

        async def body() -> None:
            async with open_fleet(cfg, seg) as fleet:
                claims: list[Claim] = []
                for start in range(0, n, 500):
                    answers = await asyncio.gather(
                        *(admit(fleet, cfg, f"k{i}") for i in range(start, start + 500))
                    )
                    claims += map(claim_of, answers)
                for i, c in enumerate(claims):
                    fleet.settle(c, Committed(f"hook-{i}"))
            assert seg.queue_depth() == n
            with redis_server.client() as r:
                reset_stats(r)
            await drain_all(cfg, seg)

        run(body())
        stats = redis_server.commandstats()
        counted = totals(seg)
        assert seg.queue_depth() == 0
        assert stats.get("evalsha", 0) + stats.get("eval", 0) <= 100, stats
        assert 0 < counted[Counter.DRAIN_ROUND_TRIPS] <= 100
        assert counted[Counter.SETTLED_PROMOTE] == n
        assert counted[Counter.SETTLE_DROPPED] == 0
        with redis_server.client() as r:
            values = committed_values(r, [dd_key(f"k{i}") for i in range(n)])
        assert values == [f"c:hook-{i}".encode() for i in range(n)]


# -- faults ---------------------------------------------------------------------------------

BUDGET_S = (50 + 250) / 1000  # timeout_ms plus a generous margin for a noisy machine


def breaker_config(server: RedisServer, seg: Segment, timeout_ms: int = 50) -> Config:
    """50 ms budget; the breaker opens once 5 calls in its window failed."""
    return fleet_config(
        server.url,
        bare(seg),
        timeout_ms=timeout_ms,
        breaker_min_calls=5,
        breaker_failure_rate=0.5,
        breaker_window_ms=10_000,
        breaker_open_ms=1000,
    )


@asynccontextmanager
async def breaker_fleets(
    server: RedisServer, seg: Segment, clock: FakeClock
) -> AsyncIterator[tuple[Config, Fleet, Fleet]]:
    """Two fleets of one host sharing one store (one connection) and the breaker: ``fast``
    has the 50 ms budget under test; ``patient`` (5 s) warms up and probes, so neither
    can run out of budget by accident on a loaded machine. The warm-up call leaves the
    breaker's window before the test goes on."""
    cfg = breaker_config(server, seg)
    store = RedisStore.from_config(cfg.fleet)
    async with (
        open_fleet(cfg, seg, clock=clock, store=store) as fast,
        open_fleet(breaker_config(server, seg, 5000), seg, clock=clock, store=store) as patient,
    ):
        claim_of(await admit(patient, cfg, "warm"))  # connects, loads the script
        clock.advance(20_000)
        yield cfg, fast, patient


async def timed(fleet: Fleet, cfg: Config, key: str) -> Admitted:
    """Admit, and check the answer came within the budget."""
    t0 = time.perf_counter()
    answer = await admit(fleet, cfg, key)
    took = time.perf_counter() - t0
    assert took < BUDGET_S, f"admit took {took:.3f} s"
    return answer


async def fail_until_open(fleet: Fleet, cfg: Config, seg: Segment, clock: FakeClock) -> list[Claim]:
    """With the store unreachable: 5 failed calls, each answered node-local within the
    budget, open the breaker; then admits make no store call at all. The claims of the
    5 hooks admitted while open."""
    for i in range(5):
        assert fleet.state() == "closed"
        claim_of(await timed(fleet, cfg, f"down-{i}"))  # node-local; the claim is kept
        clock.advance(1)
    assert fleet.state() == "open"
    assert fleet.degraded("rate_limit") and fleet.degraded("dedupe")
    before = totals(seg)
    assert sum(before[c] for c in STORE_CALLS[1:]) == 5
    assert all(before[c] == 5 for c in FALLBACKS)
    claims = []
    for i in range(5):
        claims.append(promote_only(await timed(fleet, cfg, f"open-{i}"), f"open-{i}"))
        clock.advance(1)
    after = totals(seg)
    assert all(after[c] == before[c] for c in STORE_CALLS)
    assert all(after[c] == 10 for c in FALLBACKS)
    assert after[Counter.BREAKER_TO_OPEN] == 1
    return claims


async def probe_closes(fleet: Fleet, cfg: Config, server: RedisServer, clock: FakeClock) -> None:
    """After breaker_open_ms the next admit is the probe; it succeeds and closes."""
    clock.advance(1000)
    probe = claim_of(await admit(fleet, cfg, "probe"))
    assert fleet.state() == "closed"
    assert not fleet.degraded("rate_limit") and not fleet.degraded("dedupe")
    with server.client() as r:
        assert r.get(dd_key("probe")) == pending_value(probe.token)
    assert isinstance(await admit(fleet, cfg, "probe"), DedupePending)


def test_stopped_server_costs_the_budget_and_opens_the_breaker(redis_server: RedisServer) -> None:
    with segments(1) as (seg,):
        clock = FakeClock()

        async def body() -> None:
            async with breaker_fleets(redis_server, seg, clock) as (cfg, fast, patient):
                with redis_server.client() as r:
                    reset_stats(r)
                with stopped(redis_server.pid):
                    await fail_until_open(fast, cfg, seg, clock)
                    assert totals(seg)[Counter.STORE_TIMEOUT] == 5
                await asyncio.sleep(0.3)  # the late replies come in, and are dropped
                assert redis_server.commandstats().get("evalsha", 0) <= 5
                await probe_closes(patient, cfg, redis_server, clock)

        run(body())
        counted = totals(seg)
        assert counted[Counter.BREAKER_TO_OPEN] == 1
        assert counted[Counter.BREAKER_TO_PROBING] == 1
        assert counted[Counter.BREAKER_TO_CLOSED] == 1


def test_hooks_stored_while_the_breaker_was_open_join_the_fleet_window(
    redis_server: RedisServer,
) -> None:
    """No call is made while the breaker is open, yet every hook stored meanwhile is
    promoted once Redis answers again: a resend of its event, to any host, is then a
    duplicate of it and not a second copy. One that was not stored queues nothing: there
    is nothing in Redis to release."""
    with segments(1) as (seg,):
        clock = FakeClock()

        async def body() -> None:
            async with breaker_fleets(redis_server, seg, clock) as (cfg, fast, patient):
                with stopped(redis_server.pid):
                    claims = await fail_until_open(fast, cfg, seg, clock)
                    queued = seg.queue_depth()
                    for i, claim in enumerate(claims[:4]):
                        fast.settle(claim, Committed(f"hook-{i}"))
                    fast.settle(claims[4], NotStored("store_unavailable"))
                    assert seg.queue_depth() == queued + 4
                await asyncio.sleep(0.3)
                await probe_closes(patient, cfg, redis_server, clock)
                await drain_all(cfg, seg)
                for i in range(4):
                    assert await admit(patient, cfg, f"open-{i}") == Duplicate(f"hook-{i}")
                claim_of(await admit(patient, cfg, "open-4"))  # never stored: free to claim

        run(body())
        assert totals(seg)[Counter.SETTLE_DROPPED] == 0


def test_every_store_call_is_timed_against_its_budget(redis_server: RedisServer) -> None:
    """Answered calls are timed as they took; calls to a stopped server as the budget they
    ran out of. With ``request_metrics`` off, none is kept."""
    budget_ms = 200
    with segments(2) as (seg, quiet):

        def calls(s: Segment) -> histograms.Totals:
            return histograms.totals(s.view, s.layout)[Histogram.FLEET_CALL]

        def over(t: histograms.Totals, ms: float) -> int:
            """Observations in buckets above the largest bound of at most ``ms``."""
            under = max((n for le, n in t.cumulative() if le * 1000 <= ms), default=0)
            return t.count - under

        async def body() -> None:
            cfg = fleet_config(redis_server.url, bare(seg), timeout_ms=budget_ms)
            async with open_fleet(cfg, seg) as fleet:
                assert isinstance(await admit(fleet, cfg, "connects"), Admit)
                first = calls(seg)
                assert first.count == 1
                for i in range(20):
                    assert isinstance(await admit(fleet, cfg, f"timed-{i}"), Admit)
                answered = calls(seg)
                assert answered.count == 21 == totals(seg)[Counter.STORE_OK]
                assert over(answered, budget_ms / 2) - over(first, budget_ms / 2) == 0
                with stopped(redis_server.pid):
                    for i in range(3):
                        assert isinstance(await admit(fleet, cfg, f"late-{i}"), Admit)
                timed_out = calls(seg)
                assert timed_out.count == 24
                assert totals(seg)[Counter.STORE_TIMEOUT] == 3
                assert over(timed_out, budget_ms / 2) - over(answered, budget_ms / 2) == 3
                # each gave up a little before the budget, to answer node-local within it
                late_s = cfg.fleet.call_deadline_s - 0.002
                assert timed_out.sum - answered.sum >= 3 * late_s * 1e9
            raw = fleet_raw(redis_server.url, bare(quiet), timeout_ms=budget_ms)
            raw["server"]["request_metrics"] = False
            off = config.parse(raw, "fleet-test")
            async with open_fleet(off, quiet) as fleet:
                assert isinstance(await admit(fleet, off, "untimed"), Admit)
            assert totals(quiet)[Counter.STORE_OK] == 1
            assert calls(quiet).count == 0

        run(body())


def test_one_probe_at_a_time_and_a_failed_probe_reopens(redis_server: RedisServer) -> None:
    with segments(1) as (seg,):
        clock = FakeClock()

        async def body() -> None:
            async with breaker_fleets(redis_server, seg, clock) as (cfg, fast, patient):
                with stopped(redis_server.pid):
                    await fail_until_open(fast, cfg, seg, clock)
                    clock.advance(1000)
                    probe = asyncio.ensure_future(timed(fast, cfg, "probe-1"))
                    await asyncio.sleep(0.01)
                    assert fast.state() == patient.state() == "probing"
                    before = totals(seg)
                    # one probe at a time: the other worker makes no call
                    promote_only(await timed(patient, cfg, "meanwhile"), "meanwhile")
                    assert all(totals(seg)[c] == before[c] for c in STORE_CALLS)
                    claim_of(await probe)  # timed out: answered node-local
                    assert fast.state() == "open"  # a failed probe opens it again
                    assert fast.degraded("rate_limit") and fast.degraded("dedupe")
                    promote_only(await timed(patient, cfg, "still-open"), "still-open")
                await asyncio.sleep(0.3)
                await probe_closes(patient, cfg, redis_server, clock)

        run(body())
        counted = totals(seg)
        assert counted[Counter.BREAKER_TO_OPEN] == 2
        assert counted[Counter.BREAKER_TO_PROBING] == 2
        assert counted[Counter.BREAKER_TO_CLOSED] == 1
        assert counted[Counter.STORE_TIMEOUT] == 6


def _probe_forever(seg_name: str, cfg: Config) -> None:
    """A worker whose admit becomes the probe and hangs on a stopped server."""
    seg = Segment.attach(seg_name)
    slot = procs.claim(seg.view, seg.layout, Role.WORKER)

    async def main() -> None:
        async with open_fleet(cfg, seg) as fleet:
            await admit(fleet, cfg, "doomed-probe")

    uvloop.run(main())
    slot.release()


def test_probe_of_a_killed_worker_is_taken_over(redis_server: RedisServer) -> None:
    with segments(1) as (seg,):
        cfg = fleet_config(
            redis_server.url,
            bare(seg),
            timeout_ms=3000,
            breaker_min_calls=3,
            breaker_failure_rate=0.5,
            breaker_open_ms=200,
        )

        async def open_it(fleet: Fleet) -> None:
            redis_server.kill()
            for i in range(3):  # refused at once: the breaker opens
                claim_of(await admit(fleet, cfg, f"down-{i}"))
            assert fleet.state() == "open"

        async def take_over(fleet: Fleet) -> None:
            assert fleet.state() == "probing"  # held by a dead worker
            claim_of(await admit(fleet, cfg, "taken-over"))
            assert fleet.state() == "closed"

        async def body() -> None:
            async with open_fleet(cfg, seg) as fleet:
                await open_it(fleet)
                redis_server.start()
                with stopped(redis_server.pid):
                    await asyncio.sleep(0.3)  # past breaker_open_ms
                    with forked(_probe_forever, bare(seg), cfg) as kid:
                        await await_until(lambda: fleet.state() == "probing", "the probe")
                        kid.kill()
                        kid.join(10)
                await take_over(fleet)

        run(body())
        assert totals(seg)[Counter.BREAKER_TO_CLOSED] == 1


def test_killed_and_restarted_server(redis_server: RedisServer) -> None:
    with segments(1) as (seg,):
        clock = FakeClock()

        async def body() -> None:
            async with breaker_fleets(redis_server, seg, clock) as (cfg, fast, patient):
                redis_server.kill()
                await fail_until_open(fast, cfg, seg, clock)
                assert totals(seg)[Counter.STORE_ERROR] == 5
                redis_server.start()  # same port, empty: no data, no script cache
                await asyncio.sleep(0.3)  # past the client's reconnect pause
                await probe_closes(patient, cfg, redis_server, clock)

        run(body())
        stats = redis_server.commandstats()
        assert "eval" not in stats  # the new connection loaded the scripts as it greeted
        assert stats.get("script|load") == 2
        assert stats.get("evalsha") == 2  # the probe, and the same event again
        assert totals(seg)[Counter.BREAKER_TO_CLOSED] == 1


def test_full_settle_queue_drops_and_counts(redis_server: RedisServer) -> None:
    with segments(1, queue_capacity=16) as (seg,):
        cfg = fleet_config(redis_server.url, bare(seg), settle_queue_size=16)

        async def body() -> None:
            async with open_fleet(cfg, seg) as fleet:
                claims = [claim_of(await admit(fleet, cfg, f"k{i}")) for i in range(30)]
                for i, c in enumerate(claims):
                    fleet.settle(c, Committed(f"hook-{i}"))
                assert seg.queue_depth() == 16
                assert totals(seg)[Counter.SETTLE_DROPPED] == 14
                fleet.settle(claims[0], NotStored("overloaded"))
                fleet.release(claims[1])
                fleet.promote(claims[2], "hook-2")
                assert totals(seg)[Counter.SETTLE_DROPPED] == 17
                claim_of(await admit(fleet, cfg, "after"))  # admits are unaffected
                await drain_all(cfg, seg)

        run(body())
        counted = totals(seg)
        assert counted[Counter.SETTLE_ENQUEUED] == 16
        assert counted[Counter.SETTLE_DROPPED] == 17
        assert counted[Counter.SETTLED_PROMOTE] == 16
        with redis_server.client() as r:
            values = committed_values(r, [dd_key(f"k{i}") for i in range(30)])
        assert values[:16] == [f"c:hook-{i}".encode() for i in range(16)]
        assert all(v is not None and v.startswith(b"p:") for v in values[16:])


def test_timed_out_calls_never_corrupt_later_replies(redis_server: RedisServer) -> None:
    with segments(2) as segs:
        fast_cfg = fleet_config(redis_server.url, bare(segs[0]), timeout_ms=50)
        slow_cfg = fleet_config(redis_server.url, bare(segs[0]))
        other_cfg = fleet_config(redis_server.url, bare(segs[1]))

        async def body() -> None:
            store = RedisStore.from_config(slow_cfg.fleet)  # one connection for both fleets
            async with (
                open_fleet(fast_cfg, segs[0], store=store) as fast,
                open_fleet(slow_cfg, segs[0], store=store) as slow,
                open_fleet(other_cfg, segs[1]) as other,
            ):
                done = claim_of(await admit(slow, slow_cfg, "dup"))
                slow.settle(done, Committed("hook-dup"))
                await drain_all(slow_cfg, segs[0])
                claim_of(await admit(other, other_cfg, "held"))
                for cycle in range(3):
                    with stopped(redis_server.pid):
                        lost = await asyncio.gather(
                            *(admit(fast, fast_cfg, f"lost-{cycle}-{j}") for j in range(3))
                        )
                    # written while the late replies are still on the wire
                    a, dup, b, held = await asyncio.gather(
                        admit(slow, slow_cfg, f"new-{cycle}-a"),
                        admit(slow, slow_cfg, "dup"),
                        admit(slow, slow_cfg, f"new-{cycle}-b"),
                        admit(slow, slow_cfg, "held"),
                    )
                    assert claim_of(a).key == dd_key(f"new-{cycle}-a")
                    assert claim_of(b).key == dd_key(f"new-{cycle}-b")
                    assert dup == Duplicate("hook-dup")
                    assert isinstance(held, DedupePending)
                    # the timed-out calls ran late; their claims were handed back
                    with redis_server.client() as r:
                        for j, answer in enumerate(lost):
                            key = dd_key(f"lost-{cycle}-{j}")
                            assert r.get(key) == pending_value(claim_of(answer).token)

        run(body())
        assert totals(segs[0])[Counter.STORE_TIMEOUT] == 9


@pytest.mark.parametrize("cut_before_run", [True, False], ids=["call-lost", "reply-lost"])
def test_an_admit_whose_connection_drops_is_sent_once_more(
    redis_server: RedisServer, cut_before_run: bool, caplog: pytest.LogCaptureFixture
) -> None:
    """The connection drops under a turn's call, before the server has it or after it ran:
    sent again on a new connection, the hooks are answered by the fleet, not this host,
    and the run whose reply was lost is taken for what it did, not charged twice."""
    caplog.set_level(logging.INFO, "ankusa_shm.fleet")
    with segments(1) as (seg,):

        async def body() -> list[Admitted]:
            async with cut_proxy(
                ("127.0.0.1", redis_server.port), cut_before_run=cut_before_run
            ) as proxy:
                cfg = fleet_config(proxy.url, bare(seg), rate=0.001, burst=3)
                async with open_fleet(cfg, seg) as fleet:
                    await fleet.reset_tenant(TENANT)  # connected before any admit
                    with redis_server.client() as r:
                        reset_stats(r)
                    first = await asyncio.gather(admit(fleet, cfg, "a"), admit(fleet, cfg, "b"))
                    assert proxy.made == 1
                    return [*first, await admit(fleet, cfg, "c"), await admit(fleet, cfg, "d")]

        a, b, c, d = run(body())
        with redis_server.client() as r:  # claimed once each, and charged once each
            for key, answer in (("a", a), ("b", b), ("c", c)):
                assert r.get(dd_key(key)) == pending_value(claim_of(answer).token)
            assert isinstance(d, RateLimited), d
        assert redis_server.commandstats()["evalsha"] == (3 if cut_before_run else 4)
        counted = totals(seg)
        assert counted[Counter.STORE_OK] == 4 and counted[Counter.STORE_ERROR] == 0
        assert all(counted[kind] == 0 for kind in FALLBACKS)
        assert "sending its admit calls once more" in caplog.text


def test_an_admit_call_is_sent_again_only_once(redis_server: RedisServer) -> None:
    """A call whose second connection drops too is answered by this host: a server that
    keeps dropping its clients is a failing store, not a reason to loop."""
    with segments(1) as (seg,):

        async def body() -> Admitted:
            upstream = ("127.0.0.1", redis_server.port)
            async with cut_proxy(upstream, cut_before_run=True, cuts=2) as proxy:
                cfg = fleet_config(proxy.url, bare(seg))
                async with open_fleet(cfg, seg) as fleet:
                    await fleet.reset_tenant(TENANT)
                    answer = await admit(fleet, cfg, "a")
                    assert proxy.made == 2
                    return answer

        answer = run(body())
        assert isinstance(answer, Admit)
        counted = totals(seg)
        assert counted[Counter.STORE_ERROR] == 1 and counted[Counter.STORE_OK] == 0
        assert all(counted[c] == 1 for c in FALLBACKS)


def test_a_hook_with_no_event_key_falls_back_on_its_rate_limit_only(
    redis_server: RedisServer,
) -> None:
    """A keyless hook had no fleet dedupe to answer node-local: counted as a dedupe
    fallback, it inflated the figure, and set the dedupe degraded flag with none done."""
    with segments(1) as (seg,):
        cfg = fleet_config(redis_server.url, bare(seg), timeout_ms=50, breaker_window_ms=1000)

        async def keyless(w: Worker) -> list[Admitted]:
            return [await w.admit(None) for _ in range(3)] + [await w.admit("keyed")]

        with stopped(redis_server.pid):
            (answers,) = run_workers([Job(cfg, keyless)], warm=False)
        assert all(isinstance(a, Admit) for a in answers)
        assert totals(seg)[Counter.FALLBACK_RATE_LIMIT] == 4
        assert totals(seg)[Counter.FALLBACK_DEDUPE] == 1


def test_degraded_warning_once_per_host(redis_server: RedisServer, tmp_path: Path) -> None:
    with segments(1) as (seg,):
        cfg = fleet_config(redis_server.url, bare(seg), timeout_ms=50, breaker_window_ms=1000)

        async def fall_back(w: Worker) -> list[Admitted]:
            return [await w.admit(f"w{w.index}-{i}") for i in range(5)]

        logs = [tmp_path / f"worker-{i}.log" for i in range(2)]
        with stopped(redis_server.pid):
            answers = run_workers([Job(cfg, fall_back, log) for log in logs], warm=False)
        assert all(isinstance(a, Admit) for got in answers for a in got)
        assert totals(seg)[Counter.FALLBACK_RATE_LIMIT] == 10
        assert totals(seg)[Counter.FALLBACK_DEDUPE] == 10
        lines = [ln for log in logs for ln in log.read_text().splitlines() if "node-local" in ln]
        for kind in ("rate_limit", "dedupe"):
            assert len([ln for ln in lines if re.search(rf"\b{kind}\b", ln)]) == 1, lines
        assert all(" WARNING " in ln for ln in lines)
        assert all("had no answer within 50 ms" in ln for ln in lines), lines

        # Back: the first call answered a breaker window after the last failure says so,
        # once per kind, and the calls after it are silent.
        time.sleep(1.0)

        async def answered(w: Worker) -> list[Admitted]:
            return [await w.admit(f"w{w.index}-back-{i}") for i in range(5)]

        answers = run_workers([Job(cfg, answered, log) for log in logs])
        assert all(isinstance(a, Admit) for got in answers for a in got)
        lines = [ln for log in logs for ln in log.read_text().splitlines() if " again" in ln]
        for kind in ("rate_limit", "dedupe"):
            assert len([ln for ln in lines if re.search(rf"\b{kind}\b", ln)]) == 1, lines
        assert all(" INFO " in ln and "answers again" in ln for ln in lines)


def test_the_warning_says_why_the_call_failed(tmp_path: Path) -> None:
    """A store that refuses the connection is named with the reason, not only "failed"."""
    with segments(1) as (seg,):
        cfg = fleet_config(f"redis://127.0.0.1:{free_port()}", bare(seg), timeout_ms=200)

        async def one(w: Worker) -> Admitted:
            return await w.admit("k")

        log = tmp_path / "worker.log"
        (answer,) = run_workers([Job(cfg, one, log)], warm=False)
        claim_of(answer)  # answered node-local
        lines = [ln for ln in log.read_text().splitlines() if "node-local" in ln]
        assert lines and all("call failed (" in ln and "cannot connect" in ln for ln in lines)


def test_flushed_script_cache_is_reloaded_once_per_burst(redis_server: RedisServer) -> None:
    """SCRIPT FLUSH under 64 concurrent admits of 8 tenants (8 script calls in one round
    trip): one SCRIPT LOAD per burst on the one connection, every call repeats its EVALSHA,
    no full-source EVAL, and every admit is answered by the fleet (the breaker has nothing
    to count)."""
    flushes, burst = 5, 64
    tenants = [f"t{i}" for i in range(8)]
    with segments(1) as (seg,):
        cfg = fleet_config(redis_server.url, bare(seg), tenants=tenants, breaker_min_calls=20)

        async def body() -> None:
            async with open_fleet(cfg, seg) as fleet:
                claim_of(await admit(fleet, cfg, "warm", "t0"))  # connected, scripts loaded
                with redis_server.client() as r:
                    reset_stats(r)
                    for round_ in range(flushes):
                        r.script_flush()
                        asks = [
                            admit(fleet, cfg, f"r{round_}-{i}", tenants[i % 8])
                            for i in range(burst)
                        ]
                        answers = await asyncio.gather(*asks)
                        assert all(isinstance(a, Admit) and a.claim for a in answers), answers

        run(body())
        stats = redis_server.commandstats()
        assert "eval" not in stats
        assert stats.get("script|load") == 2 * flushes  # both scripts, once per flush
        assert stats.get("evalsha") == 2 * flushes * len(tenants)  # each call, then again
        counted = totals(seg)
        assert counted[Counter.STORE_OK] == 1 + flushes * burst
        assert counted[Counter.STORE_ERROR] == counted[Counter.STORE_TIMEOUT] == 0
        assert counted[Counter.BREAKER_TO_OPEN] == 0


@pytest.mark.parametrize("refusal", ["OOM", "READONLY"])
def test_a_store_that_refuses_writes_still_answers_what_it_holds(
    redis_server: RedisServer, caplog: pytest.LogCaptureFixture, refusal: str
) -> None:
    """Redis at its maxmemory under noeviction (-OOM), or a replica (-READONLY), refuses
    writes and still answers reads. Before, every call with a hook to claim failed whole,
    a committed event in the same turn included, and the breaker opened, so a resend to
    another host of an event the fleet holds was stored again. Now each hook is judged as
    ever: the committed event is a duplicate, a new one is admitted node-local with a
    promote to follow, nothing is written, and the breaker stays closed."""
    held = {dd_key("old"): b"c:hook-old"}
    with contextlib.ExitStack() as stack, segments(1) as (seg,):
        redis_server.client().set(dd_key("old"), held[dd_key("old")], px=600_000)
        if refusal == "OOM":
            server = redis_server
            server.client().config_set("maxmemory", 1)  # noeviction is the default policy
            stack.callback(lambda: redis_server.client().config_set("maxmemory", 0))
        else:
            server = stack.enter_context(contextlib.closing(RedisServer()))
            server.client().replicaof("127.0.0.1", redis_server.port)
            replica = server.client()
            wait_until(lambda: replica.get(dd_key("old")) == b"c:hook-old", what="replicated")
        cfg = fleet_config(server.url, bare(seg), breaker_min_calls=4)

        async def body() -> tuple[list[Admitted], list[Admitted], Admitted, str]:
            async with open_fleet(cfg, seg) as fleet:
                first = await asyncio.gather(  # one turn: one call
                    *(admit(fleet, cfg, k) for k in ("old", "new-1", "new-2"))
                )
                later = [await admit(fleet, cfg, f"more-{i}") for i in range(10)]
                again = await admit(fleet, cfg, "old")
                return list(first), later, again, fleet.state()

        first, later, again, state = run(body())
        written = server.client().mget([dd_key("new-1"), dd_key("more-0"), rl_key()])
        counted = totals(seg)
    assert first[0] == again == Duplicate("hook-old")
    promote_only(first[1], "new-1")
    promote_only(first[2], "new-2")
    for i, answer in enumerate(later):
        promote_only(answer, f"more-{i}")
    assert state == "closed"
    assert written == [None, None, None]
    assert counted[Counter.STORE_OK] == 14 and counted[Counter.STORE_ERROR] == 0
    assert counted[Counter.FALLBACK_DEDUPE] == counted[Counter.FALLBACK_RATE_LIMIT] == 12
    assert f"the fleet store refuses writes ({refusal}" in caplog.text
