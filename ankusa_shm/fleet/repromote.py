"""Promote again, straight to Redis, hooks this host stored that the fleet lost track of.

Two things make the fleet forget hooks this host's store still lists: Redis losing its
data (``epoch``), and a settle queue that was full. A promote pushed onto a full ring is
dropped and counted (``fleet_settle_dropped``): its key stays a pending claim, or is
absent if the hook was admitted while the breaker was open, and once the claim expires a
resend of the event to another host is stored again. The ring fills whenever Redis fails
for longer than ``fleet.settle_queue_size`` hooks take to arrive -- under a minute at a
thousand a second -- so an outage of any length would otherwise leave such hooks behind.

Both are mended from the store: its dedupe index lists every keyed hook with the id it
was stored under, newest first, and a promote is idempotent and never goes over another
host's committed hook, so promoting a hook that is already settled changes nothing.
``Drops`` watches the drop count and, once deliveries work again and the queue has room,
promotes every hook stored since the drops began.
"""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path

from ankusa_shm import clock
from ankusa_shm.config import Config
from ankusa_shm.fleet.redis_client import RedisError
from ankusa_shm.fleet.redis_store import RedisStore
from ankusa_shm.fleet.settle import stored_claims
from ankusa_shm.hooks import Claimed
from ankusa_shm.shm.counters import Counter, CounterRow, totals
from ankusa_shm.shm.segment import Segment
from ankusa_shm.shm.settle_queue import Op, Record, SettleQueue
from ankusa_shm.store import readers
from ankusa_shm.store.schema import StoreError
from ankusa_shm.store.settled import Settled

log = logging.getLogger("ankusa_shm.drainer")

PROMOTES_PER_CALL = 1_000
PAGE = 10_000  # hooks read from the store at a time
# At most this many promotes a second from one host: after Redis lost its data every host
# promotes its whole window at once, and each host's admits share that Redis meanwhile
# (a promote costs it about 3 us: a fleet of ten at this pace keeps it 60 % busy).
PROMOTES_PER_S = 20_000
# Between a hook's receipt (its ``received_ms``) and its promote's push: the fleet call's
# budget, the wait for the store's lock, and room to spare.
SLACK_MS = 5_000


class Repromoter:
    """Promotes this host's stored hooks again, straight to Redis: those received since a
    moment, or its whole dedupe window. Where dedupe is not fleet scope no hook of this
    host has a key in Redis, and nothing is sent."""

    def __init__(self, cfg: Config, store: RedisStore, row: CounterRow, timeout_s: float) -> None:
        self._store = store
        self._row = row
        self._timeout_s = timeout_s
        self._path = cfg.store.path
        self._dedupe = "dedupe" in cfg.fleet_kinds
        self._window_ms = cfg.dedupe_window_s * 1000

    async def window(self, after_seq: int = 0, before_seq: int = 0) -> int | None:
        """``since`` the start of the longest dedupe window."""
        return await self.since(clock.wall_ms() - self._window_ms, after_seq, before_seq)

    async def since(
        self, since_wall_ms: int, after_seq: int = 0, before_seq: int = 0
    ) -> int | None:
        """Promote every keyed hook received since ``since_wall_ms`` (committed after seq
        ``after_seq``, and before ``before_seq`` if not 0) and still in its dedupe window,
        newest first (the likeliest to be sent again), ``PROMOTES_PER_CALL`` a call and
        at most ``PROMOTES_PER_S``, counted in ``fleet_repromoted``. How many were sent;
        None if the store could not be read or a call failed (said in the log), to be
        tried again later."""
        # No store yet (a first start whose workers have not created it), or nothing below
        # the first seq: a new segment made on an empty store, whose tables its workers
        # may still be creating.
        if not self._dedupe or before_seq == 1 or not Path(self._path).exists():
            return 0
        sent = 0
        below: int | None = before_seq or readers.NEWEST
        while below is not None:
            try:
                hooks, below = await asyncio.to_thread(
                    readers.claimed_page, self._path, since_wall_ms, below, PAGE, after_seq
                )
            except StoreError as e:
                log.warning("cannot read the store to promote its hooks again: %s", e)
                return None
            sent_now = await self._send(hooks, sent)
            if sent_now is None:
                return None
            sent += sent_now
        return sent

    async def _send(self, hooks: list[Claimed], sent: int) -> int | None:
        """One page's promotes, paced; how many, or None if a call failed."""
        wall_ms, now_ms = clock.wall_ms(), clock.monotonic_ms()
        records = [
            Record(Op.PROMOTE, c.key, c.token, hook_id.encode(), c.ttl_ms, c.claimed_ms, now_ms)
            for c, hook_id in stored_claims(hooks, wall_ms, self._store.dedupe_key)
        ]
        for i in range(0, len(records), PROMOTES_PER_CALL):
            part = records[i : i + PROMOTES_PER_CALL]
            began = time.monotonic()
            try:
                await self._store.settle(part, now_ms, began + self._timeout_s)
            except (TimeoutError, RedisError) as e:
                log.warning("promoting this host's hooks again stopped after %d: %s", sent + i, e)
                return None
            self._row.add(Counter.REPROMOTED, len(part))
            await asyncio.sleep(max(0.0, began + len(part) / PROMOTES_PER_S - time.monotonic()))
        return len(records)


class Drops:
    """Notices settle operations dropped for a full queue, and promotes again the hooks
    stored since the drops began. Which operations were dropped is not known, only how
    many and roughly when, so every hook stored since is promoted: a superset, harmless.

    What is made good is kept in the segment, for the next drainer: the drops as a count
    (``fleet_settle_drops_recovered``), and the moment before which every drop is made
    good in the queue (``SettleQueue.mended_ms``), moved on at every look that finds none
    left. A new segment does not know that moment -- a reboot emptied ``/dev/shm``, or an
    upgrade replaced a segment of another layout, and whatever its queue held is gone,
    promotes that waited out a Redis outage included -- so there the hooks stored since
    the last stop that left all of them settled are promoted, once (``settled``, from
    ``store.settled``), or the whole dedupe window if there was none; only those stored
    before the segment was made (``SettleQueue.first_seq``), whose settles went through
    the queue lost. On a first start that is an empty store."""

    def __init__(self, cfg: Config, seg: Segment, row: CounterRow, promote: Repromoter) -> None:
        self._seg = seg
        self._queue = SettleQueue(seg.view, seg.buf, seg.layout)
        self._row = row
        self._promote = promote
        self._slack_ms = cfg.fleet.timeout_ms + cfg.store.lock_timeout_ms + SLACK_MS
        self._settled: Settled | None = None

    def settled(self, mark: Settled) -> None:
        """A new segment's: every hook up to ``mark.seq`` is settled in Redis."""
        self._settled = mark

    def unmended(self) -> int:
        t = totals(self._seg.view, self._seg.layout)
        return t[Counter.SETTLE_DROPPED] - t[Counter.SETTLE_DROPS_RECOVERED]

    async def check(self, delivering: bool) -> None:
        """Called every second by the drainer, the queue's consumer. ``delivering``: its
        deliveries work and the queue has room again, so promoting now is neither refused
        nor dropped behind. The moment is read before the counts: a drop the counts miss
        came after it."""
        wall_ms = clock.wall_ms()
        mended_ms = self._queue.mended_ms()
        unmended = self.unmended()
        if unmended <= 0 and mended_ms:
            self._queue.set_mended_ms(wall_ms)
            return
        if not delivering:
            return
        if mended_ms:
            sent = await self._promote.since(mended_ms - self._slack_ms)
            span = f"in the {(wall_ms - mended_ms + self._slack_ms) / 1000:.0f} s since"
        elif self._settled is not None:
            sent = await self._promote.window(self._settled.seq, self._queue.first_seq())
            at = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(self._settled.at_ms / 1000))
            span = f"since its last stop that left every hook settled ({at})"
        else:
            sent = await self._promote.window(before_seq=self._queue.first_seq())
            span = "in their dedupe window"
        if sent is None:
            return
        self._queue.set_mended_ms(wall_ms)
        if unmended > 0:
            self._row.add(Counter.SETTLE_DROPS_RECOVERED, unmended)
            log.warning(
                "the settle queue had dropped %d operations for want of room; promoted again"
                " the %d hooks this host stored %s",
                unmended,
                sent,
                span,
            )
        elif sent:
            log.info(
                "a new segment (what an old one held queued is unknown): promoted again the"
                " %d hooks this host stored %s",
                sent,
                span,
            )
