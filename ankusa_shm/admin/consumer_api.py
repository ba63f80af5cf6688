"""The consumer API: hooks in commit order after a cursor, and consumers' acked cursors.

A consumer pages with ``GET /v1/hooks?after=SEQ`` (or ``consumer=NAME``, which starts at
that consumer's acked cursor) and acks what it has handled with ``POST
/v1/consumers/{name}/ack``; retention deletes only what every named consumer acked
(``DELETE /v1/consumers/{name}`` forgets one no longer run). With
``wait`` a caught-up consumer long-polls: it is answered as soon as a worker commits,
learned from the segment's commit word, on which one thread sleeps while anyone waits,
so an idle consumer costs nothing until a commit wakes it. (Loading the word every 5 ms
instead woke the admin process 200 times a second for one waiting consumer: 1 % of a
core on a host with nothing to do.)
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import re
import time
import urllib.parse
from collections.abc import Coroutine
from dataclasses import dataclass
from typing import Any

from ankusa_shm.admin.stores import StoreCalls
from ankusa_shm.config import name_problem
from ankusa_shm.shm.commits import CommitWord
from ankusa_shm.store.readers import Reader

NAP_S = 1.0  # the sleeping thread looks again this often whether someone still waits
DEFAULT_LIMIT = 100
MAX_LIMIT = 1000
MAX_WAIT_S = 60.0
# A long-poll filtered to one source reads again at most this often: woken by every
# commit of any source, one poller on a quiet source took a third of a core.
FILTERED_EVERY_S = 0.1
_WHOLE = re.compile(r"^[0-9]{1,18}\Z")
_WHOLE_MAX = 10**18 - 1
_SECONDS = re.compile(r"^[0-9]{1,2}(\.[0-9]{1,3})?\Z")

Reply = tuple[int, dict[str, Any] | bytes]  # bytes: a JSON document already encoded


class BadQuery(Exception):
    def __init__(self, field: str, detail: str) -> None:
        super().__init__(detail)
        self.field = field
        self.detail = detail


@dataclass(frozen=True)
class PageQuery:
    after: int | None
    limit: int
    source: str | None
    wait_s: float
    consumer: str | None


def parse_query(query: bytes) -> PageQuery:
    """``after``, ``limit``, ``source``, ``wait``, ``consumer``; anything else, a repeated
    key or a value out of range is a ``BadQuery`` naming the field."""
    given: dict[str, str] = {}
    text = query.decode("latin-1")
    for key, value in urllib.parse.parse_qsl(text, keep_blank_values=True):
        if key not in ("after", "limit", "source", "wait", "consumer"):
            raise BadQuery(key, "unknown parameter")
        if key in given:
            raise BadQuery(key, "given more than once")
        given[key] = value
    after = _whole(given, "after", 0, None)
    limit = _whole(given, "limit", 1, MAX_LIMIT)
    wait = given.get("wait")
    if wait is not None and not (_SECONDS.match(wait) and float(wait) <= MAX_WAIT_S):
        raise BadQuery("wait", f"must be seconds from 0 to {MAX_WAIT_S:g}, not {wait!r}")
    source = given.get("source")
    if source is not None and not source:
        raise BadQuery("source", "must not be empty")
    consumer = given.get("consumer")
    problem = None if consumer is None else name_problem(consumer)
    if problem:
        raise BadQuery("consumer", problem)
    if consumer is not None and after is not None:  # which one would it read after?
        raise BadQuery("consumer", "give after or consumer, not both")
    return PageQuery(
        after,
        DEFAULT_LIMIT if limit is None else limit,
        source,
        0.0 if wait is None else float(wait),
        consumer,
    )


def _whole(given: dict[str, str], key: str, lo: int, hi: int | None) -> int | None:
    text = given.get(key)
    if text is None:
        return None
    value = int(text) if _WHOLE.match(text) else -1
    if value < lo or (hi is not None and value > hi):
        top = f" to {_WHOLE_MAX}" if hi is None else f" to {hi}"
        raise BadQuery(key, f"must be a whole number from {lo}{top}, not {text!r}")
    return value


class CommitWatch:
    """Wakes long-polls when the commit word moves: one task for all of them, sleeping on
    the word in a thread only while someone waits."""

    def __init__(self, word: CommitWord) -> None:
        self._word = word
        self._changed = asyncio.Event()
        self._waiters = 0
        self._poller: asyncio.Task[None] | None = None
        self.closed = False

    def load(self) -> int:
        return self._word.load()

    async def wait(self, seen: int, timeout_s: float) -> None:
        """Until the word is no longer ``seen``, ``timeout_s`` has passed or ``close``."""
        self._waiters += 1
        if self._poller is None:
            self._poller = asyncio.get_running_loop().create_task(self._poll())
        try:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(timeout_s):
                    while not self.closed and self._word.load() == seen:
                        await self._changed.wait()
        finally:
            self._waiters -= 1

    def close(self) -> None:
        """Shutting down: every waiter returns now, and none waits again."""
        self.closed = True
        self._changed.set()
        self._word.wake()  # the sleeping thread too, or the loop's shutdown waits for it

    async def _poll(self) -> None:
        try:
            last = self._word.load()
            while self._waiters and not self.closed:
                await asyncio.to_thread(self._word.wait_past, last, NAP_S)
                now = self._word.load()
                if now != last:
                    last = now
                    changed, self._changed = self._changed, asyncio.Event()
                    changed.set()
        finally:
            self._poller = None


class ConsumerApi:
    def __init__(self, store: StoreCalls, watch: CommitWatch) -> None:
        self._store = store
        self._watch = watch

    async def hooks(self, query: bytes, gone: asyncio.Future[None] | None = None) -> Reply:
        """A page of hooks; with ``wait``, once there is one, the wait is over, or ``gone``
        (its client hung up: an abandoned poll held its connection and its socket, and the
        admin's connections ran out, for the rest of its wait)."""
        try:
            q = parse_query(query)
        except BadQuery as e:
            return 400, {"error": "invalid_query", "field": e.field, "detail": e.detail}
        after = q.after
        if after is None:
            name = q.consumer
            acked = None if name is None else await self._store.read(lambda r: r.consumer(name))
            after = acked or 0
        deadline = time.monotonic() + q.wait_s
        cursor = after
        while True:
            seen = self._watch.load()  # before the query: a commit after it wakes us
            page = functools.partial(
                Reader.page_json, after_seq=cursor, limit=q.limit, source=q.source
            )
            docs, last = await self._store.read(page)  # on the reading thread
            left = deadline - time.monotonic()
            hung_up = gone is not None and gone.done()
            if docs or last < cursor or left <= 0 or self._watch.closed or hung_up:
                break  # (another store's cursor is answered at once)
            cursor = last  # past the hooks a filtered read walked
            await _until(self._watch.wait(seen, left), gone)
            if q.source is not None:  # most commits are of other sources: read less often
                left = deadline - time.monotonic()  # not past ``wait`` for it
                await _until(asyncio.sleep(max(0.0, min(FILTERED_EVERY_S, left))), gone)
        return 200, f'{{"hooks":[{",".join(docs)}],"cursor":{last}}}'.encode()

    async def hook(self, hook_id: str) -> Reply:
        found = await self._store.read(lambda r: r.get(hook_id))
        if found is None:
            return 404, {"error": "not_found"}
        return 200, found.doc()

    async def consumer(self, name: str) -> Reply:
        if problem := name_problem(name):
            return 400, _bad_consumer(problem)
        cursor = await self._store.read(lambda r: r.consumer(name))
        if cursor is None:
            return 404, {"error": "unknown_consumer"}
        return 200, {"consumer": name, "cursor": cursor}

    async def forget(self, name: str) -> Reply:
        if problem := name_problem(name):
            return 400, _bad_consumer(problem)
        if not await self._store.write(lambda c: c.forget(name)):
            return 404, {"error": "unknown_consumer"}
        return 200, {"consumer": name, "forgotten": True}

    async def ack(self, name: str, body: bytes) -> Reply:
        if problem := name_problem(name):
            return 400, _bad_consumer(problem)
        try:
            doc = json.loads(body)
        except (ValueError, RecursionError):  # UnicodeDecodeError too; nested too deep
            return 400, {"error": "invalid_json"}
        if not isinstance(doc, dict):
            return 400, {"error": "invalid_json"}
        unknown = next((k for k in doc if k != "cursor"), None)
        if unknown is not None:
            return 400, _bad_ack(unknown, "unknown key")
        cursor = doc.get("cursor")
        if isinstance(cursor, bool) or not isinstance(cursor, int):
            return 400, _bad_ack("cursor", f"must be a whole number, not {cursor!r}")
        try:  # the store refuses a cursor it cannot hold: negative, or past the last seq
            stored = await self._store.write(lambda c: c.ack(name, cursor))
        except ValueError as e:
            return 400, _bad_ack("cursor", str(e))
        return 200, {"consumer": name, "cursor": stored}


async def _until(wait: Coroutine[Any, Any, None], gone: asyncio.Future[None] | None) -> None:
    """``wait``, cut short once ``gone`` is done."""
    if gone is None:
        return await wait
    task = asyncio.ensure_future(wait)
    await asyncio.wait((task, gone), return_when=asyncio.FIRST_COMPLETED)
    if not task.done():
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


def _bad_consumer(problem: str) -> dict[str, Any]:
    return {"error": "invalid_consumer", "detail": f"a consumer name {problem}"}


def _bad_ack(field: str, detail: str) -> dict[str, Any]:
    return {"error": "invalid_ack", "field": field, "detail": detail}
