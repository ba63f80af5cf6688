"""The drainer: delivers what the workers queue, survives being killed and Redis going
away, drops what has certainly expired, drains on SIGTERM; and the metrics it feeds."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import signal
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
from fleet_helpers import (
    CTX,
    TENANT,
    TIMEOUT_S,
    FakeClock,
    admit,
    await_until,
    bare,
    committed_values,
    dd_key,
    drain_all,
    drainer_process,
    drainer_running,
    fleet_config,
    fleet_raw,
    open_fleet,
    pending_value,
    reset_stats,
    run,
    segments,
    source_id,
    stopped,
    store_hooks,
    totals,
    wait_until,
    write_config,
)
from prometheus_client.parser import text_string_to_metric_families
from redis_server import RedisServer

from ankusa_shm import config, metrics
from ankusa_shm.clock import monotonic_ms
from ankusa_shm.config import Config
from ankusa_shm.fleet.admission import Admit, Admitted, Claim, Fleet, RateLimited
from ankusa_shm.fleet.drainer import Drainer
from ankusa_shm.fleet.epoch import Epoch
from ankusa_shm.fleet.redis_store import RedisStore
from ankusa_shm.fleet.repromote import Repromoter
from ankusa_shm.fleet.seen import Seen
from ankusa_shm.hooks import AlreadyStored, Committed, NewHook, NotStored
from ankusa_shm.shm import layout as L
from ankusa_shm.shm import procs, settle_queue
from ankusa_shm.shm.counters import Counter
from ankusa_shm.shm.procs import Role
from ankusa_shm.shm.segment import Segment
from ankusa_shm.shm.settle_queue import Op, Pushed, Record, SettleQueue


def claim_of(answer: Admitted) -> Claim:
    assert isinstance(answer, Admit) and answer.claim is not None, answer
    return answer.claim


@asynccontextmanager
async def claimed_then_gone(
    cfg: Config, seg: Segment, server: RedisServer
) -> AsyncIterator[tuple[Fleet, Claim]]:
    """A fleet with one claim Redis answered, and Redis killed since: what it queues next
    waits for a Redis that is not there."""
    async with open_fleet(cfg, seg) as fleet:
        claim = claim_of(await admit(fleet, cfg, "k"))
        server.kill()
        yield fleet, claim


def committed(i: int) -> bytes:
    return f"c:hook-{i}".encode()


def test_drainer_delivers_promotes_and_releases(redis_server: RedisServer) -> None:
    with segments(1) as (seg,):
        cfg = fleet_config(redis_server.url, bare(seg))

        async def body() -> None:
            async with open_fleet(cfg, seg) as fleet:
                claims = [claim_of(await admit(fleet, cfg, f"k{i}")) for i in range(6)]
                for i in range(3):
                    fleet.settle(claims[i], Committed(f"hook-{i}"))
                fleet.settle(claims[3], AlreadyStored("hook-3"))  # this host's index knew it
                fleet.settle(claims[4], NotStored("store unavailable"))
                fleet.release(claims[5])
                fleet.settle(None, Committed("hook-none"))  # nothing claimed: a no-op
                assert seg.queue_depth() == 6
                with redis_server.client() as r:
                    assert all(v and v.startswith(b"p:") for v in r.mget([c.key for c in claims]))
                await drain_all(cfg, seg)

        run(body())
        assert seg.queue_depth() == 0
        counted = totals(seg)
        assert counted[Counter.SETTLE_ENQUEUED] == 6
        assert counted[Counter.SETTLED_PROMOTE] == 4
        assert counted[Counter.SETTLED_RELEASE] == 2
        assert counted[Counter.DRAIN_ROUND_TRIPS] == 1
        assert counted[Counter.DRAIN_ERRORS] == 0
        with redis_server.client() as r:
            values = committed_values(r, [dd_key(f"k{i}") for i in range(6)])
        assert values == [committed(0), committed(1), committed(2), committed(3), None, None]


@pytest.mark.parametrize("at_head", [False, True], ids=["after-records", "and-at-the-head"])
def test_records_that_fail_their_check_are_counted_and_the_rest_delivered(
    redis_server: RedisServer, caplog: pytest.LogCaptureFixture, at_head: bool
) -> None:
    """A damaged op byte made the drainer raise on every start before records carried a
    check; a damaged key byte sent a promote for a key no hook has. One at the head is
    freed by the peek, the others with their batch: each is counted once either way."""
    with segments(1) as (seg,):
        cfg = fleet_config(redis_server.url, bare(seg))
        first = seg.layout.offset("queue") + L.Q_SLOTS + L.QS_RECORD

        async def body() -> None:
            async with open_fleet(cfg, seg) as fleet:
                claims = [claim_of(await admit(fleet, cfg, f"k{i}")) for i in range(4)]
                for i in range(4):
                    fleet.settle(claims[i], Committed(f"hook-{i}"))
                assert seg.queue_depth() == 4
                seg.buf[first + L.QUEUE_SLOT_BYTES + L.RECORD_CHECK.size] ^= 0xFF  # 1's op
                seg.buf[first + 2 * L.QUEUE_SLOT_BYTES + L.RECORD.size + 3] ^= 0x01  # 2's key
                if at_head:
                    seg.buf[first] ^= 0xFF  # 0's check
                await drain_all(cfg, seg)
                with redis_server.client() as r:
                    values = committed_values(r, [dd_key(f"k{i}") for i in range(4)])
                lost = range(3) if at_head else range(1, 3)
                assert values[3] == committed(3)
                assert values[0] == (pending_value(claims[0].token) if at_head else committed(0))
                assert [values[i] for i in lost] == [pending_value(claims[i].token) for i in lost]

        run(body())
        assert seg.queue_depth() == 0
        counted = totals(seg)
        assert counted[Counter.SETTLE_CORRUPT] == (3 if at_head else 2)
        assert counted[Counter.SETTLED_PROMOTE] == (1 if at_head else 2)
        assert "failed their check" in caplog.text


def test_killed_drainer_loses_nothing(redis_server: RedisServer, tmp_path: Path) -> None:
    with segments(1) as (seg,):
        raw = fleet_raw(redis_server.url, bare(seg), settle_timeout_ms=30_000)
        cfg_file = write_config(tmp_path / "ankusa.toml", raw)
        cfg = fleet_config(redis_server.url, bare(seg), settle_timeout_ms=30_000)
        claims: list[Claim] = []

        async def admit_all() -> None:
            async with open_fleet(cfg, seg) as fleet:
                claims.extend([claim_of(await admit(fleet, cfg, f"k{i}")) for i in range(40)])

        async def settle(which: range) -> None:
            async with open_fleet(cfg, seg) as fleet:
                for i in which:
                    fleet.settle(claims[i], Committed(f"hook-{i}"))

        run(admit_all())
        run(settle(range(20)))
        with stopped(redis_server.pid):
            with drainer_process(cfg_file, tmp_path / "drainer-1.log") as first:
                wait_until(
                    lambda: totals(seg)[Counter.DRAIN_ROUND_TRIPS] >= 1,
                    "the drainer to send its batch",
                )
                first.kill()  # SIGKILL, holding a batch it never heard back about
            assert seg.queue_depth() == 20
            run(settle(range(20, 40)))
            assert seg.queue_depth() == 40
        with drainer_process(cfg_file, tmp_path / "drainer-2.log") as second:
            wait_until(lambda: seg.queue_depth() == 0, "the new drainer to empty the queue")
            second.signal(signal.SIGTERM)
            assert second.wait() == 0, second.output()
        with redis_server.client() as r:
            values = committed_values(r, [dd_key(f"k{i}") for i in range(40)])
        assert values == [committed(i) for i in range(40)]
        assert totals(seg)[Counter.SETTLE_DROPPED] == 0


def test_drainer_keeps_its_batch_while_redis_is_down(redis_server: RedisServer) -> None:
    with segments(1) as (seg,):
        cfg = fleet_config(redis_server.url, bare(seg), settle_timeout_ms=500)

        async def body() -> None:
            async with open_fleet(cfg, seg) as fleet:
                claims = [claim_of(await admit(fleet, cfg, f"k{i}")) for i in range(5)]
                for i, c in enumerate(claims):
                    fleet.settle(c, Committed(f"hook-{i}"))
            redis_server.kill()
            async with drainer_running(cfg, seg):
                await await_until(
                    lambda: totals(seg)[Counter.DRAIN_ERRORS] >= 4, "failed deliveries"
                )
                assert seg.queue_depth() == 5
                counted = totals(seg)
                assert counted[Counter.SETTLED_PROMOTE] == 0
                # backoff: a handful of attempts, not a busy loop (0.05 s, doubling)
                await asyncio.sleep(0.5)
                assert totals(seg)[Counter.DRAIN_ERRORS] <= counted[Counter.DRAIN_ERRORS] + 4
                # Redis comes back empty: put the claims back before the drainer can run
                # again (nothing below awaits, so the drainer's task cannot interleave)
                redis_server.start()
                with redis_server.client() as r:
                    for c in claims:
                        r.set(c.key, pending_value(c.token), px=60_000)
                await await_until(lambda: seg.queue_depth() == 0, "delivery after the restart")

        run(body())
        counted = totals(seg)
        assert counted[Counter.SETTLED_PROMOTE] == 5
        assert counted[Counter.SETTLE_EXPIRED] == 0
        with redis_server.client() as r:
            values = committed_values(r, [dd_key(f"k{i}") for i in range(5)])
        assert values == [committed(i) for i in range(5)]


def test_a_failing_delivery_says_what_a_full_queue_dropped(
    redis_server: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    """During a long outage the queue fills (every hook stored meanwhile queues a promote)
    and the operations after it are dropped: the delivery warning says how many."""
    with segments(1, queue_capacity=16) as (seg,):
        cfg = fleet_config(redis_server.url, bare(seg), settle_timeout_ms=200)

        async def body() -> None:
            async with claimed_then_gone(cfg, seg, redis_server) as (fleet, claim):
                for i in range(16 + 3):
                    fleet.promote(claim, f"hook-{i}")
            assert seg.queue_depth() == 16
            async with drainer_running(cfg, seg):
                await await_until(lambda: totals(seg)[Counter.DRAIN_ERRORS] >= 1, "a failure")

        with caplog.at_level(logging.WARNING, logger="ankusa_shm.drainer"):
            run(body())
        assert totals(seg)[Counter.SETTLE_DROPPED] == 3
        assert "16 queued, 3 dropped so far for a full queue" in caplog.text


def test_an_idle_drainer_sleeps_until_an_operation_is_queued(redis_server: RedisServer) -> None:
    """An empty queue is not polled: asleep, the drainer looks only for its heartbeat (here
    every 30 s), yet an operation queued after an idle spell is delivered at once -- its
    producer wakes the drainer -- and a stop while asleep ends the run at once too."""
    with segments(1) as (seg,):
        raw = fleet_raw(redis_server.url, bare(seg), settle_interval_ms=5)
        raw["server"]["heartbeat_timeout_s"] = 120.0
        cfg = config.parse(raw, "idle-test")

        async def body() -> tuple[int, float, float]:
            slot = procs.claim(seg.view, seg.layout, Role.DRAINER)
            store = RedisStore.from_config(cfg.fleet)
            stop = asyncio.Event()
            d = Drainer(cfg, seg, slot, store)
            looks = [0]
            peek = d._queue.peek

            def counting_peek(n: int, now_ms: int) -> Any:
                looks[0] += 1
                return peek(n, now_ms)

            d._queue.peek = counting_peek  # type: ignore[method-assign,assignment]
            task = asyncio.create_task(d.run(stop))
            try:
                await asyncio.sleep(0.3)
                looks[0] = 0
                await asyncio.sleep(1.0)
                idle_looks = looks[0]
                async with open_fleet(cfg, seg) as fleet:
                    c = claim_of(await admit(fleet, cfg, "after-idle"))
                    queued = time.monotonic()
                    fleet.settle(c, Committed("hook-idle"))
                await await_until(lambda: seg.queue_depth() == 0, "the first delivery")
                took = time.monotonic() - queued
                await asyncio.sleep(0.3)  # asleep again
            finally:
                asked = time.monotonic()
                stop.set()
                await task
                stop_took = time.monotonic() - asked
                await store.close()
                slot.release()
            return idle_looks, took, stop_took

        idle_looks, took, stop_took = run(body())
        assert idle_looks == 0  # polling every 5 ms looked 200 times, every 50 ms 20
        assert took < 5.0, took  # not the 30 s of a heartbeat
        assert stop_took < 5.0, stop_took
        with redis_server.client() as r:
            assert committed_values(r, [dd_key("after-idle")]) == [b"c:hook-idle"]


def past_pending_ttl(cfg: Config) -> int:
    """How far to move the clock so that claims answered now have certainly expired."""
    return cfg.fleet.pending_ttl_ms + 1


def test_only_answered_releases_expire_and_promotes_never_do(redis_server: RedisServer) -> None:
    """Old releases of answered claims are dropped, not sent; old promotes are sent (a
    promote is the only record that the hook exists) and write committed."""
    with segments(1) as (seg,):
        cfg = fleet_config(redis_server.url, bare(seg), pending_ttl_ms=10_000)
        clock = FakeClock()

        async def body() -> None:
            async with open_fleet(cfg, seg, clock=clock) as fleet:
                old = [claim_of(await admit(fleet, cfg, f"old{i}")) for i in range(5)]
                clock.advance(past_pending_ttl(cfg))
                new = [claim_of(await admit(fleet, cfg, f"new{i}")) for i in range(2)]
                for i, c in enumerate(old[:3] + new):
                    fleet.settle(c, Committed(f"hook-{i}"))
                for c in old[3:]:
                    fleet.settle(c, NotStored("gone"))
            with redis_server.client() as r:
                reset_stats(r)
            await drain_all(cfg, seg, clock=clock)

        run(body())
        counted = totals(seg)
        assert seg.queue_depth() == 0
        assert counted[Counter.SETTLE_EXPIRED] == 2
        assert counted[Counter.SETTLED_PROMOTE] == 5
        assert counted[Counter.SETTLED_RELEASE] == 0
        assert counted[Counter.DRAIN_ROUND_TRIPS] == 1
        assert redis_server.commandstats().get("evalsha") == 1  # the one round trip
        with redis_server.client() as r:
            keys = [dd_key(k) for k in ("old0", "old1", "old2", "new0", "new1")]
            assert committed_values(r, keys) == [f"c:hook-{i}".encode() for i in range(5)]
            released = committed_values(r, [dd_key("old3"), dd_key("old4")])
            assert all(v is not None and v.startswith(b"p:") for v in released)  # not sent


def test_only_expired_releases_make_no_round_trip(redis_server: RedisServer) -> None:
    with segments(1) as (seg,):
        cfg = fleet_config(redis_server.url, bare(seg), pending_ttl_ms=10_000)
        clock = FakeClock()

        async def body() -> None:
            async with open_fleet(cfg, seg, clock=clock) as fleet:
                claims = [claim_of(await admit(fleet, cfg, f"k{i}")) for i in range(4)]
                for c in claims:
                    fleet.settle(c, NotStored("gone"))
            clock.advance(past_pending_ttl(cfg))
            with redis_server.client() as r:
                reset_stats(r)
            await drain_all(cfg, seg, clock=clock)

        run(body())
        counted = totals(seg)
        assert seg.queue_depth() == 0
        assert counted[Counter.SETTLE_EXPIRED] == 4
        assert counted[Counter.DRAIN_ROUND_TRIPS] == 0
        assert counted[Counter.SETTLED_RELEASE] == 0
        stats = redis_server.commandstats()
        assert "evalsha" not in stats and "eval" not in stats


@pytest.mark.parametrize("after", [0, 10], ids=["nothing-after", "ten-pushed-after"])
def test_sigterm_delivers_what_was_queued_then_and_exits_zero(
    redis_server: RedisServer, tmp_path: Path, after: int
) -> None:
    """SIGTERM with one batch in flight (batches of 4) and 6 operations behind it: all 10
    are delivered, and the drainer exits 0. What is pushed after the stop (a reload's new
    workers push while the drainer they replace stops) is left for the next drainer.
    Before, it stopped only at an empty queue, which under load never came, so a reload
    waited out drain_on_stop_ms (a minute here)."""
    with segments(1) as (seg,):
        settings: dict[str, Any] = {"settle_timeout_ms": 30_000, "drain_on_stop_ms": 60_000}
        raw = fleet_raw(redis_server.url, bare(seg), settle_batch_max=4, **settings)
        cfg_file = write_config(tmp_path / "ankusa.toml", raw)
        cfg = fleet_config(redis_server.url, bare(seg), **settings)

        async def queue_up() -> None:
            async with open_fleet(cfg, seg) as fleet:
                claims = [claim_of(await admit(fleet, cfg, f"k{i}")) for i in range(10)]
                for i, c in enumerate(claims):
                    fleet.settle(c, Committed(f"hook-{i}"))

        run(queue_up())
        queue = SettleQueue(seg.view, seg.buf, seg.layout)
        wake_word = seg.layout.offset("queue") + L.Q_WAKE
        with drainer_process(cfg_file, tmp_path / "drainer.log") as drainer:
            with stopped(redis_server.pid):  # the drainer holds its batch, unanswered
                wait_until(
                    lambda: totals(seg)[Counter.DRAIN_ROUND_TRIPS] >= 1,
                    "the drainer to send its batch",
                )
                woken = seg.view.load(wake_word)
                drainer.signal(signal.SIGTERM)
                # it noted the stop, then woke itself (a push would wake only a sleeper)
                wait_until(lambda: seg.view.load(wake_word) > woken, "the stop noted")
                assert drainer.proc.poll() is None
                assert seg.queue_depth() == 10
                for i in range(10, 10 + after):
                    now = monotonic_ms()
                    hook = f"hook-{i}".encode()
                    promote = Record(Op.PROMOTE, dd_key(f"k{i}"), bytes(16), hook, 60_000, now, now)
                    assert queue.push(promote) is Pushed.OK
            assert drainer.wait() == 0, drainer.output()
        assert seg.queue_depth() == after
        assert totals(seg)[Counter.SETTLED_PROMOTE] == 10
        assert totals(seg)[Counter.DRAIN_ROUND_TRIPS] == 3
        with redis_server.client() as r:
            values = committed_values(r, [dd_key(f"k{i}") for i in range(10 + after)])
        assert values == [committed(i) for i in range(10)] + [None] * after


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["TERM", "INT"])
def test_an_asleep_drainer_stops_at_once(
    redis_server: RedisServer, tmp_path: Path, sig: signal.Signals
) -> None:
    """Asleep on an empty queue until its next heartbeat (30 s here), the drainer process
    still ends at once on SIGTERM (graceful) or SIGINT (fast), with status 0."""
    with segments(1) as (seg,):
        raw = fleet_raw(redis_server.url, bare(seg))
        raw["server"]["heartbeat_timeout_s"] = 120.0
        cfg_file = write_config(tmp_path / "ankusa.toml", raw)
        sleeping = seg.layout.offset("queue") + L.Q_SLEEPING
        with drainer_process(cfg_file, tmp_path / "drainer.log") as drainer:
            wait_until(lambda: seg.view.load(sleeping) == 1, "the drainer to fall asleep")
            asked = time.monotonic()
            drainer.signal(sig)
            assert drainer.wait() == 0, drainer.output()
            assert time.monotonic() - asked < 5.0
        assert SettleQueue(seg.view, seg.buf, seg.layout).consumer_pid() == 0


def test_metrics_show_what_the_segment_holds(redis_server: RedisServer) -> None:
    with segments(1, queue_capacity=16) as (seg,):
        cfg = fleet_config(
            redis_server.url,
            bare(seg),
            rate=0.001,
            burst=3,
            breaker_min_calls=3,
            breaker_failure_rate=0.5,
            breaker_open_ms=60_000,
            settle_queue_size=16,
        )
        clock = FakeClock()

        async def body() -> None:
            async with open_fleet(cfg, seg, clock=clock) as fleet:
                answers = [await admit(fleet, cfg, f"k{i}") for i in range(5)]
                assert [type(a) for a in answers] == [Admit] * 3 + [RateLimited] * 2
                claims = [claim_of(a) for a in answers[:3]]
                fleet.settle(claims[0], Committed("hook-0"))
                fleet.settle(claims[1], Committed("hook-1"))
                fleet.settle(claims[2], NotStored("full"))
                await drain_all(cfg, seg, clock=clock)
                for i in range(20):  # 16 fit, 4 are dropped
                    fleet.promote(claims[0], f"again-{i}")
                clock.advance(60_000)
                redis_server.kill()
                for i in range(3):  # 3 failures open the breaker
                    claim_of(await admit(fleet, cfg, f"down{i}"))
                assert fleet.state() == "open"

        run(body())
        with Segment.attach(seg.name, readonly=True) as reader:  # as the admin listener
            text = metrics.render(reader)[0].decode()
        samples = {
            (s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text)
            for s in fam.samples
        }

        def value(name: str, **labels: str) -> float:
            return samples[("ankusa_" + name, tuple(sorted(labels.items())))]

        counted = totals(seg)
        expected = {
            Counter.FALLBACK_RATE_LIMIT: 3,
            Counter.FALLBACK_DEDUPE: 3,
            Counter.SETTLE_DROPPED: 4,
            Counter.SETTLED_PROMOTE: 2,
            Counter.SETTLED_RELEASE: 1,
            Counter.STORE_OK: 5,
            Counter.STORE_ERROR: 3,
            Counter.STORE_TIMEOUT: 0,
            Counter.BREAKER_TO_OPEN: 1,
            Counter.BREAKER_TO_CLOSED: 0,
            Counter.DRAIN_ROUND_TRIPS: 1,
            Counter.RATE_LIMIT_REJECTED: 2,
        }
        assert {c: counted[c] for c in expected} == expected
        for c in Counter:  # every counter, as the segment holds it
            assert value(c.family + "_total", **dict(c.labels)) == counted[c], c
        assert value("fleet_limiter_degraded", kind="rate_limit") == 1
        assert value("fleet_limiter_degraded", kind="dedupe") == 1
        assert value("fleet_fallback_total", kind="rate_limit") == 3
        assert value("fleet_fallback_total", kind="dedupe") == 3
        assert value("fleet_settle_dropped_total") == 4
        assert value("fleet_settle_queue_depth") == 16
        assert value("fleet_settled_total", op="promote") == 2
        assert value("fleet_settled_total", op="release") == 1
        assert value("fleet_store_calls_total", result="ok") == 5
        assert value("fleet_store_calls_total", result="error") == 3
        assert value("fleet_store_calls_total", result="timeout") == 0
        assert value("fleet_breaker_state") == 1
        assert value("fleet_breaker_transitions_total", to="open") == 1
        assert value("fleet_breaker_transitions_total", to="closed") == 0
        assert value("fleet_drain_round_trips_total") == 1
        assert value("rate_limit_rejected_total") == 2
        assert TENANT not in text  # tenants are not labels


def test_a_second_drainer_refuses_to_start(redis_server: RedisServer, tmp_path: Path) -> None:
    with segments(1) as (seg,):
        cfg_file = write_config(tmp_path / "ankusa.toml", fleet_raw(redis_server.url, bare(seg)))
        with drainer_process(cfg_file, tmp_path / "first.log") as first:
            wait_until(
                lambda: SettleQueue(seg.view, seg.buf, seg.layout).consumer_pid() != 0,
                "the first drainer to take the queue",
            )
            with drainer_process(cfg_file, tmp_path / "second.log") as second:
                assert second.wait() == 2
                assert "already drained by live pid" in second.output()
                assert "Traceback" not in second.output()
            assert first.proc.poll() is None  # the first one goes on
            first.signal(signal.SIGTERM)
            assert first.wait() == 0, first.output()


def _die_while_enqueuing(seg_name: str, cfg: Config, claim: Claim) -> None:
    """A worker SIGKILLed between reserving a queue slot and publishing its record."""
    seg = Segment.attach(seg_name)
    slot = procs.claim(seg.view, seg.layout, Role.WORKER)
    settle_queue._pause_after_reserve = lambda: os.kill(os.getpid(), signal.SIGKILL)
    fleet = Fleet(cfg, seg, slot, RedisStore.from_config(cfg.fleet))
    fleet.settle(claim, Committed("never-published"))


class SteppingClock:
    """Real monotonic time, plus ``step_ms`` more on every reading: a drainer's loop
    sees the abandon grace period pass in a few turns."""

    def __init__(self, step_ms: int) -> None:
        self.offset_ns = 0
        self.step_ns = step_ms * 1_000_000

    def __call__(self) -> int:
        self.offset_ns += self.step_ns
        return time.monotonic_ns() + self.offset_ns


def test_worker_killed_mid_enqueue_does_not_wedge_the_queue(redis_server: RedisServer) -> None:
    with segments(1) as (seg,):
        cfg = fleet_config(redis_server.url, bare(seg))
        claims: list[Claim] = []

        async def admit_all() -> None:
            async with open_fleet(cfg, seg) as fleet:
                claims.extend([claim_of(await admit(fleet, cfg, f"k{i}")) for i in range(5)])
                fleet.settle(claims[0], Committed("hook-0"))
                fleet.settle(claims[1], Committed("hook-1"))

        async def settle_rest() -> None:
            async with open_fleet(cfg, seg) as fleet:
                fleet.settle(claims[3], Committed("hook-3"))
                fleet.settle(claims[4], NotStored("gone"))

        run(admit_all())
        kid = CTX.Process(target=_die_while_enqueuing, args=(bare(seg), cfg, claims[2]))
        kid.start()
        try:
            kid.join(TIMEOUT_S)
            assert kid.exitcode == -signal.SIGKILL
        finally:
            if kid.is_alive():
                kid.kill()
            kid.join(10)
        run(settle_rest())
        assert seg.queue_depth() == 5  # one of them reserved and never published
        run(drain_all(cfg, seg, clock=SteppingClock(500)))
        counted = totals(seg)
        assert seg.queue_depth() == 0
        assert counted[Counter.SETTLE_ABANDONED] == 1
        assert counted[Counter.SETTLED_PROMOTE] == 3
        assert counted[Counter.SETTLED_RELEASE] == 1
        with redis_server.client() as r:
            values = committed_values(r, [dd_key(f"k{i}") for i in range(5)])
        assert values[:2] == [b"c:hook-0", b"c:hook-1"]
        assert values[2] == pending_value(claims[2].token)  # its promote was lost, not sent
        assert values[3:] == [b"c:hook-3", None]


def test_a_redis_that_may_evict_fleet_keys_is_said_and_so_are_its_evictions(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """With maxmemory-policy allkeys-lru a full Redis answers every call and evicts
    committed dedupe keys: an audit stored 5,480 of 13,953 resends a second time across two
    hosts, with no error, counter or line anywhere. The drainer now reads the policy and
    the eviction count and says both; a noeviction server is not mentioned."""
    evicting = RedisServer(None, "--maxmemory", "512mb", "--maxmemory-policy", "allkeys-lru")
    quiet = RedisServer()
    try:
        with segments(2) as segs:

            async def check(server: RedisServer, seg: Segment, fill: bool) -> None:
                cfg = fleet_config(server.url, bare(seg))
                slot = procs.claim(seg.view, seg.layout, Role.DRAINER)
                store = RedisStore.from_config(cfg.fleet)
                drainer = Drainer(cfg, seg, slot, store)
                try:
                    await drainer.check_memory()
                    if fill:  # a write past maxmemory evicts
                        with server.client() as r:
                            pipe = r.pipeline(transaction=False)
                            for i in range(3000):
                                pipe.set(f"filler:{i}", b"v" * 1000)
                            pipe.execute()
                            used = int(r.info("memory")["used_memory"])
                            r.config_set("maxmemory", used - 1_000_000)
                            r.set("filler:last", b"v")
                            assert int(r.info("stats")["evicted_keys"]) > 0
                    await drainer.check_memory()
                finally:
                    await store.close()
                    slot.release()

            with caplog.at_level(logging.WARNING, logger="ankusa_shm.drainer"):
                run(check(quiet, segs[1], fill=False))
                assert caplog.text == ""
                run(check(evicting, segs[0], fill=True))
        said = [r.getMessage() for r in caplog.records]
        assert len(said) == 2, said
        assert "may evict fleet keys (maxmemory-policy allkeys-lru" in said[0]
        assert said[1].startswith("Redis evicted ") and "stored again" in said[1]
    finally:
        evicting.close()
        quiet.close()


def test_deliveries_that_work_again_say_what_a_full_queue_dropped_meanwhile(
    redis_server: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    """The failure's warning comes once a minute, from the first failure: an audit's 25 s
    of -OOM replies left one line, '0 dropped so far', while 14,068 promotes were dropped
    for a full queue behind it. Once deliveries work again the drainer says the total."""
    with segments(1, queue_capacity=16) as (seg,):
        cfg = fleet_config(redis_server.url, bare(seg), settle_timeout_ms=200)

        async def body() -> None:
            async with claimed_then_gone(cfg, seg, redis_server) as (fleet, claim):
                fleet.promote(claim, "hook-0")
                async with drainer_running(cfg, seg):
                    await await_until(lambda: totals(seg)[Counter.DRAIN_ERRORS] >= 1, "a failure")
                    for i in range(1, 16 + 5):  # the queue fills behind the failures
                        fleet.promote(claim, f"hook-{i}")
                    assert totals(seg)[Counter.SETTLE_DROPPED] == 5
                    redis_server.start()
                    await await_until(lambda: seg.queue_depth() == 0, "delivery again")

        with caplog.at_level(logging.INFO, logger="ankusa_shm.drainer"):
            run(body())
        lines = [r.getMessage() for r in caplog.records]
        assert "0 dropped so far for a full queue" in lines[0]  # said before the drops
        again = [m for m in lines if "works again" in m]
        assert len(again) == 1, lines
        assert "5 operations dropped for a full queue meanwhile" in again[0]


def test_a_move_not_yet_promoted_for_is_owed_whichever_store_comes_next(
    redis_server: RedisServer, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A reload onto B, and back onto A before B's drainer promoted the window into B:
    what it settled into B meanwhile has no key in A. B's drainer says, before its first
    delivery, that a window is owed; A's drainer then promotes it into A. Before, the
    segment still named A (written only once B's promote was done): A's drainer saw no
    move, and a resend of those hooks to another host on A was stored again."""
    other = RedisServer()
    with segments(1) as (seg,):
        raw = fleet_raw(redis_server.url, bare(seg))
        raw["store"] = {"path": str(tmp_path / "hooks.db")}
        cfg_a = config.parse(raw, "move-a")
        cfg_b = dataclasses.replace(
            cfg_a, fleet=dataclasses.replace(cfg_a.fleet, redis_url=other.url)
        )
        wall = int(time.time() * 1000)
        hooks = [
            NewHook(f"hook-{i}", TENANT, source_id(TENANT), f"k{i}".encode(), 600, wall, (), b"{}")
            for i in range(5)
        ]

        async def body() -> None:
            await store_hooks(cfg_a, hooks)
            slot = procs.claim(seg.view, seg.layout, Role.DRAINER)
            try:
                for cfg, checked in ((cfg_a, True), (cfg_b, False), (cfg_a, True)):
                    store = RedisStore.from_config(cfg.fleet)
                    promote = Repromoter(cfg, store, slot.counters, 5.0)
                    watch = Epoch(store, seg.blob("epoch"), promote, 5.0)
                    try:
                        watch.claim()
                        if checked:  # B's drainer is stopped before its first check
                            await watch.check()
                    finally:
                        await store.close()
            finally:
                slot.release()

        try:
            with caplog.at_level(logging.WARNING, logger="ankusa_shm.drainer"):
                run(body())
        finally:
            other.close()
        assert totals(seg)[Counter.REPROMOTED] == len(hooks)
    assert "its promote after a move not done yet" in caplog.text
    with redis_server.client() as r:
        values = committed_values(r, [dd_key(f"k{i}") for i in range(5)])
    assert values == [committed(i) for i in range(5)]


def test_a_changed_epoch_is_promoted_for_only_when_the_server_does_not_evict(
    redis_server: RedisServer, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """On a Redis that may evict keys, a changed epoch may be the key evicted, and a window
    promoted into a full server would evict more: said, nothing promoted. Elsewhere a
    change is promoted for, and the new value kept only once that went out (here the store
    cannot be read, so it is not, and the next check tries again)."""
    unreadable = tmp_path / "hooks.db"
    unreadable.write_bytes(b"not a database, " * 512)
    with segments(1) as (seg,):
        raw = fleet_raw(redis_server.url, bare(seg))
        raw["store"] = {"path": str(unreadable)}
        cfg = config.parse(raw, "epoch-test")
        blob = seg.blob("epoch")

        async def body() -> None:
            store = RedisStore.from_config(cfg.fleet)
            slot = procs.claim(seg.view, seg.layout, Role.DRAINER)
            promote = Repromoter(cfg, store, slot.counters, 1.0)
            watch = Epoch(store, blob, promote, 1.0)
            try:
                await watch.check()
                first = Seen.of(blob.read())
                assert list(first.values) == ["ankusa:epoch"] and first.server == store.server
                with redis_server.client() as r:
                    r.flushall()
                    await watch.check(evicting=True)
                    second = Seen.of(blob.read())
                    assert second.values not in ({}, first.values)
                    r.flushall()
                    await watch.check()
                    assert Seen.of(blob.read()) == second
            finally:
                await store.close()
                slot.release()

        with caplog.at_level(logging.WARNING, logger="ankusa_shm.drainer"):
            run(body())
        assert totals(seg)[Counter.REPROMOTED] == 0
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 3, said
    assert "on a Redis that may evict keys" in said[0]
    assert said[1].startswith("the fleet store lost its data")
    assert said[2].startswith("cannot read the store")
