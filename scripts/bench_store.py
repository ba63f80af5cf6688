#!/usr/bin/env python3
"""Hooks per second into the host's SQLite hook store, with and without group commit.

    cd /work/main && .venv/bin/python scripts/bench_store.py [--hooks N] [--concurrency C]

Three runs, each on a fresh store in a temporary directory, ``durability = "fsync"``
(``synchronous=FULL``), every hook carrying a dedupe key, C commits in flight per process:

baseline     1 process, one transaction (and fsync) per hook: the Writer with
             ``max_batch = 1, commit_wait_ms = 0``
group        1 process, group commit with the default settings
group x2     2 processes at once on the same file, group commit (taking turns on the
             writers' flock)

Each process is a fresh interpreter running this script with ``--child``; its figure is
the time from a common "go" to its last answer. ``wal MB`` is the ``-wal`` file's size as
a process finishes, the largest of them: the file does not shrink while the store is open,
so this is about the longest the log got. ``ckpts`` counts the writers' own checkpoints,
``+N`` those of them finished under the lock (see ``ankusa_shm.store.writer``); ``ckpt ms``
is the longest checkpoint pass outside the lock / the longest hold of the lock by one.

The baseline commits N/10 hooks (it is slow), the others N per process. Ratios are against
the baseline. Every hook must come back Committed, and the store must then hold exactly
the hooks committed; otherwise it exits 1. The last line printed is one JSON object of
every figure. To measure another tree of the package with this script, put it first on
``PYTHONPATH`` (figures it does not keep read 0).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import select
import shlex
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from ankusa_shm import config
from ankusa_shm.hooks import Committed, NewHook
from ankusa_shm.store import readers
from ankusa_shm.store.writer import Writer

SCRIPT = Path(__file__).resolve()


def new_hook(tag: str, i: int) -> NewHook:
    return NewHook(
        id=str(uuid.uuid4()),
        tenant="acme",
        source="github",
        event_key=f"{tag}-{i}".encode(),
        dedupe_ttl_s=259_200,
        received_ms=time.time_ns() // 1_000_000,
        headers=(("content-type", "application/json"), ("x-github-event", "push")),
        body=b'{"action":"opened","number":%d,"padding":"%s"}' % (i, b"x" * 600),
    )


async def child(db: str, n: int, concurrency: int, tag: str, batch: int, wait_ms: int) -> None:
    """Commit n hooks once told to go; print one JSON line of what it took."""
    writer = Writer(config.Store(path=db, max_batch=batch, commit_wait_ms=wait_ms))
    writer.start(asyncio.get_running_loop())
    os.write(1, b"ready\n")
    sys.stdin.readline()
    counter = itertools.count()
    latencies: list[int] = []
    ids: list[str] = []

    async def client() -> None:
        while (i := next(counter)) < n:
            t0 = time.perf_counter_ns()
            result = await writer.commit(new_hook(tag, i))
            latencies.append(time.perf_counter_ns() - t0)
            if not isinstance(result, Committed):
                raise SystemExit(f"hook {i}: {result}")
            ids.append(result.hook_id)

    t0 = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(concurrency)))
    elapsed = time.perf_counter() - t0
    try:
        wal_bytes = os.path.getsize(db + "-wal")
    except FileNotFoundError:
        wal_bytes = 0
    await writer.close()
    latencies.sort()
    figures = {
        "elapsed_s": elapsed,
        "batches": writer.stats.batches,
        "checkpoints": getattr(writer.stats, "checkpoints", 0),
        "locked_checkpoints": getattr(writer.stats, "locked_checkpoints", 0),
        "longest_checkpoint_ms": getattr(writer.stats, "longest_checkpoint_ms", 0.0),
        "longest_locked_ms": getattr(writer.stats, "longest_locked_ms", 0.0),
        "wal_bytes": wal_bytes,
        "p99_ms": latencies[len(latencies) * 99 // 100] / 1e6,
        "p999_ms": latencies[len(latencies) * 999 // 1000] / 1e6,
        "max_ms": latencies[-1] / 1e6,
        "ids": ids,
    }
    os.write(1, json.dumps(figures).encode() + b"\n")


def _line(proc: subprocess.Popen[bytes], timeout: float = 300.0) -> bytes:
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    if not ready:
        raise SystemExit("a child said nothing in time")
    return proc.stdout.readline()


def run(
    name: str, db: str, procs: int, n: int, concurrency: int, batch: int, wait_ms: int
) -> dict[str, Any]:
    """Start ``procs`` children on ``db``, release them together, check and sum them."""
    args = [str(n), str(concurrency), str(batch), str(wait_ms)]
    kids = [
        subprocess.Popen(
            [sys.executable, str(SCRIPT), "--child", db, f"p{k}", *args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
        )
        for k in range(procs)
    ]
    try:
        for kid in kids:
            if _line(kid).strip() != b"ready":
                raise SystemExit(f"{name}: a child did not start")
        t0 = time.perf_counter()
        for kid in kids:
            assert kid.stdin is not None
            kid.stdin.write(b"go\n")
            kid.stdin.flush()
        results = [json.loads(_line(kid)) for kid in kids]
        wall = time.perf_counter() - t0
        if any(kid.wait(60) != 0 for kid in kids):
            raise SystemExit(f"{name}: a child failed")
    finally:
        for kid in kids:
            if kid.poll() is None:
                kid.kill()
                kid.wait(10)
            for pipe in (kid.stdin, kid.stdout):
                if pipe is not None:
                    pipe.close()
    committed = [i for r in results for i in r["ids"]]
    if readers.ids(db) != set(committed) or len(committed) != procs * n:
        raise SystemExit(f"{name}: the store does not hold exactly the hooks committed")
    return {
        "hooks": procs * n,
        "hooks_per_s": procs * n / wall,
        "transactions": sum(r["batches"] for r in results),
        "checkpoints": sum(r["checkpoints"] for r in results),
        "locked_checkpoints": sum(r["locked_checkpoints"] for r in results),
        "longest_checkpoint_ms": max(r["longest_checkpoint_ms"] for r in results),
        "longest_locked_ms": max(r["longest_locked_ms"] for r in results),
        "wal_mb": max(r["wal_bytes"] for r in results) / 2**20,
        "p99_ms": max(r["p99_ms"] for r in results),
        "p999_ms": max(r["p999_ms"] for r in results),
        "max_ms": [round(r["max_ms"], 1) for r in results],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--hooks", type=int, default=20_000, help="hooks per process")
    ap.add_argument("--concurrency", type=int, default=64, help="commits in flight")
    ap.add_argument("--child", nargs=6, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        db, tag, n, conc, batch, wait_ms = a.child
        asyncio.run(child(db, int(n), int(conc), tag, int(batch), int(wait_ms)))
        return
    print("$ cd", shlex.quote(os.getcwd()), "&&", shlex.join([sys.executable, *sys.argv]))
    defaults = config.Store()
    runs = [
        ("baseline", 1, max(1, a.hooks // 10), 1, 0),
        ("group", 1, a.hooks, defaults.max_batch, defaults.commit_wait_ms),
        ("group x2", 2, a.hooks, defaults.max_batch, defaults.commit_wait_ms),
    ]
    figures: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="bench-store-") as tmp:
        for k, (name, procs, n, batch, wait_ms) in enumerate(runs):
            db = str(Path(tmp) / f"run{k}" / "hooks.db")
            figures[name] = run(name, db, procs, n, a.concurrency, batch, wait_ms)
    base = figures["baseline"]["hooks_per_s"]
    head = ("run", "hooks", "hooks/s", "x base", "txns", "ckpts", "ckpt ms", "wal MB", "p99 ms")
    print("{:<10} {:>7} {:>9} {:>7} {:>6} {:>9} {:>9} {:>6} {:>6} p99.9  max ms".format(*head))
    for name, f in figures.items():
        f["ratio"] = f["hooks_per_s"] / base
        ckpts = f"{f['checkpoints']}+{f['locked_checkpoints']}"
        ckpt_ms = f"{f['longest_checkpoint_ms']:.0f}/{f['longest_locked_ms']:.0f}"
        print(
            f"{name:<10} {f['hooks']:>7} {f['hooks_per_s']:>9.0f} {f['ratio']:>7.1f}"
            f" {f['transactions']:>6} {ckpts:>9} {ckpt_ms:>9} {f['wal_mb']:>6.1f}"
            f" {f['p99_ms']:>6.1f} {f['p999_ms']:>5.1f}  {f['max_ms']}"
        )
    print(json.dumps({"version": 1, "concurrency": a.concurrency, "runs": figures}))


if __name__ == "__main__":
    main()
