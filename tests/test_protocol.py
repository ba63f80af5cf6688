"""The HTTP protocol in this process, over a real loopback socket: what a connection holds
while a client sends without reading."""

from __future__ import annotations

import asyncio
import gc
import socket
import tracemalloc
from collections.abc import Awaitable, Callable

from ankusa_shm import config
from ankusa_shm.http.protocol import (
    FEED_BYTES,
    PIPELINE_DEPTH,
    HttpServer,
    Limits,
    Request,
    Response,
)

LIMITS = Limits.of(config.Server(max_connections=16))


async def _serve(handler: Callable[[Request], Awaitable[Response]]) -> tuple[HttpServer, int]:
    server = HttpServer(handler, LIMITS)
    listener = socket.create_server(("127.0.0.1", 0))
    await server.start([listener], 16)
    return server, listener.getsockname()[1]


def test_a_pipelined_burst_is_parsed_only_as_deep_as_the_pipeline() -> None:
    """2,000 requests in one burst, none answered yet: the connection parses about as many
    as its pipeline holds and keeps the rest as the bytes they came as, which take a
    fraction of what they do parsed. Once answers flow, every request is answered
    in the order it was sent, and the half-close after the burst loses none of them."""
    bodies = [b'{"n":%d}' % i for i in range(2000)]
    burst = b"".join(
        b"POST /hooks/demo HTTP/1.1\r\nhost: x\r\ncontent-length: %d\r\n\r\n%s" % (len(b), b)
        for b in bodies
    )
    per_request = len(burst) // len(bodies)

    async def body() -> tuple[int, int, list[bytes], bytes]:
        gate = asyncio.Event()
        handled: list[bytes] = []

        async def handler(req: Request) -> Response:
            await gate.wait()
            handled.append(req.body)
            return Response(201, b"{}")

        server, port = await _serve(handler)
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(burst)
        writer.write_eof()
        await asyncio.sleep(0.5)  # for the server to read what it will
        (conn,) = server.connections
        parsed = 1 + len(conn._pipeline)  # the one the handler holds, and those queued
        held = len(conn._held)
        gate.set()
        answers = await asyncio.wait_for(reader.read(), 30)
        writer.close()
        await server.stop(graceful=True, timeout_s=5)
        return parsed, held, handled, answers

    parsed, held, handled, answers = asyncio.run(body())
    assert parsed <= PIPELINE_DEPTH + FEED_BYTES // per_request + 1, parsed
    assert held > len(burst) // 2
    assert handled == bodies
    assert answers.count(b"HTTP/1.1 201 Created\r\n") == len(bodies)


def _tiny_chunks(n: int) -> bytes:
    """A chunked body of ``n`` 2-byte chunks, without the last chunk."""
    return b"2\r\naa\r\n" * n


CHUNKED_HEAD = b"POST /hooks/demo HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\n\r\n"


def test_a_body_of_tiny_chunks_costs_about_its_size() -> None:
    """The parser hands a chunked body over a chunk at a time; kept as a list of those
    pieces, 2-byte chunks cost 48 bytes of object each: a body under max_body_bytes
    held 28 times its size, per connection."""
    size = 200_000

    async def body() -> tuple[int, int]:
        got: list[int] = []

        async def handler(req: Request) -> Response:
            got.append(len(req.body))
            return Response(201, b"{}")

        server, port = await _serve(handler)
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        request = CHUNKED_HEAD + _tiny_chunks(size // 2) + b"0\r\n\r\n"  # not counted
        tracemalloc.start()
        writer.write(request)
        await reader.readuntil(b"{}")
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        writer.close()
        await server.stop(graceful=True, timeout_s=5)
        return got[0], peak

    length, peak = asyncio.run(body())
    assert length == size
    assert peak < 5 * size, peak  # 0.6 MB here; 12.7 MB as a list of pieces


def test_a_dropped_connection_frees_its_body_at_once() -> None:
    """A connection and its parser refer to each other, so only a collection frees them;
    until then the body a client abandoned was held, and an attacker's abandoned bodies
    piled up. (The collector is off here, as it rarely runs in a worker: its heap is
    frozen, and a client that only sends allocates little.)"""
    size = 200_000

    async def body() -> tuple[int, int]:
        async def handler(req: Request) -> Response:
            return Response(201, b"{}")

        server, port = await _serve(handler)
        gc.disable()
        try:
            unfinished = CHUNKED_HEAD + _tiny_chunks(size // 2)
            tracemalloc.start()
            before = tracemalloc.get_traced_memory()[0]
            _, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(unfinished)
            await writer.drain()
            for _ in range(200):
                (conn,) = server.connections
                if len(conn._body) == size:
                    break
                await asyncio.sleep(0.01)
            holding = tracemalloc.get_traced_memory()[0] - before
            writer.transport.abort()
            for _ in range(200):
                if not server.connections:
                    break
                await asyncio.sleep(0.01)
            left = tracemalloc.get_traced_memory()[0] - before
            tracemalloc.stop()
        finally:
            gc.enable()
        await server.stop(graceful=True, timeout_s=5)
        return holding, left

    holding, left = asyncio.run(body())
    assert holding >= size
    assert left < size // 2, (holding, left)
