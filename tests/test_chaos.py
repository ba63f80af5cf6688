"""The short chaos run: two hosts on one private Redis, a provider's load with retries, a
worker SIGKILL, a Redis SIGSTOP longer than every budget and TTL, a reload, a drainer
SIGKILL -- and the ledger of every hook. Latency targets belong to the full run
(scripts/chaos.py); here only what must hold on any machine: nothing lost, nothing refused
because of Redis, no duplicate while Redis was healthy, the settle accounting exact, every
killed process replaced, every attempt during the reload answered."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from conftest import _need_redis_server

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "chaos.py"


def test_short_chaos_run_loses_nothing_and_balances() -> None:
    _need_redis_server()
    r = subprocess.run(
        [sys.executable, str(SCRIPT), "--duration", "10", "--faults", "short", "--rate", "600"],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert r.stdout.strip(), r.stderr
    led = json.loads(r.stdout.strip().splitlines()[-1])
    report = r.stdout[-4000:]
    assert led["events"] >= 5_000, report
    assert led["lost"] == 0, report
    assert led["acknowledged_without_copy"] == 0, report
    assert led["never_acknowledged"] == 0, report
    assert led["refused_while_redis_degraded"] == 0, report
    assert led["duplicates_stored_redis_healthy"] == 0, report
    assert all(s["balanced"] for s in led["settle"]), report
    assert all(s["breaker_opened"] >= 1 for s in led["settle"]), report  # the stall was seen
    assert {k["fault"] for k in led["kills"]} == {"worker-kill", "drainer-kill"}, report
    assert all(k["recovered_s"] is not None and k["5xx_within_2s"] == 0 for k in led["kills"])
    (reload,) = led["worker_changes"]
    assert reload["done_s"] is not None, report
    assert (reload["no_answer"], reload["5xx"]) == (0, 0), report
    assert [p for p in led["problems"] if "p99" not in p and "recovered in" not in p] == []
    print("\n".join(r.stdout.splitlines()[-12:-1]))  # the ledger, for -s
