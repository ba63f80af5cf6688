"""Process slots: who is attached, since when, and whether its event loop still turns.

A process claims a slot by compare-and-swap on the slot's header word (free, or held by a
process that is gone), records the slot's request count as its baseline, writes its
start time and heartbeat, and only then publishes itself as running. The header word
names the holder by pid *and* start ticks, so a holder whose pid was reused by another
process is seen to be gone (``pids``). The counter row stays with the slot and keeps
counting; what this holder served is the row less its baseline. The heartbeat is written
from inside the process's own loop, so a fresh heartbeat means the loop makes progress,
not merely that the process exists. A slot is given back by its holder (``release``) or,
for a child of the supervisor, which may be killed at any instruction, by the supervisor
once it has reaped it (``release_dead``).
"""

from __future__ import annotations

import enum
import os
import time
from collections.abc import Callable
from dataclasses import dataclass

from ankusa_shm._atomics import AtomicView
from ankusa_shm.clock import monotonic_ms
from ankusa_shm.shm import counters
from ankusa_shm.shm import layout as L
from ankusa_shm.shm.pids import my_start, pid_alive


class Role(enum.IntEnum):
    SUPERVISOR = 1
    WORKER = 2
    DRAINER = 3
    TOOL = 4
    ADMIN = 5


class SlotState(enum.IntEnum):
    FREE = 0
    CLAIMING = 1
    RUNNING = 2
    STOPPING = 3


def _pack(pid: int, state: SlotState, role: int, start: int) -> int:
    return (
        (start & L.START_MASK) << L.PS_START_SHIFT
        | (role & 0xF) << L.PS_ROLE_SHIFT
        | int(state) << L.PS_STATE_SHIFT
        | pid
    )


def _unpack(w: int) -> tuple[int, SlotState, int, int]:
    """(pid, state, role, start ticks) of any word at all: every field is masked."""
    return (
        w & L.PID_MASK,
        SlotState((w >> L.PS_STATE_SHIFT) & 3),
        (w >> L.PS_ROLE_SHIFT) & 0xF,
        (w >> L.PS_START_SHIFT) & L.START_MASK,
    )


class NoFreeSlot(Exception):
    pass


@dataclass(frozen=True)
class ProcessInfo:
    slot: int
    pid: int
    role: str
    state: str
    started_ns: int
    start_ticks: int  # /proc/<pid>/stat start time, mod 2**START_BITS: who the pid was
    heartbeat_ms: int
    claims: int
    requests: int  # hooks this process has handled (its row's REQUESTS less its baseline)
    alive: bool


class ProcessSlot:
    """The slot this process holds, with its counter row."""

    def __init__(self, view: AtomicView, lay: L.Layout, index: int, role: Role) -> None:
        self.index = index
        self.role = role
        self.counters = counters.CounterRow(view, lay, index)
        self._view = view
        self._base = lay.offset("processes") + index * L.PROCESS_SLOT_BYTES
        self._pid = os.getpid()
        self._start = my_start()

    def requests(self) -> int:
        """Hooks handled by this process (not by the slot's earlier holders)."""
        base = self._view.load(self._base + L.PS_REQUESTS_BASE)
        return self.counters.get(counters.Counter.REQUESTS) - base

    def heartbeat(self, now_ms: int) -> None:
        self._view.store(self._base + L.PS_HEARTBEAT_MS, now_ms)

    def set_state(self, state: SlotState) -> None:
        self._view.store(self._base + L.PS_HEADER, _pack(self._pid, state, self.role, self._start))

    def release(self) -> None:
        """Give the slot back; the counters stay in the row until the next claim folds them."""
        self._view.cas(
            self._base + L.PS_HEADER,
            self._view.load(self._base + L.PS_HEADER),
            _pack(0, SlotState.FREE, 0, 0),
        )


def claim(
    view: AtomicView,
    lay: L.Layout,
    role: Role,
    *,
    index: int | None = None,
    force: bool = False,
    now_ms: int | None = None,
) -> ProcessSlot:
    """Claim slot ``index`` (or the first free one). ``force`` takes the slot even if its
    recorded process is alive: only a supervisor that has reaped it may say so. Never
    waits on another process: a slot is free, or ours, or passed over."""
    me, mine = os.getpid(), my_start() & L.START_MASK
    candidates = range(lay.params.process_slots) if index is None else (index,)
    base = lay.offset("processes")
    for i in candidates:
        slot_base = base + i * L.PROCESS_SLOT_BYTES
        hdr = slot_base + L.PS_HEADER
        w = view.load(hdr)
        pid, state, _, start = _unpack(w)
        held = state != SlotState.FREE and (pid, start) != (me, mine)
        if held and not force and pid_alive(pid, start):
            continue
        if not view.cas(hdr, w, _pack(me, SlotState.CLAIMING, role, mine)):
            continue
        row = counters.CounterRow(view, lay, i)
        view.store(slot_base + L.PS_REQUESTS_BASE, row.get(counters.Counter.REQUESTS))
        view.store(slot_base + L.PS_STARTED_NS, time.time_ns())
        view.store(slot_base + L.PS_HEARTBEAT_MS, now_ms if now_ms is not None else monotonic_ms())
        view.add(slot_base + L.PS_CLAIMS, 1)
        view.store(hdr, _pack(me, SlotState.RUNNING, role, mine))
        return ProcessSlot(view, lay, i, role)
    where = "any slot" if index is None else f"slot {index}"
    raise NoFreeSlot(f"{where} of {lay.params.process_slots} is held by a live process")


def release_dead(view: AtomicView, lay: L.Layout, pid: int) -> int:
    """Free the slots naming ``pid`` whose holder is gone; how many. A child gives its slot
    back to nobody (killed or not, it simply exits): the supervisor does it once it has
    reaped the child, so ``pid`` cannot have gone to another process yet -- and a slot
    whose (pid, start ticks) names a live process is left alone all the same."""
    return _release(view, lay, lambda holder: holder == pid)


def release_gone(view: AtomicView, lay: L.Layout) -> int:
    """Free every slot whose holder is gone; how many. For a supervisor re-attaching to
    the segment its dead predecessor left: nobody reaped that one's children, and their
    slots were listed as dead processes for good."""
    return _release(view, lay, lambda holder: True)


def _release(view: AtomicView, lay: L.Layout, whose: Callable[[int], bool]) -> int:
    base = lay.offset("processes")
    freed = 0
    for i in range(lay.params.process_slots):
        hdr = base + i * L.PROCESS_SLOT_BYTES + L.PS_HEADER
        w = view.load(hdr)
        holder, state, _, start = _unpack(w)
        if state == SlotState.FREE or not whose(holder) or pid_alive(holder, start):
            continue
        if view.cas(hdr, w, _pack(0, SlotState.FREE, 0, 0)):
            freed += 1
    return freed


def read(view: AtomicView, lay: L.Layout) -> list[ProcessInfo]:
    """Every slot that is not free, each read whole (header word unchanged around it).
    Any contents at all read as something: a corrupt slot is shown, never a crash."""
    out = []
    base = lay.offset("processes")
    for i in range(lay.params.process_slots):
        b = base + i * L.PROCESS_SLOT_BYTES
        row = counters.CounterRow(view, lay, i)
        for _ in range(10):
            w = view.load(b + L.PS_HEADER)
            pid, state, role, start = _unpack(w)
            if state == SlotState.FREE:
                break
            info = ProcessInfo(
                slot=i,
                pid=pid,
                role=Role(role).name.lower() if role in Role._value2member_map_ else "?",
                state=state.name.lower(),
                started_ns=view.load(b + L.PS_STARTED_NS),
                start_ticks=start,
                heartbeat_ms=view.load(b + L.PS_HEARTBEAT_MS),
                claims=view.load(b + L.PS_CLAIMS),
                requests=row.get(counters.Counter.REQUESTS) - view.load(b + L.PS_REQUESTS_BASE),
                alive=pid_alive(pid, start),
            )
            if view.load(b + L.PS_HEADER) == w:
                out.append(info)
                break
    return out
