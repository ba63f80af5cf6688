"""Where the fleet's Redis is: ``fleet.redis_url`` read into an ``Endpoint``.

A module of its own, below both ``config`` (which checks the URL as it loads) and the
fleet's client (which connects to it), so that reading a config imports no client.
"""

from __future__ import annotations

import ssl
from dataclasses import dataclass, field
from urllib.parse import parse_qs, unquote, urlsplit


@dataclass(frozen=True)
class Endpoint:
    host: str = "127.0.0.1"
    port: int = 6379
    path: str = ""  # unix socket
    db: int = 0
    username: str = ""
    password: str = field(default="", repr=False)
    tls: bool = False
    ca_file: str = ""  # for TLS; "" = the system's CA bundle

    @property
    def name(self) -> str:
        return f"unix:{self.path}" if self.path else f"{self.host}:{self.port}"

    def ssl_context(self) -> ssl.SSLContext | None:
        return ssl.create_default_context(cafile=self.ca_file or None) if self.tls else None


def parse_url(url: str, password: str = "", tls_ca_file: str = "") -> Endpoint:
    """``redis://[user@]host[:port][/db]``, ``rediss://...`` (TLS), ``unix:///path[?db=N]``.
    The password comes from the caller (environment or file), never from the URL; anything
    this cannot use is a ValueError saying what."""
    u = urlsplit(url)
    if u.scheme not in ("redis", "rediss", "unix"):
        raise ValueError(f"scheme {u.scheme!r} is not redis://, rediss:// or unix://")
    if u.password:
        raise ValueError("a Redis URL must not carry a password (give it from a file or env)")
    try:
        port = u.port or 6379
    except ValueError:
        raise ValueError(f"{url!r} has no valid port") from None
    username = unquote(u.username or "")
    if u.scheme == "unix":
        if not u.path:
            raise ValueError(f"{url!r} names no socket path")
        db = parse_qs(u.query).get("db", ["0"])[0]
    else:
        db = u.path.lstrip("/") or "0"
    if not db.isdigit():
        raise ValueError(f"database {db!r} is not a whole number")
    if u.scheme == "unix":
        return Endpoint(path=u.path, db=int(db), username=username, password=password)
    tls = u.scheme == "rediss"
    host = u.hostname or "127.0.0.1"
    return Endpoint(host, port, "", int(db), username, password, tls, tls_ca_file)
