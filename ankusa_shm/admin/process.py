"""The admin process: the admin API on its own socket, one uvloop loop, one slot.

A child of the supervisor like a worker: it builds everything after the fork (the store's
reader and control handles, the fleet store connection for bucket resets, the HTTP
server), publishes the stored tenant overrides, says it serves, and heartbeats from its
loop so the supervisor can tell a stuck loop from a busy one. It runs retention too, being
the one process besides the workers that writes while the service runs (the supervisor
writes only its mark of a clean stop). SIGTERM: stop accepting, let requests in
flight finish (a long-poll is answered at once); SIGINT/SIGQUIT: the same without waiting.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import socket
from collections.abc import Callable

import uvloop

from ankusa_shm import config, overrides
from ankusa_shm.admin.app import App
from ankusa_shm.admin.consumer_api import CommitWatch, ConsumerApi
from ankusa_shm.admin.stores import StoreCalls
from ankusa_shm.child import BootError, Life, freeze_heap
from ankusa_shm.clock import SteadyWall
from ankusa_shm.config import Config
from ankusa_shm.credentials import MissingSecret, admin_token, fleet_password
from ankusa_shm.fleet.admission import Fleet
from ankusa_shm.fleet.redis_store import RedisStore
from ankusa_shm.http.protocol import HttpServer, Limits
from ankusa_shm.shm.commits import CommitWord
from ankusa_shm.shm.procs import ProcessSlot
from ankusa_shm.shm.segment import Segment
from ankusa_shm.shm.turns import Turns
from ankusa_shm.store.schema import StoreError

log = logging.getLogger("ankusa_shm.admin")

BODY_BYTES = 64 * 1024  # an admin body is a few bytes of JSON: any client, token or not
STEP_MS = 60_000  # a wall clock this far ahead of the steady one was stepped: said once
RETAIN_BATCH = 500
RETAIN_PAUSE_S = 0.01  # between two batches: the writers' turn on the lock


def main(
    cfg: Config, seg: Segment, slot: ProcessSlot, sock: socket.socket, ready: Callable[[], None]
) -> int:
    """The admin process's life, from the supervisor's fork to its exit status."""
    try:
        token = admin_token(cfg.server.admin_token_env, cfg.server.admin_token_file)
    except MissingSecret as e:
        raise BootError(f"admin token: {e}") from None
    try:
        password = fleet_password(cfg)
    except MissingSecret as e:
        raise BootError(str(e)) from None
    status: int = uvloop.run(_serve(cfg, seg, slot, sock, ready, token, password))
    return status


async def _serve(
    cfg: Config,
    seg: Segment,
    slot: ProcessSlot,
    sock: socket.socket,
    ready: Callable[[], None],
    token: bytes | None,
    password: str,
) -> int:
    loop = asyncio.get_running_loop()
    redis = RedisStore.from_config(cfg.fleet, password) if cfg.fleet_kinds else None
    fleet = Fleet(cfg, seg, slot, redis)  # for resetting buckets, and the breaker's state
    store = StoreCalls(cfg.store, Turns(seg.view, seg.layout))
    await asyncio.to_thread(overrides.publish_stored, seg.blob("overrides"), cfg.store.path)
    watch = CommitWatch(CommitWord(seg.view, seg.layout))
    app = App(cfg, seg, fleet, store, ConsumerApi(store, watch), token)
    limits = dataclasses.replace(Limits.of(cfg.server), max_body_bytes=BODY_BYTES)
    server = HttpServer(app, limits, counters=slot.counters)
    await server.start([sock], config.ADMIN_BACKLOG)

    life = Life(slot)
    life.start()
    keep_ms = cfg.store.retention_ms
    retention = None
    if keep_ms is not None:
        retention = loop.create_task(_retention(store, cfg.store, keep_ms))
    freeze_heap()
    ready()
    graceful = await life.stopped()
    if retention is not None:
        retention.cancel()
    watch.close()
    await server.stop(graceful, cfg.server.graceful_timeout_s)
    await fleet.close()
    await store.close()
    return 0


async def _retention(store: StoreCalls, cfg: config.Store, keep_ms: int) -> None:
    """Every ``retention_interval_s``: delete what is older than ``retention`` and acked
    by every named consumer, by a wall clock that a forward step does not move on (a step
    of a day deleted the hooks of the last minute, read by no one): the hooks received
    after such a step are kept until a restart takes the clock as it is then."""
    now = SteadyWall()
    warned = False
    while True:
        if not warned and (ahead_ms := now.ahead_ms()) > STEP_MS:
            warned = True
            log.warning(
                "the wall clock was stepped %.0f s forward; retention goes by where it was"
                " plus the time since, until the admin process restarts",
                ahead_ms / 1000,
            )
        try:
            gone = await retain(store, now() - keep_ms)
        except StoreError as e:
            log.warning("retention: %s", e)
        else:
            if gone:
                log.info("retention deleted %d hooks older than %s", gone, cfg.retention)
        await asyncio.sleep(cfg.retention_interval_s)


async def retain(store: StoreCalls, cutoff_ms: int) -> int:
    """One retention run, in small transactions with a pause between them, so a
    worker's batch never waits long behind a delete; returns how many hooks went."""
    gone = 0
    while n := await store.write(lambda c: c.retain(cutoff_ms, RETAIN_BATCH)):
        gone += n
        await asyncio.sleep(RETAIN_PAUSE_S)
    return gone
