#!/usr/bin/env python3
"""The settle queue's kill loop, as long as you like: the suite runs it with 300 kills.

Producers push numbered records while consumers are forked and SIGKILLed one after
another -- one in three by itself from inside ``commit``, the others after a random few
milliseconds -- and ``--victims`` producers are SIGKILLed between reserving a slot and
publishing it. Then what is left is drained and tallied (see ``tests/kill_loop.py``):

    cd /work/main && .venv/bin/python scripts/settle_kill_loop.py [--kills N] [--victims N]
        [--capacity N] [--grace-ms MS] [--seed N]

Exits 1 if a record told OK was never delivered, a record was delivered that no one was
told OK about or did not read back intact, depth was seen above capacity, or the slots
counted abandoned are not exactly the victims' (plus any producer told it stalled past the
grace period). Redeliveries -- a batch reported by a consumer killed before it committed --
are counted and allowed. The last line is one JSON object of the tally.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))  # kill_loop

import kill_loop

from ankusa_shm.shm import segment


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kills", type=int, default=3000, help="consumers SIGKILLed")
    ap.add_argument("--victims", type=int, default=10, help="producers SIGKILLed mid-push")
    ap.add_argument("--capacity", type=int, default=256, help="ring slots")
    ap.add_argument("--grace-ms", type=int, default=500, help="abandonment grace period")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    name = f"ankusa-kill-loop-{os.getpid()}"
    params = segment.make_params(queue_capacity=a.capacity, gcra_slots=16, process_slots=8)
    started = time.monotonic()
    try:
        with segment.Segment.create(name, params) as seg:
            t = kill_loop.run(seg, a.kills, a.victims, a.grace_ms, a.seed)
    finally:
        segment.unlink(name)
    figures = t.figures() | {"run_seconds": round(time.monotonic() - started, 1)}
    for k, v in figures.items():
        print(f"  {k:<22} {v}")
    bad = [
        k
        for k in ("lost", "phantom", "corrupt", "depth_over_capacity")
        if figures[k]  # the tally's "must be 0" figures
    ]
    if t.abandoned != t.victims + t.told_abandoned:
        bad.append("abandoned")
    print("FAIL: " + ", ".join(bad) if bad else "PASS")
    print(json.dumps(figures))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
