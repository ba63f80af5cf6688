"""The settle queue: a bounded multi-producer, single-consumer ring in the segment.

Vyukov's bounded queue with per-slot sequence numbers, using any capacity of two or more
(positions are 64-bit and never wrap; a slot is ``pos % capacity``; with one slot the
last two lines below would be one number). For the slot of position ``pos`` the sequence
word reads:

    pos                  free for the producer of ``pos`` (or reserved, not yet written)
    pos | QS_WRITING     its producer is copying the record in
    pos + 1              published: the consumer may read it
    pos | QS_ABANDONED   given up on by the consumer: its producer never published
    pos + capacity       consumed: free for the producer of the next lap

A producer reserves ``pos`` by compare-and-swap on the enqueue position, marks the slot
writing, copies the record and publishes -- the last two steps by compare-and-swap too,
so a producer that stalled past the grace period finds its slot taken and reports it.
A producer killed between reserving and publishing leaves the consumer at a slot that
never fills; after ``grace_ms`` the consumer marks the slot abandoned (its producer's
compare-and-swaps fail from then on), moves past it and counts it, so a dead worker
cannot wedge the queue.

Every record carries a check: the CRC-32 of the record, bound to its position (layout's
``RECORD``). A record that fails it is skipped and counted, never delivered. That covers
the one thing the sequence words cannot: a producer frozen (SIGSTOP, not death) in the
middle of its copy for longer than the grace period, whose slot the ring reuses a lap
later, and which then resumes and copies its stale record over the newer one. (The
supervisor ends such a freeze -- a worker whose heartbeat has been silent for
``heartbeat_timeout_s`` gets SIGABRT, then SIGKILL -- but a busy ring laps sooner.) The
newer record is lost then, and counted; the stale record, or a torn mix of the two that
could promote one event's key under another hook's id, is not sent (unless it matches by
chance: one in 2**32). Damage from outside -- a stray write into the segment -- is
skipped the same way instead of stopping the drainer.

A consumer with nothing to read sleeps on a futex (``wait_for_records``) instead of
polling: it says it is asleep, then looks once more, and a producer that publishes and
finds it asleep wakes it. Both sides act in that order on sequentially consistent words,
so a record published while the consumer was falling asleep is either seen by its last
look or wakes it; with anything reserved and not yet published it does not sleep at all
(that producer may be dead, and the slot is given up on only by looking again).

The consumer reads a batch without freeing it (``peek``) and frees it only once its
operations are delivered (``commit``): a consumer killed in between loses nothing, and
the next one starts from the same place (delivering that batch again).

A consumer killed at any instruction of ``commit`` loses nothing either. The dequeue
position moves first and the slots are freed after it, in position order, so the ring
lends a slot to the next lap only once the head is past it: depth (enqueue less dequeue
position) never exceeds the capacity. A consumer killed between the two leaves a run of
slots just behind the head still reading "published" (or "abandoned"). No producer can
take them -- pushes that reach them are FULL -- until the next consumer's first
``peek``, which frees that run back to its first freed slot: nothing is read as a stuck
producer, nothing waits a grace period, nothing of the next lap is touched. (A consumer
looks behind the head whenever the head is not where its own last commit left it: on its
first ``peek``, and after a commit it did not finish.) Giving a slot up goes the same
way -- mark it, move the head, free it -- and a consumer that finds a marked slot at the
head finishes the job at once. A slot is counted abandoned by the consumer that moves the
head past it, in ``peek``'s answer; the one count that can still be lost is that of a
consumer killed between moving the head and its caller adding the count up. A record that
fails its check is counted the same way at the head (``Batch.corrupt_skipped``); after
good records it is freed with them by ``commit`` and counted once that is done
(``Batch.corrupt``), as delivered records are, so a consumer killed in between leaves it
to be counted by the next one, once.
"""

from __future__ import annotations

import enum
import os
from collections.abc import Callable
from typing import NamedTuple

from ankusa_shm._atomics import AtomicView, crc32
from ankusa_shm.shm import layout as L
from ankusa_shm.shm import pids
from ankusa_shm.shm.pids import pid_alive

ABANDON_GRACE_MS = 2_000

# Test-only pause points: between reserving a slot and marking it written; between that
# mark and the copy; and in ``commit``, after the head has moved, before each slot (its
# position given) is freed.
_pause_after_reserve: Callable[[], None] | None = None
_pause_while_writing: Callable[[], None] | None = None
_pause_in_commit: Callable[[int], None] | None = None


class Op(enum.IntEnum):
    PROMOTE = 1
    RELEASE = 2


_OPS = {op.value: op for op in Op}
_pack_body = L.RECORD_BODY.pack
_pack_check = L.RECORD_CHECK.pack_into
_unpack = L.RECORD.unpack_from
_BODY = L.RECORD_CHECK.size  # where the body starts in the record
_HEAD = L.RECORD.size
_LOW32 = 0xFFFFFFFF
# Tuples built without the NamedTuples' Python-level __new__: half the cost, and the
# consumer builds a Record per record and a Batch per peek.
_tuple = tuple.__new__
_BASE = ~(L.QS_WRITING | L.QS_ABANDONED)  # a sequence word's position, without its flags


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
    corrupt: int = 0  # records among these that failed their check: freed by commit
    corrupt_skipped: int = 0  # such records at the head: freed by the peek itself


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
        self._sleeping = base + L.Q_SLEEPING
        self._wake = base + L.Q_WAKE
        self._deq = base + L.Q_DEQUEUE
        self._consumer = base + L.Q_CONSUMER
        self._consumer_id = base + L.Q_CONSUMER_ID
        self._mended = base + L.Q_MENDED_MS
        self._first_seq = base + L.Q_FIRST_SEQ
        self._slots = base + L.Q_SLOTS
        self.capacity = lay.params.queue_capacity
        self._grace_ms = grace_ms
        self._stuck: tuple[int, int] | None = None  # (pos, first seen ms), consumer only
        # A head position behind which this consumer knows every slot is freed: while the
        # head is there, ``peek`` need not look behind it.
        self._tidy_at = -1

    def format(self) -> None:
        """Number a fresh ring's slots for the first lap (the segment's creator, once)."""
        for i in range(self.capacity):
            self._view.store(self._slots + i * L.QUEUE_SLOT_BYTES + L.QS_SEQ, i)

    # -- a ring left by a dead owner -------------------------------------------------------

    def check(self) -> str | None:
        """What is wrong with the ring's words, or None: for the supervisor re-attaching,
        before any process of its own uses the ring.

        Every state the protocol can leave -- producers and consumers killed at any
        instruction, a frozen producer -- keeps the two positions at most a capacity
        apart, and each slot's sequence word on one of the values its position allows:
        this lap's (free, being written, published, given up on) or, just behind the
        head, the last lap's not yet freed. Anything else was written by no ankusa-shm
        code: a consumer would give slots up one grace period at a time and producers
        would find the ring full, for as long as the segment lived."""
        v, cap = self._view, self.capacity
        deq, enq = v.load(self._deq), v.load(self._enq)
        if not deq <= enq <= deq + cap:
            return f"enqueue position {enq} and dequeue position {deq} are not 0-{cap} apart"
        for pos in range(deq, deq + cap):
            seq = v.load(self._slots + (pos % cap) * L.QUEUE_SLOT_BYTES)
            last = pos - cap  # the slot's position a lap ago, behind the head
            if seq not in (pos, pos | L.QS_WRITING, pos + 1, pos | L.QS_ABANDONED) and (
                last < 0 or seq not in (last + 1, last | L.QS_ABANDONED)
            ):
                return f"slot {pos % cap} reads {seq:#x}, not a state of position {pos}"
        return None

    def rebuild(self) -> tuple[int, int]:
        """Renumber the ring from position 0 and queue again, in their order, the records
        it held that pass their checks (a check binds its record to its position, so only
        the slot's own word need be whole for it to be read). For an owner, before its
        processes start. Returns how many records were kept, and how many slots were lost:
        a record being written, or failing its check, or a word no state reads as.

        A record consumed but not yet freed is kept too: delivering it again changes
        nothing (settle operations are idempotent)."""
        v, cap = self._view, self.capacity
        found: list[tuple[int, Record]] = []
        lost = 0
        for i in range(cap):
            cell = self._slots + i * L.QUEUE_SLOT_BYTES
            seq = v.load(cell)
            flags, pos = seq & ~_BASE, seq & _BASE
            if not flags and pos % cap == (i + 1) % cap and pos:  # published at pos - 1
                rec = self._read(cell, pos - 1)
                if rec is not None:
                    found.append((pos - 1, rec))
                    continue
            elif pos % cap == i and flags in (0, L.QS_ABANDONED):  # free, or given up on
                continue
            lost += 1
        found.sort(key=lambda item: item[0])
        v.store(self._deq, 0)
        v.store(self._enq, 0)
        v.store(self._sleeping, 0)
        self.format()
        for _, rec in found:
            self.push(rec)
        self._tidy_at = -1
        return len(found), lost

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
        body = _pack_body(op, len(hook_id), len(key), ttl_ms, claimed_ms, enqueued_ms, token)
        body += key + hook_id
        crc = crc32(body, 0, len(body))  # of its own bytes: a stale copy may land in the slot
        v, cap = self._view, self.capacity
        pos = v.load(self._enq)
        while True:
            cell = self._slots + (pos % cap) * L.QUEUE_SLOT_BYTES
            seq = v.load(cell)
            if seq == pos:
                if v.cas(self._enq, pos, pos + 1):
                    break
                pos = v.load(self._enq)
            elif (seq & _BASE) < pos:
                return Pushed.FULL  # last lap's record: unread, being written, or given up on
            else:
                pos = v.load(self._enq)  # another producer took ``pos`` meanwhile
        if _pause_after_reserve is not None:
            _pause_after_reserve()
        if not v.cas(cell, pos, pos | L.QS_WRITING):
            return Pushed.ABANDONED
        if _pause_while_writing is not None:
            _pause_while_writing()
        record = cell + L.QS_RECORD
        self._buf[record + _BODY : record + _BODY + len(body)] = body
        _pack_check(self._buf, record, (crc ^ pos) & _LOW32)
        if not v.cas(cell, pos | L.QS_WRITING, pos + 1):
            return Pushed.ABANDONED
        if v.load(self._sleeping) and v.cas(self._sleeping, 1, 0):  # one producer wakes it
            self.wake_consumer()
        return Pushed.OK

    def depth(self) -> int:
        """Operations reserved and not yet consumed."""
        return max(0, self.tail() - self.head())

    def tail(self) -> int:
        """The position the next push will take: every operation pushed so far is before
        it. Once ``head`` reaches it, all of them are consumed."""
        return self._view.load(self._enq)

    def head(self) -> int:
        """The position of the next operation to consume."""
        return self._view.load(self._deq)

    # -- the one consumer -----------------------------------------------------------------

    def wait_for_records(self, timeout_s: float) -> bool:
        """With nothing to read: sleep, without the GIL, until a producer publishes, a
        ``wake_consumer`` or ``timeout_s`` (False). Returns at once while anything is
        reserved, published or not."""
        v = self._view
        v.store(self._sleeping, 1)
        seen = v.load(self._wake)
        if v.load(self._enq) > v.load(self._deq):
            woken = True
        else:
            woken = v.wait_at_least(self._wake, seen + 1, int(timeout_s * 1e9))
        v.store(self._sleeping, 0)
        return woken

    def wake_consumer(self) -> None:
        """Cut the consumer's ``wait_for_records`` short (a producer's push does it)."""
        self._view.add(self._wake, 1)
        self._view.wake(self._wake)

    def mended_ms(self) -> int:
        """Wall ms before which every drop has been made good; 0 if not known."""
        return self._view.load(self._mended)

    def set_mended_ms(self, wall_ms: int) -> None:
        """The consumer's: every drop counted so far has been made good, as of ``wall_ms``."""
        self._view.store(self._mended, wall_ms)

    def first_seq(self) -> int:
        """The first store seq whose settle went through this ring; 0 if not known."""
        return self._view.load(self._first_seq)

    def set_first_seq(self, seq: int) -> None:
        """The supervisor's, on a segment it made, before any worker commits."""
        self._view.store(self._first_seq, seq)

    def consumer_pid(self) -> int:
        return self._view.load(self._consumer)

    def live_consumer(self) -> int | None:
        """The pid of the live process holding the consumer role; None if nobody does."""
        ident = self._view.load(self._consumer_id)
        holder = ident & L.PID_MASK
        return holder if ident and pid_alive(holder, ident >> L.PID_BITS) else None

    def become_consumer(self) -> None:
        """Take the consumer role, unless a live process holds it.

        The role is held by the identity word (start ticks and pid, one word), so a holder
        whose pid has gone to another process is seen to be gone, and no one judges a
        holder by a start time that is not yet its own. The pid word is for readers.
        """
        me = os.getpid()
        mine = (pids.my_start() & L.START_MASK) << L.PID_BITS | me
        for _ in range(1000):  # each lost race means another process took or gave it up
            ident = self._view.load(self._consumer_id)
            holder = ident & L.PID_MASK
            if ident != mine and pid_alive(holder, ident >> L.PID_BITS):
                raise ConsumerTaken(f"settle queue already drained by live pid {holder}")
            if ident == mine or self._view.cas(self._consumer_id, ident, mine):
                self._view.store(self._consumer, me)
                if ident != mine:
                    self._stuck = None
                return
        raise ConsumerTaken("the settle queue's consumer role keeps changing hands")

    def resign_consumer(self) -> None:
        mine = (pids.my_start() & L.START_MASK) << L.PID_BITS | os.getpid()
        if self._view.cas(self._consumer_id, mine, 0):
            self._view.cas(self._consumer, os.getpid(), 0)

    def peek(self, max_records: int, now_ms: int) -> tuple[Batch, int]:
        """Up to ``max_records`` published records from the head, not yet freed; and how
        many abandoned slots were skipped at the head on the way. A record that fails its
        check is never returned: at the head it is skipped at once (``corrupt_skipped``),
        after records it is freed with them by ``commit`` (``corrupt``)."""
        v, cap = self._view, self.capacity
        start = pos = v.load(self._deq)
        if pos != self._tidy_at:
            self._free_behind(pos)
        records: list[Record] = []
        skipped = corrupt = corrupt_skipped = 0
        while len(records) < max_records:
            cell = self._slots + (pos % cap) * L.QUEUE_SLOT_BYTES
            seq = v.load(cell)
            if seq == pos + 1:
                rec = self._read(cell, pos)
                if rec is not None:
                    records.append(rec)
                    pos += 1
                    continue
                if records:  # freed with them by commit
                    corrupt += 1
                    pos += 1
                    continue
                # At the head: skipped at once, below, as a slot given up on is.
                corrupt_skipped += 1
            elif records or (seq == pos and v.load(self._enq) <= pos):
                break  # end of what is published, or the ring is empty
            # A slot marked by a consumer killed before it moved on needs no grace period.
            elif seq != pos | L.QS_ABANDONED and not self._abandon(cell, pos, seq, now_ms):
                break
            else:
                skipped += 1
            v.store(self._deq, pos + 1)  # the head first, then the slot: as in commit
            v.store(cell, pos + cap)
            self._tidy_at = pos + 1
            pos += 1
            start = pos
        return _tuple(Batch, (records, start, pos, corrupt, corrupt_skipped)), skipped

    def commit(self, batch: Batch) -> None:
        """Move the head past a peeked batch, then free its slots for the next lap."""
        v, cap = self._view, self.capacity
        v.store(self._deq, batch.end)
        pause = _pause_in_commit
        for pos in range(batch.start, batch.end):
            if pause is not None:
                pause(pos)
            v.store(self._slots + (pos % cap) * L.QUEUE_SLOT_BYTES, pos + cap)
        self._tidy_at = batch.end

    def _free_behind(self, head: int) -> None:
        """Free the slots a consumer killed inside ``commit`` (or while giving a slot up)
        left behind the head: the run just behind it that still reads published or
        abandoned. Frees go in position order, so that run ends at the head."""
        v, cap = self._view, self.capacity
        first = head
        while first > max(0, head - cap):
            seq = v.load(self._slots + ((first - 1) % cap) * L.QUEUE_SLOT_BYTES)
            if seq != first and seq != (first - 1) | L.QS_ABANDONED:
                break
            first -= 1
        for pos in range(first, head):
            v.store(self._slots + (pos % cap) * L.QUEUE_SLOT_BYTES, pos + cap)
        self._tidy_at = head

    def _abandon(self, cell: int, pos: int, seq: int, now_ms: int) -> bool:
        """Mark the head slot abandoned if it has been reserved-but-unpublished for the
        grace period; from then on its producer's compare-and-swaps fail."""
        if self._stuck is None or self._stuck[0] != pos:
            self._stuck = (pos, now_ms)
            return False
        if now_ms - self._stuck[1] < self._grace_ms:
            return False
        if not self._view.cas(cell, seq, pos | L.QS_ABANDONED):
            return False  # its producer moved on after all; read it next time
        self._stuck = None
        return True

    def _read(self, cell: int, pos: int) -> Record | None:
        """The record published at ``pos``; None if it fails its check."""
        # One copy of the whole slot, then slices of it: cheaper than three reads.
        raw = self._buf[cell + L.QS_RECORD : cell + L.QUEUE_SLOT_BYTES].tobytes()
        check, op, id_len, key_len, ttl_ms, claimed_ms, enqueued_ms, token = _unpack(raw)
        key_end = _HEAD + key_len
        end = key_end + id_len
        if end > len(raw) or (crc32(raw, _BODY, end) ^ pos) & _LOW32 != check:
            return None
        kind = _OPS.get(op)
        if kind is None:  # the check passed by chance (one in 2**32)
            return None
        return _tuple(
            Record,
            (kind, raw[_HEAD:key_end], token, raw[key_end:end], ttl_ms, claimed_ms, enqueued_ms),
        )
