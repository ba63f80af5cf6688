"""What every child process of the supervisor does as it starts, before it serves.

A child is forked, not exec'd: it inherits the supervisor's mapping of the segment and its
listening sockets, and nothing else it may use -- event loops, Redis connections and
database handles are all made here, after the fork. ``run`` is the child's whole life: it
never returns into the supervisor's code, and its exit status tells the supervisor what
happened (``BOOT_ERROR``: it could not start, and starting it again would not help).
"""

from __future__ import annotations

import asyncio
import ctypes
import faulthandler
import gc
import logging
import os
import signal
import sys
import traceback
from collections.abc import Callable
from typing import NoReturn

import setproctitle

from ankusa_shm.clock import monotonic_ms
from ankusa_shm.shm.procs import NoFreeSlot, ProcessSlot, SlotState

log = logging.getLogger("ankusa_shm.child")

BOOT_ERROR = 3  # as gunicorn's workers: the supervisor stops instead of respawning
QUEUE_TAKEN = 2  # the drainer: another live process drains the settle queue
HEARTBEAT_S = 1.0
_PR_SET_PDEATHSIG = 1


class BootError(Exception):
    """The child cannot start (a store it cannot open, a secret it cannot read, ...)."""


def die_with_parent(parent: int) -> None:
    """Ask the kernel to SIGKILL us when the supervisor dies: the segment keeps whatever
    was queued, and a fresh supervisor starts clean children. If the parent died before
    the request took effect, go now."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        log.warning("PR_SET_PDEATHSIG failed: errno %d", ctypes.get_errno())
    if os.getppid() != parent:
        os._exit(1)


def freeze_heap() -> None:
    """Keep garbage collection off the request path's clock.

    Everything alive once start-up is done (modules, config, the segment's objects) lives
    until the process exits; ``gc.freeze`` moves it out of the collector's sight, so an
    old-generation collection scans only what the request path allocated since -- the
    pauses that pushed admits past their budget were full scans of the start-up heap.
    """
    gc.collect()
    gc.freeze()


class Life:
    """A serving child's event-loop side: SIGTERM asks it to stop gracefully, SIGINT and
    SIGQUIT to stop now (``hurry`` is set, also when a graceful stop is under way), and
    its heartbeat goes into its slot every ``HEARTBEAT_S`` from the loop itself -- so a
    fresh heartbeat proves the loop turns. A child whose parent is gone stops too
    (PR_SET_PDEATHSIG normally kills it first). Stopping, its slot says so: a worker
    that drains no longer accepts, and readiness must not count it."""

    def __init__(self, slot: ProcessSlot) -> None:
        self._slot = slot
        self._stop = asyncio.Event()
        self.hurry = asyncio.Event()
        self.graceful = True
        self._beat: asyncio.Task[None] | None = None

    def start(self) -> None:
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGTERM, self._stopping)
        loop.add_signal_handler(signal.SIGINT, self._now)
        loop.add_signal_handler(signal.SIGQUIT, self._now)
        self._beat = loop.create_task(self._heartbeat(os.getppid()))

    async def stopped(self) -> bool:
        """Wait for a stop; whether it is to be graceful."""
        await self._stop.wait()
        if self._beat is not None:
            self._beat.cancel()
        return self.graceful

    def _stopping(self) -> None:
        self._slot.set_state(SlotState.STOPPING)
        self._stop.set()

    def _now(self) -> None:
        self.graceful = False
        self.hurry.set()
        self._stopping()

    async def _heartbeat(self, parent: int) -> None:
        while True:
            self._slot.heartbeat(monotonic_ms())
            if os.getppid() != parent:
                self._stopping()
            await asyncio.sleep(HEARTBEAT_S)


def run(title: str, parent: int, body: Callable[[], int]) -> NoReturn:
    """The forked child's life: become a child, run ``body``, exit with its status."""
    code = 1
    try:
        signal.set_wakeup_fd(-1)
        for sig in signal.valid_signals():  # whatever the supervisor handled, the child does not
            if callable(signal.getsignal(sig)):
                signal.signal(sig, signal.SIG_DFL)
        # The supervisor blocked its signals across the fork: one sent to us since then is
        # delivered now, with its default action (a TERM before we serve: gone at once).
        signal.pthread_sigmask(signal.SIG_SETMASK, ())
        die_with_parent(parent)
        faulthandler.enable()  # SIGABRT from the supervisor prints where the loop was stuck
        setproctitle.setproctitle(title)
        code = body()
    except (BootError, NoFreeSlot) as e:
        log.error("%s cannot start: %s", title, e)
        code = BOOT_ERROR
    except BaseException:
        traceback.print_exc()
    finally:
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
    os._exit(code)
