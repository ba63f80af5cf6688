#!/usr/bin/env python3
"""Fleet admission and settle delivery, measured in one run against a private redis-server.

Prints, each beside a baseline measured in the same run:
  * admits/s and CPU us per admit, node scope vs fleet scope (and, for the fleet call,
    the same EVALSHA through redis-py's asyncio client at the same concurrency);
  * Redis round trips per admitted hook (the server's own command count);
  * settle operations per drain round trip while workers admit and settle under load;
  * drainer operations/s next to a plain redis-py pipeline of per-operation commands.
The last line is one JSON object of every figure.
"""

from __future__ import annotations

import asyncio
import json
import multiprocessing
import os
import shlex
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))  # redis_server

import redis.asyncio as aioredis
import uvloop
from redis_server import RedisServer

from ankusa_shm import config
from ankusa_shm.fleet.admission import Admit, Claim, Fleet
from ankusa_shm.fleet.drainer import Drainer
from ankusa_shm.fleet.redis_store import ADMIT, RedisStore
from ankusa_shm.hooks import Committed, Envelope
from ankusa_shm.shm import counters, procs
from ankusa_shm.shm.counters import Counter
from ankusa_shm.shm.segment import Segment, make_params, unlink

CONCURRENCY = 64
figures: dict[str, float] = {}


def figure(name: str, value: float, unit: str, target: str = "") -> None:
    figures[name] = round(value, 3)
    print(f"  {name:<44} {value:>14,.1f} {unit:<10} {target}")


def make_config(
    seg: str, url: str, scope: str, queue: int = 50_000, batch: int = 1000
) -> config.Config:
    return config.parse(
        {
            "server": {"segment": seg},
            "rate_limits": {"scope": scope, "default": {"rate": 1_000_000, "burst": 1_000_000}},
            "dedupe": {"scope": scope},
            "fleet": {
                "redis_url": url,
                "timeout_ms": 1000,
                "settle_queue_size": queue,
                "settle_batch_max": batch,
            },
            "sources": [{"id": "gh", "tenant": "acme", "dedupe": {"header": "x-id"}}],
        },
        "bench",
    )


def new_segment(name: str, queue: int) -> Segment:
    unlink(name)
    return Segment.create(name, make_params(queue_capacity=queue, process_slots=16))


async def timed(n: int, body: Callable[[int], Awaitable[object]]) -> tuple[float, float]:
    """Run body(i) for i < n over CONCURRENCY tasks; (wall s, cpu s)."""

    async def lane(k: int) -> None:
        for i in range(k, n, CONCURRENCY):
            await body(i)

    t, c = time.perf_counter(), time.process_time()
    await asyncio.gather(*(lane(k) for k in range(CONCURRENCY)))
    return time.perf_counter() - t, time.process_time() - c


def _admit_run(server: RedisServer, scope: str, n: int) -> tuple[float, float]:
    """n admits through Fleet in one scope; (wall s, cpu s)."""
    name = f"bench-fleet-{os.getpid()}"
    cfg = make_config(name, server.url, scope)
    seg = new_segment(name, 1024)
    slot = procs.claim(seg.view, seg.layout, procs.Role.TOOL)

    async def run() -> tuple[float, float]:
        fleet = Fleet(cfg, seg, slot, RedisStore.from_config(cfg.fleet))
        src = cfg.sources[0]
        await fleet.admit(src, Envelope(b"warm"))
        before = server.commandstats().get("evalsha", 0)
        wall_cpu = await timed(n, lambda i: fleet.admit(src, Envelope(f"{scope}-{i}".encode())))
        calls = server.commandstats().get("evalsha", 0) - before
        admitted = counters.totals(seg.view, seg.layout)[Counter.ADMIT_OK] - 1
        await fleet.close()
        if scope == "fleet":
            figure("fleet round trips per admitted hook", calls / admitted, "", "<= 1.0")
        return wall_cpu

    try:
        return uvloop.run(run())
    finally:
        seg.close()
        unlink(name)


def bench_admission(server: RedisServer, n: int) -> None:
    print(f"\nadmission ({n} hooks, {CONCURRENCY} concurrent, one worker process)")
    results = {scope: _admit_run(server, scope, n) for scope in ("node", "fleet")}

    async def redis_py() -> tuple[float, float]:
        r = aioredis.Redis.from_url(server.url)
        sha = await r.script_load(ADMIT.source)
        key = "bench:{acme}:rl"

        async def call(i: int) -> None:
            await r.evalsha(
                sha, 2, key, f"bench:{{acme}}:dd:gh:rp-{i}", 1, 1, 1, 1_000_000, "ab", 30_000
            )

        wall_cpu = await timed(n, call)
        await r.aclose()
        return wall_cpu

    results["redis-py"] = uvloop.run(redis_py())
    for label, (wall, cpu) in results.items():
        figure(f"{label} admits per second", n / wall, "/s")
        figure(f"{label} CPU us per admit", cpu / n * 1e6, "us")
    ratio = results["redis-py"][1] / results["fleet"][1]
    figure("fleet CPU per admit: redis-py / ours", ratio, "x")


def _load_worker(name: str, url: str, seconds: float, out: Any) -> None:
    """A worker process: admit and settle as fast as it can for ``seconds``."""
    cfg = make_config(name, url, "fleet")
    seg = Segment.attach(name)
    slot = procs.claim(seg.view, seg.layout, procs.Role.WORKER)

    async def run() -> int:
        fleet = Fleet(cfg, seg, slot, RedisStore.from_config(cfg.fleet))
        src = cfg.sources[0]
        deadline = time.monotonic() + seconds
        done = 0

        async def lane(k: int) -> None:
            nonlocal done
            i = k
            while time.monotonic() < deadline:
                r = await fleet.admit(src, Envelope(f"load-{os.getpid()}-{i}".encode()))
                if isinstance(r, Admit):
                    fleet.settle(r.claim, Committed(f"hook-{i}"))
                    done += 1
                i += CONCURRENCY

        await asyncio.gather(*(lane(k) for k in range(CONCURRENCY)))
        await fleet.close()
        return done

    out.put(uvloop.run(run()))
    seg.close()


def _drainer_proc(name: str, url: str, stop_after: float) -> None:
    cfg = make_config(name, url, "fleet", batch=1000)
    seg = Segment.attach(name)
    slot = procs.claim(seg.view, seg.layout, procs.Role.DRAINER)

    async def run() -> None:
        stop = asyncio.Event()
        asyncio.get_running_loop().call_later(stop_after, stop.set)
        await Drainer(cfg, seg, slot, RedisStore.from_config(cfg.fleet)).run(stop)

    uvloop.run(run())
    seg.close()


def bench_settle_under_load(server: RedisServer, seconds: float) -> None:
    print(f"\nsettle under load (2 worker processes admitting + settling for {seconds:g} s)")
    name = f"bench-load-{os.getpid()}"
    seg = new_segment(name, 50_000)
    ctx = multiprocessing.get_context("fork")
    out = ctx.Queue()
    try:
        drainer = ctx.Process(target=_drainer_proc, args=(name, server.url, seconds + 0.5))
        workers = [
            ctx.Process(target=_load_worker, args=(name, server.url, seconds, out))
            for _ in range(2)
        ]
        drainer.start()
        for w in workers:
            w.start()
        settled_by_workers = sum(out.get(timeout=seconds + 60) for _ in workers)
        for p in (*workers, drainer):
            p.join(seconds + 60)
        t = counters.totals(seg.view, seg.layout)
        trips = t[Counter.DRAIN_ROUND_TRIPS]
        sent = t[Counter.SETTLED_PROMOTE] + t[Counter.SETTLED_RELEASE]
        figure("hooks admitted and settled", settled_by_workers, "")
        figure("drain round trips", trips, "")
        figure("settle operations per drain round trip", sent / max(trips, 1), "ops", ">= 100")
    finally:
        seg.close()
        unlink(name)


def bench_drainer(server: RedisServer, n: int) -> None:
    print(f"\ndrainer throughput ({n} queued promotes of pending claims)")
    name = f"bench-drain-{os.getpid()}"
    cfg = make_config(name, server.url, "fleet", queue=n, batch=1000)
    seg = new_segment(name, n)
    try:
        slot = procs.claim(seg.view, seg.layout, procs.Role.DRAINER)
        sync = server.client()
        token = b"\x01" * 16

        def claim_all(tag: str) -> list[bytes]:
            keys = [f"bench:{{t{i % 64}}}:dd:gh:{tag}-{i}".encode() for i in range(n)]
            pipe = sync.pipeline(transaction=False)
            for k in keys:
                pipe.set(k, b"p:" + token.hex().encode(), px=600_000)
            pipe.execute()
            return keys

        async def ours() -> float:
            fleet = Fleet(cfg, seg, slot, RedisStore.from_config(cfg.fleet))
            for k in claim_all("ours"):
                fleet.promote(Claim(k, token, 600_000, time.monotonic_ns() // 1_000_000), "h")
            stop = asyncio.Event()
            stop.set()
            drainer = Drainer(cfg, seg, slot, RedisStore.from_config(cfg.fleet))
            t = time.perf_counter()
            await drainer.run(stop)
            return time.perf_counter() - t

        wall = uvloop.run(ours())
        sample = [f"bench:{{t0}}:dd:gh:ours-{i}" for i in range(0, n, 64)]
        applied = sum(isinstance(v, bytes) and v.startswith(b"c:") for v in sync.mget(sample))
        figure("drainer operations per second", n / wall, "ops/s", ">= 100000")

        keys = claim_all("rp")
        sha = sync.script_load(
            b"if redis.call('GET', KEYS[1]) == 'p:' .. ARGV[1] then "
            b"return redis.call('SET', KEYS[1], 'c:' .. ARGV[2], 'PX', ARGV[3]) end"
        )
        t = time.perf_counter()
        for i in range(0, n, 1000):
            pipe = sync.pipeline(transaction=False)
            for k in keys[i : i + 1000]:
                pipe.evalsha(sha, 1, k, token.hex(), "h", 600_000)
            pipe.execute()
        base = time.perf_counter() - t
        figure("redis-py pipeline operations per second", n / base, "ops/s")
        figure("drainer / redis-py pipeline", base / wall, "x")
        if applied != len(sample):
            print(f"  WARNING: only {applied} sampled keys were committed")
        sync.close()
    finally:
        seg.close()
        unlink(name)


def main() -> None:
    print("command: " + " ".join(shlex.quote(a) for a in [sys.executable, *sys.argv]))
    server = RedisServer()
    try:
        bench_admission(server, 40_000)
        bench_settle_under_load(server, 3.0)
        bench_drainer(server, 200_000)
    finally:
        server.close()
    print(json.dumps(figures, sort_keys=True))


if __name__ == "__main__":
    main()
