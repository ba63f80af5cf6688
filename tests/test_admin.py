"""The admin API of a real ``ankusa-shm serve`` in a subprocess, over real HTTP: metrics
from the segment, health and readiness, tenant overrides that every worker applies and a
restart keeps, the consumer API with its long-poll, retention, and the bearer token."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import cannot_run
from load_client import GITHUB_SOURCE, SECRET, signed
from prometheus_client.openmetrics import parser as om_parser
from prometheus_client.parser import text_string_to_metric_families
from redis_server import free_port
from service import Service

from ankusa_shm.shm import procs
from ankusa_shm.shm.segment import Segment

DEMO_SOURCE = """
[[sources]]
id = "demo"
tenant = "demo"
dedupe = { json_path = "id" }
"""
REST = "[rate_limits]\ndefault = { rate = 1000, burst = 1000 }\n" + DEMO_SOURCE + GITHUB_SOURCE
ENV = {"GH_SECRET": SECRET}
FAST = {"graceful_timeout_s": 2.0, "heartbeat_timeout_s": 3.0}


@pytest.fixture
def make(tmp_path: Path) -> Iterator[Callable[..., Service]]:
    made: list[Service] = []

    def service(rest: str = REST, **kw: Any) -> Service:
        kw.setdefault("env", ENV)
        kw["server"] = {**FAST, **kw.get("server", {})}
        s = Service(tmp_path / f"svc{len(made)}", rest, **kw)
        made.append(s)
        return s

    yield service
    for s in made:
        s.close()


@pytest.fixture(scope="module")
def svc_once(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    """One service for the tests that need no fresh one (they only read, or add a hook)."""
    s = Service(tmp_path_factory.mktemp("once"), REST, env=ENV, server=FAST)
    try:
        yield s.start()
    finally:
        s.close()


def admin_json(
    svc: Service, method: str, path: str, body: Any = None, headers: dict[str, str] | None = None
) -> tuple[int, Any]:
    raw = body if body is None or isinstance(body, bytes) else json.dumps(body).encode()
    status, _, answer = svc.admin(method, path, raw, headers)
    return status, json.loads(answer)


def wait_until(check: Callable[[], object], timeout: float = 10.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(0.05)
    raise AssertionError(f"not within {timeout} s: {what}")


def demo(svc: Service, event_id: str) -> int:
    return svc.post("demo", json.dumps({"id": event_id}).encode()).status


def scrape(svc: Service) -> dict[str, list[Any]]:
    """Samples by name, as Prometheus parses them."""
    status, headers, raw = svc.admin("GET", "/metrics")
    assert status == 200 and headers["content-type"].startswith("text/plain")
    samples: dict[str, list[Any]] = {}
    for family in text_string_to_metric_families(raw.decode()):
        for s in family.samples:
            samples.setdefault(s.name, []).append(s)
    return samples


def requests_by(samples: dict[str, list[Any]]) -> dict[tuple[str, str], float]:
    return {
        (s.labels["source"], s.labels["status"]): s.value
        for s in samples["ankusa_http_requests_total"]
        if s.value
    }


def answered(samples: dict[str, list[Any]]) -> float:
    (count,) = samples["ankusa_request_duration_seconds_count"]
    return float(count.value)


# -- metrics ---------------------------------------------------------------------------


def test_metrics_count_every_answer_by_source_and_status(make: Callable[..., Service]) -> None:
    svc = make().start()
    sent: dict[tuple[str, str], int] = {}

    def tally(source: str, status: int) -> None:
        sent[(source, str(status))] = sent.get((source, str(status)), 0) + 1

    for i in range(6):
        tally("demo", demo(svc, f"evt-{i}"))
    for i in range(3):
        tally("demo", demo(svc, f"evt-{i}"))  # duplicates: 201 too
    for _ in range(4):
        body = b'{"forged":true}'
        tally("github", svc.post("github", body, signed(body, secret="wrong")).status)
    for _ in range(2):
        tally("", svc.post("nosuch", b"{}").status)
    body = b'{"ref":"main"}'
    tally("github", svc.post("github", body, signed(body)).status)
    assert sent == {("demo", "201"): 9, ("github", "401"): 4, ("", "404"): 2, ("github", "201"): 1}
    total = sum(sent.values())

    # A worker counts an answer just after writing it: give the last one a moment.
    wait_until(lambda: answered(scrape(svc)) >= total, 3.0, "every answer observed")
    samples = scrape(svc)
    assert requests_by(samples) == {k: float(n) for k, n in sent.items()}
    assert answered(samples) == total

    status, headers, raw = svc.admin(
        "GET", "/metrics", headers={"accept": "application/openmetrics-text; version=1.0.0"}
    )
    assert status == 200
    assert headers["content-type"].startswith("application/openmetrics-text")
    assert raw.endswith(b"# EOF\n")
    parsed = om_parser.text_string_to_metric_families(raw.decode())  # type: ignore[no-untyped-call]
    families = {f.name: f for f in parsed}
    om = {
        (s.labels["source"], s.labels["status"]): s.value
        for s in families["ankusa_http_requests"].samples
        if s.value
    }
    assert om == {k: float(n) for k, n in sent.items()}


def test_every_store_transaction_is_timed_once(make: Callable[..., Service]) -> None:
    """Each committed transaction is one observation of its hooks, its wait for the
    writers' lock and its time holding it -- recorded before its hooks are answered."""
    svc = make().start()
    assert [demo(svc, f"t-{i}") for i in range(8)] == [201] * 8
    assert demo(svc, "t-0") == 201  # a duplicate is answered by a transaction too
    samples = scrape(svc)

    def value(name: str) -> float:
        (sample,) = samples[name]
        return float(sample.value)

    assert value("ankusa_store_batch_hooks_sum") == 9
    transactions = value("ankusa_store_batch_hooks_count")
    assert 1 <= transactions <= 9
    assert value("ankusa_store_lock_wait_seconds_count") == transactions
    assert value("ankusa_store_lock_held_seconds_count") == transactions
    assert value("ankusa_store_lock_held_seconds_sum") > 0


def test_a_sigkilled_workers_observations_are_kept(make: Callable[..., Service]) -> None:
    svc = make().start()
    n = 20
    assert [demo(svc, f"k-{i}") for i in range(n)] == [201] * n
    with Segment.attach(svc.segment, readonly=True) as seg:
        busy = [
            p for p in procs.read(seg.view, seg.layout) if p.role == "worker" and p.requests > 0
        ]
    victim = busy[0].pid
    os.kill(victim, signal.SIGKILL)
    wait_until(
        lambda: len(svc.pids("worker")) == 2 and victim not in svc.pids("worker"),
        what="the killed worker replaced",
    )
    samples = scrape(svc)  # the dead worker's rows are still counted, and nothing twice
    assert requests_by(samples) == {("demo", "201"): n}
    assert answered(samples) == n


# -- health and readiness ----------------------------------------------------------------


def test_healthz_is_ok_while_the_supervisor_lives(make: Callable[..., Service]) -> None:
    svc = make().start()
    assert admin_json(svc, "GET", "/healthz") == (200, {"status": "ok"})
    status, headers, _ = svc.admin("POST", "/healthz")
    assert (status, headers["allow"]) == (405, "GET")
    assert admin_json(svc, "GET", "/nowhere") == (404, {"error": "not_found"})


def _chattr(flag: str, files: list[Path]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["chattr", flag, *map(str, files)], capture_output=True, text=True)


def test_readyz_fails_once_the_workers_are_told_to_stop(make: Callable[..., Service]) -> None:
    """A graceful stop closes the hook listeners and the workers drain (one held here by a
    client that never sends its body). The admin process, stopped last, answered 200 all
    the while, and a load balancer kept sending hooks to a port that refused them."""
    svc = make(server={"graceful_timeout_s": 6.0}).start()
    assert admin_json(svc, "GET", "/readyz")[0] == 200
    stuck = socket.create_connection(("127.0.0.1", svc.port), timeout=30)
    stuck.sendall(b"POST /hooks/demo HTTP/1.1\r\nhost: x\r\ncontent-length: 10\r\n\r\n{}")
    time.sleep(0.3)
    svc.send(signal.SIGTERM)
    answers: list[tuple[int, Any]] = []

    def unready() -> bool:
        answers.append(admin_json(svc, "GET", "/readyz"))
        return answers[-1][0] == 503

    wait_until(unready, 3.0, "readiness failed while the workers drain")
    assert answers[-1][1]["checks"]["workers"] == {"ok": False, "serving": 0, "stale": []}
    stuck.close()
    assert svc.proc is not None and svc.proc.wait(30) == 0


def test_readyz_fails_while_the_store_cannot_commit(make: Callable[..., Service]) -> None:
    svc = make().start()
    status, ready = admin_json(svc, "GET", "/readyz")
    assert status == 200, ready
    assert ready["ready"] is True
    assert ready["checks"]["workers"] == {"ok": True, "serving": 2, "stale": []}
    assert ready["checks"]["store"] == {"ok": True}
    assert "fleet" not in ready["checks"]  # node scope: no fleet check at all

    if shutil.which("chattr") is None:
        cannot_run("chattr is not installed (e2fsprogs)")
    # The db and -wal files only: the -shm file is mapped, and an immutable one is SIGBUS.
    files = [svc.store_path, Path(f"{svc.store_path}-wal")]
    assert all(f.exists() for f in files)
    try:
        made = _chattr("+i", files)
        if made.returncode != 0:
            cannot_run(f"chattr +i is not permitted here: {made.stderr.strip()}")
        wait_until(lambda: admin_json(svc, "GET", "/readyz")[0] == 503, 3.0, "readyz 503")
        status, ready = admin_json(svc, "GET", "/readyz")
        assert status == 503 and ready["ready"] is False
        assert ready["checks"]["store"]["ok"] is False
        assert ready["checks"]["store"]["error"].startswith(f"{svc.store_path}: probe: ")
        assert ready["checks"]["workers"]["ok"] is True
    finally:
        _chattr("-i", files)
    wait_until(lambda: admin_json(svc, "GET", "/readyz")[0] == 200, 3.0, "readyz 200 again")


# -- tenant rate limits ------------------------------------------------------------------


def burst_from_fresh_connections(svc: Service, n: int) -> list[int]:
    """``n`` new demo events, each on its own connection (the kernel spreads new
    connections over the workers' lanes)."""
    return [demo(svc, uuid.uuid4().hex) for _ in range(n)]


def worker_requests(svc: Service) -> dict[int, int]:
    with Segment.attach(svc.segment, readonly=True) as seg:
        return {
            p.pid: p.requests
            for p in procs.read(seg.view, seg.layout)
            if p.role == "worker" and p.alive
        }


def test_an_override_reaches_every_worker_and_outlives_a_restart(
    make: Callable[..., Service],
) -> None:
    svc = make().start()
    path = "/v1/tenants/demo/rate-limit"
    assert admin_json(svc, "GET", path) == (
        200,
        {"tenant": "demo", "rate": 1000, "burst": 1000, "source": "default"},
    )
    # One hook per 10 s: however slowly this machine sends, no refill within the test.
    put = admin_json(svc, "PUT", path, {"rate": 0.1, "burst": 2})
    assert put == (200, {"tenant": "demo", "rate": 0.1, "burst": 2, "source": "override"})

    time.sleep(1.0)  # the promise: every worker applies it within a second
    before = worker_requests(svc)
    statuses = burst_from_fresh_connections(svc, 16)
    after = worker_requests(svc)
    assert len(after) == 2 and all(after[p] > before.get(p, 0) for p in after), (before, after)
    # One bucket per host, and both workers hold it to a burst of 2: a worker
    # still on the old limit (burst 1000) would have admitted more than two.
    assert statuses.count(201) == 2 and statuses.count(429) == 14, statuses

    svc.stop()
    svc.start()
    assert admin_json(svc, "GET", path) == (
        200,
        {"tenant": "demo", "rate": 0.1, "burst": 2, "source": "override"},
    )
    statuses = burst_from_fresh_connections(svc, 6)
    assert statuses.count(201) <= 2 and statuses.count(429) >= 4, statuses

    assert admin_json(svc, "DELETE", path) == (
        200,
        {"tenant": "demo", "rate": 1000, "burst": 1000, "source": "default"},
    )
    assert admin_json(svc, "DELETE", path) == (404, {"error": "no_override"})
    time.sleep(1.0)  # the same promise: within a second
    assert burst_from_fresh_connections(svc, 6) == [201] * 6


def test_an_override_of_a_tenant_no_source_names_any_more_can_be_seen_and_deleted(
    make: Callable[..., Service],
) -> None:
    """It stays in the store, and would apply again if a source named its tenant again;
    GET and DELETE answered 404 unknown_tenant for it, so it could not be taken back."""
    svc = make().start()
    path = "/v1/tenants/acme/rate-limit"  # github's tenant
    assert admin_json(svc, "PUT", path, {"rate": 0.1, "burst": 1})[0] == 200
    admins = svc.pids("admin")
    svc.rewrite("[rate_limits]\ndefault = { rate = 1000, burst = 1000 }\n" + DEMO_SOURCE)
    svc.send(signal.SIGHUP)
    wait_until(lambda: svc.pids("admin") not in ([], admins), 10.0, "the admin process replaced")
    assert admin_json(svc, "GET", path) == (
        200,
        {"tenant": "acme", "rate": 0.1, "burst": 1, "source": "override"},
    )
    assert admin_json(svc, "DELETE", path)[0] == 200
    assert admin_json(svc, "GET", path) == (404, {"error": "unknown_tenant"})
    assert admin_json(svc, "DELETE", path) == (404, {"error": "unknown_tenant"})


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"rate": 0, "burst": 2}, "rate"),
        ({"rate": "1", "burst": 2}, "rate"),
        ({"rate": 1, "burst": "x"}, "burst"),
        ({"rate": 1, "burst": 0}, "burst"),
        ({"rate": 1e-12, "burst": 1}, "rate"),  # one interval beyond the GCRA's span
        ({"rate": 0.001, "burst": 10**8}, "burst"),  # the burst's span beyond it
        ({"rate": 1, "burst": 2, "extra": 1}, "extra"),
        ({"rate": 1}, "burst"),
    ],
)
def test_a_bad_override_is_refused_naming_its_field(
    svc_once: Service, body: dict[str, Any], field: str
) -> None:
    status, answer = admin_json(svc_once, "PUT", "/v1/tenants/demo/rate-limit", body)
    assert status == 400 and answer["error"] == "invalid_override"
    assert answer["field"] == field and answer["detail"]
    assert admin_json(svc_once, "GET", "/v1/tenants/demo/rate-limit")[1]["source"] == "default"


def test_override_requests_that_are_not_json_or_name_no_tenant(svc_once: Service) -> None:
    path = "/v1/tenants/demo/rate-limit"
    deep = b"[" * 30_000 + b"]" * 30_000  # deeper than json's recursion: not a 500
    for raw in (b"not json", b"[1, 2]", b"\xff", deep):
        assert admin_json(svc_once, "PUT", path, raw) == (400, {"error": "invalid_json"})
    assert admin_json(svc_once, "POST", "/v1/consumers/c1/ack", deep) == (
        400,
        {"error": "invalid_json"},
    )
    for method in ("GET", "PUT", "DELETE"):
        answer = admin_json(svc_once, method, "/v1/tenants/nobody/rate-limit", b"{}")
        assert answer == (404, {"error": "unknown_tenant"})
    # acme is github's tenant and has no entry of its own in rate_limits: the default
    assert admin_json(svc_once, "GET", "/v1/tenants/acme/rate-limit")[1]["source"] == "default"


# -- the consumer API --------------------------------------------------------------------


def page_all(svc: Service, query: str, limit: int) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    cursor = None
    while True:
        after = "" if cursor is None else f"&after={cursor}"
        status, page = admin_json(svc, "GET", f"/v1/hooks?limit={limit}{query}{after}")
        assert status == 200, page
        assert len(page["hooks"]) <= limit
        if not page["hooks"]:
            assert cursor is None or page["cursor"] == cursor
            return out
        assert page["cursor"] == page["hooks"][-1]["seq"]
        out += page["hooks"]
        cursor = page["cursor"]


def test_a_page_of_big_hooks_ends_at_its_byte_bound_and_pages_on(
    make: Callable[..., Service],
) -> None:
    """Hooks of a MiB each: a page of up to 1000 ends after about 8 MiB of them, its cursor
    at its last, and paging on from there reads every hook once. A 1000-hook page of them
    was one answer of a GB, built while the admin process answered no heartbeat: it was
    aborted, every time the consumer asked again."""
    svc = make(server={"max_body_bytes": 2 << 20}).start()
    ids = []
    for i in range(20):
        body = json.dumps({"n": i, "pad": "x" * (1 << 20)}).encode()
        answer = svc.post("demo", body)
        assert answer.status == 201
        ids.append(answer.body["id"])
    status, page = admin_json(svc, "GET", "/v1/hooks?limit=1000")
    assert status == 200
    assert 8 <= len(page["hooks"]) <= 9  # up to the bound, and the hook that crosses it
    assert page["cursor"] == page["hooks"][-1]["seq"]
    assert [h["id"] for h in page_all(svc, "", limit=1000)] == ids
    assert [h["id"] for h in page_all(svc, "&source=demo", limit=1000)] == ids


def test_consumers_page_ack_resume_after_a_restart_and_long_poll(
    make: Callable[..., Service],
) -> None:
    svc = make().start()
    m = 13
    ids = []
    for i in range(m):
        answer = svc.post("demo", json.dumps({"id": f"c-{i}", "n": i}).encode())
        assert answer.status == 201
        ids.append(answer.body["id"])

    hooks = page_all(svc, "", limit=4)
    assert [h["id"] for h in hooks] == ids  # each once, in commit order
    seqs = [h["seq"] for h in hooks]
    assert seqs == sorted(set(seqs))
    first = hooks[0]
    assert (first["source"], first["tenant"], first["event_key"]) == ("demo", "demo", "c-0")
    assert json.loads(first["body"]) == {"id": "c-0", "n": 0}
    assert isinstance(first["received_ms"], int)
    assert admin_json(svc, "GET", f"/v1/hooks/{ids[3]}") == (200, hooks[3])
    assert admin_json(svc, "GET", f"/v1/hooks/{uuid.uuid4()}") == (404, {"error": "not_found"})
    assert [h["id"] for h in page_all(svc, "&source=github", 4)] == []

    acked = seqs[6]
    ack = admin_json(svc, "POST", "/v1/consumers/c1/ack", {"cursor": acked})
    assert ack == (200, {"consumer": "c1", "cursor": acked})
    status, bad = admin_json(svc, "POST", "/v1/consumers/c1/ack", {"cursor": seqs[-1] + 1})
    assert status == 400 and bad["field"] == "cursor"
    for body in ({"cursor": "7"}, {"cursor": True}, {"at": 1}):
        assert admin_json(svc, "POST", "/v1/consumers/c1/ack", body)[0] == 400
    negative = admin_json(svc, "POST", "/v1/consumers/c1/ack", {"cursor": -1})
    assert negative == (
        400,
        {"error": "invalid_ack", "field": "cursor", "detail": "cursor -1 is negative"},
    )
    assert admin_json(svc, "POST", "/v1/consumers/c1/ack", b"nope")[0] == 400
    rule = "a consumer name must be 1-64 characters of A-Z a-z 0-9 _ . -, not only dots"
    bad_name = (400, {"error": "invalid_consumer", "detail": rule})
    assert admin_json(svc, "POST", "/v1/consumers/bad%20name/ack", {"cursor": 1}) == bad_name
    assert admin_json(svc, "GET", "/v1/consumers/" + "n" * 65) == bad_name
    assert admin_json(svc, "GET", "/v1/consumers/c2")[0] == 404
    # One no longer run is forgotten: it holds back retention no more.
    assert admin_json(svc, "POST", "/v1/consumers/gone/ack", {"cursor": 1})[0] == 200
    assert admin_json(svc, "DELETE", "/v1/consumers/gone") == (
        200,
        {"consumer": "gone", "forgotten": True},
    )
    assert admin_json(svc, "GET", "/v1/consumers/gone")[0] == 404
    assert admin_json(svc, "DELETE", "/v1/consumers/gone")[0] == 404

    svc.stop()
    svc.start()
    assert admin_json(svc, "GET", "/v1/consumers/c1") == (200, {"consumer": "c1", "cursor": acked})
    status, page = admin_json(svc, "GET", "/v1/hooks?consumer=c1")
    assert status == 200 and [h["id"] for h in page["hooks"]] == ids[7:]
    status, page = admin_json(svc, "GET", "/v1/hooks?consumer=c2&limit=2")
    assert [h["id"] for h in page["hooks"]] == ids[:2]  # never acked: from the start

    # Caught up, a consumer long-polls; a new commit answers it at once.
    got: dict[str, Any] = {}

    def poll(after: int, wait: int) -> None:
        t0 = time.monotonic()
        got["answer"] = admin_json(svc, "GET", f"/v1/hooks?after={after}&wait={wait}")
        got["at"], got["waited"] = time.monotonic(), time.monotonic() - t0

    waiter = threading.Thread(target=poll, args=(seqs[-1], 5))
    waiter.start()
    time.sleep(0.5)
    assert "answer" not in got  # nothing new: it waits
    answer = svc.post("demo", b'{"id":"late"}')
    committed_at = time.monotonic()
    assert answer.status == 201
    waiter.join(6)
    status, page = got["answer"]
    assert status == 200 and [h["id"] for h in page["hooks"]] == [answer.body["id"]]
    latency = got["at"] - committed_at
    print(f"long-poll answered {latency * 1000:.1f} ms after the 201")
    assert got["waited"] >= 0.5 and latency <= 1.0  # woken by the commit, not its 5 s

    t0 = time.monotonic()
    status, page = admin_json(svc, "GET", f"/v1/hooks?after={page['cursor']}&wait=0.3")
    assert (status, page["hooks"]) == (200, []) and 0.3 <= time.monotonic() - t0 < 2.0

    # A cursor past the end (from a store since replaced) has seen none of this store's
    # hooks: answered at once, from the start.
    t0 = time.monotonic()
    status, past = admin_json(svc, "GET", f"/v1/hooks?after={page['cursor'] + 1000}&wait=5")
    assert status == 200 and [h["id"] for h in past["hooks"]][:2] == ids[:2]
    assert time.monotonic() - t0 < 2.0

    # A long-poll whose client hangs up ends then, not at the end of its wait: abandoned
    # polls held the admin's connections (and their sockets) until none was left for a
    # scrape. One that half-closes is answered at once; one that leaves is let go.
    fds = len(os.listdir(f"/proc/{svc.one('admin')}/fd"))
    for how in ("half-close", "close"):
        t0 = time.monotonic()
        with socket.create_connection(("127.0.0.1", svc.admin_port), timeout=10) as s:
            s.sendall(
                f"GET /v1/hooks?after={page['cursor']}&wait=30 HTTP/1.1\r\n"
                "host: localhost\r\n\r\n".encode()
            )
            time.sleep(0.2)
            s.shutdown(socket.SHUT_WR)
            if how == "half-close":
                reply = s.recv(65536)
                assert reply.startswith(b"HTTP/1.1 200 ") and b'"hooks":[]' in reply
                assert time.monotonic() - t0 < 5, "answered at the end of its wait"
    wait_until(
        lambda: len(os.listdir(f"/proc/{svc.one('admin')}/fd")) <= fds,
        timeout=5,
        what="the abandoned poll's socket let go",
    )

    # A long-poll in flight does not hold up a graceful stop: it is answered at once.
    got.clear()
    waiter = threading.Thread(target=poll, args=(page["cursor"], 30))
    waiter.start()
    time.sleep(0.3)
    t0 = time.monotonic()
    assert svc.stop() == 0
    waiter.join(10)
    assert time.monotonic() - t0 < 10  # not held for the poll's 30 s
    assert got["answer"] == (200, {"hooks": [], "cursor": page["cursor"]})


@pytest.mark.parametrize(
    ("query", "field"),
    [
        ("after=x", "after"),
        ("after=-1", "after"),
        ("limit=0", "limit"),
        ("limit=1001", "limit"),
        ("wait=61", "wait"),
        ("wait=soon", "wait"),
        ("consumer=no%20spaces", "consumer"),
        ("after=1&after=2", "after"),
        ("cursor=3", "cursor"),
        ("after=3&consumer=c1", "consumer"),
        ("after=" + "9" * 20, "after"),
    ],
)
def test_bad_hooks_queries_name_the_field(svc_once: Service, query: str, field: str) -> None:
    status, answer = admin_json(svc_once, "GET", f"/v1/hooks?{query}")
    assert status == 400 and (answer["error"], answer["field"]) == ("invalid_query", field)


def test_a_binary_body_is_base64(svc_once: Service) -> None:
    answer = svc_once.post("demo", b"\xff\xfe not json")
    assert answer.status == 201
    status, hook = admin_json(svc_once, "GET", f"/v1/hooks/{answer.body['id']}")
    assert status == 200 and "body" not in hook
    assert hook["body_base64"] == "//4gbm90IGpzb24="
    assert hook["event_key"] is None and "event_key_base64" not in hook


# -- retention ---------------------------------------------------------------------------


def test_retention_deletes_only_what_every_consumer_acked(make: Callable[..., Service]) -> None:
    svc = make(store={"retention": "1s", "retention_interval_s": 1}).start()
    ids = [svc.post("demo", json.dumps({"id": f"r-{i}"}).encode()).body["id"] for i in range(10)]
    hooks = page_all(svc, "", 100)
    assert [h["id"] for h in hooks] == ids
    assert admin_json(svc, "POST", "/v1/consumers/c1/ack", {"cursor": hooks[4]["seq"]})[0] == 200

    def left() -> list[str]:
        return [h["id"] for h in page_all(svc, "", 100)]

    wait_until(lambda: len(left()) < 10, 6.0, "acked, old hooks deleted")
    time.sleep(2.5)  # two more runs: what was not acked stays, old as it is
    assert left() == ids[5:]
    assert "retention deleted " in svc.log()


# -- the bearer token --------------------------------------------------------------------


def test_an_unreadable_token_stops_the_service(make: Callable[..., Service]) -> None:
    svc = make(server={"admin_token_file": "/nonexistent/admin-token"})
    with contextlib.suppress(AssertionError):  # it may exit before or after READY=1
        svc.start()
    assert svc.proc is not None and svc.proc.wait(15) == 1
    log = svc.log()
    assert "cannot start: admin token: cannot read secret file /nonexistent/admin-token" in log
    assert log.count("admin ") < 10  # no respawn loop


def test_without_a_token_a_browser_cannot_be_made_to_ask(svc_once: Service) -> None:
    """A page elsewhere can make a browser POST to 127.0.0.1 (and move a consumer's cursor,
    after which retention deletes hooks it never read), or rebind its own name to
    127.0.0.1 and read the hooks. Without a token, the other Host or Origin is refused."""
    ack = json.dumps({"cursor": 0}).encode()
    for headers in (
        {"host": "attacker.example:9180"},  # a rebound name
        {"host": "127.0.0.1.attacker.example"},
        {"origin": "http://attacker.example"},  # a cross-site form's POST
        {"origin": "null"},  # a sandboxed frame's
        {"origin": "http://localhost:3000"},  # another local site
    ):
        for method, path, body in (
            ("GET", "/v1/hooks", None),
            ("POST", "/v1/consumers/victim/ack", ack),
        ):
            status, _, raw = svc_once.admin(method, path, body=body, headers=headers)
            assert (status, json.loads(raw)["error"]) == (403, "not_local"), (headers, path)
    assert svc_once.admin("GET", "/v1/consumers/victim")[0] == 404  # no ack was taken
    port = svc_once.admin_port
    for headers in (
        {},  # 127.0.0.1:<port>, as curl or Prometheus send it
        {"host": f"localhost:{port}"},
        {"host": f"[::1]:{port}"},
        {"host": f"127.0.0.1:{port}", "origin": f"http://127.0.0.1:{port}"},  # its own page
    ):
        assert svc_once.admin("GET", "/v1/hooks", headers=headers)[0] == 200, headers


def test_an_admin_body_is_bounded_whatever_max_body_bytes(svc_once: Service) -> None:
    """Its bodies are a few bytes of JSON; a client may not make it hold a hook's worth."""
    status, _, raw = svc_once.admin("PUT", "/v1/tenants/demo/rate-limit", body=b" " * 70_000)
    assert (status, json.loads(raw)) == (413, {"error": "too_large"})


def test_the_token_is_required_when_configured(make: Callable[..., Service]) -> None:
    port = free_port()
    svc = make(
        server={"admin_listen": f"0.0.0.0:{port}", "admin_token_env": "ADMIN_TOKEN"},
        env={**ENV, "ADMIN_TOKEN": "t0ken-for-tests\n"},  # as `echo` leaves it: trimmed
    )
    svc.admin_port = port
    svc.start()
    for headers in ({}, {"authorization": "Bearer wrong"}, {"authorization": "t0ken-for-tests"}):
        status, answer_headers, raw = svc.admin("GET", "/healthz", headers=headers)
        assert (status, json.loads(raw)) == (401, {"error": "unauthorized"})
        assert answer_headers["www-authenticate"] == "Bearer"
    assert svc.admin("GET", "/nowhere")[0] == 401  # before routing: nothing is revealed
    good = {"authorization": "Bearer t0ken-for-tests"}
    assert admin_json(svc, "GET", "/healthz", headers=good) == (200, {"status": "ok"})
    named = {**good, "host": "edge-7.example:9180", "origin": "https://ops.example"}
    assert svc.admin("GET", "/healthz", headers=named)[0] == 200  # the token decides
    assert svc.admin("GET", "/metrics", headers=good)[0] == 200


def test_a_reload_cannot_drop_the_token_of_an_address_kept_until_a_restart(
    make: Callable[..., Service],
) -> None:
    """admin_listen is kept until a restart; a new config that moves it to loopback and
    drops the token passed its own checks, and the admin process was restarted without a
    token on the old, open address. The reload is refused: the token stays required."""
    port = free_port()
    server = {"admin_listen": f"0.0.0.0:{port}", "admin_token_env": "ADMIN_TOKEN"}
    svc = make(server=server, env={**ENV, "ADMIN_TOKEN": "t0ken-for-tests"})
    svc.admin_port = port
    svc.start()
    admins = svc.pids("admin")
    svc.rewrite(REST, server={"admin_listen": f"127.0.0.1:{port}", "admin_token_env": ""})
    svc.send(signal.SIGHUP)
    wait_until(lambda: "keeps serving" in svc.log(), 10.0, "the reload refused")
    assert "server.admin_listen: 0.0.0.0:" in svc.log()
    time.sleep(1.0)  # what a reload would have done by now
    assert svc.pids("admin") == admins
    assert svc.admin("GET", "/healthz")[0] == 401
    assert svc.stop() == 0


def switches(pid: int) -> int:
    """The process's context switches so far, all its threads (a wakeup is one or more)."""
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        status = (task / "status").read_text()
        total += sum(int(n) for n in re.findall(r"ctxt_switches:\s+(\d+)", status))
    return total


def test_a_waiting_consumer_costs_the_admin_process_no_polling(svc_once: Service) -> None:
    """The long-poll sleeps on the commit word: loading it every 5 ms instead woke the
    admin process about 200 times a second for one waiting consumer (a soak measured 201
    wakeups/s against 5.8 with none waiting)."""
    admin = svc_once.one("admin")
    status, page = admin_json(svc_once, "GET", "/v1/hooks?limit=1000")
    assert status == 200
    got: dict[str, Any] = {}
    waiter = threading.Thread(
        target=lambda: got.update(
            answer=admin_json(svc_once, "GET", f"/v1/hooks?after={page['cursor']}&wait=3")
        )
    )
    waiter.start()
    time.sleep(0.5)
    before = switches(admin)
    time.sleep(2.0)
    woke = switches(admin) - before
    assert "answer" not in got
    assert woke < 60, woke  # its own timers: the 250 ms sweep, the heartbeat
    answer = svc_once.post("demo", b'{"id":"wakes-the-poll"}')
    waiter.join(5)
    assert [h["id"] for h in got["answer"][1]["hooks"]] == [answer.body["id"]]
