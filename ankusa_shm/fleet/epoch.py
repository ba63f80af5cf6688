"""Notice the fleet store losing its data, and give it back this host's hooks.

A Redis restarted without persistence, flushed, or wiped by a replica's full resync
forgets every committed dedupe key at once, and answers every call afterwards as if
nothing had happened: a resend of an event this host stored is then stored again by
whichever host it reaches. So the fleet keeps one key without a TTL, ``<prefix>:epoch``,
set by the first host to find it missing, and each host's drainer reads it every
``CHECK_S``. A value other than the one it last read means the data it stood beside is
gone; the drainer then promotes again, from this host's store, every keyed hook still in
its dedupe window, newest first and paced (``repromote``): the promotes a crash recovery
sends, idempotent and never over another host's committed hook.

The values last read are kept in the segment, so a drainer or supervisor restarted
meanwhile still compares with them. A new segment starts with those the last clean stop
kept in the store (``seed``, ``store.settled``); without them, a host started on a new
segment promotes its window anyway (``repromote.Drops``).

The same promote carries this host's window into a fleet store it did not settle into
before: ``fleet.redis_url`` or ``fleet.key_prefix`` changed, on a reload or a restart. A
reload replaces the drainer after the workers, so the new workers' first promotes went to
the old store; and whatever this host stored before is not in the new one.

On a Redis Cluster there is one epoch key in each 64th of the slot space,
``<prefix>:epoch:{<tag>}``, so that a node that loses its data alone loses one of them
too (a node serving fewer than 512 slots in a row may hold none).
"""

from __future__ import annotations

import logging
import time

from ankusa_shm.fleet import repromote
from ankusa_shm.fleet.redis_client import RedisError
from ankusa_shm.fleet.redis_store import RedisStore
from ankusa_shm.fleet.seen import Seen
from ankusa_shm.shm.blob import Blob

log = logging.getLogger("ankusa_shm.drainer")

CHECK_S = 1.0


class Epoch:
    def __init__(
        self, store: RedisStore, blob: Blob, promote: repromote.Repromoter, timeout_s: float
    ) -> None:
        self._store = store
        self._blob = blob
        self._promote = promote
        self._timeout_s = timeout_s

    def seed(self, seen: Seen) -> bool:
        """Start from ``seen`` (a new segment's, from the store) if nothing was read yet:
        the first check then compares with it instead of only keeping what it reads.
        Whether it did."""
        current = Seen.of(self._blob.read())
        if current.values or current.owed:
            return False
        self._blob.write(seen.doc())
        return True

    def claim(self) -> None:
        """Before the first delivery: if this is a store the host has not settled into
        before, say so in the segment at once, as owing it the window. The promote of the
        window comes with the next check and takes a while (a second for 40,000 hooks):
        a drainer stopped before it is done (a reload back, a kill) left the segment
        naming the old store, and the next one, on the old store again, took the hooks
        settled into this one meanwhile for settled there."""
        seen = Seen.of(self._blob.read())
        if not seen.owed and self._moved(seen):  # one owed already is owed to this one too
            self._blob.write(Seen(self._store.server, {}, owed=True).doc())

    async def check(self, evicting: bool = False) -> None:
        """Read the epoch keys; if one changed, or they are another store's than those
        read before, promote this host's window (again). A server that does not answer
        is left for the next check, and so is a promote that failed: the new values are
        kept only once every promote went out. A key not read before (a first check, a
        key new to this build) is only kept. On a server that ``evicting`` (its policy
        may evict keys), a changed epoch may be the key evicted, not the data lost, and
        promoting a whole window into a full server would evict more: it is said, and
        nothing promoted."""
        try:
            values = await self._store.epoch(time.monotonic() + self._timeout_s)
        except (TimeoutError, RedisError):
            return
        seen = Seen.of(self._blob.read())
        moved = "its promote after a move not done yet" if seen.owed else self._moved(seen)
        if moved:
            log.warning(
                "this host now settles into a fleet store it did not before (%s): "
                "promoting its hooks in their dedupe window into it",
                moved,
            )
            sent = await self._promote.window()
            if sent is None:
                return
            log.info("promoted %d hooks stored on this host into the new fleet store", sent)
            self._blob.write(Seen(self._store.server, values).doc())  # owed no more
            return
        current = {**seen.values, **values}  # a key its server refused keeps its value
        if current == seen.values and seen.server == self._store.server:
            return
        lost = [k for k, v in values.items() if k in seen.values and seen.values[k] != v]
        if lost and evicting:
            log.warning(
                "the fleet store's epoch key changed, on a Redis that may evict keys: not "
                "promoting this host's hooks again (set maxmemory-policy noeviction)"
            )
        elif lost:
            log.warning(
                "the fleet store lost its data (its epoch key changed%s: a restart without "
                "persistence, a flush, or a replica's resync); promoting this host's "
                "hooks in their dedupe window again",
                f", {lost[0]} among {len(lost)}" if len(seen.values) > 1 else "",
            )
            sent = await self._promote.window()
            if sent is None:
                return
            log.info("promoted again %d hooks stored on this host", sent)
        self._blob.write(Seen(self._store.server, current).doc())

    def _moved(self, seen: Seen) -> str:
        """Why the store is not the one ``seen`` was read from ("" if it is): another
        server (``fleet.redis_url`` changed), or other keys (``fleet.key_prefix``). The
        hooks this host settled into that one are not in this one, and a resend of one
        to another host on it would be stored again."""
        if not seen.values:
            return ""
        if seen.server and self._store.server and seen.server != self._store.server:
            return f"{seen.server} before, {self._store.server} now"
        if self._store.epoch_names.isdisjoint(seen.values):
            return "its keys have another prefix"
        return ""
