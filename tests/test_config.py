"""Configuration: declared once, validated with errors that name the file and the key."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ankusa_shm import config
from ankusa_shm.config import ConfigError
from ankusa_shm.limits import Limit

# A full configuration as an operator would write one: every section, fleet scopes on.
REFERENCE = """\
[server]
listen = ["127.0.0.1:8080"]
workers = 0               # 0: one per CPU
admin_listen = "127.0.0.1:9180"
max_body_bytes = 1048576

[store]
path = "var/hooks.db"
durability = "fsync"      # or "os"

[rate_limits]
scope = "fleet"           # node | fleet
default = { rate = 100, burst = 200 }
tenants.acme = { rate = 5, burst = 10 }

[dedupe]
scope = "fleet"

[fleet]
redis_url = "redis://127.0.0.1:6379/0"
timeout_ms = 20
breaker_failure_rate = 0.5
breaker_min_calls = 20
breaker_window_ms = 10000
breaker_open_ms = 5000
pending_ttl_ms = 30000
settle_queue_size = 50000

[[sources]]
id = "github"
tenant = "acme"
verify = { hmac = { header = "x-hub-signature-256", prefix = "sha256=", secret_env = "GITHUB_SECRET" } }
dedupe = { preset = "github", ttl_seconds = 259200 }
"""  # noqa: E501


def write(tmp_path: Path, text: str, name: str = "ankusa.toml") -> Path:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


def load_error(tmp_path: Path, text: str) -> str:
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as e:
        config.load(path)
    message = str(e.value)
    assert message.startswith(f"{path}: "), message  # names the file, first
    assert "\n" not in message
    return message


def test_reference_config_loads(tmp_path: Path) -> None:
    path = write(tmp_path, REFERENCE)
    cfg = config.load(path)
    assert cfg.origin == str(path)
    assert cfg.server.listen == ["127.0.0.1:8080"]
    assert cfg.server.workers == 0
    assert cfg.store.durability == "fsync"
    assert cfg.rate_limits.scope == "fleet"
    assert cfg.rate_limits.limit_for("acme") == Limit.of(5, 10)
    assert cfg.rate_limits.limit_for("someone-else") == Limit.of(100, 200)
    assert cfg.fleet_kinds == ("rate_limit", "dedupe")
    assert cfg.fleet.redis_url == "redis://127.0.0.1:6379/0"
    assert (cfg.fleet.breaker_failure_rate, cfg.fleet.breaker_min_calls) == (0.5, 20)
    assert (cfg.fleet.breaker_window_ms, cfg.fleet.breaker_open_ms) == (10_000, 5_000)
    assert cfg.fleet.settle_queue_size == 50_000
    src = cfg.source("github")
    assert src is not None and cfg.source("stripe") is None
    assert src.tenant == "acme"
    assert src.verify.hmac is not None
    assert src.verify.hmac.header == "x-hub-signature-256"
    assert src.verify.hmac.secret_env == "GITHUB_SECRET"
    assert src.dedupe is not None and src.dedupe.preset == "github"


def test_defaults_and_an_empty_file(tmp_path: Path) -> None:
    d = config.defaults()
    assert d.fleet_kinds == ()
    assert d.server.listen == ["127.0.0.1:8080"]
    assert d.server.admin_listen == "127.0.0.1:9180"
    (demo,) = d.sources  # a newcomer's first curl needs one source, unverified
    assert (demo.id, demo.verify.hmac) == ("demo", None)
    empty = config.load(write(tmp_path, ""))
    assert empty.sources == []  # a file says which sources exist
    assert dataclasses.replace(empty, sources=d.sources) == d  # origin is not compared
    assert empty.origin != d.origin


@pytest.mark.parametrize(
    ("text", "drain_s"),
    [
        ("", 29.0),  # node scope: the admin's second
        ('[server]\ngraceful_timeout_s = 20\n[dedupe]\nscope = "fleet"\n', 14.0),
        ('[server]\ngraceful_timeout_s = 2\n[dedupe]\nscope = "fleet"\n', 1.0),  # half
        ("[server]\ngraceful_timeout_s = 0\n", 0.0),
    ],
)
def test_workers_drain_for_the_graceful_timeout_less_what_follows(
    tmp_path: Path, text: str, drain_s: float
) -> None:
    """The drainer (drain_on_stop_ms, 5 s by default, with a fleet scope) and the admin
    process stop after the workers, within the same graceful timeout."""
    assert config.load(write(tmp_path, text)).workers_drain_s == drain_s


def test_public_snapshot_carries_no_secrets(tmp_path: Path) -> None:
    text = REFERENCE.replace(
        "settle_queue_size = 50000", 'settle_queue_size = 50000\npassword_file = "/run/pw"'
    )
    public = config.load(write(tmp_path, text)).public()
    assert "password_file" not in public["fleet"]
    assert "/run/pw" not in repr(public)
    assert public["sources"] == 1


@pytest.mark.parametrize(
    ("text", "key"),
    [
        ("bogus = 1\n", "bogus"),
        ("[fleet]\nredis_urll = 'redis://x:1'\n", "fleet.redis_urll"),
        ("[rate_limits]\ndefault = { rate = 1, brust = 2 }\n", "rate_limits.default.brust"),
        (
            REFERENCE.replace('prefix = "sha256="', 'prefix = "sha256=", algo = "x"'),
            "sources[0].verify.hmac.algo",
        ),
    ],
)
def test_unknown_key_names_file_and_dotted_key(tmp_path: Path, text: str, key: str) -> None:
    message = load_error(tmp_path, text)
    assert f": {key}: unknown key" in message


@pytest.mark.parametrize(
    ("text", "key"),
    [
        ("[server]\nworkers = 'two'\n", "server.workers"),
        ("[server]\nworkers = true\n", "server.workers"),
        ("[server]\nlisten = '127.0.0.1:8080'\n", "server.listen"),
        ("[fleet]\nbreaker_failure_rate = 'half'\n", "fleet.breaker_failure_rate"),
        ("[fleet]\ncluster = 1\n", "fleet.cluster"),
        ("[store]\ndurability = 'sometimes'\n", "store.durability"),
        ("[rate_limits]\nscope = 'galaxy'\n", "rate_limits.scope"),
        ("fleet = 3\n", "fleet"),
    ],
)
def test_wrong_type_names_the_key(tmp_path: Path, text: str, key: str) -> None:
    message = load_error(tmp_path, text)
    assert f": {key}: must be" in message


@pytest.mark.parametrize(
    ("text", "key"),
    [
        ("[server]\nworkers = 1000\n", "server.workers"),
        ("[server]\nlisten = ['nowhere']\n", "server.listen"),
        # hosts no resolver takes: a label over 63 bytes, a NUL (a TypeError at bind)
        (f"[server]\nlisten = ['{'é' * 70}:8080']\n", "server.listen"),
        ('[server]\nlisten = ["a\\u0000b:8080"]\n', "server.listen"),
        ("[fleet]\nbreaker_failure_rate = 1.5\n", "fleet.breaker_failure_rate"),
        ("[fleet]\ntimeout_ms = 0\n", "fleet.timeout_ms"),
        ("[rate_limits]\ndefault = { rate = 1, burst = 0 }\n", "rate_limits.default.burst"),
        ('[server]\nsegment = ".."\n', "server.segment"),  # a POSIX name it cannot be
        # the metrics' row for sources past their table: counted together with those
        ('[[sources]]\nid = "_overflow"\ntenant = "t"\n', "sources[0].id"),
        # one heartbeat a second: a timeout of 1 aborts a healthy worker whose turn is late
        ("[server]\nheartbeat_timeout_s = 1\n", "server.heartbeat_timeout_s"),
        # one hook SQLite refuses fails its whole batch: other senders' hooks with it
        ("[server]\nmax_body_bytes = 1100000000\n", "server.max_body_bytes"),
    ],
)
def test_out_of_range_names_the_key(tmp_path: Path, text: str, key: str) -> None:
    assert f": {key}: " in load_error(tmp_path, text)


@pytest.mark.parametrize(
    ("limit", "key"),
    [
        ("default = { rate = 0.000001, burst = 100000000 }", "rate_limits.default"),
        ("tenants.acme = { rate = 1e-320, burst = 1 }", "rate_limits.tenants.acme"),
        ("tenants.acme = { rate = 0, burst = 1 }", "rate_limits.tenants.acme"),
        ("tenants.acme = { rate = -5, burst = 1 }", "rate_limits.tenants.acme"),
        ("tenants.acme = { rate = 5e6, burst = 1 }", "rate_limits.tenants.acme"),
    ],
)
def test_limit_that_overflows_or_makes_no_sense_is_refused(
    tmp_path: Path, limit: str, key: str
) -> None:
    message = load_error(tmp_path, f"[rate_limits]\n{limit}\n")
    assert f": {key}: " in message


def test_tenant_name_is_checked(tmp_path: Path) -> None:
    message = load_error(tmp_path, '[rate_limits]\ntenants."a b" = { rate = 1, burst = 1 }\n')
    assert "rate_limits.tenants.a b" in message


def test_redis_url_with_a_password_is_refused(tmp_path: Path) -> None:
    message = load_error(tmp_path, "[fleet]\nredis_url = 'redis://:hunter2@10.0.0.1:6379/0'\n")
    assert ": fleet.redis_url: " in message
    assert "password" in message
    assert "hunter2" not in message  # the error never repeats the secret
    message = load_error(tmp_path, "[fleet]\nredis_url = 'rediss://app:hunter2@h:6380'\n")
    assert "fleet.redis_url" in message and "hunter2" not in message
    assert config.load(write(tmp_path, "[fleet]\nredis_url = 'rediss://app@h:6380'\n"))


def test_redis_url_scheme(tmp_path: Path) -> None:
    assert "fleet.redis_url" in load_error(tmp_path, "[fleet]\nredis_url = 'http://h:1'\n")


def test_cross_checks(tmp_path: Path) -> None:
    two = REFERENCE + REFERENCE[REFERENCE.index("[[sources]]") :]
    assert "sources[1].id" in load_error(tmp_path, two)
    both = REFERENCE.replace('secret_env = "GITHUB_SECRET"', 'secret_env = "A", secret_file = "B"')
    assert "sources[0].verify.hmac" in load_error(tmp_path, both)
    neither = REFERENCE.replace('preset = "github", ', "")
    assert "sources[0].dedupe" in load_error(tmp_path, neither)
    required = '[[sources]]\nid = "x"\n'
    assert "sources[0].tenant: required" in load_error(tmp_path, required)


def test_unreadable_files(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read"):
        config.load(tmp_path / "missing.toml")
    assert "not valid TOML" in load_error(tmp_path, "[server\n")
    bad = tmp_path / "latin1.toml"
    bad.write_bytes(b"# caf\xe9\n")
    with pytest.raises(ConfigError, match="not UTF-8"):
        config.load(bad)


def check_config(*args: str | Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "ankusa_shm", "check-config", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "GITHUB_SECRET": "s3cret"},
    )


def test_a_toml_file_nested_too_deep_is_one_clear_error(tmp_path: Path) -> None:
    deep = write(tmp_path, "a = " + "[" * 100_000 + "]" * 100_000 + "\n")
    with pytest.raises(ConfigError, match="not valid TOML: nested too deep"):
        config.load(deep)


def test_check_config_command(tmp_path: Path) -> None:
    good = check_config(write(tmp_path, REFERENCE))
    assert good.returncode == 0, good.stderr
    assert "ok (1 sources; fleet kinds: rate_limit, dedupe; secrets read)" in good.stdout
    assert "warning" not in good.stderr

    # A secret serve could not read fails the check, as it would fail the start.
    unset = subprocess.run(
        [sys.executable, "-m", "ankusa_shm", "check-config", str(tmp_path / "ankusa.toml")],
        capture_output=True,
        text=True,
        timeout=60,
        env={k: v for k, v in os.environ.items() if k != "GITHUB_SECRET"},
    )
    assert unset.returncode == 2 and unset.stdout == ""
    assert "source github: environment variable GITHUB_SECRET is not set" in unset.stderr
    files = (
        "[[sources]]\nid = 'a'\ntenant = 't'\n"
        f"verify = {{ hmac = {{ header = 'x-sig', secret_file = '{tmp_path / 'none'}' }} }}\n"
        "[server]\nadmin_token_env = 'NO_SUCH_TOKEN'\n"
    )
    gone = check_config(write(tmp_path, files, "files.toml"))
    assert gone.returncode == 2
    assert f"source a: cannot read secret file {tmp_path / 'none'}" in gone.stderr
    assert "server.admin_token: environment variable NO_SUCH_TOKEN is not set" in gone.stderr

    # A fleet password file named and empty (half written) is a secret missing, not none.
    (tmp_path / "redis.pass").write_text("\n")
    fleet = (
        f"[rate_limits]\nscope = 'fleet'\n[fleet]\npassword_file = '{tmp_path / 'redis.pass'}'\n"
    )
    empty_password = check_config(write(tmp_path, fleet, "fleet.toml"))
    assert empty_password.returncode == 2
    assert (
        f"fleet.password: secret file {tmp_path / 'redis.pass'} is empty" in empty_password.stderr
    )

    empty = check_config(write(tmp_path, "", "empty.toml"))  # valid, and surely not meant
    assert empty.returncode == 0 and "ok (0 sources" in empty.stdout
    assert "no [[sources]]: every hook will be answered 404" in empty.stderr

    bad = check_config(write(tmp_path, "[fleet]\ntimeout_ms = 'fast'\n", "bad.toml"))
    assert bad.returncode == 2
    assert bad.stdout == ""
    assert str(tmp_path / "bad.toml") in bad.stderr and "fleet.timeout_ms" in bad.stderr
    assert "Traceback" not in bad.stderr

    overflow = write(tmp_path, "[rate_limits]\ndefault = { rate = 1e-320, burst = 1 }\n", "o.toml")
    r = check_config(overflow)
    assert r.returncode == 2 and "Traceback" not in r.stderr

    missing = check_config(tmp_path / "nope.toml")
    assert missing.returncode == 2 and "cannot read" in missing.stderr

    listing = check_config("--list")
    assert listing.returncode == 0
    keys = {line.split()[0] for line in listing.stdout.splitlines()}
    assert {"server.listen", "fleet.breaker_open_ms", "sources[].verify.hmac.header"} <= keys
    # Each default as it is written in the file, not as Python prints it.
    defaults = {line.split()[0]: line.split(None, 1)[1] for line in listing.stdout.splitlines()}
    assert defaults["server.listen"].startswith('["127.0.0.1:8080"] ')
    assert defaults["rate_limits.default"].startswith("{ rate = 100, burst = 200 } ")
    assert defaults["fleet.cluster"].startswith("false ")
    assert defaults["sources[].dedupe.preset"].startswith("(none) ")
