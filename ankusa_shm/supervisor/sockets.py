"""The listening sockets: bound by the supervisor before it forks, or handed over by
systemd socket activation. Workers inherit them; the supervisor keeps its copies open
for the workers it forks later, so a worker replaced on reload refuses no connection.

Each worker *lane* has its own sockets, bound with ``SO_REUSEPORT`` to the same
addresses, so the kernel spreads new connections evenly over the lanes. One socket
shared by every worker is not even: uvloop accepts until the queue is empty, so the
worker that wakes first takes a whole burst (measured: 86 % of wrk's 64 connections
on one of two workers, half the throughput of an even split). The supervisor binds
every lane and keeps it open while its worker is respawned or replaced, so connections
queued for it wait instead of being reset when the worker exits -- unless its worker
cannot start, when they are closed until one is started on it again. A new lane is
bound without listening; its worker listens on it once it serves, so a worker that
fails to boot never held connections. Sockets from systemd are one per address and are
shared by every lane.

``SO_REUSEPORT`` would as gladly share a port with any other process of the same user:
a second service started on the same address would take half of the hooks, silently.
So each address is first bound once without it, which fails if anyone listens there.
"""

from __future__ import annotations

import os
import socket

from ankusa_shm.config import split_address

SD_LISTEN_FDS_START = 3


class BindError(Exception):
    pass


class Listeners:
    """The sockets of every lane: bound on first use, kept until the lane is trimmed."""

    def __init__(self, addresses: list[str], backlog: int) -> None:
        self._addresses = addresses
        self._backlog = backlog
        self._shared = from_systemd()
        self._lanes: dict[int, list[socket.socket]] = {}
        if self._shared is None:
            for s in bind(addresses, self._backlog, listen=False):  # in use by anyone: BindError
                s.close()
        self._name = describe(self.lane(0))  # bind now: a port in use is an error at start

    def lane(self, i: int, listen: bool = True) -> list[socket.socket]:
        """Lane ``i``'s sockets, bound now if they are not yet; ``listen=False`` leaves
        new ones for their worker to listen on once it serves (the kernel gives a lane
        connections only while it listens)."""
        if self._shared is not None:
            return self._shared
        if i not in self._lanes:
            self._lanes[i] = bind(self._addresses, self._backlog, reuse_port=True, listen=listen)
        return self._lanes[i]

    def all(self) -> list[socket.socket]:
        if self._shared is not None:
            return list(self._shared)
        return [s for lane in self._lanes.values() for s in lane]

    def trim(self, lanes: int) -> None:
        """Close the sockets of lanes ``lanes`` and above (fewer workers now)."""
        for i in [i for i in self._lanes if i >= max(1, lanes)]:
            for s in self._lanes.pop(i):
                s.close()

    def drop(self, i: int) -> None:
        """Close this process's sockets of lane ``i``: its worker cannot start for now, and
        connections queued on it would wait for nobody. The lane is bound again when a
        worker is next started on it (systemd's shared sockets stay)."""
        for s in self._lanes.pop(i, []):
            s.close()

    def close(self) -> None:
        for s in self.all():
            s.close()
        self._lanes.clear()
        self._shared = [] if self._shared is not None else None
        self._name = "nothing"

    def describe(self) -> str:
        return self._name


def bind(
    addresses: list[str], backlog: int, reuse_port: bool = False, listen: bool = True
) -> list[socket.socket]:
    socks: list[socket.socket] = []
    try:
        for address in addresses:
            host, port = split_address(address)
            family = socket.AF_INET6 if ":" in host else socket.AF_INET
            sock = socket.socket(family, socket.SOCK_STREAM)
            socks.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if reuse_port:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            try:  # listen() too: a port another socket has bound and not yet listened on
                sock.bind((host, port))  # binds here (SO_REUSEADDR) and refuses at listen()
                if listen:
                    sock.listen(backlog)
            except OSError as e:
                raise BindError(f"cannot listen on {address}: {e.strerror}") from None
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
