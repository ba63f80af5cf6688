"""A load client for service tests: threads posting distinct signed hooks on keep-alive
connections, recording every answer, as a provider would see them."""

from __future__ import annotations

import hashlib
import hmac
import http.client
import json
import threading
import uuid
from dataclasses import dataclass, field

SECRET = "s3cret-for-tests"
GITHUB_SOURCE = """
[[sources]]
id = "github"
tenant = "acme"
verify = { hmac = { header = "x-hub-signature-256", prefix = "sha256=", secret_env = "GH_SECRET" } }
dedupe = { preset = "github" }
"""


def signed(body: bytes, delivery: str | None = None, secret: str = SECRET) -> dict[str, str]:
    mac = hmac.new(secret.encode(), body, hashlib.sha256).hexdigest()
    return {
        "x-hub-signature-256": f"sha256={mac}",
        "x-github-delivery": delivery or str(uuid.uuid4()),
        "x-github-event": "push",
        "content-type": "application/json",
    }


@dataclass
class Tally:
    accepted: dict[str, str] = field(default_factory=dict)  # delivery -> hook id (201)
    statuses: dict[int, int] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)  # requests that got no answer
    lock: threading.Lock = field(default_factory=threading.Lock)

    def count(self, status: int) -> int:
        return self.statuses.get(status, 0)


class Load:
    def __init__(self, port: int, source: str = "github", threads: int = 4) -> None:
        self.port = port
        self.source = source
        self.tally = Tally()
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, daemon=True) for _ in range(threads)]

    def __enter__(self) -> Load:
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> Tally:
        self._stop.set()
        for t in self._threads:
            t.join(30)
        return self.tally

    def _run(self) -> None:
        conn: http.client.HTTPConnection | None = None
        while not self._stop.is_set():
            if conn is None:
                conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=10)
            delivery = str(uuid.uuid4())
            body = json.dumps({"delivery": delivery}).encode()
            try:
                conn.request("POST", f"/hooks/{self.source}", body, signed(body, delivery))
                r = conn.getresponse()
                answer = json.loads(r.read())
            except (OSError, http.client.HTTPException) as e:
                with self.tally.lock:
                    self.tally.errors.append(type(e).__name__)
                conn.close()
                conn = None
                self._stop.wait(0.01)
                continue
            with self.tally.lock:
                self.tally.statuses[r.status] = self.tally.statuses.get(r.status, 0) + 1
                if r.status == 201:
                    self.tally.accepted[delivery] = answer["id"]
            if r.getheader("connection") == "close":
                conn.close()
                conn = None
        if conn is not None:
            conn.close()
