"""A TCP proxy in front of a real redis-server that drops the client's connection under
its first script calls, the way a server's ``CLIENT KILL``, an idle timeout or a proxy
restart does, at a moment a test chooses: before the call reaches the server, or after the
server ran it and before its reply comes back."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from redis_server import free_port


@dataclass
class CutProxy:
    upstream: tuple[str, int]
    cut_before_run: bool  # drop the call itself; else drop its reply
    cuts: int  # connections to drop, one script call each
    port: int = field(default_factory=free_port)
    made: int = 0  # connections dropped so far
    _tasks: set[asyncio.Task[None]] = field(default_factory=set)
    _writers: list[asyncio.StreamWriter] = field(default_factory=list)

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection(*self.upstream)
        except BaseException:
            writer.close()
            raise
        reply_to_drop = asyncio.Event()

        async def to_server() -> None:
            while data := await reader.read(65536):
                if b"EVALSHA" in data and self.made < self.cuts:
                    self.made += 1
                    if self.cut_before_run:
                        writer.close()
                        return
                    reply_to_drop.set()
                up_writer.write(data)
                await up_writer.drain()

        async def to_client() -> None:
            while data := await up_reader.read(65536):
                if reply_to_drop.is_set():  # the call's reply: the server ran it
                    writer.close()
                    return
                writer.write(data)
                await writer.drain()

        pumps = [asyncio.ensure_future(to_server()), asyncio.ensure_future(to_client())]
        try:
            await asyncio.wait(pumps, return_when=asyncio.FIRST_COMPLETED)
        finally:
            writer.close()
            up_writer.close()
            for pump in pumps:
                pump.cancel()
            await asyncio.gather(*pumps, return_exceptions=True)

    def _track(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._writers.append(writer)  # closed at the end even if its task never ran
        task = asyncio.ensure_future(self._serve(reader, writer))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)


@contextlib.asynccontextmanager
async def cut_proxy(
    upstream: tuple[str, int], *, cut_before_run: bool, cuts: int = 1
) -> AsyncIterator[CutProxy]:
    proxy = CutProxy(upstream, cut_before_run, cuts)
    server = await asyncio.start_server(proxy._track, "127.0.0.1", proxy.port)
    try:
        yield proxy
    finally:
        server.close()
        for task in list(proxy._tasks):
            task.cancel()
        await asyncio.gather(*proxy._tasks, return_exceptions=True)
        for writer in proxy._writers:
            writer.close()
