"""A batch of hooks into the store, inside the writer's transaction: the few statements
it costs, and what became of each hook.

The writer's thread holds the GIL its worker's event loop needs, and every statement lets
go of it and takes it back, so a batch costs a few statements, not a few per hook: one
lookup of all its keys, then its hooks and its index rows as multi-row INSERTs, decided in
between in Python exactly as one hook at a time would be (a key's first hook in the batch
is stored, the later ones are AlreadyStored of it). Three statements per keyed hook remain
for a batch of one, for SQLite older than 3.8.3 and to redo a batch in which some hook's
id is taken.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Sequence
from json.encoder import encode_basestring_ascii as _json_str
from typing import Any

from ankusa_shm.hooks import AlreadyStored, CommitResult, Committed, Headers, NewHook, NotStored

DUPLICATE_ID = NotStored("duplicate_id")

# Batched statements: one lookup of every key of the batch, then all its hook rows and all
# its index rows, as multi-row statements of 1, 2, 4 ... _CHUNK rows (at most _CHUNK * 7
# parameters, under SQLite's oldest limit of 999), so a batch costs a handful of statements
# whatever its size. CROSS JOIN keeps the VALUES list the outer loop: the planner would
# otherwise scan the index for ``(source, event_key) IN (VALUES ...)``. Needs 3.8.3 (VALUES
# as a subquery); older SQLite takes the per-hook path, which is always correct.
_BATCHED = sqlite3.sqlite_version_info >= (3, 8, 3)
_CHUNK = 128
_SIZES = tuple(1 << i for i in range(_CHUNK.bit_length()))
_LOOKUP = {
    n: "SELECT d.source, d.event_key, d.hook_id, d.expires_ms FROM (VALUES "
    + ", ".join(["(?, ?)"] * n)
    + ") AS k CROSS JOIN dedupe AS d ON d.source = k.column1 AND d.event_key = k.column2"
    for n in _SIZES
}
_INSERT_HOOKS = {
    n: "INSERT INTO hooks (id, tenant, source, event_key, received_ms, headers, body) VALUES "
    + ", ".join(["(?, ?, ?, ?, ?, ?, ?)"] * n)
    for n in _SIZES
}
_PUT_KEYS = {
    n: "INSERT OR REPLACE INTO dedupe (source, event_key, hook_id, expires_ms) VALUES "
    + ", ".join(["(?, ?, ?, ?)"] * n)
    for n in _SIZES
}
# The per-hook statements: a batch of one, SQLite older than 3.8.3, and the redo of a
# batch in which a hook's id was taken.
_SELECT_KEY = "SELECT hook_id, expires_ms FROM dedupe WHERE source = ? AND event_key = ?"
_INSERT_HOOK = (
    "INSERT INTO hooks (id, tenant, source, event_key, received_ms, headers, body)"
    " VALUES (?, ?, ?, ?, ?, ?, ?)"
)
_PUT_KEY = (
    "INSERT OR REPLACE INTO dedupe (source, event_key, hook_id, expires_ms) VALUES (?, ?, ?, ?)"
)

Key = tuple[str, bytes]
"""A hook's place in the dedupe index: its source and its event key."""

Inserted = tuple[list[CommitResult], int, int, int]
"""An insert's answers, how many were Committed and AlreadyStored, and the bytes stored."""


def insert(conn: sqlite3.Connection, hooks: Sequence[NewHook], now: int) -> Inserted:
    """The hooks and their index rows, in order, so a key's first hook in the batch is
    the one stored. The window starts when the hook is stored, as Redis's does.

    A batch in which some hook's id is taken (a caller's bug) is rolled back -- it is
    all the transaction holds -- and redone one hook at a time in a new one, which
    tells that hook apart and leaves its key unclaimed. (Not a savepoint: every
    statement under the lock is one more wait for the GIL, and this is never the
    common case.) A lone hook takes the per-hook statements, which are fewer for it."""
    if _BATCHED and len(hooks) > 1:
        try:
            return _insert_batched(conn, hooks, now)
        except sqlite3.IntegrityError:
            conn.execute("ROLLBACK")
            conn.execute("BEGIN IMMEDIATE")
    return _insert_each(conn, hooks, now)


def stored(conn: sqlite3.Connection, keys: Sequence[tuple[str, bytes]], now: int) -> dict[Key, str]:
    """Of ``keys`` (source, event key), those the index holds within their window, with
    their hooks' ids: a read, in whatever transaction ``conn`` is in (none: its own)."""
    if _BATCHED:
        rows = _index(conn, [part for key in keys for part in key])
    else:
        rows = {k: row for k in keys if (row := conn.execute(_SELECT_KEY, k).fetchone())}
    return {k: hook_id for k, (hook_id, expires) in rows.items() if expires > now}


def encode_headers(headers: Headers) -> str:
    """The headers as stored: ``json.dumps(headers, separators=(",", ":"))``, the same text
    (``ensure_ascii``) in under half the time, since ``dumps`` with any argument builds a new
    encoder per call. A value that is not a ``str`` raises ``TypeError``."""
    return "[" + ",".join([f"[{_json_str(n)},{_json_str(v)}]" for n, v in headers]) + "]"


def _run_chunks(
    conn: sqlite3.Connection, statements: dict[int, str], params: list[Any], width: int
) -> None:
    """Run ``params`` (``width`` per row) as multi-row statements, largest first."""
    rows = len(params) // width
    if rows in statements:  # most batches: one statement
        conn.execute(statements[rows], params)
        return
    start, size = 0, _CHUNK
    while rows:
        while size > rows:
            size >>= 1
        end = start + size * width
        conn.execute(statements[size], params[start:end])
        start, rows = end, rows - size


def _insert_batched(conn: sqlite3.Connection, hooks: Sequence[NewHook], now: int) -> Inserted:
    """A few statements for the whole batch. The index as it stands is read once; the
    batch's own claims are added to that copy as they are made, so every hook is decided
    exactly as the per-hook path would decide it. Raises IntegrityError if an id is taken."""
    keys: list[Any] = []
    for h in hooks:
        if h.event_key is not None:
            keys += (h.source, h.event_key)
    index = _index(conn, keys)
    results: list[CommitResult] = []
    rows: list[Any] = []
    claims: list[Any] = []
    size = 0
    for h in hooks:
        key = h.event_key
        if key is not None:
            seen = index.get((h.source, key))
            if seen is not None and seen[1] > now:
                results.append(AlreadyStored(seen[0]))
                continue
            expires = now + h.dedupe_ttl_s * 1000
            index[h.source, key] = (h.id, expires)
            claims += (h.source, key, h.id, expires)
        body = h.body
        rows += (h.id, h.tenant, h.source, key, h.received_ms, encode_headers(h.headers), body)
        size += len(body)
        results.append(Committed(h.id))
    if rows:
        _run_chunks(conn, _INSERT_HOOKS, rows, 7)
    if claims:
        _run_chunks(conn, _PUT_KEYS, claims, 4)
    committed = len(rows) // 7
    return results, committed, len(hooks) - committed, size


def _index(conn: sqlite3.Connection, keys: list[Any]) -> dict[Key, tuple[str, int]]:
    """The index rows of ``keys`` (source, event key, source, event key, ...): one
    statement per ``_CHUNK`` keys. A row past its window is still a row here."""
    index: dict[Key, tuple[str, int]] = {}
    for start in range(0, len(keys), 2 * _CHUNK):
        part = keys[start : start + 2 * _CHUNK]
        n = len(part) // 2
        padded = 1 << (n - 1).bit_length()
        part += part[-2:] * (padded - n)  # pad to a prepared size with the last key again
        for source, key, hook_id, expires in conn.execute(_LOOKUP[padded], part):
            index[source, key] = (hook_id, expires)
    return index


def _insert_each(conn: sqlite3.Connection, hooks: Sequence[NewHook], now: int) -> Inserted:
    """Three statements per keyed hook: look the key up, insert the hook, claim the key."""
    results: list[CommitResult] = []
    committed = already = size = 0
    for h in hooks:
        if h.event_key is not None:
            row = conn.execute(_SELECT_KEY, (h.source, h.event_key)).fetchone()
            if row is not None and row[1] > now:
                results.append(AlreadyStored(row[0]))
                already += 1
                continue
        headers = encode_headers(h.headers)
        try:
            conn.execute(
                _INSERT_HOOK,
                (h.id, h.tenant, h.source, h.event_key, h.received_ms, headers, h.body),
            )
        except sqlite3.IntegrityError:  # the id is taken: a caller's bug, not the store's
            results.append(DUPLICATE_ID)
            continue
        if h.event_key is not None:
            expires = now + h.dedupe_ttl_s * 1000
            conn.execute(_PUT_KEY, (h.source, h.event_key, h.id, expires))
        results.append(Committed(h.id))
        committed += 1
        size += len(h.body)
    return results, committed, already, size
