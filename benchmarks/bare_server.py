#!/usr/bin/env python3
"""The ceiling for scripts/bench_http.py: uvloop + httptools answering every request with
201 and a fixed body, and doing nothing else (no verification, no admission, no store).

It forks its workers over one listening socket, as the service does, so the figure is
what this machine's HTTP stack alone allows at the same process count. Every request is
parsed to its last body byte before it is answered.

    .venv/bin/python benchmarks/bare_server.py --port 8080 --workers 2
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import socket
import sys
import typing

import httptools
import uvloop

_BODY = b'{"status":"accepted","id":"00000000-0000-7000-8000-000000000000"}'
_RESPONSE = (
    b"HTTP/1.1 201 Created\r\ncontent-type: application/json\r\n"
    b"content-length: %d\r\n\r\n%s" % (len(_BODY), _BODY)
)


class Bare(asyncio.Protocol):
    """One connection: parse with httptools, answer each complete request at once."""

    def __init__(self) -> None:
        self.parser = httptools.HttpRequestParser(self)
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = typing.cast(asyncio.Transport, transport)  # uvloop's is no subclass

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            assert self.transport is not None
            self.transport.write(b"HTTP/1.1 400 Bad Request\r\ncontent-length: 0\r\n\r\n")
            self.transport.close()

    def on_message_complete(self) -> None:
        assert self.transport is not None
        self.transport.write(_RESPONSE)
        if not self.parser.should_keep_alive():
            self.transport.close()


async def _serve(sock: socket.socket) -> None:
    loop = asyncio.get_running_loop()
    stop = loop.create_future()
    loop.add_signal_handler(signal.SIGTERM, stop.set_result, None)
    server = await loop.create_server(Bare, sock=sock, backlog=2048)
    await stop
    server.close()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8080)
    p.add_argument("--workers", type=int, default=2)
    args = p.parse_args()

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((args.host, args.port))
    sock.listen(2048)
    sock.setblocking(False)

    children: list[int] = []
    for _ in range(args.workers):
        pid = os.fork()
        if pid == 0:  # the worker: its own loop, created after fork
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            uvloop.run(_serve(sock))
            os._exit(0)
        children.append(pid)

    def stop(_sig: int, _frame: object) -> None:
        for pid in children:
            os.kill(pid, signal.SIGTERM)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    for pid in children:
        os.waitpid(pid, 0)  # retried by Python itself when a signal interrupts it
    return 0


if __name__ == "__main__":
    sys.exit(main())
