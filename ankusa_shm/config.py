"""Configuration: every setting declared once, as a typed field with its default and doc.

``load(path)`` reads one TOML file and builds a frozen ``Config`` through one generic
converter driven by these declarations; ``defaults()`` is the embedded configuration a
newcomer runs with. Any problem -- an unknown key, a wrong type, a value out of range -- is
a ``ConfigError`` naming the file and the key. Nothing here logs, exits or reads the
environment: secrets are named here (``secret_env``, ``password_file``, ...) and read by
the process that needs them.
"""

from __future__ import annotations

import dataclasses
import functools
import ipaddress
import json
import os
import re
import tomllib
import types
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from ankusa_shm.limits import Limit
from ankusa_shm.redis_url import parse_url
from ankusa_shm.shm.layout import MAX_NAME, OVERFLOW_LABEL

Scope = Literal["node", "fleet"]
ADMIN_BACKLOG = 128  # the admin listener's: a few local clients, or a load balancer
Check = Callable[[Any], str | None]  # returns what is wrong, or None

# ASCII, so characters are bytes; \Z, not $, which would let a trailing newline through.
_NAME = re.compile(rf"^(?!\.+\Z)[A-Za-z0-9_.-]{{1,{MAX_NAME}}}\Z")  # not "." nor ".."
_DIGITS = re.compile(r"^[0-9]{1,5}\Z")  # str.isdigit() takes '²', which int() refuses
_PRINTABLE_KEY = re.compile(r"^[\x20-\x7e]{1,200}\Z")


def _shown(key: str) -> str:
    """A key from the file as an error message names it: as written when it is plain,
    quoted when it holds what could break the one-line message (a newline, say)."""
    return key if _PRINTABLE_KEY.match(key) else repr(key)


class ConfigError(Exception):
    """One line: ``file: key: what is wrong``."""


def setting(default: Any, doc: str, check: Check | None = None) -> Any:
    """Declare a setting: its default, one line of doc, and an optional check."""
    kw: dict[str, Any] = {"metadata": {"doc": doc, "check": check}}
    if isinstance(default, list | dict):
        kw["default_factory"] = lambda: type(default)(default)
    else:
        kw["default"] = default
    return field(**kw)


def required(doc: str, check: Check | None = None) -> Any:
    return field(metadata={"doc": doc, "check": check})


MAX_BODY_BYTES = 256 << 20
NODE_SETTLE_CAPACITY = 1024  # the settle queue of a service started without a fleet scope


def at_least(n: float) -> Check:
    return lambda v: None if v >= n else f"must be at least {n}"


def between(lo: float, hi: float) -> Check:
    return lambda v: None if lo <= v <= hi else f"must be between {lo} and {hi}"


def name_problem(v: str) -> str | None:
    """What is wrong with ``v`` as a name (a source, a tenant, a segment, a consumer)."""
    if _NAME.match(v):
        return None
    return f"must be 1-{MAX_NAME} characters of A-Z a-z 0-9 _ . -, not only dots"


def _source_id(v: str) -> str | None:
    if v == OVERFLOW_LABEL:  # its requests would be counted with those of the overflow
        return f"{v!r} is the metrics' label for sources past their table"
    return name_problem(v)


def _address(v: str) -> str | None:
    host, sep, port = v.rpartition(":")
    if not sep or not host or not _DIGITS.match(port) or not 0 < int(port) < 65536:
        return f"{v!r} is not host:port"
    try:  # as the resolver will take it (a label over 63 bytes, say, it cannot)
        ok = host.isprintable() and bool(host.strip("[]").encode("idna"))
    except UnicodeError:
        ok = False
    return None if ok else f"{v!r}: {host!r} is not a host name or address"


def _addresses(v: list[str]) -> str | None:
    if not v:
        return "needs at least one address"
    return next((e for e in map(_address, v) if e), None)


def split_address(address: str) -> tuple[str, int]:
    """A checked ``host:port`` (``_address``) as the host, without an IPv6 literal's
    brackets, and the port."""
    host, _, port = address.rpartition(":")
    return host.strip("[]"), int(port)


def is_loopback(address: str) -> bool:
    """Whether ``host:port`` binds only this host: 127.0.0.0/8, ::1 or localhost."""
    host = split_address(address)[0]
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _redis_url(v: str) -> str | None:
    try:
        parse_url(v)
    except ValueError as e:
        return str(e)
    return None


# -- sections ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Server:
    listen: list[str] = setting(["127.0.0.1:8080"], "Addresses for hooks.", _addresses)
    workers: int = setting(0, "Request workers; 0 = one per CPU.", between(0, 256))
    admin_listen: str = setting(
        "127.0.0.1:9180",
        "Address of the admin API (/metrics /healthz /readyz /v1/...); '' for none.",
        lambda v: None if v == "" else _address(v),
    )
    admin_token_env: str = setting("", "Environment variable holding the admin bearer token.")
    admin_token_file: str = setting("", "File holding the admin bearer token.")
    request_metrics: bool = setting(
        True,
        "Count requests by source and status, and keep every histogram (off: they stay at 0).",
    )
    max_body_bytes: int = setting(
        1_048_576,
        "Largest hook body accepted; at most 256 MiB (a body is held in memory whole, and "
        "SQLite refuses a value of 1e9 bytes or more).",
        between(1, MAX_BODY_BYTES),
    )
    max_header_bytes: int = setting(
        65_536, "Largest request line and headers accepted.", between(1_024, 1_048_576)
    )
    header_timeout_s: float = setting(
        10.0, "From a request's first byte to its last header.", between(0.1, 3_600)
    )
    body_timeout_s: float = setting(
        30.0,
        "From a request's last header to its last body byte; also how long a client may "
        "leave our answers unread before it is dropped.",
        between(0.1, 3_600),
    )
    keepalive_timeout_s: float = setting(
        15.0, "How long an idle keep-alive connection is kept.", between(0.1, 3_600)
    )
    graceful_timeout_s: float = setting(
        30.0, "On SIGTERM, how long in-flight work may take before it is killed.", between(0, 3_600)
    )
    heartbeat_timeout_s: float = setting(
        10.0,
        "A child whose event loop is silent this long is restarted. It writes a heartbeat a"
        " second: at least 3, so a turn of the loop that runs late is not taken for silence.",
        between(3, 3_600),
    )
    backlog: int = setting(2_048, "Listen backlog of each address.", between(1, 65_535))
    max_connections: int = setting(
        10_000,
        "Client connections each worker holds open. At the cap a new connection closes the "
        "longest-idle keep-alive one, or is closed itself if none is idle. Fewer if the "
        "open-file limit leaves less room.",
        between(1, 1_000_000),
    )
    segment: str = setting("ankusa-shm", "Name of the shared-memory segment.", name_problem)


# store.retention: a whole number and a unit, e.g. '7d'; [0-9], since \d takes any digit.
_DURATION = re.compile(r"^([0-9]{1,9})([smhd])\Z")
_UNIT_MS = {"s": 1_000, "m": 60_000, "h": 3_600_000, "d": 86_400_000}
_LONGEST_MS = 36_500 * 86_400_000


def _duration_ms(v: str) -> int | None:
    """The milliseconds ``v`` stands for; None if it is not a duration we take."""
    m = _DURATION.match(v)
    ms = int(m[1]) * _UNIT_MS[m[2]] if m else 0
    return ms if 0 < ms <= _LONGEST_MS else None


def _retention(v: str) -> str | None:
    if v == "" or _duration_ms(v) is not None:
        return None
    return f"must be '' or a duration from 1s to 36500d like '7d', '12h', '30m', not {v!r}"


@dataclass(frozen=True)
class Store:
    path: str = setting(
        "var/hooks.db", "The host's durable hook store (SQLite); relative: to the working dir."
    )
    durability: Literal["fsync", "os"] = setting(
        "fsync", "fsync: each commit batch is on disk; os: left to the OS."
    )
    commit_wait_ms: int = setting(
        0,
        "How long a batch's first hook may wait for company; 0: no longer than the event"
        " loop's turn in which it came.",
        between(0, 50),
    )
    max_batch: int = setting(256, "Hooks in one transaction at most.", between(1, 10_000))
    lock_timeout_ms: int = setting(
        5_000, "A hook whose transaction has not begun by then is not stored.", between(10, 600_000)
    )
    sweep_interval_s: int = setting(
        60, "Pause between sweeps of expired dedupe index rows.", between(1, 86_400)
    )
    retention: str = setting(
        "",
        "Delete hooks older than this (e.g. '7d', '12h', '30m') once every named consumer"
        " acked them; '' keeps them.",
        _retention,
    )
    retention_interval_s: int = setting(60, "Pause between retention runs.", between(1, 86_400))

    @property
    def file(self) -> str:
        """The database as the file system names it: one file however ``path`` is
        written (relative, through a symlink), to tell whether two configs share it."""
        return os.path.realpath(self.path)

    @property
    def close_wait_s(self) -> float:
        """How long closing a writer waits for its thread. Every hook it holds is answered
        within one ``lock_timeout_ms`` (its transaction began, or it was given up on); a
        second more covers the last batch's write and fsync."""
        return self.lock_timeout_ms / 1000 + 1.0

    @property
    def retention_ms(self) -> int | None:
        """``retention`` in milliseconds; None when hooks are kept."""
        if not self.retention:
            return None
        ms = _duration_ms(self.retention)
        if ms is None:
            raise ValueError(f"store.retention: {_retention(self.retention)}")
        return ms


@dataclass(frozen=True)
class LimitSpec:
    rate: float = required("Hooks per second (may be fractional).")
    burst: int = required("Hooks admitted at once from a full bucket.", at_least(1))

    @functools.cached_property
    def limit(self) -> Limit:
        return Limit.of(self.rate, self.burst)


@dataclass(frozen=True)
class RateLimits:
    scope: Scope = setting("node", "node: this host's buckets; fleet: one bucket in Redis.")
    default: LimitSpec = setting(LimitSpec(100, 200), "Limit of tenants not listed.")
    tenants: dict[str, LimitSpec] = setting({}, "Per-tenant limits.")

    def limit_for(self, tenant: str) -> Limit:
        spec = self.tenants.get(tenant)
        return (spec or self.default).limit

    def changed(self, new: RateLimits, tenants: set[str]) -> set[str]:
        """Which of ``tenants`` the move to ``new`` gives another limit: their buckets,
        filled under the old one, must be forgotten (a bucket filled under a strict limit
        kept a raised one refusing for up to the old burst's length)."""
        return {t for t in tenants if self.limit_for(t) != new.limit_for(t)}


@dataclass(frozen=True)
class Dedupe:
    scope: Scope = setting("node", "node: the store's own index; fleet: one window in Redis.")


@dataclass(frozen=True)
class Fleet:
    redis_url: str = setting("redis://127.0.0.1:6379/0", "The fleet store.", _redis_url)
    cluster: bool = setting(False, "The URL names one node of a Redis Cluster.")
    password_env: str = setting("", "Environment variable holding the Redis password.")
    password_file: str = setting("", "File holding the Redis password.")
    tls_ca_file: str = setting("", "CA bundle for rediss:// (default: the system's).")
    key_prefix: str = setting("ankusa", "Prefix of every fleet key.", name_problem)
    timeout_ms: int = setting(20, "Hard budget of one store call.", between(1, 10_000))
    breaker_failure_rate: float = setting(
        0.5, "Failed share of calls that opens the breaker.", between(0.01, 1.0)
    )
    breaker_min_calls: int = setting(
        20,
        "Calls in the window before it may open; as many failures in a row open it.",
        at_least(1),
    )
    breaker_window_ms: int = setting(
        10_000, "Sliding window of call outcomes.", between(1_000, 3_600_000)
    )
    breaker_open_ms: int = setting(5_000, "How long it stays open before a probe.", at_least(1))
    pending_ttl_ms: int = setting(30_000, "Life of an unsettled claim.", between(1_000, 86_400_000))
    settle_queue_size: int = setting(
        50_000,
        "Settle queue capacity, with a fleet scope (without one, at most 1024 at start).",
        between(16, 10_000_000),
    )
    settle_interval_ms: int = setting(5, "Drainer's pause between batches.", between(1, 10_000))
    settle_batch_max: int = setting(1_000, "Operations per drain round trip.", between(1, 100_000))
    settle_timeout_ms: int = setting(2_000, "Budget of one drain round trip.", between(10, 600_000))
    drain_on_stop_ms: int = setting(
        5_000, "On SIGTERM, how long the drainer keeps delivering.", between(0, 600_000)
    )

    # Derived pauses: the time limits of the fleet's calls that are not settings are
    # computed here, from the settings they follow.

    @property
    def call_deadline_s(self) -> float:
        """How long admission waits for the store's answer. ``timeout_ms`` bounds the whole
        admit, and a call given up on must still be answered node-local, for its hook and
        for every call that gave up in the same instant: a tenth of the budget, at most
        2 ms, is kept back for that."""
        return (self.timeout_ms - min(2.0, self.timeout_ms / 10)) / 1000

    @property
    def probe_timeout_ms(self) -> int:
        """A breaker probe still unfinished after this is taken over by the next caller.
        Its call is bounded by the budget; twice that plus 100 ms leaves room for a busy
        event loop without letting a lost probe hold the breaker for long."""
        return 2 * self.timeout_ms + 100

    @property
    def admit_stall_s(self) -> float:
        """A request worker's connection whose oldest request has waited this long is
        closed and replaced. Every caller gave up after one budget; fifty budgets (at least
        1 s) is long past any caller's interest, yet short enough that a hung server does
        not pile up work on one socket."""
        return max(1.0, 50 * self.timeout_ms / 1000)

    @property
    def reconnect_pause_s(self) -> float:
        """After a failed connect, calls fail at once for this long instead of trying
        again: five budgets, at most 100 ms. Short, because it is the breaker, not this
        pause, that keeps calls off a dead server; this only spares a burst of callers
        one refused connect each."""
        return min(0.1, 5 * self.timeout_ms / 1000)

    @property
    def drainer_stall_s(self) -> float:
        """The drainer's connection is replaced when a round trip has waited twice its
        budget: the batch was already given up on (and kept) after one."""
        return 2 * self.settle_timeout_ms / 1000


# An HTTP field name (RFC 9110 token), so a typo cannot name a header no request carries.
_TOKEN = re.compile(r"^[!#$%&'*+.^_`|~0-9A-Za-z-]+\Z")


def _header_name(v: str) -> str | None:
    return None if _TOKEN.match(v) else f"{v!r} is not a header name"


def _json_path(v: str) -> str | None:
    if all(v.split(".")):
        return None
    return f"{v!r} is not a dotted path, e.g. 'data.object.id'"


def _previous_secret(where: str) -> Any:
    return setting("", f"{where} holding the secret being replaced, accepted too meanwhile.")


@dataclass(frozen=True)
class Hmac:
    header: str = required("Header carrying the signature.", _header_name)
    secret_env: str = setting("", "Environment variable holding the secret.")
    secret_file: str = setting("", "File holding the secret.")
    previous_secret_env: str = _previous_secret("Environment variable")
    previous_secret_file: str = _previous_secret("File")
    prefix: str = setting("", "Text before the digest, e.g. 'sha256='.")
    algorithm: Literal["sha256", "sha1", "sha512"] = setting("sha256", "Digest.")
    encoding: Literal["hex", "base64"] = setting(
        "hex", "How the digest is written: hex (GitHub) or base64 (Shopify)."
    )


@dataclass(frozen=True)
class StandardWebhooks:
    secret_env: str = setting("", "Environment variable holding the whsec_ secret.")
    secret_file: str = setting("", "File holding the whsec_ secret.")
    previous_secret_env: str = _previous_secret("Environment variable")
    previous_secret_file: str = _previous_secret("File")
    tolerance_s: int = setting(
        300, "Largest distance of the signed timestamp from now.", between(1, 86_400)
    )


@dataclass(frozen=True)
class Svix(StandardWebhooks):
    """The Standard Webhooks scheme under svix-* header names."""


@dataclass(frozen=True)
class Stripe:
    secret_env: str = setting("", "Environment variable holding the endpoint's secret.")
    secret_file: str = setting("", "File holding the endpoint's secret.")
    previous_secret_env: str = _previous_secret("Environment variable")
    previous_secret_file: str = _previous_secret("File")
    tolerance_s: int = setting(
        300, "Largest distance of the signed timestamp from now.", between(1, 86_400)
    )


SignatureScheme = Hmac | StandardWebhooks | Stripe


@dataclass(frozen=True)
class Verify:
    hmac: Hmac | None = setting(None, "HMAC of the body in one header.")
    standard_webhooks: StandardWebhooks | None = setting(
        None, "Standard Webhooks: webhook-id, webhook-timestamp, webhook-signature."
    )
    svix: Svix | None = setting(None, "Svix: svix-id, svix-timestamp, svix-signature.")
    stripe: Stripe | None = setting(None, "Stripe: the Stripe-Signature header.")

    def schemes(self) -> list[tuple[str, SignatureScheme]]:
        """(key, spec) of every scheme given; the config lets through at most one."""
        return [
            (f.name, v)
            for f in dataclasses.fields(self)
            if (v := getattr(self, f.name)) is not None
        ]


DedupePreset = Literal["github", "standard_webhooks", "svix", "shopify", "stripe"]


@dataclass(frozen=True)
class SourceDedupe:
    preset: DedupePreset | None = setting(
        None,
        "github (x-github-hook-id:x-github-delivery) | standard_webhooks (webhook-id) |"
        " svix (svix-id) | shopify (x-shopify-event-id, else x-shopify-webhook-id) |"
        " stripe (the JSON body's id).",
    )
    header: str = setting("", "Header carrying the event key.", _header_name)
    json_path: str = setting("", "Dotted path of the event key in a JSON body.", _json_path)
    ttl_seconds: int = setting(259_200, "Dedupe window.", between(1, 31_536_000))


@dataclass(frozen=True)
class Source:
    id: str = required("Path segment: POST /hooks/{id}.", _source_id)
    tenant: str = required("Tenant whose rate limit this source draws on.", name_problem)
    verify: Verify = setting(Verify(), "Signature verification.")
    dedupe: SourceDedupe | None = setting(None, "How the event key is found.")

    @property
    def dedupe_ttl_s(self) -> int:
        """The dedupe window of this source's events (the default when it sets none)."""
        return (self.dedupe or SourceDedupe()).ttl_seconds


@dataclass(frozen=True)
class Config:
    server: Server = setting(Server(), "")
    store: Store = setting(Store(), "")
    rate_limits: RateLimits = setting(RateLimits(), "")
    dedupe: Dedupe = setting(Dedupe(), "")
    fleet: Fleet = setting(Fleet(), "")
    sources: list[Source] = setting([], "")
    origin: str = field(default="<embedded defaults>", compare=False)

    @property
    def fleet_kinds(self) -> tuple[str, ...]:
        """The kinds answered by the fleet store: ``rate_limit`` and/or ``dedupe``."""
        kinds = (("rate_limit", self.rate_limits.scope), ("dedupe", self.dedupe.scope))
        return tuple(k for k, scope in kinds if scope == "fleet")

    @property
    def settle_capacity(self) -> int:
        """The settle queue's slots: ``fleet.settle_queue_size`` with a fleet scope. With
        none, nothing is queued, and a ring of that size would only take /dev/shm (its
        slots are numbered when it is made: 31 MB resident at 50,000); a small one keeps
        a reload to a fleet scope working until the next restart, its drops made good
        from the store."""
        size = self.fleet.settle_queue_size
        return size if self.fleet_kinds else min(size, NODE_SETTLE_CAPACITY)

    @property
    def dedupe_window_s(self) -> int:
        """The longest dedupe window of any source: how long a stored hook may still be
        owed to the fleet's window (what a recovery looks back over)."""
        return max((s.dedupe_ttl_s for s in self.sources), default=0)

    @property
    def workers_drain_s(self) -> float:
        """On SIGTERM, how long the workers may finish in-flight requests: the graceful
        timeout less what is stopped after them within it -- the drainer's last deliveries
        (with a fleet scope) and a second for the admin process -- but at least half of
        it. Taking all of it left those none: they were killed at the deadline."""
        g = self.server.graceful_timeout_s
        after = 1.0 + (self.fleet.drain_on_stop_ms / 1000 if self.fleet_kinds else 0.0)
        return max(g - after, g / 2)

    def source(self, source_id: str) -> Source | None:
        return next((s for s in self.sources if s.id == source_id), None)

    def public(self) -> dict[str, Any]:
        """What may be shown to anyone who can read the segment: no secrets, no sources."""
        return {
            "origin": self.origin,
            "store": self.store.file,
            "rate_limits": {"scope": self.rate_limits.scope},
            "dedupe": {"scope": self.dedupe.scope},
            "fleet": {
                f.name: getattr(self.fleet, f.name)
                for f in dataclasses.fields(Fleet)
                if f.name not in ("password_env", "password_file", "tls_ca_file")
            },
            "sources": len(self.sources),
        }


def defaults() -> Config:
    """What ``serve`` runs with no file: node scope, the store under ./var, one ``demo``
    source without verification whose event key is the JSON body's ``id``."""
    demo = Source(id="demo", tenant="demo", dedupe=SourceDedupe(json_path="id"))
    return Config(sources=[demo])


def load(path: str | Path) -> Config:
    path = Path(path)
    try:
        raw = tomllib.loads(path.read_text(encoding="utf-8"))
    except OSError as e:
        raise ConfigError(f"{path}: cannot read: {e.strerror}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{path}: not UTF-8 text") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: not valid TOML: {e}") from None
    except RecursionError:
        raise ConfigError(f"{path}: not valid TOML: nested too deep") from None
    return parse(raw, str(path))


def parse(raw: Mapping[str, Any], origin: str) -> Config:
    cfg: Config = dataclasses.replace(_build(Config, raw, origin, ""), origin=origin)
    _cross_checks(cfg, origin)
    return cfg


def _build(cls: type[Any], raw: Any, origin: str, path: str) -> Any:
    if not isinstance(raw, Mapping):
        raise ConfigError(f"{origin}: {path or 'top level'}: must be a table")
    hints = typing.get_type_hints(cls)
    known = {f.name: f for f in dataclasses.fields(cls) if f.name != "origin"}
    unknown = sorted(set(raw) - set(known))
    if unknown:
        where = f"{path}.{_shown(unknown[0])}" if path else _shown(unknown[0])
        raise ConfigError(f"{origin}: {where}: unknown key")
    values: dict[str, Any] = {}
    for name, f in known.items():
        key = f"{path}.{name}" if path else name
        if name not in raw:
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise ConfigError(f"{origin}: {key}: required")
            continue
        value = _convert(hints[name], raw[name], origin, key)
        check = f.metadata.get("check")
        problem = check(value) if check else None
        if problem:
            raise ConfigError(f"{origin}: {key}: {problem}")
        values[name] = value
    try:
        obj = cls(**values)
        if isinstance(obj, LimitSpec):
            _ = obj.limit
    except ValueError as e:
        raise ConfigError(f"{origin}: {path}: {e}") from None
    return obj


def _convert(tp: Any, v: Any, origin: str, key: str) -> Any:
    def bad(what: str) -> ConfigError:
        return ConfigError(f"{origin}: {key}: must be {what}, not {v!r}")

    base = typing.get_origin(tp)
    if base in (types.UnionType, typing.Union):
        inner = [a for a in typing.get_args(tp) if a is not type(None)]
        return _convert(inner[0], v, origin, key)
    if base is Literal:
        choices = typing.get_args(tp)
        if v not in choices:
            raise bad(" or ".join(repr(c) for c in choices))
        return v
    if base is list:
        if not isinstance(v, list):
            raise bad("an array")
        (item,) = typing.get_args(tp)
        return [_convert(item, x, origin, f"{key}[{i}]") for i, x in enumerate(v)]
    if base is dict:
        if not isinstance(v, Mapping):
            raise bad("a table")
        _, item = typing.get_args(tp)
        for k in v:
            if problem := name_problem(k):
                raise ConfigError(f"{origin}: {key}.{_shown(k)}: {problem}")
        return {k: _convert(item, x, origin, f"{key}.{k}") for k, x in v.items()}
    if dataclasses.is_dataclass(tp):
        return _build(typing.cast(type[Any], tp), v, origin, key)
    if tp is bool:
        if not isinstance(v, bool):
            raise bad("true or false")
        return v
    if tp is int:
        if isinstance(v, bool) or not isinstance(v, int):
            raise bad("a whole number")
        return v
    if tp is float:
        if isinstance(v, bool) or not isinstance(v, int | float):
            raise bad("a number")
        return float(v)
    if tp is str:
        if not isinstance(v, str):
            raise bad("a string")
        return v
    raise TypeError(f"no converter for {tp!r} at {key}")


def check(cfg: Config) -> None:
    """The checks across settings, again, for a config assembled from two: a reload keeps
    the running one's restart-only settings, and what it keeps must agree with the rest."""
    _cross_checks(cfg, cfg.origin)


def _cross_checks(cfg: Config, origin: str) -> None:
    seen: set[str] = set()
    for i, src in enumerate(cfg.sources):
        if src.id in seen:
            raise ConfigError(f"{origin}: sources[{i}].id: {src.id!r} is used twice")
        seen.add(src.id)
        schemes = src.verify.schemes()
        if len(schemes) > 1:
            given = ", ".join(name for name, _ in schemes)
            raise ConfigError(
                f"{origin}: sources[{i}].verify: give at most one scheme, not {given}"
            )
        for name, scheme in schemes:
            if bool(scheme.secret_env) == bool(scheme.secret_file):
                raise ConfigError(
                    f"{origin}: sources[{i}].verify.{name}: "
                    "give exactly one of secret_env, secret_file"
                )
            if scheme.previous_secret_env and scheme.previous_secret_file:
                raise ConfigError(
                    f"{origin}: sources[{i}].verify.{name}: "
                    "give at most one of previous_secret_env, previous_secret_file"
                )
        d = src.dedupe
        if d is not None and sum(map(bool, (d.preset, d.header, d.json_path))) != 1:
            raise ConfigError(
                f"{origin}: sources[{i}].dedupe: give exactly one of preset, header, json_path"
            )
    s = cfg.server
    if s.admin_token_env and s.admin_token_file:
        raise ConfigError(
            f"{origin}: server: give at most one of admin_token_env, admin_token_file"
        )
    if (
        s.admin_listen
        and not is_loopback(s.admin_listen)
        and not (s.admin_token_env or s.admin_token_file)
    ):
        raise ConfigError(
            f"{origin}: server.admin_listen: {s.admin_listen} is not a loopback address; "
            "give server.admin_token_env or server.admin_token_file to serve it there"
        )
    f = cfg.fleet
    if f.password_env and f.password_file:
        raise ConfigError(f"{origin}: fleet: give at most one of password_env, password_file")
    if f.cluster and parse_url(f.redis_url).path:
        raise ConfigError(f"{origin}: fleet.cluster: a Redis Cluster is not reached over unix://")


_EXPANDED = (Config, Source, Verify)


def _as_toml(value: object) -> str:
    """A default as it would be written in the file; ``(none)`` for a setting unset."""
    if value is None:
        return "(none)"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, list | tuple):
        return "[" + ", ".join(map(_as_toml, value)) + "]"
    if isinstance(value, dict):
        items = ", ".join(f"{k} = {_as_toml(v)}" for k, v in value.items())
        return f"{{ {items} }}" if items else "{}"
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return _as_toml({f.name: getattr(value, f.name) for f in dataclasses.fields(value)})
    return repr(value)


def describe() -> list[tuple[str, str, str]]:
    """(key, default, doc) for every setting, for ``check-config --list`` and the docs."""
    rows: list[tuple[str, str, str]] = []

    def walk(cls: type[Any], prefix: str) -> None:
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            if f.name == "origin":
                continue
            key = f"{prefix}{f.name}"
            tp = hints[f.name]
            inner = [a for a in typing.get_args(tp) if a is not type(None)]
            if typing.get_origin(tp) is list and dataclasses.is_dataclass(inner[0]):
                walk(typing.cast(type[Any], inner[0]), key + "[].")  # [[sources]]
                continue
            table = next((t for t in [tp, *inner] if dataclasses.is_dataclass(t)), None)
            if table is not None and cls in _EXPANDED:  # a section or a source's sub-table
                walk(typing.cast(type[Any], table), key + ".")
                continue
            if f.default is not dataclasses.MISSING:
                default = _as_toml(f.default)
            elif f.default_factory is not dataclasses.MISSING:
                default = _as_toml(f.default_factory())
            else:
                default = "(required)"
            rows.append((key, default, f.metadata.get("doc", "")))

    walk(Config, "")
    return rows
