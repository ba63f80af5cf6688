#!/usr/bin/env python3
"""Nanoseconds per operation of ankusa-shm's shared-memory structures, measured from Python.

Every structure is timed as the project builds it (lock-free, on the ``_atomics`` C
extension) and beside its "semaphore twin": the same words of the same segment updated by
a plain-Python read-modify-write (``struct.unpack_from`` / ``struct.pack_into``) while a
``posix_ipc.Semaphore`` is held. Each runs in one process, then in two forked processes
hammering the segment at once: both are released by one barrier, and the figure is the
wall time from the first start to the last finish divided by the operations of one
process. Every figure is the best of ``--reps`` repetitions, taken with the garbage
collector off.

    cd /work/main && .venv/bin/python scripts/bench_shm.py [--reps N] [--scale F]

The settle queue has a single consumer, so its two-process runs are a producer (``push``)
and the consumer (``peek`` + ``commit``) at once, the shape of a worker and the drainer.

Each run is also checked: no fetch-add or GCRA charge lost, every queue record read back
in order, the queue empty afterwards. A failed check exits 1.

The last line printed is one JSON object of every figure, under the names printed above
it. The segment and the semaphore are created under names holding this pid and unlinked
on the way out, also on error or SIGTERM.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import json
import mmap
import os
import platform
import secrets
import select
import shlex
import signal
import struct
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from time import perf_counter_ns
from types import FrameType
from typing import Any, Literal, NoReturn, Protocol

import posix_ipc

from ankusa_shm._atomics import AtomicView, crc32
from ankusa_shm.limits import MAX_SPAN_US, Limit, retry_ms
from ankusa_shm.shm import layout as L
from ankusa_shm.shm import procs, segment
from ankusa_shm.shm.breaker import Breaker, Policy
from ankusa_shm.shm.counters import Counter, CounterRow
from ankusa_shm.shm.gcra import GcraTable, tenant_hash
from ankusa_shm.shm.segment import Segment
from ankusa_shm.shm.settle_queue import Batch, Op, Pushed, Record, SettleQueue

ROOT = Path(__file__).resolve().parent.parent

Variant = Literal["atomics", "twin"]
Mode = Literal["solo", "producer", "consumer"]
Loop = Callable[[int, int], int]
"""loop(n, base) runs n operations at clock base ``base`` and returns how many went wrong."""

WORD = struct.Struct("<q")
CHECK = L.RECORD_CHECK
CHUNK = 1000  # operations per simulated clock tick; every n is a multiple of it
WARM_BACK = 5_000_000  # warm-up runs at base - WARM_BACK, clear of the timed run's words
BASE_STEP = 10_000_000  # each run gets a fresh clock base: fresh buckets, fresh GCRA TAT
CHILD_TIMEOUT_S = 60.0
BARRIER_TIMEOUT_NS = 10 * 10**9

# Control page shared by the parent and its forked children (anonymous MAP_SHARED).
CTL_BARRIER = 0
CTL_ABORT = L.LINE

# Breaker: 1 ms buckets (window 32 ms), so a tick of CHUNK records never fills a bucket
# (a full bucket stops sampling and would turn record() into a bare load).
POLICY = Policy(
    failure_rate=0.5,
    min_calls=20,
    window_ms=L.BREAKER_BUCKETS,
    open_ms=5_000,
    probe_timeout_ms=1_000,
)
# GCRA: 1 us interval, burst 2**40: every take admits and moves the TAT by one interval.
TENANT = "acme"
LIMIT = Limit.of(1_000_000, 1 << 40)

QUEUE_BATCH = 1000
POOL_MASK = 1023  # records are taken from a pool of 1024, tagged with their index

TARGETS: dict[str, tuple[str, float]] = {
    "segment_mib": ("<=", 40.0),
    "fetch_add_1p_atomics_ns": ("<=", 60.0),
    "gcra_take_1p_atomics_ns": ("<=", 400.0),
    "queue_push_pop_1p_atomics_ns": ("<=", 3000.0),
    "fetch_add_2p_ratio": (">=", 3.0),
    "gcra_take_2p_ratio": (">=", 3.0),
    "queue_push_pop_2p_ratio": (">=", 3.0),
}


class BenchError(Exception):
    pass


class Aborted(Exception):
    """The other process of a two-process run failed; stop waiting for it."""


@dataclass(frozen=True)
class Ctx:
    """What one process needs to run a loop."""

    seg: Segment
    sem: Any  # posix_ipc.Semaphore (untyped)
    ctl: AtomicView
    fa_off: int  # the one word every fetch-add hits
    row: CounterRow


@dataclass(frozen=True)
class Run:
    procs: int
    warm: int  # warm-up operations per process before the timed ones
    n: int  # timed operations per process
    base: int


def _no_snapshot(ctx: Ctx) -> int:
    return 0


def _no_verify(ctx: Ctx, before: int, run: Run) -> int:
    return 0


@dataclass(frozen=True)
class Bench:
    key: str
    title: str
    twin: str
    n: int
    warm: int
    symmetric: bool  # False: two processes are a producer and a consumer
    make: Callable[[Ctx, Variant, Mode], Loop]
    snapshot: Callable[[Ctx], int] = _no_snapshot
    verify: Callable[[Ctx, int, Run], int] = _no_verify


# -- semaphore twins: the same words, plain reads and writes under one lock --------------


def _load(buf: memoryview, off: int) -> int:
    value: int = WORD.unpack_from(buf, off)[0]
    return value


class BreakerLike(Protocol):
    def record(self, ok: bool, now_ms: int) -> None: ...


class GcraLike(Protocol):
    def take(self, tenant: str, limit: Limit, now_us: int) -> int: ...


class QueueLike(Protocol):
    def push(self, rec: Record) -> Pushed: ...
    def peek(self, max_records: int, now_ms: int) -> tuple[Batch, int]: ...
    def commit(self, batch: Batch) -> None: ...


class TwinBreaker:
    """Breaker.record(True, now) as a locked read-modify-write of the window bucket."""

    def __init__(self, sem: Any, buf: memoryview, lay: L.Layout, policy: Policy) -> None:
        self._acquire = sem.acquire
        self._release = sem.release
        self._buf = buf
        self._buckets = lay.offset("breaker") + L.BR_BUCKETS
        self._width = max(1, -(-policy.window_ms // L.BREAKER_BUCKETS))

    def record(self, ok: bool, now_ms: int) -> None:
        if not ok:
            raise NotImplementedError("the twin models the success path only")
        self._acquire()
        try:
            self._bump(now_ms, failed=False)
        finally:
            self._release()

    def _bump(self, now_ms: int, failed: bool) -> None:
        epoch_full = now_ms // self._width
        epoch = epoch_full & L.BK_EPOCH_MASK
        off = self._buckets + (epoch_full % L.BREAKER_BUCKETS) * L.WORD
        w = _load(self._buf, off)
        if w & L.BK_VALID and (w >> L.BK_EPOCH_SHIFT) & L.BK_EPOCH_MASK == epoch:
            if w & L.BK_COUNT_MASK == L.BK_COUNT_MASK:
                return
            new = w + 1 + (failed << L.BK_FAIL_SHIFT)
        else:
            new = L.BK_VALID | (epoch << L.BK_EPOCH_SHIFT) | (failed << L.BK_FAIL_SHIFT) | 1
        WORD.pack_into(self._buf, off, new)


def _twin_lead(word: int, tag: int, now_us: int) -> int:
    """gcra._lead, restated: how far the TAT is ahead of now (0: fresh or drained)."""
    if word >> L.GCRA_TAG_SHIFT != tag:
        return 0
    d = ((word & L.GCRA_TAT_MASK) - now_us) & L.GCRA_TAT_MASK
    if d >= (L.GCRA_TAT_MASK + 1) >> 1:
        return 0
    return d if d <= MAX_SPAN_US else 0


class TwinGcra:
    """GcraTable.take as a locked lookup and read-modify-write of the tenant's TAT word."""

    def __init__(self, sem: Any, buf: memoryview, lay: L.Layout) -> None:
        self._acquire = sem.acquire
        self._release = sem.release
        self._buf = buf
        self._base = lay.offset("gcra")
        self.slots = lay.params.gcra_slots

    def take(self, tenant: str, limit: Limit, now_us: int) -> int:
        key, tag = tenant_hash(tenant)
        buf = self._buf
        self._acquire()
        try:
            off = self._find(key)
            if off < 0:
                return 0
            w = _load(buf, off + L.GS_TAT)
            lead = _twin_lead(w, tag, now_us) + limit.interval_us
            if lead > limit.span_us:
                return retry_ms(lead - limit.span_us)
            WORD.pack_into(
                buf, off + L.GS_TAT, (tag << L.GCRA_TAG_SHIFT) | ((now_us + lead) & L.GCRA_TAT_MASK)
            )
            return 0
        finally:
            self._release()

    def _find(self, key: int) -> int:
        home = key % self.slots
        for i in range(L.GCRA_PROBE):
            off = self._base + ((home + i) % self.slots) * L.GCRA_SLOT_BYTES
            k = _load(self._buf, off + L.GS_KEY)
            if k == key:
                return off
            if k == 0:
                WORD.pack_into(self._buf, off + L.GS_KEY, key)
                return off
        return -1


class TwinQueue:
    """The settle ring (same words, same sequence numbers, the same record check) with
    every step under a lock."""

    def __init__(self, sem: Any, buf: memoryview, lay: L.Layout) -> None:
        self._acquire = sem.acquire
        self._release = sem.release
        self._buf = buf
        base = lay.offset("queue")
        self._enq = base + L.Q_ENQUEUE
        self._deq = base + L.Q_DEQUEUE
        self._slots = base + L.Q_SLOTS
        self.capacity = lay.params.queue_capacity

    def push(self, rec: Record) -> Pushed:
        payload = len(rec.key) + len(rec.hook_id)
        if payload > L.RECORD_MAX_PAYLOAD or len(rec.hook_id) > 255 or len(rec.token) != 16:
            raise ValueError("record too large")
        body = (
            L.RECORD_BODY.pack(
                rec.op,
                len(rec.hook_id),
                len(rec.key),
                rec.ttl_ms,
                rec.claimed_ms,
                rec.enqueued_ms,
                rec.token,
            )
            + rec.key
            + rec.hook_id
        )
        crc = crc32(body, 0, len(body))
        buf = self._buf
        self._acquire()
        try:
            pos = _load(buf, self._enq)
            cell = self._slots + (pos % self.capacity) * L.QUEUE_SLOT_BYTES
            if _load(buf, cell) != pos:
                return Pushed.FULL
            start = cell + L.QS_RECORD
            buf[start + CHECK.size : start + CHECK.size + len(body)] = body
            CHECK.pack_into(buf, start, (crc ^ pos) & 0xFFFFFFFF)
            WORD.pack_into(buf, cell, pos + 1)
            WORD.pack_into(buf, self._enq, pos + 1)
        finally:
            self._release()
        return Pushed.OK

    def peek(self, max_records: int, now_ms: int) -> tuple[Batch, int]:
        buf, cap = self._buf, self.capacity
        records: list[Record] = []
        self._acquire()
        try:
            start = pos = _load(buf, self._deq)
            while len(records) < max_records:
                cell = self._slots + (pos % cap) * L.QUEUE_SLOT_BYTES
                if _load(buf, cell) != pos + 1:
                    break
                records.append(self._read(cell, pos))
                pos += 1
        finally:
            self._release()
        return Batch(records, start, pos), 0

    def commit(self, batch: Batch) -> None:
        buf, cap = self._buf, self.capacity
        self._acquire()
        try:
            for pos in range(batch.start, batch.end):
                WORD.pack_into(buf, self._slots + (pos % cap) * L.QUEUE_SLOT_BYTES, pos + cap)
            WORD.pack_into(buf, self._deq, batch.end)
        finally:
            self._release()

    def _read(self, cell: int, pos: int) -> Record:
        raw = self._buf[cell + L.QS_RECORD : cell + L.QUEUE_SLOT_BYTES].tobytes()
        check, op, id_len, key_len, ttl_ms, claimed_ms, enqueued_ms, token = L.RECORD.unpack_from(
            raw
        )
        key_end = L.RECORD.size + key_len
        end = key_end + id_len
        if (crc32(raw, CHECK.size, end) ^ pos) & 0xFFFFFFFF != check:
            raise ValueError(f"record {pos} fails its check")
        return Record(
            op=Op(op),
            key=raw[L.RECORD.size : key_end],
            token=token,
            hook_id=raw[key_end:end],
            ttl_ms=ttl_ms,
            claimed_ms=claimed_ms,
            enqueued_ms=enqueued_ms,
        )


# -- the loops ------------------------------------------------------------------------------


def make_fetch_add(ctx: Ctx, variant: Variant, mode: Mode) -> Loop:
    """AtomicView.add on one word, unrolled x10 so the loop itself costs ~1/10 per op."""
    off = ctx.fa_off
    if variant == "atomics":
        add = ctx.seg.view.add

        def atomic_loop(n: int, base: int) -> int:
            for _ in range(n // 10):
                add(off, 1)
                add(off, 1)
                add(off, 1)
                add(off, 1)
                add(off, 1)
                add(off, 1)
                add(off, 1)
                add(off, 1)
                add(off, 1)
                add(off, 1)
            return 0

        return atomic_loop

    acq, rel = ctx.sem.acquire, ctx.sem.release
    buf = ctx.seg.buf
    get, put = WORD.unpack_from, WORD.pack_into

    def twin_loop(n: int, base: int) -> int:
        for _ in range(n // 10):
            acq()
            put(buf, off, get(buf, off)[0] + 1)
            rel()
            acq()
            put(buf, off, get(buf, off)[0] + 1)
            rel()
            acq()
            put(buf, off, get(buf, off)[0] + 1)
            rel()
            acq()
            put(buf, off, get(buf, off)[0] + 1)
            rel()
            acq()
            put(buf, off, get(buf, off)[0] + 1)
            rel()
            acq()
            put(buf, off, get(buf, off)[0] + 1)
            rel()
            acq()
            put(buf, off, get(buf, off)[0] + 1)
            rel()
            acq()
            put(buf, off, get(buf, off)[0] + 1)
            rel()
            acq()
            put(buf, off, get(buf, off)[0] + 1)
            rel()
            acq()
            put(buf, off, get(buf, off)[0] + 1)
            rel()
        return 0

    return twin_loop


def snapshot_fetch_add(ctx: Ctx) -> int:
    return ctx.seg.view.load(ctx.fa_off)


def verify_fetch_add(ctx: Ctx, before: int, run: Run) -> int:
    """Increments lost (or invented): the word must have grown by every add."""
    return abs(ctx.seg.view.load(ctx.fa_off) - before - run.procs * (run.warm + run.n))


def make_breaker(ctx: Ctx, variant: Variant, mode: Mode) -> Loop:
    lay = ctx.seg.layout
    br: BreakerLike
    if variant == "atomics":
        br = Breaker(ctx.seg.view, lay, POLICY, ctx.row)
    else:
        br = TwinBreaker(ctx.sem, ctx.seg.buf, lay, POLICY)
    record = br.record

    def loop(n: int, base: int) -> int:
        for tick in range(n // CHUNK):
            now = base + tick
            for _ in range(CHUNK):
                record(True, now)
        return 0

    return loop


def make_gcra(ctx: Ctx, variant: Variant, mode: Mode) -> Loop:
    table: GcraLike
    if variant == "atomics":
        table = GcraTable(ctx.seg.view, ctx.seg.buf, ctx.seg.layout, ctx.row)
    else:
        table = TwinGcra(ctx.sem, ctx.seg.buf, ctx.seg.layout)
    take = table.take

    def loop(n: int, base: int) -> int:
        denied = 0
        for _ in range(n):
            if take(TENANT, LIMIT, base):
                denied += 1
        return denied

    return loop


def _gcra_tat_offset(ctx: Ctx) -> int:
    key, _ = tenant_hash(TENANT)
    lay, v = ctx.seg.layout, ctx.seg.view
    home = key % lay.params.gcra_slots
    for i in range(L.GCRA_PROBE):
        off = lay.offset("gcra") + ((home + i) % lay.params.gcra_slots) * L.GCRA_SLOT_BYTES
        if v.load(off + L.GS_KEY) == key:
            return off + L.GS_TAT
    raise BenchError(f"tenant {TENANT!r} has no GCRA slot after a run")


def verify_gcra(ctx: Ctx, before: int, run: Run) -> int:
    """Charges lost: every admitted take moves the TAT one interval past base."""
    tat = ctx.seg.view.load(_gcra_tat_offset(ctx)) & L.GCRA_TAT_MASK
    want = (run.base + run.procs * run.n * LIMIT.interval_us) & L.GCRA_TAT_MASK
    return abs(want - tat)


def _record_pool() -> list[Record]:
    """Settle records of a realistic size; claimed_ms carries the index for order checks."""
    return [
        Record(
            op=Op.PROMOTE,
            key=b"ankusa:{acme}:dd:github:" + f"{i:08x}-1f0e-4c2b-9a7d-5e6f7a8b9c0d".encode(),
            token=i.to_bytes(16, "little"),
            hook_id=f"01JD{i:022d}".encode(),
            ttl_ms=259_200_000,
            claimed_ms=i,
            enqueued_ms=i,
        )
        for i in range(POOL_MASK + 1)
    ]


def _push_pop_loop(q: QueueLike, pool: list[Record]) -> Loop:
    push, peek, commit = q.push, q.peek, q.commit
    ok = Pushed.OK

    def loop(n: int, base: int) -> int:
        errors = 0
        for i in range(n):
            if push(pool[i & POOL_MASK]) is not ok:
                errors += 1
                continue
            batch, _ = peek(1, base)
            recs = batch.records
            if len(recs) != 1 or recs[0].claimed_ms != i & POOL_MASK:
                errors += 1
            commit(batch)
        return errors

    return loop


def _batched_loop(q: QueueLike, pool: list[Record], capacity: int) -> Loop:
    push, peek, commit = q.push, q.peek, q.commit
    ok = Pushed.OK

    def loop(n: int, base: int) -> int:
        errors = done = 0
        while done < n:
            k = min(capacity, n - done)
            for i in range(done, done + k):
                if push(pool[i & POOL_MASK]) is not ok:
                    errors += 1
            got = 0
            while got < k:
                batch, _ = peek(min(QUEUE_BATCH, k - got), base)
                if not batch.records:
                    errors += k - got
                    break
                for rec in batch.records:
                    if rec.claimed_ms != (done + got) & POOL_MASK:
                        errors += 1
                    got += 1
                commit(batch)
            done += k
        return errors

    return loop


def _producer_loop(q: QueueLike, pool: list[Record], ctl: AtomicView) -> Loop:
    push = q.push
    ok, full = Pushed.OK, Pushed.FULL

    def loop(n: int, base: int) -> int:
        errors = 0
        for i in range(n):
            rec = pool[i & POOL_MASK]
            while True:
                r = push(rec)
                if r is ok:
                    break
                if r is not full:
                    errors += 1
                    break
                if ctl.load(CTL_ABORT):
                    raise Aborted("the consumer failed")
        return errors

    return loop


def _consumer_loop(q: QueueLike, ctl: AtomicView, batch_max: int) -> Loop:
    peek, commit = q.peek, q.commit

    def loop(n: int, base: int) -> int:
        errors = got = 0
        while got < n:
            batch, _ = peek(min(batch_max, n - got), base)
            if not batch.records:
                if ctl.load(CTL_ABORT):
                    raise Aborted("the producer failed")
                continue
            for rec in batch.records:
                if rec.claimed_ms != got & POOL_MASK:
                    errors += 1
                got += 1
            commit(batch)
        return errors

    return loop


def make_queue(batched: bool) -> Callable[[Ctx, Variant, Mode], Loop]:
    def make(ctx: Ctx, variant: Variant, mode: Mode) -> Loop:
        lay = ctx.seg.layout
        q: QueueLike
        if variant == "atomics":
            q = SettleQueue(ctx.seg.view, ctx.seg.buf, lay)
        else:
            q = TwinQueue(ctx.sem, ctx.seg.buf, lay)
        pool = _record_pool()
        if mode == "producer":
            return _producer_loop(q, pool, ctx.ctl)
        if mode == "consumer":
            return _consumer_loop(q, ctx.ctl, QUEUE_BATCH if batched else 1)
        if batched:
            return _batched_loop(q, pool, lay.params.queue_capacity)
        return _push_pop_loop(q, pool)

    return make


def verify_queue(ctx: Ctx, before: int, run: Run) -> int:
    """Records left behind: the ring must be empty after every run."""
    return ctx.seg.queue_depth()


# -- running ----------------------------------------------------------------------------


def run_solo(ctx: Ctx, bench: Bench, variant: Variant, n: int, base: int) -> tuple[float, int]:
    loop = bench.make(ctx, variant, "solo")
    before = bench.snapshot(ctx)
    gc.disable()
    try:
        errors = loop(bench.warm, base - WARM_BACK) if bench.warm else 0
        t0 = perf_counter_ns()
        errors += loop(n, base)
        t1 = perf_counter_ns()
    finally:
        gc.enable()
    errors += bench.verify(ctx, before, Run(1, bench.warm, n, base))
    return (t1 - t0) / n, errors


def _barrier(ctl: AtomicView, parties: int) -> None:
    ctl.add(CTL_BARRIER, 1)
    deadline = time.monotonic_ns() + BARRIER_TIMEOUT_NS
    while ctl.load(CTL_BARRIER) < parties:
        if ctl.load(CTL_ABORT) or time.monotonic_ns() > deadline:
            raise Aborted("the other process never reached the barrier")


def _child(ctx: Ctx, bench: Bench, variant: Variant, role: int, n: int, base: int) -> bytes:
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) >= 2:
        os.sched_setaffinity(0, {cpus[role]})  # one core each: real cross-core contention
    slot = procs.claim(ctx.seg.view, ctx.seg.layout, procs.Role.WORKER)
    try:
        mine = dataclasses.replace(ctx, row=slot.counters)
        mode: Mode = "solo" if bench.symmetric else ("producer" if role == 0 else "consumer")
        loop = bench.make(mine, variant, mode)
        gc.disable()
        errors = 0
        if bench.symmetric and bench.warm:
            errors += loop(bench.warm, base - WARM_BACK)
        _barrier(ctx.ctl, 2)
        t0 = perf_counter_ns()
        errors += loop(n, base)
        t1 = perf_counter_ns()
    finally:
        slot.release()
    return json.dumps({"t0": t0, "t1": t1, "errors": errors}).encode()


def _child_main(
    ctx: Ctx, bench: Bench, variant: Variant, role: int, n: int, base: int, out: int
) -> NoReturn:
    code = 70
    try:
        os.write(out, _child(ctx, bench, variant, role, n, base))
        code = 0
    except Aborted:
        code = 75
    except BaseException:
        traceback.print_exc()
        ctx.ctl.store(CTL_ABORT, 1)
    finally:
        with contextlib.suppress(BaseException):
            sys.stderr.flush()
        os._exit(code)


def _collect(ctl: AtomicView, kids: dict[int, int]) -> list[dict[str, int]]:
    """Each child's JSON result from its pipe (read fd -> pid)."""
    data = {fd: b"" for fd in kids}
    waiting = set(kids)
    deadline = time.monotonic() + CHILD_TIMEOUT_S
    while waiting:
        left = deadline - time.monotonic()
        if left <= 0:
            ctl.store(CTL_ABORT, 1)
            raise BenchError(f"a two-process run did not finish in {CHILD_TIMEOUT_S:.0f} s")
        ready, _, _ = select.select(sorted(waiting), [], [], left)
        for fd in ready:
            chunk = os.read(fd, 65536)
            if chunk:
                data[fd] += chunk
            else:
                waiting.discard(fd)
                if not data[fd]:
                    ctl.store(CTL_ABORT, 1)  # it died without a result; free the other
    failed = [pid for fd, pid in kids.items() if not data[fd]]
    if failed:
        raise BenchError(f"benchmark child(ren) {failed} failed; see the traceback above")
    return [json.loads(data[fd]) for fd in kids]


def _reap(pid: int, kill: bool) -> int:
    """Wait for a child of ours; SIGKILL it first if it must not be waited for."""
    if kill:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return status
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    return os.waitpid(pid, 0)[1]


def run_duo(ctx: Ctx, bench: Bench, variant: Variant, n: int, base: int) -> tuple[float, int]:
    ctx.ctl.store(CTL_BARRIER, 0)
    ctx.ctl.store(CTL_ABORT, 0)
    before = bench.snapshot(ctx)
    sys.stdout.flush()
    sys.stderr.flush()
    kids: dict[int, int] = {}
    clean = False
    try:
        for role in (0, 1):
            r, w = os.pipe()
            pid = os.fork()
            if pid == 0:
                os.close(r)
                _child_main(ctx, bench, variant, role, n, base, w)
            os.close(w)
            kids[r] = pid
        results = _collect(ctx.ctl, kids)
        clean = True
    finally:
        statuses = {}
        for fd, pid in kids.items():
            statuses[pid] = _reap(pid, kill=not clean)
            os.close(fd)
    bad = {pid: status for pid, status in statuses.items() if status != 0}
    if bad:
        raise BenchError(f"benchmark children exited with wait statuses {bad}")
    wall = max(r["t1"] for r in results) - min(r["t0"] for r in results)
    warm = bench.warm if bench.symmetric else 0
    errors = sum(r["errors"] for r in results)
    errors += bench.verify(ctx, before, Run(2, warm, n, base))
    return wall / n, errors


def loop_overhead_ns(n: int) -> float:
    gc.disable()
    try:
        t0 = perf_counter_ns()
        for _ in range(n):
            pass
        return (perf_counter_ns() - t0) / n
    finally:
        gc.enable()


BENCHES = (
    Bench(
        "fetch_add",
        "fetch-add: AtomicView.add(word, 1), loop unrolled x10, every process on one word",
        "twin: sem.acquire(); pack_into(w, unpack_from(w) + 1); sem.release()",
        200_000,
        10_000,
        True,
        make_fetch_add,
        snapshot_fetch_add,
        verify_fetch_add,
    ),
    Bench(
        "breaker_record",
        "breaker record: Breaker.record(True, now_ms), 1 ms buckets, 1000 calls per tick",
        "twin: the window bucket's read-modify-write under the semaphore",
        100_000,
        5_000,
        True,
        make_breaker,
    ),
    Bench(
        "gcra_take",
        "GCRA take: GcraTable.take('acme', rate 1e6/s burst 2**40, now_us); always admits",
        "twin: slot lookup + TAT read-modify-write under the semaphore",
        100_000,
        5_000,
        True,
        make_gcra,
        verify=verify_gcra,
    ),
    Bench(
        "queue_push_pop",
        "settle queue push + pop: push(Record) then peek(1) + commit; 2p = producer | consumer",
        "twin: the same ring, each push / peek / commit under the semaphore",
        50_000,
        2_000,
        False,
        make_queue(batched=False),
        verify=verify_queue,
    ),
    Bench(
        "queue_batched",
        "settle queue batched, per op: push N, then peek(1000) + commit; 2p = producer | consumer",
        "twin: push under the semaphore each; each peek(1000) / commit under it once",
        50_000,
        2_000,
        False,
        make_queue(batched=True),
        verify=verify_queue,
    ),
)


# -- reporting ----------------------------------------------------------------------------


def _verdict(name: str, value: float) -> tuple[str, str]:
    if name not in TARGETS:
        return "", ""
    op, limit = TARGETS[name]
    ok = value <= limit if op == "<=" else value >= limit
    unit = {"<=": " ns", ">=": "x"}[op] if name != "segment_mib" else " MiB"
    return f"target {op} {limit:g}{unit}", "PASS" if ok else "MISS"


class Report:
    def __init__(self) -> None:
        self.figures: dict[str, float | int] = {}
        self.checks: dict[str, str] = {}

    def emit(self, name: str, value: float, unit: str, digits: int = 1) -> None:
        shown = round(value, digits)
        self.figures[name] = int(shown) if digits == 0 else shown
        target, verdict = _verdict(name, value)
        if verdict:
            self.checks[name] = verdict
        print(f"  {name:<32} {value:>10.{digits}f} {unit:<4} {target:<18} {verdict}".rstrip())


def _command_line(argv: list[str]) -> str:
    exe = Path(sys.executable)
    script = Path(__file__).resolve()
    with contextlib.suppress(ValueError):
        exe = exe.relative_to(ROOT)
    with contextlib.suppress(ValueError):
        script = script.relative_to(ROOT)
    return f"cd {shlex.quote(str(ROOT))} && {shlex.join([str(exe), str(script), *argv])}"


def _on_term(signum: int, frame: FrameType | None) -> None:
    raise SystemExit(128 + signum)


def _scaled(n: int, scale: float) -> int:
    return max(CHUNK, round(n * scale / CHUNK) * CHUNK)


def measure(
    ctx: Ctx, reps: int, scale: float
) -> tuple[dict[tuple[str, int, str], float], dict[str, int]]:
    """Best ns/op per (bench, processes, variant), interleaved over the repetitions; and
    the consistency errors per bench."""
    best: dict[tuple[str, int, str], float] = {}
    errors: dict[str, int] = {}
    base = BASE_STEP
    for rep in range(reps):
        for bench in BENCHES:
            n = _scaled(bench.n, scale)
            for p, runner in ((1, run_solo), (2, run_duo)):
                for variant in ("atomics", "twin"):
                    base += BASE_STEP
                    per_op, errs = runner(ctx, bench, variant, n, base)
                    k = (bench.key, p, variant)
                    best[k] = min(best.get(k, float("inf")), per_op)
                    errors[bench.key] = errors.get(bench.key, 0) + errs
        print(f"# repetition {rep + 1}/{reps} done", file=sys.stderr, flush=True)
    return best, errors


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    ap.add_argument("--reps", type=int, default=5, help="repetitions; the best is kept")
    ap.add_argument("--scale", type=float, default=1.0, help="multiply every iteration count")
    args = ap.parse_args(argv)
    if args.reps < 1 or not args.scale > 0:
        ap.error("--reps must be >= 1 and --scale > 0")
    signal.signal(signal.SIGTERM, _on_term)
    started = time.monotonic()

    cpus = len(os.sched_getaffinity(0))
    print(f"# command: {_command_line(argv)}")
    print("# ankusa-shm shared-memory benchmark: ns per operation from Python")
    print(
        f"# python {platform.python_version()} on {platform.system()} {platform.machine()}, "
        f"{cpus} CPUs, load average {os.getloadavg()[0]:.2f} at start; best of {args.reps}; "
        "gc off while timing"
    )
    print(
        "# 1p = one process; 2p = two forked processes on one segment, one CPU each, released "
        "by one barrier: wall time from first start to last finish / ops of one process"
    )

    tag = f"{os.getpid()}-{secrets.token_hex(3)}"
    seg_name = f"ankusa-bench-{tag}"
    sem_name = f"/ankusa-bench-sem-{tag}"
    seg: Segment | None = None
    sem: Any = None
    slot: procs.ProcessSlot | None = None
    made_seg = made_sem = False
    rep = Report()
    try:
        params = segment.make_params()
        lay = L.Layout.of(params)
        made_seg = True  # the name is ours (pid + random): unlink it even if create fails
        seg = Segment.create(seg_name, params)
        made_sem = True
        sem = posix_ipc.Semaphore(sem_name, posix_ipc.O_CREX, mode=0o600, initial_value=1)
        ctl_map = mmap.mmap(-1, mmap.PAGESIZE)  # anonymous and shared: inherited by fork
        slot = procs.claim(seg.view, seg.layout, procs.Role.WORKER)
        fa_off = lay.offset("counters") + slot.index * lay.counter_row + Counter.REQUESTS.offset
        ctx = Ctx(seg, sem, AtomicView(ctl_map), fa_off, slot.counters)

        print("\nsegment with default params (segment.make_params())")
        big = sorted(lay.regions.items(), key=lambda kv: -kv[1][1])[:3]
        print(
            f"  {params.queue_capacity} queue slots, {params.gcra_slots} GCRA slots, "
            f"{params.process_slots} process slots: {lay.total_size} bytes; largest: "
            + ", ".join(f"{name} {size / 2**20:.2f} MiB" for name, (_, size) in big)
        )
        rep.emit("segment_mib", lay.total_size / 2**20, "MiB", 2)
        rep.emit("python_loop_overhead_ns", min(loop_overhead_ns(10**6) for _ in range(3)), "ns")
        sys.stdout.flush()

        best, errors = measure(ctx, args.reps, args.scale)
        total_errors = sum(errors.values())
        for bench in BENCHES:
            n = _scaled(bench.n, args.scale)
            print(f"\n{bench.title}\n  ({bench.twin}; {n} ops per process)")
            for p in (1, 2):
                a, t = best[(bench.key, p, "atomics")], best[(bench.key, p, "twin")]
                rep.emit(f"{bench.key}_{p}p_atomics_ns", a, "ns")
                rep.emit(f"{bench.key}_{p}p_twin_ns", t, "ns")
                rep.emit(f"{bench.key}_{p}p_ratio", t / a, "x", 2)
            rep.emit(f"{bench.key}_errors", errors[bench.key], "", 0)

        elapsed = time.monotonic() - started
        print()
        rep.emit("run_seconds", elapsed, "s")
        misses = [k for k, v in rep.checks.items() if v == "MISS"]
        passed = len(rep.checks) - len(misses)
        print(
            f"targets: {passed}/{len(rep.checks)} PASS"
            + (f"; MISS: {', '.join(misses)}" if misses else "")
            + f"; consistency errors: {total_errors}"
        )
        print(json.dumps({**rep.figures, "checks": rep.checks}, sort_keys=False))
        return 1 if total_errors else 0
    except BenchError as e:
        print(f"bench_shm: {e}", file=sys.stderr)
        return 2
    finally:
        if slot is not None:
            with contextlib.suppress(Exception):
                slot.release()
        if made_sem:
            with contextlib.suppress(posix_ipc.ExistentialError):
                posix_ipc.unlink_semaphore(sem_name)
        if sem is not None:
            sem.close()
        if made_seg:
            segment.unlink(seg_name)
        if seg is not None:
            with contextlib.suppress(BufferError):
                seg.close()


if __name__ == "__main__":
    sys.exit(main())
