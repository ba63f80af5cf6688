"""What a crash may have left unsettled in Redis, as the supervisor reckons it.

A worker killed between a commit and its settle leaves its claim pending: another host
would store a retry of the event. So after a worker dies, or a supervisor restarts on the
segment a dead one left, the next worker promotes again what was stored since then
(``start``, ``last_heard_ms``). A graceful stop that leaves nothing owed keeps its moment in
the store (``keep_settled``), and a start after it on this boot owes nothing
(``stopped_settled``).
"""

from __future__ import annotations

import logging
from pathlib import Path

from ankusa_shm.clock import monotonic_ms, wall_ms, wall_of
from ankusa_shm.config import Config
from ankusa_shm.fleet.seen import Seen
from ankusa_shm.shm import procs
from ankusa_shm.shm.counters import Counter, totals
from ankusa_shm.shm.procs import Role
from ankusa_shm.shm.segment import Segment
from ankusa_shm.shm.settle_queue import SettleQueue
from ankusa_shm.store import readers, settled
from ankusa_shm.store.schema import StoreError

log = logging.getLogger("ankusa_shm.supervisor")


def start(cfg: Config, crashed_ms: int | None = None) -> int:
    """Wall ms from which a crashed worker's commits may be unsettled: a hook is
    committed at most ``lock_timeout_ms`` after it was received, and a second more
    covers the transaction itself. ``crashed_ms`` is when the crash was (wall ms), if
    not just now."""
    now_ms = wall_ms()
    return min(now_ms, crashed_ms or now_ms) - cfg.store.lock_timeout_ms - 1_000


def mark_new_segment(cfg: Config, queue: SettleQueue) -> None:
    """A segment this start made: the hooks committed from now on settle through its
    queue, and only those before may have had theirs lost with an earlier segment. Its
    drainer promotes those again (``repromote.Drops``), not what its own workers stored
    before its first look. A store that cannot be read leaves it unknown: the whole
    dedupe window is promoted, as before this was kept."""
    try:
        last = readers.last_seq(cfg.store.path) if Path(cfg.store.path).exists() else 0
    except StoreError as e:
        log.warning("cannot read the store's last hook: %s", e)
        return
    queue.set_first_seq(last + 1)


def stopped_settled(cfg: Config, seg: Segment) -> bool:
    """Whether the last supervisor on this segment stopped with every hook settled, after
    its workers were last heard from: a mark of this boot, later than every heartbeat."""
    mark = settled.read(cfg.store.path)
    if mark is None or not mark.boot or mark.boot != settled.boot_id():
        return False
    return mark.mono_ms >= (_last_beat_ms(seg) or 0)


def last_heard_ms(seg: Segment) -> int | None:
    """When the last supervisor's workers were last heard from, on the wall clock: their
    latest heartbeat (monotonic, so it keeps across processes) moved to it. A restart
    that comes long after a crash must still look back from the crash."""
    return wall_of(_last_beat_ms(seg))


def _last_beat_ms(seg: Segment) -> int | None:
    """The latest heartbeat (monotonic ms) of the workers gone from ``seg``."""
    worker = Role.WORKER.name.lower()
    beats = [
        p.heartbeat_ms
        for p in procs.read(seg.view, seg.layout)
        if p.role == worker and not p.alive and p.heartbeat_ms
    ]
    return max(beats, default=None)


def keep_settled(
    cfg: Config,
    seg: Segment,
    queue: SettleQueue,
    *,
    clean: bool,
    recovery_owed: bool,
    other_drainer: bool,
) -> None:
    """Every child gone after a graceful stop: if nothing is owed to the fleet, keep
    the moment in the store, so that the next start need not promote again what this
    host stored before it (``store.settled``)."""
    if "dedupe" not in cfg.fleet_kinds:
        return
    t = totals(seg.view, seg.layout)
    epoch = Seen.of(seg.blob("epoch").read())
    depth = queue.depth()
    owed = [
        why
        for why, yes in (
            ("a crash recovery not done whole, or a child killed", not clean),
            ("a crash recovery still owed", recovery_owed),
            ("another process drained the queue", other_drainer),
            (f"{depth} settle operations still queued", depth > 0),
            (
                "dropped promotes not yet made good",
                t[Counter.SETTLE_DROPPED] > t[Counter.SETTLE_DROPS_RECOVERED],
            ),
            ("a new segment's promotes not all sent", not queue.mended_ms()),
            ("the fleet's epoch never read", not epoch.values),
            ("a move to another fleet store not yet promoted for", epoch.owed),
        )
        if yes
    ]
    if owed:
        log.info(
            "not every hook is known settled in Redis (%s): a start on a new segment"
            " promotes again what was stored since the last stop that left them all",
            "; ".join(owed),
        )
        return
    try:
        settled.write(
            cfg.store.path, wall_ms(), monotonic_ms(), epoch.doc(), cfg.store.lock_timeout_ms
        )
    except StoreError as e:
        log.warning("%s", e)
        return
    log.info("every hook stored is settled in Redis: kept in the store for the next start")
