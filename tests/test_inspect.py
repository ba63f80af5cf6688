"""``ankusa-shm inspect`` and ``scripts/ankusa-shm-inspect``: read-only, clear, never a traceback.

Both are run as real commands (subprocesses) against a segment that real processes write.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from multiprocessing.synchronize import Event
from pathlib import Path
from typing import Any

import posix_ipc
import pytest
from proc_helpers import CTX, Children, claimed_row, dead_pid

from ankusa_shm.clock import monotonic_ms
from ankusa_shm.shm import breaker, procs
from ankusa_shm.shm import layout as L
from ankusa_shm.shm.counters import Counter
from ankusa_shm.shm.degraded import Degraded
from ankusa_shm.shm.segment import Segment
from ankusa_shm.shm.settle_queue import Op, Pushed, Record, SettleQueue
from ankusa_shm.shm.snapshot import GAUGES

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "ankusa-shm-inspect"
CONSOLE = Path(sys.executable).parent / "ankusa-shm"  # the installed console script
WRITERS = 2


def run(*argv: str | Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(a) for a in argv], capture_output=True, text=True, timeout=60, cwd=ROOT, env=env
    )


def script(*args: str) -> subprocess.CompletedProcess[str]:
    """Run as a user would from a shell without the .venv on PATH: the script finds it."""
    return run(SCRIPT, *args, env={**os.environ, "PATH": "/usr/bin:/bin"})


def console(*args: str) -> subprocess.CompletedProcess[str]:
    return run(CONSOLE, *args)


def module(*args: str) -> subprocess.CompletedProcess[str]:
    return run(sys.executable, "-m", "ankusa_shm", *args)


def assert_refused(r: subprocess.CompletedProcess[str], says: str) -> None:
    assert r.returncode == 2, r
    assert r.stdout == ""
    assert "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert says in r.stderr


def served(index: int) -> int:
    """How many requests writer ``index`` reports: a different figure for each."""
    return 100 * (index + 1)


def _writer(name: str, index: int, ready: Event, stop: Event) -> int:
    with Segment.attach(name) as s:
        slot = procs.claim(s.view, s.layout, procs.Role.WORKER)
        for _ in range(served(index)):
            slot.counters.add(Counter.REQUESTS)
            slot.counters.add(Counter.ADMIT_OK)
        ready.set()
        while not stop.is_set():
            slot.heartbeat(monotonic_ms())
            time.sleep(0.001)
        return os.getpid()


@pytest.fixture
def busy(seg: Segment) -> Iterator[list[int]]:
    """The segment in a recognisable state, with writer processes running; their pids."""
    seg.write_config({"fleet": {"breaker_window_ms": 20_000}})
    seg.view.store(
        seg.layout.offset("breaker") + L.BR_STATE, breaker.pack(breaker.State.OPEN, 0, 12345)
    )
    Degraded(seg.view, seg.layout).failed("dedupe", 1)
    q = SettleQueue(seg.view, seg.buf, seg.layout)
    for i in range(2):
        q.push(Record(Op.PROMOTE, b"k%d" % i, bytes(16), b"h%d" % i, 1, 2, 3))
    stop = CTX.Event()
    with Children() as kids:
        for i in range(WRITERS):
            ready = CTX.Event()
            kids.start(_writer, seg.name, i, ready, stop)
            assert ready.wait(60)
        yield [p.pid for p in kids.procs if p.pid is not None]
        stop.set()
        kids.collect()
        kids.join()


def test_text_view_of_a_live_segment(seg: Segment, busy: list[int]) -> None:
    r = script("--name", seg.name)
    assert r.returncode == 0, r.stderr
    assert r.stderr == ""
    out = r.stdout
    assert f"segment   {seg.name}  " in out
    assert f"owner pid {os.getpid()} (running)" in out
    assert "breaker   open  window 20 s" in out
    assert "rate_limit=no  dedupe=YES" in out
    assert f"queue     2 / {seg.layout.params.queue_capacity} queued" in out
    header = next(line.split() for line in out.splitlines() if line.split()[:2] == ["slot", "pid"])
    assert header[-2:] == ["requests", "claims"]
    rows = {line.split()[1]: line.split() for line in out.splitlines() if "worker" in line}
    for i, pid in enumerate(busy):
        assert rows[str(pid)][2] == "worker"
        assert rows[str(pid)][-2:] == [str(served(i)), "1"]  # requests served, claims


def test_json_view_of_a_live_segment(seg: Segment, busy: list[int]) -> None:
    args = ("inspect", "--name", seg.name, "--json")
    for r in (console(*args), module(*args)):
        assert r.returncode == 0, r.stderr
        doc: dict[str, Any] = json.loads(r.stdout)
        assert doc["version"] == 1
        assert doc["segment"]["name"] == seg.name
        assert doc["segment"]["owner_pid"] == os.getpid()
        assert doc["segment"]["owner_running"] is True
        assert doc["segment"]["layout_version"] == L.LAYOUT_VERSION
        assert doc["breaker"]["state"] == "open"
        assert doc["breaker"]["since_ms"] == 12345
        assert doc["breaker"]["window_ms"] == 20_000
        assert doc["degraded"] == {"rate_limit": False, "dedupe": True}
        assert doc["queue"]["depth"] == 2
        assert doc["queue"]["capacity"] == seg.layout.params.queue_capacity
        workers = {p["pid"]: p for p in doc["processes"] if p["role"] == "worker"}
        assert set(workers) == set(busy)
        assert [workers[pid]["requests"] for pid in busy] == [served(i) for i in range(WRITERS)]
        assert all(p["alive"] and p["state"] == "running" for p in doc["processes"])
        assert doc["figures"]["requests"] == sum(served(i) for i in range(WRITERS))
        assert doc["figures"]['admit{result="ok"}'] > 0
        assert doc["figures"]['processes{role="worker"}'] == WRITERS
        assert doc["figures"]['processes{role="supervisor"}'] == 1  # the owner, slot or not
        assert doc["figures"]["fleet_breaker_state"] == 1
        assert doc["config"] == {"fleet": {"breaker_window_ms": 20_000}}


def test_a_dead_owner_is_shown_not_running(seg: Segment) -> None:
    seg.view.store(L.H_OWNER_PID, dead_pid())
    r = script("--name", seg.name)
    assert r.returncode == 0
    assert "(NOT RUNNING)" in r.stdout
    doc = json.loads(console("inspect", "--name", seg.name, "--json").stdout)
    assert doc["segment"]["owner_running"] is False
    assert doc["figures"]["segment_owner_up"] == 0
    assert doc["figures"]['processes{role="supervisor"}'] == 0


def test_inspect_never_writes(seg: Segment) -> None:
    seg.write_config({"a": 1})
    procs.claim(seg.view, seg.layout, procs.Role.SUPERVISOR, now_ms=1)
    SettleQueue(seg.view, seg.buf, seg.layout).push(
        Record(Op.RELEASE, b"k", bytes(16), b"h", 1, 2, 3)
    )
    before = hashlib.sha256(seg.buf).hexdigest()
    assert script("--name", seg.name).returncode == 0
    assert console("inspect", "--name", seg.name, "--json").returncode == 0
    assert hashlib.sha256(seg.buf).hexdigest() == before


def test_missing_segment(seg_name: str) -> None:
    assert_refused(script("--name", seg_name), f"no segment named /{seg_name}")
    assert_refused(console("inspect", "--name", seg_name, "--json"), "no segment named")


def _raw(name: str, data: bytes) -> None:
    shm = posix_ipc.SharedMemory("/" + name, posix_ipc.O_CREX, mode=0o600, size=len(data))
    try:
        os.pwrite(shm.fd, data, 0)
    finally:
        shm.close_fd()


def test_garbage_segment(seg_name: str) -> None:
    _raw(seg_name, secrets.token_bytes(8192))
    assert_refused(script("--name", seg_name), "not an ankusa-shm segment")
    assert_refused(console("inspect", "--name", seg_name, "--json"), "not an ankusa-shm")


def test_truncated_segment(seg_name: str) -> None:
    _raw(seg_name, secrets.token_bytes(100))
    assert_refused(script("--name", seg_name), "too small")


def test_other_layout_version(seg: Segment) -> None:
    seg.view.store(L.H_VERSION, 99)
    assert_refused(script("--name", seg.name), "layout version 99")


def test_corrupt_region_table(seg: Segment) -> None:
    seg.view.add(L.region_offsets("queue")[0], L.LINE)
    assert_refused(console("inspect", "--name", seg.name, "--json"), "'queue'")


NO_ROLE = (0xF << L.PS_ROLE_SHIFT) | (procs.SlotState.RUNNING << L.PS_STATE_SHIFT) | 1


@pytest.mark.parametrize(
    ("region", "at", "word"),
    [
        ("breaker", L.BR_STATE, -1),  # a state that names no state
        ("processes", L.PS_HEADER, NO_ROLE),  # a running slot whose role names no role
        ("processes", L.PS_HEADER, 0xFFFFFFFF),
        ("queue", L.Q_CONSUMER, 2**40),  # a consumer pid no pid can be
        (None, L.H_OWNER_PID, 2**40),
    ],
    ids=["breaker-state", "slot-role", "slot-pid", "consumer-pid", "owner-pid"],
)
def test_corrupt_contents_under_a_whole_header(
    seg: Segment, region: str | None, at: int, word: int
) -> None:
    seg.view.store((seg.layout.offset(region) if region else 0) + at, word)
    assert_refused(script("--name", seg.name), "corrupt")
    assert_refused(console("inspect", "--name", seg.name, "--json"), "corrupt")


def test_a_damaged_queue_of_a_stopped_service_is_named(seg: Segment) -> None:
    queue = SettleQueue(seg.view, seg.buf, seg.layout)
    assert queue.push(Record(Op.PROMOTE, b"k", bytes(16), b"h", 1, 2, 3)) is Pushed.OK
    seg.view.store(L.H_OWNER_PID, dead_pid())  # stopped: nothing moves the ring
    r = console("inspect", "--name", seg.name, "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["queue"]["depth"] == 1
    seg.view.store(seg.layout.offset("queue") + L.Q_ENQUEUE, 2**40)
    assert_refused(script("--name", seg.name), "settle queue: enqueue position")
    assert_refused(console("inspect", "--name", seg.name, "--json"), "rebuilds the queue")


def test_invalid_name() -> None:
    assert_refused(script("--name", "a/b"), "invalid segment name")


def test_watch_must_be_finite() -> None:
    r = console("inspect", "--watch", "inf")
    assert r.returncode == 2 and "must be positive and finite" in r.stderr
    assert "Traceback" not in r.stderr


def test_list_names_every_figure() -> None:
    for r in (script("--list"), console("inspect", "--list")):
        assert r.returncode == 0
        listed = {line.split()[0] for line in r.stdout.splitlines()}
        assert {c.family for c in Counter} <= listed
        assert set(GAUGES) <= listed
        for line in r.stdout.splitlines():
            assert line.split()[1] in ("counter", "gauge", "histogram")
            assert len(line.split()) > 2, f"no help text: {line!r}"


def test_watch_redraws_until_interrupted(seg: Segment) -> None:
    p = subprocess.Popen(
        [str(CONSOLE), "inspect", "--name", seg.name, "--json", "--watch", "0.05"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        # Ctrl-C as a terminal sends it, even where this test runs with SIGINT ignored (a
        # background job inherits that, and Python then never raises KeyboardInterrupt).
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    watchdog = threading.Timer(60, p.kill)  # a silent watcher must not hang readline()
    watchdog.start()
    try:
        assert p.stdout is not None
        first = json.loads(p.stdout.readline())
        claimed_row(seg, 0).add(Counter.REQUESTS, 7)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            doc = json.loads(p.stdout.readline())
            if doc["figures"]["requests"] == 7:
                break
        assert first["figures"]["requests"] == 0
        assert doc["figures"]["requests"] == 7  # a later view sees the change
        p.send_signal(signal.SIGINT)
        _, err = p.communicate(timeout=60)
        assert p.returncode == 0
        assert "Traceback" not in err
    finally:
        watchdog.cancel()
        if p.poll() is None:
            p.kill()
            p.communicate(timeout=10)
