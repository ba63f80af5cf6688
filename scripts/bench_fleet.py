#!/usr/bin/env python3
"""Fleet admission and settle delivery, measured in one run against a private redis-server.

Prints, each beside a baseline measured in the same run:
  * admits/s and CPU us per admit, node scope vs fleet scope (and, for the fleet call,
    the same EVALSHA through redis-py's asyncio client at the same concurrency, one call
    per hook), with redis-server's own CPU per admit beside each fleet figure;
  * admitted hooks per script call (the server's own command count);
  * settle operations per drain round trip while workers admit and settle under load;
  * drainer operations/s next to a plain redis-py pipeline of per-operation commands.
  * admit latency while redis-server is SIGSTOPped (the budget must hold), the breaker's
    time to open and to close again, and what a flushed script cache costs.
The last line is one JSON object of every figure. Name parts to run only those:
  .venv/bin/python scripts/bench_fleet.py [admission|load|drainer|stall|cold-cache ...]
"""

from __future__ import annotations

import asyncio
import json
import multiprocessing
import os
import shlex
import sys
import time
from array import array
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))  # redis_server

import redis.asyncio as aioredis
import uvloop
from bench_http import cpu_s  # CPU seconds from /proc
from redis_server import RedisServer

from ankusa_shm import child, config
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
    seg: str, url: str, scope: str, queue: int = 50_000, batch: int = 1000, **fleet: Any
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
                **fleet,
            },
            "sources": [{"id": "gh", "tenant": "acme", "dedupe": {"header": "x-id"}}],
        },
        "bench",
    )


def new_segment(name: str, queue: int) -> Segment:
    unlink(name)
    return Segment.create(name, make_params(queue_capacity=queue, process_slots=16))


Timing = tuple[float, float, float]  # wall s, this process's cpu s, redis-server's cpu s


async def timed(n: int, body: Callable[[int], Awaitable[object]], server: RedisServer) -> Timing:
    """Run body(i) for i < n over CONCURRENCY tasks."""

    async def lane(k: int) -> None:
        for i in range(k, n, CONCURRENCY):
            await body(i)

    t, c, r = time.perf_counter(), time.process_time(), cpu_s([server.pid])[server.pid]
    await asyncio.gather(*(lane(k) for k in range(CONCURRENCY)))
    redis_cpu = cpu_s([server.pid])[server.pid] - r
    return time.perf_counter() - t, time.process_time() - c, redis_cpu


def _admit_run(server: RedisServer, scope: str, n: int) -> Timing:
    """n admits through Fleet in one scope."""
    name = f"bench-fleet-{os.getpid()}"
    cfg = make_config(name, server.url, scope)
    seg = new_segment(name, 1024)
    slot = procs.claim(seg.view, seg.layout, procs.Role.TOOL)

    async def run() -> Timing:
        fleet = Fleet(cfg, seg, slot, RedisStore.from_config(cfg.fleet))
        src = cfg.sources[0]
        await fleet.admit(src, Envelope(b"warm"))
        before = server.commandstats().get("evalsha", 0)
        timing = await timed(
            n, lambda i: fleet.admit(src, Envelope(f"{scope}-{i}".encode())), server
        )
        calls = server.commandstats().get("evalsha", 0) - before
        admitted = counters.totals(seg.view, seg.layout)[Counter.ADMIT_OK] - 1
        await fleet.close()
        if scope == "fleet":
            figure("fleet admitted hooks per script call", admitted / calls, "", ">= 1")
        return timing

    try:
        return uvloop.run(run())
    finally:
        seg.close()
        unlink(name)


def bench_admission(server: RedisServer, n: int) -> None:
    print(f"\nadmission ({n} hooks, {CONCURRENCY} concurrent, one worker process)")
    results = {scope: _admit_run(server, scope, n) for scope in ("node", "fleet")}

    async def redis_py() -> Timing:
        r = aioredis.Redis.from_url(server.url)
        sha = await r.script_load(ADMIT.source)
        key = "bench:{acme}:rl"

        async def call(i: int) -> None:
            await r.evalsha(
                sha, 2, key, f"bench:{{acme}}:dd:gh:rp-{i}", 1, 1, 1_000_000, 30_000, "ab"
            )

        timing = await timed(n, call, server)
        await r.aclose()
        return timing

    results["redis-py"] = uvloop.run(redis_py())
    for label, (wall, cpu, redis_cpu) in results.items():
        figure(f"{label} admits per second", n / wall, "/s")
        figure(f"{label} CPU us per admit", cpu / n * 1e6, "us")
        if label != "node":
            figure(f"{label} redis-server CPU us per admit", redis_cpu / n * 1e6, "us")
    ratio = results["redis-py"][1] / results["fleet"][1]
    figure("fleet CPU per admit: redis-py / ours", ratio, "x")
    ratio = results["redis-py"][2] / results["fleet"][2]
    figure("redis-server CPU per admit: redis-py / ours", ratio, "x")


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


def _stall_worker(name: str, url: str, fleet_kw: dict[str, Any], seconds: float, out: Any) -> None:
    """Admit from CONCURRENCY lanes for ``seconds``, as a request worker would (its start-up
    included); report every admit's start and latency, and what was refused."""
    cfg = make_config(name, url, "fleet", **fleet_kw)
    seg = Segment.attach(name)
    slot = procs.claim(seg.view, seg.layout, procs.Role.WORKER)
    child.freeze_heap()
    starts, lat = array("d"), array("d")
    refused = 0

    async def run() -> None:
        nonlocal refused
        fleet = Fleet(cfg, seg, slot, RedisStore.from_config(cfg.fleet))
        src = cfg.sources[0]
        await fleet.admit(src, Envelope(b"warm"))
        deadline = time.monotonic() + seconds
        tag = os.urandom(4).hex().encode()

        async def lane(i: int) -> None:
            nonlocal refused
            while (t := time.monotonic()) < deadline:
                answer = await fleet.admit(src, Envelope(b"stall-%s-%d" % (tag, i)))
                starts.append(t)
                lat.append(time.monotonic() - t)
                if not isinstance(answer, Admit):
                    refused += 1
                i += CONCURRENCY
                await asyncio.sleep(0)  # a worker reads its socket between hooks

        await asyncio.gather(*(lane(k) for k in range(CONCURRENCY)))
        await fleet.close()

    uvloop.run(run())
    out.put((starts.tobytes(), lat.tobytes(), refused))
    seg.close()


def _stall_run(
    server: RedisServer, fleet_kw: dict[str, Any], stall_s: float, flushes: int = 0
) -> dict[str, Any]:
    """Two worker processes admit for 1 s, through a SIGSTOP of ``stall_s`` (or, with
    ``flushes``, that many SCRIPT FLUSHes spread over the same time), and 2 s after;
    the breaker's transitions are watched from here."""
    name = f"bench-stall-{os.getpid()}"
    seg = new_segment(name, 1024)
    ctx = multiprocessing.get_context("fork")
    out = ctx.Queue()
    seconds = 1.0 + stall_s + 2.0
    try:
        workers = [
            ctx.Process(target=_stall_worker, args=(name, server.url, fleet_kw, seconds, out))
            for _ in range(2)
        ]
        for w in workers:
            w.start()
        time.sleep(1.0)
        word = seg.layout.offset("breaker")
        seen: list[tuple[float, int]] = []

        def watch(until: float) -> None:
            while time.monotonic() < until:
                state = seg.view.load(word) >> 61
                if not seen or seen[-1][1] != state:
                    seen.append((time.monotonic(), state))
                time.sleep(0.002)

        t_stop = time.monotonic()
        if flushes:
            with server.client() as r:
                for _ in range(flushes):
                    r.script_flush()
                    watch(time.monotonic() + stall_s / flushes)
        else:
            server.stop_signal()
            watch(t_stop + stall_s)
        t_cont = time.monotonic()
        if not flushes:
            server.cont_signal()
        watch(t_cont + 1.5)
        results = [out.get(timeout=seconds + 60) for _ in workers]
        for w in workers:
            w.join(60)
        during: list[float] = []
        refused = 0
        for starts_b, lat_b, ref in results:
            starts, lat = array("d"), array("d")
            starts.frombytes(starts_b)
            lat.frombytes(lat_b)
            during += [x * 1000 for t, x in zip(starts, lat, strict=True) if t_stop <= t < t_cont]
            refused += ref
        during.sort()
        opened = next((t for t, st in seen if st == 1 and t >= t_stop), None)
        closed = next((t for t, st in seen if st == 0 and t >= t_cont), None)
        totals = counters.totals(seg.view, seg.layout)
        return {
            "during": during,
            "refused": refused,
            "open_ms": (opened - t_stop) * 1000 if opened else None,
            "close_ms": (closed - t_cont) * 1000 if closed and opened else None,
            "opens": totals[Counter.BREAKER_TO_OPEN],
            "errors": totals[Counter.STORE_ERROR] + totals[Counter.STORE_TIMEOUT],
        }
    finally:
        seg.close()
        unlink(name)


def _pct(xs: list[float], q: float) -> float:
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def bench_stall(server: RedisServer, stall_s: float) -> None:
    budget = 20
    print(f"\nredis-server SIGSTOPped for {stall_s:g} s under 2 processes x {CONCURRENCY} admits")
    print(f"  (a) breaker held closed: every admit pays the {budget} ms budget")
    r = _stall_run(server, {"timeout_ms": budget, "breaker_min_calls": 10**9}, stall_s)
    d = r["during"]
    figure("stall admits measured", len(d), "")
    figure("stall admit p50", _pct(d, 0.5), "ms")
    figure("stall admit p99", _pct(d, 0.99), "ms", f"<= {budget + 2} ms")
    figure("stall admit max", d[-1] if d else float("nan"), "ms", f"<= {budget + 5} ms")
    figure("stall admits over budget + 2 ms", sum(x > budget + 2 for x in d), "")
    figure("stall refusals", r["refused"], "", "= 0")
    print("  (b) breaker over a 1 s window, open for 1 s, then probe")
    fleet_kw = {"timeout_ms": budget, "breaker_window_ms": 1000, "breaker_open_ms": 1000}
    r = _stall_run(server, fleet_kw, stall_s)
    figure("stall breaker time to open", r["open_ms"] or float("nan"), "ms")
    figure("stall breaker time to close after SIGCONT", r["close_ms"] or float("nan"), "ms")
    figure("stall breaker refusals", r["refused"], "", "= 0")
    figure("stall breaker admit p99", _pct(r["during"], 0.99), "ms")


def bench_cold_cache(server: RedisServer, flushes: int) -> None:
    print(f"\ncold script cache: {flushes} SCRIPT FLUSHes under 2 processes x {CONCURRENCY} admits")
    with server.client() as c:
        c.config_resetstat()
    r = _stall_run(server, {"timeout_ms": 20}, 3.0, flushes=flushes)
    stats = server.commandstats()
    figure("cold cache breaker opens", r["opens"], "", "= 0")
    figure("cold cache failed store calls", r["errors"], "")
    figure("cold cache full-source EVALs", stats.get("eval", 0), "", "= 0")
    figure("cold cache SCRIPT LOADs", stats.get("script|load", 0), "")
    figure("cold cache refusals", r["refused"], "", "= 0")


def main() -> None:
    print("command: " + " ".join(shlex.quote(a) for a in [sys.executable, *sys.argv]))
    parts: dict[str, Callable[[RedisServer], None]] = {
        "admission": lambda s: bench_admission(s, 40_000),
        "load": lambda s: bench_settle_under_load(s, 3.0),
        "drainer": lambda s: bench_drainer(s, 200_000),
        "stall": lambda s: bench_stall(s, 3.0),
        "cold-cache": lambda s: bench_cold_cache(s, 6),
    }
    only = sys.argv[1:] or list(parts)
    unknown = [p for p in only if p not in parts]
    if unknown:
        sys.exit(f"bench_fleet: unknown part {unknown[0]!r}; parts: {', '.join(parts)}")
    server = RedisServer()
    try:
        for part in only:
            parts[part](server)
    finally:
        server.close()
    print(json.dumps(figures, sort_keys=True))


if __name__ == "__main__":
    main()
