"""The chaos run's provider: an open-loop load of signed GitHub-style hooks that records
every attempt and retries as a provider does.

Events are generated at a fixed rate, whatever the hosts answer (open loop: a host that
stalls does not slow the offer). Each event goes to one host first; an answer that is not
2xx, or no answer at all, is sent again -- the same delivery id, the same body, the same
signature -- to a host picked at random (the load balancer), after the Retry-After it was
given (capped, so a run of a minute sees its retries) or a short pause. Every attempt is
kept: when it was sent, to which host, its status (0: no answer), the hook id and whether
the answer said duplicate.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import random
import time
from dataclasses import dataclass, field

CONNECTIONS_PER_HOST = 24
ANSWER_TIMEOUT_S = 3.0
RETRY_CAP_S = 1.0
NO_ANSWER_PAUSE_S = 0.2
MAX_ATTEMPTS = 50


@dataclass(slots=True)
class Attempt:
    event: int
    host: int
    sent_s: float  # since the run began
    latency_ms: float
    status: int  # 0: no answer (refused, reset, closed, timed out)
    hook_id: str = ""
    duplicate: bool = False
    error: str = ""


@dataclass(slots=True)
class Event:
    key: str
    request: bytes  # the whole HTTP request, sent as is on every attempt
    attempts: int = 0
    acked: bool = False


@dataclass
class Load:
    ports: list[int]
    secret: str
    rate: float  # events per second, offered
    seed: int = 1
    events: list[Event] = field(default_factory=list)
    attempts: list[Attempt] = field(default_factory=list)
    t0: float = 0.0

    def __post_init__(self) -> None:
        self._rng = random.Random(self.seed)
        self._queues: list[asyncio.Queue[int]] = []
        self._run_id = f"{self.seed:x}-{time.time_ns():x}"

    def now(self) -> float:
        return time.monotonic() - self.t0

    def _event(self, i: int) -> Event:
        key = f"chaos-{self._run_id}-{i:08d}"
        body = json.dumps({"delivery": key, "n": i, "ref": "refs/heads/main"}).encode()
        mac = hmac.new(self.secret.encode(), body, hashlib.sha256).hexdigest()
        head = (
            "POST /hooks/github HTTP/1.1\r\nHost: edge\r\nContent-Type: application/json\r\n"
            f"X-GitHub-Event: push\r\nX-GitHub-Delivery: {key}\r\n"
            f"X-Hub-Signature-256: sha256={mac}\r\nContent-Length: {len(body)}\r\n\r\n"
        )
        return Event(key, head.encode() + body)

    async def run(self, duration_s: float, drain_s: float) -> None:
        """Offer ``rate`` events a second for ``duration_s``, then keep retrying the
        unacknowledged ones for up to ``drain_s``."""
        self.t0 = time.monotonic()
        self._queues = [asyncio.Queue() for _ in self.ports]
        conns = [
            asyncio.create_task(self._connection(h))
            for h in range(len(self.ports))
            for _ in range(CONNECTIONS_PER_HOST)
        ]
        await self._offer(duration_s)
        deadline = time.monotonic() + drain_s
        while time.monotonic() < deadline and not all(e.acked for e in self.events):
            await asyncio.sleep(0.1)
        for c in conns:
            c.cancel()
        await asyncio.gather(*conns, return_exceptions=True)

    async def _offer(self, duration_s: float) -> None:
        tick = 0.01
        n = 0
        while (elapsed := self.now()) < duration_s:
            due = int(elapsed * self.rate)
            while n < due:
                self.events.append(self._event(n))
                self._queues[n % len(self.ports)].put_nowait(n)
                n += 1
            await asyncio.sleep(tick)

    def _retry(self, i: int, delay_s: float) -> None:
        e = self.events[i]
        if e.attempts >= MAX_ATTEMPTS:
            return
        host = self._rng.randrange(len(self.ports))
        loop = asyncio.get_running_loop()
        loop.call_later(delay_s, self._queues[host].put_nowait, i)

    async def _connection(self, host: int) -> None:
        queue = self._queues[host]
        conn: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None = None
        while True:
            i = await queue.get()
            e = self.events[i]
            if e.acked:
                continue
            e.attempts += 1
            sent = self.now()
            try:
                if conn is None:
                    conn = await asyncio.wait_for(
                        asyncio.open_connection("127.0.0.1", self.ports[host]), ANSWER_TIMEOUT_S
                    )
                reader, writer = conn
                writer.write(e.request)
                status, headers, body = await asyncio.wait_for(_answer(reader), ANSWER_TIMEOUT_S)
            except (OSError, asyncio.IncompleteReadError, TimeoutError, ValueError) as ex:
                self.attempts.append(
                    Attempt(i, host, sent, (self.now() - sent) * 1000, 0, error=type(ex).__name__)
                )
                if conn is not None:
                    conn[1].close()
                conn = None
                self._retry(i, NO_ANSWER_PAUSE_S)
                await asyncio.sleep(0.05)
                continue
            latency = (self.now() - sent) * 1000
            doc = _json(body)
            a = Attempt(i, host, sent, latency, status)
            if 200 <= status < 300:
                a.hook_id = str(doc.get("id", ""))
                a.duplicate = bool(doc.get("duplicate", False))
                e.acked = True
            else:
                a.error = str(doc.get("error", ""))
                retry_after = headers.get("retry-after", "")
                delay = float(retry_after) if retry_after.isdigit() else NO_ANSWER_PAUSE_S
                self._retry(i, min(delay, RETRY_CAP_S))
            self.attempts.append(a)
            if headers.get("connection", "") == "close":
                writer.close()
                conn = None


async def _answer(reader: asyncio.StreamReader) -> tuple[int, dict[str, str], bytes]:
    head = await reader.readuntil(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split(" ", 2)[1])
    headers = {}
    for line in lines[1:]:
        if ":" in line:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
    body = await reader.readexactly(int(headers.get("content-length", "0")))
    return status, headers, body


def _json(body: bytes) -> dict[str, object]:
    try:
        doc = json.loads(body)
    except ValueError:
        return {}
    return doc if isinstance(doc, dict) else {}
