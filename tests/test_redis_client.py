"""The multiplexed RESP client: encoding, URLs, and replies that arrive after their caller
gave up."""

from __future__ import annotations

import asyncio
import ssl
import time

import pytest
from fleet_helpers import await_until, run, stopped
from redis_server import RedisServer

from ankusa_shm import config
from ankusa_shm.fleet import redis_client
from ankusa_shm.fleet.redis_client import Client, RedisError, ReplyError, pack
from ankusa_shm.fleet.redis_store import RedisStore
from ankusa_shm.redis_url import Endpoint, parse_url


def test_pack_encodes_resp() -> None:
    assert pack("PING") == b"*1\r\n$4\r\nPING\r\n"
    assert pack("SET", b"k", 5) == b"*3\r\n$3\r\nSET\r\n$1\r\nk\r\n$1\r\n5\r\n"
    assert pack("ECHO", b"") == b"*2\r\n$4\r\nECHO\r\n$0\r\n\r\n"
    assert pack("ECHO", "h\u00e9") == b"*2\r\n$4\r\nECHO\r\n$3\r\nh\xc3\xa9\r\n"  # bytes, not chars
    assert pack("ECHO", b"a\r\nb") == b"*2\r\n$4\r\nECHO\r\n$4\r\na\r\nb\r\n"  # binary-safe
    assert pack("INCRBY", "n", -12) == b"*3\r\n$6\r\nINCRBY\r\n$1\r\nn\r\n$3\r\n-12\r\n"


@pytest.mark.parametrize(
    ("url", "expected"),
    [
        ("redis://10.0.0.5:6380/3", Endpoint("10.0.0.5", 6380, "", 3)),
        ("redis://cache.internal", Endpoint("cache.internal", 6379, "", 0)),
        ("redis://127.0.0.1:7000/", Endpoint("127.0.0.1", 7000, "", 0)),
        ("redis://edge@10.0.0.5:6380/1", Endpoint("10.0.0.5", 6380, "", 1, "edge")),
        ("redis://ank%40usa@h:1/0", Endpoint("h", 1, "", 0, "ank@usa")),
        ("unix:///run/redis/redis.sock", Endpoint(path="/run/redis/redis.sock")),
        ("unix:///run/redis.sock?db=2", Endpoint(path="/run/redis.sock", db=2)),
        (
            "unix://edge@/run/redis.sock?db=2",
            Endpoint(path="/run/redis.sock", db=2, username="edge"),
        ),
    ],
)
def test_parse_url(url: str, expected: Endpoint) -> None:
    assert parse_url(url) == expected


def test_parse_url_password_comes_from_the_caller() -> None:
    ep = parse_url("redis://edge@h:1/0", password="s3cret")
    assert (ep.username, ep.password) == ("edge", "s3cret")


def test_parse_url_rediss_sets_tls() -> None:
    ep = parse_url("rediss://edge@cache.example:6380/2")
    ctx = ep.ssl_context()
    assert isinstance(ctx, ssl.SSLContext)
    assert ctx.verify_mode == ssl.CERT_REQUIRED and ctx.check_hostname
    assert (ep.host, ep.port, ep.db, ep.username) == ("cache.example", 6380, 2, "edge")
    assert parse_url("redis://cache.example").ssl_context() is None


@pytest.mark.parametrize("url", ["http://h:6379", "tcp://h:6379", "valkey://h", "h:6379"])
def test_parse_url_refuses_other_schemes(url: str) -> None:
    with pytest.raises(ValueError, match="scheme"):
        parse_url(url)


@pytest.mark.parametrize(
    ("url", "where", "db"),
    [
        ("redis://127.0.0.1:6380/3", "127.0.0.1:6380", 3),
        ("redis://edge@cache.internal", "cache.internal:6379", 0),
        ("rediss://cache.example:6380/2", "cache.example:6380", 2),
        ("unix:///run/redis.sock?db=2", "unix:/run/redis.sock", 2),
    ],
)
def test_a_url_the_config_accepts_the_client_reads(url: str, where: str, db: int) -> None:
    cfg = config.parse({"fleet": {"redis_url": url}}, "t.toml")
    ep = parse_url(cfg.fleet.redis_url)
    assert (ep.name, ep.db) == (where, db)


@pytest.mark.parametrize(
    ("url", "problem"),
    [
        ("redis://h:99999/0", "no valid port"),
        ("redis://h:port/0", "no valid port"),
        ("redis://h:6379/zero", "not a whole number"),
        ("unix:///run/redis.sock?db=two", "not a whole number"),
        ("unix://", "no socket path"),
        ("http://h:6379", "scheme"),
        ("redis://edge:pw@h:6379", "password"),
    ],
)
def test_the_config_refuses_a_url_the_client_cannot_read(url: str, problem: str) -> None:
    with pytest.raises(config.ConfigError, match=rf"^t.toml: fleet.redis_url: .*{problem}"):
        config.parse({"fleet": {"redis_url": url}}, "t.toml")


def client_for(server: RedisServer, stall_s: float = 5.0) -> Client:
    return Client(parse_url(server.url), stall_s=stall_s)


def test_calls_and_pipelines(redis_server: RedisServer) -> None:
    async def body() -> None:
        c = client_for(redis_server)
        try:
            assert await c.call("SET", "k", "v") == b"OK"
            assert await c.call("GET", "k") == b"v"
            replies = await c.pipeline([("INCR", "n"), ("HGET", "k", "f"), ("INCR", "n")])
            assert replies[0] == 1 and replies[2] == 2
            assert isinstance(replies[1], ReplyError)  # in place, not raised
            with pytest.raises(ReplyError, match="WRONGTYPE"):
                await c.call("HGET", "k", "f")
            got = await asyncio.gather(*(c.call("ECHO", f"m{i}") for i in range(50)))
            assert got == [f"m{i}".encode() for i in range(50)]
        finally:
            await c.close()

    run(body())


def test_late_reply_is_dropped_and_the_next_call_gets_its_own(redis_server: RedisServer) -> None:
    async def body() -> None:
        c = client_for(redis_server)
        try:
            assert await c.call("SET", "k", "current") == b"OK"
            with stopped(redis_server.pid):
                for i in range(3):  # their replies will come after their callers left
                    with pytest.raises(TimeoutError):
                        async with asyncio.timeout(0.05):
                            await c.call("ECHO", f"late-{i}")
                with pytest.raises(TimeoutError):
                    async with asyncio.timeout(0.05):
                        await c.pipeline([("ECHO", "late-p1"), ("ECHO", "late-p2")])
            # sent behind the abandoned requests on the same connection
            assert await c.call("GET", "k") == b"current"
            assert await c.call("ECHO", "mine") == b"mine"
            got = await asyncio.gather(*(c.call("ECHO", f"next-{i}") for i in range(10)))
            assert got == [f"next-{i}".encode() for i in range(10)]
        finally:
            await c.close()

    run(body())


def test_late_reply_while_others_wait(redis_server: RedisServer) -> None:
    """Callers that gave up and callers that wait, interleaved on one connection."""

    async def body() -> None:
        c = client_for(redis_server)
        try:
            await c.call("PING")

            async def impatient(i: int) -> bytes | None:
                try:
                    async with asyncio.timeout(0.05):
                        reply: bytes = await c.call("ECHO", f"gone-{i}")
                        return reply
                except TimeoutError:
                    return None

            with stopped(redis_server.pid):
                tasks = [
                    asyncio.ensure_future(c.call("ECHO", f"keep-{i}") if i % 2 else impatient(i))
                    for i in range(10)
                ]
                await asyncio.sleep(0.2)
            got = await asyncio.gather(*tasks)
            assert got == [f"keep-{i}".encode() if i % 2 else None for i in range(10)]
        finally:
            await c.close()

    run(body())


def test_deadlines_fail_each_waiter_on_time_and_the_replies_stay_in_order(
    redis_server: RedisServer,
) -> None:
    """Deadlines handed down with the requests, earliest last (the one timer is re-armed
    for it): each waiter fails with TimeoutError at its own deadline -- no earlier than
    the timer's slack (``_LATE_S``, and the loop's millisecond timers) allows, and not long
    after -- while one without a deadline keeps waiting and gets its own reply."""
    early = redis_client._LATE_S + 0.001

    async def body() -> None:
        c = client_for(redis_server)
        try:
            await c.call("PING")
            failed_after: dict[str, float] = {}

            async def bounded(name: str, budget_s: float) -> bytes | None:
                start = time.monotonic()
                try:
                    reply: list[bytes] = await c.pipeline([("ECHO", name)], start + budget_s)
                    return reply[0]
                except TimeoutError:
                    failed_after[name] = time.monotonic() - start
                    return None

            with stopped(redis_server.pid):
                tasks = [
                    asyncio.ensure_future(bounded("slow", 0.30)),
                    asyncio.ensure_future(c.call("ECHO", "patient")),
                    asyncio.ensure_future(bounded("fast", 0.05)),
                ]
                # a deadline already past: refused at once, without a word to the server
                # (nothing queued behind the stalled requests to swallow a later reply)
                start = time.monotonic()
                with pytest.raises(TimeoutError):
                    await c.pipeline([("ECHO", "too late")], start - 1)
                assert time.monotonic() - start < 0.05
                await asyncio.sleep(0.5)
            got = await asyncio.gather(*tasks)
            assert got == [None, b"patient", None]
            assert 0.05 - early <= failed_after["fast"] < 0.2, failed_after
            assert 0.30 - early <= failed_after["slow"] < 0.45, failed_after
            assert await c.call("ECHO", "after") == b"after"
        finally:
            await c.close()

    run(body())


def test_send_now_writes_at_once_and_answers_from_the_read_callback(
    redis_server: RedisServer,
) -> None:
    """``send_now``: with no connection open, a call connects (by way of ``pipeline``) and
    is answered; on an open one, its calls go out in one write behind what ``pipeline``
    queued earlier in the turn, and each ``then`` gets its own replies in order; a
    deadline already past is answered at once with TimeoutError, one that passes while
    the server is stopped by the timer -- and the replies that come later still land in
    order."""

    async def body() -> None:
        c = client_for(redis_server)
        got: list[object] = []

        def call(word: str, deadline: float) -> redis_client.Call:
            return (b"", ("ECHO", word), deadline, got.append)

        try:
            c.send_now([call("connecting", time.monotonic() + 5)])
            await await_until(lambda: bool(got), "an answer after connecting")
            assert got == [[b"connecting"]]
            got.clear()
            earlier = asyncio.ensure_future(c.pipeline([("ECHO", "first")]))
            await asyncio.sleep(0)  # its request is queued, not yet written
            deadline = time.monotonic() + 1
            c.send_now([*(call(f"now-{i}", deadline) for i in range(3)), call("late", 0.0)])
            assert len(got) == 1 and isinstance(got[0], TimeoutError)  # at once, unsent
            assert await earlier == [b"first"]
            await await_until(lambda: len(got) == 4, "three answers")
            assert got[1:] == [[b"now-0"], [b"now-1"], [b"now-2"]]
            got.clear()
            with stopped(redis_server.pid):
                c.send_now([call("stuck", time.monotonic() + 0.05)])
                await asyncio.sleep(0.2)
                assert len(got) == 1 and isinstance(got[0], TimeoutError)
            assert await c.call("ECHO", "after") == b"after"  # the late reply was dropped
        finally:
            await c.close()

    run(body())


def test_stalled_connection_is_closed_and_waiters_fail(redis_server: RedisServer) -> None:
    async def body() -> None:
        c = client_for(redis_server, stall_s=0.2)
        try:
            await c.call("PING")
            with stopped(redis_server.pid):
                waiting = asyncio.ensure_future(c.call("ECHO", "stuck"))
                await asyncio.sleep(0.4)  # the oldest request is now older than stall_s
                with pytest.raises(RedisError, match="stalled"):
                    await c.call("ECHO", "next")
                with pytest.raises(RedisError):
                    await waiting
            assert await c.call("ECHO", "again") == b"again"  # a fresh connection
        finally:
            await c.close()

    run(body())


def test_unreachable_server_fails_fast(redis_server: RedisServer) -> None:
    async def body() -> None:
        c = client_for(redis_server)
        try:
            redis_server.kill()
            for _ in range(2):  # refused, then the reconnect pause
                with pytest.raises(RedisError):
                    async with asyncio.timeout(2):
                        await c.call("PING")
            redis_server.start()
            await asyncio.sleep(0.2)
            assert await c.call("PING") == b"PONG"
        finally:
            await c.close()

    run(body())


def test_select_db(redis_server: RedisServer) -> None:
    async def body() -> None:
        c = Client(parse_url(f"redis://127.0.0.1:{redis_server.port}/3"))
        try:
            assert await c.call("SET", "in-3", "x") == b"OK"
        finally:
            await c.close()

    run(body())
    with redis_server.client() as r:
        assert r.exists("in-3") == 0
        r.select(3)
        assert r.get("in-3") == b"x"


def test_empty_pipeline_answers_at_once_and_wedges_nothing(redis_server: RedisServer) -> None:
    async def body() -> None:
        c = client_for(redis_server)
        store = RedisStore(c, "ankusa", cluster=False)
        try:
            await c.call("PING")
            async with asyncio.timeout(2):
                assert await c.pipeline([]) == []
                assert await c.send([]) == []
                assert await store.settle([], 0) == (0, 0)
                assert await c.call("ECHO", "after") == b"after"
        finally:
            await c.close()

    run(body())
