"""Process slots: who is attached, since when, and whether its event loop still turns.

A process claims a slot by compare-and-swap on the slot's header word (free, or held by a
pid that no longer exists), folds the previous owner's counters into the archive, writes
its start time and heartbeat, and only then publishes itself as running. The heartbeat is
written from inside the process's own loop, so a fresh heartbeat means the loop makes
progress, not merely that the process exists.
"""

from __future__ import annotations

import enum
import os
import time
from dataclasses import dataclass

from ankusa_shm._atomics import AtomicView
from ankusa_shm.clock import monotonic_ms
from ankusa_shm.shm import counters
from ankusa_shm.shm import layout as L
from ankusa_shm.shm.pids import pid_alive


class Role(enum.IntEnum):
    SUPERVISOR = 1
    WORKER = 2
    DRAINER = 3
    TOOL = 4


class SlotState(enum.IntEnum):
    FREE = 0
    CLAIMING = 1
    RUNNING = 2
    STOPPING = 3


def _pack(pid: int, state: SlotState, role: int) -> int:
    return (role << 40) | (int(state) << 32) | pid


def _unpack(w: int) -> tuple[int, SlotState, int]:
    return w & 0xFFFFFFFF, SlotState((w >> 32) & 0xFF), (w >> 40) & 0xFF


class NoFreeSlot(Exception):
    pass


@dataclass(frozen=True)
class ProcessInfo:
    slot: int
    pid: int
    role: str
    state: str
    started_ns: int
    heartbeat_ms: int
    claims: int
    requests: int  # hooks this process has handled (its REQUESTS counter)
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

    def heartbeat(self, now_ms: int) -> None:
        self._view.store(self._base + L.PS_HEARTBEAT_MS, now_ms)

    def set_state(self, state: SlotState) -> None:
        self._view.store(self._base + L.PS_HEADER, _pack(self._pid, state, self.role))

    def release(self) -> None:
        """Give the slot back; the counters stay in the row until the next claim folds them."""
        self._view.cas(
            self._base + L.PS_HEADER,
            self._view.load(self._base + L.PS_HEADER),
            _pack(0, SlotState.FREE, 0),
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
    recorded pid is alive: only a supervisor that has reaped that pid may say so (the pid
    may have been reused)."""
    me = os.getpid()
    candidates = range(lay.params.process_slots) if index is None else (index,)
    base = lay.offset("processes")
    for i in candidates:
        hdr = base + i * L.PROCESS_SLOT_BYTES + L.PS_HEADER
        w = view.load(hdr)
        pid, state, _ = _unpack(w)
        if state != SlotState.FREE and pid != me and not force and pid_alive(pid):
            continue
        if not view.cas(hdr, w, _pack(me, SlotState.CLAIMING, role)):
            continue
        counters.fold(view, lay, i)
        slot_base = base + i * L.PROCESS_SLOT_BYTES
        view.store(slot_base + L.PS_STARTED_NS, time.time_ns())
        view.store(slot_base + L.PS_HEARTBEAT_MS, now_ms if now_ms is not None else monotonic_ms())
        view.add(slot_base + L.PS_CLAIMS, 1)
        view.store(hdr, _pack(me, SlotState.RUNNING, role))
        return ProcessSlot(view, lay, i, role)
    where = "any slot" if index is None else f"slot {index}"
    raise NoFreeSlot(f"{where} of {lay.params.process_slots} is held by a live process")


def read(view: AtomicView, lay: L.Layout) -> list[ProcessInfo]:
    """Every slot that is not free, each read whole (header word unchanged around it)."""
    out = []
    base = lay.offset("processes")
    for i in range(lay.params.process_slots):
        b = base + i * L.PROCESS_SLOT_BYTES
        for _ in range(10):
            w = view.load(b + L.PS_HEADER)
            pid, state, role = _unpack(w)
            if state == SlotState.FREE:
                break
            info = ProcessInfo(
                slot=i,
                pid=pid,
                role=Role(role).name.lower() if role in Role._value2member_map_ else "?",
                state=state.name.lower(),
                started_ns=view.load(b + L.PS_STARTED_NS),
                heartbeat_ms=view.load(b + L.PS_HEARTBEAT_MS),
                claims=view.load(b + L.PS_CLAIMS),
                requests=counters.CounterRow(view, lay, i).get(counters.Counter.REQUESTS),
                alive=pid_alive(pid),
            )
            if view.load(b + L.PS_HEADER) == w:
                out.append(info)
                break
    return out
