"""The few small writes a long-lived admin process makes to the store.

Consumer acks, tenants' rate-limit overrides, the readiness probe and retention. Each is
one short transaction on ``Control``'s own connection, taken in turn with the request
workers' writers on their ``WriteLock`` (BEGIN IMMEDIATE to COMMIT), so a writer waits for
it no longer than for another writer's batch. Waiting for the lock is bounded by
``store.lock_timeout_ms``: past it the call is a ``StoreError``, never a hang.

Calls are synchronous (the admin process runs them on a thread) and serialized, from any
thread. Like the writers, the connection never checkpoints inside COMMIT, i.e. under the
lock: Control runs a PASSIVE checkpoint itself, after letting go of it, once it has logged
about ``CHECKPOINT_PAGES`` pages, so the log is kept short even when no hook arrives.
After an SQLite error the connection is dropped and opened again by the next call.
"""

from __future__ import annotations

import contextlib
import sqlite3
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from ankusa_shm import config
from ankusa_shm.clock import WallClock, wall_ms
from ankusa_shm.limits import Limit
from ankusa_shm.store import schema
from ankusa_shm.store.lock import Queue, WriteLock
from ankusa_shm.store.schema import StoreError
from ankusa_shm.store.writer import CHECKPOINT_PAGES

__all__ = ["Control"]

T = TypeVar("T")

_ACK = (
    "INSERT INTO consumers (name, cursor, acked_ms) VALUES (?, ?, ?)"
    " ON CONFLICT (name) DO UPDATE SET cursor = excluded.cursor, acked_ms = excluded.acked_ms"
)
_PUT_OVERRIDE = (
    "INSERT INTO rate_overrides (tenant, rate, burst, set_ms) VALUES (?, ?, ?, ?)"
    " ON CONFLICT (tenant) DO UPDATE"
    " SET rate = excluded.rate, burst = excluded.burst, set_ms = excluded.set_ms"
)
_PROBE = (
    "INSERT INTO meta (key, value) VALUES ('probe', ?)"
    " ON CONFLICT (key) DO UPDATE SET value = excluded.value"
)
# Retention's candidates: the oldest hooks in seq order (the start of the table, so no
# scan), none past the slowest consumer's cursor.
# length() of a blob or text is read from the row's header: no overflow page is read.
_OLDEST = "SELECT seq, received_ms, length(body) + length(headers) FROM hooks ORDER BY seq LIMIT ?"
_OLDEST_ACKED = (
    "SELECT seq, received_ms, length(body) + length(headers) FROM hooks"
    " WHERE seq <= (SELECT min(cursor) FROM consumers) ORDER BY seq LIMIT ?"
)
RETAIN_BYTES = 4 << 20  # of hooks deleted in one retention transaction: a few ms of lock
_TX_PAGES = 5  # log pages one small transaction appends, as the writer counts them


class Control:
    """The admin process's writer of the store: create it once, ``close`` it once."""

    def __init__(
        self, cfg: config.Store, wall: WallClock = wall_ms, turns: Queue | None = None
    ) -> None:
        """``turns``: take the lock in turn with the workers' writers (``lock``), so a
        write from here -- the readiness probe's among them -- is not starved by theirs."""
        self.cfg = cfg
        self._turns = turns
        self.path = Path(cfg.path)
        self._wall = wall
        self._mutex = threading.Lock()
        self._lock: WriteLock | None = None
        self._conn: sqlite3.Connection | None = None
        self._ids: schema.FileIds | None = None  # of the files self._conn opened
        self._log_pages = 0

    def ack(self, name: str, cursor: int) -> int:
        """Record consumer ``name``'s position: every hook up to seq ``cursor`` is handled.

        An ack may move backwards: a consumer that rewinds to read again is allowed, and
        retention then keeps what lies after its new cursor (what retention deleted
        already is gone). A cursor that is negative or beyond the last seq ever committed
        is a ValueError. Returns the cursor stored."""
        if not name:
            raise ValueError("a consumer needs a name")
        if cursor < 0:
            raise ValueError(f"cursor {cursor} is negative")

        def write(conn: sqlite3.Connection) -> int:
            last = int(conn.execute(schema.LAST_SEQ).fetchone()[0])
            if cursor > last:
                raise ValueError(f"cursor {cursor} is beyond the last seq, {last}")
            conn.execute(_ACK, (name, cursor, self._wall()))
            return cursor

        return self._write("ack", write)

    def forget(self, name: str) -> bool:
        """Forget consumer ``name`` (no longer run: it would hold back retention for
        good); False if it never acked."""

        def delete(conn: sqlite3.Connection) -> bool:
            return conn.execute("DELETE FROM consumers WHERE name = ?", (name,)).rowcount > 0

        return self._write("forget consumer", delete)

    def put_override(self, tenant: str, rate: float, burst: int) -> None:
        """Hold ``tenant`` to ``rate`` hooks/s with ``burst``, instead of its configured
        limit. A limit ``Limit.of`` refuses is a ValueError."""
        Limit.of(rate, burst)
        now = self._wall()
        self._write("put override", lambda c: c.execute(_PUT_OVERRIDE, (tenant, rate, burst, now)))

    def delete_override(self, tenant: str) -> bool:
        """Give ``tenant`` its configured limit back; False if it had no override."""

        def delete(conn: sqlite3.Connection) -> bool:
            gone = conn.execute("DELETE FROM rate_overrides WHERE tenant = ?", (tenant,))
            return gone.rowcount > 0

        return self._write("delete override", delete)

    def probe(self) -> None:
        """A real write, committed: readiness means a commit works now. A read-only file,
        a full disk or a lock held past the bound is a StoreError naming the file."""
        now = self._wall()
        self._write("probe", lambda c: c.execute(_PROBE, (now,)))

    def retain(self, older_than_ms: int, batch: int, max_bytes: int = RETAIN_BYTES) -> int:
        """Delete up to ``batch`` of the oldest hooks received before ``older_than_ms``
        (wall ms) and, if any consumer is named, acked by every one, and no more of them
        than ``max_bytes`` hold (but at least one); returns how many went.

        One small transaction: call it again until it returns 0. Freeing a big body reads
        each of its pages, under the lock every writer waits for: 500 hooks of 1 MB held
        it for over a second. It walks the hooks from the oldest in seq order and stops at
        the first one too young or not acked, so it reads ``batch`` rows, never the
        table. ``received_ms`` follows the commit order up to the hosts' clock steps and
        the workers' queueing, so a hook out of order holds back the few behind it until
        it is old enough too."""
        if batch < 1:
            raise ValueError(f"batch {batch} must be at least 1")

        def delete(conn: sqlite3.Connection) -> int:
            named = conn.execute("SELECT 1 FROM consumers LIMIT 1").fetchone() is not None
            rows = conn.execute(_OLDEST_ACKED if named else _OLDEST, (batch,)).fetchall()
            n = size = 0
            for _, ms, length in rows:
                if ms >= older_than_ms or (n and size + length > max_bytes):
                    break
                n, size = n + 1, size + length
            if n:
                conn.execute("DELETE FROM hooks WHERE seq <= ?", (rows[n - 1][0],))
            self._log_pages += n
            return n

        return self._write("retain", delete)

    def close(self) -> None:
        with self._mutex:
            self._drop_connection()
            if self._lock is not None:
                self._lock.close()
                self._lock = None

    # -- one transaction ---------------------------------------------------------------------

    def _write(self, what: str, body: Callable[[sqlite3.Connection], T]) -> T:
        """``body`` in one transaction under the writers' lock, then a checkpoint outside
        it if one is due. ValueError from ``body`` rolls back and is raised as it is."""
        with self._mutex:
            lock = self._locked(what)
            try:
                result = self._transaction(what, body)
            finally:
                lock.release()
            self._log_pages += _TX_PAGES
            if self._log_pages >= CHECKPOINT_PAGES:
                self._checkpoint()
            return result

    def _locked(self, what: str) -> WriteLock:
        if self._lock is None:
            try:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                self._lock = WriteLock(schema.lock_path(self.path), self._turns)
            except OSError as e:
                raise StoreError(f"{self.path}: {what}: {e.strerror}") from None
        if not self._lock.wait_within(self.cfg.lock_timeout_ms / 1000):
            raise StoreError(
                f"{self.path}: {what}: another writer held the lock for over"
                f" {self.cfg.lock_timeout_ms} ms"
            )
        return self._lock

    def _transaction(self, what: str, body: Callable[[sqlite3.Connection], T]) -> T:
        conn = self._connection()
        try:
            conn.execute("BEGIN IMMEDIATE")
            try:
                result = body(conn)
                conn.execute("COMMIT")
                if not schema.same_files(self.path, self._ids):
                    raise sqlite3.OperationalError(schema.REPLACED)
            except BaseException:
                with contextlib.suppress(sqlite3.Error):
                    if conn.in_transaction:
                        conn.execute("ROLLBACK")
                raise
        except sqlite3.Error as e:
            self._drop_connection()
            raise StoreError(f"{self.path}: {what}: {e}") from None
        return result

    def _connection(self) -> sqlite3.Connection:
        """The open connection, or a new one (the schema created or brought up to date:
        we hold the lock, as the writers do when they open theirs)."""
        if self._conn is not None:
            return self._conn
        self._conn, self._ids = schema.open_checked(
            self.path, self.cfg.durability, self.cfg.lock_timeout_ms, any_thread=True
        )
        return self._conn

    def _checkpoint(self) -> None:
        """Without the lock: copy the log into the database (PASSIVE: it waits for no one
        and blocks no one). A failure loses nothing; the next write reopens."""
        self._log_pages = 0
        if self._conn is None:
            return
        try:
            self._conn.execute("PRAGMA wal_checkpoint(PASSIVE)")
        except sqlite3.Error:
            self._drop_connection()

    def _drop_connection(self) -> None:
        if self._conn is not None:
            with contextlib.suppress(sqlite3.Error):
                self._conn.close()
            self._conn = None
