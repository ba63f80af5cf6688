"""The settle queue: a bounded multi-producer, single-consumer ring in the segment.

Vyukov's bounded queue with per-slot sequence numbers, using any capacity (positions are
64-bit and never wrap; a slot is ``pos % capacity``). For the slot of position ``pos``
the sequence word reads:

    pos                free for the producer of ``pos`` (or reserved, not yet written)
    pos | QS_WRITING   its producer is copying the record in
    pos + 1            published: the consumer may read it
    pos + capacity     consumed: free for the producer of the next lap

A producer reserves ``pos`` by compare-and-swap on the enqueue position, marks the slot
writing, copies the record and publishes -- the last two steps by compare-and-swap too,
so a producer that stalled past the grace period finds its slot taken and reports it.
A producer killed between reserving and publishing leaves the consumer at a slot that
never fills; after ``grace_ms`` the consumer takes the slot back itself and counts it as
abandoned, so a dead worker cannot wedge the queue. (One case stays open: a producer
frozen -- SIGSTOP, not death -- in the middle of its copy for longer than the grace period,
whose slot the ring then reuses a whole lap later, can resume and overwrite that newer
record before it is read. DESIGN.md has the supervisor kill a worker whose heartbeat goes
stale -- not built yet -- which would end such a freeze long before a lap comes round.)

The consumer reads a batch without freeing it (``peek``) and frees it only once its
operations are delivered (``commit``): a consumer killed in between loses nothing, and
the next one starts from the same place.
"""

from __future__ import annotations

import enum
import os
from collections.abc import Callable
from typing import NamedTuple

from ankusa_shm._atomics import AtomicView
from ankusa_shm.shm import layout as L
from ankusa_shm.shm.pids import pid_alive

ABANDON_GRACE_MS = 2_000

# Test-only pause point between reserving a slot and publishing it.
_pause_after_reserve: Callable[[], None] | None = None


class Op(enum.IntEnum):
    PROMOTE = 1
    RELEASE = 2


_OPS = {op.value: op for op in Op}
_pack = L.RECORD.pack
_unpack = L.RECORD.unpack_from
_HEAD = L.RECORD.size


class Pushed(enum.Enum):
    OK = "ok"
    FULL = "full"  # the caller counts the drop
    ABANDONED = "abandoned"  # stalled past the grace period; the consumer counted it


class RecordTooLarge(ValueError):
    pass


class Record(NamedTuple):
    """One settle operation (a tuple: the consumer builds thousands a second)."""

    op: Op
    key: bytes
    token: bytes
    hook_id: bytes
    ttl_ms: int
    claimed_ms: int
    enqueued_ms: int


class Batch(NamedTuple):
    records: list[Record]
    start: int
    end: int


class ConsumerTaken(Exception):
    pass


class SettleQueue:
    def __init__(
        self, view: AtomicView, buf: memoryview, lay: L.Layout, grace_ms: int = ABANDON_GRACE_MS
    ) -> None:
        self._view = view
        self._buf = buf
        base = lay.offset("queue")
        self._enq = base + L.Q_ENQUEUE
        self._deq = base + L.Q_DEQUEUE
        self._consumer = base + L.Q_CONSUMER
        self._slots = base + L.Q_SLOTS
        self.capacity = lay.params.queue_capacity
        self._grace_ms = grace_ms
        self._stuck: tuple[int, int] | None = None  # (pos, first seen ms), consumer only

    def format(self) -> None:
        """Number a fresh ring's slots for the first lap (the segment's creator, once)."""
        for i in range(self.capacity):
            self._view.store(self._slots + i * L.QUEUE_SLOT_BYTES + L.QS_SEQ, i)

    # -- producers ------------------------------------------------------------------------

    def push(self, rec: Record) -> Pushed:
        """Add one record; never blocks. A full ring is ``Pushed.FULL`` at once."""
        op, key, token, hook_id, ttl_ms, claimed_ms, enqueued_ms = rec
        if len(key) + len(hook_id) > L.RECORD_MAX_PAYLOAD or len(hook_id) > 255:
            raise RecordTooLarge(
                f"settle record of {len(key) + len(hook_id)} bytes (key + hook id) exceeds "
                f"the {L.RECORD_MAX_PAYLOAD}-byte slot limit (and a hook id 255)"
            )
        if len(token) != 16:
            raise ValueError(f"a claim token is 16 bytes, not {len(token)}")
        data = _pack(op, len(hook_id), len(key), ttl_ms, claimed_ms, enqueued_ms, token)
        data += key + hook_id
        v, cap = self._view, self.capacity
        pos = v.load(self._enq)
        while True:
            cell = self._slots + (pos % cap) * L.QUEUE_SLOT_BYTES
            seq = v.load(cell)
            if seq & L.QS_WRITING:
                if seq & ~L.QS_WRITING < pos:
                    return Pushed.FULL  # last lap's producer is still writing this slot
                pos = v.load(self._enq)  # another producer took ``pos`` meanwhile
                continue
            if seq == pos:
                if v.cas(self._enq, pos, pos + 1):
                    break
                pos = v.load(self._enq)
            elif seq < pos:
                return Pushed.FULL
            else:
                pos = v.load(self._enq)
        if _pause_after_reserve is not None:
            _pause_after_reserve()
        if not v.cas(cell, pos, pos | L.QS_WRITING):
            return Pushed.ABANDONED
        start = cell + L.QS_RECORD
        self._buf[start : start + len(data)] = data
        if not v.cas(cell, pos | L.QS_WRITING, pos + 1):
            return Pushed.ABANDONED
        return Pushed.OK

    def depth(self) -> int:
        """Operations reserved and not yet consumed."""
        return max(0, self._view.load(self._enq) - self._view.load(self._deq))

    # -- the one consumer -----------------------------------------------------------------

    def consumer_pid(self) -> int:
        return self._view.load(self._consumer)

    def become_consumer(self) -> None:
        """Take the consumer role, unless a live process holds it."""
        me = os.getpid()
        while True:
            holder = self._view.load(self._consumer)
            if holder == me:
                return
            if holder and pid_alive(holder):
                raise ConsumerTaken(f"settle queue already drained by live pid {holder}")
            if self._view.cas(self._consumer, holder, me):
                self._stuck = None
                return

    def resign_consumer(self) -> None:
        self._view.cas(self._consumer, os.getpid(), 0)

    def peek(self, max_records: int, now_ms: int) -> tuple[Batch, int]:
        """Up to ``max_records`` published records from the head, not yet freed; and how
        many abandoned slots were skipped at the head on the way."""
        v, cap = self._view, self.capacity
        start = pos = v.load(self._deq)
        records: list[Record] = []
        skipped = 0
        while len(records) < max_records:
            cell = self._slots + (pos % cap) * L.QUEUE_SLOT_BYTES
            seq = v.load(cell)
            if seq == pos + 1:
                records.append(self._read(cell))
                pos += 1
                continue
            if records or (seq == pos and v.load(self._enq) <= pos):
                break  # end of what is published, or the ring is empty
            if not self._abandon(cell, pos, seq, now_ms):
                break
            skipped += 1
            pos += 1
            start = pos
            v.store(self._deq, pos)
        return Batch(records, start, pos), skipped

    def commit(self, batch: Batch) -> None:
        """Free a peeked batch's slots for the next lap and move the head past them."""
        v, cap = self._view, self.capacity
        for pos in range(batch.start, batch.end):
            v.store(self._slots + (pos % cap) * L.QUEUE_SLOT_BYTES, pos + cap)
        v.store(self._deq, batch.end)

    def _abandon(self, cell: int, pos: int, seq: int, now_ms: int) -> bool:
        """Skip the head slot if it has been reserved-but-unpublished for the grace period."""
        if self._stuck is None or self._stuck[0] != pos:
            self._stuck = (pos, now_ms)
            return False
        if now_ms - self._stuck[1] < self._grace_ms:
            return False
        if not self._view.cas(cell, seq, pos + self.capacity):
            return False  # its producer moved on after all; read it next time
        self._stuck = None
        return True

    def _read(self, cell: int) -> Record:
        # One copy of the whole slot, then slices of it: cheaper than three reads.
        raw = self._buf[cell + L.QS_RECORD : cell + L.QUEUE_SLOT_BYTES].tobytes()
        op, id_len, key_len, ttl_ms, claimed_ms, enqueued_ms, token = _unpack(raw)
        key_end = _HEAD + key_len
        return Record(
            _OPS[op], raw[_HEAD:key_end], token, raw[key_end : key_end + id_len],
            ttl_ms, claimed_ms, enqueued_ms,
        )  # fmt: skip
