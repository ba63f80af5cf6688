"""``ankusa-shm inspect``: look into a live segment without touching it, like varnishstat.

Maps the segment read-only (it works for a user who may only read it), prints one view
and exits -- or, with ``--watch``, redraws every few seconds with per-second rates.
``--json`` is for machines and carries a ``version``; ``--list`` names every figure.
A missing, foreign or corrupt segment is one line on stderr and exit status 2.
"""

from __future__ import annotations

import json
import math
import sys
import time
from datetime import UTC, datetime
from typing import Any, TextIO

from ankusa_shm.shm import histograms, snapshot
from ankusa_shm.shm.segment import Segment, SegmentError

JSON_VERSION = 1
EXIT_UNUSABLE = 2


def run(name: str, as_json: bool, watch: float | None, out: TextIO = sys.stdout) -> int:
    try:
        seg = Segment.attach(name, readonly=True)
    except SegmentError as e:
        print(f"ankusa-shm inspect: {e}", file=sys.stderr)
        return EXIT_UNUSABLE
    with seg:
        try:
            if watch is None:
                snap = snapshot.take(seg)
                out.write(to_json(snap) + "\n" if as_json else render(snap))
                return 0
            return _watch(seg, as_json, watch, out)
        except SegmentError as e:
            print(f"ankusa-shm inspect: {e}", file=sys.stderr)
            return EXIT_UNUSABLE
        except ValueError as e:
            # A whole header over words no writer writes (a breaker or slot state that
            # names no state): corrupt too, and said so in one line like the others.
            print(f"ankusa-shm inspect: segment {seg.name} is corrupt: {e}", file=sys.stderr)
            return EXIT_UNUSABLE


def _watch(seg: Segment, as_json: bool, every: float, out: TextIO) -> int:
    prev: snapshot.Snapshot | None = None
    clear = "\x1b[H\x1b[2J" if out.isatty() and not as_json else ""
    try:
        while True:
            snap = snapshot.take(seg)
            out.write(to_json(snap) + "\n" if as_json else clear + render(snap, prev))
            out.flush()
            prev = snap
            time.sleep(every)
    except KeyboardInterrupt:
        return 0


def list_figures(out: TextIO = sys.stdout) -> int:
    for family, kind, help in snapshot.declared():
        out.write(f"{family:<36} {kind:<8} {help}\n")
    return 0


def to_json(s: snapshot.Snapshot) -> str:
    doc: dict[str, Any] = {
        "version": JSON_VERSION,
        "segment": {
            "name": s.name,
            "bytes": s.header.total_size,
            "layout_version": s.header.version,
            "owner_pid": s.header.owner_pid,
            "owner_running": s.owner_alive,
            "created": _iso(s.header.created_ns),
            "params": vars(s.header.params),
        },
        "breaker": vars(s.breaker),
        "degraded": s.degraded,
        "queue": {
            "depth": s.queue_depth,
            "capacity": s.queue_capacity,
            "consumer_pid": s.consumer_pid,
            "consumer_running": s.consumer_alive,
        },
        "limiter": {"slots": s.limiter_slots, "used": s.limiter_used, "filling": s.limiter_filling},
        "processes": [
            {**vars(p), "heartbeat_age_ms": s.taken_ms - p.heartbeat_ms} for p in s.processes
        ],
        "figures": {f.label: _json_value(f) for f in snapshot.figures(s)},
        "config": s.config,
    }
    return json.dumps(doc, sort_keys=True)


def render(s: snapshot.Snapshot, prev: snapshot.Snapshot | None = None) -> str:
    h, b = s.header, s.breaker
    owner = "running" if s.owner_alive else "NOT RUNNING"
    consumer = (
        f"pid {s.consumer_pid} ({'running' if s.consumer_alive else 'not running'})"
        if s.consumer_pid
        else "none"
    )
    lines = [
        f"segment   {s.name}  {h.total_size / 2**20:.1f} MiB  layout v{h.version}  "
        f"owner pid {h.owner_pid} ({owner})  created {_iso(h.created_ns)}",
        f"breaker   {b.state}  window {b.window_ms / 1000:g} s: "
        f"{b.window_calls} calls, {b.window_failures} failed",
        "degraded  " + "  ".join(f"{k}={'YES' if on else 'no'}" for k, on in s.degraded.items()),
        f"queue     {s.queue_depth} / {s.queue_capacity} queued  consumer {consumer}",
        f"limiter   {s.limiter_used} / {s.limiter_slots} slots used ({s.limiter_filling} filling)",
        "",
        f"{'slot':>4}  {'pid':>7}  {'role':<10} {'state':<9} {'heartbeat':>12} "
        f"{'requests':>10}  claims",
    ]
    for p in s.processes:
        age = "dead" if not p.alive else f"{s.taken_ms - p.heartbeat_ms} ms ago"
        lines.append(
            f"{p.slot:>4}  {p.pid:>7}  {p.role:<10} {p.state:<9} {age:>12} "
            f"{p.requests:>10}  {p.claims}"
        )
    lines += ["", f"{'figure':<52} {'value':>14}" + ("  per second" if prev else "")]
    dt = (s.taken_ms - prev.taken_ms) / 1000 if prev else 0.0
    before = {f.label: f.value for f in snapshot.figures(prev)} if prev else {}
    for f in snapshot.figures(s):
        v = f.value  # whole numbers in full: 35184640, not 3.51846e+07
        value = str(int(v)) if float(v).is_integer() else f"{v:g}"
        row = f"{f.label:<52} {value:>14}"
        if prev and f.kind != "gauge" and dt > 0:
            row += f"  {(f.value - before.get(f.label, 0)) / dt:>10.1f}"
        if f.kind == "histogram":
            row += "  " + "  ".join(f"{k} {_amount(f, v)}" for k, v in _summary(f).items())
        lines.append(row)
    return "\n".join(lines) + "\n"


QUANTILES = {"p50": 0.5, "p90": 0.9, "p99": 0.99}


def _summary(f: snapshot.Figure) -> dict[str, float | None]:
    """A histogram's mean and quantiles, in its unit (seconds, or hooks)."""
    out: dict[str, float | None] = {"mean": f.sum / f.value if f.value else None}
    out.update({k: histograms.quantile(f.buckets, q) for k, q in QUANTILES.items()})
    return out


def _amount(f: snapshot.Figure, v: float | None) -> str:
    if v is None:
        return "-"
    return f"{v * 1000:.2f} ms" if f.family.endswith("_seconds") else f"{v:.1f}"


def _json_value(f: snapshot.Figure) -> float | dict[str, Any]:
    if f.kind != "histogram":
        return f.value
    buckets = [["+Inf" if math.isinf(le) else le, n] for le, n in f.buckets]
    return {"count": f.value, "sum": f.sum, **_summary(f), "buckets": buckets}


def _iso(ns: int) -> str:
    return datetime.fromtimestamp(ns / 1e9, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
