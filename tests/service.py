"""One ``ankusa-shm serve`` in a subprocess, as a host runs it: its own port, segment,
store and notify socket. Tests talk to it over real sockets and signal it by PID."""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from redis_server import free_port

from ankusa_shm.shm import procs
from ankusa_shm.shm import segment as segmod
from ankusa_shm.shm.segment import Segment

READY_TIMEOUT_S = 20.0


@dataclass
class Answer:
    status: int
    headers: dict[str, str]
    body: dict[str, Any]


def toml_table(name: str, values: dict[str, Any]) -> str:
    lines = [f"[{name}]"]
    lines += [f"{k} = {json.dumps(v)}" for k, v in values.items()]
    return "\n".join(lines) + "\n"


class Service:
    def __init__(
        self,
        tmp: Path,
        rest: str = "",
        *,
        server: dict[str, Any] | None = None,
        store: dict[str, Any] | None = None,
        env: dict[str, str] | None = None,
        segment: str | None = None,
        port: int | None = None,
    ) -> None:
        self.dir = tmp
        tmp.mkdir(parents=True, exist_ok=True)
        self.port = port or free_port()
        self.segment = segment or f"ankusa-test-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.store_path = tmp / "hooks.db"
        self.config_path = tmp / "config.toml"
        self.log_path = tmp / "service.log"
        self.admin_port = free_port()
        srv = {
            "listen": [f"127.0.0.1:{self.port}"],
            "workers": 2,
            "segment": self.segment,
            "admin_listen": f"127.0.0.1:{self.admin_port}",
        }
        srv.update(server or {})
        self.write_config(rest, srv, {"path": str(self.store_path), **(store or {})})
        self.env = {**os.environ, **(env or {})}
        self.proc: subprocess.Popen[bytes] | None = None
        self.notify_path = tmp / "notify.sock"
        self.notify: socket.socket | None = None
        self.notifications: list[str] = []

    def write_config(self, rest: str, server: dict[str, Any], store: dict[str, Any]) -> None:
        self._server, self._store = server, store
        text = toml_table("server", server) + toml_table("store", store) + rest
        self.config_path.write_text(text)

    def rewrite(self, rest: str, server: dict[str, Any] | None = None, **store: Any) -> None:
        """A new config (for HUP): the same server and store sections, but for what
        ``server`` and ``store`` change in them."""
        self.write_config(rest, {**self._server, **(server or {})}, {**self._store, **store})

    # -- life -------------------------------------------------------------------------

    def start(
        self,
        env: dict[str, str] | None = None,
        argv_prefix: list[str] | None = None,
        pass_fds: tuple[int, ...] = (),
        ready: bool = True,
    ) -> Service:
        """Start it, and wait for READY=1 unless ``ready`` is false."""
        if self.notify is None:
            self.notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
            self.notify.bind(str(self.notify_path))
            self.notify.settimeout(0.2)
        log = open(self.log_path, "ab")  # noqa: SIM115 -- the child writes it; closed below
        try:
            self.proc = subprocess.Popen(
                [
                    *(argv_prefix or []),
                    sys.executable,
                    "-m",
                    "ankusa_shm",
                    "serve",
                    "--config",
                    str(self.config_path),
                ],
                pass_fds=pass_fds,
                env={**self.env, "NOTIFY_SOCKET": str(self.notify_path), **(env or {})},
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=self.dir,
            )
        finally:
            log.close()
        if ready:
            self.wait_for("READY=1")
        return self

    def wait_for(self, field: str, timeout: float = READY_TIMEOUT_S) -> None:
        """Wait until a notify message carries ``field`` (READY=1, WATCHDOG=1, ...)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise AssertionError(f"service exited {self.proc.returncode}:\n{self.log()}")
            if self.receive(field):
                return
        raise AssertionError(f"no {field} within {timeout} s:\n{self.log()}")

    def receive(self, field: str) -> bool:
        assert self.notify is not None
        try:
            msg = self.notify.recv(4096).decode()
        except TimeoutError:
            return False
        self.notifications.append(msg)
        return field in msg.split("\n")

    def received_fields(self) -> set[str]:
        """Every field of every message sent so far, reading what is still queued."""
        assert self.notify is not None
        self.notify.setblocking(False)
        try:
            while True:
                self.notifications.append(self.notify.recv(4096).decode())
        except BlockingIOError:
            pass
        finally:
            self.notify.settimeout(0.2)
        return {f for m in self.notifications for f in m.split("\n")}

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def send(self, sig: int) -> None:
        os.kill(self.pid, sig)

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30.0) -> int:
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        return self.proc.wait(timeout)

    def close(self) -> None:
        """Whatever happened: no process, no socket, no segment left behind."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        for p in self.children():
            with contextlib.suppress(ProcessLookupError):
                os.kill(p.pid, signal.SIGKILL)
        if self.notify is not None:
            self.notify.close()
            self.notify = None
        segmod.unlink(self.segment)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def children(self) -> list[procs.ProcessInfo]:
        """The live processes holding slots in the segment."""
        try:
            with Segment.attach(self.segment, readonly=True) as seg:
                return [p for p in procs.read(seg.view, seg.layout) if p.alive]
        except segmod.SegmentError:
            return []

    def pids(self, role: str) -> list[int]:
        return sorted(p.pid for p in self.children() if p.role == role)

    def one(self, role: str, timeout: float = 15.0) -> int:
        """The one process of ``role``, once it holds its slot: READY=1 waits for the
        workers, not for the drainer or the admin process to claim theirs."""
        deadline = time.monotonic() + timeout
        while len(found := self.pids(role)) != 1:
            if time.monotonic() > deadline:
                raise AssertionError(f"no one {role} within {timeout} s: {found}")
            time.sleep(0.05)
        return found[0]

    # -- HTTP -------------------------------------------------------------------------

    def connection(self, timeout: float = 10.0) -> http.client.HTTPConnection:
        return http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)

    def admin(
        self,
        method: str,
        path: str,
        body: bytes | None = None,
        headers: dict[str, str] | None = None,
        timeout: float = 10.0,
    ) -> tuple[int, dict[str, str], bytes]:
        """One request to the admin listener: (status, headers, raw body)."""
        c = http.client.HTTPConnection("127.0.0.1", self.admin_port, timeout=timeout)
        try:
            c.request(method, path, body=body, headers=headers or {})
            r = c.getresponse()
            return r.status, {k.lower(): v for k, v in r.getheaders()}, r.read()
        finally:
            c.close()

    def post(
        self,
        source: str,
        body: bytes,
        headers: dict[str, str] | None = None,
        conn: http.client.HTTPConnection | None = None,
    ) -> Answer:
        own = conn is None
        c = conn or self.connection()
        try:
            c.request("POST", f"/hooks/{source}", body=body, headers=headers or {})
            r = c.getresponse()
            raw = r.read()
            return Answer(r.status, {k.lower(): v for k, v in r.getheaders()}, json.loads(raw))
        finally:
            if own:
                c.close()
