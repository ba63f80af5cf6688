"""Read-only queries over the hook store: for the consumer API, the crash recovery and
the drainer's promotes again, tools and tests.

Every query is one statement on a ``mode=ro`` connection, read to its end: one short read
transaction in WAL mode, which never blocks a writer and which a writer never blocks. The
module's functions open a connection per call, for tools and tests; a long-lived process
keeps one open in a ``Reader``, which runs the same queries.
"""

from __future__ import annotations

import base64
import contextlib
import json
import sqlite3
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from json.encoder import encode_basestring_ascii as _json_str
from pathlib import Path
from typing import Any, TypeVar

from ankusa_shm.hooks import Claimed, Headers
from ankusa_shm.store import schema
from ankusa_shm.store.schema import StoreError

T = TypeVar("T")
_COLUMNS = "seq, id, tenant, source, event_key, received_ms, headers, body"


@dataclass(frozen=True, slots=True)
class StoredHook:
    """One stored hook, as committed. ``seq`` is its place in commit order."""

    seq: int
    id: str
    tenant: str
    source: str
    event_key: bytes | None
    received_ms: int
    headers: Headers
    body: bytes

    def doc(self) -> dict[str, Any]:
        """As JSON, for the consumer API and ``hooks --json``: the key and the body as text
        when they are UTF-8, else base64 (they are whatever the sender chose)."""
        doc: dict[str, Any] = {"id": self.id, "seq": self.seq}
        doc.update(tenant=self.tenant, source=self.source)
        key = None if self.event_key is None else text(self.event_key)
        doc["event_key"] = key
        if self.event_key is not None and key is None:
            doc["event_key_base64"] = base64.b64encode(self.event_key).decode("ascii")
        doc["received_ms"] = self.received_ms
        doc["headers"] = [[name, value] for name, value in self.headers]
        body = text(self.body)
        if body is None:
            doc["body_base64"] = base64.b64encode(self.body).decode("ascii")
        else:
            doc["body"] = body
        return doc


_RECENT_PAGE = 1_000
# A consumer's page stops once its hooks come to this much (at least one hook): a thousand
# hooks of a MiB each made a 2 GB answer that held the admin process past its heartbeat.
PAGE_BYTES = 8 << 20
NEWEST = 1 << 62  # a seq above every hook's: ``claimed_page`` from the latest
_CLAIMED = (
    "SELECT h.seq, h.received_ms, h.tenant, h.source, h.event_key, h.id, d.expires_ms"
    " FROM hooks AS h JOIN dedupe AS d ON d.source = h.source AND d.event_key = h.event_key"
    " WHERE h.seq < ? AND d.hook_id = h.id ORDER BY h.seq DESC LIMIT ?"
)

# A hook's document without its key and body (the closing brace is replaced by them).
_DOC_HEAD = (
    "seq, json_object('id', id, 'seq', seq, 'tenant', tenant, 'source', source,"
    " 'received_ms', received_ms, 'headers', json(headers)), event_key, body"
)


def _size(row: Any) -> int:
    """What a row's text and blobs hold, in characters and bytes."""
    return sum(len(c) for c in row if isinstance(c, str | bytes))


def _doc_tail(key: bytes | None, body: bytes) -> str:
    """The rest of ``StoredHook.doc()``'s document, from ``,"event_key"`` to ``}``."""
    key_text = None if key is None else text(key)
    parts = [',"event_key":', "null" if key_text is None else _json_str(key_text)]
    if key is not None and key_text is None:
        parts += [',"event_key_base64":"', base64.b64encode(key).decode("ascii"), '"']
    body_text = text(body)
    if body_text is None:
        parts += [',"body_base64":"', base64.b64encode(body).decode("ascii"), '"}']
    else:
        parts += [',"body":', _json_str(body_text), "}"]
    return "".join(parts)


def text(data: bytes) -> str | None:
    """``data`` as UTF-8 text, or None when it is not (then it is shown as base64)."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return None


def _hook(row: Any) -> StoredHook:
    seq, hook_id, tenant, source, event_key, received_ms, headers, body = row
    pairs = json.loads(headers)
    return StoredHook(
        seq, hook_id, tenant, source, event_key, received_ms, tuple(map(tuple, pairs)), body
    )


class Reader:
    """One ``mode=ro`` connection kept open, for a process that reads often.

    Calls may come from any thread, one at a time (a mutex sees to it). A call that fails
    on a connection opened earlier is tried once more on a new one (the error may have been
    passing); any other failure is a ``StoreError``. A file deleted or replaced since the
    connection opened is let go of first: the reads follow the file at the path.
    """

    def __init__(self, path: str | Path) -> None:
        self.path = path
        self._conn: sqlite3.Connection | None = None
        self._ids: schema.FileIds | None = None  # of the file self._conn opened
        self._mutex = threading.Lock()

    def page(self, after_seq: int, limit: int, source: str | None = None) -> list[StoredHook]:
        """Up to ``limit`` hooks committed after ``after_seq`` (of ``source`` only, if given),
        in commit order: a consumer resumes from the last ``seq`` it has seen. A snapshot
        holds a prefix of the commit order, so paging on never skips a hook. The source
        filter walks the hooks after the cursor: it is for tools, not for a hot path."""
        return [_hook(r) for r in self._after(_COLUMNS, after_seq, limit, source)]

    def page_json(
        self, after_seq: int, limit: int, source: str | None = None
    ) -> tuple[list[str], int]:
        """``page`` as the consumer API sends it: each hook's ``doc()`` as JSON text, and
        the cursor to read on from. SQLite writes all of a document but the key and the
        body, which may not be UTF-8: a fifth of the cost of making ``StoredHook`` objects
        and encoding them, which is most of what a consumer costs the host.

        Every hook up to the last seq read first is committed by now: a page that comes
        back short has walked them all, and its cursor is that seq (a filtered read does
        not walk them again). A cursor past it is another store's (this one replaced
        since, or the host's): every hook here is unseen by its reader, who is answered
        from the start, at least once as ever, rather than after hooks it never read.
        A page also ends once its hooks come to ``PAGE_BYTES``, its cursor at its last."""
        upto = self.last_seq()
        if after_seq > upto:
            after_seq = 0
        rows = self._after(_DOC_HEAD, after_seq, limit, source, upto, PAGE_BYTES)
        docs = [head[:-1] + _doc_tail(key, body) for _, head, key, body in rows]
        cut = len(rows) == limit or sum(_size(r) for r in rows) >= PAGE_BYTES
        return docs, rows[-1][0] if cut else upto

    def claimed_since(self, received_ms: int, limit: int = 1 << 62) -> list[Claimed]:
        """(tenant, source, event key, hook id, expires_ms) of every hook received at or
        after ``received_ms`` that holds its key in the dedupe index, the newest ``limit``
        of them: what a crashed worker may have committed without settling. Read from the
        newest back, a page at a time, so it costs what is that recent, not the table."""
        out: list[Claimed] = []
        below: int | None = NEWEST
        while below is not None and len(out) < limit:
            page, below = self.claimed_page(received_ms, below, min(_RECENT_PAGE, limit - len(out)))
            out += page
        return out

    def claimed_page(
        self, received_ms: int, below: int, limit: int, after_seq: int = 0
    ) -> tuple[list[Claimed], int | None]:
        """Up to ``limit`` of ``claimed_since``'s hooks, the newest committed before seq
        ``below`` first; and the ``below`` to read on from, None once there are no more.
        ``NEWEST`` starts from the latest. Only hooks committed after seq ``after_seq``."""
        rows = self._rows(_CLAIMED, [below, limit])
        out: list[Claimed] = []
        for seq, received, tenant, source, key, hook_id, expires in rows:
            if received < received_ms or seq <= after_seq:
                return out, None
            out.append((tenant, source, bytes(key), hook_id, expires))
            below = seq
        return out, (below if rows and len(rows) == limit else None)

    def _after(
        self,
        columns: str,
        after_seq: int,
        limit: int,
        source: str | None,
        upto: int = NEWEST,
        max_bytes: int | None = None,
    ) -> list[Any]:
        params: list[Any]
        if source is None:
            sql, params = "seq > ? AND seq <= ?", [after_seq, upto, limit]
        else:
            sql, params = "seq > ? AND seq <= ? AND source = ?", [after_seq, upto, source, limit]
        query = f"SELECT {columns} FROM hooks WHERE {sql} ORDER BY seq LIMIT ?"
        return self._rows(query, params, max_bytes)

    def latest(self, n: int) -> list[StoredHook]:
        """The last ``n`` hooks committed, in commit order."""
        rows = self._rows(
            f"SELECT * FROM (SELECT {_COLUMNS} FROM hooks ORDER BY seq DESC LIMIT ?) ORDER BY seq",
            [n],
        )
        return [_hook(r) for r in rows]

    def get(self, hook_id: str) -> StoredHook | None:
        """The hook stored under ``hook_id``, or None."""
        rows = self._rows(f"SELECT {_COLUMNS} FROM hooks WHERE id = ?", [hook_id])
        return _hook(rows[0]) if rows else None

    def count(self) -> int:
        """How many hooks are stored."""
        return int(self._rows("SELECT count(*) FROM hooks")[0][0])

    def ids(self) -> set[str]:
        """The ids of every stored hook."""
        return {str(r[0]) for r in self._rows("SELECT id FROM hooks")}

    def last_seq(self) -> int:
        """The seq of the last hook ever committed, 0 if none: it stays when retention has
        deleted that hook, so a cursor acked there stays valid."""
        return int(self._rows(schema.LAST_SEQ)[0][0])

    def consumer(self, name: str) -> int | None:
        """Consumer ``name``'s acked cursor, or None if it never acked."""
        rows = self._rows("SELECT cursor FROM consumers WHERE name = ?", [name])
        return int(rows[0][0]) if rows else None

    def consumers(self) -> dict[str, int]:
        """Every named consumer's acked cursor."""
        return {str(n): int(c) for n, c in self._rows("SELECT name, cursor FROM consumers")}

    def overrides(self) -> dict[str, tuple[float, int]]:
        """The tenants' rate-limit overrides: tenant -> (rate, burst)."""
        rows = self._rows("SELECT tenant, rate, burst FROM rate_overrides")
        return {str(t): (float(r), int(b)) for t, r, b in rows}

    def close(self) -> None:
        with self._mutex:
            self._drop()

    def _rows(
        self, sql: str, params: Sequence[Any] = (), max_bytes: int | None = None
    ) -> list[Any]:
        """The rows of ``sql``; with ``max_bytes``, only until their text and blobs come to
        that many bytes, the row that crosses it included (never none but for no rows):
        read a row at a time, so that no more than that is ever held."""
        with self._mutex:
            if self._conn is not None and not schema.same_files(self.path, self._ids, writer=False):
                self._drop()  # the file was replaced: read the one at the path now
            again = self._conn is not None
            while True:
                try:
                    if self._conn is None:
                        self._conn = self._open()
                    rows = self._conn.execute(sql, params)
                    if max_bytes is None:
                        return rows.fetchall()
                    out, size = [], 0
                    for row in rows:
                        out.append(row)
                        size += _size(row)
                        if size >= max_bytes:
                            break
                    return out
                except (sqlite3.Error, OSError) as e:  # OSError: the path cannot be looked at
                    self._drop()
                    if not again:
                        raise StoreError(f"{self.path}: cannot read: {e}") from None
                    again = False

    def _open(self) -> sqlite3.Connection:
        # mode=ro cannot create the file; saying so beats "unable to open database file".
        path = Path(self.path)
        if not path.exists():
            where = "" if path.is_absolute() else f", and {path} is relative to {Path.cwd()}"
            raise StoreError(
                f"{self.path}: cannot read: no such file (the service creates it when it "
                f"starts{where})"
            )
        conn = schema.connect_ro(self.path, any_thread=True)
        self._ids = schema.file_ids(self.path, writer=False)
        return conn

    def _drop(self) -> None:
        if self._conn is not None:
            conn, self._conn = self._conn, None
            with contextlib.suppress(sqlite3.Error):
                conn.close()


def _once(path: str | Path, call: Callable[[Reader], T]) -> T:
    """``call`` on a Reader of its own, closed at once: the module's functions."""
    with contextlib.closing(Reader(path)) as reader:
        return call(reader)


def page(
    path: str | Path, after_seq: int, limit: int, source: str | None = None
) -> list[StoredHook]:
    """See ``Reader.page``."""
    return _once(path, lambda r: r.page(after_seq, limit, source))


def latest(path: str | Path, n: int) -> list[StoredHook]:
    """See ``Reader.latest``."""
    return _once(path, lambda r: r.latest(n))


def get(path: str | Path, hook_id: str) -> StoredHook | None:
    """See ``Reader.get``."""
    return _once(path, lambda r: r.get(hook_id))


def claimed_since(path: str | Path, received_ms: int, limit: int = 1 << 62) -> list[Claimed]:
    """``Reader.claimed_since`` on a reader of its own."""
    return _once(path, lambda r: r.claimed_since(received_ms, limit))


def claimed_page(
    path: str | Path, received_ms: int, below: int, limit: int, after_seq: int = 0
) -> tuple[list[Claimed], int | None]:
    """``Reader.claimed_page`` on a reader of its own."""
    return _once(path, lambda r: r.claimed_page(received_ms, below, limit, after_seq))


def count(path: str | Path) -> int:
    """See ``Reader.count``."""
    return _once(path, Reader.count)


def ids(path: str | Path) -> set[str]:
    """See ``Reader.ids``."""
    return _once(path, Reader.ids)


def last_seq(path: str | Path) -> int:
    """See ``Reader.last_seq``."""
    return _once(path, Reader.last_seq)


def consumer(path: str | Path, name: str) -> int | None:
    """See ``Reader.consumer``."""
    return _once(path, lambda r: r.consumer(name))


def consumers(path: str | Path) -> dict[str, int]:
    """See ``Reader.consumers``."""
    return _once(path, Reader.consumers)


def overrides(path: str | Path) -> dict[str, tuple[float, int]]:
    """See ``Reader.overrides``."""
    return _once(path, Reader.overrides)
