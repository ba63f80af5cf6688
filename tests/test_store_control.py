"""The store's operating side: schema v2 and its migration, consumer cursors, rate-limit
overrides, retention, the readiness probe, the long-lived Reader and the settings.

Real SQLite files in tmp_path; other writers and lock holders are separate processes
(``tests/store_child.py``), as in ``test_store.py``, whose helpers these tests share.
"""

from __future__ import annotations

import dataclasses
import json
import select
import shutil
import sqlite3
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from conftest import cannot_run
from test_store import T0, Child, FakeWall, hook, run, started, store_cfg

from ankusa_shm import config
from ankusa_shm.config import ConfigError
from ankusa_shm.hooks import Committed, NewHook
from ankusa_shm.store import readers, schema, settled
from ankusa_shm.store.control import Control
from ankusa_shm.store.lock import WriteLock
from ankusa_shm.store.schema import StoreError

# The schema as version 1 wrote it, by hand: what a host upgraded to this build has.
V1_SCHEMA = """
CREATE TABLE hooks (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    id TEXT NOT NULL UNIQUE,
    tenant TEXT NOT NULL,
    source TEXT NOT NULL,
    event_key BLOB,
    received_ms INTEGER NOT NULL,
    headers TEXT NOT NULL,
    body BLOB NOT NULL
);
CREATE TABLE dedupe (
    source TEXT NOT NULL,
    event_key BLOB NOT NULL,
    hook_id TEXT NOT NULL,
    expires_ms INTEGER NOT NULL,
    PRIMARY KEY (source, event_key)
) WITHOUT ROWID;
CREATE INDEX dedupe_expires ON dedupe (expires_ms);
"""


def commit_all(cfg: config.Store, hooks: list[NewHook]) -> list[int]:
    """Commit ``hooks`` one at a time, in order, with a Writer; their seqs."""

    async def body() -> None:
        async with started(cfg) as w:
            for h in hooks:
                assert await w.commit(h) == Committed(h.id)

    run(body)
    by_id = {h.id: h.seq for h in readers.page(cfg.path, 0, 1_000_000)}
    return [by_id[h.id] for h in hooks]


def aged(received_ms: int) -> NewHook:
    return dataclasses.replace(hook(), received_ms=received_ms)


@contextmanager
def control(cfg: config.Store, wall: FakeWall | None = None) -> Iterator[Control]:
    c = Control(cfg) if wall is None else Control(cfg, wall)
    try:
        yield c
    finally:
        c.close()


def table_sql(db: str) -> dict[str, str]:
    conn = sqlite3.connect(db)
    try:
        rows = conn.execute("SELECT name, sql FROM sqlite_master WHERE sql IS NOT NULL")
        return {str(n): str(s) for n, s in rows}
    finally:
        conn.close()


def user_version(db: str) -> int:
    conn = sqlite3.connect(db)
    try:
        return int(conn.execute("PRAGMA user_version").fetchone()[0])
    finally:
        conn.close()


# -- schema ------------------------------------------------------------------------------------


def test_v1_file_is_migrated_in_place_with_its_hooks(tmp_path: Path) -> None:
    cfg = store_cfg(tmp_path)
    Path(cfg.path).parent.mkdir()
    conn = sqlite3.connect(cfg.path, isolation_level=None)
    conn.executescript(V1_SCHEMA)
    conn.execute(f"PRAGMA application_id = {schema.APPLICATION_ID}")
    conn.execute("PRAGMA user_version = 1")
    old = [hook(b"k-%d" % i) for i in range(3)]
    for h in old:
        conn.execute(
            "INSERT INTO hooks (id, tenant, source, event_key, received_ms, headers, body)"
            " VALUES (?, ?, ?, ?, ?, '[]', ?)",
            (h.id, h.tenant, h.source, h.event_key, h.received_ms, h.body),
        )
    conn.close()

    new = hook(b"after")
    assert commit_all(cfg, [new]) == [4]  # the writer's boot migrated the file
    assert user_version(cfg.path) == schema.VERSION == 3
    got = readers.page(cfg.path, 0, 10)
    assert [(h.seq, h.id, h.event_key, h.body) for h in got] == [
        *((i + 1, h.id, h.event_key, h.body) for i, h in enumerate(old)),
        (4, new.id, b"after", new.body),
    ]
    with control(cfg) as c:
        assert c.ack("billing", 4) == 4
    assert readers.consumers(cfg.path) == {"billing": 4}
    assert settled.read(cfg.path) is None  # a table for it, and nothing in it yet
    settled.write(cfg.path, 1_700_000_000_000, 42, {"ankusa:epoch": "ab12"}, 1_000)
    mark = settled.read(cfg.path)
    assert mark is not None and (mark.seq, mark.at_ms, mark.mono_ms) == (4, 1_700_000_000_000, 42)
    assert mark.epoch == {"ankusa:epoch": "ab12"} and mark.boot == settled.boot_id()

    fresh = store_cfg(tmp_path / "fresh")
    with control(fresh) as c:
        c.probe()
    assert table_sql(fresh.path) == table_sql(cfg.path)  # the same tables either way


def test_no_settled_mark_where_there_is_none_to_read(tmp_path: Path) -> None:
    """No file, a store of an older version (no table), a mark that is not ours: none, so
    the next start on a new segment promotes the whole window, as before marks."""
    assert settled.read(tmp_path / "missing.db") is None
    with pytest.raises(StoreError, match="not there"):
        settled.write(tmp_path / "missing.db", 1, 1, {"ankusa:epoch": "ab"}, 1_000)
    assert not (tmp_path / "missing.db").exists()
    old = tmp_path / "v1.db"
    conn = sqlite3.connect(old, isolation_level=None)
    conn.executescript(V1_SCHEMA)
    conn.close()
    assert settled.read(old) is None
    cfg = store_cfg(tmp_path)
    with control(cfg) as c:
        c.probe()
    conn = sqlite3.connect(cfg.path, isolation_level=None)
    conn.execute("INSERT INTO marks (key, value) VALUES ('settled', '{\"seq\": \"x\"}')")
    conn.close()
    assert settled.read(cfg.path) is None


def test_a_newer_file_is_still_refused(tmp_path: Path) -> None:
    db = tmp_path / "newer.db"
    conn = sqlite3.connect(db)
    conn.execute(f"PRAGMA application_id = {schema.APPLICATION_ID}")
    conn.execute(f"PRAGMA user_version = {schema.VERSION + 1}")
    conn.close()
    newer = f"store version {schema.VERSION + 1}"
    with control(config.Store(path=str(db))) as c, pytest.raises(StoreError, match=newer):
        c.probe()
    assert user_version(str(db)) == schema.VERSION + 1


# -- readers -----------------------------------------------------------------------------------


def test_page_by_source_and_cursor_reads_every_hook_once(tmp_path: Path) -> None:
    cfg = store_cfg(tmp_path)
    hooks = [hook(source=("github", "stripe", "shopify")[i % 3]) for i in range(20)]
    commit_all(cfg, hooks)
    for source in ("github", "stripe", None):
        seen: list[str] = []
        cursor = 0
        while page := readers.page(cfg.path, cursor, 3, source):
            assert len(page) <= 3 and all(source in (None, h.source) for h in page)
            seen += [h.id for h in page]
            cursor = page[-1].seq
        assert seen == [h.id for h in hooks if source in (None, h.source)]
    assert readers.last_seq(cfg.path) == 20
    assert [h.id for h in readers.latest(cfg.path, 2)] == [h.id for h in hooks[-2:]]


def test_paging_while_a_writer_process_commits_reads_each_hook_once(tmp_path: Path) -> None:
    db = str(tmp_path / "var" / "hooks.db")
    n = 2_000
    seen: list[str] = []
    with Child("load", db, str(n), "16", "a") as child:
        assert child.line() == "ready"
        child.send("go")
        reader = readers.Reader(db)
        cursor, deadline = 0, time.monotonic() + 60
        while len(seen) < n:
            assert time.monotonic() < deadline, f"{len(seen)} of {n} hooks seen in 60 s"
            page = reader.page(cursor, 64)
            seen += [h.id for h in page]
            cursor = page[-1].seq if page else cursor
            if not page:
                time.sleep(0.001)
        stats = json.loads(child.line())  # its last line, once every commit returned
        assert child.wait() == 0
        assert reader.page(cursor, 64) == []
        reader.close()
    assert len(seen) == len(set(seen)) == n
    assert set(seen) == set(stats["committed"])


def test_a_missing_store_is_one_clear_line(tmp_path: Path) -> None:
    missing = tmp_path / "missing.db"
    reader = readers.Reader(missing)
    calls: list[Callable[[], object]] = [
        lambda: readers.page(missing, 0, 10),
        lambda: readers.last_seq(missing),
        lambda: readers.consumers(missing),
        lambda: readers.overrides(missing),
        reader.ids,
    ]
    for call in calls:
        with pytest.raises(StoreError, match=r"missing\.db: cannot read: no such file") as e:
            call()
        assert "\n" not in str(e.value)
    assert not missing.exists()  # a reader creates nothing


def test_reader_keeps_one_connection_and_reconnects_once(tmp_path: Path) -> None:
    cfg = store_cfg(tmp_path)
    first, second = hook(), hook()
    commit_all(cfg, [first])
    reader = readers.Reader(cfg.path)
    try:
        assert reader.get(first.id) is not None and reader.last_seq() == 1
        conn = reader._conn
        commit_all(cfg, [second])
        assert reader.get(second.id) is not None  # a new snapshot per call
        assert reader._conn is conn
        assert conn is not None
        conn.close()  # the connection fails under it: one new one, and the call succeeds
        assert [h.id for h in reader.page(0, 10)] == [first.id, second.id]
        assert reader._conn is not conn
        answers: list[int] = []
        t = threading.Thread(target=lambda: answers.append(reader.count()))  # another thread
        t.start()
        t.join()
        assert answers == [2]
    finally:
        reader.close()


# -- consumers and overrides -------------------------------------------------------------------


def test_consumer_acks_and_resumes(tmp_path: Path) -> None:
    cfg = store_cfg(tmp_path)
    hooks = [hook() for _ in range(6)]
    seqs = commit_all(cfg, hooks)
    wall = FakeWall()
    with control(cfg, wall) as c:
        assert readers.consumer(cfg.path, "billing") is None
        batch = readers.page(cfg.path, 0, 4)
        assert c.ack("billing", batch[-1].seq) == seqs[3]
        # a restarted consumer resumes after its cursor
        resumed = readers.page(cfg.path, readers.consumer(cfg.path, "billing") or 0, 10)
        assert [h.id for h in resumed] == [h.id for h in hooks[4:]]
        assert c.ack("audit", 0) == 0
        assert c.ack("billing", seqs[1]) == seqs[1]  # rewinding is allowed
        assert readers.consumers(cfg.path) == {"billing": seqs[1], "audit": 0}
        with pytest.raises(ValueError, match="cursor 7 is beyond the last seq, 6"):
            c.ack("billing", 7)
        with pytest.raises(ValueError, match="cursor -1 is negative"):
            c.ack("billing", -1)
        c.probe()  # the failed acks left the connection usable
    assert readers.consumer(cfg.path, "billing") == seqs[1]
    conn = sqlite3.connect(cfg.path)
    assert conn.execute("SELECT acked_ms FROM consumers WHERE name = 'audit'").fetchone() == (T0,)
    conn.close()


def test_overrides_put_get_delete(tmp_path: Path) -> None:
    cfg = store_cfg(tmp_path)
    with control(cfg) as c:
        c.put_override("acme", 2.5, 10)
        c.put_override("globex", 100, 200)
        c.put_override("acme", 5, 20)  # replaces
        assert readers.overrides(cfg.path) == {"acme": (5.0, 20), "globex": (100.0, 200)}
        assert c.delete_override("acme") is True
        assert c.delete_override("acme") is False
        with pytest.raises(ValueError, match="burst must be"):
            c.put_override("acme", 1, 0)
        with pytest.raises(ValueError, match="rate must be"):
            c.put_override("acme", 0, 1)
    assert readers.overrides(cfg.path) == {"globex": (100.0, 200)}


# -- retention ---------------------------------------------------------------------------------


def retain_all(c: Control, older_than_ms: int, batch: int, **kw: int) -> list[int]:
    """Every batch of one retention run, as the admin process loops it (the last, 0,
    left out)."""
    runs: list[int] = []
    while n := c.retain(older_than_ms, batch, **kw):
        runs.append(n)
    return runs


def test_retention_by_age_alone_without_consumers(tmp_path: Path) -> None:
    cfg = store_cfg(tmp_path)
    old = [aged(T0 - 10_000 + i) for i in range(10)]
    young = [aged(T0 + i) for i in range(3)]
    commit_all(cfg, old + young)
    with control(cfg) as c:
        assert retain_all(c, T0, 3) == [3, 3, 3, 1]
        assert retain_all(c, T0, 3) == []
    assert [h.id for h in readers.page(cfg.path, 0, 100)] == [h.id for h in young]
    assert readers.last_seq(cfg.path) == 13


def test_retention_keeps_what_a_consumer_has_not_acked(tmp_path: Path) -> None:
    cfg = store_cfg(tmp_path)
    old = [aged(T0 - 10_000 + i) for i in range(10)]
    young = [aged(T0 + i) for i in range(3)]
    seqs = commit_all(cfg, old + young)
    with control(cfg) as c:
        c.ack("billing", seqs[6])
        c.ack("audit", seqs[3])
        assert retain_all(c, T0, 2) == [2, 2]  # up to the slowest consumer's cursor
        assert readers.page(cfg.path, 0, 1)[0].seq == seqs[4]
        c.ack("audit", seqs[-1])
        assert retain_all(c, T0, 2) == [2, 1]  # up to billing's
        c.ack("billing", seqs[-1])
        assert retain_all(c, T0, 2) == [2, 1]  # every old hook; the young ones stay
        assert [h.id for h in readers.page(cfg.path, 0, 100)] == [h.id for h in young]
        assert c.ack("billing", seqs[-1]) == seqs[-1]  # still a valid cursor
        assert c.ack("late", 0) == 0  # a new consumer at 0 holds back everything
        assert retain_all(c, T0 + 1_000, 5) == []
        assert c.forget("late") and not c.forget("late")  # no longer run: forgotten
        assert retain_all(c, T0 + 1_000, 5) == [3]
    assert readers.count(cfg.path) == 0


def test_retention_deletes_big_hooks_a_few_megabytes_a_transaction(tmp_path: Path) -> None:
    """Freeing a big body reads its pages under the writers' lock: a transaction deletes
    hooks up to ``max_bytes`` (at least one, however big), not ``batch`` of them."""
    cfg = store_cfg(tmp_path)
    big = [dataclasses.replace(aged(T0 - 10_000 + i), body=b"x" * 300_000) for i in range(7)]
    commit_all(cfg, big)
    with control(cfg) as c:
        assert retain_all(c, T0, 500, max_bytes=1_000_000) == [3, 3, 1]
        commit_all(cfg, [dataclasses.replace(aged(T0 - 5_000), body=b"y" * 2_000_000)])
        assert retain_all(c, T0, 500, max_bytes=1_000_000) == [1]
    assert readers.count(cfg.path) == 0


def test_retention_stops_at_the_first_young_hook(tmp_path: Path) -> None:
    """It walks from the oldest end: an out-of-order young hook holds back those after it."""
    cfg = store_cfg(tmp_path)
    hooks = [aged(T0 - 9_000), aged(T0 + 5), aged(T0 - 8_000), aged(T0 - 7_000)]
    commit_all(cfg, hooks)
    with control(cfg) as c:
        assert c.retain(T0, 10) == 1
        assert c.retain(T0 + 10, 10) == 3


def test_retention_in_a_loop_does_not_fail_a_writer_at_full_speed(tmp_path: Path) -> None:
    """A writer process commits as fast as it can while retention deletes everything it has
    committed so far and the probe writes: every commit is stored, and retention is never
    starved of the lock the writer keeps taking back."""
    cfg = store_cfg(tmp_path, lock_timeout_ms=2_000)
    n = 6_000
    deleted = probes = 0
    with Child("load", cfg.path, str(n), "64", "a") as child, control(cfg) as c:
        assert child.line() == "ready"
        child.send("go")
        future = time.time_ns() // 1_000_000 + 3_600_000
        stdout = child.proc.stdout
        assert stdout is not None
        while not select.select([stdout], [], [], 0)[0]:  # until its stats come
            deleted += sum(retain_all(c, future, 200))
            c.probe()
            probes += 1
        stats = json.loads(child.line())
        assert child.wait() == 0  # the child asserts that every commit was stored
        deleted += sum(retain_all(c, future, 200))
    print(
        f"writer: {n / stats['elapsed_s']:.0f} hooks/s, p99 {stats['p99_ms']:.1f} ms,"
        f" max {stats['max_ms']:.1f} ms; retention deleted {deleted}, {probes} probes"
    )
    assert len(stats["committed"]) == n
    assert deleted == n and readers.count(cfg.path) == 0
    assert probes > 1
    assert readers.last_seq(cfg.path) == n


# -- the probe and the lock --------------------------------------------------------------------


def test_probe_commits_a_write(tmp_path: Path) -> None:
    cfg = store_cfg(tmp_path)
    wall = FakeWall()
    with control(cfg, wall) as c:
        c.probe()
        wall.now += 1
        c.probe()
    conn = sqlite3.connect(cfg.path)
    assert conn.execute("SELECT value FROM meta WHERE key = 'probe'").fetchall() == [(T0 + 1,)]
    conn.close()


def _chattr(flag: str, files: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["chattr", flag, *files], capture_output=True, text=True)


def test_probe_fails_on_an_immutable_store_then_recovers(tmp_path: Path) -> None:
    """``chattr +i`` binds root too, where chmod would not. Only the db and -wal files:
    the -shm file is mapped, and making it immutable kills the process with SIGBUS."""
    if shutil.which("chattr") is None:
        cannot_run("chattr is not installed (e2fsprogs)")
    cfg = store_cfg(tmp_path)
    files = [cfg.path, cfg.path + "-wal"]
    with control(cfg) as c:
        c.probe()
        made = _chattr("+i", files)
        if made.returncode != 0:
            _chattr("-i", files)
            cannot_run(f"chattr +i is not permitted here: {made.stderr.strip()}")
        try:
            # on the open connection; then a reopened one is refused, not opened read-only
            for says in (f"{cfg.path}: probe: ", f"{cfg.path}: cannot open: not writable"):
                with pytest.raises(StoreError) as e:
                    c.probe()
                assert str(e.value).startswith(says)
                assert "\n" not in str(e.value)
        finally:
            _chattr("-i", files)
        c.probe()


@pytest.mark.parametrize("holder", ["hold-flock", "hold-sqlite"])
def test_control_gives_up_on_a_lock_held_past_the_bound(tmp_path: Path, holder: str) -> None:
    cfg = store_cfg(tmp_path, lock_timeout_ms=300)
    with control(cfg) as c:
        c.probe()
        with Child(holder, cfg.path) as child:
            assert child.line() == "held"
            t0 = time.monotonic()
            with pytest.raises(StoreError, match=r"hooks\.db: ack: "):
                c.ack("billing", 0)
            elapsed = time.monotonic() - t0
            child.send("release")
            assert child.wait() == 0
        assert 0.29 <= elapsed < 1.5
        assert c.ack("billing", 0) == 0
    assert readers.consumers(cfg.path) == {"billing": 0}


def test_wait_within_waits_in_line_and_lets_go_when_given_up(tmp_path: Path) -> None:
    db = str(tmp_path / "hooks.db")
    lock = WriteLock(schema.lock_path(db))
    try:
        with Child("hold-flock", db) as child:
            assert child.line() == "held"
            t0 = time.monotonic()
            assert lock.wait_within(0.2) is False
            assert 0.19 <= time.monotonic() - t0 < 1.0
            child.send("release")
            assert child.wait() == 0
        # the thread given up on took the lock and let go of it: others can have it
        with Child("hold-flock", db) as other:
            assert other.line(5) == "held"
            assert lock.wait_within(0.1) is False
            other.send("release")
            assert lock.wait_within(5) is True  # taken as soon as the holder lets go
            assert other.wait() == 0
        lock.release()
        assert lock.wait_within(0.1) is True  # free: taken at once
        lock.release()
    finally:
        lock.close()


# -- settings ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "ms"),
    [("", None), ("90s", 90_000), ("30m", 1_800_000), ("12h", 43_200_000), ("7d", 604_800_000)],
)
def test_retention_setting_good_values(text: str, ms: int | None) -> None:
    store = config.parse({"store": {"retention": text}}, "t.toml").store
    assert (store.retention, store.retention_ms) == (text, ms)


@pytest.mark.parametrize("text", ["7", "d", "0d", "7w", "-1d", " 7d", "7d\n", "1.5h", "36501d"])
def test_retention_setting_bad_values_name_the_key(text: str) -> None:
    with pytest.raises(ConfigError, match=r"^t\.toml: store\.retention: must be '' or a duration"):
        config.parse({"store": {"retention": text}}, "t.toml")


def test_retention_interval_setting() -> None:
    store = config.defaults().store
    assert (store.retention, store.retention_ms, store.retention_interval_s) == ("", None, 60)
    store = config.parse({"store": {"retention_interval_s": 5}}, "t.toml").store
    assert store.retention_interval_s == 5
    for bad in (0, 86_401):
        with pytest.raises(ConfigError, match=r"store\.retention_interval_s: must be between"):
            config.parse({"store": {"retention_interval_s": bad}}, "t.toml")
    with pytest.raises(ConfigError, match=r"store\.retention: must be a string"):
        config.parse({"store": {"retention": 7}}, "t.toml")


def test_page_json_is_page_as_documents(tmp_path: Path) -> None:
    """The consumer API's fast path writes the same documents ``StoredHook.doc`` does,
    non-UTF-8 keys and bodies included."""
    cfg = store_cfg(tmp_path)
    hooks = [
        NewHook(
            id=f"hook-{i}",
            tenant="acme",
            source="github" if i % 2 else "stripe",
            event_key=[None, f"evt-\u00e9{i}".encode(), b"\xff\xfe%d" % i][i % 3],
            dedupe_ttl_s=60,
            received_ms=1_000 + i,
            headers=(("x-a", "b\u00e9"), ("x-n", str(i))),
            body=[b'{"x":"\\u2603 \xe2\x98\x83"}', b"\x00\xff binary"][i % 2],
        )
        for i in range(12)
    ]
    commit_all(cfg, hooks)
    r = readers.Reader(cfg.path)
    try:
        for source in (None, "github"):
            want = r.page(0, 100, source)
            docs, last = r.page_json(0, 100, source)
            assert len(want) == (12 if source is None else 6)
            assert [json.loads(d) for d in docs] == [h.doc() for h in want]
            assert last == want[-1].seq
        assert r.page_json(last, 100) == ([], last)
        # A filtered page that comes back short has walked every hook up to the last: its
        # cursor moves on to there, so a poller does not walk them again from 0; a full
        # one stops at its last hook.
        assert r.page_json(0, 100, "nosuch") == ([], 12)
        docs, full = r.page_json(0, 2, "github")
        assert [json.loads(d)["id"] for d in docs] == ["hook-1", "hook-3"] and full == 4
        # Past the end: another store's cursor, answered from the start of this one.
        assert r.page_json(99, 2, "github") == (docs, 4)
        assert r.page_json(99, 100) == r.page_json(0, 100)
    finally:
        r.close()


def test_claimed_since_finds_the_recent_keyed_hooks_across_pages(tmp_path: Path) -> None:
    """What a crash may have left unsettled: keyed hooks received since the moment given,
    newest first, found a page at a time (more than one page here), nothing older, and
    no hook without a key."""
    cfg = store_cfg(tmp_path, max_batch=5_000)
    old = [dataclasses.replace(hook(b"old-%d" % i), received_ms=1_000) for i in range(5)]
    keyless = dataclasses.replace(hook(None), received_ms=5_000)
    recent = [dataclasses.replace(hook(b"new-%d" % i), received_ms=5_000 + i) for i in range(2_500)]
    commit_all(cfg, [*old, keyless, *recent])
    r = readers.Reader(cfg.path)
    try:
        found = r.claimed_since(5_000)
        newest = r.claimed_since(5_000, limit=1_500)  # across a page boundary too
        paged: list[str] = []
        below: int | None = readers.NEWEST
        while below is not None:  # as a repromote reads them: page by page, to the moment
            page, below = r.claimed_page(5_000, below, 700)
            paged += [h for _, _, _, h, _ in page]
    finally:
        r.close()
    assert [h for _, _, _, h, _ in found] == [h.id for h in reversed(recent)]
    assert [h for _, _, _, h, _ in newest] == [h.id for h in reversed(recent)][:1_500]
    assert paged == [h.id for h in reversed(recent)]
    tenant, source, key, _, expires = found[-1]
    assert (tenant, source, key) == (recent[0].tenant, recent[0].source, b"new-0")
    assert expires > 0
