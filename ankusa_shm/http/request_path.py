"""The request path: ``POST /hooks/{source}`` from parsed request to answer.

Route, verify, derive the event key, admit, commit, settle, answer -- in that order, so a
forgery costs the tenant nothing and a hook is answered 201 only once it is durable. The
settle step -- a push onto the shared-memory queue, never a wait on Redis -- is made by the
store's writer thread the moment the hook's transaction ends, so a worker killed after a
commit has not left its claim pending.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from ankusa_shm.config import Config, Source
from ankusa_shm.fleet.admission import Admit, DedupePending, Duplicate, Fleet, RateLimited
from ankusa_shm.hooks import (
    AlreadyStored,
    CommitResult,
    Committed,
    Envelope,
    NewHook,
    new_hook_id,
)
from ankusa_shm.http.event_key import KeyFinder, key_finder_for
from ankusa_shm.http.observe import Observer
from ankusa_shm.http.protocol import Request, Response, error_body
from ankusa_shm.http.verify import Verifier, verifier_for
from ankusa_shm.shm.counters import Counter, CounterRow
from ankusa_shm.store.writer import Writer

PREFIX = b"/hooks/"

# Headers not kept with a stored hook: credentials, and how this one connection was framed.
_NOT_KEPT = frozenset(
    {
        "authorization",
        "proxy-authorization",
        "cookie",
        "connection",
        "keep-alive",
        "transfer-encoding",
        "te",
        "upgrade",
        "content-length",
        "expect",
    }
)


def _fixed(status: int, error: str, *headers: tuple[bytes, bytes]) -> Response:
    return Response(status, error_body(error), headers)


NOT_FOUND = _fixed(404, "not_found")
UNKNOWN_SOURCE = _fixed(404, "unknown_source")
NOT_ALLOWED = _fixed(405, "method_not_allowed", (b"allow", b"POST"))
BAD_SIGNATURE = _fixed(401, "bad_signature")
STORE_UNAVAILABLE = _fixed(503, "store_unavailable", (b"retry-after", b"1"))


def accepted(hook_id: str, duplicate: bool = False) -> Response:
    tail = b'","duplicate":true}' if duplicate else b'"}'
    return Response(201, b'{"status":"accepted","id":"' + hook_id.encode() + tail)


def retry_later(status: int, error: str, retry_ms: int) -> Response:
    seconds = max(1, -(-retry_ms // 1000))
    return _fixed(status, error, (b"retry-after", str(seconds).encode()))


@dataclass(frozen=True)
class Route:
    """One source, with what its requests need precomputed at start."""

    source: Source
    verifier: Verifier | None
    key_finder: KeyFinder | None


def routes(cfg: Config) -> dict[bytes, Route]:
    """Every source's route, secrets read now (``MissingSecret`` is a boot failure)."""
    return {s.id.encode(): Route(s, verifier_for(s), key_finder_for(s)) for s in cfg.sources}


class RequestPath:
    def __init__(
        self,
        cfg: Config,
        fleet: Fleet,
        writer: Writer,
        row: CounterRow,
        observer: Observer | None = None,
    ) -> None:
        self._routes = routes(cfg)
        self._fleet = fleet
        self._writer = writer
        self._row = row
        self._observer = observer

    async def __call__(self, req: Request) -> Response:
        if not req.path.startswith(PREFIX):
            return NOT_FOUND
        if req.method != b"POST":
            return NOT_ALLOWED
        route = self._routes.get(req.path[len(PREFIX) :])
        if route is None:
            return UNKNOWN_SOURCE
        self._row.add(Counter.REQUESTS)
        headers = dict(req.headers)
        now_s = time.time()
        if route.verifier is not None and not route.verifier.verify(headers, req.body, now_s):
            return BAD_SIGNATURE
        key = route.key_finder.find(headers, req.body) if route.key_finder else None
        source = route.source
        verdict = await self._fleet.admit(source, Envelope(key))
        if isinstance(verdict, Duplicate):
            return accepted(verdict.hook_id, duplicate=True)
        if not isinstance(verdict, Admit):
            # Refused, unless this host holds the event already: its resend is answered as
            # the duplicate it is, whatever the tenant's rate or the fleet's claim.
            first = await self._writer.stored(source.id, key) if key is not None else None
            if first is not None:
                self._row.add(Counter.STORE_DUPLICATE)
                return accepted(first, duplicate=True)
            if isinstance(verdict, RateLimited):
                return retry_later(429, "rate_limited", verdict.retry_ms)
            assert isinstance(verdict, DedupePending)
            return retry_later(409, "dedupe_pending", verdict.retry_ms)
        wall_ms = int(now_s * 1000)
        hook = NewHook(  # id, tenant, source, event key, ttl, received, headers, body
            new_hook_id(wall_ms),
            source.tenant,
            source.id,
            key,
            source.dedupe_ttl_s,
            wall_ms,
            tuple([p for p in req.headers if p[0] not in _NOT_KEPT]),
            req.body,
        )
        began = time.monotonic_ns()
        result: CommitResult = await self._writer.commit(hook, verdict.claim)  # and settles it
        if self._observer is not None:
            self._observer.committed(time.monotonic_ns() - began)
        if isinstance(result, Committed):
            return accepted(result.hook_id)
        if isinstance(result, AlreadyStored):
            self._fleet.refund(source)
            self._row.add(Counter.STORE_DUPLICATE)
            return accepted(result.hook_id, duplicate=True)
        return STORE_UNAVAILABLE
