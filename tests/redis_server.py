"""A private redis-server for the tests and benchmarks: a free loopback port, its own
directory, stopped by its PID. Never the machine's shared Redis on 6379. It lives beside
the tests, not in the installed package: a service host has no use for it."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import redis


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass(frozen=True)
class Tls:
    """The files a TLS-only server is started with; ``ca`` signed ``cert``."""

    cert: Path
    key: Path
    ca: Path


class RedisServer:
    """A redis-server process; signals go to its PID and nothing else. With ``tls`` it
    listens only for TLS on ``port`` (plain port 0) and does not ask clients for
    certificates."""

    def __init__(self, port: int | None = None, *extra: str, tls: Tls | None = None) -> None:
        self.port = port or free_port()
        self.extra = extra
        self.tls = tls
        self.dir = tempfile.mkdtemp(prefix="ankusa-redis-")
        self.proc: subprocess.Popen[bytes] | None = None
        self.start()

    @property
    def url(self) -> str:
        scheme = "rediss" if self.tls else "redis"
        return f"{scheme}://127.0.0.1:{self.port}/0"

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def start(self) -> None:
        """Start (or start again, empty) on the same port."""
        listen = ["--port", str(self.port)]
        if self.tls is not None:
            listen = [
                "--port", "0",
                "--tls-port", str(self.port),
                "--tls-cert-file", str(self.tls.cert),
                "--tls-key-file", str(self.tls.key),
                "--tls-ca-cert-file", str(self.tls.ca),
                "--tls-auth-clients", "no",
            ]  # fmt: skip
        self.proc = subprocess.Popen(
            [
                "redis-server",
                *listen,
                "--bind", "127.0.0.1",
                "--save", "",
                "--appendonly", "no",
                "--dir", self.dir,
                "--logfile", str(Path(self.dir) / "redis.log"),
                *self.extra,
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )  # fmt: skip
        deadline = time.monotonic() + 10
        while True:
            try:
                with self.client(socket_timeout=0.5) as r:
                    r.ping()
                return
            except redis.ConnectionError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"redis-server on port {self.port} did not start") from None
                time.sleep(0.02)

    def client(self, socket_timeout: float = 5) -> redis.Redis:
        if self.tls is None:
            return redis.Redis(port=self.port, socket_timeout=socket_timeout)
        return redis.Redis(
            port=self.port, socket_timeout=socket_timeout, ssl=True, ssl_ca_certs=str(self.tls.ca)
        )

    def commandstats(self) -> dict[str, int]:
        """Calls per command since start (or CONFIG RESETSTAT), as the server counted them."""
        with self.client() as r:
            info = r.info("commandstats")
        return {k.removeprefix("cmdstat_"): int(v["calls"]) for k, v in info.items()}

    def stop_signal(self) -> None:
        os.kill(self.pid, signal.SIGSTOP)

    def cont_signal(self) -> None:
        os.kill(self.pid, signal.SIGCONT)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGCONT)
            self.proc.kill()
            self.proc.wait(10)

    def close(self) -> None:
        self.kill()
        shutil.rmtree(self.dir, ignore_errors=True)
