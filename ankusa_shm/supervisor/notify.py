"""systemd's notify protocol, spoken directly: one datagram per message to the socket
named by ``NOTIFY_SOCKET``. Outside systemd (no such variable) every call is a no-op."""

from __future__ import annotations

import logging
import os
import socket

log = logging.getLogger("ankusa_shm.supervisor")


class Notifier:
    def __init__(self) -> None:
        path = os.environ.pop("NOTIFY_SOCKET", "")  # children must not speak for us
        self._address = "\0" + path[1:] if path.startswith("@") else path
        self._sock: socket.socket | None = None
        if path:
            self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
        usec = os.environ.pop("WATCHDOG_USEC", "")
        pid = os.environ.pop("WATCHDOG_PID", "")
        watched = usec.isdigit() and (not pid or pid == str(os.getpid()))
        # Ping at half the interval systemd allows, as sd_watchdog_enabled(3) advises.
        self.watchdog_s: float | None = int(usec) / 2e6 if watched and path else None

    def send(self, *fields: str) -> None:
        if self._sock is None:
            return
        try:
            self._sock.sendto("\n".join(fields).encode(), self._address)
        except OSError as e:
            log.warning("systemd notify failed: %s", e.strerror)

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None
