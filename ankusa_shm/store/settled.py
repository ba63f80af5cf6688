"""The last moment this host stopped with every hook in its store settled in Redis.

A graceful stop can leave nothing owed to the fleet: every worker stopped cleanly, every
crash recovery of the run was done whole and none is owed, no dropped promote was left to
make good, and the drainer emptied the settle queue. The supervisor then writes that
moment here (``write``), with the fleet's epoch as the drainer last read it, and the boot
and monotonic clock it was written on. Two readers:

- a supervisor that re-attaches its segment on the same boot, after such a stop and
  after its workers were last heard from: no commit can be unsettled, so no crash
  recovery is owed;
- a drainer on a new segment (a reboot emptied ``/dev/shm``, or an upgrade replaced the
  segment): it promotes again only the hooks stored since then, instead of the whole
  dedupe window, once its epoch check, seeded with the epoch kept here, shows Redis still
  holds what it held then. A Redis emptied while the host was down is seen as such.

Written only when it is true, a mark stays true: a later run that crashes leaves it as it
was, and everything that run stored comes after it.
"""

from __future__ import annotations

import contextlib
import json
import sqlite3
from dataclasses import dataclass
from pathlib import Path

from ankusa_shm.store import schema
from ankusa_shm.store.schema import StoreError

_BOOT_ID = "/proc/sys/kernel/random/boot_id"
_READ = "SELECT value FROM marks WHERE key = 'settled'"
_WRITE = (
    "INSERT INTO marks (key, value) VALUES ('settled', ?)"
    " ON CONFLICT (key) DO UPDATE SET value = excluded.value"
)


@dataclass(frozen=True)
class Settled:
    seq: int  # the last hook committed by then (commit order: no clock to step back)
    at_ms: int  # wall clock, for people
    boot: str  # the kernel's boot id: ``mono_ms`` means nothing on another boot
    mono_ms: int
    epoch: dict[str, object]  # the fleet store as the drainer last read it (``fleet.seen``)


def boot_id() -> str:
    """This boot's id; "" where the kernel does not say, which matches no mark."""
    try:
        return Path(_BOOT_ID).read_text().strip()
    except OSError:
        return ""


def read(path: str | Path) -> Settled | None:
    """The mark; None when there is none, no store, or a store too old to hold one."""
    try:
        with contextlib.closing(schema.connect_ro(path)) as conn:
            row = conn.execute(_READ).fetchone()
    except sqlite3.Error:
        return None
    if row is None:
        return None
    try:
        doc = json.loads(row[0])
        epoch = dict(doc["epoch"])
        return Settled(
            int(doc["seq"]), int(doc["at_ms"]), str(doc["boot"]), int(doc["mono_ms"]), epoch
        )
    except (ValueError, TypeError, KeyError, AttributeError):
        return None


def write(
    path: str | Path, at_ms: int, mono_ms: int, epoch: dict[str, object], timeout_ms: int
) -> None:
    """Keep the mark of a stop at ``at_ms`` (and ``mono_ms``) that leaves every hook
    committed so far settled under ``epoch``, synced before this returns. A store that is
    not there (deleted under the service) is not created for it. A ``StoreError`` names
    the file."""
    if not Path(path).exists():
        raise StoreError(f"{path}: not there: no settled mark kept")
    conn = schema.open_writer(path, "fsync", timeout_ms)
    try:
        conn.execute("BEGIN IMMEDIATE")
        seq = conn.execute(schema.LAST_SEQ).fetchone()[0]
        doc = {"seq": seq, "at_ms": at_ms, "boot": boot_id(), "mono_ms": mono_ms, "epoch": epoch}
        conn.execute(_WRITE, (json.dumps(doc, sort_keys=True),))
        conn.execute("COMMIT")
    except sqlite3.Error as e:
        raise StoreError(f"{path}: cannot keep the settled mark: {e}") from None
    finally:
        conn.close()
