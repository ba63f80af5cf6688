"""Fleet admission against real servers that want more than a plain socket: TLS only
(``rediss://`` with a CA made here, given as ``fleet.tls_ca_file``), and an ACL user with a
password (named by ``fleet.password_env``, the user in the URL). What must hold: admission
works through them; a certificate the client cannot verify or a wrong password is a clear
``RedisError`` and hooks are still answered node-local."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from fleet_helpers import (
    TIMEOUT_S,
    admit,
    bare,
    dd_key,
    drain_all,
    drainer_process,
    fleet_config,
    fleet_raw,
    open_fleet,
    run,
    segments,
    totals,
    wait_until,
    write_config,
)
from redis_server import RedisServer, Tls, free_port

from ankusa_shm.config import Config
from ankusa_shm.credentials import read_secret
from ankusa_shm.fleet.admission import Admit, Duplicate
from ankusa_shm.fleet.redis_client import RedisError
from ankusa_shm.fleet.redis_store import RedisStore
from ankusa_shm.hooks import Committed
from ankusa_shm.shm.counters import Counter

OPENSSL = "/usr/bin/openssl"


def openssl(*args: str | Path) -> None:
    subprocess.run([OPENSSL, *map(str, args)], check=True, capture_output=True, timeout=TIMEOUT_S)


def make_ca(d: Path, name: str) -> tuple[Path, Path]:
    """A self-signed CA: (certificate, key)."""
    cert, key = d / f"{name}.crt", d / f"{name}.key"
    openssl(
        "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
        "-nodes", "-keyout", key, "-out", cert, "-days", "2", "-subj", f"/CN={name}",
        "-addext", "basicConstraints=critical,CA:TRUE",
        "-addext", "keyUsage=critical,keyCertSign,cRLSign",
    )  # fmt: skip
    return cert, key


@pytest.fixture(scope="module")
def tls_files(tmp_path_factory: pytest.TempPathFactory) -> Tls:
    """A CA and a server certificate it signed, for 127.0.0.1 (the URL's host)."""
    d = tmp_path_factory.mktemp("tls")
    ca, ca_key = make_ca(d, "ankusa-test-ca")
    key, csr, cert, ext = d / "server.key", d / "server.csr", d / "server.crt", d / "ext.cnf"
    ext.write_text(
        "subjectAltName = IP:127.0.0.1, DNS:localhost\n"
        "basicConstraints = CA:FALSE\n"
        "keyUsage = critical, digitalSignature, keyEncipherment\n"
        "extendedKeyUsage = serverAuth\n"
    )
    openssl(
        "req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
        "-keyout", key, "-out", csr, "-subj", "/CN=127.0.0.1",
    )  # fmt: skip
    openssl(
        "x509", "-req", "-in", csr, "-CA", ca, "-CAkey", ca_key, "-CAcreateserial",
        "-out", cert, "-days", "2", "-extfile", ext,
    )  # fmt: skip
    return Tls(cert=cert, key=key, ca=ca)


@pytest.fixture
def tls_server(redis_server: RedisServer, tls_files: Tls) -> Iterator[RedisServer]:
    """A TLS-only server (``redis_server`` first: it checks redis-server is there)."""
    server = RedisServer(None, tls=tls_files)
    yield server
    server.close()


def admit_commit_drain_admit(cfg: Config, store: RedisStore | None = None) -> None:
    """One host (a segment of its own; the config's name is not used) admits a hook,
    commits and drains it; its next admit of the same event is the fleet's Duplicate -- an
    answer only Redis can give."""
    with segments(1) as (seg,):

        async def body() -> None:
            async with open_fleet(cfg, seg, store=store) as fleet:
                first = await admit(fleet, cfg, "evt")
                assert isinstance(first, Admit) and first.claim is not None
                assert totals(seg)[Counter.STORE_OK] == 1  # Redis answered, not this host
                fleet.settle(first.claim, Committed("hook-1"))
                drainer = drainer_store(cfg)
                try:
                    await drain_all(cfg, seg, store=drainer)
                finally:
                    await drainer.close()
                assert await admit(fleet, cfg, "evt") == Duplicate("hook-1")

        run(body())
        counted = totals(seg)
    assert counted[Counter.STORE_OK] == 2
    assert counted[Counter.STORE_ERROR] == counted[Counter.STORE_TIMEOUT] == 0
    assert counted[Counter.SETTLED_PROMOTE] == 1


def drainer_store(cfg: Config) -> RedisStore:
    """What the drainer builds: the password read as the config names it."""
    return RedisStore.from_config(cfg.fleet, read_secret(cfg.fleet.password_env))


def answered_node_local(cfg: Config, store: RedisStore | None = None) -> None:
    """The store cannot be used: every admit is still answered, from this host alone."""
    with segments(1) as (seg,):

        async def body() -> None:
            async with open_fleet(cfg, seg, store=store) as fleet:
                for i in range(3):
                    assert isinstance(await admit(fleet, cfg, f"k{i}"), Admit)
                assert fleet.degraded("dedupe") and fleet.degraded("rate_limit")

        run(body())
        counted = totals(seg)
    assert counted[Counter.STORE_OK] == 0
    assert counted[Counter.STORE_ERROR] + counted[Counter.STORE_TIMEOUT] == 3
    assert counted[Counter.FALLBACK_DEDUPE] == 3


# -- TLS --------------------------------------------------------------------------------------


def test_tls_with_the_configured_ca(tls_server: RedisServer, tls_files: Tls) -> None:
    cfg = fleet_config(tls_server.url, "unused", tls_ca_file=str(tls_files.ca))
    assert tls_server.url.startswith("rediss://")
    admit_commit_drain_admit(cfg)
    with tls_server.client() as r:
        assert r.get(dd_key("evt")) == b"c:hook-1"


def test_tls_without_the_ca_is_refused(tls_server: RedisServer, tmp_path: Path) -> None:
    """The server's certificate is checked: the system's CAs do not know the test CA, and
    another CA does not either. The error says why."""
    other_ca, _ = make_ca(tmp_path, "someone-else")
    for ca in ("", str(other_ca)):
        cfg = fleet_config(tls_server.url, "unused", tls_ca_file=ca)
        store = RedisStore.from_config(cfg.fleet)

        async def ping(store: RedisStore = store) -> None:
            try:
                await store.client.send([(b"k", ("PING",))])
            finally:
                await store.close()

        with pytest.raises(RedisError, match="CERTIFICATE_VERIFY_FAILED"):
            run(ping())
        answered_node_local(cfg)


def test_plain_client_to_a_tls_port_is_an_error(tls_server: RedisServer) -> None:
    """``redis://`` against a TLS-only port: an error and node-local answers, no hang."""
    cfg = fleet_config(tls_server.url.replace("rediss://", "redis://"), "unused")
    answered_node_local(cfg)


# -- ACL --------------------------------------------------------------------------------------

USER, PASSWORD, ENV = "edge", "s3cret-pw", "ANKUSA_TEST_REDIS_PASSWORD"
ADMIN = ("admin", "admin-pw")


def admin(server: RedisServer) -> redis.Redis:
    return redis.Redis(port=server.port, username=ADMIN[0], password=ADMIN[1], socket_timeout=5)


@pytest.fixture
def acl_server(redis_server: RedisServer) -> RedisServer:
    """Only two users: the edge (its own keys, with a password) and the test's admin. The
    default user is off, so a client that did not log in as the edge gets nothing."""
    with redis_server.client() as r:
        r.execute_command("ACL", "SETUSER", USER, "on", f">{PASSWORD}", "~ankusa:*", "+@all")
        r.execute_command("ACL", "SETUSER", ADMIN[0], "on", f">{ADMIN[1]}", "~*", "&*", "+@all")
        r.execute_command("ACL", "SETUSER", "default", "off")
    return redis_server


def acl_url(server: RedisServer, user: str = USER) -> str:
    return f"redis://{user}@127.0.0.1:{server.port}/0"


def test_acl_user_and_password_from_env(
    acl_server: RedisServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(ENV, PASSWORD)
    cfg = fleet_config(acl_url(acl_server), "unused", password_env=ENV)
    admit_commit_drain_admit(cfg, drainer_store(cfg))
    with admin(acl_server) as r:
        assert r.get(dd_key("evt")) == b"c:hook-1"
        assert not r.execute_command("ACL", "LOG")  # no command was denied


def test_acl_drainer_process_reads_password_env(
    acl_server: RedisServer, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The drainer process takes its password from ``password_env`` as the config says."""
    monkeypatch.setenv(ENV, PASSWORD)
    with segments(1) as (seg,):
        raw = fleet_raw(acl_url(acl_server), bare(seg), password_env=ENV)
        config_file = write_config(tmp_path / "edge.toml", raw)
        cfg = fleet_config(acl_url(acl_server), bare(seg), password_env=ENV)

        async def admit_and_settle() -> None:
            async with open_fleet(cfg, seg, store=drainer_store(cfg)) as fleet:
                first = await admit(fleet, cfg, "evt")
                assert isinstance(first, Admit) and first.claim is not None
                fleet.settle(first.claim, Committed("hook-1"))

        run(admit_and_settle())
        with drainer_process(config_file, tmp_path / "drainer.log") as d:
            wait_until(lambda: totals(seg)[Counter.SETTLED_PROMOTE] == 1, "the promote")
            assert seg.queue_depth() == 0, d.output()
    with admin(acl_server) as r:
        assert r.get(dd_key("evt")) == b"c:hook-1"


def test_acl_wrong_password(acl_server: RedisServer, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV, "not-the-password")
    cfg = fleet_config(acl_url(acl_server), "unused", password_env=ENV)

    async def ping() -> None:
        store = drainer_store(cfg)
        try:
            await store.client.send([(b"k", ("PING",))])
        finally:
            await store.close()

    with pytest.raises(RedisError, match=rf"127\.0\.0\.1:{acl_server.port}: WRONGPASS"):
        run(ping())
    answered_node_local(cfg, drainer_store(cfg))


def test_acl_no_password_is_an_error(acl_server: RedisServer) -> None:
    """No password at all: the connection is not logged in and every command is refused
    by the server (NOAUTH), which the fleet answers node-local."""
    cfg = fleet_config(acl_url(acl_server), "unused")
    answered_node_local(cfg)


@pytest.mark.parametrize("case", ["wrong password", "no EVALSHA"])
def test_a_server_that_refuses_the_client_is_an_error_that_says_what_to_fix(
    acl_server: RedisServer,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    case: str,
) -> None:
    """A wrong password or an ACL without a command the scripts need looks like an outage
    (every hook answered node-local), and waiting will not end it: it is said at ERROR,
    with the settings to check, not as the once-a-minute warning of an outage."""
    user, password = USER, PASSWORD
    if case == "wrong password":
        password = "not-the-password"
    else:
        user = "edge-noeval"
        with admin(acl_server) as r:
            r.execute_command(
                "ACL", "SETUSER", user, "on", f">{PASSWORD}", "~ankusa:*", "+@all", "-evalsha"
            )
    monkeypatch.setenv(ENV, password)
    cfg = fleet_config(acl_url(acl_server, user), "unused", password_env=ENV)
    with caplog.at_level(logging.WARNING, logger="ankusa_shm.fleet"):
        answered_node_local(cfg, drainer_store(cfg))
    said = [(r.levelno, r.getMessage()) for r in caplog.records]
    assert [level for level, _ in said] == [logging.ERROR, logging.ERROR], said  # per kind
    code = "WRONGPASS" if case == "wrong password" else "NOPERM"
    assert all(code in m and "check fleet.password_env" in m for _, m in said), said


def check_connect(
    tmp_path: Path, url: str, password: str | None
) -> subprocess.CompletedProcess[str]:
    """``ankusa-shm check-config --connect`` on a config for ``url``, as an operator runs it."""
    raw = fleet_raw(url, "unused")
    if password is not None:
        raw["fleet"]["password_env"] = ENV
    path = write_config(tmp_path / "edge.toml", raw)
    env = {**os.environ, ENV: password or ""}
    return subprocess.run(
        [sys.executable, "-m", "ankusa_shm", "check-config", "--connect", str(path)],
        capture_output=True,
        text=True,
        env=env,
        timeout=30,
    )


@pytest.mark.parametrize(
    ("user", "password", "code"),
    [
        (USER, PASSWORD, ""),
        (USER, "not-the-password", "WRONGPASS"),
        ("edge-noeval", PASSWORD, "NOPERM"),
    ],
)
def test_check_config_connect_runs_what_a_host_runs_on_redis(
    acl_server: RedisServer, tmp_path: Path, user: str, password: str, code: str
) -> None:
    """A config can be valid and its Redis unusable (a wrong password, an ACL without a
    command the scripts need): ``--connect`` logs in, runs a script and writes a key, and
    says what failed, without the password."""
    with admin(acl_server) as r:
        r.execute_command(
            "ACL", "SETUSER", "edge-noeval", "on", f">{PASSWORD}", "~ankusa:*", "+@all", "-evalsha"
        )
    done = check_connect(tmp_path, acl_url(acl_server, user), password)
    assert password not in done.stdout + done.stderr
    if not code:
        assert done.returncode == 0, done.stderr
        assert "ok (logged in, scripts loaded and run, a key written" in done.stdout
        return
    assert done.returncode == 1
    assert code in done.stderr and "check fleet.password_env" in done.stderr
    assert "Traceback" not in done.stderr


def test_check_config_connect_warns_of_an_evicting_redis(
    redis_server: RedisServer, tmp_path: Path
) -> None:
    with redis_server.client() as r:
        r.config_set("maxmemory", 512 << 20)
        r.config_set("maxmemory-policy", "volatile-lru")
    done = check_connect(tmp_path, redis_server.url, None)
    assert done.returncode == 0, done.stderr
    assert "maxmemory-policy volatile-lru evicts fleet keys" in done.stderr


def test_check_config_connect_says_an_unreachable_redis(tmp_path: Path) -> None:
    done = check_connect(tmp_path, f"redis://127.0.0.1:{free_port()}/0", None)
    assert done.returncode == 1
    assert "cannot connect" in done.stderr and "Traceback" not in done.stderr
