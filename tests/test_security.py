"""Security properties as tests: a private segment, a read-only inspector, secrets kept out
of every output, an admin listener that will not face the network unguarded, and HMAC
signatures compared in constant time."""

from __future__ import annotations

import base64
import hashlib
import hmac
import io
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import cannot_run
from load_client import GITHUB_SOURCE, SECRET, Load, signed
from proc_helpers import run_children
from redis_server import RedisServer
from service import Service

from ankusa_shm import config, inspect
from ankusa_shm.http import verify
from ankusa_shm.shm.segment import Segment, SegmentDenied

NOBODY = 65534
ROOT = Path(__file__).resolve().parent.parent


def _mode(name: str) -> int:
    return os.stat(f"/dev/shm/{name}").st_mode & 0o777


def _cli(
    *args: str, timeout: float = 60, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "ankusa_shm", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
        env=env,
    )


# -- the segment is private -------------------------------------------------------------------


def test_a_created_segment_is_mode_0600(seg: Segment) -> None:
    assert _mode(seg.name.lstrip("/")) == 0o600
    assert os.stat(f"/dev/shm/{seg.name.lstrip('/')}").st_uid == os.getuid()


@pytest.fixture
def service(tmp_path: Path) -> Iterator[Service]:
    s = Service(tmp_path, GITHUB_SOURCE, server={"admin_listen": ""}, env={"GH_SECRET": SECRET})
    try:
        yield s.start()
    finally:
        s.close()


def test_a_running_services_segment_is_mode_0600(service: Service) -> None:
    assert _mode(service.segment) == 0o600


def _as_nobody(_: int, name: str) -> str:
    """In a forked child that is another user: try to open the segment both ways."""
    os.setgroups([])
    os.setgid(NOBODY)
    os.setuid(NOBODY)
    outcomes = []
    for readonly in (False, True):
        try:
            Segment.attach(name, readonly=readonly).close()
            outcomes.append("opened")
        except SegmentDenied:
            outcomes.append("denied")
    return ",".join(outcomes)


def _need_root() -> None:
    if os.getuid() != 0:
        cannot_run("needs root, to become a second user (uid 65534) in a child")


def test_another_user_can_neither_write_nor_read_the_segment(seg: Segment) -> None:
    _need_root()
    name = seg.name.lstrip("/")
    assert run_children(1, _as_nobody, name) == ["denied,denied"]
    for readonly in (False, True):  # while its owner can
        Segment.attach(name, readonly=readonly).close()


# -- inspect never writes, and maps read-only --------------------------------------------------


def _tree(svc: Service) -> list[int]:
    return [svc.pid, *(p.pid for p in svc.children() if p.pid != svc.pid)]


def _frozen(svc: Service) -> Callable[[], None]:
    """SIGSTOP the whole service (real signals): nothing writes the segment until thawed."""
    pids = _tree(svc)
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)

    def thaw() -> None:
        for pid in pids:
            os.kill(pid, signal.SIGCONT)

    return thaw


def _inspect_as_reader(_: int, name: str) -> tuple[int, str, str]:
    """As uid 65534, which may read the segment (group, mode 0640) and not write it."""
    os.setgroups([])
    os.setgid(NOBODY)
    os.setuid(NOBODY)
    try:
        Segment.attach(name).close()
        writable = "opened for writing"
    except SegmentDenied:
        writable = "denied for writing"
    out = io.StringIO()
    code = inspect.run(name, True, None, out=out)
    return code, out.getvalue(), writable


def test_inspect_of_a_live_service_changes_no_byte_and_needs_only_read(service: Service) -> None:
    with Load(service.port, threads=2) as load:
        time.sleep(0.5)
    assert load.tally.count(201) > 0
    path = Path(f"/dev/shm/{service.segment}")
    thaw = _frozen(service)
    try:
        before = path.read_bytes()
        text = _cli("inspect", "--name", service.segment)
        as_json = _cli("inspect", "--name", service.segment, "--json")
        assert text.returncode == 0 and "segment" in text.stdout, text.stderr
        assert as_json.returncode == 0, as_json.stderr
        assert json.loads(as_json.stdout)["segment"]["owner_pid"] == service.pid
        assert path.read_bytes() == before  # every byte, heartbeats included: all are stopped
        if os.getuid() == 0:
            os.chown(path, 0, NOBODY)
            os.chmod(path, 0o640)
            try:
                ((code, out, writable),) = run_children(1, _inspect_as_reader, service.segment)
            finally:
                os.chmod(path, 0o600)
                os.chown(path, 0, 0)
            assert writable == "denied for writing"  # this user really may only read
            assert code == 0 and json.loads(out)["segment"]["owner_pid"] == service.pid
            assert path.read_bytes() == before
    finally:
        thaw()
    body = b'{"after":1}'
    assert service.post("github", body, signed(body)).status == 201


# -- secrets stay secret ------------------------------------------------------------------------


def _send_hooks(svc: Service, secret: str) -> None:
    body = b'{"n":1}'
    assert svc.post("github", body, signed(body, secret=secret)).status == 201
    assert svc.post("github", body, signed(body, secret=secret + "x")).status == 401
    assert svc.post("github", body, {"x-hub-signature-256": "sha256=00"}).status == 401
    assert svc.post("github", body, {}).status == 401


def _metrics(svc: Service) -> str:
    """``/metrics`` of the admin listener."""
    status, _, raw = svc.admin("GET", "/metrics", timeout=3)
    assert status == 200
    return raw.decode(errors="replace")


def _assert_nowhere(svc: Service, *secrets: str) -> None:
    time.sleep(0.3)  # let the children's last log lines land
    dump = _cli("inspect", "--name", svc.segment, "--json")
    text = _cli("inspect", "--name", svc.segment)
    assert dump.returncode == 0 and text.returncode == 0, dump.stderr + text.stderr
    for secret in secrets:
        assert secret not in svc.log()
        assert secret not in dump.stdout and secret not in text.stdout
    metrics = _metrics(svc)
    for secret in secrets:
        assert secret not in metrics


def _admin_service(tmp: Path, rest: str, env: dict[str, str]) -> Service:
    return Service(tmp, rest, env=env)


def test_the_signing_secret_is_in_no_log_inspect_or_metrics(tmp_path: Path) -> None:
    secret = f"sig-{uuid.uuid4().hex}"
    svc = _admin_service(tmp_path, GITHUB_SOURCE, {"GH_SECRET": secret})
    try:
        svc.start()
        _send_hooks(svc, secret)
        _assert_nowhere(svc, secret)
    finally:
        svc.close()


def test_the_redis_password_is_in_no_log_inspect_or_metrics(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    secret, password = f"sig-{uuid.uuid4().hex}", f"pw-{uuid.uuid4().hex}"  # a wrong one
    rest = (
        f"""
[dedupe]
scope = "fleet"

[fleet]
redis_url = "{redis_server.url}"
password_env = "REDIS_PW"
timeout_ms = 50
"""
        + GITHUB_SOURCE
    )
    svc = _admin_service(tmp_path, rest, {"GH_SECRET": secret, "REDIS_PW": password})
    try:
        svc.start()
        _send_hooks(svc, secret)
        _assert_nowhere(svc, secret, password)
    finally:
        svc.close()


# -- the admin listener stays on loopback without a token --------------------------------------


def test_a_non_loopback_admin_listener_needs_a_token(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    path.write_text(
        f'[server]\nadmin_listen = "0.0.0.0:9999"\nsegment = "sec-{uuid.uuid4().hex[:8]}"\n'
    )
    for argv in (["check-config", str(path)], ["serve", "--config", str(path)]):
        r = _cli(*argv, timeout=30)
        assert r.returncode == 2, (argv, r)
        assert "server.admin_listen" in r.stderr and "Traceback" not in r.stderr
    guarded = path.read_text() + 'admin_token_env = "ADMIN_TOKEN"\n'
    path.write_text(guarded)
    with_token = {**os.environ, "ADMIN_TOKEN": "t0ken"}
    assert _cli("check-config", str(path), env=with_token).returncode == 0  # with one it may


# -- HMAC comparison is constant-time ----------------------------------------------------------

KEY = b"k" * 32
WHSEC = "whsec_" + base64.b64encode(KEY).decode()


def _sources(monkeypatch: pytest.MonkeyPatch) -> dict[str, config.Source]:
    monkeypatch.setenv("SEC_HEX", "hex-secret")
    monkeypatch.setenv("SEC_WH", WHSEC)
    monkeypatch.setenv("SEC_STRIPE", "whsec_stripe")
    raw: dict[str, Any] = {
        "sources": [
            {
                "id": "hex",
                "tenant": "t",
                "verify": {
                    "hmac": {"header": "x-sig", "prefix": "sha256=", "secret_env": "SEC_HEX"}
                },
            },
            {
                "id": "b64",
                "tenant": "t",
                "verify": {
                    "hmac": {"header": "x-sig", "encoding": "base64", "secret_env": "SEC_HEX"}
                },
            },
            {"id": "sw", "tenant": "t", "verify": {"standard_webhooks": {"secret_env": "SEC_WH"}}},
            {"id": "svix", "tenant": "t", "verify": {"svix": {"secret_env": "SEC_WH"}}},
            {"id": "stripe", "tenant": "t", "verify": {"stripe": {"secret_env": "SEC_STRIPE"}}},
        ]
    }
    return {s.id: s for s in config.parse(raw, "<test>").sources}


def _signed_headers(source: str, body: bytes, now: int) -> dict[str, str]:
    """Correct headers for ``source``'s scheme, computed here from the scheme's spec."""
    if source in ("hex", "b64"):
        mac = hmac.new(b"hex-secret", body, hashlib.sha256).digest()
        text = "sha256=" + mac.hex() if source == "hex" else base64.b64encode(mac).decode()
        return {"x-sig": text}
    if source in ("sw", "svix"):
        p = "webhook-" if source == "sw" else "svix-"
        mac = hmac.new(KEY, b"msg_1.%d.%b" % (now, body), hashlib.sha256).digest()
        sig = "v1," + base64.b64encode(mac).decode()
        return {p + "id": "msg_1", p + "timestamp": str(now), p + "signature": sig}
    digest = hmac.new(b"whsec_stripe", b"%d.%b" % (now, body), hashlib.sha256).hexdigest()
    return {"stripe-signature": f"t={now},v1={digest}"}


def _forged(headers: dict[str, str]) -> dict[str, str]:
    """The same headers with one character of the digest changed: same length, wrong."""
    out = dict(headers)
    name = next(k for k in out if k in ("x-sig", "stripe-signature") or k.endswith("signature"))
    v = out[name]
    # Ten from the end: inside every scheme's digest, and not base64's last character,
    # whose low bits are padding (changing it may decode to the same bytes). "0" or "1":
    # a digit of hex and base64 alike, unlike the old character in either case (hex is
    # read case-blind, so "a" -> "A" would forge nothing).
    i = len(v) - 10
    out[name] = v[:i] + ("0" if v[i].lower() != "0" else "1") + v[i + 1 :]
    return out


@pytest.mark.parametrize("source", ["hex", "b64", "sw", "svix", "stripe"])
def test_every_signature_is_decided_by_compare_digest(
    monkeypatch: pytest.MonkeyPatch, source: str
) -> None:
    v = verify.verifier_for(_sources(monkeypatch)[source])
    assert v is not None
    body, now = b'{"event":1}', int(time.time())
    good = _signed_headers(source, body, now)
    bad = _forged(good)
    real = hmac.compare_digest
    calls: list[tuple[int, int]] = []
    flip = False

    def recording(a: Any, b: Any) -> bool:
        calls.append((len(a), len(b)))
        answer = real(a, b)
        return not answer if flip else answer

    monkeypatch.setattr(hmac, "compare_digest", recording)
    for headers, want in ((good, True), (bad, False)):
        calls.clear()
        assert v.verify(headers, body, now) is want
        assert calls, "no compare_digest call"
        assert all(a == b for a, b in calls)  # a digest of the right length reached it
    flip = True  # if compare_digest is what decides, its answer is the verifier's answer
    assert v.verify(good, body, now) is False
    assert v.verify(bad, body, now) is True
