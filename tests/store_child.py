"""A separate process for the store's tests: a second writer, or a foreign lock holder.

Run as ``python tests/store_child.py MODE DB [ARGS]``; it talks to the test over stdin and
stdout, one line at a time:

``load DB N CONCURRENCY TAG``  start a Writer, print ``ready``, wait for ``go``, commit N
    hooks (CONCURRENCY at once; every tenth carries a key shared with the other writers),
    close, print one JSON line of what happened.
``stream DB``  start a Writer, print ``ready``, commit hooks until killed, printing the id
    of each one committed as soon as commit() returns it.
``hold-flock DB``  take the writers' flock, print ``held``, let go at the next line.
``hold-sqlite DB``  take SQLite's write lock (BEGIN IMMEDIATE), print ``held``, let go at
    the next line.
"""

from __future__ import annotations

import asyncio
import fcntl
import itertools
import json
import os
import sqlite3
import sys
import time
import uuid

from ankusa_shm import config
from ankusa_shm.hooks import AlreadyStored, Committed, NewHook
from ankusa_shm.store import schema
from ankusa_shm.store.writer import Writer

SHARED_EVERY = 10


def new_hook(tag: str, i: int, shared: bool) -> NewHook:
    """Hook ``i`` of writer ``tag``; a shared key is also committed by the other writers."""
    key = f"shared-{i}" if shared else f"{tag}-{i}"
    return NewHook(
        id=str(uuid.uuid4()),
        tenant="acme",
        source="github",
        event_key=key.encode(),
        dedupe_ttl_s=3600,
        received_ms=time.time_ns() // 1_000_000,
        headers=(("x-tag", tag),),
        body=b"%d" % i,
    )


def say(line: str) -> None:
    os.write(1, (line + "\n").encode())


async def load(db: str, n: int, concurrency: int, tag: str) -> None:
    writer = Writer(config.Store(path=db, lock_timeout_ms=10_000))
    writer.start(asyncio.get_running_loop())
    say("ready")
    assert sys.stdin.readline().strip() == "go"
    counter = itertools.count()
    committed: list[str] = []
    already = 0
    latencies: list[int] = []

    async def one_at_a_time() -> None:
        nonlocal already
        while (i := next(counter)) < n:
            t0 = time.perf_counter_ns()
            result = await writer.commit(new_hook(tag, i, i % SHARED_EVERY == 0))
            latencies.append(time.perf_counter_ns() - t0)
            if isinstance(result, Committed):
                committed.append(result.hook_id)
            elif isinstance(result, AlreadyStored):
                already += 1
            else:
                raise AssertionError(f"hook {i}: {result}")

    t0 = time.perf_counter()
    await asyncio.gather(*(one_at_a_time() for _ in range(concurrency)))
    elapsed = time.perf_counter() - t0
    await writer.close()
    latencies.sort()
    say(
        json.dumps(
            {
                "committed": committed,
                "already": already,
                "elapsed_s": elapsed,
                "max_ms": latencies[-1] / 1e6,
                "p99_ms": latencies[len(latencies) * 99 // 100] / 1e6,
                "batches": writer.stats.batches,
            }
        )
    )


async def stream(db: str) -> None:
    writer = Writer(config.Store(path=db))
    writer.start(asyncio.get_running_loop())
    say("ready")
    counter = itertools.count()

    async def forever() -> None:
        while True:
            result = await writer.commit(new_hook("stream", next(counter), False))
            if isinstance(result, Committed):
                say(result.hook_id)

    await asyncio.gather(*(forever() for _ in range(16)))


def hold_flock(db: str) -> None:
    fd = os.open(schema.lock_path(db), os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX)
    say("held")
    sys.stdin.readline()
    fcntl.flock(fd, fcntl.LOCK_UN)


def hold_sqlite(db: str) -> None:
    conn = sqlite3.connect(db, isolation_level=None)
    conn.execute("BEGIN IMMEDIATE")
    say("held")
    sys.stdin.readline()
    conn.execute("ROLLBACK")
    conn.close()


def main(argv: list[str]) -> None:
    mode, db, *rest = argv
    if mode == "load":
        n, concurrency, tag = rest
        asyncio.run(load(db, int(n), int(concurrency), tag))
    elif mode == "stream":
        asyncio.run(stream(db))
    elif mode == "hold-flock":
        hold_flock(db)
    elif mode == "hold-sqlite":
        hold_sqlite(db)
    else:
        raise SystemExit(f"unknown mode {mode!r}")


if __name__ == "__main__":
    main(sys.argv[1:])
