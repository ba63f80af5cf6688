"""The long fuzzing campaign: bad HTTP, bad config files, corrupt segments, in bulk.

The generators and judges are ``tests/fuzz_cases.py``'s, so the campaign and the suite's
bounded run (``tests/test_fuzz.py``) agree on what a failure is. Prints the command, one
line per target, and last one JSON object; exits 1 on any crash, hang, restart or lost
hook. Bugs already reported (``KNOWN_BUGS``) are counted apart and also exit 1: they are
bugs.

    .venv/bin/python scripts/fuzz.py                      # 100 000 cases
    .venv/bin/python scripts/fuzz.py --cases 5000 --target http config
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

import fuzz_cases as F

SHARE = {"http": 0.2, "config": 0.4, "segment": 0.4}  # of --cases, among the targets chosen


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--cases", type=int, default=100_000, help="cases across the targets")
    p.add_argument("--target", nargs="+", choices=list(SHARE), default=list(SHARE))
    p.add_argument("--seed", type=int, default=int(time.time()), help="to replay a campaign")
    args = p.parse_args()
    print("command:", shlex.join([sys.executable, *sys.argv]), f"(seed {args.seed})")
    total = sum(SHARE[t] for t in args.target)
    tallies = []
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="ankusa-fuzz-") as tmp:
        for target in args.target:
            n = max(1, round(args.cases * SHARE[target] / total))
            t = F.Tally(target)
            workdir = Path(tmp) / target
            workdir.mkdir()
            if target == "http":
                F.run_http(n, workdir, t, args.seed)
            elif target == "config":
                F.run_config(n, workdir, t, derandomize=False, seed=args.seed)
            else:
                name = f"ankusa-fuzz-{os.getpid()}-{uuid.uuid4().hex[:8]}"
                F.run_segment(n, name, t, args.seed, cli_every=max(1, n // 100))
            tallies.append(t)
            print(_line(t), flush=True)
            for f in t.failures:
                print("   ", f[:600])
            for sig, count in t.known.items():
                print(f"    known bug x{count}: {F.KNOWN_BUGS[sig]}")
    seconds = time.monotonic() - started
    failed = any(t.bad or t.known for t in tallies)
    doc: dict[str, Any] = {t.target: t.summary() for t in tallies}
    doc.update(seed=args.seed, seconds=round(seconds, 1), failed=failed)
    print(json.dumps(doc))
    return 1 if failed else 0


def _line(t: F.Tally) -> str:
    s = t.summary()
    return (
        f"{t.target:<8} {s['cases']:>7} cases  {s['ok']:>6} ok  {s['errors']:>6} errors answered"
        f"  {s['crashes']} crashes  {s['hangs']} hangs  {s['restarts']} worker restarts"
        f"  {s['lost']} lost  {s['known_bugs']} known bugs  {s['seconds']} s"
    )


if __name__ == "__main__":
    sys.exit(main())
