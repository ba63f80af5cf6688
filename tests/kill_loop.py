"""The settle queue under fire: real producers, consumers SIGKILLed at random, hundreds of times.

Producers push numbered records and remember which pushes returned OK. Consumers are
forked one after another; each reports every batch it peeks down a pipe *before* it
commits it (the drainer's order: deliver, then free), and is SIGKILLed after a random
while -- or, for some, by itself from inside ``commit`` at a chosen slot. Optionally a few
"victim" producers are SIGKILLed between reserving a slot and publishing it. At the end
the test process drains what is left itself, and the tally says what a real drainer
would have lost: records told OK and never delivered, records delivered twice (allowed:
their consumer died before committing them), abandoned slots counted.

Pipe writes of at most ``PIPE_BUF`` bytes are atomic, and SIGKILL cannot split one: a
report is in the pipe whole or not at all.
"""

from __future__ import annotations

import itertools
import os
import random
import select
import signal
import struct
import time
from dataclasses import dataclass, field
from multiprocessing.synchronize import Event

from proc_helpers import CTX, Children

from ankusa_shm.shm import settle_queue
from ankusa_shm.shm.segment import Segment
from ankusa_shm.shm.settle_queue import Op, Pushed, Record, SettleQueue

BATCH = 64  # 64 reports of 5 bytes: far below PIPE_BUF
PRODUCERS = 2
VICTIM = 100  # victims are producers 100, 101, ...
CORRUPT = 255

FRAME = struct.Struct("<cH")  # kind, count; then ``count`` deliveries for b"D"
DELIVERY = struct.Struct("<BI")  # producer (CORRUPT: the record did not read back), seq


def rec(seq: int, producer: int = 0, *, key: bytes | None = None, op: Op = Op.PROMOTE) -> Record:
    """A record that says who pushed it, and which of that producer's it is."""
    return Record(
        op=op,
        key=key if key is not None else b"ankusa:{acme}:dd:github:%d" % seq,
        token=seq.to_bytes(8, "little") + producer.to_bytes(8, "little"),
        hook_id=b"%d:%d" % (producer, seq),
        ttl_ms=259_200_000,
        claimed_ms=seq,
        enqueued_ms=seq + 1,
    )


def origin(r: Record) -> tuple[int, int]:
    producer, seq = r.hook_id.split(b":")
    return int(producer), int(seq)


def _now_ms() -> int:
    return time.monotonic_ns() // 1_000_000


def _produce(i: int, name: str, stop: Event) -> tuple[int, list[int], int]:
    """Push records 0, 1, 2, ... until told to stop, each retried until the ring takes it.
    Returns how many were pushed, those told ABANDONED, and how often depth was seen above
    capacity."""
    seq, over, abandoned = 0, 0, list[int]()
    with Segment.attach(name) as s:
        q = SettleQueue(s.view, s.buf, s.layout)
        for attempt in itertools.count(1):
            if attempt % 64 == 0 and stop.is_set():
                break
            result = q.push(rec(seq, i))
            if result is Pushed.FULL:
                time.sleep(0.0005)
                continue
            if result is Pushed.ABANDONED:
                abandoned.append(seq)
            over += q.depth() > q.capacity
            seq += 1
            if seq % 32 == 0:
                time.sleep(0.001)  # a steady stream, not a spin: this machine is shared
    return seq, abandoned, over


def die_in_commit(die_at: int) -> None:
    """From now on in this process, SIGKILL itself inside ``commit``, just before freeing
    the ``die_at``-th slot it frees (counting from 0)."""
    freed = itertools.count()

    def die(pos: int) -> None:
        if next(freed) == die_at:
            os.kill(os.getpid(), signal.SIGKILL)

    settle_queue._pause_in_commit = die


def _consume(name: str, fd: int, grace_ms: int, die_at: int | None) -> None:
    """Report each batch, then commit it, until SIGKILLed (see ``die_in_commit``)."""
    if die_at is not None:
        die_in_commit(die_at)
    with Segment.attach(name) as s:
        q = SettleQueue(s.view, s.buf, s.layout, grace_ms=grace_ms)
        q.become_consumer()
        os.write(fd, FRAME.pack(b"R", 0))
        while True:
            batch, skipped = q.peek(BATCH, _now_ms())
            if skipped:
                os.write(fd, FRAME.pack(b"A", skipped))
            if not batch.records:
                time.sleep(0.001)
                continue
            report = bytearray(FRAME.pack(b"D", len(batch.records)))
            for r in batch.records:
                p, seq = origin(r)
                report += DELIVERY.pack(p if r == rec(seq, p) else CORRUPT, seq)
            os.write(fd, report)
            q.commit(batch)


def _reserve_and_die(name: str, reserved: Event, who: int) -> None:
    def hang() -> None:
        reserved.set()
        time.sleep(3600)  # until SIGKILL

    settle_queue._pause_after_reserve = hang
    with Segment.attach(name) as s:
        q = SettleQueue(s.view, s.buf, s.layout)
        while q.push(rec(0, who)) is Pushed.FULL:
            time.sleep(0.001)


@dataclass
class Tally:
    kills: int = 0
    killed_in_commit: int = 0  # consumers that SIGKILLed themselves inside commit
    victims: int = 0  # producers SIGKILLed between reserving and publishing
    told_ok: int = 0
    told_abandoned: int = 0  # pushes answered ABANDONED (a producer stalled past grace)
    lost: int = 0  # told OK, never delivered
    phantom: int = 0  # delivered, never told OK
    corrupt: int = 0
    redelivered: int = 0
    abandoned: int = 0  # slots the consumers skipped as abandoned
    depth_over_capacity: int = 0
    damaged: int = 0  # times the ring, its consumer just killed, failed SettleQueue.check
    # producer -> deliveries of each of its seqs (a bytearray indexed by seq: millions fit)
    delivered: dict[int, bytearray] = field(default_factory=dict)

    def deliver(self, producer: int, seq: int) -> None:
        counts = self.delivered.setdefault(producer, bytearray())
        if seq >= len(counts):
            counts.extend(bytes(seq + 1 - len(counts) + 65_536))
        counts[seq] = min(255, counts[seq] + 1)

    def settle(self, results: list[tuple[int, list[int], int]]) -> None:
        """Compare what each producer was told with what was delivered."""
        for p in set(self.delivered) | set(range(len(results))):
            n, abandoned, over = results[p] if p < len(results) else (0, [], 0)
            counts = self.delivered.get(p, bytearray()).ljust(n, b"\0")
            told = bytearray(b"\1" * n)
            for seq in abandoned:
                told[seq] = 0
            self.told_ok += n - len(abandoned)
            self.told_abandoned += len(abandoned)
            self.depth_over_capacity += over
            told.extend(bytes(len(counts) - n))  # past n: told nothing
            self.lost += sum(1 for t, c in zip(told, counts, strict=True) if t and not c)
            self.phantom += sum(1 for t, c in zip(told, counts, strict=True) if c and not t)
            self.redelivered += sum(c - 1 for c in counts if c > 1)

    def figures(self) -> dict[str, int]:
        return {k: v for k, v in vars(self).items() if isinstance(v, int)}


class _Reports:
    """The consumers' end of the pipe, parsed as it arrives."""

    def __init__(self, fd: int, tally: Tally) -> None:
        self._fd, self._tally, self._buf = fd, tally, bytearray()
        self.ready = 0

    def pump(self, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while True:
            left = deadline - time.monotonic()
            if select.select([self._fd], [], [], max(0.0, left))[0]:
                self._buf += os.read(self._fd, 1 << 16)
                self._parse()
            if left <= 0:
                return

    def _parse(self) -> None:
        buf, t = self._buf, self._tally
        at = 0
        while len(buf) - at >= FRAME.size:
            kind, n = FRAME.unpack_from(buf, at)
            size = FRAME.size + (n * DELIVERY.size if kind == b"D" else 0)
            if len(buf) - at < size:
                break
            if kind == b"R":
                self.ready += 1
            elif kind == b"A":
                t.abandoned += n
            for j in range(n if kind == b"D" else 0):
                p, seq = DELIVERY.unpack_from(buf, at + FRAME.size + j * DELIVERY.size)
                t.corrupt += p == CORRUPT
                t.deliver(p, seq)
            at += size
        del buf[:at]


def run(seg: Segment, kills: int, victims: int = 0, grace_ms: int = 500, seed: int = 0) -> Tally:
    """Kill ``kills`` consumers while producers push -- one in three from inside commit,
    the others after a random while -- and ``victims`` producers mid-push; then drain,
    and tally."""
    rng = random.Random(seed)
    victim_at = set(rng.sample(range(kills), victims))
    tally = Tally()
    r, w = os.pipe()
    reports = _Reports(r, tally)
    cap = seg.layout.params.queue_capacity
    q = SettleQueue(seg.view, seg.buf, seg.layout, grace_ms=grace_ms)
    try:
        with Children() as producers, Children() as others:
            stop = CTX.Event()
            for p in range(PRODUCERS):
                producers.start(_produce, p, seg.name, stop)
            for i in range(kills):
                in_commit = i % 3 == 0 and i not in victim_at
                die_at = rng.randrange(3 * BATCH) if in_commit else None
                c = others.start(_consume, seg.name, w, grace_ms, die_at)
                ready = reports.ready
                deadline = time.monotonic() + 60
                while reports.ready == ready:
                    # One set to die in commit may report, commit and die between two looks:
                    # whatever it sent before dying is in the pipe for the pump after.
                    alive = c.is_alive()
                    reports.pump(0.005)
                    started = reports.ready != ready
                    assert started or (alive and time.monotonic() < deadline), (
                        f"consumer did not start (exit status {c.exitcode})"
                    )
                if i in victim_at:  # while a consumer runs: the ring has room to reserve in
                    reserved = CTX.Event()
                    v = others.start(_reserve_and_die, seg.name, reserved, VICTIM + tally.victims)
                    while not reserved.is_set():
                        assert time.monotonic() < deadline, "a victim never reserved a slot"
                        reports.pump(0.005)
                    v.kill()
                    v.join(60)
                    tally.victims += 1
                if in_commit:
                    while c.is_alive():
                        assert time.monotonic() < deadline, "consumer never died in commit"
                        reports.pump(0.005)
                    tally.killed_in_commit += 1
                else:  # a few ms; with victims, now and then long enough to abandon one
                    long = victims and i % 5 == 4
                    reports.pump(1.5 * grace_ms / 1000 if long else rng.uniform(0, 0.02))
                tally.depth_over_capacity += q.depth() > cap
                c.kill()
                c.join(60)
                assert c.exitcode == -signal.SIGKILL, f"consumer exited with {c.exitcode}"
                tally.damaged += q.check() is not None  # what a re-attaching owner checks
                tally.kills += 1
            stop.set()
            results = producers.collect()
            producers.join()
        reports.pump(0)
        _drain_rest(q, tally)
    finally:
        os.close(r)
        os.close(w)
    tally.settle(results)
    return tally


def _drain_rest(q: SettleQueue, tally: Tally) -> None:
    """Consume here until the ring is empty (waiting out the grace period of any slot a
    dead producer left)."""
    q.become_consumer()
    deadline = time.monotonic() + 120
    while True:
        batch, skipped = q.peek(BATCH, _now_ms())
        tally.abandoned += skipped
        for r in batch.records:
            p, seq = origin(r)
            tally.corrupt += r != rec(seq, p)
            tally.deliver(p, seq)
        q.commit(batch)
        if not batch.records:
            if q.depth() == 0:
                return
            assert time.monotonic() < deadline, f"{q.depth()} records never came out"
            time.sleep(0.001)
