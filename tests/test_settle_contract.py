"""What settling promises, whatever Redis did meanwhile: a hook this host committed is
``committed`` in Redis for its dedupe window once Redis is reachable again, and a release
is dropped only when its claim has certainly expired.

The stalls here are longer than ``pending_ttl_ms``, with a real redis-server SIGSTOPped:
an admit that timed out stays in the server's socket buffer and runs when the server
resumes, writing its pending claim long after admission gave up on it.
"""

from __future__ import annotations

import asyncio

from fleet_helpers import (
    admit,
    await_until,
    bare,
    dd_key,
    drain_all,
    fleet_config,
    open_fleet,
    run,
    segments,
    stopped,
    totals,
)
from redis_server import RedisServer

from ankusa_shm.config import Config
from ankusa_shm.fleet.admission import Admit, Admitted, Claim, Duplicate, Fleet
from ankusa_shm.fleet.settle import UNKNOWN
from ankusa_shm.hooks import CommitResult, Committed, NotStored
from ankusa_shm.shm.counters import Counter

PENDING_TTL_MS = 1_000
STALL_S = 1.5  # longer than the pending TTL, the budget and the drainer's patience


def stall_config(server: RedisServer, seg_name: str) -> Config:
    return fleet_config(server.url, seg_name, timeout_ms=200, pending_ttl_ms=PENDING_TTL_MS)


def claim_of(answer: Admitted) -> Claim:
    assert isinstance(answer, Admit) and answer.claim is not None, answer
    return answer.claim


def value(server: RedisServer, key: bytes) -> bytes | None:
    with server.client() as r:
        v: bytes | None = r.get(key)
        return v


async def stalled_admit(
    fleet: Fleet, cfg: Config, server: RedisServer, result: CommitResult
) -> Claim:
    """Admit event ``evt`` while the server is stopped for longer than the pending TTL and
    settle it with ``result``; return once the late call has run and written its claim."""
    claim_of(await admit(fleet, cfg, "warm"))  # connected before the stall
    with stopped(server.pid):
        claim = claim_of(await admit(fleet, cfg, "evt"))
        assert claim.claimed_ms == UNKNOWN  # timed out: the server may yet run it
        fleet.settle(claim, result)
        await asyncio.sleep(STALL_S)
    await await_until(lambda: value(server, dd_key("evt")) is not None, "the late claim")
    return claim


def test_promote_after_a_stall_longer_than_the_pending_ttl(redis_server: RedisServer) -> None:
    with segments(1) as (seg,):
        cfg = stall_config(redis_server, bare(seg))

        async def body() -> None:
            async with open_fleet(cfg, seg) as fleet:
                claim = await stalled_admit(fleet, cfg, redis_server, Committed("hook-1"))
                assert value(redis_server, dd_key("evt")) == b"p:" + claim.token.hex().encode()
                await drain_all(cfg, seg)
                assert value(redis_server, dd_key("evt")) == b"c:hook-1"
                with redis_server.client() as r:
                    assert r.pttl(dd_key("evt")) > PENDING_TTL_MS  # the dedupe window
                await asyncio.sleep(PENDING_TTL_MS / 1000 + 0.2)
                assert await admit(fleet, cfg, "evt") == Duplicate("hook-1")

        run(body())
        counted = totals(seg)
        assert counted[Counter.SETTLED_PROMOTE] == 1
        assert counted[Counter.SETTLE_EXPIRED] == 0


def test_release_of_an_unanswered_claim_is_sent_after_any_stall(
    redis_server: RedisServer,
) -> None:
    """The late call wrote its claim after the stall; the release must still delete it, or
    every resend of the event would get 409 until the claim's TTL."""
    with segments(1) as (seg,):
        cfg = stall_config(redis_server, bare(seg))

        async def body() -> None:
            async with open_fleet(cfg, seg) as fleet:
                await stalled_admit(fleet, cfg, redis_server, NotStored("disk full"))
                await drain_all(cfg, seg)
                assert value(redis_server, dd_key("evt")) is None
                claim_of(await admit(fleet, cfg, "evt"))  # the resend is admitted at once

        run(body())
        counted = totals(seg)
        assert counted[Counter.SETTLED_RELEASE] == 1
        assert counted[Counter.SETTLE_EXPIRED] == 0


def test_promote_of_a_claim_redis_lost(redis_server: RedisServer) -> None:
    """Redis restarted empty between the claim and its promote: the promote writes
    committed over nothing, so the stored hook is in the fleet's window again."""
    with segments(1) as (seg,):
        cfg = stall_config(redis_server, bare(seg))

        async def body() -> None:
            async with open_fleet(cfg, seg) as fleet:
                claim = claim_of(await admit(fleet, cfg, "evt"))
                assert claim.claimed_ms != UNKNOWN  # answered
                redis_server.kill()
                redis_server.start()
                fleet.settle(claim, Committed("hook-1"))
                await drain_all(cfg, seg)
                assert value(redis_server, dd_key("evt")) == b"c:hook-1"
                await asyncio.sleep(0.2)  # past the reconnect pause
                assert await admit(fleet, cfg, "evt") == Duplicate("hook-1")

        run(body())


def test_promote_never_overwrites_another_hosts_hook(redis_server: RedisServer) -> None:
    with segments(2) as segs:
        cfgs = [stall_config(redis_server, bare(s)) for s in segs]

        async def body() -> None:
            async with open_fleet(cfgs[0], segs[0]) as a, open_fleet(cfgs[1], segs[1]) as b:
                mine = claim_of(await admit(a, cfgs[0], "evt"))
                with redis_server.client() as r:
                    r.set(dd_key("evt"), b"c:theirs")  # another host committed it
                a.settle(mine, Committed("hook-mine"))
                await drain_all(cfgs[0], segs[0])
                assert value(redis_server, dd_key("evt")) == b"c:theirs"
                assert await admit(b, cfgs[1], "evt") == Duplicate("theirs")

        run(body())
        assert totals(segs[0])[Counter.SETTLED_PROMOTE] == 1  # sent, and found it taken
