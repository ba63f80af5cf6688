"""Replies no Redis should send, from a fake server on loopback (a broken proxy, a
misbehaving module): a hook is answered on this host, as in an outage, and the settle
records are kept; nothing hangs, raises into the request path, or ends the drainer."""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Callable

import hiredis
import pytest
from fleet_helpers import admit, bare, fleet_config, open_fleet, run, segments, totals

from ankusa_shm.fleet.admission import Admit, Admitted
from ankusa_shm.fleet.redis_client import RedisError
from ankusa_shm.fleet.redis_store import RedisStore
from ankusa_shm.shm.counters import Counter
from ankusa_shm.shm.settle_queue import Op, Record

Answer = Callable[[list[bytes]], bytes | None]


def _bulk(b: bytes) -> bytes:
    return b"$%d\r\n%s\r\n" % (len(b), b)


class FakeRedis:
    """Answers what a RedisStore asks at start as Redis would, and script calls as
    ``answer`` says (None: as Redis would, an empty admit or settle)."""

    def __init__(self, answer: Answer) -> None:
        self._answer = answer
        self.port = 0

    async def __aenter__(self) -> FakeRedis:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc: object) -> None:
        self._server.close()

    async def _serve(self, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        reader = hiredis.Reader()
        while data := await r.read(65536):
            reader.feed(data)
            while (cmd := reader.gets()) is not False:
                w.write(self._reply(cmd))
        w.close()

    def _reply(self, cmd: list[bytes]) -> bytes:
        name = cmd[0].upper()
        if name == b"EVALSHA":
            return self._answer(cmd) or b"*2\r\n:0\r\n:0\r\n"
        if name == b"SCRIPT":
            return _bulk(hashlib.sha1(cmd[2]).hexdigest().encode())
        if name == b"GET":
            return b"$-1\r\n"
        if name == b"INFO":
            return _bulk(b"maxmemory:0\r\nmaxmemory_policy:noeviction\r\nevicted_keys:0\r\n")
        return b"+OK\r\n"


ADMIT_REPLIES = [
    b"*2\r\n$1\r\nx\r\n:0\r\n",  # a verdict that is no number: the hook hung for good
    b"*2\r\n_\r\n:0\r\n",  # RESP3's null
    b"*2\r\n#t\r\n$3\r\nh-1\r\n",  # RESP3's true, read as 1 (a duplicate)
    b"*2\r\n:9\r\n:0\r\n",  # no such verdict: was admitted, claim and all
    b"*2\r\n:1\r\n:5\r\n",  # a duplicate without an id: a 500 to the provider
    b"*2\r\n:1\r\n$2\r\n\xff\xfe\r\n",  # an id that is not text: a 500 on every resend
    b'*2\r\n:1\r\n$9\r\nx","a":"b\r\n',  # an id that breaks the answer's JSON
    b"*2\r\n:2\r\n$3\r\nabc\r\n",  # pending, for no number of ms
    b"*2\r\n:3\r\n:-5000\r\n",  # limited, for minus five seconds
    b"*2\r\n:4\r\n:0\r\n",  # writes refused, without the refusal
]


@pytest.mark.parametrize("reply", ADMIT_REPLIES, ids=range(len(ADMIT_REPLIES)))
def test_an_admit_reply_of_the_wrong_shape_is_answered_on_this_host(reply: bytes) -> None:
    def answer(cmd: list[bytes]) -> bytes | None:
        return reply if cmd[3].endswith(b":rl") and int(cmd[2]) > 1 else None

    async def body() -> tuple[list[Admitted], int]:
        async with FakeRedis(answer) as fake:
            with segments(1) as (seg,):
                url = f"redis://127.0.0.1:{fake.port}/0"
                cfg = fleet_config(url, bare(seg), timeout_ms=2000)
                async with open_fleet(cfg, seg) as fleet:
                    async with asyncio.timeout(5):  # far under its budget: not a timeout
                        answers = [await admit(fleet, cfg, f"ev{i}") for i in range(3)]
                return answers, totals(seg)[Counter.STORE_ERROR]

    answers, errors = run(body())
    assert all(isinstance(a, Admit) for a in answers), answers  # node-local, as in an outage
    assert errors >= 1


@pytest.mark.parametrize(
    "reply",
    [b"*2\r\n$1\r\nx\r\n:0\r\n", b"*1\r\n:1\r\n", b"%1\r\n:1\r\n:1\r\n", b"*2\r\n:1\r\n:-1\r\n"],
)
def test_a_settle_reply_of_the_wrong_shape_fails_the_delivery(reply: bytes) -> None:
    """Raised as anything but a RedisError, it ended the drainer, restarted every 5 s
    with a traceback, its records never counted as failing."""

    def answer(cmd: list[bytes]) -> bytes | None:
        return reply if not cmd[3].endswith(b":rl") else None

    async def body() -> None:
        async with FakeRedis(answer) as fake:
            with segments(1) as (seg,):
                cfg = fleet_config(f"redis://127.0.0.1:{fake.port}/0", bare(seg))
                store = RedisStore.from_config(cfg.fleet, "")
                try:
                    key = b"ankusa:{acme}:dd:github:k1"
                    record = Record(Op.PROMOTE, key, b"", b"h-1", 60_000, 0, 0)
                    with pytest.raises(RedisError, match=r"settle\.lua answered"):
                        await store.settle([record], now_ms=0)
                finally:
                    await store.close()

    run(body())
