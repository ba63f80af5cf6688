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

Each request is a distinct signed GitHub-style hook (313-byte body). The figure is the
best of R repetitions of N hooks, in microseconds per hook, and the ratio to ``bare``.
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
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))  # bare_server

import uvloop
from bare_server import Bare

from ankusa_shm import config
from ankusa_shm.fleet.admission import Fleet
from ankusa_shm.hooks import CommitResult, Committed, NewHook
from ankusa_shm.http.observe import Observer
from ankusa_shm.http.protocol import Connection, HttpServer, Limits, Request, Response
from ankusa_shm.http.request_path import RequestPath, accepted
from ankusa_shm.shm import procs
from ankusa_shm.shm.procs import Role
from ankusa_shm.shm.segment import Segment, make_params, unlink
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
    in which it was queued has ended, the way the writer thread hands a batch back."""

    def __init__(self) -> None:
        self.queued: list[tuple[asyncio.Future[CommitResult], CommitResult]] = []

    async def commit(self, hook: NewHook, claim: object = None) -> CommitResult:
        future: asyncio.Future[CommitResult] = asyncio.get_running_loop().create_future()
        self.queued.append((future, Committed(hook.id)))
        return await future

    def hand_back(self) -> None:
        queued, self.queued = self.queued, []
        for future, result in queued:
            future.set_result(result)


def node_config(segment: str) -> config.Config:
    os.environ[SECRET_ENV] = SECRET.decode()
    hmac_spec = {"header": "x-hub-signature-256", "prefix": "sha256=", "secret_env": SECRET_ENV}
    return config.parse(
        {
            "server": {"segment": segment},
            "rate_limits": {"default": {"rate": 1_000_000, "burst": 1_000_000}},
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
    make: Callable[[], Any], data: list[bytes], reps: int, writer: TurnWriter | None
) -> float:
    """Best µs per hook over ``reps`` passes of ``data`` through CONNECTIONS protocols."""
    conns = []
    for _ in range(CONNECTIONS):
        proto, transport = make(), CountingTransport()
        proto.connection_made(transport)
        conns.append((proto, transport))
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        for start in range(0, len(data), CONNECTIONS):
            for (proto, _), request in zip(conns, data[start : start + CONNECTIONS], strict=False):
                proto.data_received(request)
            await asyncio.sleep(0)  # the answer tasks run up to the commit
            if writer is not None:
                writer.hand_back()
                await asyncio.sleep(0)  # the wake-ups
            await asyncio.sleep(0)  # the answers
        best = min(best, (time.perf_counter() - t0) / len(data) * 1e6)
    created = sum(t.created for _, t in conns)
    if created != reps * len(data):  # a path that refused them would look cheap
        raise SystemExit(f"bench_request_path: {created} 201s for {reps * len(data)} hooks")
    return best


async def run(hooks: int, reps: int) -> dict[str, float]:
    data = signed_requests(hooks)
    loop = asyncio.get_running_loop()
    name = f"bench-request-path-{os.getpid()}"
    seg = Segment.create(name, make_params(process_slots=8))
    try:
        cfg = node_config(name)
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
        return {
            "bare_us": await measure(Bare, data, reps, None),
            "protocol_us": await measure(lambda: Connection(protocol, loop), data, reps, None),
            "node_us": await measure(lambda: Connection(node, loop), data, reps, writer),
        }
    finally:
        seg.close()
        unlink(name)


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
    print(json.dumps({k: round(v, 3) for k, v in figures.items()}, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
