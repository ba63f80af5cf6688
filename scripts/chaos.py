#!/usr/bin/env python3
"""A chaos run that counts every hook: hosts on one private Redis, a provider's load, faults
on a schedule, then a ledger of what happened to each hook, and a report with plots.

Two (or three) service instances -- the "hosts", each with its own port, segment and
store, both scopes fleet -- share one private redis-server on loopback. An open-loop load
(scripts/chaos_load.py) offers signed hooks and retries refused and unanswered ones, as a
provider does. While it runs, faults are injected on a schedule scaled to the duration:

  worker-kill      SIGKILL of a random request worker
  drainer-kill     SIGKILL of a drainer
  redis-stall      redis-server SIGSTOPped for longer than every budget and TTL, then SIGCONT
  redis-restart    redis-server killed and started again, empty
  redis-drop       every client connection dropped by redis-server (CLIENT KILL) every
                   50 ms for a while: the calls in flight are sent again on new connections,
                   so no hook is answered node-local and Redis counts as healthy throughout
  supervisor-kill  SIGKILL of a supervisor (its children die with it), then a fresh start
                   on the same segment, as systemd would
  host-reboot      a graceful stop (SIGTERM) of a host, its segment removed as a reboot
                   empties /dev/shm, then a start on a new segment: what the stop settled
                   is not promoted again, only what came after it
  queue-full       a host with a small settle queue whose drainer is SIGSTOPped until the
                   queue overflows (its workers still claim in Redis), then SIGCONT
  store-full       a host whose store is on a small tmpfs that is filled (needs root)
  redis-full       redis-server at its maxmemory under noeviction: it refuses writes (-OOM)
                   and still answers reads
  reload           SIGHUP: every worker replaced, one at a time, under the load
  scale            SIGTTIN, then SIGTTOU once the extra worker serves (closing the removed
                   worker's socket can reset a connection whose handshake is under way
                   unless net.ipv4.tcp_migrate_req is 1: counted, and held against the run
                   only then)

The ledger (printed, and the last line as one JSON object): hooks answered 2xx but not in
their host's store (lost); copies stored per event key fleet-wide, split by whether
Redis was healthy when the later copy was stored; stored hooks not committed in Redis at
the end (a resend of one would be stored again); hooks refused because of Redis; the
settle accounting of every host from its segment; breaker transitions against the faults;
latency while Redis was stalled; how long each SIGKILLed process took to be replaced; the
attempts a reload or a change of the worker count left unanswered.

  .venv/bin/python scripts/chaos.py --duration 60 [--hosts 2] [--rate 2000]
        [--faults all|short|NAME,NAME] [--report docs/reliability.md] [--no-plots]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import shlex
import signal
import sqlite3
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter as Tally
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import uvloop
from chaos_load import Load
from load_client import GITHUB_SOURCE, SECRET
from redis_server import RedisServer
from service import Service

from ankusa_shm.shm import segment as segmod
from ankusa_shm.shm import snapshot
from ankusa_shm.shm.counters import Counter
from ankusa_shm.shm.segment import Segment, SegmentError

TIMEOUT_MS = 20
PENDING_TTL_MS = 2_000
BREAKER_OPEN_MS = 1_000
SMALL_QUEUE = 512
STALL_S = 3.0  # longer than the budget, the breaker's open time and the pending TTL
SAMPLE_S = 0.1
RECOVERED_WITHIN_S = 2.0
FAULTS = (
    "worker-kill",
    "drainer-kill",
    "redis-stall",
    "redis-drop",
    "redis-restart",
    "supervisor-kill",
    "host-reboot",
    "queue-full",
    "store-full",
    "redis-full",
    "reload",
    "scale",
)
SHORT = ("worker-kill", "redis-stall", "reload", "drainer-kill")


@dataclass
class Fault:
    name: str
    at_s: float  # since the run began
    host: int = 0
    start_s: float = 0.0  # when it was injected (run time)
    end_s: float = 0.0  # when it was undone (run time)
    start_ms: int = 0  # the same, wall clock, to compare with stored hooks
    end_ms: int = 0
    recovered_s: float | None = None  # a SIGKILLed process: until its successor served
    fallbacks: int = 0  # hooks the hosts answered node-local while it lasted
    note: str = ""

    @property
    def redis(self) -> bool:
        """Fleet dedupe is degraded while it lasts (and a little after): Redis is away, or
        (queue-full) promotes are dropped, so their claims expire instead of committing."""
        return self.name in ("redis-stall", "redis-restart", "queue-full", "redis-full")


def schedule(names: list[str], duration: float, hosts: int) -> list[Fault]:
    """The faults, spread over the run so each one's effect has passed before the next."""
    slots = {
        "worker-kill": 0.08,
        "drainer-kill": 0.16,
        "redis-stall": 0.24,
        "redis-drop": 0.37,
        "redis-restart": 0.45,
        "supervisor-kill": 0.55,
        "host-reboot": 0.62,
        "store-full": 0.70,
        "queue-full": 0.80,
        "redis-full": 0.90,
        "reload": 0.31,
        "scale": 0.51,
    }
    if set(names) <= set(SHORT):
        slots.update({"worker-kill": 0.15, "redis-stall": 0.25, "reload": 0.6, "drainer-kill": 0.8})
    small = hosts - 1  # the host with the small queue and the small disk
    # the reboot on a host that no worker kill leaves owing a crash recovery
    host_of = {
        "queue-full": small,
        "store-full": small,
        "drainer-kill": small,
        "host-reboot": small,
    }
    return sorted(
        (Fault(n, slots[n] * duration, host_of.get(n, 0)) for n in names),
        key=lambda f: f.at_s,
    )


# -- the hosts -------------------------------------------------------------------------------


@dataclass
class Host:
    index: int
    service: Service
    store: Path
    tmpfs: Path | None = None
    seg: Segment | None = None

    def attach(self) -> Segment:
        if self.seg is None:
            self.seg = Segment.attach(self.service.segment, readonly=True)
        return self.seg


def host_config(redis_url: str, queue: int) -> str:
    return f"""
[rate_limits]
scope = "fleet"
default = {{ rate = 1000000, burst = 1000000 }}

[dedupe]
scope = "fleet"

[fleet]
redis_url = "{redis_url}"
timeout_ms = {TIMEOUT_MS}
pending_ttl_ms = {PENDING_TTL_MS}
breaker_open_ms = {BREAKER_OPEN_MS}
breaker_window_ms = 2000
settle_queue_size = {queue}
{GITHUB_SOURCE}"""


def mount_tmpfs(path: Path, mib: int) -> str:
    """'' on success, else why not (a fault that needs it is then skipped)."""
    path.mkdir(parents=True, exist_ok=True)
    r = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={mib}m,mode=0700", "tmpfs", str(path)],
        capture_output=True,
        text=True,
    )
    return "" if r.returncode == 0 else (r.stderr.strip() or f"mount exited {r.returncode}")


def make_hosts(work: Path, n: int, redis: RedisServer, faults: list[str]) -> list[Host]:
    hosts = []
    for i in range(n):
        small = i == n - 1 and n > 1
        d = work / f"host{i}"
        store = d / "hooks.db"
        tmpfs = None
        if small and "store-full" in faults:
            why = mount_tmpfs(d / "disk", 256)
            if why:
                print(f"store-full: skipped, cannot mount a tmpfs: {why}", flush=True)
            else:
                tmpfs = d / "disk"
                store = tmpfs / "hooks.db"
        queue = SMALL_QUEUE if small and "queue-full" in faults else 50_000
        svc = Service(
            d,
            host_config(redis.url, queue),
            server={"workers": 2, "graceful_timeout_s": 10, "heartbeat_timeout_s": 5},
            store={"path": str(store), "lock_timeout_ms": 2_000},
            env={"GH_SECRET": SECRET},
        )
        hosts.append(Host(i, svc, store, tmpfs))
    return hosts


# -- faults ----------------------------------------------------------------------------------


def _wall_ms() -> int:
    return time.time_ns() // 1_000_000


def _replaced(host: Host, role: str, before: list[int], within_s: float = 20.0) -> float | None:
    """Seconds until ``host`` has as many processes of ``role`` as ``before`` again, one of
    them new, and its supervisor has logged that the new one serves."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < within_s:
        now = host.service.pids(role)
        new = set(now) - set(before)
        log = host.service.log() if new else ""
        if len(now) >= len(before) and any(f"{role} {pid} serving" in log for pid in new):
            return time.monotonic() - t0
        time.sleep(0.01)
    return None


def _workers_became(
    host: Host, done: Callable[[list[int]], bool], within_s: float = 20.0
) -> float | None:
    """Seconds until ``done`` holds of ``host``'s workers and each of them serves."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < within_s:
        now = host.service.pids("worker")
        if done(now):
            log = host.service.log()
            if all(f"worker {pid} serving" in log for pid in now):
                return time.monotonic() - t0
        time.sleep(0.01)
    return None


def _fallbacks(hosts: list[Host]) -> int:
    """Hooks every host has answered node-local so far (both kinds: rate limit, dedupe)."""
    n = 0
    for h in hosts:  # attached afresh: a host rebooted since has a new segment
        with Segment.attach(h.service.segment, readonly=True) as seg:
            c = snapshot.take(seg).counters
        n += c[Counter.FALLBACK_RATE_LIMIT] + c[Counter.FALLBACK_DEDUPE]
    return n


def inject(f: Fault, hosts: list[Host], redis: RedisServer, load: Load, rng: random.Random) -> None:
    host = hosts[f.host]
    f.start_s, f.start_ms = load.now(), _wall_ms()
    if f.name in ("worker-kill", "drainer-kill"):
        role = f.name.split("-")[0]
        pids = host.service.pids(role)
        if not pids:
            f.note = f"no {role} was running"
        else:
            victim = rng.choice(pids)
            os.kill(victim, signal.SIGKILL)
            f.recovered_s = _replaced(host, role, pids)
            f.note = f"pid {victim} on host {f.host}"
    elif f.name == "redis-stall":
        redis.stop_signal()
        time.sleep(STALL_S)
        redis.cont_signal()
        f.note = f"SIGSTOP {STALL_S:g} s"
    elif f.name == "redis-drop":
        before = _fallbacks(hosts)
        dropped = 0
        with redis.client() as r:
            end = time.monotonic() + STALL_S
            while time.monotonic() < end:
                dropped += r.client_kill_filter(_type="normal", skipme=True)
                time.sleep(0.05)
        f.fallbacks = _fallbacks(hosts) - before
        f.note = (
            f"{dropped} client connections dropped in {STALL_S:g} s; "
            f"{f.fallbacks} hooks answered node-local meanwhile"
        )
    elif f.name == "redis-full":
        with redis.client() as r:  # noeviction, the policy deploy.md asks for: -OOM
            r.config_set("maxmemory", 1)
            time.sleep(STALL_S)
            r.config_set("maxmemory", 0)
        f.note = f"maxmemory reached (noeviction) for {STALL_S:g} s: writes refused"
    elif f.name == "queue-full":
        drainers = host.service.pids("drainer")
        for pid in drainers:
            os.kill(pid, signal.SIGSTOP)
        time.sleep(STALL_S)  # under the heartbeat timeout: it is not replaced meanwhile
        for pid in drainers:
            os.kill(pid, signal.SIGCONT)
        f.note = f"drainer SIGSTOPped {STALL_S:g} s, queue of {SMALL_QUEUE}"
    elif f.name == "reload":
        workers = host.service.pids("worker")
        host.service.send(signal.SIGHUP)
        f.recovered_s = _workers_became(
            host, lambda now: len(now) == len(workers) and not set(now) & set(workers)
        )
        f.note = f"host {f.host}: {len(workers)} workers replaced"
    elif f.name == "scale":
        workers = host.service.pids("worker")
        host.service.send(signal.SIGTTIN)
        _workers_became(host, lambda now: len(now) > len(workers))
        host.service.send(signal.SIGTTOU)
        f.recovered_s = _workers_became(host, lambda now: len(now) == len(workers))
        f.note = f"host {f.host}: one worker added, then one removed"
    elif f.name == "redis-restart":
        redis.kill()
        time.sleep(0.5)
        redis.start()
        f.note = "killed, restarted empty after 0.5 s"
    elif f.name == "supervisor-kill":
        svc = host.service
        os.kill(svc.pid, signal.SIGKILL)
        assert svc.proc is not None
        svc.proc.wait(10)
        deadline = time.monotonic() + 10
        while svc.children() and time.monotonic() < deadline:
            time.sleep(0.02)
        svc.start()
        f.recovered_s = load.now() - f.start_s
        f.note = f"host {f.host} restarted on its segment"
    elif f.name == "host-reboot":
        svc = host.service
        code = svc.stop()
        segmod.unlink(svc.segment)
        svc.start()
        f.recovered_s = load.now() - f.start_s
        f.note = f"host {f.host} stopped (exit {code}), its segment removed, started again"
    elif f.name == "store-full":
        if host.tmpfs is None:
            f.note = "skipped: no tmpfs"
        else:
            # A reader's snapshot keeps the log from being rewound, so the writers must
            # grow the file: a log with room left at its start would take the hooks of a
            # full disk without a failure, and the fault would test nothing.
            pin = sqlite3.connect(f"file:{host.store}?mode=ro", uri=True, isolation_level=None)
            pin.execute("BEGIN")
            pin.execute("SELECT count(*) FROM consumers").fetchone()
            filler = host.tmpfs / "filler"
            try:
                # The open inside the suppress: a disk already full refuses the file itself.
                with contextlib.suppress(OSError), filler.open("wb") as out:
                    while True:
                        out.write(bytes(1 << 20))
                        out.flush()
                time.sleep(STALL_S)
            finally:  # never left full: the faults after this one need the disk back
                filler.unlink(missing_ok=True)
                pin.close()
            f.note = f"tmpfs of host {f.host} full for {STALL_S:g} s"
    f.end_s, f.end_ms = load.now(), _wall_ms()


def run_faults(
    faults: list[Fault], hosts: list[Host], redis: RedisServer, load: Load, seed: int
) -> threading.Thread:
    rng = random.Random(seed)

    def loop() -> None:
        for f in faults:
            while load.t0 == 0.0 or load.now() < f.at_s:
                time.sleep(0.01)
            inject(f, hosts, redis, load, rng)
            print(f"  {f.start_s:6.1f} s  {f.name:<16} {f.note}", flush=True)

    t = threading.Thread(target=loop, daemon=True)
    t.start()
    return t


# -- sampling --------------------------------------------------------------------------------


@dataclass
class Sample:
    t_s: float
    host: int
    depth: int
    breaker: str
    degraded: bool


def run_sampler(hosts: list[Host], load: Load, stop: threading.Event) -> list[Sample]:
    samples: list[Sample] = []

    def loop() -> None:
        while not stop.is_set():
            if load.t0:
                for h in hosts:
                    try:
                        s = snapshot.take(h.attach())
                    except (SegmentError, ValueError):
                        continue
                    degraded = any(s.degraded.values())
                    samples.append(
                        Sample(load.now(), h.index, s.queue_depth, s.breaker.state, degraded)
                    )
            stop.wait(SAMPLE_S)

    threading.Thread(target=loop, daemon=True).start()
    return samples


# -- the ledger ------------------------------------------------------------------------------


@dataclass
class Stored:
    host: int
    id: str
    key: str
    received_ms: int


def read_store(h: Host) -> list[Stored]:
    uri = h.store.absolute().as_uri() + "?mode=ro"
    with contextlib.closing(sqlite3.connect(uri, uri=True)) as conn:
        rows = conn.execute("SELECT id, event_key, received_ms FROM hooks").fetchall()
    return [Stored(h.index, i, bytes(k).decode(), ms) for i, k, ms in rows if k is not None]


def settle_ledger(s: snapshot.Snapshot) -> dict[str, int | bool]:
    c = s.counters
    sent = c[Counter.SETTLED_PROMOTE] + c[Counter.SETTLED_RELEASE]
    enqueued = c[Counter.SETTLE_ENQUEUED]
    expired = c[Counter.SETTLE_EXPIRED]
    corrupt = c[Counter.SETTLE_CORRUPT]
    return {
        "enqueued": enqueued,
        "sent": sent,
        "expired": expired,
        "corrupt": corrupt,
        "queued_at_end": s.queue_depth,
        "dropped_full": c[Counter.SETTLE_DROPPED],
        "drops_made_good": c[Counter.SETTLE_DROPS_RECOVERED],
        "abandoned": c[Counter.SETTLE_ABANDONED],
        "balanced": enqueued == sent + expired + corrupt + s.queue_depth,
        "breaker_opened": c[Counter.BREAKER_TO_OPEN],
        "breaker_closed": c[Counter.BREAKER_TO_CLOSED],
    }


def _pct(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


@dataclass
class Ledger:
    figures: dict[str, Any] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)

    def check(self, ok: bool, what: str) -> None:
        if not ok:
            self.problems.append(what)


def ledger(
    load: Load,
    hosts: list[Host],
    stores: list[list[Stored]],
    faults: list[Fault],
    finals: list[snapshot.Snapshot],
    unknown: int,
) -> Ledger:
    led = Ledger()
    fig = led.figures
    fig["stored_unknown_to_fleet"] = unknown
    attempts = load.attempts
    by_host = [{s.id for s in rows} for rows in stores]
    everywhere = set().union(*by_host)
    ok = [a for a in attempts if 200 <= a.status < 300]
    fresh = [a for a in ok if not a.duplicate]
    lost = [a for a in fresh if a.hook_id not in by_host[a.host]]
    lost_original = [a for a in ok if a.duplicate and a.hook_id not in everywhere]
    fig["events"] = len(load.events)
    fig["attempts"] = len(attempts)
    fig["answered_2xx"] = len(ok)
    fig["duplicates_answered"] = len(ok) - len(fresh)
    fig["lost"] = len(lost) + len(lost_original)
    fig["never_acknowledged"] = sum(1 for e in load.events if not e.acked)
    fig["statuses"] = dict(sorted(Tally(str(a.status) for a in attempts).items()))

    # Copies per event key, and whether Redis was healthy when the later ones were stored.
    unhealthy = [
        (f.start_ms, f.end_ms + PENDING_TTL_MS + BREAKER_OPEN_MS + 1_000) for f in faults if f.redis
    ]
    copies: dict[str, list[Stored]] = {}
    for rows in stores:
        for s in rows:
            copies.setdefault(s.key, []).append(s)
    dist = Tally(len(v) for v in copies.values())
    fig["copies_per_key"] = {str(k): v for k, v in sorted(dist.items())}
    healthy_dups: list[str] = []
    degraded_dups: list[str] = []
    for key, rows in copies.items():
        if len(rows) < 2:
            continue
        later = sorted(rows, key=lambda s: s.received_ms)[1:]
        in_fault = all(any(a <= s.received_ms <= b for a, b in unhealthy) for s in later)
        (degraded_dups if in_fault else healthy_dups).append(key)
    fig["duplicates_stored_redis_degraded"] = len(degraded_dups)
    fig["duplicates_stored_redis_healthy"] = len(healthy_dups)
    fig["healthy_duplicate_keys"] = healthy_dups[:10]
    acked_keys = {load.events[a.event].key for a in ok}
    fig["acknowledged_without_copy"] = len(acked_keys - copies.keys())

    # Refusals because of Redis: while a Redis fault lasted (and a second after), any
    # answer that is neither 2xx nor the store's own 503 nor a 409 for an event in flight.
    windows = [(f.start_s, f.end_s + 1.0) for f in faults if f.redis]
    during = [a for a in attempts if any(s <= a.sent_s <= e for s, e in windows)]
    refused = [
        a
        for a in during
        if a.status
        and not 200 <= a.status < 300
        and a.error not in ("store_unavailable",)
        and a.status != 409
    ]
    fig["refused_while_redis_degraded"] = len(refused)
    fig["refused_while_redis_degraded_statuses"] = dict(Tally(str(a.status) for a in refused))
    fig["dedupe_pending_409"] = sum(1 for a in attempts if a.status == 409)
    fig["store_unavailable_503"] = sum(1 for a in attempts if a.error == "store_unavailable")

    stalls = [(f.start_s, f.end_s) for f in faults if f.name == "redis-stall"]
    stalled = [
        a.latency_ms for a in attempts if a.status and any(s <= a.sent_s <= e for s, e in stalls)
    ]
    fig["stall_requests"] = len(stalled)
    fig["stall_p50_ms"] = round(_pct(stalled, 0.5), 2)
    fig["stall_p99_ms"] = round(_pct(stalled, 0.99), 2)
    fig["stall_max_ms"] = round(max(stalled, default=0.0), 2)
    # Where the slow ones were: before the breaker could open (the stall's first 100 ms,
    # each call waiting out its budget), or later (the host's own commit latency).
    slow = [
        a.sent_s - s
        for a in attempts
        for s, e in stalls
        if a.status and s <= a.sent_s <= e and a.latency_ms > TIMEOUT_MS + 5
    ]
    fig["stall_slow"] = len(slow)
    fig["stall_slow_in_first_100ms"] = sum(1 for d in slow if d <= 0.1)
    fig["p99_outside_faults_ms"] = round(
        _pct(
            [
                a.latency_ms
                for a in attempts
                if a.status and not any(f.start_s - 1 <= a.sent_s <= f.end_s + 2 for f in faults)
            ],
            0.99,
        ),
        2,
    )
    fig["p99_ms"] = round(_pct([a.latency_ms for a in attempts if a.status], 0.99), 2)

    kills: list[dict[str, Any]] = []
    for f in faults:
        if f.name.endswith("-kill"):
            window = [
                a for a in attempts if f.start_s <= a.sent_s <= f.start_s + RECOVERED_WITHIN_S
            ]
            kills.append(
                {
                    "fault": f.name,
                    "host": f.host,
                    "recovered_s": None if f.recovered_s is None else round(f.recovered_s, 3),
                    "5xx_within_2s": sum(1 for a in window if a.status >= 500),
                    "no_answer_within_2s": sum(1 for a in window if a.status == 0),
                }
            )
    fig["kills"] = kills
    migrate = Path("/proc/sys/net/ipv4/tcp_migrate_req")
    fig["tcp_migrate_req"] = migrate.read_text().strip() == "1" if migrate.exists() else False
    changes: list[dict[str, Any]] = []
    for f in faults:
        if f.name in ("reload", "scale"):
            window = [a for a in attempts if f.start_s <= a.sent_s <= f.end_s + 1.0]
            changes.append(
                {
                    "fault": f.name,
                    "host": f.host,
                    "done_s": None if f.recovered_s is None else round(f.recovered_s, 3),
                    "attempts": len(window),
                    "5xx": sum(1 for a in window if a.status >= 500),
                    "no_answer": sum(1 for a in window if a.status == 0),
                    "no_answer_errors": dict(Tally(a.error for a in window if a.status == 0)),
                }
            )
    fig["worker_changes"] = changes
    fig["settle"] = [settle_ledger(s) for s in finals]
    fig["faults"] = [
        {
            "name": f.name,
            "host": f.host,
            "start_s": round(f.start_s, 2),
            "end_s": round(f.end_s, 2),
            "note": f.note,
        }
        for f in faults
    ]

    led.check(fig["lost"] == 0, f"lost {fig['lost']} hooks answered 2xx")
    led.check(fig["acknowledged_without_copy"] == 0, "events acknowledged with no stored copy")
    led.check(fig["refused_while_redis_degraded"] == 0, "hooks refused because of Redis")
    led.check(
        fig["duplicates_stored_redis_healthy"] == 0, "duplicates stored while Redis was healthy"
    )
    led.check(all(s["balanced"] for s in fig["settle"]), "settle accounting does not balance")
    led.check(unknown == 0, f"{unknown} stored hooks not committed in Redis at the end")
    for i, h in enumerate(hosts):  # a restart after SIGKILL re-attaches a ring at rest
        damaged = "settle queue was damaged" in h.service.log()
        led.check(not damaged, f"host {i}: a crash left a settle queue taken for damage")
    for f in faults:
        if f.name == "queue-full":
            dropped = fig["settle"][f.host]["dropped_full"]
            led.check(dropped > 0, f"queue-full: host {f.host}'s settle queue never overflowed")
        if f.name == "redis-drop":
            led.check(f.fallbacks == 0, f"redis-drop: {f.note}")
        if f.name == "host-reboot":
            log = hosts[f.host].service.log()
            led.check("stopped (exit 0" in f.note, f"host-reboot: {f.note}")
            led.check(  # the stop left every hook settled: none is promoted again
                "this host stored in their dedupe window" not in log,
                f"host-reboot: host {f.host} promoted its whole window again",
            )
    led.check(fig["stall_p99_ms"] <= TIMEOUT_MS + 5, f"p99 while stalled over {TIMEOUT_MS + 5} ms")
    for c in changes:
        led.check(c["done_s"] is not None, f"{c['fault']}: the workers never settled")
        led.check(c["5xx"] == 0, f"{c['fault']}: {c['5xx']} answered 5xx")
        if c["fault"] == "reload" or fig["tcp_migrate_req"]:
            led.check(c["no_answer"] == 0, f"{c['fault']}: {c['no_answer']} left unanswered")
    for k in kills:
        if k["fault"] != "supervisor-kill":
            r = k["recovered_s"]
            led.check(r is not None and r <= RECOVERED_WITHIN_S, f"{k['fault']} recovered in {r} s")
    return led


# -- the run ---------------------------------------------------------------------------------


def _settled(s: snapshot.Snapshot) -> bool:
    """Nothing queued, and every drop made good (``repromote.Drops``)."""
    c = s.counters
    return s.queue_depth == 0 and c[Counter.SETTLE_DROPPED] == c[Counter.SETTLE_DROPS_RECOVERED]


def wait_drained(hosts: list[Host], timeout_s: float = 15.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if all(_settled(snapshot.take(h.attach())) for h in hosts):
            return
        time.sleep(0.1)


def unknown_to_fleet(redis: RedisServer, stores: list[list[Stored]]) -> int:
    """Stored hooks whose event the fleet does not hold as committed at the end (its key
    absent, pending, or naming no stored copy): a resend of one would be stored again."""
    ids: dict[str, set[str]] = {}
    for rows in stores:
        for s in rows:
            ids.setdefault(s.key, set()).add(s.id)
    keys = list(ids)
    missing = 0
    with redis.client() as r:
        for i in range(0, len(keys), 1_000):
            part = keys[i : i + 1_000]
            values = r.mget([f"ankusa:{{acme}}:dd:github:{k}" for k in part])
            for key, value in zip(part, values, strict=True):
                held = value.decode().removeprefix("c:") if value else ""
                missing += not (value and value.startswith(b"c:") and held in ids[key])
    return missing


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--duration", type=float, default=60.0)
    p.add_argument("--hosts", type=int, default=2, choices=(2, 3))
    p.add_argument("--rate", type=float, default=2_000.0, help="hooks/s offered, all hosts")
    p.add_argument(
        "--faults", default="all", help="all | short | a comma list of " + ",".join(FAULTS)
    )
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--report", type=Path, help="write the report (markdown + PNG plots) here")
    p.add_argument("--no-plots", action="store_true")
    args = p.parse_args(argv)
    names = list(
        FAULTS
        if args.faults == "all"
        else SHORT
        if args.faults == "short"
        else args.faults.split(",")
    )
    unknown = [n for n in names if n not in FAULTS]
    if unknown:
        p.error(f"unknown fault {unknown[0]!r}; faults: {', '.join(FAULTS)}")
    print("command: " + " ".join(shlex.quote(a) for a in [sys.executable, *sys.argv]), flush=True)

    work = Path(tempfile.mkdtemp(prefix="ankusa-chaos-"))
    redis = RedisServer()
    hosts = make_hosts(work, args.hosts, redis, names)
    faults = schedule(names, args.duration, args.hosts)
    load = Load([h.service.port for h in hosts], SECRET, args.rate, args.seed)
    stop_sampling = threading.Event()
    try:
        for h in hosts:
            h.service.start()
        print(
            f"hosts: {args.hosts} x 2 workers, fleet scope on redis {redis.url}; "
            f"offered {args.rate:g} hooks/s for {args.duration:g} s; faults:",
            flush=True,
        )
        samples = run_sampler(hosts, load, stop_sampling)
        injector = run_faults(faults, hosts, redis, load, args.seed)
        uvloop.run(load.run(args.duration, drain_s=20.0))
        injector.join(60)
        wait_drained(hosts)
        stop_sampling.set()
        finals = [snapshot.take(h.attach()) for h in hosts]
        for h in hosts:
            h.service.stop()
        stores = [read_store(h) for h in hosts]
        led = ledger(load, hosts, stores, faults, finals, unknown_to_fleet(redis, stores))
        print_ledger(led)
        if args.report:
            from chaos_report import write_report

            write_report(args.report, args, load, samples, faults, led, plots=not args.no_plots)
            print(f"report: {args.report}")
        print(
            json.dumps(
                {"ok": not led.problems, "problems": led.problems, **led.figures}, sort_keys=True
            )
        )
        return 0 if not led.problems else 1
    finally:
        stop_sampling.set()
        for h in hosts:
            if h.seg is not None:
                h.seg.close()
            h.service.close()
            if h.tmpfs is not None:
                subprocess.run(["umount", "-l", str(h.tmpfs)], capture_output=True)
        redis.close()
        subprocess.run(["rm", "-rf", str(work)], capture_output=True)


def print_ledger(led: Ledger) -> None:
    f = led.figures
    print("ledger:")
    print(f"  events {f['events']:,}, attempts {f['attempts']:,}, statuses {f['statuses']}")
    print(f"  lost (2xx, not stored): {f['lost']}    never acknowledged: {f['never_acknowledged']}")
    print(f"  copies per event key: {f['copies_per_key']}")
    print(f"  stored but not committed in Redis at the end: {f['stored_unknown_to_fleet']}")
    print(
        f"  duplicates stored: {f['duplicates_stored_redis_healthy']} while Redis was healthy, "
        f"{f['duplicates_stored_redis_degraded']} while it was not"
    )
    print(f"  refused because of Redis: {f['refused_while_redis_degraded']}")
    print(
        f"  while Redis was stalled: {f['stall_requests']} answers, p50 {f['stall_p50_ms']} ms, "
        f"p99 {f['stall_p99_ms']} ms, max {f['stall_max_ms']} ms (budget {TIMEOUT_MS} ms); "
        f"{f['stall_slow']} over {TIMEOUT_MS + 5} ms, {f['stall_slow_in_first_100ms']} of them "
        f"in a stall's first 100 ms; p99 away from any fault {f['p99_outside_faults_ms']} ms"
    )
    for i, s in enumerate(f["settle"]):
        print(f"  host {i} settle: {s}")
    for k in f["kills"] + f["worker_changes"]:
        print(f"  {k}")
    for problem in led.problems:
        print(f"  PROBLEM: {problem}")


if __name__ == "__main__":
    sys.exit(main())
