"""The writers' turn-taking lock: ``flock`` on ``<db>.lock``.

Every process that writes the store while it serves -- the request workers' writers and
the admin process's ``Control`` -- takes it from BEGIN IMMEDIATE to COMMIT. (The
supervisor's mark of a clean stop, ``settled.write``, comes once they have all stopped,
and leaves the waiting to SQLite.) A waiter is woken the
moment the holder lets go, which SQLite's sleeping busy handler cannot do, and a holder
that dies lets go by dying.

``flock`` is not fair, though: it wakes its waiters and hands the lock to none of them, so
a writer that commits batch after batch keeps taking it back before a woken waiter runs.
With a ``Queue`` (the segment's ``shm.turns``) a writer first waits for its ticket's turn,
for ``TURN_WAIT_S`` at most -- the bound on what a writer that died waiting costs the
others -- and the lock goes round in the order it was asked for.
"""

from __future__ import annotations

import fcntl
import os
import threading
import time
from pathlib import Path
from typing import Protocol

TURN_WAIT_S = 0.02  # a turn waited for longer is taken to be a dead writer's


class Queue(Protocol):
    """Tickets in the order the lock was asked for (``shm.turns.Turns``)."""

    def ticket(self) -> int: ...
    def wait(self, ticket: int, timeout_s: float) -> bool: ...
    def served(self, ticket: int) -> None: ...


class WriteLock:
    """``flock`` on one store's lock file (``schema.lock_path``), held by one process;
    ``acquire`` waits for its turn in ``queue`` first, when there is one."""

    def __init__(
        self, path: Path, queue: Queue | None = None, turn_wait_s: float = TURN_WAIT_S
    ) -> None:
        self._fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        self._queue = queue
        self._turn_wait_s = turn_wait_s
        self._ticket: int | None = None  # the ticket of the turn now held
        self._mutex = threading.Lock()  # the rest is for wait_within
        self._got = threading.Event()
        self._taker = False  # a thread is in a blocking flock on _fd
        self._wanted = False  # a caller of wait_within still waits for it
        self._closed = False

    def acquire(self) -> None:
        self._ticket = self._wait_turn(self._turn_wait_s)
        fcntl.flock(self._fd, fcntl.LOCK_EX)

    def wait_within(self, timeout_s: float) -> bool:
        """Wait in line for the lock, as ``acquire`` does, for ``timeout_s`` at most; a
        turn given up on passes on to the next ticket."""
        began = time.monotonic()
        self._ticket = self._wait_turn(min(self._turn_wait_s, timeout_s))
        got = self._flock_within(max(0.0, timeout_s - (time.monotonic() - began)))
        if not got:
            self._pass_turn()
        return got

    def _wait_turn(self, bound_s: float) -> int | None:
        """Take a ticket and wait for its turn, ``bound_s`` at most (past it, the lock
        alone decides); None without a queue."""
        if self._queue is None:
            return None
        ticket = self._queue.ticket()
        self._queue.wait(ticket, bound_s)
        return ticket

    def _pass_turn(self) -> None:
        if self._ticket is not None and self._queue is not None:
            self._queue.served(self._ticket)
            self._ticket = None

    def _flock_within(self, timeout_s: float) -> bool:
        """The ``flock`` for ``timeout_s`` at most.

        Writers hand the lock straight on to each other, so a poll seldom finds it free
        and would give up under load (a worker booting beside busy ones, a process that
        writes now and then). A thread waits in ``flock`` instead; given up on, it lets go
        of the lock as soon as it gets it, unless the next call wants it by then. One
        caller at a time."""
        with self._mutex:
            if not self._taker:
                try:
                    fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    return True
                except BlockingIOError:
                    self._taker = True
                    threading.Thread(target=self._take, name="store-lock", daemon=True).start()
            self._wanted = True
        got = self._got.wait(timeout_s)
        with self._mutex:
            got = self._got.is_set()  # it may have come after the wait ended
            self._got.clear()
            self._wanted = False
        return got

    def _take(self) -> None:
        fcntl.flock(self._fd, fcntl.LOCK_EX)
        with self._mutex:  # so no other call can see the lock as ours in between
            self._taker = False
            if self._closed:  # close() left the descriptor to us
                os.close(self._fd)
            elif self._wanted:
                self._got.set()
            else:
                fcntl.flock(self._fd, fcntl.LOCK_UN)

    def release(self) -> None:
        fcntl.flock(self._fd, fcntl.LOCK_UN)
        self._pass_turn()

    def close(self) -> None:
        with self._mutex:
            self._closed = True
            if self._taker:  # closing under its flock would let it lock a reused number
                return
        os.close(self._fd)
