"""Opening the host's hook store: the pragmas every connection needs and the schema.

One SQLite file in WAL mode, so readers never block the writer and a commit is one append
to the log (plus one fsync under ``durability = "fsync"``). The file carries an
application id and a schema version; a file that is someone else's database, or was
written by a newer ankusa-shm, is refused rather than altered.

The writer opens its connections with ``autocheckpoint=False``: SQLite's automatic
checkpoint runs inside the COMMIT that crosses the threshold, i.e. while the writer holds
the writers' flock, and stalls every other writer process for as long as it takes to copy
the log into the database and fsync it. The writer checkpoints by itself instead, after
letting go of the lock (see ``writer``).
"""

from __future__ import annotations

import contextlib
import os
import sqlite3
from pathlib import Path
from typing import Literal

from ankusa_shm import _atomics

APPLICATION_ID = 0x616E6B75  # "anku": marks the file as an ankusa-shm store

# ``seq`` is the commit order and the consumer cursor. AUTOINCREMENT because a cursor must
# never see a number twice: without it SQLite may hand out the largest seq again once that
# row is deleted (retention deletes rows). Writers are serialized, so seqs are assigned in
# commit order and a reader's snapshot always holds a prefix.
_V1 = """
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

# What the admin process keeps: each named consumer's cursor (a ``hooks.seq``), the
# tenants' rate-limit overrides, and ``meta`` for the readiness probe's write.
_V2 = """
CREATE TABLE consumers (
    name TEXT PRIMARY KEY,
    cursor INTEGER NOT NULL,
    acked_ms INTEGER NOT NULL
) WITHOUT ROWID;
CREATE TABLE rate_overrides (
    tenant TEXT PRIMARY KEY,
    rate REAL NOT NULL,
    burst INTEGER NOT NULL,
    set_ms INTEGER NOT NULL
) WITHOUT ROWID;
CREATE TABLE meta (
    key TEXT PRIMARY KEY,
    value INTEGER NOT NULL
) WITHOUT ROWID;
"""

# The seq of the last hook ever committed, 0 if none: sqlite_sequence keeps the largest seq
# handed out even once retention deleted its row.
LAST_SEQ = "SELECT coalesce((SELECT seq FROM sqlite_sequence WHERE name = 'hooks'), 0)"

# What the supervisor keeps across stops: the moment of the last stop that left every
# hook settled in Redis (``settled``).
_V3 = """
CREATE TABLE marks (
    key TEXT PRIMARY KEY,
    value TEXT NOT NULL
) WITHOUT ROWID;
"""

# _STEPS[v] takes a file of version v to v + 1: a new file runs them all, an older file the
# ones it lacks, so both end with the same tables. Only ever append a step.
_STEPS = (_V1, _V2, _V3)
VERSION = len(_STEPS)

Durability = Literal["fsync", "os"]
_SYNCHRONOUS: dict[str, str] = {"fsync": "FULL", "os": "NORMAL"}
# The log file is cut back to this when a write starts it over: without a limit it keeps
# the largest size it ever had (a soak grew it to 33 MB, with 1 MB of it in use). Twice
# the length at which a writer finishes a checkpoint under the lock, so a log that runs
# as designed is overwritten, not cut and grown again.
LOG_SIZE_LIMIT = 32 << 20


class StoreError(Exception):
    """The store cannot be used at all; one line that names the file."""


def cannot_open(path: str | Path, e: OSError) -> StoreError:
    """The store's path, and the file the error was about if another (its directory,
    its lock file): the one to chown is not always the database."""
    other = e.filename is not None and os.fspath(e.filename) != os.fspath(path)
    return StoreError(f"{path}: cannot open{f' {e.filename}' if other else ''}: {e.strerror}")


FileIds = tuple[tuple[int, int], ...]


def file_ids(path: str | Path, *, writer: bool = True) -> FileIds | None:
    """The (device, inode) of the store's database and, for a writer, of its log and its
    shared-memory index; None if one is missing or cannot be looked at (a directory on
    the path made unsearchable, a symlink loop): then no one can say they are the same.

    An open connection goes on writing to the files it opened whatever becomes of their
    names: a store deleted or replaced under a running service would take every later
    commit with it, each one answered as stored. So a connection notes these at open and
    compares them after a commit, before anyone is answered (``same_files``). Without
    letting go of the GIL (``_atomics.file_ids``): a writer thread that does, three
    times a batch, waits each time for its busy event loop to give it back."""
    try:
        if writer:
            return _atomics.file_ids(str(path), f"{path}-wal", f"{path}-shm")
        return _atomics.file_ids(str(path))
    except OSError:
        return None


def same_files(path: str | Path, ids: FileIds | None, *, writer: bool = True) -> bool:
    """Whether the files at ``path`` are still the ones ``ids`` were taken of."""
    return ids is not None and file_ids(path, writer=writer) == ids


REPLACED = "its files were deleted or replaced while open"


def lock_path(path: str | Path) -> Path:
    """The file whose ``flock`` serializes this store's writers across processes."""
    return Path(f"{path}.lock")


def connect(
    path: str | Path,
    durability: Durability,
    busy_timeout_ms: int,
    *,
    autocheckpoint: bool = True,
    any_thread: bool = False,
) -> sqlite3.Connection:
    """A read-write connection in WAL mode, creating the file (not the schema) if needed.

    ``isolation_level=None``: the writer issues BEGIN IMMEDIATE and COMMIT itself, so the
    write lock is taken at a moment it chooses, not at the first INSERT. Without
    ``autocheckpoint`` its commits never checkpoint (``wal_autocheckpoint = 0``): whoever
    opens it so must run ``PRAGMA wal_checkpoint`` itself, or the log grows forever.
    ``any_thread`` lets calls come from any thread (one at a time: the caller serializes
    them), for an owner whose calls run on a thread pool.
    """
    conn = sqlite3.connect(path, isolation_level=None, check_same_thread=not any_thread)
    try:
        conn.execute(f"PRAGMA busy_timeout = {int(busy_timeout_ms)}")
        mode = conn.execute("PRAGMA journal_mode = WAL").fetchone()[0]
        if str(mode).lower() != "wal":
            raise sqlite3.OperationalError(f"journal_mode is {mode}, not wal")
        conn.execute(f"PRAGMA synchronous = {_SYNCHRONOUS[durability]}")
        conn.execute(f"PRAGMA journal_size_limit = {LOG_SIZE_LIMIT}")
        # A batch's statements keep the pages they change in a statement journal, which
        # past 64 KiB SQLite spills to a temporary file it creates and unlinks again --
        # in most batches, with the write lock held. In memory it is a copy of a few pages.
        conn.execute("PRAGMA temp_store = MEMORY")
        if not autocheckpoint:
            conn.execute("PRAGMA wal_autocheckpoint = 0")
    except BaseException:
        conn.close()
        raise
    return conn


def open_writer(
    path: str | Path, durability: Durability, busy_timeout_ms: int, *, any_thread: bool = False
) -> sqlite3.Connection:
    """A writer's connection (the workers' and the admin process's): ``connect`` without
    automatic checkpoints, its directory made and the schema created or brought up to
    date -- so open it holding the writers' lock. Any failure is a ``StoreError`` that
    names the file; nothing is left open."""
    try:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        if not os.path.lexists(path) and os.path.lexists(f"{path}-wal"):
            # SQLite would delete the log beside a new, empty database: the log of one
            # moved away under a running service may hold every hook not yet copied in.
            raise StoreError(
                f"{path}: cannot open: the database is gone but its log {path}-wal is "
                "still there, and may hold hooks: put the database back, or remove "
                f"{path}-wal and {path}-shm for a new store"
            )
        _create_private(path)
        for name in (str(path), f"{path}-wal", f"{path}-shm"):
            # SQLite opens a file it may not write read-only, without a word: every commit
            # would then fail, and every hook be answered 503, until someone looked
            if os.path.exists(name) and not os.access(name, os.R_OK | os.W_OK):
                raise StoreError(
                    f"{name}: cannot open: not writable by this user (uid {os.geteuid()}): "
                    "check its owner, its mode and attributes, and its file system"
                )
        conn = connect(
            path, durability, busy_timeout_ms, autocheckpoint=False, any_thread=any_thread
        )
    except OSError as e:
        raise cannot_open(path, e) from None
    except sqlite3.Error as e:
        raise StoreError(f"{path}: cannot open: {e}") from None
    try:
        ensure_schema(conn, path)
    except BaseException as e:
        conn.close()
        if isinstance(e, sqlite3.Error):
            raise StoreError(f"{path}: cannot open: {e}") from None
        raise
    return conn


def open_checked(
    path: str | Path, durability: Durability, busy_timeout_ms: int, *, any_thread: bool = False
) -> tuple[sqlite3.Connection, FileIds]:
    """``open_writer``, and the ids of the files it opened, for ``same_files`` after each
    commit. Files that cannot be looked at are a ``StoreError``: no commit on them could
    be told from one lost to a store deleted under it."""
    conn = open_writer(path, durability, busy_timeout_ms, any_thread=any_thread)
    ids = file_ids(path)
    if ids is None:
        conn.close()
        raise StoreError(f"{path}: cannot open: its files cannot be looked at")
    return conn, ids


def _create_private(path: str | Path) -> None:
    """A new store's file, empty and readable by its owner alone: it holds every hook's
    body and headers, and SQLite gives its log and shm index the database file's mode."""
    with contextlib.suppress(FileExistsError):
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))


_READ_BUSY_MS = 1_000  # a reader waits this long on the rare lock a WAL reader can meet


def connect_ro(path: str | Path, *, any_thread: bool = False) -> sqlite3.Connection:
    """A read-only connection (``mode=ro``): it can never take the write lock.
    ``any_thread`` as for ``connect``."""
    uri = Path(path).absolute().as_uri() + "?mode=ro"
    conn = sqlite3.connect(uri, uri=True, isolation_level=None, check_same_thread=not any_thread)
    conn.execute(f"PRAGMA busy_timeout = {_READ_BUSY_MS}")
    return conn


def check_ours(path: str | Path) -> None:
    """Refuse a store this build would refuse -- someone else's database, or one a newer
    build wrote -- before the supervisor touches anything: its workers would find out only
    once it had replaced a segment the newer build left. A file that cannot be read is left
    for the workers to name."""
    if not os.path.isfile(path):
        return
    try:
        conn = connect_ro(path)
        try:
            _refuse(conn, path)
        finally:
            conn.close()
    except sqlite3.Error:
        return


def _refuse(conn: sqlite3.Connection, path: str | Path) -> int:
    """The file's schema version, 0 for a new file; a ``StoreError`` for one that is not
    ours or that a newer build wrote."""
    app_id = conn.execute("PRAGMA application_id").fetchone()[0]
    version: int = conn.execute("PRAGMA user_version").fetchone()[0]
    tables = conn.execute("SELECT count(*) FROM sqlite_master").fetchone()[0]
    if app_id == 0 and version == 0 and tables == 0:
        return 0
    if app_id != APPLICATION_ID:
        raise StoreError(f"{path}: not an ankusa-shm hook store")
    if version > VERSION:
        raise StoreError(
            f"{path}: store version {version}, written by a newer build of ankusa-shm; this "
            f"build reads up to {VERSION}. Run that build, or a copy of the store made before "
            "the upgrade"
        )
    if version < 1:
        raise StoreError(f"{path}: store version {version}, this build reads {VERSION}")
    return version


def ensure_schema(conn: sqlite3.Connection, path: str | Path) -> None:
    """Create the tables in a new file, bring an older file of ours up to this version in
    place, accept this version; refuse someone else's file or a newer one.

    Runs in one BEGIN IMMEDIATE transaction, so processes starting together create or
    migrate the tables once and never see half of them.
    """
    conn.execute("BEGIN IMMEDIATE")
    try:
        version = _refuse(conn, path)
        if version == 0:
            conn.execute(f"PRAGMA application_id = {APPLICATION_ID}")
        if version < VERSION:
            for step in _STEPS[version:]:
                for statement in filter(str.strip, step.split(";")):
                    conn.execute(statement)
            conn.execute(f"PRAGMA user_version = {VERSION}")
        conn.execute("COMMIT")
    except BaseException:
        if conn.in_transaction:
            conn.execute("ROLLBACK")
        raise
