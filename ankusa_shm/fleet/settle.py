"""The producer side of settling: what a claim is, and how the outcome of a hook's commit
becomes one record on the settle queue.

A claim is *pending* in Redis until the hook it guards is durable. Settling it never waits
on Redis: ``Settler`` pushes a promote (the hook is stored, under this id) or a release
(nothing was stored) onto the ring in the segment and returns; the drainer delivers it.
A full ring is a counted drop, never a wait: a dropped promote is made good later by the
drainer, which promotes again from the store the hooks stored since the drops began
(``repromote``); a dropped release leaves the key pending until its TTL (senders get 409
and retry). Neither loses a hook.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ankusa_shm.clock import Clock
from ankusa_shm.hooks import AlreadyStored, Claimed, CommitResult, Committed
from ankusa_shm.shm.counters import Counter, CounterRow
from ankusa_shm.shm.settle_queue import Op, Pushed, Record, RecordTooLarge, SettleQueue

log = logging.getLogger("ankusa_shm.fleet")

UNKNOWN = 0
NO_TOKEN = bytes(16)  # a claim no call made: nothing to release, only a promote to send


@dataclass(slots=True)
class Claim:
    """A dedupe key this host may hold as pending, and the token that proves it. Never
    changed once made (not frozen only because that triples ``__init__``'s cost, and
    admission makes two per hook).

    ``claimed_ms`` is the latest moment (this host's monotonic ms) at which the store can
    have written the claim: when its call was answered. A call that timed out or failed
    may still run on the server after any stall, so its claim's moment is ``UNKNOWN`` and
    its release is never taken for expired.

    A hook admitted with no call at all (the breaker open) has a claim too, with
    ``NO_TOKEN``: nothing of it is in Redis to release, but once it is stored its promote
    puts it in the fleet's dedupe window when Redis answers again, so a resend of the same
    event to another host is a duplicate there, not a second copy."""

    key: bytes
    token: bytes
    ttl_ms: int  # the source's dedupe window: how long a promoted key lives
    claimed_ms: int = UNKNOWN


def stored_claims(
    hooks: Sequence[Claimed], wall_ms: int, key_of: Callable[[str, str, bytes], bytes]
) -> list[tuple[Claim, str]]:
    """The claim to promote each hook under, with its id, for those still in their dedupe
    window: what a recovery sends again. A promote needs no token and never overwrites
    another host's committed hook, so promoting what is already settled changes nothing."""
    return [
        (Claim(key_of(tenant, source, key), NO_TOKEN, expires_ms - wall_ms), hook_id)
        for tenant, source, key, hook_id, expires_ms in hooks
        if expires_ms > wall_ms
    ]


class Settler:
    """Turns claims and commit results into queued promotes and releases."""

    def __init__(self, queue: SettleQueue, row: CounterRow, clock: Clock) -> None:
        self._queue = queue
        self._row = row
        self._clock = clock

    def settle(self, claim: Claim | None, result: CommitResult) -> None:
        """Durable (committed now, or known to this host's index) promotes the claim under
        that hook id; anything else releases it."""
        if claim is None:
            return
        if isinstance(result, Committed | AlreadyStored):
            self.promote(claim, result.hook_id)
        else:
            self.release(claim)

    def promote(self, claim: Claim | None, hook_id: str) -> None:
        if claim is not None:
            self._push(Op.PROMOTE, claim, hook_id.encode())

    def release(self, claim: Claim | None) -> None:
        if claim is not None and claim.token != NO_TOKEN:
            self._push(Op.RELEASE, claim, b"")

    def _push(self, op: Op, claim: Claim, hook_id: bytes) -> None:
        now_ms = self._clock() // 1_000_000
        rec = Record(op, claim.key, claim.token, hook_id, claim.ttl_ms, claim.claimed_ms, now_ms)
        try:
            pushed = self._queue.push(rec)
        except RecordTooLarge as e:  # the config's limits forbid it; a bug if seen
            log.error("settle operation dropped: %s", e)
            pushed = Pushed.FULL
        if pushed is Pushed.OK:
            self._row.add(Counter.SETTLE_ENQUEUED)
        elif pushed is Pushed.FULL:
            self._row.add(Counter.SETTLE_DROPPED)
