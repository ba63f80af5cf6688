"""A request worker: one uvloop event loop serving HTTP on the supervisor's sockets.

It builds, after the fork, everything it owns -- the store's writer thread and connection,
the fleet store's Redis connection, the HTTP server -- then tells the supervisor it serves
and heartbeats into its process slot from the loop, so a heartbeat proves the loop turns.
SIGTERM: stop accepting, finish in-flight requests (for up to ``workers_drain_s``: the
graceful timeout less what the drainer and the admin process need after the workers), let
the writer commit what it holds, exit. SIGINT/SIGQUIT: the same without waiting for clients.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from collections.abc import Callable

import uvloop

from ankusa_shm import overrides
from ankusa_shm.child import BootError, Life, freeze_heap
from ankusa_shm.clock import wall_ms
from ankusa_shm.config import Config
from ankusa_shm.credentials import MissingSecret, fleet_password
from ankusa_shm.fleet.admission import Fleet
from ankusa_shm.fleet.redis_store import RedisStore
from ankusa_shm.http.observe import Observer
from ankusa_shm.http.protocol import HttpServer, Limits
from ankusa_shm.http.request_path import RequestPath
from ankusa_shm.shm.commits import CommitWord
from ankusa_shm.shm.procs import ProcessSlot
from ankusa_shm.shm.segment import Segment
from ankusa_shm.shm.turns import Turns
from ankusa_shm.store import readers
from ankusa_shm.store.writer import StoreError, Writer

log = logging.getLogger("ankusa_shm.worker")


class Worker:
    """One worker process's life, from the supervisor's fork to its exit status."""

    def __init__(
        self,
        cfg: Config,
        seg: Segment,
        slot: ProcessSlot,
        sockets: list[socket.socket],
        ready: Callable[[bool], None],
        recover_since_ms: int | None = None,
        reset_tenants: list[str] | None = None,
    ) -> None:
        """``recover_since_ms``: a worker died (or the whole host did) and may have left
        claims unsettled; before serving, promote what was stored since then.
        ``reset_tenants``: a reload changed their limits; before serving, forget their
        buckets, filled under the old ones. ``ready`` says it serves, and whether that
        recovery, if any, was done whole."""
        self._recover_since_ms = recover_since_ms
        self._reset_tenants = reset_tenants or []
        self._cfg = cfg
        self._seg = seg
        self._slot = slot
        self._sockets = sockets
        self._ready = ready

    def run(self) -> int:
        return uvloop.run(self._serve())

    async def _forget_buckets(self, fleet: Fleet) -> None:
        """The tenants a reload gave another limit start from a full bucket under it, as
        after an override (one with an override kept has no other limit now)."""
        tenants = [t for t in self._reset_tenants if not fleet.overridden(t)]
        for tenant in tenants:
            await fleet.reset_tenant(tenant)
        if tenants:
            log.info("new rate limits: the buckets of %s start full", ", ".join(tenants))

    async def _recover(self, fleet: Fleet, since_ms: int) -> bool:
        """Whether every hook stored since ``since_ms`` had its promote queued."""
        # The newest, up to half the settle queue: the rest is room for the hooks served
        # meanwhile, and a look back over days of hooks must not fill it.
        most = self._seg.layout.params.queue_capacity // 2  # the ring made at start
        try:
            hooks = await asyncio.to_thread(
                readers.claimed_since, self._cfg.store.path, since_ms, most
            )
        except StoreError as e:
            log.warning("recovery: cannot read the store: %s", e)
            return False
        if not hooks:  # nothing stored lately
            return True
        queued = fleet.queue_promotes(hooks, wall_ms())
        log.info(
            "recovery: %d promotes queued for hooks stored since %s%s, whose settle a crash "
            "may have lost",
            queued,
            time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(since_ms / 1000)),
            f" (only the newest {most})" if len(hooks) >= most else "",
        )
        return len(hooks) < most

    async def _serve(self) -> int:
        cfg, seg = self._cfg, self._seg
        loop = asyncio.get_running_loop()
        ids = [s.id for s in cfg.sources]
        observer = (
            Observer.of_slot(seg, self._slot.index, ids) if cfg.server.request_metrics else None
        )
        commits = CommitWord(seg.view, seg.layout)

        def on_commit(hooks: int, waited_ns: int, held_ns: int) -> None:
            commits.bump()
            if observer is not None:
                observer.transaction(hooks, waited_ns, held_ns)

        try:
            password = fleet_password(cfg)
        except MissingSecret as e:
            raise BootError(str(e)) from None
        store = RedisStore.from_config(cfg.fleet, password) if cfg.fleet_kinds else None
        fleet = Fleet(cfg, seg, self._slot, store)
        # The writer settles each claim itself, from its thread, the moment the hook's
        # transaction ends (``Writer``): the request path never holds a committed claim.
        turns = Turns(seg.view, seg.layout)
        writer = Writer(cfg.store, on_commit=on_commit, settle=fleet.settle, turns=turns)
        try:
            writer.start(loop)
            path = RequestPath(cfg, fleet, writer, self._slot.counters, observer)
        except (StoreError, MissingSecret) as e:  # a store it cannot open, a secret it lacks
            await writer.close()
            await fleet.close()
            raise BootError(str(e)) from None
        recovered = True
        if self._recover_since_ms is not None and "dedupe" in cfg.fleet_kinds:
            recovered = await self._recover(fleet, self._recover_since_ms)
        fleet.set_overrides(overrides.read(seg.blob("overrides")))
        if self._reset_tenants:
            await self._forget_buckets(fleet)
        follow = loop.create_task(overrides.follow(seg.blob("overrides"), fleet.set_overrides))
        answered = observer.answered if observer else None
        server = HttpServer(path, Limits.of(cfg.server), answered, self._slot.counters)
        await server.start(self._sockets, cfg.server.backlog)

        life = Life(self._slot)
        life.start()
        freeze_heap()
        self._ready(recovered)
        graceful = await life.stopped()
        follow.cancel()
        await server.stop(graceful, cfg.workers_drain_s, life.hurry)
        await writer.close()
        await fleet.close()
        return 0
