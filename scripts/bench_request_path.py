#!/usr/bin/env python3
"""CPU per hook in a worker's event loop, without the network and without the store.

    .venv/bin/python scripts/bench_request_path.py [--hooks N] [--reps R]

Under ``bench_http.py``'s load the worker's event loop is the busiest thread on the
machine, so every microsecond it spends per hook is throughput. This measures that Python
cost alone, in one process, deterministically: complete requests are handed to
``data_received`` of 32 connections whose transports only count what is written, the
way uvloop would hand them over, and the answers are written when the turn ends.

  bare      benchmarks/bare_server.py's protocol: httptools answering 201 (the baseline)
  protocol  ankusa-shm's HTTP protocol (framing, limits, pipeline, answer task) with a
            handler that answers a fixed 201
  node      the whole request path of a node-scope worker: route, HMAC-SHA256 check,
            GitHub event key, GCRA in a real segment, the hook built and handed to a
            writer whose answers come back one turn later as the store's would
            (no SQLite: ``bench_store.py`` measures that)
  fleet     the same in fleet scope (rate limits and dedupe) against a private
            redis-server: the hooks of a turn share one admit call, and each committed
            hook's promote is pushed onto the settle queue, as the writer thread does.
            Its figure is this process's CPU time, since it also waits for Redis; the
            server's own CPU per hook is printed beside it. Needs redis-server on PATH.

Each request is a distinct signed GitHub-style hook (313-byte body). The figure is the
best of R repetitions of N hooks, in microseconds per hook, and the ratio to ``bare``
(``fleet``: to ``node``, the figure it is measured against).
The last line is one JSON object of the figures.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import hmac
import json
import os
import shlex
import shutil
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))  # bare_server
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))  # redis_server

import uvloop
from bare_server import Bare

from ankusa_shm import config
from ankusa_shm.fleet.admission import Fleet
from ankusa_shm.fleet.redis_store import RedisStore
from ankusa_shm.hooks import CommitResult, Committed, NewHook
from ankusa_shm.http.observe import Observer
from ankusa_shm.http.protocol import Connection, HttpServer, Limits, Request, Response
from ankusa_shm.http.request_path import RequestPath, accepted
from ankusa_shm.shm import procs
from ankusa_shm.shm.procs import Role
from ankusa_shm.shm.segment import Segment, make_params, unlink
from ankusa_shm.shm.settle_queue import SettleQueue
from ankusa_shm.store.writer import Writer

CONNECTIONS = 32  # one worker's share of bench_http's 64
SECRET = b"bench-request-path"
SECRET_ENV = "ANKUSA_BENCH_REQUEST_PATH_SECRET"


def signed_requests(n: int) -> list[bytes]:
    """``n`` distinct hooks as a GitHub sender writes them."""
    out = []
    for _ in range(n):
        delivery = str(uuid.uuid4())
        body = json.dumps(
            {
                "action": "opened",
                "delivery": delivery,
                "repository": {"full_name": "acme/widgets", "id": 1296269},
                "sender": {"login": "octocat"},
                "pad": "x" * 138,  # 313 bytes in all, as bench_http's bodies
            }
        ).encode()
        sig = "sha256=" + hmac.new(SECRET, body, hashlib.sha256).hexdigest()
        out.append(
            b"POST /hooks/github HTTP/1.1\r\nHost: 127.0.0.1:8080\r\n"
            b"User-Agent: GitHub-Hookshot/7a1b2c3\r\nContent-Type: application/json\r\n"
            b"X-GitHub-Event: issues\r\nX-GitHub-Delivery: " + delivery.encode() + b"\r\n"
            b"X-Hub-Signature-256: " + sig.encode() + b"\r\n"
            b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body
        )
    return out


class CountingTransport:
    """What the protocols write to: counts the 201s written, sends nothing."""

    def __init__(self) -> None:
        self.created = 0

    def write(self, data: bytes) -> None:
        self.created += data.startswith(b"HTTP/1.1 201 ")

    def is_closing(self) -> bool:
        return False

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return default

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass

    def close(self) -> None:
        pass


class TurnWriter:
    """Stands in for the store's writer: each commit is answered Committed once the turn
    in which it was queued has ended, the way the writer thread hands a batch back, its
    claim settled first (``settle``) as the writer thread does."""

    def __init__(self, settle: Callable[[Any, CommitResult], None] | None = None) -> None:
        self.queued: list[tuple[asyncio.Future[CommitResult], CommitResult, Any]] = []
        self._settle = settle
        self._want = 0
        self._all_queued: asyncio.Event | None = None

    def expect(self, n: int) -> asyncio.Event:
        """Set once ``n`` commits are queued: a fleet hook's comes after its Redis reply."""
        self._want, self._all_queued = n, asyncio.Event()
        return self._all_queued

    async def commit(self, hook: NewHook, claim: object = None) -> CommitResult:
        future: asyncio.Future[CommitResult] = asyncio.get_running_loop().create_future()
        self.queued.append((future, Committed(hook.id), claim))
        if self._all_queued is not None and len(self.queued) >= self._want:
            self._all_queued.set()
        return await future

    def hand_back(self) -> None:
        queued, self.queued = self.queued, []
        for future, result, claim in queued:
            if self._settle is not None:
                self._settle(claim, result)
            future.set_result(result)


def make_config(segment: str, redis_url: str = "") -> config.Config:
    """Node scope; with ``redis_url``, rate limits and dedupe both fleet scope."""
    os.environ[SECRET_ENV] = SECRET.decode()
    hmac_spec = {"header": "x-hub-signature-256", "prefix": "sha256=", "secret_env": SECRET_ENV}
    scope = "fleet" if redis_url else "node"
    return config.parse(
        {
            "server": {"segment": segment},
            "rate_limits": {"scope": scope, "default": {"rate": 1_000_000, "burst": 1_000_000}},
            "dedupe": {"scope": scope},
            "fleet": {"redis_url": redis_url or "redis://127.0.0.1:6379/0"},
            "sources": [
                {
                    "id": "github",
                    "tenant": "acme",
                    "verify": {"hmac": hmac_spec},
                    "dedupe": {"preset": "github"},
                }
            ],
        },
        "bench_request_path",
    )


async def measure(
    make: Callable[[], Any],
    data: list[bytes],
    reps: int,
    writer: TurnWriter | None,
    waits: bool = False,
    between: Callable[[], None] = lambda: None,
) -> float:
    """Best µs per hook over ``reps`` passes of ``data`` through CONNECTIONS protocols.
    ``waits``: the path waits for Redis, so the figure is this process's CPU time, not
    the time passed; ``between`` runs after each pass, untimed."""
    clock = time.process_time if waits else time.perf_counter
    conns = []
    for _ in range(CONNECTIONS):
        proto, transport = make(), CountingTransport()
        proto.connection_made(transport)
        conns.append((proto, transport))
    best = float("inf")
    for _ in range(reps):
        t0 = clock()
        for start in range(0, len(data), CONNECTIONS):
            turn = data[start : start + CONNECTIONS]
            queued = writer.expect(len(turn)) if writer is not None and waits else None
            for (proto, _), request in zip(conns, turn, strict=False):
                proto.data_received(request)
            await asyncio.sleep(0)  # the answer tasks run up to the commit (or the admit)
            if queued is not None:
                await queued.wait()  # every admit answered, every hook queued to commit
            if writer is not None:
                writer.hand_back()
                await asyncio.sleep(0)  # the wake-ups
            await asyncio.sleep(0)  # the answers
        best = min(best, (clock() - t0) / len(data) * 1e6)
        between()
    created = sum(t.created for _, t in conns)
    if created != reps * len(data):  # a path that refused them would look cheap
        raise SystemExit(f"bench_request_path: {created} 201s for {reps * len(data)} hooks")
    return best


async def run(hooks: int, reps: int) -> dict[str, float]:
    data = signed_requests(hooks)
    loop = asyncio.get_running_loop()
    name = f"bench-request-path-{os.getpid()}"
    # A queue that holds every pass's promotes: a full one would count drops, not push.
    seg = Segment.create(name, make_params(process_slots=8, queue_capacity=1 << 15))
    try:
        cfg = make_config(name)
        slot = procs.claim(seg.view, seg.layout, Role.WORKER)
        fleet = Fleet(cfg, seg, slot, None)
        observer = Observer.of_slot(seg, slot.index, [s.id for s in cfg.sources])
        writer = TurnWriter()
        path = RequestPath(cfg, fleet, cast(Writer, writer), slot.counters, observer)
        limits = Limits.of(cfg.server)
        fixed = accepted("01938d5e-7b7a-7cc1-8f0e-2c5d7e8a9b10")

        async def answer_fixed(req: Request) -> Response:
            return fixed

        protocol = HttpServer(answer_fixed, limits, observer.answered)
        node = HttpServer(path, limits, observer.answered)
        figures = {
            "bare_us": await measure(Bare, data, reps, None),
            "protocol_us": await measure(lambda: Connection(protocol, loop), data, reps, None),
            "node_us": await measure(lambda: Connection(node, loop), data, reps, writer),
        }
        if shutil.which("redis-server") is not None:
            figures.update(await run_fleet(data, reps, name, seg, slot, observer))
        return figures
    finally:
        seg.close()
        unlink(name)


async def run_fleet(
    data: list[bytes],
    reps: int,
    name: str,
    seg: Segment,
    slot: procs.ProcessSlot,
    observer: Observer,
) -> dict[str, float]:
    """``fleet_us`` and ``fleet_redis_us``: this process's and redis-server's CPU per hook."""
    from redis_server import RedisServer  # needs redis-py, a dev dependency

    loop = asyncio.get_running_loop()
    server = RedisServer()
    try:
        cfg = make_config(name, server.url)
        fleet = Fleet(cfg, seg, slot, RedisStore.from_config(cfg.fleet))
        writer = TurnWriter(fleet.settle)
        path = RequestPath(cfg, fleet, cast(Writer, writer), slot.counters, observer)
        http = HttpServer(path, Limits.of(cfg.server), observer.answered)
        queue = SettleQueue(seg.view, seg.buf, seg.layout)
        redis_cpu = [cpu_s(server.pid)]

        def between() -> None:
            """Untimed: the server's CPU so far, the keys gone (the next pass sends the same
            events, new again), and the promotes taken off the queue as the drainer would."""
            redis_cpu.append(cpu_s(server.pid))
            with server.client() as r:
                r.flushall()
            while (batch := queue.peek(4096, time.monotonic_ns() // 1_000_000)[0]).records:
                queue.commit(batch)
            redis_cpu.append(cpu_s(server.pid))

        us = await measure(lambda: Connection(http, loop), data, reps, writer, True, between)
        passes = [b - a for a, b in zip(redis_cpu[::2], redis_cpu[1::2], strict=False)]
        await fleet.close()
        return {"fleet_us": us, "fleet_redis_us": min(passes) / len(data) * 1e6}
    finally:
        server.close()


def cpu_s(pid: int) -> float:
    """A process's CPU seconds so far, from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hooks", type=int, default=20_000, help="distinct hooks per pass")
    p.add_argument("--reps", type=int, default=5, help="passes; the best counts")
    args = p.parse_args()
    print("command: " + " ".join(shlex.quote(a) for a in [sys.executable, *sys.argv]))
    figures = uvloop.run(run(args.hooks, args.reps))
    bare = figures["bare_us"]
    for key, what in (
        ("bare_us", "httptools answering 201 (baseline)"),
        ("protocol_us", "ankusa-shm's HTTP protocol, fixed 201"),
        ("node_us", "the node-scope request path, store excluded"),
    ):
        ratio = figures[key] / bare
        figures[key.replace("_us", "_vs_bare")] = round(ratio, 2)
        print(f"  {key[:-3]:<9} {figures[key]:7.2f} us/hook  {ratio:6.2f}x bare   {what}")
    if "fleet_us" in figures:
        ratio = figures["fleet_us"] / figures["node_us"]
        figures["fleet_vs_node"] = round(ratio, 2)
        print(
            f"  fleet     {figures['fleet_us']:7.2f} us/hook  {ratio:6.2f}x node   the same, fleet "
            f"scope, CPU time (redis-server: {figures['fleet_redis_us']:.2f} us/hook more)"
        )
    else:
        print("  fleet     not measured: redis-server is not on PATH")
    print(json.dumps({k: round(v, 3) for k, v in figures.items()}, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
