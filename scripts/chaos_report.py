"""The chaos run's report: its settings, the ledger, and plots over time with every fault
marked, so a reader sees at a glance what each fault did. matplotlib is an optional
dependency (``pip install -e '.[report]'``); without it the report has no plots."""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path
from typing import Any

from chaos_load import Load

BREAKER_LEVEL = {"closed": 0, "open": 1, "probing": 2, "down": 0}


def _per_second(load: Load) -> dict[str, dict[int, list[float]]]:
    """Per whole second of the run: accepted (2xx, by host), refused, latencies."""
    out: dict[str, dict[int, list[float]]] = defaultdict(lambda: defaultdict(list))
    for a in load.attempts:
        sec = int(a.sent_s)
        if 200 <= a.status < 300:
            out[f"host {a.host}"][sec].append(1)
        else:
            out["not 2xx"][sec].append(1)
        if a.status:
            out["latency"][sec].append(a.latency_ms)
    return out


def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def plot(path: Path, load: Load, samples: list[Any], faults: list[Any], hosts: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series = _per_second(load)
    fig, axes = plt.subplots(4, 1, figsize=(11, 10), sharex=True)
    rate, lat, depth, state = axes
    seconds = range(max(series["latency"], default=0) + 1)
    for name in [*(f"host {h}" for h in range(hosts)), "not 2xx"]:
        counts = series[name]
        rate.plot(seconds, [len(counts.get(s, ())) for s in seconds], label=name)
    rate.set_ylabel("answers / s")
    rate.legend(loc="upper right", fontsize=8)
    points = sorted(series["latency"].items())
    xs = [s for s, _ in points]
    lat.plot(xs, [_quantile(v, 0.5) for _, v in points], label="p50")
    lat.plot(xs, [_quantile(v, 0.99) for _, v in points], label="p99")
    lat.set_yscale("log")
    lat.set_ylabel("latency, ms")
    lat.legend(loc="upper right", fontsize=8)
    for h in range(hosts):
        mine = [s for s in samples if s.host == h]
        depth.plot([s.t_s for s in mine], [s.depth for s in mine], label=f"host {h}")
        state.step(
            [s.t_s for s in mine],
            [BREAKER_LEVEL.get(s.breaker, 0) + 0.05 * h for s in mine],
            where="post",
            label=f"breaker, host {h}",
        )
        state.step(
            [s.t_s for s in mine],
            [-1 + 0.05 * h if s.degraded else -1.5 for s in mine],
            where="post",
            linestyle=":",
            label=f"degraded, host {h}",
        )
    depth.set_ylabel("settle queue depth")
    depth.legend(loc="upper right", fontsize=8)
    state.set_yticks([-1.5, -1, 0, 1, 2], ["node ok", "degraded", "closed", "open", "probing"])
    state.legend(loc="upper right", fontsize=7, ncol=2)
    state.set_xlabel("seconds since the load began")
    for f in faults:
        for ax in axes:
            ax.axvspan(f.start_s, max(f.end_s, f.start_s + 0.15), color="tab:red", alpha=0.15)
        rate.annotate(
            f.name,
            (f.start_s, 1.0),
            xycoords=("data", "axes fraction"),
            rotation=90,
            fontsize=7,
            va="top",
        )
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def write_report(
    path: Path,
    args: argparse.Namespace,
    load: Load,
    samples: list[Any],
    faults: list[Any],
    led: Any,
    plots: bool = True,
) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    f = led.figures
    image = path.with_suffix("").name + "-timeline.png"
    plotted = ""
    if plots:
        try:
            plot(path.parent / image, load, samples, faults, args.hosts)
            plotted = f"![accepted hooks/s, latency, queue depth, breaker]({image})\n"
        except ImportError:
            plotted = "(no plots: matplotlib is not installed; pip install -e '.[report]')\n"
    rows = "\n".join(f"| {x['start_s']:.1f} s | {x['name']} | {x['note']} |" for x in f["faults"])
    kills = "\n".join(
        f"| {k['fault']} | {k['host']} | {k['recovered_s']} | {k['5xx_within_2s']} "
        f"| {k['no_answer_within_2s']} |"
        for k in f["kills"]
    )
    changes = "\n".join(
        f"| {c['fault']} | {c['host']} | {c['done_s']} | {c['attempts']:,} | {c['5xx']} "
        f"| {c['no_answer']} |"
        for c in f["worker_changes"]
    )
    settle = "\n".join(
        f"| {i} | {s['enqueued']:,} | {s['sent']:,} | {s['expired']:,} | {s['corrupt']} "
        f"| {s['queued_at_end']} | {s['dropped_full']:,} | {s['drops_made_good']:,} "
        f"| {s['abandoned']} "
        f"| {'yes' if s['balanced'] else 'NO'} "
        f"| {s['breaker_opened']} |"
        for i, s in enumerate(f["settle"])
    )
    verdict = "every check passed" if not led.problems else "; ".join(led.problems)
    text = f"""# Reliability under faults

Produced by `{" ".join(["scripts/chaos.py", *_argv(args)])}`: {args.hosts} hosts (2 workers
each, rate limits and dedupe both fleet-scoped) on one private redis-server, an open-loop
load of {args.rate:g} signed hooks/s for {args.duration:g} s with provider-style retries, and
the faults below. Verdict: **{verdict}**.

{plotted}
## Faults

| at | fault | what |
|---|---|---|
{rows}

## Ledger

| figure | value |
|---|---|
| events offered | {f["events"]:,} |
| attempts (with retries) | {f["attempts"]:,} |
| answers by status (0 = no answer) | `{json.dumps(f["statuses"])}` |
| **lost** (answered 2xx, not in the host's store) | **{f["lost"]}** |
| events never acknowledged | {f["never_acknowledged"]} |
| copies stored per event key | `{json.dumps(f["copies_per_key"])}` |
| **stored, but not committed in Redis at the end** (a resend would be stored again) | \
**{f["stored_unknown_to_fleet"]}** |
| **duplicates stored while Redis was healthy** | **{f["duplicates_stored_redis_healthy"]}** |
| duplicates stored while Redis was stalled, down or just back | \
{f["duplicates_stored_redis_degraded"]} |
| **refused because of Redis** | **{f["refused_while_redis_degraded"]}** |
| 409 dedupe_pending (an event held by another attempt; retried) | {f["dedupe_pending_409"]} |
| 503 store_unavailable (the full disk; retried) | {f["store_unavailable_503"]} |
| latency while Redis was SIGSTOPped: p50 / p99 / max | \
{f["stall_p50_ms"]} / {f["stall_p99_ms"]} / {f["stall_max_ms"]} ms |
| of those, answers over budget + 5 ms / in a stall's first 100 ms | \
{f["stall_slow"]} / {f["stall_slow_in_first_100ms"]} |
| p99 latency away from every fault | {f["p99_outside_faults_ms"]} ms |

## Settle accounting, from each host's segment

enqueued = sent + expired + corrupt (failed their check) + still queued; dropped (queue
full) and abandoned (a producer killed between reserving and publishing) were never
enqueued. Drops made good: the drainer promoted again, from the store, every hook stored
since the drops began. A host rebooted (host-reboot) counts from its new segment.

| host | enqueued | sent | expired | corrupt | queued | dropped | made good | abandoned \
| balanced | breaker opened |
|---|---|---|---|---|---|---|---|---|---|---|
{settle}

## Processes killed

| fault | host | replaced after (s) | 5xx within 2 s | unanswered within 2 s |
|---|---|---|---|---|
{kills}

## Workers replaced (reload) and added then removed (scale)

The attempts sent from the signal until a second after the workers settled.
`net.ipv4.tcp_migrate_req` was {"1" if f["tcp_migrate_req"] else "0"} (see deploy.md, Reload).

| fault | host | settled after (s) | attempts | 5xx | unanswered |
|---|---|---|---|---|---|
{changes}
"""
    path.write_text(text)


def _argv(args: argparse.Namespace) -> list[str]:
    out = [f"--duration {args.duration:g}", f"--hosts {args.hosts}", f"--rate {args.rate:g}"]
    if args.faults != "all":
        out.append(f"--faults {args.faults}")
    return out
