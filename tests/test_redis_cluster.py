"""Fleet admission on a local Redis Cluster of three masters (fleet.cluster = true): every
hook's keys share its tenant's hash tag, so tenants spread over the nodes, and the
ClusterClient routes, batches per node, follows MOVED and finds a failed primary's promoted
replica. Also: the project's own hash slot agrees with the server's ``CLUSTER KEYSLOT``."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import random
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from conftest import cannot_run
from fleet_helpers import (
    TENANT,
    TIMEOUT_S,
    admit,
    bare,
    dd_key,
    drain_all,
    fleet_config,
    fleet_raw,
    open_fleet,
    rl_key,
    run,
    segments,
    stopped,
    store_hooks,
    total,
    totals,
)
from redis.crc import key_slot
from redis_server import RedisServer, free_port

from ankusa_shm import config
from ankusa_shm.config import Config
from ankusa_shm.fleet import hash_slot
from ankusa_shm.fleet.admission import (
    Admit,
    Admitted,
    Claim,
    DedupePending,
    Duplicate,
    Fleet,
    RateLimited,
)
from ankusa_shm.fleet.epoch import Epoch
from ankusa_shm.fleet.redis_client import ClusterClient
from ankusa_shm.fleet.redis_store import RedisStore
from ankusa_shm.fleet.repromote import Repromoter
from ankusa_shm.hooks import Committed, NewHook, NotStored
from ankusa_shm.shm import procs
from ankusa_shm.shm.counters import Counter

Addr = tuple[str, int]


@dataclass
class RedisCluster:
    nodes: list[RedisServer]

    @property
    def url(self) -> str:
        return self.nodes[0].url

    def slot_ranges(self) -> list[Any]:
        """``CLUSTER SLOTS`` as a node still running says it."""
        live = next(n for n in self.nodes if n.proc is not None and n.proc.poll() is None)
        with live.client() as r:
            ranges: list[Any] = r.execute_command("CLUSTER", "SLOTS")
        return ranges

    def by_port(self, port: object) -> RedisServer:
        return next(n for n in self.nodes if n.port == int(str(port)))

    def primaries(self) -> list[RedisServer]:
        return [self.by_port(primary[1]) for _, _, primary, *_ in self.slot_ranges()]

    def owner(self, key: bytes) -> RedisServer:
        """The node that serves ``key``'s slot, as the cluster itself says."""
        return self.owner_and_replicas(key)[0]

    def owner_and_replicas(self, key: bytes) -> list[RedisServer]:
        slot = key_slot(key)
        for start, end, *nodes in self.slot_ranges():
            if start <= slot <= end:
                return [self.by_port(n[1]) for n in nodes]
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
    cannot_run(f"{' and '.join(missing)} not on PATH (apt install redis-server redis-tools)")


def _cluster_ok(node: RedisServer, replicas: int) -> bool:
    """This node sees the cluster whole: three slot ranges, each with its replicas, and,
    if the node is a replica, its link to its primary is up (it has the data)."""
    with node.client() as r:
        info = r.execute_command("CLUSTER", "INFO").decode()
        ranges = r.execute_command("CLUSTER", "SLOTS")
        replication = r.info("replication")
    return (
        "cluster_state:ok" in info
        and len(ranges) == 3
        and all(len(nodes) == 1 + replicas for _, _, *nodes in ranges)
        and (replication["role"] == "master" or replication["master_link_status"] == "up")
    )


def start_cluster(replicas: int = 0, node_timeout_ms: int = 5000) -> RedisCluster:
    """Three primaries, each with ``replicas`` replicas, on free loopback ports."""
    nodes: list[RedisServer] = []
    try:
        for _ in range(3 * (1 + replicas)):
            args = [
                "--cluster-enabled", "yes",
                "--cluster-config-file", "nodes.conf",  # in the node's own --dir
                "--cluster-port", str(free_port()),
                "--cluster-node-timeout", str(node_timeout_ms),
                # a replica may take over however long ago it last heard its primary
                "--cluster-replica-validity-factor", "0",
                "--repl-diskless-sync-delay", "0",  # replicas sync at once, not after 5 s
                # CLUSTER SLOTS lists a replica once its offset moved: ping it each second
                "--repl-ping-replica-period", "1",
            ]  # fmt: skip
            nodes.append(RedisServer(None, *args))
        subprocess.run(
            [
                "redis-cli", "--cluster", "create",
                *(f"127.0.0.1:{n.port}" for n in nodes),
                "--cluster-replicas", str(replicas), "--cluster-yes",
            ],
            check=True,
            capture_output=True,
            timeout=TIMEOUT_S,
        )  # fmt: skip
        deadline = time.monotonic() + TIMEOUT_S
        while not all(_cluster_ok(n, replicas) for n in nodes):
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
    """One tenant per primary, in node order."""
    primaries = [n for n in c.nodes if n in c.primaries()]
    by_node: dict[int, str] = {}
    i = 0
    while len(by_node) < len(primaries):
        tenant = f"tenant{i}"
        by_node.setdefault(c.owner(rl_key(tenant)).port, tenant)
        i += 1
    return [by_node[n.port] for n in primaries]


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


# -- the hash slot ----------------------------------------------------------------------------


SLOT_KEYS = [
    b"",
    b"123456789",
    b"{}",
    b"{}tenant",
    b"a{}b{c}d",  # the first { meets the first } at once: an empty tag, the whole key
    b"{a}{b}",
    b"{{nested}}",
    b"x{a{b}c}y",
    b"}{back}",
    b"{unclosed",
    b"closed}",
    b"ankusa:{acme}:rl",
    b"ankusa:{acme}:dd:src-acme:evt",
    "ankusa:{t\u00e9nant-\u4e2d}:rl".encode(),
    b"\xff\xfe\x00{\x80\x81}\x00",
    b"\x00" * 64,
]


def test_key_slot_matches_cluster_keyslot(cluster: RedisCluster) -> None:
    rng = random.Random(7)
    keys = SLOT_KEYS + [rng.randbytes(rng.randrange(40)) for _ in range(300)]
    keys += [b"p{" + rng.randbytes(3) + b"}" + rng.randbytes(5) for _ in range(100)]
    with cluster.nodes[0].client() as r:
        pipe = r.pipeline(transaction=False)
        for k in keys:
            pipe.execute_command("CLUSTER", "KEYSLOT", k)
        expected = pipe.execute()
    assert [hash_slot.key_slot(k) for k in keys] == expected
    assert hash_slot.key_slot(b"123456789") == 0x31C3  # CRC16/XMODEM's check value


def test_client_does_not_import_redis_py() -> None:
    code = "import ankusa_shm.fleet.redis_client, sys; print('redis' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_reload_does_not_wait_for_a_hung_seed(cluster: RedisCluster) -> None:
    """A seed that accepts but never answers (SIGSTOP) must not hold up a reload: the
    other nodes answer it. A reload that waited on the seed would hold every caller that
    needs it (a MOVED, a failed node) for its whole budget, and never refresh."""
    seed = cluster.nodes[0]
    with segments(1) as (seg,):
        cfg = cluster_config(cluster, bare(seg), [TENANT])

        async def body() -> None:
            store = RedisStore.from_config(cfg.fleet)
            client = store.client
            assert isinstance(client, ClusterClient)
            try:
                await client.refresh()  # learns the other nodes
                expected = list(client._slots)
                client._slots = [None] * 16384
                with stopped(seed.pid):
                    async with asyncio.timeout(RECOVERY_S):
                        await client.refresh()
                assert client._slots == expected
            finally:
                await store.close()

        run(body())


# -- failover ---------------------------------------------------------------------------------


@pytest.fixture
def cluster_with_replicas() -> Iterator[RedisCluster]:
    """Its own cluster: a test kills one of its primaries. A short node timeout makes the
    failover quick; the replica validity factor 0 lets the replica take over whatever."""
    _need_cluster_tools()
    c = start_cluster(replicas=1, node_timeout_ms=2000)
    yield c
    c.close()


def is_primary(node: RedisServer) -> bool:
    with node.client(socket_timeout=1) as r:
        role: list[Any] = r.execute_command("ROLE")
    return bool(role[0] == b"master")


def test_primary_failover_recovers(cluster_with_replicas: RedisCluster) -> None:
    """SIGKILL the primary the config names as its seed: every admit meanwhile is answered
    (node-local), and fleet answers for its slots resume soon after its replica is promoted."""
    c = cluster_with_replicas
    tenants = tenants_on_each_node(c)
    victim_tenant = tenants[0]
    victim, replica = c.owner_and_replicas(rl_key(victim_tenant))
    survivors = [n for n in c.nodes if n is not victim]
    at: dict[str, float] = {}
    answers: list[Admitted] = []
    with segments(1) as (seg,):
        cfg = fleet_config(victim.url, bare(seg), cluster=True, tenants=tenants)

        async def load(fleet: Fleet, stop: asyncio.Event) -> None:
            """Fresh keys for every tenant, all along: each must be admitted."""
            i = 0
            while not stop.is_set():
                for t in tenants:
                    answers.append(await admit(fleet, cfg, f"fresh-{i}", t))
                i += 1
                await asyncio.sleep(0.002)

        async def watch_promotion() -> None:
            while not await asyncio.to_thread(is_primary, replica):
                await asyncio.sleep(0.05)
            at["promoted"] = time.monotonic()

        async def recovered(fleet: Fleet) -> None:
            committed = Duplicate(f"h-{victim_tenant}")
            while (answer := await admit(fleet, cfg, "evt", victim_tenant)) != committed:
                assert isinstance(answer, Admit), answer  # node-local, never refused
                if "promoted" in at:
                    assert time.monotonic() - at["promoted"] < RECOVERY_S, "no recovery"
                await asyncio.sleep(0.02)
            at["recovered"] = time.monotonic()

        async def body() -> None:
            async with open_fleet(cfg, seg) as fleet:
                for t in tenants:
                    fleet.settle(claim_of(await admit(fleet, cfg, "evt", t)), Committed(f"h-{t}"))
                await drain_all(cfg, seg)
                for t in tenants:
                    assert await admit(fleet, cfg, "evt", t) == Duplicate(f"h-{t}")
                with victim.client() as r:  # the replica holds the committed keys
                    assert r.execute_command("WAIT", 1, 10_000) == 1
                for n in survivors:
                    with n.client() as r:
                        r.config_resetstat()
                victim.kill()  # SIGKILL
                at["killed"] = time.monotonic()
                stop = asyncio.Event()
                loader = asyncio.create_task(load(fleet, stop))
                watcher = asyncio.create_task(watch_promotion())
                try:
                    await recovered(fleet)
                    await watcher
                    for t in tenants:  # every tenant is answered by the fleet again
                        await fleet_answers_again(fleet, cfg, t)
                finally:
                    stop.set()
                    watcher.cancel()
                    await asyncio.gather(loader, watcher, return_exceptions=True)

        run(body())
        counted = totals(seg)
    assert at["recovered"] - at["promoted"] < RECOVERY_S
    assert answers and all(isinstance(a, Admit) for a in answers)  # nothing refused
    failed = counted[Counter.STORE_ERROR] + counted[Counter.STORE_TIMEOUT]
    assert failed > 0  # the outage was seen, and answered node-local
    assert counted[Counter.FALLBACK_DEDUPE] == failed
    # Reloads after failures are rate limited: each survivor was asked CLUSTER SLOTS at
    # most once per interval of the outage (and a few times more for MOVED).
    allowed = (at["recovered"] - at["killed"]) / REFRESH_INTERVAL_S + 4
    for n in survivors:
        asked = n.commandstats().get("cluster|slots", 0)
        assert asked <= allowed, (n.port, asked, allowed)
    assert failed > 2 * allowed  # many failed calls, few reloads


RECOVERY_S = 10.0  # "a few seconds" with room for a loaded machine; without reloads: never
REFRESH_INTERVAL_S = 0.5  # ClusterClient's default


async def fleet_answers_again(fleet: Fleet, cfg: Config, tenant: str) -> None:
    """Wait until ``tenant``'s committed key is answered from Redis (not node-local)."""
    deadline = time.monotonic() + TIMEOUT_S
    while (answer := await admit(fleet, cfg, "evt", tenant)) != Duplicate(f"h-{tenant}"):
        assert isinstance(answer, Admit), answer
        assert time.monotonic() < deadline, f"{tenant} not answered by the fleet"
        await asyncio.sleep(0.02)


def test_epoch_keys_lie_one_in_each_64th_of_the_slots() -> None:
    tags = hash_slot.spread_tags(64)
    assert sorted(hash_slot.key_slot(t.encode()) // 256 for t in tags) == list(range(64))
    assert hash_slot.spread_tags(64) == tags  # every host computes the same keys


def test_a_cluster_named_by_another_of_its_nodes_is_the_same_store(
    cluster: RedisCluster, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Any node names a cluster: a drainer given another of its nodes (a config's seed node
    changed) finds the epoch values it read and promotes nothing, where a host moved to
    another store promotes its whole window into it."""
    other = next(n for n in cluster.nodes if n.url != cluster.url)
    with segments(1) as (seg,):
        raw = fleet_raw(cluster.url, bare(seg), cluster=True)
        raw["store"] = {"path": str(tmp_path / "hooks.db")}
        cfg = config.parse(raw, "cluster-seed")
        moved = dataclasses.replace(cfg.fleet, redis_url=other.url)

        async def body() -> None:
            slot = procs.claim(seg.view, seg.layout, procs.Role.DRAINER)
            try:
                for fleet in (cfg.fleet, moved):
                    store = RedisStore.from_config(fleet)
                    promote = Repromoter(cfg, store, slot.counters, 5.0)
                    try:
                        await Epoch(store, seg.blob("epoch"), promote, 5.0).check()
                    finally:
                        await store.close()
            finally:
                slot.release()

        with caplog.at_level(logging.WARNING, logger="ankusa_shm.drainer"):
            run(body())
        assert totals(seg)[Counter.REPROMOTED] == 0
    assert caplog.text == ""


def test_a_node_that_lost_its_data_alone_gets_this_hosts_hooks_again(
    cluster: RedisCluster, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A node that loses its data alone (FLUSHALL on it, a restart without persistence)
    loses epoch keys too, since every node holds some: the drainer's check sees them
    change and promotes this host's hooks again. With the one epoch key of before, the
    other nodes could lose theirs unseen: the node flushed here does not hold it."""
    tenants = tenants_on_each_node(cluster)
    lone = next(n for n in cluster.primaries() if n is not cluster.owner(b"ankusa:epoch"))
    with segments(1) as (seg,):
        raw = fleet_raw(cluster.url, bare(seg), cluster=True, tenants=tenants)
        raw["store"] = {"path": str(tmp_path / "hooks.db")}
        cfg = config.parse(raw, "cluster-epoch")
        wall = int(time.time() * 1000)
        hooks = [
            NewHook(f"hook-{t}-{i}", t, f"src-{t}", f"k{i}".encode(), 600, wall, (), b"{}")
            for t in tenants
            for i in range(5)
        ]

        async def body() -> None:
            await store_hooks(cfg, hooks)
            store = RedisStore.from_config(cfg.fleet)
            slot = procs.claim(seg.view, seg.layout, procs.Role.DRAINER)
            promote = Repromoter(cfg, store, slot.counters, 5.0)
            watch = Epoch(store, seg.blob("epoch"), promote, 5.0)
            try:
                await watch.check()  # the values as they are
                with lone.client() as r:
                    r.flushall()
                await watch.check()
            finally:
                await store.close()
                slot.release()

        with caplog.at_level(logging.WARNING, logger="ankusa_shm.drainer"):
            run(body())
        assert totals(seg)[Counter.REPROMOTED] == len(hooks)
    assert "the fleet store lost its data" in caplog.text
    for h in hooks:
        key = dd_key(f"k{h.id.rsplit('-', 1)[1]}", h.tenant)
        assert get_on_owner(cluster, key) == f"c:{h.id}".encode()
