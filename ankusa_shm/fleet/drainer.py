"""The drainer: the only process that sends settlements to Redis.

It is the settle queue's single consumer. Every ``settle_interval_ms`` it peeks up to
``settle_batch_max`` operations and delivers them in one pipelined round trip; only then
does it free them in the ring. A queue found empty is not polled: the drainer sleeps on
it (``SettleQueue.wait_for_records``, in a thread, so its event loop stays free) until a
producer wakes it, then gives what comes with that first operation ``settle_interval_ms``
to gather. Asleep, it wakes only for its heartbeat, every quarter of
``heartbeat_timeout_s``. (Polling every 5 ms cost 3 % of a core on a host with nothing
to do, and backed off to every 50 ms still 0.35-0.4 %.) If Redis fails it keeps that batch
and retries with capped backoff while producers keep filling the ring behind it; a
drainer killed at any moment loses nothing, because the next one starts from the same
head (and a batch delivered twice changes nothing: every operation is idempotent). A
release whose pending claim has certainly expired -- its call was answered more than
``pending_ttl_ms`` ago -- is counted and not sent; a promote is never dropped for age,
since it is the only record in Redis that the hook exists. On SIGTERM it delivers what
was queued by then, for up to ``drain_on_stop_ms``, and exits 0; on SIGINT or SIGQUIT it
exits at once (what is queued stays in the segment).

It also asks Redis, at start and once a minute, whether it may evict keys (a
``maxmemory`` with any policy but ``noeviction``: every fleet key has a TTL, so even a
``volatile-*`` policy takes them) and how many it has evicted. An evicted committed key is
a hook the fleet forgets inside its dedupe window, so a resend to another host is stored
again, and nothing else would say so: the evictions answer every call without an error.
Every second it reads the fleet's epoch key, and promotes this host's hooks again when
Redis has lost its data (``epoch``); and it looks at the queue's drop count, and once a
full queue has dropped operations and deliveries work again, promotes again the hooks
stored since (``repromote``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import time
from collections.abc import Callable

import uvloop

from ankusa_shm.child import QUEUE_TAKEN, BootError
from ankusa_shm.clock import Clock, monotonic_ns
from ankusa_shm.config import Config
from ankusa_shm.credentials import MissingSecret, fleet_password
from ankusa_shm.fleet import epoch, repromote
from ankusa_shm.fleet.redis_client import REFUSED_HINT, RedisError, refused
from ankusa_shm.fleet.redis_store import Memory, RedisStore
from ankusa_shm.fleet.seen import Seen
from ankusa_shm.fleet.settle import UNKNOWN
from ankusa_shm.shm import procs
from ankusa_shm.shm.counters import Counter, totals
from ankusa_shm.shm.degraded import WARN_EVERY_MS
from ankusa_shm.shm.procs import ProcessSlot, Role
from ankusa_shm.shm.segment import Segment
from ankusa_shm.shm.settle_queue import Batch, ConsumerTaken, Op, Record, SettleQueue
from ankusa_shm.store import settled

log = logging.getLogger("ankusa_shm.drainer")

BACKOFF_MIN_S = 0.05
BACKOFF_MAX_S = 2.0
PLAIN_SLEEP_S = 0.05  # a pause this short is not cut short by a stop
MEMORY_CHECK_S = 60.0  # how often the server's eviction policy and evictions are read
POLICY_WARN_EVERY_S = 600.0  # an evicting policy is said again this often


class Drainer:
    def __init__(
        self,
        cfg: Config,
        seg: Segment,
        slot: ProcessSlot,
        store: RedisStore,
        clock: Clock = monotonic_ns,
    ) -> None:
        f = cfg.fleet
        self._queue = SettleQueue(seg.view, seg.buf, seg.layout)
        self._seg = seg
        self._slot = slot
        self._row = slot.counters
        self._store = store
        self._clock = clock
        self._interval_s = f.settle_interval_ms / 1000
        self._batch_max = f.settle_batch_max
        self._timeout_s = f.settle_timeout_ms / 1000
        self._pending_ttl_ms = f.pending_ttl_ms
        self._on_stop_ms = f.drain_on_stop_ms
        self._idle_s = cfg.server.heartbeat_timeout_s / 4  # asleep: the heartbeat's pace
        self._warned_ms: int | None = None
        # the first failed delivery of the current run of failures, and the queue's
        # drops counted by then: what the line said when deliveries resume is drawn from
        self._failing: tuple[int, int] | None = None
        self._memory: Memory | None = None  # the last answer to ``check_memory``
        self._memory_at = 0.0
        self._policy_warned_at: float | None = None
        self._store_path = cfg.store.path
        self._until = -1  # told to stop: the queue's tail then (``_told``)
        promote = repromote.Repromoter(cfg, store, self._row, self._timeout_s)
        self._epoch = epoch.Epoch(store, seg.blob("epoch"), promote, self._timeout_s)
        self._drops = repromote.Drops(cfg, seg, self._row, promote)

    def _now_ms(self) -> int:
        return self._clock() // 1_000_000

    async def run(self, stop: asyncio.Event) -> None:
        """Drain until ``stop`` is set and what was queued by then is delivered, or the
        stop deadline passes. Not until the queue is empty: a drainer replaced on reload
        stops while the new workers push, and its successor delivers what they push
        (it waited out ``drain_on_stop_ms`` under load, the reload with it). A service
        that stops has no worker left to push when its drainer is told."""
        self._queue.become_consumer()
        parent = os.getppid()
        batch: Batch | None = None
        backoff = 0.0
        deadline: int | None = None
        if not self._queue.mended_ms():  # a new segment: before the first epoch check
            await self._seed()
        self._epoch.claim()  # before the first delivery
        waker = asyncio.get_running_loop().create_task(self._wake_on(stop))
        watcher = asyncio.get_running_loop().create_task(self._watch(stop))
        try:
            while True:
                now = self._now_ms()
                self._slot.heartbeat(now)
                if os.getppid() != parent:
                    stop.set()  # orphaned: our supervisor is gone
                if stop.is_set() and deadline is None:
                    deadline = now + self._on_stop_ms
                    self._told()
                if deadline is not None and (
                    now >= deadline or (batch is None and self._queue.head() >= self._until)
                ):
                    return  # stopping: past its deadline, or all it was told to deliver is
                if batch is None:
                    batch, skipped = self._queue.peek(self._batch_size(), now)
                    if skipped:
                        self._row.add(Counter.SETTLE_ABANDONED, skipped)
                    if batch.corrupt_skipped:
                        self._corrupt(batch.corrupt_skipped)
                if not batch.records:
                    batch = None
                    await self._idle(stop)
                    continue
                delivered = await self._deliver(batch, now, deadline)
                if delivered is not None:
                    full = len(batch.records) >= self._batch_max
                    self._queue.commit(batch)
                    self._count(delivered)  # after the commit: a redelivery counts once
                    if batch.corrupt:
                        self._corrupt(batch.corrupt)
                    batch, backoff = None, 0.0
                    if not full:
                        await self._pause(self._interval_s, stop)
                    continue
                backoff = min(max(2 * backoff, BACKOFF_MIN_S), BACKOFF_MAX_S)
                if deadline is not None:  # stopping: not past the stop's deadline either
                    backoff = min(backoff, max(0, deadline - self._now_ms()) / 1000)
                await self._pause(backoff, stop)
        finally:
            waker.cancel()
            watcher.cancel()
            self._queue.resign_consumer()

    async def _watch(self, stop: asyncio.Event) -> None:
        """Beside the deliveries: the server's epoch and the queue's drops every
        ``epoch.CHECK_S``, the server's memory every ``MEMORY_CHECK_S``."""
        memory_at = -MEMORY_CHECK_S
        while not stop.is_set():
            if time.monotonic() - memory_at >= MEMORY_CHECK_S:
                memory_at = time.monotonic()
                await self.check_memory()
            await self._epoch.check(self._memory is not None and self._memory.evicts)
            roomy = self._queue.depth() <= self._queue.capacity // 2
            await self._drops.check(self._failing is None and roomy)
            await self._pause(epoch.CHECK_S, stop)

    async def _seed(self) -> None:
        """Start a new segment from what the last stop that left every hook settled kept
        in the store (``store.settled``): its epoch, to compare the server's with, and the
        last hook it covers, after which those stored are promoted again. A mark of
        another store (another server, another prefix, a cluster then and not now) is
        not used: what it covers was settled there, not here."""
        mark = await asyncio.to_thread(settled.read, self._store_path)
        if mark is None:
            return
        seen = Seen.of(mark.epoch)
        if set(seen.values) != self._store.epoch_names or seen.server != self._store.server:
            return
        if self._epoch.seed(seen):
            self._drops.settled(mark)

    async def check_memory(self) -> None:
        """Warn if the server may evict fleet keys (when first seen, when its policy
        changes, then every ``POLICY_WARN_EVERY_S``) and whenever it evicted some since
        the last check. A server that does not answer, or will not say, is left alone:
        the deliveries report an unreachable one."""
        try:
            mem = await self._store.memory(time.monotonic() + self._timeout_s)
        except (TimeoutError, RedisError):
            return
        if mem is None:
            return
        now = time.monotonic()
        last, last_at = self._memory, self._memory_at
        self._memory, self._memory_at = mem, now
        if mem.evicts and (
            last is None
            or last.policy != mem.policy
            or self._policy_warned_at is None
            or now - self._policy_warned_at >= POLICY_WARN_EVERY_S
        ):
            self._policy_warned_at = now
            log.warning(
                "Redis may evict fleet keys (maxmemory-policy %s, maxmemory %d bytes): an"
                " evicted dedupe key lets a resend be stored again on another host, an"
                " evicted bucket forgets a tenant's rate; set maxmemory-policy noeviction",
                mem.policy,
                mem.maxmemory,
            )
        elif not mem.evicts:
            self._policy_warned_at = None
        if last is not None and mem.evicted_keys > last.evicted_keys:
            log.warning(
                "Redis evicted %d keys in the last %.0f s (maxmemory-policy %s): resends of"
                " events whose keys it evicted are stored again",
                mem.evicted_keys - last.evicted_keys,
                now - last_at,
                mem.policy,
            )

    def _corrupt(self, n: int) -> None:
        """Records that failed their check: counted, and said every time, since each is
        a settle operation lost (a producer that stalled mid-copy, or a damaged segment)."""
        self._row.add(Counter.SETTLE_CORRUPT, n)
        log.error("skipped %d settle record(s) that failed their check", n)

    def _expired(self, rec: Record, now_ms: int) -> bool:
        """Only a release whose claim was certainly written, long enough ago, is dropped."""
        return (
            rec.op is Op.RELEASE
            and rec.claimed_ms != UNKNOWN
            and now_ms - rec.claimed_ms > self._pending_ttl_ms
        )

    async def _deliver(
        self, batch: Batch, now_ms: int, stop_ms: int | None
    ) -> tuple[int, int, int] | None:
        """One round trip for the batch: (promotes, releases sent, expired); None (batch
        kept) if the store failed. Stopping, it is given up at the stop's deadline
        (``stop_ms``): a Redis gone for good held the drainer past it for one more
        ``settle_timeout_ms``, into the supervisor's SIGKILL."""
        live = [r for r in batch.records if not self._expired(r, now_ms)]
        if live:
            self._row.add(Counter.DRAIN_ROUND_TRIPS)
            budget_s = self._timeout_s
            if stop_ms is not None:
                budget_s = min(budget_s, max(0, stop_ms - now_ms) / 1000)
            try:
                await self._store.settle(live, now_ms, time.monotonic() + budget_s)
            except (TimeoutError, RedisError) as e:
                self._row.add(Counter.DRAIN_ERRORS)
                if self._failing is None:
                    self._failing = (now_ms, self._dropped())
                if self._warned_ms is None or now_ms - self._warned_ms >= WARN_EVERY_MS:
                    self._warned_ms = now_ms
                    config_error = refused(e)  # said as an error, with what to fix
                    log.log(
                        logging.ERROR if config_error else logging.WARNING,
                        "settle delivery failed (%s); keeping %d operations, %d queued, %d"
                        " dropped so far for a full queue%s",
                        str(e) or type(e).__name__,
                        len(batch.records),
                        self._queue.depth(),
                        self._dropped(),
                        f"; {REFUSED_HINT}" if config_error else "",
                    )
                return None
            if self._failing is not None:
                self._resumed(now_ms)
        promotes = sum(1 for r in live if r.op is Op.PROMOTE)
        return promotes, len(live) - promotes, len(batch.records) - len(live)

    def _dropped(self) -> int:
        return totals(self._seg.view, self._seg.layout)[Counter.SETTLE_DROPPED]

    def _resumed(self, now_ms: int) -> None:
        """Deliveries work again: say for how long they failed and what a full queue
        dropped meanwhile. The failure's warning comes once a minute and may have said
        "0 dropped" just before the queue filled; each drop is a promote that may let a
        resend be stored again, so the operator is told the total when it is known. Said
        when the failures were warned about or dropped something: a flap within the
        warning's minute stays as quiet as its failure was."""
        assert self._failing is not None
        since_ms, dropped_before = self._failing
        self._failing = None
        dropped = self._dropped() - dropped_before
        warned = self._warned_ms is not None and self._warned_ms >= since_ms
        if not (dropped or warned):  # a flap the once-a-minute warning did not mention
            return
        log.log(
            logging.WARNING if dropped else logging.INFO,
            "settle delivery works again after %.1f s of failures; %d queued, %d operations"
            " dropped for a full queue meanwhile",
            (now_ms - since_ms) / 1000,
            self._queue.depth(),
            dropped,
        )

    def _count(self, delivered: tuple[int, int, int]) -> None:
        promotes, releases, expired = delivered
        if promotes:
            self._row.add(Counter.SETTLED_PROMOTE, promotes)
        if releases:
            self._row.add(Counter.SETTLED_RELEASE, releases)
        if expired:
            self._row.add(Counter.SETTLE_EXPIRED, expired)

    async def _idle(self, stop: asyncio.Event) -> None:
        """Nothing to read: sleep until a producer publishes, a stop or the heartbeat is
        due; then give what comes with it ``settle_interval_ms`` to gather. Stopping,
        only that pause: the queue is being emptied against a deadline."""
        if not stop.is_set():
            loop = asyncio.get_running_loop()
            try:
                await loop.run_in_executor(None, self._queue.wait_for_records, self._idle_s)
            except BaseException:  # cancelled: the thread must not sleep on until its timeout
                self._queue.wake_consumer()
                raise
        await self._pause(self._interval_s, stop)

    async def _wake_on(self, stop: asyncio.Event) -> None:
        await stop.wait()
        self._told()
        self._queue.wake_consumer()

    def _batch_size(self) -> int:
        """Stopping, none past what was queued when told: the rest is the next one's."""
        if self._until < 0:
            return self._batch_max
        return max(1, min(self._batch_max, self._until - self._queue.head()))

    def _told(self) -> None:
        """Told to stop: what is queued now is what it delivers. Noted as the stop comes,
        by ``_wake_on``, not once a delivery under way returns."""
        if self._until < 0:
            self._until = self._queue.tail()

    @staticmethod
    async def _pause(seconds: float, stop: asyncio.Event) -> None:
        """Sleep. A backoff is cut short by ``stop`` (unless stopping already: then keep
        draining); the pauses of a working drainer are shorter than the time it would
        take to notice, and a plain sleep costs a fraction of a cancelled wait."""
        if seconds <= PLAIN_SLEEP_S or stop.is_set():
            await asyncio.sleep(seconds)
            return
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(seconds):
                await stop.wait()


def main(
    cfg: Config, seg: Segment, slot: ProcessSlot, ready: Callable[[], None] = lambda: None
) -> int:
    """The drainer's life in its slot: drain until SIGTERM (then deliver what is queued, up
    to ``drain_on_stop_ms``) or SIGINT/SIGQUIT (stop now; the queue keeps what it holds)."""
    try:
        password = fleet_password(cfg)
    except MissingSecret as e:
        raise BootError(str(e)) from None
    store = RedisStore.from_config(cfg.fleet, password, stall_s=cfg.fleet.drainer_stall_s)
    drainer = Drainer(cfg, seg, slot, store)
    ready()

    async def serve() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGTERM, stop.set)
        task = asyncio.current_task()
        assert task is not None
        for sig in (signal.SIGINT, signal.SIGQUIT):
            loop.add_signal_handler(sig, task.cancel)
        try:
            await drainer.run(stop)
        finally:
            await store.close()

    try:
        with contextlib.suppress(asyncio.CancelledError):
            uvloop.run(serve())
    except ConsumerTaken as e:  # a second drainer: say so, without a traceback
        log.error("not draining: %s", e)
        return QUEUE_TAKEN
    return 0


def run_alone(cfg: Config) -> int:
    """``ankusa-shm drainer``: attach to a running service's segment and drain it."""
    with Segment.attach(cfg.server.segment) as seg:
        slot = procs.claim(seg.view, seg.layout, Role.DRAINER)
        try:
            return main(cfg, seg, slot)
        finally:
            slot.release()
