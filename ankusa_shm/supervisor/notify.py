"""systemd's notify protocol, spoken directly: one datagram per message to the socket
named by ``NOTIFY_SOCKET``. Outside systemd (no such variable) every call is a no-op.

A send never blocks the supervisor's loop. A datagram socket's queue is short (ten
messages by default), and a receiver that reads slowly, or not at all, would otherwise
stop the loop that reaps and watches every child. A message that does not fit waits,
in order, and goes with the next send or ``flush`` (the loop calls it every tick); if the
backlog grows past ``PENDING_MAX``, the oldest messages go first.
"""

from __future__ import annotations

import collections
import logging
import os
import socket

log = logging.getLogger("ankusa_shm.supervisor")

PENDING_MAX = 64


class Notifier:
    def __init__(self) -> None:
        path = os.environ.pop("NOTIFY_SOCKET", "")  # children must not speak for us
        self._address = "\0" + path[1:] if path.startswith("@") else path
        self._sock: socket.socket | None = None
        if path:
            self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
            self._sock.setblocking(False)
        self._pending: collections.deque[bytes] = collections.deque(maxlen=PENDING_MAX)
        self._waiting = False  # the receiver has not kept up: said once until it does
        usec = os.environ.pop("WATCHDOG_USEC", "")
        pid = os.environ.pop("WATCHDOG_PID", "")
        watched = usec.isdigit() and (not pid or pid == str(os.getpid()))
        # Ping at half the interval systemd allows, as sd_watchdog_enabled(3) advises.
        self.watchdog_s: float | None = int(usec) / 2e6 if watched and path else None

    def send(self, *fields: str) -> None:
        if self._sock is None:
            return
        self._pending.append("\n".join(fields).encode())
        self.flush()

    def flush(self) -> None:
        """Send what waits, in order, until the receiver's queue is full."""
        sock = self._sock
        while sock is not None and self._pending:
            try:
                sock.sendto(self._pending[0], self._address)
            except BlockingIOError:
                if not self._waiting:
                    self._waiting = True
                    log.warning("systemd notify: the receiver is not reading; messages wait")
                return
            except OSError as e:
                log.warning("systemd notify failed: %s", e.strerror)
            self._pending.popleft()
        if self._waiting and not self._pending:
            self._waiting = False
            log.info("systemd notify: the receiver reads again")

    def close(self) -> None:
        if self._sock is not None:
            self.flush()
            self._sock.close()
            self._sock = None
