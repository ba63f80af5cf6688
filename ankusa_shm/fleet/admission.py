"""Fleet-scoped admission: one tenant limit and one dedupe window for N hosts.

``admit`` is the request path's way in (then ``settle`` or ``refund`` once the store has
answered). With both scopes ``node`` it is this host's
GCRA table and nothing else. With a fleet scope it makes exactly one store call per hook
(sent once more only if its connection drops under it: ``redis_store``), carrying the
tenant's charge and the dedupe claim together, under the hard budget ``fleet.timeout_ms``.
A call that fails or runs out of budget -- or is not made because the shared breaker is
open -- is answered from this host alone: its own buckets, and for dedupe the store's
local index. A limiter outage never refuses a hook. A store that
answers but refuses writes (full, or a replica) is still asked: it still knows the events
it holds, and only what it cannot record is answered from this host.

A keyed hook is always admitted with its claim, to be settled once its commit is known.
A claim that may exist in Redis is handed back even when its call timed out (the server
may yet run it, after any stall): settling it promotes or releases what is there, and a
no-op costs nothing. A hook admitted while the breaker is open made no call and claims
nothing, but once stored its promote (sent when Redis answers again) puts it in the
fleet's dedupe window all the same. Settling is a push onto the settle queue in the
segment (``settle.Settler``); the drainer process delivers it. Nothing here takes a lock
or waits for another process (a push wakes an asleep drainer, and goes on).
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from dataclasses import dataclass

from ankusa_shm.clock import Clock, monotonic_ns
from ankusa_shm.config import Config, Source
from ankusa_shm.fleet import redis_store
from ankusa_shm.fleet.redis_client import REFUSED_HINT, RedisError, refused
from ankusa_shm.fleet.redis_store import RedisStore, WritesRefused
from ankusa_shm.fleet.settle import NO_TOKEN, Claim, Settler, stored_claims
from ankusa_shm.hooks import Claimed, CommitResult, Envelope
from ankusa_shm.limits import Limit
from ankusa_shm.shm.breaker import Breaker, Permit, Policy
from ankusa_shm.shm.counters import Counter
from ankusa_shm.shm.degraded import Degraded
from ankusa_shm.shm.gcra import GcraTable
from ankusa_shm.shm.histograms import Histogram, HistogramRow
from ankusa_shm.shm.procs import ProcessSlot
from ankusa_shm.shm.segment import Segment
from ankusa_shm.shm.settle_queue import SettleQueue

log = logging.getLogger("ankusa_shm.fleet")

__all__ = ["Admit", "Admitted", "Claim", "DedupePending", "Duplicate", "Fleet", "RateLimited"]


@dataclass(frozen=True, slots=True)
class Admit:
    claim: Claim | None


@dataclass(frozen=True, slots=True)
class Duplicate:
    hook_id: str


@dataclass(frozen=True, slots=True)
class RateLimited:
    retry_ms: int


@dataclass(frozen=True, slots=True)
class DedupePending:
    retry_ms: int


Admitted = Admit | Duplicate | RateLimited | DedupePending

_TALLY = {
    Admit: Counter.ADMIT_OK,
    Duplicate: Counter.ADMIT_DUPLICATE,
    RateLimited: Counter.ADMIT_RATE_LIMITED,
    DedupePending: Counter.ADMIT_DEDUPE_PENDING,
}
_FALLBACK = {"rate_limit": Counter.FALLBACK_RATE_LIMIT, "dedupe": Counter.FALLBACK_DEDUPE}


class Fleet:
    def __init__(
        self,
        cfg: Config,
        seg: Segment,
        slot: ProcessSlot,
        store: RedisStore | None,
        clock: Clock = monotonic_ns,
    ) -> None:
        self._kinds = cfg.fleet_kinds
        if self._kinds and store is None:
            raise ValueError(f"fleet scope for {', '.join(self._kinds)} needs a store")
        self._store = store
        self._rate_fleet = "rate_limit" in self._kinds
        self._dedupe_fleet = "dedupe" in self._kinds
        self._limits = cfg.rate_limits
        self._overrides: dict[str, Limit] = {}  # set at run time, ahead of the config
        f = cfg.fleet
        self._budget_s = f.timeout_ms / 1000
        self._deadline_s = f.call_deadline_s
        self._pending_ttl_ms = f.pending_ttl_ms
        self._failure: BaseException = TimeoutError()  # why the last failed call failed
        self._clock = clock
        self._row = slot.counters
        # How long each store call took, against the budget it had: kept with the
        # request figures (``server.request_metrics``).
        self._histograms = (
            HistogramRow(seg.view, seg.layout, slot.index) if cfg.server.request_metrics else None
        )
        self._breaker = Breaker(
            seg.view,
            seg.layout,
            Policy(
                failure_rate=f.breaker_failure_rate,
                min_calls=f.breaker_min_calls,
                window_ms=f.breaker_window_ms,
                open_ms=f.breaker_open_ms,
                probe_timeout_ms=f.probe_timeout_ms,
            ),
            self._row,
        )
        self._degraded = Degraded(seg.view, seg.layout)
        self._stable_ms = f.breaker_window_ms  # answered this long: said to be back
        self._gcra = GcraTable(seg.view, seg.buf, seg.layout, self._row)
        self._settler = Settler(SettleQueue(seg.view, seg.buf, seg.layout), self._row, clock)

    # -- the request path -----------------------------------------------------------------

    async def admit(self, source: Source, envelope: Envelope) -> Admitted:
        """Charge the tenant and claim the event key, in whatever scope the config says."""
        now = self._clock()
        limit = self._limit(source.tenant)
        event_key = envelope.event_key if self._dedupe_fleet else None
        if event_key is None and not self._rate_fleet:
            # Nothing for the fleet to do: both scopes node, or a keyless hook whose rate
            # limit is the host's. No store call, no breaker sample.
            return self._tally(self._take_local(source.tenant, limit, now, None))
        assert self._store is not None
        now_ms = now // 1_000_000
        permit = self._breaker.allow(now_ms)
        claim = None
        if event_key is not None:
            key = self._store.dedupe_key(source.tenant, source.id, event_key)
            # Unique, not secret: ``random`` is reseeded in every forked child, and a
            # system call per hook would hand the GIL to the store's writer thread. With
            # no call to make, nothing is claimed, but a promote will be due.
            token = random.getrandbits(128).to_bytes(16) if permit.call else NO_TOKEN
            claim = Claim(key, token, source.dedupe_ttl_s * 1000)
        failed: BaseException | None = None  # no call made: the breaker is open
        if permit.call:
            answer = await self._ask_store(permit, source.tenant, limit, claim, now)
            if answer is not None:
                return self._tally(answer)
            failed = self._failure  # the claim's moment stays unknown
        self._fall_back(failed, now_ms, claim is not None)
        return self._tally(self._take_local(source.tenant, limit, now, claim))

    def refund(self, source: Source) -> None:
        """Give back the charge of an admitted hook the store found to be a duplicate, as
        a fleet bucket is never charged for one: with a node-scope rate limit only (a fleet
        bucket's would be one more call)."""
        if not self._rate_fleet:
            self._gcra.refund(source.tenant, self._limit(source.tenant), self._clock() // 1000)

    def settle(self, claim: Claim | None, result: CommitResult) -> None:
        """Queue the outcome of the commit that followed ``admit`` (``Settler.settle``).
        Never blocks, never raises: a full queue is a counted drop."""
        self._settler.settle(claim, result)

    def promote(self, claim: Claim | None, hook_id: str) -> None:
        self._settler.promote(claim, hook_id)

    def queue_promotes(self, hooks: list[Claimed], wall_ms: int) -> int:
        """Queue a promote for each hook this host stored that is still in its window
        (``stored_claims``): the recovery after a worker died between a commit and its
        settle, which would leave the claim pending and let a retry on another host store
        the event again. How many were queued. (Through the settle queue, as every
        promote of a worker goes; ``fleet.repromote`` is the drainer's, sent to Redis
        itself, for a whole window at a pace.)"""
        if not self._dedupe_fleet or self._store is None:
            return 0
        claims = stored_claims(hooks, wall_ms, self._store.dedupe_key)
        for claim, hook_id in claims:
            self._settler.promote(claim, hook_id)
        self._row.add(Counter.REPROMOTED, len(claims))
        return len(claims)

    def release(self, claim: Claim | None) -> None:
        self._settler.release(claim)

    def set_overrides(self, overrides: dict[str, Limit]) -> None:
        """Tenant limits set at run time (the admin API's), replacing the last set; a
        tenant not in it goes back to its configured limit."""
        self._overrides = dict(overrides)

    def overridden(self, tenant: str) -> bool:
        return tenant in self._overrides

    async def reset_tenant(self, tenant: str) -> None:
        """Forget the tenant's buckets, this host's and the fleet's (its limit changed).
        Best effort: a store that does not answer within the budget is left alone."""
        self._gcra.reset(tenant)
        if self._rate_fleet and self._store is not None:
            try:
                async with asyncio.timeout(self._budget_s):
                    await self._store.reset_tenant(tenant)
            except (TimeoutError, RedisError) as e:
                log.info("fleet bucket of %s not reset: %s", tenant, str(e) or type(e).__name__)

    def degraded(self, kind: str) -> bool:
        """Whether hooks of ``kind`` are being answered from this host alone right now."""
        return self._degraded.is_set(kind)

    def state(self) -> str:
        """closed | open | probing, or down when no fleet scope is configured or the store
        is not running in this process."""
        if not self._kinds or self._store is None:
            return "down"
        return self._breaker.state().name.lower()

    async def close(self) -> None:
        if self._store is not None:
            await self._store.close()
            self._store = None

    # -- inside -----------------------------------------------------------------------------

    async def _ask_store(
        self, permit: Permit, tenant: str, limit: Limit, claim: Claim | None, now: int
    ) -> Admitted | None:
        """The one store call; None if it failed or ran out of budget."""
        assert self._store is not None
        now_ms = now // 1_000_000
        try:
            verdict, value = await self._store.admit(
                tenant,
                limit if self._rate_fleet else None,
                claim.key if claim else None,
                claim.token if claim else b"",
                self._pending_ttl_ms,
                time.monotonic() + self._deadline_s,
            )
            outcome = Counter.STORE_OK
        except TimeoutError as e:
            outcome, self._failure = Counter.STORE_TIMEOUT, e
        except RedisError as e:
            outcome, self._failure = Counter.STORE_ERROR, e
        ended = self._clock()
        self._row.add(outcome)
        if self._histograms is not None:
            self._histograms.observe(Histogram.FLEET_CALL, ended - now)
        ok = outcome is Counter.STORE_OK
        if permit.probe:
            self._breaker.finish_probe(permit, ok, now_ms)
        else:
            self._breaker.record(ok, now_ms)
        if not ok:
            return None
        if verdict == redis_store.UNRECORDED:  # it reads, but writes nothing: see admit.lua
            assert isinstance(value, bytes)
            writes_refused = WritesRefused(value.decode(errors="replace"))
            self._fall_back(writes_refused, now_ms, claim is not None)
            if claim is not None:  # nothing of it in Redis; its promote will say it is stored
                claim = Claim(claim.key, NO_TOKEN, claim.ttl_ms)
            return self._take_local(tenant, limit, now, claim)
        if claim is not None:  # answered: the claim was written, if at all, before now
            claim = Claim(claim.key, claim.token, claim.ttl_ms, ended // 1_000_000)
        if self._breaker.closed():  # a late success while open changes nothing
            for kind in self._kinds:
                if self._degraded.answered(kind, ended // 1_000_000, self._stable_ms):
                    log.info("the fleet store answers again: answering %s fleet-wide", kind)
        if verdict == redis_store.DUPLICATE:
            assert isinstance(value, bytes)
            return Duplicate(value.decode())
        if verdict == redis_store.PENDING:
            return DedupePending(int(value))
        if verdict == redis_store.LIMITED:
            return RateLimited(int(value))
        if self._rate_fleet:
            return Admit(claim)
        return self._take_local(tenant, limit, now, claim)

    def _limit(self, tenant: str) -> Limit:
        return self._overrides.get(tenant) or self._limits.limit_for(tenant)

    def _take_local(self, tenant: str, limit: Limit, now: int, claim: Claim | None) -> Admitted:
        """This host's bucket decides; a refused hook gives back whatever it claimed."""
        wait = self._gcra.take(tenant, limit, now // 1000)
        if wait:
            self.release(claim)
            return RateLimited(wait)
        return Admit(claim)

    def _fall_back(self, failed: BaseException | None, now_ms: int, keyed: bool) -> None:
        """Count the hook as answered node-local, for each fleet kind it had (a hook with
        no event key had no dedupe to answer); ``failed`` is why its call failed, None if
        the breaker let none be made."""
        for kind in self._kinds:
            if kind == "dedupe" and not keyed:
                continue
            self._row.add(_FALLBACK[kind])
            if self._degraded.failed(kind, now_ms):
                why = self._why(failed)
                if refused(failed or self._failure):  # a config to fix: an error, with how
                    log.error(
                        "%s: answering %s node-local on this host; %s", why, kind, REFUSED_HINT
                    )
                else:
                    log.warning("%s: answering %s node-local on this host", why, kind)

    def _why(self, failed: BaseException | None) -> str:
        if failed is None:  # and the call that last failed, since the open breaker hides it
            return f"the fleet store breaker is open ({self._why(self._failure)})"
        if isinstance(failed, WritesRefused):
            return (
                f"the fleet store refuses writes ({failed}), and still answers reads: resends "
                "of events it holds are duplicates as ever, but it records no new claim"
            )
        if isinstance(failed, TimeoutError):
            return f"the last fleet store call had no answer within {self._budget_s * 1000:g} ms"
        return f"the last fleet store call failed ({failed})"

    def _tally(self, result: Admitted) -> Admitted:
        self._row.add(_TALLY[type(result)])
        if isinstance(result, RateLimited):
            self._row.add(Counter.RATE_LIMIT_REJECTED)
        return result
