"""Read-only queries over the hook store, for tests, tools and the consumer API to come.

Each call opens a ``mode=ro`` connection, runs one statement (one short read transaction
in WAL mode: it never blocks a writer, and a writer never blocks it) and closes it.
"""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Iterator
from contextlib import closing, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ankusa_shm.hooks import Headers
from ankusa_shm.store import schema
from ankusa_shm.store.schema import StoreError

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


@contextmanager
def _reading(path: str | Path) -> Iterator[sqlite3.Connection]:
    try:
        with closing(schema.connect_ro(path)) as conn:
            yield conn
    except sqlite3.Error as e:
        raise StoreError(f"{path}: cannot read: {e}") from None


def _hook(row: Any) -> StoredHook:
    seq, hook_id, tenant, source, event_key, received_ms, headers, body = row
    pairs = json.loads(headers)
    return StoredHook(
        seq, hook_id, tenant, source, event_key, received_ms, tuple(map(tuple, pairs)), body
    )


def get(path: str | Path, hook_id: str) -> StoredHook | None:
    """The hook stored under ``hook_id``, or None."""
    with _reading(path) as conn:
        row = conn.execute(f"SELECT {_COLUMNS} FROM hooks WHERE id = ?", (hook_id,)).fetchone()
    return None if row is None else _hook(row)


def count(path: str | Path) -> int:
    """How many hooks are stored."""
    with _reading(path) as conn:
        return int(conn.execute("SELECT count(*) FROM hooks").fetchone()[0])


def ids(path: str | Path) -> set[str]:
    """The ids of every stored hook."""
    with _reading(path) as conn:
        return {str(r[0]) for r in conn.execute("SELECT id FROM hooks")}


def page(path: str | Path, after_seq: int, limit: int) -> list[StoredHook]:
    """Up to ``limit`` hooks committed after ``after_seq``, in commit order: a consumer
    resumes from the last ``seq`` it has seen."""
    with _reading(path) as conn:
        rows = conn.execute(
            f"SELECT {_COLUMNS} FROM hooks WHERE seq > ? ORDER BY seq LIMIT ?",
            (after_seq, limit),
        ).fetchall()
    return [_hook(r) for r in rows]
