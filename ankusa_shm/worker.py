"""A request worker: one uvloop event loop serving HTTP on the supervisor's sockets.

It builds, after the fork, everything it owns -- the store's writer thread and connection,
the fleet store's Redis connection, the HTTP server -- then tells the supervisor it serves
and heartbeats into its process slot from the loop, so a heartbeat proves the loop turns.
SIGTERM: stop accepting, finish in-flight requests (up to ``graceful_timeout_s``), let the
writer commit what it holds, exit. SIGINT/SIGQUIT: the same without waiting for clients.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
from collections.abc import Callable

import uvloop

from ankusa_shm.child import BootError, settle_heap
from ankusa_shm.clock import monotonic_ms
from ankusa_shm.config import Config
from ankusa_shm.credentials import MissingSecret, read_secret
from ankusa_shm.fleet.admission import Fleet
from ankusa_shm.fleet.redis_store import RedisStore
from ankusa_shm.http.protocol import HttpServer, Limits
from ankusa_shm.http.request_path import RequestPath
from ankusa_shm.shm.procs import ProcessSlot
from ankusa_shm.shm.segment import Segment
from ankusa_shm.store.writer import StoreError, Writer

log = logging.getLogger("ankusa_shm.worker")

HEARTBEAT_S = 1.0


def limits(cfg: Config) -> Limits:
    s = cfg.server
    return Limits(
        max_header_bytes=s.max_header_bytes,
        max_body_bytes=s.max_body_bytes,
        header_timeout_s=s.header_timeout_s,
        body_timeout_s=s.body_timeout_s,
        keepalive_timeout_s=s.keepalive_timeout_s,
    )


class Worker:
    """One worker process's life, from the supervisor's fork to its exit status."""

    def __init__(
        self,
        cfg: Config,
        seg: Segment,
        slot: ProcessSlot,
        sockets: list[socket.socket],
        ready: Callable[[], None],
    ) -> None:
        self._cfg = cfg
        self._seg = seg
        self._slot = slot
        self._sockets = sockets
        self._ready = ready

    def run(self) -> int:
        return uvloop.run(self._serve())

    async def _serve(self) -> int:
        cfg = self._cfg
        loop = asyncio.get_running_loop()
        writer = Writer(cfg.store)
        try:
            writer.start(loop)
            password = read_secret(cfg.fleet.password_env, cfg.fleet.password_file)
            store = RedisStore.from_config(cfg.fleet, password) if cfg.fleet_kinds else None
            fleet = Fleet(cfg, self._seg, self._slot, store)
            path = RequestPath(cfg, fleet, writer, self._slot.counters)
        except (StoreError, MissingSecret) as e:
            await writer.close()
            raise BootError(str(e)) from None
        server = HttpServer(path, limits(cfg))
        await server.start(self._sockets)

        stop = asyncio.Event()
        graceful = True

        def fast() -> None:
            nonlocal graceful
            graceful = False
            stop.set()

        loop.add_signal_handler(signal.SIGTERM, stop.set)
        loop.add_signal_handler(signal.SIGINT, fast)
        loop.add_signal_handler(signal.SIGQUIT, fast)
        beat = loop.create_task(self._heartbeat(os.getppid(), stop))
        settle_heap()
        self._ready()
        await stop.wait()
        beat.cancel()
        if graceful:
            if not await server.drain(cfg.server.graceful_timeout_s):
                log.warning("graceful timeout: %d connections still busy", len(server.connections))
        else:
            server.stop_accepting()
        await writer.close()
        await fleet.close()
        return 0

    async def _heartbeat(self, parent: int, stop: asyncio.Event) -> None:
        while True:
            self._slot.heartbeat(monotonic_ms())
            if os.getppid() != parent:
                stop.set()  # orphaned (PDEATHSIG normally kills us first)
            await asyncio.sleep(HEARTBEAT_S)
