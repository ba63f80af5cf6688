"""The HTTP protocol in this process, over a real loopback socket: what a connection holds
while a client sends without reading."""

from __future__ import annotations

import asyncio
import socket

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

        server = HttpServer(handler, LIMITS)
        listener = socket.create_server(("127.0.0.1", 0))
        await server.start([listener], 16)
        reader, writer = await asyncio.open_connection(*listener.getsockname()[:2])
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
