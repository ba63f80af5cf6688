"""A reader's view of a live segment, and every figure it yields, declared once.

``take`` reads the segment (read-only is enough) into a ``Snapshot``; ``figures`` turns a
snapshot into named values. ``inspect`` prints them and ``/metrics`` exports them, both
from this one list, so the two can never disagree about a name or its meaning.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from ankusa_shm.shm import breaker, counters, histograms, procs, requests
from ankusa_shm.shm import layout as L
from ankusa_shm.shm.counters import Counter
from ankusa_shm.shm.degraded import Degraded
from ankusa_shm.shm.gcra import GcraTable
from ankusa_shm.shm.histograms import Histogram
from ankusa_shm.shm.pids import pid_alive
from ankusa_shm.shm.segment import CorruptSegment, Header, Segment
from ankusa_shm.shm.settle_queue import SettleQueue

DEFAULT_WINDOW_MS = 10_000


@dataclass(frozen=True)
class BreakerView:
    state: str
    owner_pid: int
    since_ms: int
    window_ms: int
    window_calls: int
    window_failures: int


@dataclass(frozen=True)
class Snapshot:
    name: str
    taken_ms: int
    header: Header
    owner_alive: bool
    config: dict[str, object]
    breaker: BreakerView
    degraded: dict[str, bool]
    counters: dict[Counter, int]
    requests: dict[tuple[str, str], int]  # (source, status) -> requests answered
    histograms: dict[Histogram, histograms.Totals]
    queue_depth: int
    queue_capacity: int
    consumer_pid: int
    consumer_alive: bool
    processes: list[procs.ProcessInfo]
    limiter_slots: int
    limiter_used: int
    limiter_filling: int


@dataclass(frozen=True)
class Figure:
    family: str
    kind: str  # "counter" | "gauge" | "histogram"
    help: str
    labels: tuple[tuple[str, str], ...]
    value: float  # a histogram's: its count
    buckets: tuple[tuple[float, int], ...] = ()  # a histogram's (le, cumulative count)
    sum: float = 0.0  # a histogram's sum, in its unit

    @property
    def label(self) -> str:
        return counters.label(self.family, self.labels)


REQUESTS_FAMILY = "http_requests"
REQUESTS_HELP = "Requests answered, by source (empty: none named) and status."

GAUGES: dict[str, str] = {
    "fleet_limiter_degraded": "1 while hooks of this kind are answered node-local.",
    "fleet_breaker_state": "Fleet store breaker: 0 closed, 1 open, 2 probing.",
    "fleet_breaker_window_calls": "Fleet store calls in the breaker's window.",
    "fleet_breaker_window_failures": "Failed fleet store calls in the breaker's window.",
    "fleet_settle_queue_depth": "Settle operations queued and not yet delivered.",
    "fleet_settle_queue_capacity": "Settle queue capacity.",
    "limiter_table_used": "Node limiter slots holding a tenant.",
    "limiter_table_slots": "Node limiter slots in all.",
    "processes": "Live processes attached to the segment, by role.",
    "segment_bytes": "Size of the shared-memory segment.",
    "segment_owner_up": "1 while the supervisor that owns the segment is alive.",
}


def declared() -> list[tuple[str, str, str]]:
    """(family, kind, help) of every figure, without a segment: for ``--list`` and docs."""
    families = dict.fromkeys(c.family for c in Counter)
    rows = [(f, "counter", counters.family_help(f)) for f in families]
    rows.append((REQUESTS_FAMILY, "counter", REQUESTS_HELP))
    rows += [(h.family, "histogram", h.help) for h in Histogram]
    return rows + [(f, "gauge", h) for f, h in GAUGES.items()]


def take(seg: Segment) -> Snapshot:
    v, lay = seg.view, seg.layout
    now_ns = time.monotonic_ns()
    now = now_ns // 1_000_000
    config = seg.read_config()
    fleet = config.get("fleet")
    window_ms = DEFAULT_WINDOW_MS
    if isinstance(fleet, dict) and isinstance(fleet.get("breaker_window_ms"), int):
        window_ms = fleet["breaker_window_ms"]
    reader = breaker.Breaker(v, lay, breaker.Policy(1.0, 1, window_ms, 1, 1))
    state, owner, since = breaker.unpack(reader.word())
    calls, failures = reader.window(now)
    queue = SettleQueue(v, seg.buf, lay)
    hdr = seg.header()
    limiter = GcraTable(v, seg.buf, lay)
    used, filling = limiter.usage(now_ns // 1000)
    degraded = Degraded(v, lay)
    processes = procs.read(v, lay)
    _check_identities(seg.name, hdr.owner_pid, queue.consumer_pid(), processes)
    owner_alive = pid_alive(hdr.owner_pid, hdr.owner_start)
    if not owner_alive:  # a ring at rest: the check its next owner makes holds exactly
        damage = queue.check()
        if damage is not None:
            raise CorruptSegment(
                f"segment {seg.name} is corrupt: its settle queue: {damage} "
                "(the next supervisor started on it rebuilds the queue)"
            )
    return Snapshot(
        name=seg.name,
        taken_ms=now,
        header=hdr,
        owner_alive=owner_alive,
        config=config,
        breaker=BreakerView(state.name.lower(), owner, since, window_ms, calls, failures),
        degraded={k: degraded.is_set(k) for k in L.KINDS},
        counters=counters.totals(v, lay),
        requests=_requests(seg),
        histograms=histograms.totals(v, lay),
        queue_depth=queue.depth(),
        queue_capacity=queue.capacity,
        consumer_pid=queue.consumer_pid(),
        # judged by its identity word (pid and start ticks): a pid since reused is gone
        consumer_alive=queue.live_consumer() == queue.consumer_pid(),
        processes=processes,
        limiter_slots=limiter.slots,
        limiter_used=used,
        limiter_filling=filling,
    )


def _requests(seg: Segment) -> dict[tuple[str, str], int]:
    names = requests.source_names(seg.blob("sources"))
    out: dict[tuple[str, str], int] = {}
    for (row, column), n in requests.totals(seg.view, seg.layout).items():
        if row - requests.FIRST_SOURCE_ROW >= len(names):
            continue  # counted for a table entry whose name this reader cannot see
        key = (requests.row_label(names, row), requests.status_label(column))
        out[key] = out.get(key, 0) + n
    return out


def _check_identities(
    name: str, owner: int, consumer: int, processes: list[procs.ProcessInfo]
) -> None:
    """Words no writer can produce -- a pid out of any pid's range, a slot whose role
    names no role -- mean the segment is corrupt; a reader says so instead of guessing."""
    if not 0 < owner <= L.PID_MASK:
        raise CorruptSegment(f"segment {name} is corrupt: owner pid word {owner} is no pid")
    if not 0 <= consumer <= L.PID_MASK:
        raise CorruptSegment(f"segment {name} is corrupt: queue consumer word {consumer} is no pid")
    for p in processes:
        if p.role == "?":
            raise CorruptSegment(f"segment {name} is corrupt: process slot {p.slot} names no role")


def figures(s: Snapshot) -> list[Figure]:
    out = [
        Figure(c.family, "counter", counters.family_help(c.family), c.labels, s.counters[c])
        for c in Counter
    ]

    for (source, status), n in sorted(s.requests.items()):
        labels = (("source", source), ("status", status))
        out.append(Figure(REQUESTS_FAMILY, "counter", REQUESTS_HELP, labels, n))
    for h, t in s.histograms.items():
        buckets, total = tuple(t.cumulative()), t.sum / h.per_unit
        out.append(Figure(h.family, "histogram", h.help, (), t.count, buckets, total))

    def gauge(family: str, value: float, *labels: tuple[str, str]) -> None:
        out.append(Figure(family, "gauge", GAUGES[family], labels, value))

    for kind, on in s.degraded.items():
        gauge("fleet_limiter_degraded", int(on), ("kind", kind))
    gauge("fleet_breaker_state", breaker.State[s.breaker.state.upper()].value)
    gauge("fleet_breaker_window_calls", s.breaker.window_calls)
    gauge("fleet_breaker_window_failures", s.breaker.window_failures)
    gauge("fleet_settle_queue_depth", s.queue_depth)
    gauge("fleet_settle_queue_capacity", s.queue_capacity)
    gauge("limiter_table_used", s.limiter_used)
    gauge("limiter_table_slots", s.limiter_slots)
    for role in procs.Role:
        name = role.name.lower()
        alive = sum(1 for p in s.processes if p.role == name and p.alive)
        if role is procs.Role.SUPERVISOR:  # the segment's owner, not a slot's holder
            alive = int(s.owner_alive)
        gauge("processes", alive, ("role", name))
    gauge("segment_bytes", s.header.total_size)
    gauge("segment_owner_up", int(s.owner_alive))
    return out
