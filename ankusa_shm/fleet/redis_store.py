"""The fleet's data in Redis: key names, the two Lua scripts, and the calls that run them.

Keys (the tenant in braces is the Redis Cluster hash tag, so one hook's keys share a slot):

    {prefix}:{<tenant>}:rl                   the tenant's GCRA theoretical arrival time (us)
    {prefix}:{<tenant>}:dd:<source>:<key>    "p:<token>" pending, expires at pending_ttl_ms;
                                             "c:<hook id>" committed, expires with the window
    {prefix}:epoch                           set once, without a TTL, by the first host to find
                                             it missing: a new value means the data is new
    {prefix}:epoch:{<tag>}                   the same on a cluster, 64 of them, so that every
                                             node holds some (``hash_slot.spread_tags``)

Time is the Redis server's (``TIME`` inside the script), so hosts with skewed clocks still
share one bucket. Scripts run by ``EVALSHA``: the client loads both on every connection and
once more if the server loses its cache while connected (see redis_client).

A promote does not need its pending claim to still exist (settle.lua): a hook this host
stored is ``committed`` in Redis once a promote reaches it, whether its claim expired, was
never written, or was written late by a call that timed out here and ran after a stall.

An admit call whose connection closes under it (a server or proxy dropping clients, a
reset) is sent once more on a new connection, within its budget: it may have run, and its
reply been lost, so admit.lua takes a key holding the hook's own token for that first run
(admitted, not charged again). Answered from this host instead, the hooks of such a call
would claim nothing the fleet can see while the server is fine.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import logging
import os
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from importlib import resources

from ankusa_shm.config import Fleet as FleetConfig
from ankusa_shm.fleet.hash_slot import hash_tag, spread_tags
from ankusa_shm.fleet.redis_client import (
    Arg,
    Call,
    Client,
    ClusterClient,
    ConnectionLost,
    RedisError,
    Reply,
    ReplyError,
)
from ankusa_shm.hooks import bounded_event_key
from ankusa_shm.limits import Limit
from ankusa_shm.redis_url import parse_url
from ankusa_shm.shm import layout as L
from ankusa_shm.shm.settle_queue import Op, Record

log = logging.getLogger("ankusa_shm.fleet")

SETTLE_OPS_PER_CALL = 500  # bounds how long one script holds the server
ADMITS_PER_CALL = 100  # the same, for admit.lua
_NEVER = float("inf")


@dataclass(frozen=True)
class Script:
    source: bytes
    sha: str

    @classmethod
    def load(cls, name: str) -> Script:
        source = resources.files(__package__).joinpath(name).read_bytes()
        return cls(source, hashlib.sha1(source).hexdigest())


ADMIT = Script.load("admit.lua")
SETTLE = Script.load("settle.lua")

EPOCH_KEYS = 64  # on a cluster: one in each 256 slots (a node serving 512 in a row has one)

# admit.lua's answers
ADMITTED, DUPLICATE, PENDING, LIMITED, UNRECORDED = 0, 1, 2, 3, 4


class WritesRefused(RedisError):
    """The server answered, but refuses writes (``-OOM``, ``-READONLY``, ``-MISCONF``): it
    still says what it holds, and records nothing new."""


class RedisStore:
    def __init__(
        self, client: Client | ClusterClient, prefix: str, cluster: bool, server: str = ""
    ) -> None:
        self.client = client
        # Where it is, without credentials ("" on a cluster): a store this host has not
        # delivered to before is told by it (``epoch``).
        self.server = server
        self._prefix = prefix
        # One epoch key, or on a cluster one in each 64th of the slot space, so that every
        # node holds one (``epoch``); the first is the one ``probe`` writes.
        self._epoch_keys = (
            [f"{prefix}:epoch:{{{tag}}}".encode() for tag in spread_tags(EPOCH_KEYS)]
            if cluster
            else [f"{prefix}:epoch".encode()]
        )
        self._cluster = cluster
        # (tenant, limit, pending_ttl_ms) -> this turn's hooks for it
        self._asks: dict[tuple[str, Limit | None, int], list[_Ask]] = {}
        self._asks_due = False
        self._loop: asyncio.AbstractEventLoop | None = None  # the running turn's
        self._lost: BaseException | None = None  # the last connection loss logged

    @classmethod
    def from_config(
        cls, cfg: FleetConfig, password: str = "", stall_s: float | None = None
    ) -> RedisStore:
        """Build without connecting: the socket opens on first use, in the caller's process.
        ``stall_s`` defaults to the request path's (the drainer passes its own)."""
        ep = parse_url(cfg.redis_url, password=password, tls_ca_file=cfg.tls_ca_file)
        stall = cfg.admit_stall_s if stall_s is None else stall_s
        scripts = (ADMIT.source, SETTLE.source)
        client: Client | ClusterClient = (
            ClusterClient(ep, stall_s=stall, scripts=scripts)
            if cfg.cluster
            else Client(ep, stall_s=stall, retry_connect_s=cfg.reconnect_pause_s, scripts=scripts)
        )
        # A cluster is named by any of its nodes: told apart by its epoch values alone.
        server = "" if cfg.cluster else f"{ep.name}/{ep.db}"
        return cls(client, cfg.key_prefix, cfg.cluster, server)

    @property
    def epoch_names(self) -> frozenset[str]:
        """The epoch keys, as ``epoch`` names them."""
        return frozenset(k.decode() for k in self._epoch_keys)

    def rate_key(self, tenant: str) -> bytes:
        return f"{self._prefix}:{{{tenant}}}:rl".encode()

    def dedupe_key(self, tenant: str, source: str, key: bytes) -> bytes:
        return L.dedupe_key(self._prefix, tenant, source, bounded_event_key(key))

    def admit(
        self,
        tenant: str,
        limit: Limit | None,
        dedupe_key: bytes | None,
        token: bytes,
        pending_ttl_ms: int,
        deadline: float = _NEVER,
    ) -> asyncio.Future[tuple[int, int | bytes]]:
        """One hook's admission: (ADMITTED, 0) | (DUPLICATE, hook id) | (PENDING, ms) |
        (LIMITED, ms) | (UNRECORDED, the server's refusal to write): admitted as far as
        the server can say, but nothing of it recorded, neither claim nor charge.
        ``limit`` None charges nothing; ``dedupe_key`` None claims nothing.
        Past ``deadline`` (``time.monotonic()`` seconds), TimeoutError.

        The hooks asked for in one turn of the loop share one script call per tenant
        (admit.lua answers each as a call of its own would), all in one round trip: a
        script call's fixed cost in Redis is several times a hook's own work."""
        if not self._asks_due:  # the turn's first: the loop is looked up once a turn
            self._loop = asyncio.get_running_loop()
            self._loop.call_soon(self._send_asks)
            self._asks_due = True
        assert self._loop is not None
        future: asyncio.Future[tuple[int, int | bytes]] = self._loop.create_future()
        group = (tenant, limit, pending_ttl_ms)
        ask = _Ask(dedupe_key, token.hex() if dedupe_key else "", deadline, future)
        asks = self._asks.get(group)
        if asks is None:
            self._asks[group] = [ask]
        else:
            asks.append(ask)
        return future

    def _send_asks(self) -> None:
        """The turn is over: one script call per tenant (and limit), all in one write.
        Each is a request of its own, so a cluster node that fails fails only its
        tenants' hooks."""
        groups, self._asks, self._asks_due = self._asks, {}, False
        sends: list[Call] = []
        for (tenant, limit, pending_ttl_ms), asks in groups.items():
            rate_key = self.rate_key(tenant)
            head: tuple[Arg, ...] = (
                int(limit is not None),
                limit.interval_us if limit else 0,
                limit.burst if limit else 0,
                pending_ttl_ms,
            )
            for i in range(0, len(asks), ADMITS_PER_CALL):
                part = asks[i : i + ADMITS_PER_CALL]
                keys = (rate_key, *[a.key or rate_key for a in part])
                key, command = _evalsha(ADMIT, keys, head + tuple(a.token for a in part))
                deadline = min(a.deadline for a in part)
                again = (key, command, deadline)
                sends.append(
                    (key, command, deadline, functools.partial(self._answered, part, again))
                )
        self.client.send_now(sends)

    def _answered(
        self,
        asks: Sequence[_Ask],
        again: tuple[bytes, Sequence[Arg], float] | None,
        replies: list[Reply] | BaseException,
    ) -> None:
        """A turn's call answered or failed; ``again`` is the call to send once more if
        its connection was lost under it (None once it has been)."""
        if (
            isinstance(replies, ConnectionLost)
            and again is not None
            and time.monotonic() < again[2]
        ):
            if replies is not self._lost:  # every call in flight fails with the one loss
                self._lost = replies
                log.info("fleet store %s: sending its admit calls once more", replies)
            then = functools.partial(self._answered, asks, None)
            self.client.send_now([(*again, then)])
        elif isinstance(replies, BaseException):
            _fail(asks, replies)
        else:
            _hand_out(asks, replies[0])

    async def settle(
        self, records: Sequence[Record], now_ms: int, deadline: float = _NEVER
    ) -> tuple[int, int]:
        """Apply promotes and releases in one round trip: (promotes that wrote or found
        their hook, releases that found their token). A promote keeps its key for what is
        left of the hook's dedupe window at ``now_ms`` (at least 1 ms), and needs no token.
        Past ``deadline`` (``time.monotonic()`` seconds), TimeoutError."""
        groups: dict[bytes, list[Record]] = {}
        if self._cluster:  # one script call per hash tag
            for r in records:
                groups.setdefault(hash_tag(r.key), []).append(r)
        else:
            groups[b""] = list(records)
        calls: list[tuple[tuple[bytes, ...], tuple[Arg, ...]]] = []
        for group in groups.values():
            for i in range(0, len(group), SETTLE_OPS_PER_CALL):
                chunk = group[i : i + SETTLE_OPS_PER_CALL]
                args: list[Arg] = []
                for r in chunk:
                    if r.op is Op.PROMOTE:
                        args += (b"p", b"", r.hook_id)
                    else:
                        args += (b"r", r.token.hex(), r.hook_id)
                    args.append(max(1, r.ttl_ms - (now_ms - r.enqueued_ms)))
                calls.append((tuple(r.key for r in chunk), tuple(args)))
        replies = await self._run(SETTLE, calls, deadline)
        errors = [r for r in replies if isinstance(r, ReplyError)]
        if errors:
            raise errors[0]
        if not all(isinstance(r, list) and len(r) == 2 and all(map(_count, r)) for r in replies):
            # the drainer keeps the records and tries again, as after an error
            raise RedisError(f"settle.lua answered {str(replies)[:80]!r}")
        return sum(r[0] for r in replies), sum(r[1] for r in replies)

    async def memory(self, deadline: float = _NEVER) -> Memory | None:
        """What the server says of its memory limit and evictions (``INFO memory`` and
        ``INFO stats``; on a cluster, the node that owns slot 0), or None if it will not
        say (an ACL user may be denied ``INFO``). Past ``deadline``, TimeoutError."""
        replies = await self.client.send(
            [(b"", ("INFO", "memory")), (b"", ("INFO", "stats"))], deadline
        )
        if any(not isinstance(r, bytes) for r in replies):
            return None
        fields: dict[str, str] = {}
        for r in replies:
            for line in r.decode(errors="replace").splitlines():
                name, sep, value = line.partition(":")
                if sep:
                    fields[name] = value.strip()
        try:
            return Memory(
                int(fields.get("maxmemory", "0")),
                fields.get("maxmemory_policy", "noeviction"),
                int(fields.get("evicted_keys", "0")),
            )
        except ValueError:
            return None

    async def epoch(self, deadline: float = _NEVER) -> dict[str, str]:
        """Each epoch key's value, set to a new random one where it is missing (``SET NX``,
        then ``GET``, all in one round trip, per node on a cluster): a different value than
        last time means that key's server lost its data since (``epoch``). A key its
        server refused (no room, read-only) is left out. Past ``deadline``,
        TimeoutError."""
        sends: list[tuple[bytes, tuple[Arg, ...]]] = []
        for key in self._epoch_keys:
            sends += [self._new_epoch(key), (key, ("GET", key))]
        replies = await self.client.send(sends, deadline)
        return {
            key.decode(): value.decode(errors="replace")
            for key, value in zip(self._epoch_keys, replies[1::2], strict=True)
            if isinstance(value, bytes)
        }

    async def probe(self, deadline: float = _NEVER) -> None:
        """What a host does to Redis, once, without touching a hook's key: connect and log
        in, load both scripts, run one (``EVALSHA`` of settle.lua with no keys), and write
        a key of the prefix (the epoch key, ``SET NX``: set if missing, as a drainer
        would). Raises the first refusal met (``RedisError``; past ``deadline``,
        TimeoutError)."""
        key = self._epoch_keys[0]
        ran = (key, ("EVALSHA", SETTLE.sha, 0))  # the key routes it, on a cluster
        for reply in await self.client.send([ran, self._new_epoch(key)], deadline):
            if isinstance(reply, ReplyError):
                raise reply

    @staticmethod
    def _new_epoch(key: bytes) -> tuple[bytes, tuple[Arg, ...]]:
        """``key`` set to a new random value if it is missing (``SET NX``)."""
        return key, ("SET", key, os.urandom(8).hex(), "NX")

    async def reset_tenant(self, tenant: str) -> None:
        key = self.rate_key(tenant)
        (reply,) = await self.client.send([(key, ("DEL", key))])
        if isinstance(reply, ReplyError):
            raise reply

    async def close(self) -> None:
        await self.client.close()
        for asks in self._asks.values():  # asked for in this very turn: never sent now
            _fail(asks, RedisError("client closed"))
        self._asks, self._asks_due = {}, False

    async def _run(
        self,
        script: Script,
        calls: Sequence[tuple[tuple[bytes, ...], tuple[Arg, ...]]],
        deadline: float = _NEVER,
    ) -> list[Reply]:
        """EVALSHA each call, all in one round trip (per node, on a cluster)."""
        return await self.client.send([_evalsha(script, k, a) for k, a in calls], deadline)


@dataclass(frozen=True, slots=True)
class Memory:
    maxmemory: int  # bytes; 0 is no limit
    policy: str  # maxmemory-policy
    evicted_keys: int  # since the server started (or CONFIG RESETSTAT)

    @property
    def evicts(self) -> bool:
        """Whether the server may evict fleet keys: every one of them has a TTL, so a
        ``volatile-*`` policy evicts them as surely as an ``allkeys-*`` one."""
        return self.maxmemory > 0 and self.policy != "noeviction"


@dataclass(slots=True)
class _Ask:
    """One hook's part of a turn's admit.lua call."""

    key: bytes | None
    token: str  # hex; "" claims nothing
    deadline: float
    future: asyncio.Future[tuple[int, int | bytes]]


def _hand_out(asks: Sequence[_Ask], reply: Reply) -> None:
    """Each hook its part of admit.lua's reply. Called from the read callback: a reply of
    the wrong shape fails these hooks, every one of them (they fall back on this host's
    answer), and must not raise into the connection."""
    if isinstance(reply, ReplyError):
        _fail(asks, reply)
        return
    if not _fits(reply, len(asks)):
        _fail(asks, RedisError(f"admit.lua answered {str(reply)[:80]!r}"))
        return
    for j, a in enumerate(asks):
        if not a.future.done():  # its caller may have given up
            a.future.set_result((reply[2 * j], reply[2 * j + 1]))


def _count(value: Reply) -> bool:
    """A whole number of at least 0, as Lua's integers come back (not RESP3's booleans)."""
    return type(value) is int and value >= 0


def _fits(reply: Reply, hooks: int) -> bool:
    """Whether ``reply`` is admit.lua's for ``hooks`` hooks: a verdict and its value each."""
    if not (isinstance(reply, list) and len(reply) == 2 * hooks):
        return False
    for verdict, value in zip(reply[::2], reply[1::2], strict=True):
        fits = _VERDICT_VALUES.get(verdict) if type(verdict) is int else None
        if fits is None or not fits(value):
            return False
    return True


# What each verdict of admit.lua comes with. A duplicate's hook id is put into an answer's
# JSON as it is, so it must look like one (every id this service makes does).
_HOOK_ID = re.compile(rb"[0-9A-Za-z_-]{1,64}")
_VERDICT_VALUES: dict[int, Callable[[Reply], bool]] = {
    ADMITTED: lambda x: x == 0,
    DUPLICATE: lambda x: isinstance(x, bytes) and _HOOK_ID.fullmatch(x) is not None,
    PENDING: _count,
    LIMITED: _count,
    UNRECORDED: lambda x: isinstance(x, bytes),
}


def _fail(asks: Sequence[_Ask], e: BaseException) -> None:
    for a in asks:
        if not a.future.done():
            a.future.set_exception(e)


def _evalsha(
    script: Script, keys: tuple[bytes, ...], args: tuple[Arg, ...]
) -> tuple[bytes, tuple[Arg, ...]]:
    """One script call as the client sends it: (routing key, command)."""
    return keys[0], ("EVALSHA", script.sha, len(keys), *keys, *args)
