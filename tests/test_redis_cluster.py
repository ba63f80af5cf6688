"""Fleet admission on a local Redis Cluster of three masters (fleet.cluster = true): every
hook's keys share its tenant's hash tag, so tenants spread over the nodes, and the
ClusterClient routes, batches per node and follows MOVED."""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
from fleet_helpers import (
    TIMEOUT_S,
    admit,
    bare,
    dd_key,
    drain_all,
    fleet_config,
    open_fleet,
    rl_key,
    run,
    segments,
    total,
    totals,
)
from redis.crc import key_slot
from redis_server import RedisServer, free_port

from ankusa_shm.config import Config
from ankusa_shm.fleet.admission import Admit, Admitted, Claim, DedupePending, Duplicate, RateLimited
from ankusa_shm.fleet.redis_client import ClusterClient
from ankusa_shm.fleet.redis_store import RedisStore
from ankusa_shm.hooks import Committed, NotStored
from ankusa_shm.shm.counters import Counter

Addr = tuple[str, int]


@dataclass
class RedisCluster:
    nodes: list[RedisServer]

    @property
    def url(self) -> str:
        return self.nodes[0].url

    def owner(self, key: bytes) -> RedisServer:
        """The node that serves ``key``'s slot, as the cluster itself says."""
        with self.nodes[0].client() as r:
            ranges = r.execute_command("CLUSTER", "SLOTS")
        slot = key_slot(key)
        for start, end, primary, *_ in ranges:
            if start <= slot <= end:
                return next(n for n in self.nodes if n.port == int(primary[1]))
        raise AssertionError(f"no node serves slot {slot}")

    def addr(self, node: RedisServer) -> Addr:
        return ("127.0.0.1", node.port)

    def close(self) -> None:
        for n in self.nodes:
            n.close()


def _need_cluster_tools() -> None:
    missing = [t for t in ("redis-server", "redis-cli") if not shutil.which(t)]
    if not missing:
        return
    msg = f"{' and '.join(missing)} not on PATH (apt install redis-server redis-tools)"
    if os.environ.get("CI") == "true":
        pytest.fail(msg)
    pytest.skip(msg)


def _cluster_ok(node: RedisServer) -> bool:
    with node.client() as r:
        info = r.execute_command("CLUSTER", "INFO").decode()
        known = len(r.execute_command("CLUSTER", "SLOTS"))
    return "cluster_state:ok" in info and known == 3


def start_cluster() -> RedisCluster:
    nodes: list[RedisServer] = []
    try:
        for _ in range(3):
            args = [
                "--cluster-enabled", "yes",
                "--cluster-config-file", "nodes.conf",  # in the node's own --dir
                "--cluster-port", str(free_port()),
                "--cluster-node-timeout", "5000",
            ]  # fmt: skip
            nodes.append(RedisServer(None, *args))
        subprocess.run(
            [
                "redis-cli", "--cluster", "create",
                *(f"127.0.0.1:{n.port}" for n in nodes),
                "--cluster-replicas", "0", "--cluster-yes",
            ],
            check=True,
            capture_output=True,
            timeout=TIMEOUT_S,
        )  # fmt: skip
        deadline = time.monotonic() + TIMEOUT_S
        while not all(_cluster_ok(n) for n in nodes):
            if time.monotonic() > deadline:
                raise RuntimeError("the cluster did not reach cluster_state:ok")
            time.sleep(0.05)
        return RedisCluster(nodes)
    except BaseException:
        for n in nodes:
            n.close()
        raise


@pytest.fixture(scope="module")
def cluster_once() -> Iterator[RedisCluster]:
    _need_cluster_tools()
    c = start_cluster()
    yield c
    c.close()


@pytest.fixture
def cluster(cluster_once: RedisCluster) -> RedisCluster:
    for n in cluster_once.nodes:
        with n.client() as r:
            r.flushall()
    return cluster_once


def tenants_on_each_node(c: RedisCluster) -> list[str]:
    """One tenant per node, in node order."""
    by_node: dict[int, str] = {}
    i = 0
    while len(by_node) < len(c.nodes):
        tenant = f"tenant{i}"
        by_node.setdefault(c.owner(rl_key(tenant)).port, tenant)
        i += 1
    return [by_node[n.port] for n in c.nodes]


def cluster_config(c: RedisCluster, seg_name: str, tenants: list[str], **kw: object) -> Config:
    return fleet_config(c.url, seg_name, cluster=True, tenants=tenants, **kw)


def claim_of(answer: Admitted) -> Claim:
    assert isinstance(answer, Admit) and answer.claim is not None, answer
    return answer.claim


def get_on_owner(c: RedisCluster, key: bytes) -> bytes | None:
    """GET on the node that owns the key (a wrong node would answer MOVED)."""
    with c.owner(key).client() as r:
        value: bytes | None = r.get(key)
        return value


def test_tenants_on_different_nodes(cluster: RedisCluster) -> None:
    tenants = tenants_on_each_node(cluster)
    assert len({cluster.owner(rl_key(t)).port for t in tenants}) == 3
    with segments(2) as segs:
        cfgs = [cluster_config(cluster, bare(s), tenants, rate=0.001, burst=3) for s in segs]
        claims: dict[str, list[Claim]] = {}

        async def body() -> None:
            async with open_fleet(cfgs[0], segs[0]) as a, open_fleet(cfgs[1], segs[1]) as b:
                for t in tenants:  # each tenant has its own limit, on its own node
                    answers = [await admit(a, cfgs[0], f"k{i}", t) for i in range(5)]
                    claims[t] = [claim_of(x) for x in answers[:3]]
                    assert all(isinstance(x, RateLimited) for x in answers[3:]), answers
                for t in tenants:
                    a.settle(claims[t][0], Committed(f"hook-{t}"))
                    a.settle(claims[t][1], NotStored("gone"))
                await drain_all(cfgs[0], segs[0])
                for t in tenants:  # the other host sees one window per tenant
                    assert await admit(b, cfgs[1], "k0", t) == Duplicate(f"hook-{t}")
                    assert isinstance(await admit(b, cfgs[1], "k2", t), DedupePending)
                    assert isinstance(await admit(b, cfgs[1], "k9", t), RateLimited)

        run(body())
        for t in tenants:
            assert get_on_owner(cluster, dd_key("k0", t)) == f"c:hook-{t}".encode()
            assert get_on_owner(cluster, dd_key("k1", t)) is None
            assert (
                get_on_owner(cluster, dd_key("k2", t)) == b"p:" + claims[t][2].token.hex().encode()
            )
            assert get_on_owner(cluster, rl_key(t)) is not None
        assert totals(segs[0])[Counter.DRAIN_ROUND_TRIPS] == 1
        assert all(total(segs, c) == 0 for c in (Counter.STORE_ERROR, Counter.STORE_TIMEOUT))


def test_settle_batch_across_nodes(cluster: RedisCluster) -> None:
    tenants = tenants_on_each_node(cluster)
    n = 200
    with segments(1) as (seg,):
        cfg = cluster_config(cluster, bare(seg), tenants, settle_batch_max=1000)

        async def body() -> None:
            async with open_fleet(cfg, seg) as fleet:
                for t in tenants:
                    for i in range(n):
                        fleet.settle(
                            claim_of(await admit(fleet, cfg, f"k{i}", t)), Committed(f"{t}-{i}")
                        )
            assert seg.queue_depth() == 3 * n
            await drain_all(cfg, seg)

        run(body())
        counted = totals(seg)
        assert seg.queue_depth() == 0
        assert counted[Counter.DRAIN_ROUND_TRIPS] == 1  # one round trip, three nodes
        assert counted[Counter.SETTLED_PROMOTE] == 3 * n
        for t in tenants:
            keys = [dd_key(f"k{i}", t) for i in range(n)]
            with cluster.owner(keys[0]).client() as r:
                values = r.mget(keys)
            assert values == [f"c:{t}-{i}".encode() for i in range(n)]


def misroute_everything(store: RedisStore, to: Addr) -> ClusterClient:
    client = store.client
    assert isinstance(client, ClusterClient)
    client._slots = [to] * 16384
    return client


def test_moved_is_followed(cluster: RedisCluster) -> None:
    tenants = tenants_on_each_node(cluster)
    wrong = cluster.addr(cluster.nodes[0])
    with segments(1) as (seg,):
        cfg = cluster_config(cluster, bare(seg), tenants)

        async def body() -> None:
            store = RedisStore.from_config(cfg.fleet)
            client = store.client
            assert isinstance(client, ClusterClient)
            await client.refresh()
            misroute_everything(store, wrong)
            async with open_fleet(cfg, seg, store=store) as fleet:
                for t in tenants:
                    claim = claim_of(await admit(fleet, cfg, "evt", t))
                    fleet.settle(claim, Committed(f"hook-{t}"))
                for t in tenants:  # the slot map was reloaded on the first MOVED
                    assert client._slots[key_slot(rl_key(t))] == cluster.addr(
                        cluster.owner(rl_key(t))
                    )
                drainer_store = RedisStore.from_config(cfg.fleet)
                drainer_client = drainer_store.client
                assert isinstance(drainer_client, ClusterClient)
                await drainer_client.refresh()
                misroute_everything(drainer_store, wrong)
                try:
                    await drain_all(cfg, seg, store=drainer_store)
                finally:
                    await drainer_store.close()
                for t in tenants:
                    assert await admit(fleet, cfg, "evt", t) == Duplicate(f"hook-{t}")

        run(body())
        counted = totals(seg)
        assert counted[Counter.STORE_OK] == 2 * len(tenants)
        assert counted[Counter.STORE_ERROR] == counted[Counter.STORE_TIMEOUT] == 0
        assert counted[Counter.SETTLED_PROMOTE] == len(tenants)
        assert counted[Counter.DRAIN_ERRORS] == 0
