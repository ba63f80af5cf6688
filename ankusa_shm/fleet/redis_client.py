"""A small multiplexed Redis client for the two things the fleet needs: one script call per
hook under a hard budget, and one pipelined round trip per settle batch.

Every request on a connection is written in order and its reply is matched in order
(hiredis parses). A caller that gives up -- its budget ran out, it was cancelled -- only
abandons its future: the reply still arrives, is read, and is dropped, so a late reply can
never be taken by the next caller (the failure behind redis-py's CVE-2023-28858/28859 is
a pooled request/response connection reused with a reply still on the wire; here nothing
is ever reused out of order). A connection whose oldest request has waited longer than
``stall_s`` is closed and every waiter failed, so a hung server cannot pile up work.

A caller's budget is a deadline handed down with its request, not an ``asyncio.timeout``
around it: each connection keeps one timer, armed for the earliest deadline among its
waiters, which fails whoever's deadline has passed with ``TimeoutError`` (their replies are
still read, and dropped). Per call, a timeout and its timer handle cost more than the rest
of the client; one timer per connection costs almost nothing.

A caller that gathers its own requests through a turn of the loop (the fleet's admission)
sends them with ``send_now``: on an open connection they are written at once and their
replies handed to a plain function from the read callback, so no task and no further turn
of the loop stand between a reply and the hooks waiting on it. What needs more -- a
connection to open, a script cache to reload, a cluster's routing -- goes the way of
``send``, in a task, and ends in the same function.

Lua scripts a client is given are loaded (``SCRIPT LOAD``) on every connection as part of
its greeting, so callers only ever send ``EVALSHA``. A server that loses its script cache
while connected (``SCRIPT FLUSH``) answers ``NOSCRIPT``: the first such reply on a
connection sends one ``SCRIPT LOAD`` and every caller caught in the same burst waits for
that one load and repeats its ``EVALSHA`` -- never a full-source ``EVAL`` per caller.

``Client`` talks to one server (``redis://``, ``rediss://``, ``unix://``); ``ClusterClient``
routes each command by its key's hash slot across a Redis Cluster, following ``MOVED``
(refresh the slot map) and ``ASK`` (one ``ASKING`` hop). Sockets and loops are created
lazily, inside the process that uses them -- never inherited across fork.
"""

from __future__ import annotations

import asyncio
import collections
import functools
import re
import time
from collections.abc import Callable, Coroutine, Sequence
from typing import Any, cast

import hiredis

from ankusa_shm.fleet.hash_slot import key_slot
from ankusa_shm.redis_url import Endpoint

Arg = bytes | str | int
Reply = Any
_NEVER = float("inf")


class RedisError(Exception):
    """The store could not answer: not connected, connection lost, stalled, protocol."""


class ReplyError(RedisError):
    """The server answered with an error reply (``-ERR ...``, ``-NOSCRIPT ...``)."""


class ConnectionLost(RedisError):
    """The connection closed under requests in flight (reset, or closed by the server or a
    proxy): each may or may not have run, and a new connection may answer at once."""


_REFUSED = re.compile(r"\b(WRONGPASS|NOAUTH|NOPERM)\b")
REFUSED_HINT = (
    "the server refuses this client, which no wait will cure: check fleet.password_env or "
    "fleet.password_file, the URL's user, and that user's ACL"
)


def refused(e: BaseException | None) -> bool:
    """Whether ``e`` is the server refusing this client (a wrong password, a user whose ACL
    lacks a command or key): a configuration to fix, not an outage to wait out."""
    return isinstance(e, RedisError) and _REFUSED.search(str(e)) is not None


class ProtocolError(RedisError):
    pass


def pack(*args: Arg) -> bytes:
    """RESP-encode one command (str as UTF-8, int in decimal), in hiredis's C."""
    packed: bytes = hiredis.pack_command(cast(Any, args))  # its stub allows one argument
    return packed


_REFRESH_INTERVAL_S = 0.5  # a cluster's slot map is read again on failures at most this often
_LATE_S = 0.001  # a deadline timer firing fails every waiter due within this much after it


Then = Callable[[list[Reply] | BaseException], None]
Call = tuple[bytes, Sequence[Arg], float, Then]  # routing key, command, deadline, then


class _Callback:
    """A request's waiter that is a plain function, called from the read callback with
    the replies (or the failure): no task to wake, no turn of the loop in between. It
    answers the few calls ``_Pending`` makes of a future."""

    __slots__ = ("_called", "_then")

    def __init__(self, then: Then) -> None:
        self._then = then
        self._called = False

    def done(self) -> bool:
        return self._called

    def set_result(self, replies: list[Reply]) -> None:
        """A ``then`` that cannot read the replies fails as a call that got none: raised
        into the read callback, it ended the connection of every other call and left its
        own waiters unanswered."""
        self._called = True
        try:
            self._then(replies)
        except Exception as e:
            self._then(RedisError(f"reply not understood: {e!r}"[:200]))

    def set_exception(self, exc: BaseException) -> None:
        self._called = True
        self._then(exc)

    def exception(self) -> None:
        return None


class _Pending:
    __slots__ = ("deadline", "future", "remaining", "replies", "sent_at")

    def __init__(
        self, future: asyncio.Future[Any] | _Callback, n: int, sent_at: float, deadline: float
    ):
        self.future = future
        self.remaining = n
        self.replies: list[Reply] = []
        self.sent_at = sent_at
        self.deadline = deadline


class Connection(asyncio.Protocol):
    """One socket; requests in flight are answered strictly in the order sent."""

    def __init__(self, stall_s: float) -> None:
        self._reader = hiredis.Reader(replyError=ReplyError, protocolError=ProtocolError)
        self._loop = asyncio.get_running_loop()  # made by a protocol factory, on its loop
        self._pending: collections.deque[_Pending] = collections.deque()
        self._transport: asyncio.Transport | None = None
        self._stall_s = stall_s
        self._out: list[bytes] = []
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = _NEVER  # monotonic seconds the timer fires at
        self.closed = False
        self.script_load: asyncio.Future[None] | None = None  # the one reload in flight

    # asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)  # uvloop's are not subclasses

    def data_received(self, data: bytes) -> None:
        self._reader.feed(data)
        try:
            while (reply := self._reader.gets()) is not False:
                self._deliver(reply)
        except ProtocolError as e:
            self.close(RedisError(f"protocol error: {e}"))
        # hiredis on what it cannot hold (``*4294967295``, a map keyed by an array)
        except Exception as e:
            self.close(RedisError(f"unreadable reply: {e!r}"[:200]))

    def connection_lost(self, exc: Exception | None) -> None:
        self.close(ConnectionLost(f"connection lost: {exc}" if exc else "connection closed"))

    def _deliver(self, reply: Reply) -> None:
        if not self._pending:
            self.close(RedisError("reply without a request"))
            return
        p = self._pending[0]
        p.replies.append(reply)
        p.remaining -= 1
        if p.remaining == 0:
            self._pending.popleft()
            if not p.future.done():  # its caller may have given up; the reply is dropped
                p.future.set_result(p.replies)

    def request(
        self, payload: bytes, n: int, deadline: float = _NEVER
    ) -> asyncio.Future[list[Reply]]:
        """Send ``n`` packed commands; the future gets their ``n`` replies in order, or
        ``TimeoutError`` once ``deadline`` (``time.monotonic()`` seconds) has passed. The
        write goes out at the end of this turn of the loop, with the turn's others."""
        fut: asyncio.Future[list[Reply]] = self._loop.create_future()
        self._queue(payload, n, deadline, fut)
        if len(self._out) == 1:
            self._loop.call_soon(self.flush)
        return fut

    def queue(self, payload: bytes, n: int, deadline: float, then: Then) -> None:
        """``request`` without a future or the end of the turn: its replies or failure
        are handed to ``then`` from the read callback, and it is written by the next
        ``flush``, which the caller makes."""
        self._queue(payload, n, deadline, _Callback(then))

    def _queue(
        self, payload: bytes, n: int, deadline: float, waiter: asyncio.Future[Any] | _Callback
    ) -> None:
        if self.closed or self._transport is None:
            raise RedisError("not connected")
        now = time.monotonic()
        if deadline <= now:  # its caller has given up already: Redis need not hear of it
            raise TimeoutError
        if self._pending and now - self._pending[0].sent_at > self._stall_s:
            self.close(RedisError(f"server stalled for more than {self._stall_s:g} s"))
            raise RedisError("server stalled")
        self._pending.append(_Pending(waiter, n, now, deadline))
        if deadline < self._timer_at:
            self._arm(deadline, now)
        self._out.append(payload)

    def _arm(self, at: float, now: float) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer_at = at
        self._timer = self._loop.call_later(max(0.0, at - now), self._expire)

    def _expire(self) -> None:
        """The timer: fail every waiter whose deadline has passed; re-arm for the next."""
        self._timer, self._timer_at = None, _NEVER
        now = time.monotonic()
        due = now + _LATE_S
        following = _NEVER
        for p in self._pending:
            if p.future.done():
                continue
            if p.deadline <= due:
                p.future.set_exception(TimeoutError())
                p.future.exception()  # its waiter has it; nobody else must be warned
            elif p.deadline < following:
                following = p.deadline
        if following < _NEVER and not self.closed:
            self._arm(following, now)

    def flush(self) -> None:
        """One write for every request made in this turn of the loop: one system call
        for many concurrent hooks instead of one each."""
        out, self._out = self._out, []
        if out and self._transport is not None and not self.closed:
            self._transport.write(b"".join(out))

    def close(self, exc: RedisError) -> None:
        if self.closed:
            return
        self.closed = True
        if self._timer is not None:
            self._timer.cancel()
            self._timer, self._timer_at = None, _NEVER
        if self._transport is not None:
            self._transport.abort()
        while self._pending:
            fut = self._pending.popleft().future
            if not fut.done():
                fut.set_exception(exc)
                fut.exception()  # mark retrieved: an abandoned waiter must not warn


class Client:
    """One server, one multiplexed connection, opened on first use and after any loss."""

    def __init__(
        self,
        endpoint: Endpoint,
        *,
        stall_s: float = 2.0,
        retry_connect_s: float = 0.1,
        scripts: Sequence[bytes] = (),
    ) -> None:
        self.endpoint = endpoint
        self._stall_s = stall_s
        self._retry_connect_s = retry_connect_s
        self._scripts = tuple(scripts)
        self._conn: Connection | None = None
        self._connecting: asyncio.Future[Connection] | None = None
        self._failed_at = 0.0
        self._closed = False
        self._ssl = endpoint.ssl_context()
        self._tasks: set[asyncio.Future[list[Reply]]] = set()  # send_now's, kept alive

    async def call(self, *args: Arg) -> Reply:
        """One command; an error reply raises ``ReplyError``."""
        (reply,) = await self.pipeline([args])
        if isinstance(reply, ReplyError):
            raise reply
        return reply

    def send(
        self, commands: Sequence[tuple[bytes, Sequence[Arg]]], deadline: float = _NEVER
    ) -> Coroutine[Any, Any, list[Reply]]:
        """(routing key, command) pairs, as ``ClusterClient.send``; one server needs no
        routing. ``pipeline``'s own coroutine, not one awaiting it: a frame less per hook."""
        return self.pipeline([c for _, c in commands], deadline)

    def send_now(self, calls: Sequence[Call]) -> None:
        """Each call's replies, or its failure, handed to its ``then``. On an open
        connection the calls are written at once, in one write, and answered from the
        read callback; with none open yet, or after a ``NOSCRIPT`` reply, a call goes
        through ``pipeline`` (which connects), its scripts reloaded first."""
        conn = self._conn
        if conn is None or conn.closed:
            for _, command, deadline, then in calls:
                _later(self.pipeline([command], deadline), then, self._tasks)
            return
        for _, command, deadline, then in calls:
            replied = functools.partial(self._replied, command, deadline, then)
            try:
                conn.queue(pack(*command), 1, deadline, replied)
            except (TimeoutError, RedisError) as e:  # its deadline passed; a stalled server
                then(e)
        conn.flush()

    def _replied(
        self,
        command: Sequence[Arg],
        deadline: float,
        then: Then,
        replies: list[Reply] | BaseException,
    ) -> None:
        if self._scripts and not isinstance(replies, BaseException) and noscript(replies[0]):
            _later(self._reload_and_resend(command, deadline), then, self._tasks)
        else:
            then(replies)

    async def _reload_and_resend(self, command: Sequence[Arg], deadline: float) -> list[Reply]:
        """After a ``NOSCRIPT``: the scripts first (callers in a burst share one reload),
        so the call is not sent once more only to be refused again."""
        conn = self._conn
        if conn is not None and not conn.closed:
            async with _within(deadline):
                await self._reload_scripts(conn)
        return await self.pipeline([command], deadline)

    async def pipeline(
        self, commands: Sequence[Sequence[Arg]], deadline: float = _NEVER
    ) -> list[Reply]:
        """Many commands in one write and one round trip; error replies are returned in
        place, not raised. Past ``deadline`` (``time.monotonic()`` seconds): TimeoutError."""
        if not commands:  # no reply would ever come: the entry would swallow the next ones
            return []
        conn = self._conn
        if conn is None or conn.closed:
            async with _within(deadline):
                conn = await self._connection()
        payload = b"".join([pack(*c) for c in commands])
        replies = await conn.request(payload, len(commands), deadline)
        again = [i for i, r in enumerate(replies) if noscript(r)] if self._scripts else []
        if again:
            async with _within(deadline):
                await self._reload_scripts(conn)
            redo = b"".join(pack(*commands[i]) for i in again)
            for i, r in zip(again, await conn.request(redo, len(again), deadline), strict=True):
                replies[i] = r
        return replies

    async def _reload_scripts(self, conn: Connection) -> None:
        """Load the scripts again on ``conn``; callers in one NOSCRIPT burst share one load
        (its replies come in order, so every EVALSHA sent before the load was sent finds it
        still in flight)."""
        if conn.script_load is None:
            conn.script_load = asyncio.ensure_future(self._load_scripts(conn))
            conn.script_load.add_done_callback(_retrieve)
        load = conn.script_load
        try:
            await asyncio.shield(load)
        finally:
            if load.done() and conn.script_load is load:
                conn.script_load = None

    async def _load_scripts(self, conn: Connection) -> None:
        loads = [("SCRIPT", "LOAD", src) for src in self._scripts]
        replies = await conn.request(b"".join(pack(*c) for c in loads), len(loads))
        bad = next((r for r in replies if isinstance(r, ReplyError)), None)
        if bad is not None:
            raise bad

    async def _connection(self) -> Connection:
        if self._conn is not None and not self._conn.closed:
            return self._conn
        if self._closed:
            raise RedisError(f"{self.endpoint.name}: client closed")
        if self._connecting is None:
            if time.monotonic() - self._failed_at < self._retry_connect_s:
                raise RedisError(f"{self.endpoint.name}: not connected (recent connect failed)")
            self._connecting = asyncio.ensure_future(self._open())
            self._connecting.add_done_callback(_retrieve)
        # shield: one caller's budget running out must not cancel everyone's connect
        return await asyncio.shield(self._connecting)

    async def _open(self) -> Connection:
        ep = self.endpoint
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self._stall_s):
                return await self._connect_and_greet(ep, loop)
        except OSError as e:  # TimeoutError included: a server that accepts but never answers
            self._failed_at = time.monotonic()
            raise RedisError(
                f"{ep.name}: cannot connect: {e.strerror or type(e).__name__}"
            ) from None
        except BaseException:
            self._failed_at = time.monotonic()
            raise
        finally:
            self._connecting = None

    async def _connect_and_greet(self, ep: Endpoint, loop: asyncio.AbstractEventLoop) -> Connection:
        if ep.path:
            _, conn = await loop.create_unix_connection(lambda: Connection(self._stall_s), ep.path)
        else:
            _, conn = await loop.create_connection(
                lambda: Connection(self._stall_s),
                ep.host,
                ep.port,
                ssl=self._ssl,
                server_hostname=ep.host if ep.tls else None,
            )
        hello: list[tuple[Arg, ...]] = []
        if ep.password:
            auth: tuple[Arg, ...] = ("AUTH", ep.password)
            hello.append(("AUTH", ep.username, ep.password) if ep.username else auth)
        if ep.db:
            hello.append(("SELECT", ep.db))
        hello += [("SCRIPT", "LOAD", src) for src in self._scripts]
        if hello:
            try:
                replies = await conn.request(b"".join(pack(*c) for c in hello), len(hello))
            except BaseException:
                conn.close(RedisError("handshake abandoned"))
                raise
            bad = next((r for r in replies if isinstance(r, ReplyError)), None)
            if bad is not None:
                conn.close(RedisError("handshake failed"))
                raise RedisError(f"{ep.name}: {bad}")
        if self._closed:  # closed while we were connecting: do not leave this one open
            conn.close(RedisError("client closed"))
            raise RedisError(f"{ep.name}: client closed")
        self._conn = conn
        return conn

    async def close(self) -> None:
        self._closed = True
        if self._conn is not None:
            self._conn.close(RedisError("client closed"))
            self._conn = None


class ClusterClient:
    """A Redis Cluster: commands are routed by the slot of their first key.

    The slot map comes from ``CLUSTER SLOTS`` and is reloaded after a ``MOVED`` reply and
    after any node could not be reached: a primary that died is replaced by its replica,
    and only a fresh map says which. A reload after a failed node runs in the background
    and at most once per ``_REFRESH_INTERVAL_S`` (a dead node fails every call sent to it;
    under load that must not become a reload per call), so the failed call returns at once
    and its caller answers node-local. Such a call is not repeated elsewhere: the node may
    have run it before the connection went. A redirected command is retried once. The
    caller's budget bounds everything; reloads are shared, so giving up cancels none.
    """

    def __init__(
        self,
        seed: Endpoint,
        *,
        stall_s: float = 2.0,
        scripts: Sequence[bytes] = (),
    ) -> None:
        self._seed = seed
        self._stall_s = stall_s
        self._scripts = tuple(scripts)
        self._nodes: dict[tuple[str, int], Client] = {}
        # every node the last map named, replicas too: any of them can answer a reload
        self._peers: list[tuple[str, int]] = [(seed.host, seed.port)]
        self._slots: list[tuple[str, int] | None] = [None] * 16384
        self._loaded = False
        self._refreshing: asyncio.Future[None] | None = None
        self._tasks: set[asyncio.Future[list[Reply]]] = set()  # send_now's, kept alive
        self._failure_refresh_at = float("-inf")

    def _node(self, addr: tuple[str, int]) -> Client:
        client = self._nodes.get(addr)
        if client is None:
            s = self._seed
            ep = Endpoint(addr[0], addr[1], "", 0, s.username, s.password, s.tls, s.ca_file)
            client = Client(ep, stall_s=self._stall_s, scripts=self._scripts)
            self._nodes[addr] = client
        return client

    async def call(self, key: bytes, *args: Arg) -> Reply:
        (reply,) = await self.send([(key, args)])
        if isinstance(reply, ReplyError):
            raise reply
        return reply

    def send_now(self, calls: Sequence[Call]) -> None:
        """``Client.send_now``'s contract, always by way of ``send``: routing, redirects
        and slot map reloads need a task."""
        for key, command, deadline, then in calls:
            _later(self.send([(key, command)], deadline), then, self._tasks)

    async def send(
        self, commands: Sequence[tuple[bytes, Sequence[Arg]]], deadline: float = _NEVER
    ) -> list[Reply]:
        """(routing key, command) pairs; one concurrent round trip per node involved. A
        node that cannot be reached raises ``RedisError`` for the whole call; past
        ``deadline``, TimeoutError."""
        if not self._loaded:
            async with _within(deadline):
                await self.refresh()
        replies: list[Reply] = [None] * len(commands)
        todo = list(range(len(commands)))
        for attempt in range(2):
            by_node: dict[tuple[str, int], list[int]] = collections.defaultdict(list)
            for i in todo:
                addr = self._slots[key_slot(commands[i][0])]
                if addr is None:
                    raise RedisError("cluster slot map has no owner for a key")
                by_node[addr].append(i)
            results = await asyncio.gather(
                *(
                    self._pipeline(a, [commands[i][1] for i in ix], deadline)
                    for a, ix in by_node.items()
                )
            )
            redirected = []
            for ix, rs in zip(by_node.values(), results, strict=True):
                for i, r in zip(ix, rs, strict=True):
                    replies[i] = r
                    if isinstance(r, ReplyError) and str(r).startswith(("MOVED ", "ASK ")):
                        redirected.append(i)
            if not redirected or attempt == 1:
                break
            if any(str(replies[i]).startswith("MOVED ") for i in redirected):
                async with _within(deadline):
                    await self.refresh()
            asks = [i for i in redirected if str(replies[i]).startswith("ASK ")]
            for i in asks:
                rs = await self._pipeline(
                    _asked(replies[i]), [("ASKING",), commands[i][1]], deadline
                )
                replies[i] = rs[1]
            todo = [i for i in redirected if i not in asks]
        return replies

    async def _pipeline(
        self, addr: tuple[str, int], commands: Sequence[Sequence[Arg]], deadline: float
    ) -> list[Reply]:
        """One node's share of a call; a node that fails may have failed over."""
        try:
            return await self._node(addr).pipeline(commands, deadline)
        except RedisError:
            self._refresh_soon()
            raise

    def _refresh_soon(self) -> None:
        """Start a background reload unless one started within the last interval."""
        now = time.monotonic()
        if now - self._failure_refresh_at < _REFRESH_INTERVAL_S:
            return
        self._failure_refresh_at = now
        self._start_refresh()

    async def refresh(self) -> None:
        """Reload the slot map; concurrent callers share one reload."""
        await asyncio.shield(self._start_refresh())

    def _start_refresh(self) -> asyncio.Future[None]:
        if self._refreshing is None:
            self._refreshing = asyncio.ensure_future(self._load_slots())
            self._refreshing.add_done_callback(self._refreshed)
        return self._refreshing

    def _refreshed(self, fut: asyncio.Future[None]) -> None:
        if self._refreshing is fut:
            self._refreshing = None
        _retrieve(fut)

    async def _load_slots(self) -> None:
        """Ask every known node at once and take the first map that comes back: a dead or
        hung node, the seed included, must not hold up the reload. At most ``stall_s``."""
        asks = {
            asyncio.ensure_future(self._node(a).call("CLUSTER", "SLOTS")): a
            for a in dict.fromkeys(self._peers)
        }
        last: BaseException = TimeoutError(f"no answer in {self._stall_s:g} s")
        try:
            async with asyncio.timeout(self._stall_s):
                waiting = set(asks)
                while waiting:
                    done, waiting = await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
                    for ask in done:
                        if (e := ask.exception()) is None:
                            self._use_map(ask.result(), asks[ask][0])
                            return
                        if not isinstance(e, RedisError):
                            raise e
                        last = e
        except TimeoutError:
            pass
        finally:
            for ask in asks:
                ask.cancel()
                ask.add_done_callback(_retrieve)
        raise RedisError(f"no cluster node answered CLUSTER SLOTS: {last}")

    def _use_map(self, ranges: list[Any], asked_host: str) -> None:
        """Install a ``CLUSTER SLOTS`` answer; a node named without a host is on the
        host that answered. One that is not a slot map is a RedisError: a range past the
        16384 slots made a list as long as it said."""
        slots: list[tuple[str, int] | None] = [None] * 16384
        peers = [(self._seed.host, self._seed.port)]
        try:
            for start, end, *nodes in ranges:
                if not 0 <= start <= end < 16384:
                    raise ValueError(f"slots {start}-{end}")
                owners = [(n[0].decode() or asked_host, int(n[1])) for n in nodes]
                if not all(0 < port < 65536 for _, port in owners):
                    raise ValueError("a port out of range")
                slots[start : end + 1] = [owners[0]] * (end + 1 - start)
                peers += owners
        except (ValueError, TypeError, IndexError, AttributeError) as e:
            raise RedisError(f"CLUSTER SLOTS answered no slot map: {e!r}"[:200]) from None
        self._slots = slots
        self._peers = list(dict.fromkeys(peers))
        self._loaded = True

    async def close(self) -> None:
        for c in self._nodes.values():
            await c.close()


def _asked(reply: Reply) -> tuple[str, int]:
    """The node an ``ASK <slot> <host>:<port>`` redirect names, or a RedisError."""
    parts = str(reply).split()
    host, _, port = parts[2].rpartition(":") if len(parts) == 3 else ("", "", "")
    if not (host and port.isdigit() and 0 < int(port) < 65536):
        raise RedisError(f"a redirect that names no node: {str(reply)[:80]!r}")
    return host, int(port)


def _within(deadline: float) -> asyncio.Timeout:
    """A timeout at ``deadline`` for the rare waits that are not one request: a connect,
    a script reload."""
    return asyncio.timeout(None if deadline == _NEVER else max(0.0, deadline - time.monotonic()))


def _later(
    call: Coroutine[Any, Any, list[Reply]], then: Then, tasks: set[asyncio.Future[list[Reply]]]
) -> None:
    """Run ``call`` as a task, and hand its replies or its failure to ``then``."""
    task = asyncio.ensure_future(call)
    tasks.add(task)
    task.add_done_callback(functools.partial(_hand_over, then, tasks))


def _hand_over(
    then: Then, tasks: set[asyncio.Future[list[Reply]]], task: asyncio.Future[list[Reply]]
) -> None:
    tasks.discard(task)
    if task.cancelled():  # with its loop: no answer is coming
        then(RedisError("call abandoned"))
    elif (e := task.exception()) is not None:
        then(e if isinstance(e, TimeoutError | RedisError) else RedisError(f"call failed: {e!r}"))
    else:
        then(task.result())


def noscript(reply: Reply) -> bool:
    """The server has lost the script (``SCRIPT FLUSH``, a restart)."""
    return isinstance(reply, ReplyError) and str(reply).startswith("NOSCRIPT")


def _retrieve(fut: asyncio.Future[Any]) -> None:
    """Mark a shared task's failure as seen: every caller that waited on it has its own
    copy, and one whose budget ran out must not leave a "never retrieved" warning."""
    if not fut.cancelled():
        fut.exception()
