"""The group-commit writer: one thread per request worker that makes hooks durable.

``commit()`` puts a hook on an in-process queue and awaits its answer; one dedicated thread
with its own SQLite connection turns whatever is queued into one transaction -- one append
to the WAL and one fsync for up to ``max_batch`` hooks -- and hands every answer of the
batch back to the event loop in one ``call_soon_threadsafe``.

A batch starts when the event loop has finished the turn in which its hooks were queued:
requests read together are answered together, and none waits on a timer for company that
is not coming (a fixed wait put a millisecond into every hook's latency, and the loop had
nothing to do meanwhile). The first hook of a turn schedules a callback that marks what is
queued as ripe; a thread still busy with the last transaction takes everything ripe by
then. ``commit_wait_ms`` adds a wait after that, for loads that arrive spread out.

Several worker processes write the same file. SQLite's own busy handler sleeps and retries,
and a writer that keeps losing the retry starves; so writers take turns on a kernel lock
instead, ``flock`` on ``<db>.lock``: a waiter is woken the moment the holder lets go, and
a holder that dies lets go by dying. It is held from BEGIN IMMEDIATE to COMMIT only, and
for the rare finishing pass of a checkpoint (below).

Hooks leave the queue only once their transaction has begun. Until then the event loop
may give up on them: a hook that has waited ``lock_timeout_ms`` is answered
``NotStored("store_unavailable")`` and taken off the queue, so it is never written after
its sender was told it was not. (A commit whose caller is cancelled is not taken off: it
may still be stored.)

What a batch's transaction runs, and why it is as few statements as it is (each lets go
of the GIL the worker's event loop needs, and takes it back), is in ``inserts``.

Checkpoints run outside the lock. SQLite's automatic checkpoint runs inside the COMMIT
that crosses its threshold, with the flock held, so every other writer process waited
for the copy and the fsync of the database (tails of 100 ms and more). Here a connection
never checkpoints in COMMIT; the thread runs a PASSIVE checkpoint itself, after letting
go of the lock and handing the batch's answers back, once it has logged about
``CHECKPOINT_PAGES`` pages. A long log is finished under the lock, so that several
processes writing at once cannot keep the log from being rewound (``_checkpoint``).

A store that cannot write (disk full, read-only, I/O error, locked past the bound) answers
``NotStored`` for the hooks it had and keeps serving: the transaction is rolled back and
the connection reopened before the next one. Between batches the same thread sweeps
expired rows out of the dedupe index, a few hundred per transaction, and answers
``stored`` (is this event here already?) with a read outside the lock.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import sqlite3
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ankusa_shm import config
from ankusa_shm.clock import WallClock, wall_ms
from ankusa_shm.hooks import CommitResult, NewHook, NotStored
from ankusa_shm.store import inserts, schema
from ankusa_shm.store.lock import Queue, WriteLock
from ankusa_shm.store.schema import StoreError

__all__ = [
    "CHECKPOINT_PAGES",
    "SWEEP_ROWS",
    "UNAVAILABLE",
    "WAL_LIMIT_FRAMES",
    "StoreError",
    "Writer",
    "WriterStats",
]

log = logging.getLogger("ankusa_shm.store")

UNAVAILABLE = NotStored("store_unavailable")
SWEEP_ROWS = 500  # index rows deleted per sweep transaction: a few ms of lock at most
CHECKPOINT_PAGES = 2_000  # checkpoint once this writer has logged about this many pages
WAL_LIMIT_FRAMES = 4_096  # a log this long (16 MiB of 4 KiB pages) is finished under the lock
_BUSY_PAUSE_S = 0.01  # after SQLITE_BUSY, so a holder that refuses at once is not spun on
_NEVER = 1 << 62

OnCommit = Callable[[int, int, int], None]
"""Told of a committed transaction: its hooks, how long it waited for the writers' lock
and how long it held it, in nanoseconds."""


_CHECKPOINT = "PRAGMA wal_checkpoint(PASSIVE)"
_SWEEP = (
    "DELETE FROM dedupe WHERE (source, event_key) IN"
    " (SELECT source, event_key FROM dedupe WHERE expires_ms <= ? LIMIT ?)"
)


@dataclass(slots=True)
class WriterStats:
    """What the writer has done, for tests and the store benchmark. The thread updates each figure
    alone (``expired`` under the queue's mutex); a reader may see one a moment late."""

    batches: int = 0  # transactions that wrote hooks
    hooks: int = 0  # hooks in those transactions
    largest: int = 0  # hooks in the largest of them
    committed: int = 0
    already_stored: int = 0
    not_stored: int = 0  # answered NotStored by a failed transaction or open
    expired: int = 0  # given up on before their transaction began
    failures: int = 0  # transactions or opens that failed
    reopens: int = 0
    sweeps: int = 0  # sweep runs finished
    swept: int = 0  # index rows they deleted
    checkpoints: int = 0  # PASSIVE checkpoints run, outside the lock
    locked_checkpoints: int = 0  # of those, finished again under the lock (a long log)
    wal_frames: int = 0  # frames in the log at the last checkpoint (-1: another was running)
    longest_checkpoint_ms: float = 0.0  # the longest PASSIVE pass outside the lock
    longest_locked_ms: float = 0.0  # the longest the lock was held by a finishing pass


@dataclass(slots=True)
class _Item:
    hook: NewHook
    future: asyncio.Future[CommitResult]
    submitted_ns: int  # monotonic
    claim: object  # what the caller's ``settle`` is told the outcome of; None: nothing


Settle = Callable[[Any, CommitResult], None]
"""Told, for each hook committed with a claim, what became of it -- from the writer's
thread, right after its transaction, before anyone is answered (never raises)."""


Answers = list[tuple[asyncio.Future[Any], Any]]


def _resolve(answers: Answers) -> None:
    """On the event loop: hand each waiting caller its answer (a cancelled one is gone)."""
    for future, answer in answers:
        if not future.done():
            future.set_result(answer)


def _busy(e: sqlite3.Error) -> bool:
    code = getattr(e, "sqlite_errorcode", 0) & 0xFF
    return code in (sqlite3.SQLITE_BUSY, sqlite3.SQLITE_LOCKED)


class Writer:
    """The store's writer for one worker process: create it after fork, ``start`` it on the
    worker's event loop, call ``commit`` only from that loop, ``close`` it once."""

    def __init__(
        self,
        cfg: config.Store,
        wall: WallClock = wall_ms,
        on_commit: OnCommit | None = None,
        settle: Settle | None = None,
        turns: Queue | None = None,
    ) -> None:
        """``on_commit`` is called from the writer thread after each transaction that
        committed hooks, once the lock is let go (for metrics and long-polls). ``settle``
        hears the outcome of every hook committed with a claim, whatever it was, once:
        from the thread, right after its transaction, once the lock is let go, so a
        process killed after a commit has almost never left a claim unsettled (the window
        is the few microseconds between COMMIT and the queue push, not the event loop's
        turn).
        ``turns`` makes the writers of all processes take the lock in turn (``lock``)."""
        self.cfg = cfg
        self._turns = turns
        self.path = Path(cfg.path)
        self.stats = WriterStats()
        self._wall = wall
        self._on_commit = on_commit
        self._settle_claim = settle
        self._timeout_ns = cfg.lock_timeout_ms * 1_000_000
        self._wait_ns = cfg.commit_wait_ms * 1_000_000
        self._max_batch = cfg.max_batch
        # Shared between the loop and the thread, under _cond (commit() takes its mutex
        # directly: a Condition's __enter__ and __exit__ are Python calls):
        self._mutex = threading.Lock()
        self._cond = threading.Condition(self._mutex)
        self._queue: collections.deque[_Item] = collections.deque()
        self._wake_at = _NEVER  # queue length at which commit() wakes the thread
        self._ripe = 0  # how many of the queue's first hooks the loop has ended a turn with
        self._stopping = False
        self._sweep_waiters: list[asyncio.Future[int]] = []
        self._lookups: list[tuple[inserts.Key, asyncio.Future[str | None]]] = []
        # The event loop's:
        self._loop: asyncio.AbstractEventLoop | None = None
        self._accepting = False
        self._turn_ends = False  # _end_turn is scheduled
        self._expiry: asyncio.TimerHandle | None = None
        self._done: asyncio.Future[None] | None = None
        self._thread: threading.Thread | None = None
        # The thread's:
        self._conn: sqlite3.Connection | None = None
        self._ids: schema.FileIds | None = None  # of the files self._conn opened
        self._lock: WriteLock | None = None
        self._failing = False  # the last transaction failed: log the recovery
        self._pause = False  # SQLite was busy: pause once the lock is let go
        self._log_pages = 0  # pages logged since the last checkpoint, about: see _logged

    # -- the event loop's side ---------------------------------------------------------------

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        """Open the store (creating its directory and tables) and start the writer thread.

        Raises ``StoreError`` if the store cannot be opened: a worker without its store
        must not serve.
        """
        if self._thread is not None:
            raise RuntimeError("Writer.start called twice")
        self._loop = loop
        self._done = loop.create_future()
        opened = threading.Event()
        failure: list[StoreError] = []
        self._thread = threading.Thread(
            target=self._run, args=(opened, failure), name="ankusa-store-writer", daemon=True
        )
        self._thread.start()
        opened.wait()
        if failure:
            self._thread.join()
            raise failure[0]

    async def commit(self, hook: NewHook, claim: object = None) -> CommitResult:
        """Store ``hook`` with the next batch, and settle ``claim`` with the outcome.
        Never raises for the store's sake: a store that cannot take it answers
        ``NotStored("store_unavailable")``."""
        loop = self._loop
        if loop is None:
            return self._answered(claim, UNAVAILABLE)
        future: asyncio.Future[CommitResult] = loop.create_future()
        with self._mutex:
            if not self._accepting:  # checked under the mutex: a dying thread drains under it
                return self._answered(claim, UNAVAILABLE)
            self._queue.append(_Item(hook, future, time.monotonic_ns(), claim))
            if len(self._queue) >= self._wake_at:
                self._cond.notify()
        if not self._turn_ends:
            self._turn_ends = True
            loop.call_soon(self._end_turn)
        if self._expiry is None:
            self._expiry = loop.call_later(self.cfg.lock_timeout_ms / 1000, self._expire)
        return await future

    async def stored(self, source: str, event_key: bytes) -> str | None:
        """The id of the hook stored under this key within its window; None if there is
        none or the store cannot say now. For a hook about to be refused, so that the
        resend of an event this host holds is answered as its duplicate instead. Read by
        the thread outside the writers' lock, with the lookups asked meanwhile."""
        loop = self._loop
        if loop is None:
            return None
        future: asyncio.Future[str | None] = loop.create_future()
        with self._cond:
            if not self._accepting:
                return None
            self._lookups.append(((source, event_key), future))
            self._cond.notify()
        return await future

    async def sweep(self) -> int:
        """Delete every index row expired by now (in small transactions); how many went.
        The thread does this by itself every ``sweep_interval_s``."""
        loop = self._loop
        if loop is None:
            return 0
        future: asyncio.Future[int] = loop.create_future()
        with self._cond:
            if not self._accepting:
                return 0
            self._sweep_waiters.append(future)
            self._cond.notify()
        return await future

    async def close(self) -> None:
        """Write everything already submitted, then stop the thread and close the store.

        Waits at most ``cfg.close_wait_s``: a thread still waiting then for a stuck foreign
        holder of the lock has nothing left to write (every hook it had was given up on)
        and exits by itself once it gets its turn.
        """
        self._accepting = False
        thread, done = self._thread, self._done
        if thread is None or done is None or not thread.is_alive():
            return
        with self._cond:
            self._stopping = True
            self._cond.notify()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.shield(done), self.cfg.close_wait_s)

    def _end_turn(self) -> None:
        """After the callbacks that were ready with the turn's first commit: what is queued
        now is a batch, unless the thread is busy (then it takes it when it is done)."""
        self._turn_ends = False
        with self._mutex:
            self._ripe = len(self._queue)
            if self._ripe and self._wake_at != _NEVER:
                self._cond.notify()

    def _expire(self) -> None:
        """Timer: answer the hooks that have waited ``lock_timeout_ms`` for a transaction."""
        self._expiry = None
        now = time.monotonic_ns()
        gone: list[_Item] = []
        with self._cond:
            queue = self._queue
            while queue and now - queue[0].submitted_ns >= self._timeout_ns:
                gone.append(queue.popleft())
            self._ripe = max(0, self._ripe - len(gone))
            self.stats.expired += len(gone)
            next_ns = queue[0].submitted_ns + self._timeout_ns - now if queue else None
        _resolve(self._unavailable(gone))
        if next_ns is not None and self._loop is not None:
            delay = max(0.001, next_ns / 1e9)
            self._expiry = self._loop.call_later(delay, self._expire)

    def _answered(self, claim: object, result: CommitResult) -> CommitResult:
        if claim is not None and self._settle_claim is not None:
            self._settle_claim(claim, result)
        return result

    def _unavailable(self, items: Sequence[_Item]) -> Answers:
        """``_outcomes`` of items that were not, and will not be, written."""
        return self._outcomes(items, [UNAVAILABLE] * len(items))

    def _outcomes(self, items: Sequence[_Item], results: Sequence[CommitResult]) -> Answers:
        """Settle each item's claim with its result; the answers to hand back."""
        for item, result in zip(items, results, strict=True):
            self._answered(item.claim, result)
        return [(item.future, r) for item, r in zip(items, results, strict=True)]

    # -- the thread's side -------------------------------------------------------------------

    def _run(self, opened: threading.Event, failure: list[StoreError]) -> None:
        try:
            self._boot()
        except Exception as e:
            why = e if isinstance(e, StoreError) else StoreError(f"{self.path}: cannot open: {e}")
            failure.append(why)
            opened.set()
            return
        with self._cond:
            self._accepting = True
        opened.set()
        try:
            self._serve()
        except Exception:
            log.exception("%s: the store's writer thread failed", self.path)
        finally:
            with self._cond:
                self._accepting = False
            batch, late = self._take(everything=True)  # empty, unless the thread failed
            gone = batch + late
            self._hand_back(self._unavailable(gone))
            with self._cond:
                lookups, self._lookups = self._lookups, []
            self._hand_back([(future, None) for _, future in lookups])
            self._finish_sweep(0)
            self._drop_connection()
            if self._lock is not None:
                self._lock.close()
            if self._done is not None:
                self._hand_back([(self._done, None)])

    def _boot(self) -> None:
        """Open the lock file and the store with the lock held, so processes starting
        together create the tables once; bounded, so a stuck holder fails the boot."""
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._lock = WriteLock(schema.lock_path(self.path), self._turns)
        except OSError as e:
            raise schema.cannot_open(self.path, e) from None
        if not self._lock.wait_within(self.cfg.lock_timeout_ms / 1000):
            self._lock.close()
            raise StoreError(
                f"{self.path}: another writer held the lock for over {self.cfg.lock_timeout_ms} ms"
            )
        try:
            self._conn = self._connect()
        except StoreError:
            self._lock.release()
            self._lock.close()
            raise
        self._lock.release()

    def _connect(self) -> sqlite3.Connection:
        conn, self._ids = schema.open_checked(
            self.path, self.cfg.durability, self.cfg.lock_timeout_ms
        )
        return conn

    def _drop_connection(self) -> None:
        if self._conn is not None:
            with contextlib.suppress(sqlite3.Error):
                self._conn.close()
            self._conn = None

    def _serve(self) -> None:
        interval = self.cfg.sweep_interval_s
        sweep_at = time.monotonic() + interval
        swept: int | None = None  # rows deleted so far by the sweep run under way
        while True:
            with self._cond:
                if self._sweep_waiters:
                    sweep_at = 0.0
                self._wait_for_work(sweep_at if swept is None else 0.0)
                stopping = self._stopping
                # Not a batch the loop is still adding to, if a lookup or the sweep woke us.
                hooks = bool(self._queue) and self._batch_due()
                lookups, self._lookups = self._lookups, []
            if lookups:
                self._look_up(lookups)
            if hooks:
                self._write_batch()
            elif stopping:
                break
            if not stopping and (swept is not None or time.monotonic() >= sweep_at):
                deleted = self._sweep_pass()
                swept = (swept or 0) + (deleted or 0)
                if deleted != SWEEP_ROWS:  # the run is over (or failed: try next time)
                    self.stats.sweeps += 1
                    self._finish_sweep(swept)
                    swept, sweep_at = None, time.monotonic() + interval
            if self._log_pages >= CHECKPOINT_PAGES:
                self._checkpoint()

    def _wait_for_work(self, sweep_at: float) -> None:
        """Under ``_cond``: sleep until a batch is due (``_batch_due``), a sweep is due or
        asked for, or a lookup is asked; then give the batch's first hook up to
        ``commit_wait_ms`` in all to find company."""
        self._wake_at = self._max_batch
        while not (self._batch_due() or self._sweep_waiters or self._lookups):
            left = sweep_at - time.monotonic()
            if left <= 0:
                break
            self._cond.wait(left)
        if self._queue and self._wait_ns and not self._stopping:
            until = self._queue[0].submitted_ns + self._wait_ns
            while len(self._queue) < self._max_batch and not self._stopping:
                left_ns = until - time.monotonic_ns()
                if left_ns <= 0:
                    break
                self._cond.wait(left_ns / 1e9)
        self._wake_at = _NEVER

    def _batch_due(self) -> bool:
        """Under ``_cond``: the loop has ended the turn of what is queued (or queued a whole
        batch), or we are stopping."""
        return bool(self._ripe or len(self._queue) >= self._max_batch or self._stopping)

    def _take(self, everything: bool) -> tuple[list[_Item], list[_Item]]:
        """Take the next batch off the queue (all of it when ``everything``), and apart from
        it the hooks that waited too long to be written now."""
        now = time.monotonic_ns()
        batch: list[_Item] = []
        late: list[_Item] = []
        with self._cond:
            queue = self._queue
            while queue and (everything or len(batch) < self._max_batch):
                item = queue.popleft()
                (late if now - item.submitted_ns >= self._timeout_ns else batch).append(item)
            self._ripe = max(0, self._ripe - len(batch) - len(late))
            self.stats.expired += len(late)
        return batch, late

    def _look_up(self, lookups: list[tuple[inserts.Key, asyncio.Future[str | None]]]) -> None:
        """Answer ``stored`` with one read, outside the lock: a write of another process
        is never waited for, and none is held up."""
        found: dict[inserts.Key, str] = {}
        if self._conn is not None:
            try:
                found = inserts.stored(self._conn, [key for key, _ in lookups], self._wall())
            except sqlite3.Error as e:  # the next batch finds out what it means
                log.debug("%s: lookup failed: %s", self.path, e)
        self._hand_back([(future, found.get(key)) for key, future in lookups])

    def _hand_back(self, answers: Answers) -> None:
        if answers and self._loop is not None:
            with contextlib.suppress(RuntimeError):  # the loop is closed: no one waits
                self._loop.call_soon_threadsafe(_resolve, answers)

    def _write_batch(self) -> None:
        assert self._lock is not None
        asked = time.monotonic_ns()
        self._lock.acquire()
        got = time.monotonic_ns()
        try:
            items, results, hooks = self._transaction()
        finally:
            self._release()
        held = time.monotonic_ns() - got
        if hooks and not schema.same_files(self.path, self._ids):
            self._replaced(hooks)
            results, hooks = [UNAVAILABLE] * len(results), 0
        if hooks and self._on_commit is not None:
            self._on_commit(hooks, got - asked, held)
        # Claims are settled once the lock is let go: the next writer's turn does not wait
        # for a batch's pushes onto the settle queue.
        self._hand_back(self._outcomes(items, results))

    def _release(self) -> None:
        assert self._lock is not None
        self._lock.release()
        if self._pause:  # outside the lock, so our other processes are not held up
            self._pause = False
            time.sleep(_BUSY_PAUSE_S)

    def _checkpoint(self) -> None:
        """Without the lock, after the answers went back: copy the log into the database.

        PASSIVE never waits for a reader or a writer and never blocks one, so the other
        processes keep committing meanwhile; only this thread's next batch waits for it.
        Any writer's checkpoint copies every writer's frames. A log is rewound to its start
        only by a write that begins after a checkpoint copied all of it, and with several
        processes writing one of them usually appends while another checkpoints: the log
        could then grow for as long as the load lasts (the count PASSIVE reports is of the
        frames there were when it began, so it cannot tell). So a checkpoint that finds a
        log of ``WAL_LIMIT_FRAMES`` or more runs once more holding the lock, when no writer
        can append: it copies only what came since the first (a few batches), and the next
        write rewinds the log.
        """
        self._log_pages = 0
        conn = self._conn
        if conn is None:
            return
        s = self.stats
        try:
            t0 = time.perf_counter()
            frames = conn.execute(_CHECKPOINT).fetchone()[1]
            s.longest_checkpoint_ms = max(s.longest_checkpoint_ms, (time.perf_counter() - t0) * 1e3)
            s.checkpoints += 1
            if frames >= WAL_LIMIT_FRAMES:
                assert self._lock is not None
                self._lock.acquire()
                try:
                    t0 = time.perf_counter()
                    frames = conn.execute(_CHECKPOINT).fetchone()[1]
                    held_ms = (time.perf_counter() - t0) * 1e3
                finally:
                    self._release()
                s.longest_locked_ms = max(s.longest_locked_ms, held_ms)
                s.locked_checkpoints += 1
        except sqlite3.Error as e:  # nothing is lost: the frames stay in the log
            self._failed(f"{self.path}: checkpoint: {e}")
            if not _busy(e):
                self._drop_connection()
            return
        s.wal_frames = frames

    def _logged(self, rows: int, size: int) -> None:
        """Count what a commit appended to the log, in pages, without asking SQLite (Python
        cannot: a commit's frame count goes only to a WAL hook). Measured: a one-hook
        transaction logs 5 or 6 pages; a batch of 64 small hooks 20 to 45 in a young store,
        more as the indexes grow, since each random key or id dirties a leaf of its own.
        So: 5 a transaction, 1 a row, 1 per 4 KiB of bodies begun; high for small batches of
        ordered keys, which only checkpoints a little more often than it needs to."""
        self._log_pages += 5 + rows + ((size + 4095) >> 12)

    def _begin(self) -> sqlite3.Connection | None:
        """With the lock held: reopen if needed and BEGIN IMMEDIATE; None if that failed
        (the connection is dropped unless the store was merely busy)."""
        if self._conn is None:
            try:
                self._conn = self._connect()
            except StoreError as e:
                self._failed(str(e))
                return None
            self.stats.reopens += 1
        try:
            self._conn.execute("BEGIN IMMEDIATE")
        except sqlite3.Error as e:
            self._failed(f"{self.path}: {e}")
            if _busy(e):
                self._pause = True
            else:
                self._drop_connection()
            return None
        return self._conn

    def _replaced(self, hooks: int) -> None:
        """The batch went to files no longer at the path: none of it may be answered as
        stored. The next batch opens the path again, as a new store if nothing is there."""
        log.error(
            "%s: %s; its last batch is answered unavailable, and the path reopened",
            self.path,
            schema.REPLACED,
        )
        self.stats.not_stored += hooks
        self.stats.failures += 1
        if self._conn is not None:  # a database moved away then holds every hook committed
            with contextlib.suppress(sqlite3.Error):
                self._conn.execute(_CHECKPOINT)
        self._drop_connection()

    def _fail(self, conn: sqlite3.Connection, e: Exception) -> None:
        """Roll back a failed transaction; keep the connection only if it was merely busy."""
        self._failed(f"{self.path}: {e}")
        with contextlib.suppress(sqlite3.Error):
            if conn.in_transaction:
                conn.execute("ROLLBACK")
        if not (isinstance(e, sqlite3.Error) and _busy(e)):
            self._drop_connection()

    def _failed(self, what: str) -> None:
        """Count a failure; log only the first of a run, so a full disk is one line."""
        self.stats.failures += 1
        if not self._failing:
            log.warning("cannot write the hook store: %s", what)
            self._failing = True

    def _transaction(self) -> tuple[list[_Item], list[CommitResult], int]:
        """One transaction of up to ``max_batch`` hooks, with the lock held; the hooks it
        took off the queue, what became of each, and how many it committed (its batch,
        or 0 if it failed)."""
        conn = self._begin()
        if conn is None:
            if self._conn is not None:  # busy: leave the hooks queued for the timer
                return [], [], 0
            batch, late = self._take(everything=True)
            self.stats.not_stored += len(batch)
            gone = batch + late
            return gone, [UNAVAILABLE] * len(gone), 0
        batch, late = self._take(everything=False)
        if not batch:
            with contextlib.suppress(sqlite3.Error):
                conn.execute("ROLLBACK")
            return late, [UNAVAILABLE] * len(late), 0
        try:
            results, committed, already, size = self._insert(conn, [item.hook for item in batch])
            conn.execute("COMMIT")
        except Exception as e:  # an SQLite error; anything else is a bug, still not fatal
            if not isinstance(e, sqlite3.Error):
                log.exception("%s: a batch failed", self.path)
            self._fail(conn, e)
            self.stats.not_stored += len(batch)
            results, hooks = [UNAVAILABLE] * len(batch), 0
        else:
            if self._failing:
                log.info("%s: writing again", self.path)
                self._failing = False
            s = self.stats
            s.batches += 1
            s.hooks += len(batch)
            s.largest = max(s.largest, len(batch))
            s.committed += committed
            s.already_stored += already
            self._logged(committed, size)
            hooks = len(batch)
        return late + batch, [UNAVAILABLE] * len(late) + results, hooks

    def _insert(self, conn: sqlite3.Connection, hooks: Sequence[NewHook]) -> inserts.Inserted:
        return inserts.insert(conn, hooks, self._wall())

    def _sweep_pass(self) -> int | None:
        """Delete up to ``SWEEP_ROWS`` expired index rows in one transaction; None if the
        store could not be written."""
        assert self._lock is not None
        self._lock.acquire()
        try:
            conn = self._begin()
            if conn is None:
                return None
            try:
                deleted = conn.execute(_SWEEP, (self._wall(), SWEEP_ROWS)).rowcount
                conn.execute("COMMIT")
            except sqlite3.Error as e:
                self._fail(conn, e)
                return None
        finally:
            self._release()
        self.stats.swept += deleted
        self._logged(deleted, 0)
        return deleted

    def _finish_sweep(self, swept: int) -> None:
        with self._cond:
            waiters, self._sweep_waiters = self._sweep_waiters, []
        self._hand_back([(w, swept) for w in waiters])
