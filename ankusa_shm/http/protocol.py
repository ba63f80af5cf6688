"""HTTP/1.1 framing over asyncio, parsed by httptools: keep-alive, pipelining, bodies of
either framing, and the limits that keep one client from costing the others.

A connection parses what it receives a slice at a time; each complete request goes onto
the connection's pipeline and is answered in order by one task at a time, so a pipelined
burst is answered in the order it was sent. Once the pipeline is deep, the rest of a read
is held unparsed (a request parsed takes several times its bytes) and reading pauses until
answers make room, so a client that sends without reading cannot grow our memory.
Limits: a request line plus headers larger than ``max_header_bytes`` is 431;
a body larger than ``max_body_bytes`` is 413 as soon as the ``Content-Length`` (or the
chunks seen so far) says so, without reading the rest; a transfer coding other than
chunked is 501; bytes that do not parse are 400, and so is a request with more than one
``Host`` field or a malformed one, an HTTP/1.1 request with none, or an HTTP/1.0 one with
a transfer coding; HTTP/2 and later are 505. Each ends the
connection: nothing more is read, and the requests queued before it are answered first,
in order (a client pairs answers with requests by their order, RFC 9112 9.3.2); none is
cancelled, since a hook being handled may already be committed. Deadlines (headers,
body, idle keep-alive, and answers left unread, which bound what a client can make us
hold) are checked by one sweep per server each ``SWEEP_S`` rather than a timer per
request. A request asking to switch protocols (``Upgrade: h2c``, as ``curl --http2``
sends) is answered over HTTP/1.1 as if it had not asked; CONNECT is 400.

A server holds at most ``max_connections``. At the cap, a new connection closes the one
that has been idle longest (a kept-alive client must expect that, RFC 9112 9.3), or, with
none idle, is closed itself: refusing one client beats running out of file descriptors,
which refuses every one.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import socket
import time
import typing
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from http import HTTPStatus

import httptools

from ankusa_shm import config, fds
from ankusa_shm.shm.counters import Counter, CounterRow

log = logging.getLogger("ankusa_shm.http")

SWEEP_S = 0.25
LATE_S = 1.0  # a sweep this much behind is skipped: the process did not run meanwhile
PIPELINE_DEPTH = 16  # requests parsed ahead of their answers before reading pauses
# Parsed at a time, so that a read holding a burst of requests stops being parsed near
# the pipeline's depth: 2,000 pipelined in one read once took 1.7 MiB of heap, kept by
# the process after. A big body costs a few more calls (measured: 0.14 ms a MiB, not 0.05).
FEED_BYTES = 8192
LINGER_S = 1.0  # after an error answer: how long to discard what the client still sends
SHED_LOG_S = 60.0  # at most one warning this often while connections are being shed
# On a graceful stop: how long an idle connection is kept for a request its client may be
# sending at that very moment (one closed under it is reset, and the hook refused): a
# client that sends within it is answered, with ``connection: close``
STOP_GRACE_S = 1.0


# Request and Response are built once per request and never changed; not frozen, since
# a frozen dataclass's __init__ costs three times as much.
@dataclass(slots=True)
class Request:
    method: bytes
    path: bytes  # without the query string
    headers: list[tuple[str, str]]  # latin-1 text, names lower-case, in the order received
    body: bytes
    query: bytes = b""  # after the "?", undecoded
    started_ns: int = 0  # monotonic, when its first byte was parsed
    # done once its client has sent all it will or is gone: for a handler that would
    # otherwise go on waiting for it (a long-poll)
    hung_up: Callable[[], asyncio.Future[None]] | None = None


@dataclass(slots=True)
class Response:
    status: int
    body: bytes
    headers: tuple[tuple[bytes, bytes], ...] = ()
    content_type: bytes = b"application/json"


Handler = Callable[[Request], Awaitable[Response]]
Observer = Callable[[bytes, int, int], None]
"""Told of every answer: the request's path, the status, and when its first byte came."""


@dataclass(frozen=True)
class Limits:
    max_header_bytes: int
    max_body_bytes: int
    header_timeout_s: float
    body_timeout_s: float
    keepalive_timeout_s: float
    max_connections: int

    @classmethod
    def of(cls, s: config.Server) -> Limits:
        return cls(
            max_header_bytes=s.max_header_bytes,
            max_body_bytes=s.max_body_bytes,
            header_timeout_s=s.header_timeout_s,
            body_timeout_s=s.body_timeout_s,
            keepalive_timeout_s=s.keepalive_timeout_s,
            max_connections=fds.connection_cap(s.max_connections),
        )


class _Reject(Exception):
    """Raised inside a parser callback to stop parsing and answer ``status``."""

    def __init__(self, status: int, error: str) -> None:
        self.status = status
        self.error = error


def _origin_path(target: bytes) -> bytes:
    """The path of an absolute-form target (``http://host/path``), which a server must
    accept (RFC 9112 3.2.2) though few clients send it but to a proxy; any other target
    is left as it is, to be found nowhere."""
    scheme, sep, rest = target.partition(b"://")
    if not sep or scheme.lower() not in (b"http", b"https"):
        return target
    return b"/" + rest.partition(b"/")[2]


def _check_coding(coding: str) -> None:
    """Chunked is the only transfer coding we decode: another one is 501 (RFC 9112 6.1),
    not a body stored still coded; when chunked is not the last, the body's length cannot
    be known, 400 (6.3). Every field's value, joined by commas."""
    codings = [c for c in (c.strip().lower() for c in coding.split(",")) if c]
    if codings[-1:] != ["chunked"]:
        raise _Reject(400, "bad_request")
    if len(codings) > 1:
        raise _Reject(501, "not_implemented")


def _check_version(version: str, coding: str) -> None:
    """A request of a version other than 1.1: 1.0 is served, without chunked bodies, a
    major version above 1 is 505, and 0.9's request line (no version: the parser calls it
    0.9) or a 1.x we do not know is 400. HTTP/1.0 has no Transfer-Encoding: a 1.0 proxy
    in front that ignores it would read the chunks as requests of their own, so its
    framing is faulty (RFC 9112 6.1)."""
    if version.partition(".")[0] not in ("0", "1"):
        raise _Reject(505, "http_version_not_supported")
    if version != "1.0" or coding:
        raise _Reject(400, "bad_request")


# A Host field's value (RFC 9112 3.2, RFC 3986 3.2.2): an IP literal in brackets or a
# registered name or IPv4 address (possibly empty), then an optional port. An HTTP/1.1
# request without one, or with two, is 400: a proxy in front may have routed it by another.
_HOST = re.compile(r"(?:\[[0-9A-Za-z:.]+\]|[0-9A-Za-z._~%!$&'()*+,;=-]*)(?::[0-9]*)?")


_STATUS_LINES = {s.value: f"HTTP/1.1 {s.value} {s.phrase}\r\n".encode() for s in HTTPStatus}


def error_body(error: str) -> bytes:
    return b'{"error":"' + error.encode() + b'"}'


# What an answer says of its connection: kept open to HTTP/1.1 by default, to HTTP/1.0 only
# when the answer says so (RFC 9112 9.3), or closed.
KEEP = b""
KEEP_HTTP10 = b"connection: keep-alive\r\n"
CLOSE = b"connection: close\r\n"


def encode(resp: Response, connection: bytes, head: bool = False) -> bytes:
    """The answer's bytes, with ``connection`` (KEEP, KEEP_HTTP10 or CLOSE); to a HEAD
    request, without its body (RFC 9110 9.3.2)."""
    extra = b"".join([name + b": " + value + b"\r\n" for name, value in resp.headers])
    return b"%scontent-type: %s\r\ncontent-length: %d\r\n%s%s\r\n%s" % (
        _STATUS_LINES[resp.status],
        resp.content_type,
        len(resp.body),
        connection,
        extra,
        b"" if head else resp.body,
    )


class Connection(asyncio.Protocol):
    """One client connection: parse, queue, answer in order, enforce the limits."""

    def __init__(self, server: HttpServer, loop: asyncio.AbstractEventLoop) -> None:
        self._server = server
        # Its tasks are created on this loop: asyncio.get_running_loop makes a system
        # call (getpid, to tell a forked child) each time it is asked.
        self._loop = loop
        self._limits = server.limits
        self._parser = httptools.HttpRequestParser(self)
        self._transport: asyncio.Transport | None = None
        self._pipeline: deque[tuple[Request, bytes]] = deque()  # and its KEEP or CLOSE
        self._task: asyncio.Task[None] | None = None
        self._can_write = asyncio.Event()
        self._can_write.set()
        self._reading = True
        self._held = b""  # read, not yet parsed: the pipeline was deep
        self._eof = False  # the client sent all it will send (what is held is still read)
        self._hangup: asyncio.Future[None] | None = None  # made when a handler asks
        self._closing = False  # no more requests are read: answering what is queued
        self._lingering = False
        # an error answer kept until the answers queued before it are written: the answer,
        # and the path and first byte of its request, for the observer
        self._refusal: tuple[Response, bytes, int] | None = None
        self._idle_since = time.monotonic()  # between requests since then (or never sent)
        # the request being parsed
        self._in_request = False
        self._started_ns = 0  # 0 until its first request begins
        self._url = b""
        self._raw_headers: list[tuple[bytes, bytes]] = []  # as parsed, until decoded at once
        self._headers: list[tuple[str, str]] = []
        self._header_bytes = 0
        self._expect_continue = False  # its 100 Continue waits for earlier answers
        self._host = ""  # the last Host value found good: a kept-alive client repeats it
        # One buffer, not a list of the parser's pieces: a chunked body of 2-byte chunks
        # made a 48-byte object for every 2 bytes, 28 times max_body_bytes a connection.
        self._body = bytearray()
        self._deadline = 0.0  # monotonic seconds; 0 when none applies
        self._deadline_error = ""
        self._write_deadline = 0.0  # while answers wait unsent: when the client is dropped

    # -- asyncio.Protocol ---------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = typing.cast(asyncio.Transport, transport)  # uvloop's is not a subclass
        if not self._server.make_room():
            self.shed()
            return
        self._server.connections.add(self)
        self._expect_idle()

    def connection_lost(self, exc: Exception | None) -> None:
        self._server.idle.pop(self, None)
        self._transport = None
        self._can_write.set()
        self._tell_hangup()
        # No answer can reach its client now: the requests not begun are dropped, and the
        # one being handled is finished, its answer unsent. Cancelled, a hook admitted but
        # not yet committed left its claim pending in Redis, and the client's retry was
        # refused 409 until the claim expired; finished, it is stored, and the retry is
        # its duplicate. Until it is, the connection still counts: a graceful stop waits
        # for it, and it holds its place under ``max_connections``.
        self._pipeline.clear()
        self._held = b""
        # Freed now, not when a collection finds this connection (it and its parser refer
        # to each other): a client's abandoned bodies would otherwise pile up.
        self._body = bytearray()
        self._raw_headers = []
        self._headers = []
        if self._task is None:
            self._server.connections.discard(self)

    def data_received(self, data: bytes) -> None:
        self._parse(self._held + data if self._held else data)

    def _parse(self, data: bytes) -> None:
        """Feed ``data`` to the parser a slice at a time, holding what is left once the
        pipeline is deep; once closing (an error, or stopping), the rest is discarded."""
        view = memoryview(data)
        self._held = b""
        while view and not self._closing:
            if len(self._pipeline) >= PIPELINE_DEPTH:
                self._held = bytes(view)
                self._pause_reading()
                return
            rest = self._feed(view[:FEED_BYTES])
            view = memoryview(bytes(rest) + bytes(view[FEED_BYTES:])) if rest else view[FEED_BYTES:]
        if self._eof:  # all it sent is parsed now
            self._closing = True

    def _feed(self, data: bytes | memoryview) -> bytes | memoryview:
        """Parse ``data``; what is left to parse when a request asked to upgrade."""
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserCallbackError as e:
            cause = e.__context__
            if isinstance(cause, _Reject):
                self._reject(cause.status, cause.error)
            else:
                log.error("request parser callback failed: %r", cause)
                self._reject(500, "internal_error")
        except httptools.HttpParserUpgrade as e:
            head = self._without_upgrade()
            if head:
                self._feed(head)
            return memoryview(data)[e.args[0] :]
        except httptools.HttpParserError:
            if not self._closing:  # else bytes after a request that asked to close: ignored
                self._reject(400, "bad_request")  # (RFC 9112 9.6)
        return b""

    def _without_upgrade(self) -> bytes:
        """A request asked to switch protocols: it is answered over HTTP/1.1 as if it had
        not asked (RFC 9110 7.8), a CONNECT refused. httptools completed it without its
        body and stopped after its head: a new parser is to read that head again, without
        the Upgrade field (returned), and then what followed it."""
        req, _ = self._pipeline.pop()
        if req.method == b"CONNECT":
            self._reject(400, "upgrade_not_supported")
            return b""
        self._closing = False  # if it said it was the last: parsed again, it says so again
        version = self._parser.get_http_version().encode()
        head = [b"%s %s HTTP/%s\r\n" % (req.method, self._url, version)]
        head += [n + b": " + v + b"\r\n" for n, v in self._raw_headers if n.lower() != b"upgrade"]
        self._parser = httptools.HttpRequestParser(self)
        return b"".join(head) + b"\r\n"

    def eof_received(self) -> bool | None:
        # A half-closed client may still read our answers to what it sent.
        self._eof = True
        self._tell_hangup()
        if self._held:  # closing once what it sent is parsed
            return True
        self._closing = True
        idle = self._task is None and not self._pipeline
        if (self._lingering or idle) and self._transport is not None:
            self._transport.close()
        return True

    def hung_up(self) -> asyncio.Future[None]:
        """Done once the client has sent all it will (it may still read) or is gone."""
        if self._hangup is None:
            self._hangup = self._loop.create_future()
            if self._eof or self._transport is None:
                self._hangup.set_result(None)
        return self._hangup

    def _tell_hangup(self) -> None:
        if self._hangup is not None and not self._hangup.done():
            self._hangup.set_result(None)

    def pause_writing(self) -> None:
        self._can_write.clear()

    def resume_writing(self) -> None:
        self._can_write.set()

    # -- httptools callbacks ------------------------------------------------------------

    # The callbacks below run for every request, several per header: what they share is
    # inlined rather than called (a method call costs about what the rest of one does).

    def on_message_begin(self) -> None:
        # Not idle from a request's first byte, not from any byte: the CRLFs a client may
        # send between requests would keep it from being closed to make room.
        self._server.idle.pop(self, None)
        self._in_request = True
        self._started_ns = now_ns = time.monotonic_ns()
        self._url = b""
        self._raw_headers = []
        self._header_bytes = 0
        self._expect_continue = False
        self._body = bytearray()
        self._deadline = now_ns / 1e9 + self._limits.header_timeout_s
        self._deadline_error = "header_timeout"

    def on_url(self, url: bytes) -> None:
        self._url += url
        self._header_bytes += len(url)
        if self._header_bytes > self._limits.max_header_bytes:
            raise _Reject(431, "headers_too_large")

    def on_header(self, name: bytes, value: bytes) -> None:
        # Only kept here; decoded all at once when the headers are complete. A chunked
        # body's trailer fields come after that: counted against the limit, never taken
        # for headers.
        self._header_bytes += len(name) + len(value) + 4
        if self._header_bytes > self._limits.max_header_bytes:
            raise _Reject(431, "headers_too_large")
        self._raw_headers.append((name, value))

    def on_headers_complete(self) -> None:
        # Decoded once, here: every later stage reads headers as text. Whitespace around a
        # value is not part of it (RFC 9112 5); the parser drops only what leads.
        self._headers = headers = [
            (name.decode("latin-1").lower(), value.decode("latin-1").strip(" \t"))
            for name, value in self._raw_headers
        ]
        coding, expect, hosts = "", False, 0
        for key, text in headers:
            if key == "content-length":
                # Leading zeros are valid and unbounded: int() of over 4300 digits raises.
                digits = text.lstrip("0")
                if digits.isdigit() and (
                    len(digits) > 18 or int(digits) > self._limits.max_body_bytes
                ):
                    raise _Reject(413, "too_large")
            elif key == "host":
                hosts += 1
                if hosts > 1:
                    raise _Reject(400, "bad_host")
                if text != self._host:
                    if _HOST.fullmatch(text) is None:
                        raise _Reject(400, "bad_host")
                    self._host = text
            elif key == "expect":
                expect = text.lower() == "100-continue"
            elif key == "transfer-encoding":
                coding = f"{coding},{text}" if coding else text
        parser = self._parser
        version = parser.get_http_version()
        if version != "1.1":
            _check_version(version, coding)
        elif not hosts:
            raise _Reject(400, "bad_host")
        if coding and coding.lower() != "chunked":
            _check_coding(coding)
        # curl and others wait for this (a second, with curl) before the body. Not to
        # HTTP/1.0, which cannot know it (RFC 9110 10.1.1); not ahead of the answers owed
        # before it; to a request that asks to upgrade, when it is parsed again without.
        self._deadline_error = "body_timeout"
        asks = expect and version == "1.1" and not parser.should_upgrade()
        if not asks:
            self._deadline = time.monotonic() + self._limits.body_timeout_s
        elif self._task is None:
            self._continue()  # which starts the body's deadline
        else:  # written by _answer once they are, and the body's time starts then
            self._expect_continue = True
            self._deadline = 0.0

    def on_body(self, body: bytes) -> None:
        if len(self._body) + len(body) > self._limits.max_body_bytes:
            raise _Reject(413, "too_large")
        self._body += body

    def on_message_complete(self) -> None:
        path, _, query = self._url.partition(b"?")
        if path[:1] != b"/":
            path = _origin_path(path)
        body = bytes(self._body)
        method, started = self._parser.get_method(), self._started_ns
        req = Request(method, path, self._headers, body, query, started, self.hung_up)
        self._in_request = False
        self._deadline = 0.0
        parser = self._parser
        if not parser.should_keep_alive():
            connection = CLOSE
        else:
            connection = KEEP if parser.get_http_version() == "1.1" else KEEP_HTTP10
        self._pipeline.append((req, connection))
        if connection is CLOSE:
            self._closing = True  # its answer is the last: nothing after it is read
        if len(self._pipeline) >= PIPELINE_DEPTH:
            self._pause_reading()
        if self._task is None:
            self._task = self._loop.create_task(self._answer())

    # -- answering ----------------------------------------------------------------------

    async def _answer(self) -> None:
        """Answer the pipeline in order; one task per connection at a time."""
        handler = self._server.handler
        observe = self._server.observe
        try:
            while self._pipeline and self._transport is not None:
                req, connection = self._pipeline.popleft()
                if len(self._pipeline) < PIPELINE_DEPTH // 2:
                    self._resume_reading()
                try:
                    resp = await handler(req)
                except Exception:  # a bug: answer it, and keep the connection's order
                    log.exception("request handler failed")
                    resp = Response(500, error_body("internal_error"))
                if self._server.stopping and not self._owed():
                    connection = CLOSE  # the last answer this connection owes
                if self._transport is None:
                    return
                if observe is not None:  # first: a client that has its answer was counted
                    observe(req.path, resp.status, req.started_ns)
                self._transport.write(encode(resp, connection, req.method == b"HEAD"))
                if connection is CLOSE:
                    self._closing = True
                    self._pipeline.clear()
                    self._transport.close()
                    return
                if not self._can_write.is_set():
                    await self._can_write.wait()
        finally:
            self._task = None
            if self._transport is None:  # its client is gone: now so is the connection
                self._server.connections.discard(self)
        if self._transport is None:
            return
        if self._refusal is not None:
            self._refuse()
        elif self._closing:
            self._transport.close()
        elif not self._in_request:
            self._expect_idle()
        elif self._expect_continue:
            self._continue()

    def _owed(self) -> bool:
        """Whether requests its client has sent are still to be answered: queued, held
        unparsed, or being read."""
        return bool(self._pipeline or self._held or self._in_request)

    def _continue(self) -> None:
        """Ask for the body; its deadline starts now, as its client may wait for this."""
        self._expect_continue = False
        if self._transport is not None:
            self._transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")
            self._deadline = time.monotonic() + self._limits.body_timeout_s

    def _reject(self, status: int, error: str) -> None:
        """Answer an unreadable request and end the connection: nothing more is read, and
        the answer waits for those of the requests queued before it."""
        self._closing = True
        path = self._url.partition(b"?")[0] if self._in_request else b""
        started_ns = self._started_ns if self._in_request else time.monotonic_ns()
        self._refusal = (Response(status, error_body(error)), path, started_ns)
        if self._task is None:
            self._refuse()

    def _refuse(self) -> None:
        """Write the answer ``_reject`` kept, and close our side."""
        t, refusal = self._transport, self._refusal
        if t is None or refusal is None:
            return
        self._refusal = None
        self._lingering = True
        resp, path, started_ns = refusal
        if self._server.observe is not None:
            self._server.observe(path, resp.status, started_ns)
        t.write(encode(resp, CLOSE))
        # Close our side but keep reading (and discarding) for a moment, so the client
        # reads the answer instead of a reset caused by its unread bytes.
        if t.can_write_eof():
            t.write_eof()
            self._deadline = time.monotonic() + LINGER_S
            self._deadline_error = ""
        else:
            t.close()

    # -- limits -------------------------------------------------------------------------

    def _expect_idle(self) -> None:
        self._idle_since = now = time.monotonic()
        self._deadline = now + self._limits.keepalive_timeout_s
        self._deadline_error = ""
        self._server.idle[self] = None  # the last to become idle, the last to be shed

    def shed(self) -> None:
        """Closed now, without a word: at the cap, the longest-idle one to make room for a
        new one, or a new one with none idle (neither in a request: nothing is lost); at a
        fast stop or a graceful one out of time, every one, and what its client sent and
        was not answered is dropped, for it to send again."""
        if self._transport is not None:
            self._closing = True
            self._pipeline.clear()
            self._held = b""
            self._transport.close()

    def check_deadline(self, now: float) -> None:
        """Called by the server's sweep. An idle connection past its keep-alive is closed
        quietly; a request too slow in coming is answered 408 first. A client that leaves
        our answers unread for ``body_timeout_s`` (as long as it may take to send a body)
        is reset, and the requests it queued that were not begun are dropped: none was
        answered, so its client sends them again. The deadline starts at the first sweep
        that finds answers waiting unsent, not when the transport pauses us: that is only
        past its high-water mark, and answers below it left unread held the connection
        for ever."""
        t = self._transport
        if t is not None:
            if not t.get_write_buffer_size():
                self._write_deadline = 0.0
            elif not self._write_deadline:
                self._write_deadline = now + self._limits.body_timeout_s
        if self._write_deadline and now >= self._write_deadline:
            self._pipeline.clear()
            if self._transport is not None:
                self._transport.abort()
            return
        if not self._deadline or now < self._deadline or self._task is not None:
            return
        if self._deadline_error and not self._lingering:
            self._reject(408, self._deadline_error)
        elif self._transport is not None:
            self._transport.close()

    def stop(self) -> None:
        """The server is stopping: a connection with requests begun or queued closes once
        it has answered every one its client sent, the last answer saying ``connection:
        close`` (pipelined requests after the first were dropped unanswered on every
        reload); one between requests closes once it has been idle ``STOP_GRACE_S`` (a
        client must expect that of a kept-alive one), so that a request its client was
        sending as the stop began is answered, not reset: a pooled client sending every
        few milliseconds was reset on every reload. (A new connection is idle from the
        start.)"""
        if self._transport is None or self._task is not None or self._owed():
            return
        if time.monotonic() - self._idle_since < STOP_GRACE_S:
            return
        self._transport.close()

    def _pause_reading(self) -> None:
        if self._reading and self._transport is not None:
            self._reading = False
            self._transport.pause_reading()

    def _resume_reading(self) -> None:
        if self._held:
            self._parse(self._held)
            if self._held:  # deep again
                return
        if not self._reading and self._transport is not None and not self._eof:
            self._reading = True
            self._transport.resume_reading()


class HttpServer:
    """The connections of one process, across all its listening sockets."""

    def __init__(
        self,
        handler: Handler,
        limits: Limits,
        observe: Observer | None = None,
        counters: CounterRow | None = None,
    ) -> None:
        self.handler = handler
        self.limits = limits
        self.observe = observe
        self.connections: set[Connection] = set()
        # the connections between requests, the longest idle first (insertion order)
        self.idle: dict[Connection, None] = {}
        self.stopping = False
        self._counters = counters
        self._shed_logged = -SHED_LOG_S
        self._servers: list[asyncio.Server] = []
        self._listening: list[socket.socket] = []
        self._sweeper: asyncio.Task[None] | None = None

    async def start(self, sockets: list[socket.socket], backlog: int) -> None:
        """Serve on ``sockets``. The loop listens on each again, with ``backlog`` (its own
        default of 100 would otherwise replace what they were bound with)."""
        loop = asyncio.get_running_loop()
        for sock in sockets:
            srv = await loop.create_server(
                lambda: Connection(self, loop), sock=sock, backlog=backlog
            )
            self._servers.append(srv)
        self._listening = list(sockets)
        self._sweeper = loop.create_task(self._sweep())

    def make_room(self) -> bool:
        """Whether a new connection may be held: under the cap, or once the longest-idle
        connection is closed for it."""
        if len(self.connections) < self.limits.max_connections:
            return True
        if self.idle:
            self._count_shed(Counter.SHED_IDLE)  # first: it says how many are open
            oldest = next(iter(self.idle))
            del self.idle[oldest]
            self.connections.discard(oldest)  # gone now, not when the loop reports it
            oldest.shed()
            return True
        self._count_shed(Counter.SHED_NEW)
        return False

    def _count_shed(self, counter: Counter) -> None:
        if self._counters is not None:
            self._counters.add(counter)
        now = time.monotonic()
        if now - self._shed_logged >= SHED_LOG_S:
            self._shed_logged = now
            log.warning(
                "%d client connections open, the most this process holds "
                "(server.max_connections, or the open-file limit): %s",
                len(self.connections),
                "closing idle ones for new ones"
                if counter is Counter.SHED_IDLE
                else "none idle, closing new ones",
            )

    async def _sweep(self) -> None:
        """Check every connection's deadlines each ``SWEEP_S``. A sweep that comes a
        second or more late is skipped: the process did not run meanwhile (stopped, the
        host paused), and after a pause the loop runs its overdue timers before it reads
        (libuv), so a keep-alive ended then was reset with the request its client sent
        meanwhile unread."""
        swept = time.monotonic()
        while True:
            await asyncio.sleep(SWEEP_S)
            now = time.monotonic()
            late, swept = now - swept > SWEEP_S + LATE_S, now
            if late:
                continue
            for conn in list(self.connections):
                conn.check_deadline(now)

    def stop_accepting(self) -> None:
        self._listening = []
        for srv in self._servers:
            srv.close()

    def _take_queued(self) -> list[socket.socket]:
        """The connections the kernel has queued on the listening sockets, taken before
        they are closed: the last close of a listening socket resets every one still in
        its queue (0 to 11 of 64 clients' on each TERM), whose clients were told it was
        open. No await between this and ``stop_accepting``."""
        queued = []
        for sock in self._listening:
            with contextlib.suppress(OSError):  # BlockingIOError: none left
                while True:
                    queued.append(sock.accept()[0])
        return queued

    async def stop(
        self, graceful: bool, timeout_s: float, hurry: asyncio.Event | None = None
    ) -> None:
        """Graceful: ``drain``, logging what did not finish; else stop accepting now.
        ``hurry`` set cuts a graceful stop short (SIGINT after SIGTERM)."""
        if not graceful:
            self.stopping = True
            self.stop_accepting()
        elif not await self.drain(timeout_s, hurry):
            busy = len(self.connections)
            if hurry is not None and hurry.is_set():
                log.warning("told to stop now: %d connections cut short", busy)
            else:
                log.warning("graceful timeout: %d connections still busy", busy)
        # Nothing more is read: the store and Redis are closed next, under any request
        # that would still begin (a fast stop answered them 500 from a closed fleet).
        for conn in list(self.connections):
            conn.shed()

    async def drain(self, timeout_s: float, hurry: asyncio.Event | None = None) -> bool:
        """Stop accepting, let in-flight requests finish; True if all did in time."""
        self.stopping = True
        loop = asyncio.get_running_loop()
        queued = self._take_queued()
        self.stop_accepting()
        for sock in queued:
            sock.setblocking(False)
            await loop.connect_accepted_socket(lambda: Connection(self, loop), sock)
        deadline = time.monotonic() + timeout_s
        while self.connections and time.monotonic() < deadline:
            if hurry is not None and hurry.is_set():
                break
            for conn in list(self.connections):
                conn.stop()
            await asyncio.sleep(0.01)
        if self._sweeper is not None:
            self._sweeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._sweeper
        return not self.connections
