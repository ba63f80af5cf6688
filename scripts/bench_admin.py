#!/usr/bin/env python3
"""What operating the edge costs the hooks it serves, in one run (wrk; see bench_http.py).

  metrics   hooks/s with ``server.request_metrics`` on against off (counts by source and
            status, latency and batch histograms), ROUNDS runs of each in the order on,
            off, off, on, ... (runs here vary by 10 % and more, and whichever always went
            first came out 10 % slower); the ratio of the medians (target >= 0.97)
  scrape    GET /metrics every SCRAPE_EVERY_S while the service takes the full load:
            the scrape's latency (target p99 <= 50 ms)
  consume   a consumer reads every hook through GET /v1/hooks (pages of PAGE, long-poll
            when caught up) while the writes run at full speed: hooks/s read, and the
            writers' hooks/s against the metrics-on runs without a reader (target: at
            most 10 % slower)

The store uses ``durability = "os"`` here: an fsync's latency varies by more from run to
run on this disk than the few per cent measured, and none of these figures is about the
disk. The last line is one JSON object.

  .venv/bin/python scripts/bench_admin.py      (needs wrk: apt-get install -y wrk)
"""

from __future__ import annotations

import http.client
import json
import shlex
import shutil
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_http as bh  # the same load, targets and report
from redis_server import free_port

ROUNDS = 4
SECONDS = 8
SCRAPE_EVERY_S = 0.1
PAGE = 1_000


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def get(port: int, path: str, timeout: float = 10.0) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("GET", path)
        r = conn.getresponse()
        return r.status, r.read()
    finally:
        conn.close()


def scraper(port: int) -> bh.During:
    def start() -> Callable[[], dict[str, float]]:
        stop = threading.Event()
        latencies: list[float] = []
        failures = [0]

        def loop() -> None:
            while not stop.is_set():
                t0 = time.perf_counter()
                status, body = get(port, "/metrics")
                latencies.append((time.perf_counter() - t0) * 1000)
                if status != 200 or b"ankusa_request_duration_seconds_count" not in body:
                    failures[0] += 1
                stop.wait(SCRAPE_EVERY_S)

        thread = threading.Thread(target=loop, daemon=True)
        thread.start()

        def done() -> dict[str, float]:
            stop.set()
            thread.join()
            return {
                "scrapes": len(latencies),
                "scrape_failures": failures[0],
                "scrape_p50_ms": percentile(latencies, 0.5),
                "scrape_p99_ms": percentile(latencies, 0.99),
                "scrape_max_ms": max(latencies),
            }

        return done

    return start


def consumer(port: int) -> bh.During:
    def start() -> Callable[[], dict[str, float]]:
        stop = threading.Event()
        read = [0]
        pages = [0]
        seen: set[str] = set()
        repeats = [0]
        t0 = time.perf_counter()

        def loop() -> None:
            cursor = 0
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
            while not stop.is_set():
                conn.request("GET", f"/v1/hooks?after={cursor}&limit={PAGE}&wait=1")
                doc = json.loads(conn.getresponse().read())
                for h in doc["hooks"]:
                    if h["id"] in seen:
                        repeats[0] += 1
                    seen.add(h["id"])
                read[0] += len(doc["hooks"])
                pages[0] += 1
                cursor = doc["cursor"]
            conn.close()

        thread = threading.Thread(target=loop, daemon=True)
        thread.start()

        def done() -> dict[str, float]:
            elapsed = time.perf_counter() - t0
            stop.set()
            thread.join()
            return {
                "read": read[0],
                "read_per_s": read[0] / elapsed,
                "read_repeats": repeats[0],
                "pages": pages[0],
            }

        return done

    return start


def main() -> int:
    print("command: " + " ".join(shlex.quote(a) for a in [sys.executable, *sys.argv]))
    if shutil.which("wrk") is None:
        print("bench_admin: wrk is not on PATH; install it (apt-get install -y wrk).")
        return 1
    print(
        f"load: wrk -t{bh.THREADS} -c{bh.CONNECTIONS}, {bh.WARMUP_S} s warm-up then {SECONDS} s "
        f"measured, closed loop; {bh.WORKERS} workers, node scope, durability os"
    )
    work = Path(tempfile.mkdtemp(prefix="bench-admin-"))
    on: list[float] = []
    off: list[float] = []
    lost = 0

    def run(
        name: str, metrics: bool, during: Callable[[int], bh.During] | None = None
    ) -> bh.Result:
        nonlocal lost
        port = free_port()
        t = bh.ankusa_target(
            name, port, work, "redis://127.0.0.1:1/0", "os", {"request_metrics": metrics}
        )
        admin = t.admin_port
        assert admin is not None
        hook = during(admin) if during else None
        r = bh.run_target(t, port, work, lua, pool, None, hook, SECONDS)
        lost += r.lost
        print(f"{bh.line(r)}\n       (request_metrics {'on' if metrics else 'off'})", flush=True)
        return r

    try:
        pool, lua = bh.prepare(work)
        for i in range(ROUNDS):  # on, off, off, on, ...: neither goes first every round
            for metrics in (True, False) if i % 2 == 0 else (False, True):
                name = f"{'on' if metrics else 'off'}{i}"
                (on if metrics else off).append(run(name, metrics).hooks_per_s)
        scraped = run("scrape", True, scraper)
        consumed = run("consume", True, consumer)
    finally:
        shutil.rmtree(work, ignore_errors=True)

    ratio = statistics.median(on) / statistics.median(off)
    s = scraped.extra
    c = consumed.extra
    slowdown = 1 - consumed.hooks_per_s / statistics.median(on)
    print("figures:")
    print(f"  metrics on / off      {ratio:6.3f}   target >= 0.97: {bh.verdict(ratio >= 0.97)}")
    print(f"     on  {', '.join(f'{x:,.0f}' for x in on)} hooks/s")
    print(f"     off {', '.join(f'{x:,.0f}' for x in off)} hooks/s")
    print(
        f"  scrape under load     p50 {s['scrape_p50_ms']:.1f} ms  p99 {s['scrape_p99_ms']:.1f} ms"
        f"  max {s['scrape_max_ms']:.1f} ms over {s['scrapes']:.0f} scrapes"
        f"  target p99 <= 50 ms: {bh.verdict(s['scrape_p99_ms'] <= 50)}"
    )
    print(
        f"  consumer              {c['read_per_s']:,.0f} hooks/s read ({c['read']:,.0f}, "
        f"{c['read_repeats']:.0f} repeats, {c['read'] / max(1, c['pages']):.0f} a page) "
        f"while writing {consumed.hooks_per_s:,.0f} hooks/s: "
        f"writers {slowdown:+.1%} slower  target <= 10%: {bh.verdict(slowdown <= 0.10)}"
    )
    figures = {
        "metrics_on_hooks_per_s": [round(x, 1) for x in on],
        "metrics_off_hooks_per_s": [round(x, 1) for x in off],
        "metrics_on_vs_off": round(ratio, 3),
        "scrape_p50_ms": round(s["scrape_p50_ms"], 2),
        "scrape_p99_ms": round(s["scrape_p99_ms"], 2),
        "scrape_max_ms": round(s["scrape_max_ms"], 2),
        "scrape_failures": s["scrape_failures"],
        "consumer_read_per_s": round(c["read_per_s"], 1),
        "consumer_repeats": c["read_repeats"],
        "consumer_pages": c["pages"],
        "writes_with_consumer_per_s": round(consumed.hooks_per_s, 1),
        "writer_slowdown": round(slowdown, 3),
        "lost": lost,
    }
    print(json.dumps(figures, sort_keys=True))
    return 1 if lost or s["scrape_failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
