"""The admin API's routes, behind one bearer token when the config names one.

Without a token (only on loopback) the API answers only what a browser cannot have been
made to send: a loopback ``Host`` (a DNS-rebound name reaching 127.0.0.1 is refused, so a
web page cannot read hooks through it) and no ``Origin`` but its own (a page elsewhere
cannot move a consumer's cursor with a form's POST). Curl, Prometheus and health agents
send neither.

JSON everywhere but ``/metrics``. Health and readiness are for load balancers and
orchestrators; the tenant routes change a tenant's rate limit at run time (stored, then
published to every worker through the segment); the consumer routes are in
``consumer_api``. A store that cannot answer is a 503, never a crash: the file may not
exist yet when a worker has not created it.
"""

from __future__ import annotations

import asyncio
import hmac
import ipaddress
import json
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

from ankusa_shm import metrics, overrides
from ankusa_shm.admin.consumer_api import ConsumerApi, Reply
from ankusa_shm.admin.stores import StoreCalls
from ankusa_shm.clock import monotonic_ms
from ankusa_shm.config import Config
from ankusa_shm.fleet.admission import Fleet
from ankusa_shm.http.protocol import Request, Response
from ankusa_shm.shm import procs
from ankusa_shm.shm.pids import pid_alive
from ankusa_shm.shm.segment import Segment
from ankusa_shm.store.control import Control
from ankusa_shm.store.schema import StoreError

log = logging.getLogger("ankusa_shm.admin")

PROBE_CACHE_S = 0.5  # a scrape storm on /readyz costs one commit per half second

Handler = Callable[[Request, list[str]], Awaitable[Response]]


def reply(status: int, doc: dict[str, Any], *headers: tuple[bytes, bytes]) -> Response:
    return Response(status, json.dumps(doc, separators=(",", ":")).encode(), headers)


NOT_LOCAL = (
    "without an admin token, only requests to a loopback host (localhost, 127.0.0.1, [::1])"
    " and from no other origin are answered"
)


def _header(req: Request, name: str) -> str:
    return next((v for k, v in req.headers if k == name), "")


def _local(req: Request) -> bool:
    """Sent to this listener by a local client, not by a browser for another site."""
    host = _header(req, "host")
    origin = _header(req, "origin")
    return _loopback(host) and (not origin or origin.lower() == f"http://{host}".lower())


def _loopback(host: str) -> bool:
    """``host`` (a Host field: a name or address, then maybe a port) names this machine's
    loopback. An HTTP/1.0 request may have none: it cannot have been rebound."""
    if not host:
        return True
    name = host[1:].partition("]")[0] if host.startswith("[") else host.rpartition(":")[0] or host
    if name.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


class StoreProbe:
    """Readiness's store check: a real commit, its outcome kept ``PROBE_CACHE_S``, and
    one probe at a time however many ask."""

    def __init__(self, store: StoreCalls) -> None:
        self._store = store
        self._at = float("-inf")
        self._error: str | None = None
        self._running: asyncio.Task[str | None] | None = None

    async def error(self) -> str | None:
        """None if the store commits, else what is wrong."""
        if time.monotonic() - self._at < PROBE_CACHE_S:
            return self._error
        if self._running is None:
            self._running = asyncio.get_running_loop().create_task(self._probe())
        return await asyncio.shield(self._running)

    async def _probe(self) -> str | None:
        error: str | None = "the probe did not finish"
        try:
            await self._store.write(Control.probe)
            error = None
        except StoreError as e:
            error = str(e)
        except Exception as e:  # never a probe that fails every later one with it
            log.exception("the store's readiness probe failed")
            error = f"{self._store.path}: cannot write: {e}"
        finally:
            self._at, self._error, self._running = time.monotonic(), error, None
        return error


class App:
    def __init__(
        self,
        cfg: Config,
        seg: Segment,
        fleet: Fleet,
        store: StoreCalls,
        consumers: ConsumerApi,
        token: bytes | None,
    ) -> None:
        self._cfg = cfg
        self._seg = seg
        self._fleet = fleet
        self._store = store
        self._consumers = consumers
        self._token = token
        self._probe = StoreProbe(store)
        self._tenants = {s.tenant for s in cfg.sources}
        self._overriding = asyncio.Lock()  # one change at a time: the last publish wins
        self._routes: list[tuple[tuple[str, ...], dict[bytes, Handler]]] = [
            (("metrics",), {b"GET": self._metrics}),
            (("healthz",), {b"GET": self._healthz}),
            (("readyz",), {b"GET": self._readyz}),
            (
                ("v1", "tenants", "*", "rate-limit"),
                {b"GET": self._get_limit, b"PUT": self._put_limit, b"DELETE": self._delete_limit},
            ),
            (("v1", "hooks"), {b"GET": self._hooks}),
            (("v1", "hooks", "*"), {b"GET": self._hook}),
            (("v1", "consumers", "*"), {b"GET": self._consumer, b"DELETE": self._forget}),
            (("v1", "consumers", "*", "ack"), {b"POST": self._ack}),
        ]

    async def __call__(self, req: Request) -> Response:
        if self._token is None:
            if not _local(req):
                return reply(403, {"error": "not_local", "detail": NOT_LOCAL})
        elif not self._authorized(req):
            return reply(401, {"error": "unauthorized"}, (b"www-authenticate", b"Bearer"))
        found = self._route(req.path)
        if found is None:
            return reply(404, {"error": "not_found"})
        methods, args = found
        handler = methods.get(req.method)
        if handler is None:
            allow = b", ".join(methods)
            return reply(405, {"error": "method_not_allowed"}, (b"allow", allow))
        try:
            return await handler(req, args)
        except StoreError as e:
            log.warning("%s %s: %s", req.method.decode(), req.path.decode("latin-1"), e)
            return reply(503, {"error": "store_unavailable"}, (b"retry-after", b"1"))

    def _authorized(self, req: Request) -> bool:
        assert self._token is not None
        scheme, _, given = _header(req, "authorization").partition(" ")
        if scheme.lower() != "bearer":
            return False
        return hmac.compare_digest(given.strip().encode("latin-1"), self._token)

    def _route(self, path: bytes) -> tuple[dict[bytes, Handler], list[str]] | None:
        if not path.startswith(b"/"):
            return None
        parts = path.decode("latin-1").split("/")[1:]
        for pattern, methods in self._routes:
            if len(pattern) == len(parts) and all(
                p == q or (p == "*" and q) for p, q in zip(pattern, parts, strict=True)
            ):
                return methods, [q for p, q in zip(pattern, parts, strict=True) if p == "*"]
        return None

    # -- health -------------------------------------------------------------------------

    async def _metrics(self, req: Request, _: list[str]) -> Response:
        body, content_type = metrics.render(self._seg, _header(req, "accept"))
        return Response(200, body, content_type=content_type.encode())

    async def _healthz(self, req: Request, _: list[str]) -> Response:
        """Alive while the supervisor is: without it no worker is replaced or watched."""
        hdr = self._seg.header()
        if pid_alive(hdr.owner_pid, hdr.owner_start):
            return reply(200, {"status": "ok"})
        return reply(503, {"status": "supervisor_gone"})

    async def _readyz(self, req: Request, _: list[str]) -> Response:
        """Ready when workers serve and the store commits. The fleet check is reported and
        never fails readiness: with Redis down every host keeps serving node-local, and a
        Redis outage that took every host out of its load balancer would refuse every hook
        -- the one thing the fleet scope promises never to cause."""
        workers = self._workers()
        error = await self._probe.error()
        store: dict[str, Any] = {"ok": error is None}
        if error is not None:
            store["error"] = error
        checks: dict[str, Any] = {"workers": workers, "store": store}
        if self._cfg.fleet_kinds:
            checks["fleet"] = {
                "state": self._fleet.state(),
                "degraded": {k: self._fleet.degraded(k) for k in self._cfg.fleet_kinds},
            }
        ready = bool(workers["ok"]) and error is None
        return reply(200 if ready else 503, {"ready": ready, "checks": checks})

    def _workers(self) -> dict[str, Any]:
        limit_ms = self._cfg.server.heartbeat_timeout_s * 1000
        now = monotonic_ms()
        alive = [  # a worker told to stop no longer accepts: not counted
            p
            for p in procs.read(self._seg.view, self._seg.layout)
            if p.role == "worker" and p.alive and p.state != "stopping"
        ]
        stale = [p.pid for p in alive if now - p.heartbeat_ms > limit_ms]
        serving = len(alive) - len(stale)
        return {"ok": serving > 0 and not stale, "serving": serving, "stale": stale}

    # -- tenant rate limits -------------------------------------------------------------

    async def _get_limit(self, req: Request, args: list[str]) -> Response:
        """A tenant no source names any more is still shown while an override of it is
        kept: it would apply again if a source named it again."""
        (tenant,) = args
        stored = await self._store.read(lambda r: r.overrides())
        if tenant not in self._tenants and tenant not in stored:
            return reply(404, {"error": "unknown_tenant"})
        return reply(200, self._effective(tenant, stored))

    async def _put_limit(self, req: Request, args: list[str]) -> Response:
        (tenant,) = args
        if tenant not in self._tenants:
            return reply(404, {"error": "unknown_tenant"})
        parsed = _parse_override(req.body)
        if not isinstance(parsed, tuple):
            return reply(400, parsed)
        rate, burst = parsed
        async with self._overriding:
            try:  # the store refuses a limit Limit.of refuses, as the config does
                await self._store.write(lambda c: c.put_override(tenant, rate, burst))
            except ValueError as e:
                field = "burst" if str(e).startswith("burst") else "rate"
                return reply(400, _bad_override(field, str(e)))
            await self._publish_and_reset(tenant)
        log.info("rate limit of %s set to rate %g burst %d", tenant, rate, burst)
        return reply(
            200, {"tenant": tenant, "rate": float(rate), "burst": burst, "source": "override"}
        )

    async def _delete_limit(self, req: Request, args: list[str]) -> Response:
        """Any kept override can be deleted, also of a tenant no source names any more."""
        (tenant,) = args
        async with self._overriding:
            if not await self._store.write(lambda c: c.delete_override(tenant)):
                known = tenant in self._tenants
                return reply(404, {"error": "no_override" if known else "unknown_tenant"})
            stored = await self._publish_and_reset(tenant)
        log.info("rate limit override of %s deleted", tenant)
        return reply(200, self._effective(tenant, stored))

    async def _publish_and_reset(self, tenant: str) -> overrides.Overrides:
        """Publish the whole stored set (what the workers apply) and forget the tenant's
        buckets, filled under the limit it no longer has."""
        stored = await self._store.read(lambda r: r.overrides())
        overrides.publish(self._seg.blob("overrides"), stored)
        await self._fleet.reset_tenant(tenant)
        return stored

    def _effective(self, tenant: str, stored: overrides.Overrides) -> dict[str, Any]:
        if tenant in stored:
            (rate, burst), source = stored[tenant], "override"
        else:
            spec = self._cfg.rate_limits.tenants.get(tenant)
            source = "default" if spec is None else "config"
            spec = spec or self._cfg.rate_limits.default
            rate, burst = spec.rate, spec.burst
        return {"tenant": tenant, "rate": rate, "burst": burst, "source": source}

    # -- consumers ----------------------------------------------------------------------

    async def _hooks(self, req: Request, _: list[str]) -> Response:
        gone = req.hung_up() if req.hung_up is not None else None
        return _answer(await self._consumers.hooks(req.query, gone))

    async def _hook(self, req: Request, args: list[str]) -> Response:
        return _answer(await self._consumers.hook(args[0]))

    async def _consumer(self, req: Request, args: list[str]) -> Response:
        return _answer(await self._consumers.consumer(args[0]))

    async def _forget(self, req: Request, args: list[str]) -> Response:
        return _answer(await self._consumers.forget(args[0]))

    async def _ack(self, req: Request, args: list[str]) -> Response:
        return _answer(await self._consumers.ack(args[0], req.body))


def _answer(r: Reply) -> Response:
    status, doc = r
    return Response(status, doc) if isinstance(doc, bytes) else reply(status, doc)


def _parse_override(body: bytes) -> tuple[Any, Any] | dict[str, Any]:
    """(rate, burst) as given, or the 400's body; their values are the store's to judge."""
    try:
        doc = json.loads(body)
    except (ValueError, RecursionError):  # UnicodeDecodeError too; nested too deep
        return {"error": "invalid_json"}
    if not isinstance(doc, dict):
        return {"error": "invalid_json"}
    for key in doc:
        if key not in ("rate", "burst"):
            return _bad_override(key, "unknown key; give rate and burst")
    for key in ("rate", "burst"):
        if key not in doc:
            return _bad_override(key, "missing")
    return doc["rate"], doc["burst"]


def _bad_override(field: str, detail: str) -> dict[str, Any]:
    return {"error": "invalid_override", "field": field, "detail": detail}
