"""The host's hook store: real SQLite files, real threads, real processes where it matters.

Other writers and foreign lock holders are separate processes (``tests/store_child.py``)
started with ``subprocess`` and stopped by their own ``Popen``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import fcntl
import json
import os
import random
import resource
import select
import shutil
import signal
import sqlite3
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Coroutine
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, TypeVar

import pytest

from ankusa_shm import config
from ankusa_shm.clock import WallClock, wall_ms
from ankusa_shm.config import ConfigError
from ankusa_shm.hooks import AlreadyStored, CommitResult, Committed, NewHook, NotStored
from ankusa_shm.store import inserts, readers, schema, writer
from ankusa_shm.store.control import Control
from ankusa_shm.store.inserts import encode_headers
from ankusa_shm.store.writer import (
    SWEEP_ROWS,
    UNAVAILABLE,
    OnCommit,
    StoreError,
    Writer,
)

CHILD = str(Path(__file__).with_name("store_child.py"))
T = TypeVar("T")
T0 = 1_700_000_000_000  # a wall-clock ms for the fake clock


class FakeWall:
    """A wall clock the test moves by hand: expiry without sleeping."""

    def __init__(self) -> None:
        self.now = T0

    def __call__(self) -> int:
        return self.now


def hook(
    key: bytes | None = None,
    *,
    source: str = "github",
    ttl_s: int = 60,
    body: bytes = b'{"ok":true}',
) -> NewHook:
    return NewHook(
        id=str(uuid.uuid4()),
        tenant="acme",
        source=source,
        event_key=key,
        dedupe_ttl_s=ttl_s,
        received_ms=T0 - 5,
        headers=(("content-type", "application/json"), ("x-github-event", "push")),
        body=body,
    )


def store_cfg(tmp_path: Path, **kw: Any) -> config.Store:
    return config.Store(path=str(tmp_path / "var" / "hooks.db"), **kw)


def run(body: Callable[[], Coroutine[Any, Any, T]]) -> T:
    return asyncio.run(body())


@asynccontextmanager
async def started(
    cfg: config.Store, wall: WallClock = wall_ms, on_commit: OnCommit | None = None
) -> AsyncIterator[Writer]:
    """A Writer started on the running loop, closed on the way out (closing twice is fine)."""
    writer = Writer(cfg, wall, on_commit)
    writer.start(asyncio.get_running_loop())
    try:
        yield writer
    finally:
        await writer.close()


def index_rows(db: str) -> dict[bytes, tuple[str, int]]:
    """The dedupe index as event key -> (hook id, expires_ms), read behind the writer's back."""
    conn = sqlite3.connect(db)
    try:
        rows = conn.execute("SELECT event_key, hook_id, expires_ms FROM dedupe").fetchall()
    finally:
        conn.close()
    return {k: (h, e) for k, h, e in rows}


class Child:
    """A helper process speaking lines on stdin/stdout; killed on the way out if alive."""

    def __init__(self, *args: str) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, CHILD, *args], stdin=subprocess.PIPE, stdout=subprocess.PIPE
        )
        self._buf = b""

    def line(self, timeout: float = 30.0) -> str:
        assert self.proc.stdout is not None
        deadline = time.monotonic() + timeout
        while b"\n" not in self._buf:
            left = deadline - time.monotonic()
            ready, _, _ = select.select([self.proc.stdout], [], [], max(0.0, left))
            if not ready:
                raise AssertionError("the child said nothing in time")
            chunk = os.read(self.proc.stdout.fileno(), 1 << 16)
            if not chunk:
                raise AssertionError(f"the child ended (exit status {self.proc.wait()})")
            self._buf += chunk
        line, _, self._buf = self._buf.partition(b"\n")
        return line.decode()

    def rest(self) -> list[str]:
        """Every whole line it wrote before its stdout closed."""
        assert self.proc.stdout is not None
        self._buf += self.proc.stdout.read()
        return [x.decode() for x in self._buf.split(b"\n") if x]

    def send(self, line: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(line.encode() + b"\n")
        self.proc.stdin.flush()

    def wait(self) -> int:
        return self.proc.wait(30)

    def __enter__(self) -> Child:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(30)
        for pipe in (self.proc.stdin, self.proc.stdout):
            if pipe is not None:
                pipe.close()


# -- config ------------------------------------------------------------------------------------


def test_store_settings_defaults_and_ranges() -> None:
    s = config.defaults().store
    assert (s.commit_wait_ms, s.max_batch, s.lock_timeout_ms, s.sweep_interval_s) == (
        0,
        256,
        5_000,
        60,
    )
    for key, value in [
        ("commit_wait_ms", 51),
        ("max_batch", 0),
        ("lock_timeout_ms", 5),
        ("sweep_interval_s", 0),
    ]:
        with pytest.raises(ConfigError, match=f"store.{key}: must be between"):
            config.parse({"store": {key: value}}, "t.toml")
    assert config.parse({"store": {"commit_wait_ms": 0}}, "t.toml").store.commit_wait_ms == 0


# -- one writer --------------------------------------------------------------------------------


def test_commit_then_read_back_intact(tmp_path: Path) -> None:
    cfg = store_cfg(tmp_path)
    h = hook(b"evt-1", body=bytes(range(256)) * 4)

    async def body() -> CommitResult:
        async with started(cfg) as w:
            return await w.commit(h)

    assert run(body) == Committed(h.id)
    got = readers.get(cfg.path, h.id)
    assert got is not None
    assert (got.id, got.tenant, got.source, got.event_key) == (h.id, "acme", "github", b"evt-1")
    assert (got.received_ms, got.headers, got.body) == (h.received_ms, h.headers, h.body)
    assert readers.get(cfg.path, "no-such-id") is None
    assert readers.count(cfg.path) == 1


def test_a_new_store_is_readable_by_its_owner_alone(tmp_path: Path) -> None:
    """Its files hold every hook's body and headers: 0600 whatever the umask lets through
    (systemd's UMask=0077 is not there when it is run by hand)."""
    cfg = store_cfg(tmp_path)
    old = os.umask(0o022)
    try:

        async def body() -> None:
            async with started(cfg) as w:
                await w.commit(hook())
                modes = {s: os.stat(cfg.path + s).st_mode & 0o777 for s in ("", "-wal", "-shm")}
                assert modes == {"": 0o600, "-wal": 0o600, "-shm": 0o600}

        run(body)
    finally:
        os.umask(old)


def test_same_key_is_already_stored_and_not_inserted(tmp_path: Path) -> None:
    cfg = store_cfg(tmp_path)
    first, again, other_source = hook(b"k"), hook(b"k"), hook(b"k", source="stripe")

    async def body() -> list[CommitResult]:
        async with started(cfg) as w:
            return [await w.commit(first), await w.commit(again), await w.commit(other_source)]

    assert run(body) == [Committed(first.id), AlreadyStored(first.id), Committed(other_source.id)]
    assert readers.ids(cfg.path) == {first.id, other_source.id}


def test_stored_reads_the_index_within_its_window_and_outside_the_lock(tmp_path: Path) -> None:
    """``stored`` (asked for a hook about to be refused) names the hook a key was stored
    under, per source and within its window, and is answered while another process holds
    the writers' lock: it never waits for a write."""
    cfg = store_cfg(tmp_path, lock_timeout_ms=5_000)
    wall = FakeWall()
    first = hook(b"k", ttl_s=10)

    async def body() -> list[str | None]:
        async with started(cfg, wall) as w:
            assert await w.commit(first) == Committed(first.id)
            with Child("hold-flock", cfg.path) as child:
                assert child.line() == "held"
                found = await asyncio.wait_for(
                    asyncio.gather(
                        w.stored("github", b"k"), w.stored("stripe", b"k"), w.stored("github", b"j")
                    ),
                    1.0,
                )
                child.send("release")
                assert child.wait() == 0
            wall.now += 10_000  # the window is over
            return [*found, await w.stored("github", b"k")]

    assert run(body) == [first.id, None, None, None]


def test_same_key_in_one_batch(tmp_path: Path) -> None:
    cfg = store_cfg(tmp_path, commit_wait_ms=20)
    a, b = hook(b"twice"), hook(b"twice")

    async def body() -> tuple[list[CommitResult], int]:
        async with started(cfg) as w:
            results = await asyncio.gather(w.commit(a), w.commit(b))
            return list(results), w.stats.batches

    assert run(body) == ([Committed(a.id), AlreadyStored(a.id)], 1)
    assert readers.ids(cfg.path) == {a.id}


def test_expired_index_row_is_replaced(tmp_path: Path) -> None:
    cfg = store_cfg(tmp_path)
    wall = FakeWall()
    first, second = hook(b"k", ttl_s=10), hook(b"k", ttl_s=10)

    async def body() -> list[CommitResult]:
        async with started(cfg, wall) as w:
            r1 = await w.commit(first)
            wall.now += 9_999
            r2 = await w.commit(hook(b"k"))  # still inside the window
            wall.now += 1  # exactly at expiry: expired
            r3 = await w.commit(second)
            return [r1, r2, r3]

    assert run(body) == [Committed(first.id), AlreadyStored(first.id), Committed(second.id)]
    assert readers.ids(cfg.path) == {first.id, second.id}
    assert index_rows(cfg.path) == {b"k": (second.id, T0 + 10_000 + 10_000)}


def test_duplicate_id_leaves_its_key_unclaimed(tmp_path: Path) -> None:
    """A hook whose id is taken (a caller's bug) is answered duplicate_id in the middle of
    a batch and claims nothing: a later hook of its key in the same batch is stored."""
    cfg = store_cfg(tmp_path, commit_wait_ms=20)
    first = hook()
    a, c, d = hook(b"k1"), hook(b"k2"), hook(b"k1")
    dup = dataclasses.replace(hook(b"k2"), id=first.id)

    async def body() -> tuple[list[CommitResult], int]:
        async with started(cfg) as w:
            await w.commit(first)
            results = await asyncio.gather(*(w.commit(h) for h in (a, dup, c, d)))
            return list(results), w.stats.batches

    results, batches = run(body)
    assert results == [
        Committed(a.id),
        NotStored("duplicate_id"),
        Committed(c.id),
        AlreadyStored(a.id),
    ]
    assert batches == 2
    assert readers.ids(cfg.path) == {first.id, a.id, c.id}
    assert {k: h for k, (h, _) in index_rows(cfg.path).items()} == {b"k1": a.id, b"k2": c.id}


@pytest.mark.parametrize("batched", [True, False], ids=["batched", "per-hook"])
@pytest.mark.parametrize("max_batch", [7, 300])
def test_batches_decide_as_one_hook_at_a_time(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, batched: bool, max_batch: int
) -> None:
    """Random rounds of hooks (few keys, two sources, windows of 0 to 2 s, some taken ids),
    the clock moving between rounds, through the batched statements (batches of 7 and of
    up to 300: several statements of each size) and through the per-hook ones: every
    answer, the stored hooks in their order and the index are what deciding each hook
    alone, in order, gives."""
    monkeypatch.setattr(inserts, "_BATCHED", batched)
    rng = random.Random(7)
    cfg = store_cfg(tmp_path, commit_wait_ms=20, max_batch=max_batch)
    index: dict[tuple[str, bytes], tuple[str, int]] = {}
    stored: list[str] = []
    expected: list[CommitResult] = []
    rounds: list[tuple[int, list[NewHook]]] = []
    now = T0
    for _ in range(12):
        group: list[NewHook] = []
        for _ in range(rng.choice([1, 5, 60, 140, 290])):
            key = None if rng.random() < 0.3 else b"k%d" % rng.randrange(40)
            h = hook(key, source=rng.choice(["github", "stripe"]), ttl_s=rng.choice([0, 1, 2]))
            if rng.random() < 0.03 and stored:
                h = dataclasses.replace(h, id=rng.choice(stored))
            group.append(h)
            seen = index.get((h.source, key)) if key is not None else None
            if seen is not None and seen[1] > now:
                expected.append(AlreadyStored(seen[0]))
            elif h.id in stored:
                expected.append(NotStored("duplicate_id"))
            else:
                stored.append(h.id)
                if key is not None:
                    index[h.source, key] = (h.id, now + h.dedupe_ttl_s * 1000)
                expected.append(Committed(h.id))
        rounds.append((now, group))
        now += rng.choice([0, 500, 1_000, 2_000])
    assert {type(r) for r in expected} == {Committed, AlreadyStored, NotStored}
    wall = FakeWall()

    async def body() -> list[CommitResult]:
        results: list[CommitResult] = []
        async with started(cfg, wall) as w:
            for at, group in rounds:
                wall.now = at
                results += await asyncio.gather(*(w.commit(h) for h in group))
        return results

    assert run(body) == expected
    in_order: list[str] = []
    cursor = 0
    while page := readers.page(cfg.path, cursor, 500):
        in_order += [p.id for p in page]
        cursor = page[-1].seq
    assert in_order == stored
    conn = sqlite3.connect(cfg.path)
    try:
        rows = conn.execute("SELECT source, event_key, hook_id, expires_ms FROM dedupe")
        assert {(s, k): (h, e) for s, k, h, e in rows} == index
    finally:
        conn.close()


def test_headers_are_stored_as_compact_json() -> None:
    tricky = (
        ("x-quote", 'say "hi"'),
        ("x-slash", "a\\b/c"),
        ("x-ctl", "tab\tnl\nnul\x00"),
        ("x-utf8", "caf\u00e9 \U0001f600"),
        ("", ""),
    )
    for headers in [(), tricky[:1], tricky]:
        assert encode_headers(headers) == json.dumps(headers, separators=(",", ":"))
        assert tuple(map(tuple, json.loads(encode_headers(headers)))) == headers
    with pytest.raises(TypeError):
        encode_headers((("x-raw", b"bytes"),))  # type: ignore[arg-type]


def test_keyless_hooks_always_stored(tmp_path: Path) -> None:
    cfg = store_cfg(tmp_path)
    hooks = [hook(None) for _ in range(3)]

    async def body() -> list[CommitResult]:
        async with started(cfg) as w:
            return [await w.commit(h) for h in hooks]

    assert run(body) == [Committed(h.id) for h in hooks]
    assert readers.count(cfg.path) == 3
    assert index_rows(cfg.path) == {}


def test_group_commit_groups(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Concurrent commits share transactions, never more than max_batch each, and each
    batch's answers reach the loop in one call_soon_threadsafe."""
    n = 300
    cfg = store_cfg(tmp_path, commit_wait_ms=2, max_batch=64)

    async def body() -> tuple[list[CommitResult], int, int]:
        loop = asyncio.get_running_loop()
        calls = 0
        real = loop.call_soon_threadsafe

        def counting(*args: Any, **kw: Any) -> Any:
            nonlocal calls
            calls += 1
            return real(*args, **kw)

        monkeypatch.setattr(loop, "call_soon_threadsafe", counting)
        async with started(cfg) as w:
            results = await asyncio.gather(*(w.commit(hook(b"g%d" % i)) for i in range(n)))
            batches, largest = w.stats.batches, w.stats.largest
        assert calls == batches + 1  # one per batch, and the thread's goodbye
        return list(results), batches, largest

    results, batches, largest = run(body)
    print(f"{n} hooks in {batches} transactions, the largest of {largest}")
    assert all(isinstance(r, Committed) for r in results)
    assert readers.count(cfg.path) == n
    assert -(-n // 64) <= batches < n // 4
    assert largest <= 64


def test_one_turn_of_the_loop_is_one_batch(tmp_path: Path) -> None:
    """Without any wait, the hooks queued in one turn of the event loop share one
    transaction: the thread is woken when the turn ends, not by the first of them; and
    what a later turn queues is the next transaction's."""
    cfg = store_cfg(tmp_path, commit_wait_ms=0, max_batch=64)

    async def body() -> tuple[int, int, int]:
        async with started(cfg) as w:
            await asyncio.gather(*(w.commit(hook(b"t%d" % i)) for i in range(40)))
            first = w.stats.batches
            await asyncio.gather(*(w.commit(hook(b"u%d" % i)) for i in range(40)))
            return first, w.stats.batches, w.stats.largest

    assert run(body) == (1, 2, 40)
    assert readers.count(cfg.path) == 80


def test_group_commit_without_wait(tmp_path: Path) -> None:
    """Without the wait, hooks that come while a transaction is under way still share the
    next one."""
    n = 300
    cfg = store_cfg(tmp_path, commit_wait_ms=0)

    async def body() -> tuple[int, int]:
        async with started(cfg) as w:
            await asyncio.gather(*(w.commit(hook()) for _ in range(n)))
            return w.stats.batches, w.stats.hooks

    batches, hooks = run(body)
    print(f"commit_wait_ms=0: {n} hooks in {batches} transactions")
    assert hooks == n
    assert batches < n // 4


def test_durability_setting_picks_synchronous(tmp_path: Path) -> None:
    cases: list[tuple[schema.Durability, int]] = [("fsync", 2), ("os", 1)]  # FULL, NORMAL
    for durability, level in cases:
        conn = schema.connect(tmp_path / f"{durability}.db", durability, 100)
        try:
            assert conn.execute("PRAGMA synchronous").fetchone()[0] == level
            assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
        finally:
            conn.close()


def test_close_finishes_what_was_submitted(tmp_path: Path) -> None:
    cfg = store_cfg(tmp_path, commit_wait_ms=5)
    hooks = [hook() for _ in range(50)]

    async def body() -> tuple[list[CommitResult], CommitResult]:
        async with started(cfg) as w:
            tasks = [asyncio.create_task(w.commit(h)) for h in hooks]
            await asyncio.sleep(0)  # every commit is on the queue
            await w.close()
            return [t.result() for t in tasks], await w.commit(hook())

    results, late = run(body)
    assert results == [Committed(h.id) for h in hooks]
    assert late == UNAVAILABLE
    assert readers.count(cfg.path) == 50


def lock_is_free(db: str) -> bool:
    """Whether the writers' flock is free now (another open file: it conflicts even with a
    writer of this process)."""
    fd = os.open(schema.lock_path(db), os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    finally:
        os.close(fd)  # closing lets go of it
    return True


def test_checkpoints_run_outside_the_lock(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The writer's connection never checkpoints in COMMIT; the writer checkpoints by itself
    once it has logged about CHECKPOINT_PAGES, with the writers' flock free, so the log is
    rewound and stays short. Readers read through it all."""
    monkeypatch.setattr(writer, "CHECKPOINT_PAGES", 100)
    cfg = store_cfg(tmp_path, commit_wait_ms=0, durability="os")
    seen: list[tuple[int, bool]] = []  # (wal_autocheckpoint, flock free) per checkpoint
    real_connect = schema.connect

    def connect(*args: Any, **kw: Any) -> sqlite3.Connection:
        conn = real_connect(*args, **kw)
        auto = conn.execute("PRAGMA wal_autocheckpoint").fetchone()[0]

        def trace(sql: str) -> None:
            if sql.startswith("PRAGMA wal_checkpoint"):
                seen.append((auto, lock_is_free(cfg.path)))

        conn.set_trace_callback(trace)
        return conn

    monkeypatch.setattr(schema, "connect", connect)
    hooks = [hook(b"c%d" % i, body=os.urandom(3000)) for i in range(600)]

    async def body() -> tuple[int, int, int]:
        async with started(cfg) as w:
            for h in hooks:  # one transaction each: about 7 pages
                assert await w.commit(h) == Committed(h.id)
            wal = os.path.getsize(cfg.path + "-wal")
            return w.stats.checkpoints, w.stats.locked_checkpoints, wal

    checkpoints, locked, wal = run(body)
    print(f"{checkpoints} checkpoints, -wal file {wal >> 10} KiB")
    assert checkpoints >= 30 and locked == 0  # every ~15 transactions: 40
    assert seen and all(s == (0, True) for s in seen)
    assert wal < 1 << 20  # ~100 pages of log at most; never rewound, it would be ~17 MiB
    assert readers.ids(cfg.path) == {h.id for h in hooks}


def test_two_writers_keep_the_log_bounded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two writers (two connections and lock files, as two processes have) commit at once:
    the log is rewound only by a write that begins after a checkpoint copied all of it,
    which one writer's appending while the other checkpoints keeps from happening; a log
    past WAL_LIMIT_FRAMES is therefore finished under the lock. The -wal file stays near
    that limit instead of holding all that was written."""
    monkeypatch.setattr(writer, "CHECKPOINT_PAGES", 64)
    monkeypatch.setattr(writer, "WAL_LIMIT_FRAMES", 256)
    cfg = store_cfg(tmp_path)  # fsync: a disk that stalls holds both writers up alike
    n = 2500
    hooks = [
        [hook(b"%s-%d" % (tag, i), body=os.urandom(2000)) for i in range(n)] for tag in (b"a", b"b")
    ]

    async def body() -> tuple[list[writer.WriterStats], int]:
        async with started(cfg) as a, started(cfg) as b:

            async def load(w: Writer, mine: list[NewHook]) -> None:
                it = iter(mine)

                async def client() -> None:
                    for h in it:
                        assert isinstance(await w.commit(h), Committed)

                await asyncio.gather(*(client() for _ in range(32)))

            await asyncio.gather(load(a, hooks[0]), load(b, hooks[1]))
            return [a.stats, b.stats], os.path.getsize(cfg.path + "-wal")

    stats, wal = run(body)
    written = 2 * n * 2000
    print(
        f"checkpoints {[s.checkpoints for s in stats]}, under the lock"
        f" {[s.locked_checkpoints for s in stats]}; -wal file {wal >> 20} MiB of"
        f" {written >> 20} MiB of bodies written"
    )
    assert sum(s.locked_checkpoints for s in stats) >= 1
    assert wal < 8 << 20  # 256 frames is 1 MiB; left to grow, the log got to 38 MiB
    assert readers.count(cfg.path) == 2 * n


def test_start_fails_with_one_line_naming_the_path(tmp_path: Path) -> None:
    (tmp_path / "a-file").write_text("not a directory")
    bad = config.Store(path=str(tmp_path / "a-file" / "hooks.db"))

    async def body() -> CommitResult:
        w = Writer(bad)
        with pytest.raises(StoreError) as e:
            w.start(asyncio.get_running_loop())
        assert str(e.value).startswith(bad.path) and "\n" not in str(e.value)
        await w.close()  # as a worker does after a failed boot
        return await w.commit(hook())

    assert run(body) == UNAVAILABLE == NotStored("store_unavailable")


def test_foreign_or_newer_file_is_refused(tmp_path: Path) -> None:
    foreign, newer = tmp_path / "foreign.db", tmp_path / "newer.db"
    with sqlite3.connect(foreign) as conn:
        conn.execute("CREATE TABLE t (x)")
    conn.close()
    with sqlite3.connect(newer) as conn:
        conn.execute(f"PRAGMA application_id = {schema.APPLICATION_ID}")
        conn.execute(f"PRAGMA user_version = {schema.VERSION + 1}")
    conn.close()

    async def body(path: Path) -> str:
        w = Writer(config.Store(path=str(path)))
        with pytest.raises(StoreError) as e:
            w.start(asyncio.get_running_loop())
        return str(e.value)

    assert "not an ankusa-shm hook store" in asyncio.run(body(foreign))
    assert f"store version {schema.VERSION + 1}" in asyncio.run(body(newer))
    # and the supervisor's check, made before it touches the segment, says the same
    for path, says in ((foreign, "not an ankusa-shm"), (newer, "written by a newer build")):
        with pytest.raises(StoreError, match=says):
            schema.check_ours(path)
    current = tmp_path / "current.db"
    schema.open_writer(current, "fsync", 1000).close()
    for fine in (current, tmp_path / "none-yet.db", tmp_path):
        schema.check_ours(fine)


def test_a_lock_file_that_cannot_be_opened_is_the_one_named(tmp_path: Path) -> None:
    """The database may be fine and its lock file the one to mend (left by root, say)."""
    cfg = store_cfg(tmp_path)
    Path(schema.lock_path(cfg.path)).mkdir(parents=True)

    async def body() -> str:
        w = Writer(cfg)
        with pytest.raises(StoreError) as e:
            w.start(asyncio.get_running_loop())
        await w.close()
        return str(e.value)

    assert asyncio.run(body()) == f"{cfg.path}: cannot open {cfg.path}.lock: Is a directory"


def test_write_failure_answers_not_stored_then_recovers(tmp_path: Path) -> None:
    """Simulates a disk that refuses to grow the store (what a full disk does), in a way
    that binds root too, where chmod 0o444 would not: RLIMIT_FSIZE makes the kernel refuse
    to extend any file of this process (EFBIG; Python ignores SIGXFSZ), so appending the big
    hook to the WAL fails with an I/O error. Lifting the limit is "writable again"."""
    cfg = store_cfg(tmp_path)
    before, big, after = hook(), hook(body=os.urandom(1 << 20)), hook()

    async def body() -> list[CommitResult]:
        async with started(cfg) as w:
            r1 = await w.commit(before)
            wal = os.path.getsize(cfg.path + "-wal")
            soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
            resource.setrlimit(resource.RLIMIT_FSIZE, (wal + (256 << 10), hard))
            try:
                r2 = await w.commit(big)
            finally:
                resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
            r3 = await w.commit(after)
            assert (w.stats.failures, w.stats.reopens) == (1, 1)
            return [r1, r2, r3]

    assert run(body) == [Committed(before.id), UNAVAILABLE, Committed(after.id)]
    assert readers.ids(cfg.path) == {before.id, after.id}


def _take_away(path: str, how: str) -> None:
    """``deleted``: the store's three files unlinked, as ``rm hooks.db*`` does.
    ``replaced``: each renamed aside and a copy put at its name (a restore from a backup),
    so the path holds the same bytes in new files."""
    for suffix in ("", "-wal", "-shm"):
        name = path + suffix
        os.rename(name, name + ".old")
        if how == "replaced":
            shutil.copyfile(name + ".old", name)


@pytest.mark.parametrize("how", ["deleted", "replaced"])
def test_a_store_deleted_or_replaced_while_open_is_never_answered_stored(
    tmp_path: Path, how: str, caplog: pytest.LogCaptureFixture
) -> None:
    """An open connection goes on writing to the files it opened: unchecked, every hook
    committed after ``rm hooks.db*`` was answered 201 and gone at the next start. The
    batch that finds its files gone is answered unavailable (its sender retries); the next
    opens the path again. A long-lived Reader and the admin's writer follow the path too."""
    cfg = store_cfg(tmp_path)
    first, lost, after = hook(b"k1"), hook(b"k2"), hook(b"k3")
    reader = readers.Reader(cfg.path)
    control = Control(cfg)

    async def body() -> list[CommitResult]:
        async with started(cfg) as w:
            r1 = await w.commit(first)
            assert reader.ids() == {first.id}
            control.probe()
            _take_away(cfg.path, how)
            r2 = await w.commit(lost)
            r3 = await w.commit(after)
            assert (w.stats.not_stored, w.stats.reopens) == (1, 1)
            return [r1, r2, r3]

    try:
        assert run(body) == [Committed(first.id), UNAVAILABLE, Committed(after.id)]
        kept = {first.id} if how == "replaced" else set()
        assert readers.ids(cfg.path) == kept | {after.id}
        assert reader.ids() == kept | {after.id}
        with pytest.raises(StoreError, match="deleted or replaced while open"):
            control.probe()
        control.probe()  # on the files at the path now
    finally:
        reader.close()
        control.close()
    assert "deleted or replaced while open" in caplog.text


def test_a_database_moved_away_alone_keeps_its_hooks_and_its_log_is_not_deleted(
    tmp_path: Path,
) -> None:
    """``mv hooks.db`` under a running service leaves its log behind, holding the hooks
    not yet copied in. The writer that finds the database gone copies them into it
    (through the files it has open) before it lets go, and no new store is made beside
    the log, which SQLite would delete: unavailable, with the reason, until the database
    is put back."""
    cfg = store_cfg(tmp_path)
    moved = tmp_path / "moved.db"
    first, cut, refused, after = hook(b"k1"), hook(b"k2"), hook(b"k3"), hook(b"k4")

    async def body() -> list[CommitResult]:
        async with started(cfg) as w:
            r1 = await w.commit(first)
            os.rename(cfg.path, moved)
            r2 = await w.commit(cut)  # found out: answered unavailable
            r3 = await w.commit(refused)  # no new store beside the log
            assert Path(cfg.path + "-wal").exists() and not Path(cfg.path).exists()
            shutil.copyfile(moved, tmp_path / "copy.db")  # the moved file alone, as it is
            os.rename(moved, cfg.path)
            r4 = await w.commit(after)
            return [r1, r2, r3, r4]

    assert run(body) == [Committed(first.id), UNAVAILABLE, UNAVAILABLE, Committed(after.id)]
    assert first.id in readers.ids(tmp_path / "copy.db")
    assert {first.id, after.id} <= readers.ids(cfg.path)
    orphan = tmp_path / "other" / "hooks.db"  # a log alone, at a first start too
    orphan.parent.mkdir()
    Path(f"{orphan}-wal").write_bytes(b"")
    with pytest.raises(StoreError, match=r"its log .* is still there"):
        schema.open_writer(orphan, "fsync", 100)


def test_a_path_that_cannot_be_looked_at_is_unavailable_until_it_can(tmp_path: Path) -> None:
    """A directory on the store's path turned into a symlink loop (or made unsearchable):
    stat() fails with ELOOP (EACCES) rather than ENOENT. Once that killed the writer's
    thread, leaving the batch it held unanswered for good and every later hook 503. Now
    the batch is answered unavailable and writing resumes when the path is back; the
    readers and the admin's writer say so too, and recover."""
    real, link = tmp_path / "real", tmp_path / "link"
    real.mkdir()
    link.symlink_to(real)
    cfg = config.Store(path=str(link / "hooks.db"))
    first, cut, after = hook(b"k1"), hook(b"k2"), hook(b"k3")
    reader = readers.Reader(cfg.path)
    control = Control(cfg)

    def loop_the_link() -> None:
        link.unlink()
        link.symlink_to(link)  # ELOOP

    def mend_the_link() -> None:
        link.unlink()
        link.symlink_to(real)

    async def body() -> list[CommitResult]:
        async with started(cfg) as w:
            r1 = await w.commit(first)
            assert reader.ids() == {first.id}
            control.probe()
            loop_the_link()
            r2 = await asyncio.wait_for(w.commit(cut), 5)
            r3 = await asyncio.wait_for(w.commit(hook(b"k4")), 5)  # the reopen fails too
            with pytest.raises(StoreError):
                reader.ids()
            with pytest.raises(StoreError):
                control.probe()
            mend_the_link()
            r4 = await asyncio.wait_for(w.commit(after), 5)
            return [r1, r2, r3, r4]

    try:
        assert run(body) == [Committed(first.id), UNAVAILABLE, UNAVAILABLE, Committed(after.id)]
        assert after.id in reader.ids()
        control.probe()
    finally:
        reader.close()
        control.close()


@pytest.mark.parametrize("holder", ["hold-flock", "hold-sqlite"])
def test_lock_held_past_the_bound(tmp_path: Path, holder: str) -> None:
    """Another process holds the writers' flock, or SQLite's own write lock (an operator's
    sqlite3 shell): waiting hooks are answered NotStored after lock_timeout_ms, are never
    written once the lock is free, and the next hooks are stored."""
    cfg = store_cfg(tmp_path, lock_timeout_ms=300)
    first, waiting, later = hook(), [hook() for _ in range(5)], hook()

    async def body() -> tuple[list[CommitResult], float, CommitResult]:
        async with started(cfg) as w:
            assert await w.commit(first) == Committed(first.id)
            with Child(holder, cfg.path) as child:
                assert child.line() == "held"
                t0 = time.monotonic()
                results = await asyncio.gather(*(w.commit(h) for h in waiting))
                elapsed = time.monotonic() - t0
                child.send("release")
                assert child.wait() == 0
            return list(results), elapsed, await w.commit(later)

    results, elapsed, last = run(body)
    print(f"{holder}: answered after {elapsed * 1000:.0f} ms (bound 300 ms)")
    assert results == [UNAVAILABLE] * 5
    assert 0.29 <= elapsed < 1.5
    assert last == Committed(later.id)
    assert readers.ids(cfg.path) == {first.id, later.id}


def test_a_transaction_reports_its_wait_for_the_lock(tmp_path: Path) -> None:
    """on_commit hears each committed transaction once the lock is let go: its hooks, how
    long it waited while another process held the writers' lock, and how long it held it."""
    cfg = store_cfg(tmp_path)
    heard: list[tuple[int, int, int]] = []
    quick, blocked = [hook() for _ in range(3)], hook()

    async def body() -> None:
        async with started(cfg, on_commit=lambda *t: heard.append(t)) as w:
            await asyncio.gather(*(w.commit(h) for h in quick))
            with Child("hold-flock", cfg.path) as child:
                assert child.line() == "held"
                pending = asyncio.ensure_future(w.commit(blocked))
                await asyncio.sleep(0.5)
                assert not pending.done()
                child.send("release")
                assert child.wait() == 0
                assert await pending == Committed(blocked.id)

    run(body)
    assert sum(n for n, _, _ in heard) == 4
    assert heard[-1][0] == 1
    waited, held = heard[-1][1:]
    assert 0.3e9 <= waited < 30e9  # asked within 0.2 s of the commit, got it at the release
    assert 0 < held < waited
    assert all(w >= 0 and h > 0 for _, w, h in heard)


def test_sweeper_deletes_expired_rows_only(tmp_path: Path) -> None:
    cfg = store_cfg(tmp_path, max_batch=1000)
    wall = FakeWall()
    short = [hook(b"short-%d" % i, ttl_s=10) for i in range(2 * SWEEP_ROWS + 7)]
    keep = [hook(b"long-%d" % i, ttl_s=100) for i in range(5)]

    async def body() -> tuple[int, int, int]:
        async with started(cfg, wall) as w:
            await asyncio.gather(*(w.commit(h) for h in short + keep))
            wall.now += 10_000
            swept = await w.sweep()
            again = await w.sweep()
            return swept, again, w.stats.sweeps

    swept, again, sweeps = run(body)
    assert (swept, again, sweeps) == (len(short), 0, 2)
    assert set(index_rows(cfg.path)) == {h.event_key for h in keep}
    assert readers.count(cfg.path) == len(short) + len(keep)  # the hooks themselves stay


def test_sweeper_runs_by_itself(tmp_path: Path) -> None:
    cfg = store_cfg(tmp_path, sweep_interval_s=1)
    wall = FakeWall()

    async def body() -> float:
        async with started(cfg, wall) as w:
            await w.commit(hook(b"gone", ttl_s=1))
            await w.commit(hook(b"kept", ttl_s=60))
            wall.now += 1_000
            t0 = time.monotonic()
            while b"gone" in index_rows(cfg.path):
                assert time.monotonic() - t0 < 10, "no sweep within 10 s"
                await asyncio.sleep(0.05)
            await w.close()
            return time.monotonic() - t0

    took = run(body)
    assert took < 10
    assert set(index_rows(cfg.path)) == {b"kept"}


def test_readers_page_in_commit_order(tmp_path: Path) -> None:
    cfg = store_cfg(tmp_path)
    hooks = [hook() for _ in range(7)]

    async def body() -> None:
        async with started(cfg) as w:
            for h in hooks:
                await w.commit(h)
            await w.close()

    run(body)
    seen: list[str] = []
    cursor = 0
    while page := readers.page(cfg.path, cursor, 3):
        assert len(page) <= 3
        seen += [p.id for p in page]
        cursor = page[-1].seq
    assert seen == [h.id for h in hooks]
    with pytest.raises(StoreError, match=r"missing\.db: cannot read"):
        readers.count(tmp_path / "missing.db")


# -- several processes -------------------------------------------------------------------------


def test_two_writer_processes_share_the_store_fairly(tmp_path: Path) -> None:
    """Two processes commit 3000 hooks each at once (every tenth key committed by both):
    every committed hook is there once, each shared key is stored once, and neither
    process waits long for its turn."""
    db = str(tmp_path / "var" / "hooks.db")
    n = 3000
    with Child("load", db, str(n), "32", "a") as a, Child("load", db, str(n), "32", "b") as b:
        assert (a.line(), b.line()) == ("ready", "ready")
        a.send("go")
        b.send("go")
        stats = [json.loads(a.line(60)), json.loads(b.line(60))]
        assert (a.wait(), b.wait()) == (0, 0)
    for tag, s in zip("ab", stats, strict=True):
        print(
            f"writer {tag}: {len(s['committed'])} committed, {s['already']} already stored,"
            f" {n / s['elapsed_s']:.0f} hooks/s, {s['batches']} transactions,"
            f" p99 {s['p99_ms']:.1f} ms, max {s['max_ms']:.1f} ms"
        )
    committed = stats[0]["committed"] + stats[1]["committed"]
    assert len(committed) == len(set(committed))
    assert readers.ids(db) == set(committed)
    assert stats[0]["already"] + stats[1]["already"] == n // 10  # each shared key once
    assert len(committed) == 2 * n - n // 10
    for s in stats:
        assert s["max_ms"] < 2_000  # starvation measured 1.7 s under SQLite's busy handler


def test_writer_killed_mid_load(tmp_path: Path) -> None:
    """SIGKILL a writer while it and another process commit: every hook it answered
    Committed is stored, its lock died with it, and the other writer carries on."""
    cfg = store_cfg(tmp_path, lock_timeout_ms=2_000)
    n = 3000
    with Child("stream", cfg.path) as killed, Child("load", cfg.path, str(n), "32", "b") as other:
        assert (killed.line(), other.line()) == ("ready", "ready")
        answered = [killed.line() for _ in range(200)]
        other.send("go")
        answered += [killed.line() for _ in range(300)]
        killed.proc.send_signal(signal.SIGKILL)
        assert killed.wait() == -signal.SIGKILL
        answered += killed.rest()
        survivor = json.loads(other.line(60))
        assert other.wait() == 0  # it raises on any hook not stored
    print(
        f"killed after {len(answered)} answered commits; the other writer stored"
        f" {len(survivor['committed'])}, max latency {survivor['max_ms']:.1f} ms"
    )
    assert len(survivor["committed"]) == n
    assert survivor["max_ms"] < 2_000
    fd = os.open(schema.lock_path(cfg.path), os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # free: raises if still held
        fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)
    stored = readers.ids(cfg.path)
    conn = schema.connect_ro(cfg.path)
    try:
        assert conn.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    finally:
        conn.close()
    assert set(answered) <= stored
    assert set(survivor["committed"]) <= stored

    nxt = hook()

    async def body() -> tuple[CommitResult, float]:
        async with started(cfg) as w:
            t0 = time.monotonic()
            r = await w.commit(nxt)
            return r, time.monotonic() - t0

    result, took = run(body)
    assert result == Committed(nxt.id) and took < 1.0


def test_a_bad_hook_fails_its_batch_not_the_writer(tmp_path: Path) -> None:
    """A hook the writer cannot encode (a caller's bug) is answered NotStored with its
    batch; the thread lives on and stores the next one."""
    cfg = store_cfg(tmp_path)
    bad = dataclasses.replace(hook(), headers=(("x-raw", b"bytes"),))  # type: ignore[arg-type]
    good = hook()

    async def body() -> list[CommitResult]:
        async with started(cfg) as w:
            return [await w.commit(bad), await w.commit(good)]

    assert run(body) == [UNAVAILABLE, Committed(good.id)]
    assert readers.ids(cfg.path) == {good.id}


def test_every_claim_is_settled_once_from_the_writer_thread(tmp_path: Path) -> None:
    """Committed, already stored, given up on while the lock was held, refused after close:
    each hook's claim is settled exactly once with the answer its caller got, a committed
    one from the writer's thread, right after its transaction."""
    cfg = store_cfg(tmp_path, lock_timeout_ms=300)
    settled: list[tuple[object, CommitResult, str]] = []

    def settle(claim: object, result: CommitResult) -> None:
        settled.append((claim, result, threading.current_thread().name))

    first, again, waiting, late, keyless = hook(b"k"), hook(b"k"), hook(), hook(), hook()

    async def body() -> list[CommitResult]:
        w = Writer(cfg, settle=settle)
        w.start(asyncio.get_running_loop())
        answers = [await w.commit(first, "c-first")]
        answers.append(await w.commit(again, "c-again"))
        answers.append(await w.commit(keyless, None))  # no claim: nothing to settle
        with Child("hold-flock", cfg.path) as child:
            assert child.line() == "held"
            answers.append(await w.commit(waiting, "c-waiting"))
            child.send("release")
            assert child.wait() == 0
        await w.close()
        answers.append(await w.commit(late, "c-late"))
        return answers

    answers = run(body)
    assert answers == [
        Committed(first.id),
        AlreadyStored(first.id),
        Committed(keyless.id),
        UNAVAILABLE,
        UNAVAILABLE,
    ]
    by_claim = {c: r for c, r, _ in settled}
    assert [c for c, _, _ in settled] == ["c-first", "c-again", "c-waiting", "c-late"]
    assert by_claim == {
        "c-first": Committed(first.id),
        "c-again": AlreadyStored(first.id),
        "c-waiting": UNAVAILABLE,
        "c-late": UNAVAILABLE,
    }
    threads = {c: t for c, _, t in settled}
    assert threads["c-first"] == threads["c-again"] == "ankusa-store-writer"


def test_the_log_file_is_cut_back_when_it_starts_over(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without a limit the -wal file keeps the largest size it ever had."""
    monkeypatch.setattr(schema, "LOG_SIZE_LIMIT", 1 << 20)
    path = tmp_path / "hooks.db"
    conn = schema.connect(path, "os", 1000, autocheckpoint=False)
    try:
        conn.execute("CREATE TABLE t (b BLOB)")
        for _ in range(4):
            conn.execute("BEGIN IMMEDIATE")
            conn.execute("INSERT INTO t VALUES (?)", (os.urandom(1 << 20),))
            conn.execute("COMMIT")
        assert os.path.getsize(f"{path}-wal") > 4 << 20
        conn.execute("PRAGMA wal_checkpoint(PASSIVE)")  # as the writer does
        conn.execute("INSERT INTO t VALUES (x'00')")  # the next write starts the log over
        assert os.path.getsize(f"{path}-wal") <= 1 << 20
    finally:
        conn.close()
