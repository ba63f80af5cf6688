"""The listening sockets: bound by the supervisor before it forks, or handed over by
systemd socket activation. Workers inherit them; the supervisor keeps its copies open
for the workers it forks later, so a worker replaced on reload refuses no connection."""

from __future__ import annotations

import os
import socket

SD_LISTEN_FDS_START = 3


class BindError(Exception):
    pass


def split_address(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host.strip("[]"), int(port)


def bind(addresses: list[str], backlog: int) -> list[socket.socket]:
    socks: list[socket.socket] = []
    try:
        for address in addresses:
            host, port = split_address(address)
            family = socket.AF_INET6 if ":" in host else socket.AF_INET
            sock = socket.socket(family, socket.SOCK_STREAM)
            socks.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                sock.bind((host, port))
            except OSError as e:
                raise BindError(f"cannot listen on {address}: {e.strerror}") from None
            sock.listen(backlog)
            sock.setblocking(False)
    except BaseException:
        for s in socks:
            s.close()
        raise
    return socks


def from_systemd() -> list[socket.socket] | None:
    """The sockets systemd passed us (``LISTEN_FDS``), or None if it passed none. The
    variables are removed so no child mistakes them for its own."""
    if os.environ.get("LISTEN_PID") != str(os.getpid()):
        return None
    count = int(os.environ.get("LISTEN_FDS", "0"))
    for name in ("LISTEN_PID", "LISTEN_FDS", "LISTEN_FDNAMES"):
        os.environ.pop(name, None)
    if count <= 0:
        return None
    socks = []
    for fd in range(SD_LISTEN_FDS_START, SD_LISTEN_FDS_START + count):
        sock = socket.socket(fileno=fd)
        sock.setblocking(False)
        socks.append(sock)
    return socks


def describe(socks: list[socket.socket]) -> str:
    return ", ".join(_name(s) for s in socks)


def _name(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
