"""The fleet's data in Redis: key names, the two Lua scripts, and the calls that run them.

Keys (the tenant in braces is the Redis Cluster hash tag, so one hook's keys share a slot):

    {prefix}:{<tenant>}:rl                   the tenant's GCRA theoretical arrival time (us)
    {prefix}:{<tenant>}:dd:<source>:<key>    "p:<token>" pending, expires at pending_ttl_ms;
                                             "c:<hook id>" committed, expires with the window

Time is the Redis server's (``TIME`` inside the script), so hosts with skewed clocks still
share one bucket. Scripts run by ``EVALSHA``: the client loads both on every connection and
once more if the server loses its cache while connected (see redis_client).

A promote does not need its pending claim to still exist (settle.lua): a hook this host
stored is ``committed`` in Redis once a promote reaches it, whether its claim expired, was
never written, or was written late by a call that timed out here and ran after a stall.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from importlib import resources

from ankusa_shm.config import Fleet as FleetConfig
from ankusa_shm.fleet.redis_client import (
    Arg,
    Client,
    ClusterClient,
    Reply,
    ReplyError,
    parse_url,
)
from ankusa_shm.hooks import bounded_event_key
from ankusa_shm.limits import Limit
from ankusa_shm.shm import layout as L
from ankusa_shm.shm.settle_queue import Op, Record

SETTLE_OPS_PER_CALL = 500  # bounds how long one script holds the server
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

# admit.lua's answers
ADMITTED, DUPLICATE, PENDING, LIMITED = 0, 1, 2, 3


class RedisStore:
    def __init__(self, client: Client | ClusterClient, prefix: str, cluster: bool) -> None:
        self.client = client
        self._prefix = prefix
        self._cluster = cluster

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
        return cls(client, cfg.key_prefix, cfg.cluster)

    def rate_key(self, tenant: str) -> bytes:
        return f"{self._prefix}:{{{tenant}}}:rl".encode()

    def dedupe_key(self, tenant: str, source: str, key: bytes) -> bytes:
        return L.dedupe_key(self._prefix, tenant, source, bounded_event_key(key))

    async def admit(
        self,
        tenant: str,
        limit: Limit | None,
        dedupe_key: bytes | None,
        token: bytes,
        pending_ttl_ms: int,
        deadline: float = _NEVER,
    ) -> tuple[int, int | bytes]:
        """One round trip: (ADMITTED, 0) | (DUPLICATE, hook id) | (PENDING, ms) | (LIMITED, ms).
        ``limit`` None charges nothing; ``dedupe_key`` None claims nothing. Past
        ``deadline`` (``time.monotonic()`` seconds), TimeoutError."""
        rate_key = self.rate_key(tenant)
        keys = (rate_key, dedupe_key or rate_key)
        args: tuple[Arg, ...] = (
            int(limit is not None),
            int(dedupe_key is not None),
            limit.interval_us if limit else 0,
            limit.burst if limit else 0,
            token.hex(),
            pending_ttl_ms,
        )
        (reply,) = await self.client.send([_evalsha(ADMIT, keys, args)], deadline)
        if isinstance(reply, ReplyError):
            raise reply
        return int(reply[0]), reply[1] if len(reply) > 1 else 0

    async def settle(self, records: Sequence[Record], now_ms: int) -> tuple[int, int]:
        """Apply promotes and releases in one round trip: (promotes that wrote or found
        their hook, releases that found their token). A promote keeps its key for what is
        left of the hook's dedupe window at ``now_ms`` (at least 1 ms)."""
        groups: dict[bytes, list[Record]] = {}
        for r in records:
            groups.setdefault(self._group(r.key), []).append(r)
        calls: list[tuple[tuple[bytes, ...], tuple[Arg, ...]]] = []
        for group in groups.values():
            for i in range(0, len(group), SETTLE_OPS_PER_CALL):
                chunk = group[i : i + SETTLE_OPS_PER_CALL]
                args: list[Arg] = []
                for r in chunk:
                    args += (b"p" if r.op == Op.PROMOTE else b"r", r.token.hex(), r.hook_id)
                    args.append(max(1, r.ttl_ms - (now_ms - r.enqueued_ms)))
                calls.append((tuple(r.key for r in chunk), tuple(args)))
        replies = await self._run(SETTLE, calls)
        errors = [r for r in replies if isinstance(r, ReplyError)]
        if errors:
            raise errors[0]
        return sum(int(r[0]) for r in replies), sum(int(r[1]) for r in replies)

    async def reset_tenant(self, tenant: str) -> None:
        key = self.rate_key(tenant)
        (reply,) = await self.client.send([(key, ("DEL", key))])
        if isinstance(reply, ReplyError):
            raise reply

    async def close(self) -> None:
        await self.client.close()

    def _group(self, key: bytes) -> bytes:
        """Keys that may share one script call: one hash tag on a cluster, all otherwise."""
        if not self._cluster:
            return b""
        start = key.find(b"{")
        return key[start : key.find(b"}", start) + 1]

    async def _run(
        self,
        script: Script,
        calls: Sequence[tuple[tuple[bytes, ...], tuple[Arg, ...]]],
        deadline: float = _NEVER,
    ) -> list[Reply]:
        """EVALSHA each call, all in one round trip (per node, on a cluster)."""
        return await self.client.send([_evalsha(script, k, a) for k, a in calls], deadline)


def _evalsha(
    script: Script, keys: tuple[bytes, ...], args: tuple[Arg, ...]
) -> tuple[bytes, tuple[Arg, ...]]:
    """One script call as the client sends it: (routing key, command)."""
    return keys[0], ("EVALSHA", script.sha, len(keys), *keys, *args)
