"""The C extension: checked offsets, read-only and released views, real atomicity, and
its stat() that keeps the GIL."""

from __future__ import annotations

import bisect
import mmap
import os
import random
import threading
import time
import zlib
from collections.abc import Iterator
from multiprocessing.synchronize import Barrier
from pathlib import Path
from typing import Any, cast

import pytest
from proc_helpers import CTX, run_children

from ankusa_shm._atomics import AtomicView, crc32, file_ids
from ankusa_shm.limits import MAX_SPAN_US
from ankusa_shm.shm import layout as L
from ankusa_shm.shm.segment import Segment

N_PROCS = 4
M_OPS = 100_000


@pytest.fixture
def page() -> Iterator[mmap.mmap]:
    mm = mmap.mmap(-1, 4096)  # page aligned, so offsets and addresses agree on alignment
    yield mm
    mm.close()


def test_load_store_add_cas(page: mmap.mmap) -> None:
    v = AtomicView(page)
    assert v.writable and v.size == 4096
    assert v.load(8) == 0
    v.store(8, -5)
    assert v.load(8) == -5
    assert v.add(8, 7) == -5  # fetch-add returns the previous value
    assert v.load(8) == 2
    assert v.cas(8, 3, 10) is False
    assert v.load(8) == 2
    assert v.cas(8, 2, 10) is True
    assert v.load(8) == 10
    v.store(4088, 2**63 - 1)  # the last word, full int64 range
    assert v.load(4088) == 2**63 - 1
    assert int.from_bytes(page[4088:4096], "little", signed=True) == 2**63 - 1
    assert v.load(0) == 0 and v.load(16) == 0  # neighbours untouched
    v.release()


@pytest.mark.parametrize("offset", [1, 3, 4, 7, 9, 4087])
def test_misaligned_offsets_raise_value_error(page: mmap.mmap, offset: int) -> None:
    v = AtomicView(page)
    with pytest.raises(ValueError, match="aligned"):
        v.load(offset)
    with pytest.raises(ValueError, match="aligned"):
        v.store(offset, 1)
    with pytest.raises(ValueError, match="aligned"):
        v.add(offset, 1)
    with pytest.raises(ValueError, match="aligned"):
        v.cas(offset, 0, 1)
    assert bytes(page) == bytes(4096)  # nothing was touched
    v.release()


@pytest.mark.parametrize("offset", [-8, -1, 4089, 4096, 4104, 1 << 40])
def test_out_of_range_offsets_raise_index_error(page: mmap.mmap, offset: int) -> None:
    v = AtomicView(page)
    with pytest.raises(IndexError):
        v.load(offset)
    with pytest.raises(IndexError):
        v.store(offset, 1)
    with pytest.raises(IndexError):
        v.add(offset, 1)
    with pytest.raises(IndexError):
        v.cas(offset, 0, 1)
    assert bytes(page) == bytes(4096)
    v.release()


def test_alignment_is_of_the_address_not_the_offset(page: mmap.mmap) -> None:
    shifted = memoryview(page)[4:]
    v = AtomicView(shifted)
    with pytest.raises(ValueError, match="aligned"):
        v.load(0)
    v.store(4, 7)  # address page+8
    assert int.from_bytes(page[8:16], "little") == 7
    # The hot routines too: they took an aligned offset for an aligned word.
    for call in (lambda: v.observe(0, (), 7), lambda: v.breaker_window(0, 1, 0)):
        with pytest.raises(ValueError, match="misaligned"):
            call()
    v.release()
    shifted.release()


def test_bad_arguments(page: mmap.mmap) -> None:
    v = AtomicView(page)
    with pytest.raises(TypeError):
        v.load("8")  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        v.store(8)  # type: ignore[call-arg]
    with pytest.raises(OverflowError):
        v.store(8, 2**63)  # not an int64: refused, not truncated
    assert v.load(8) == 0
    with pytest.raises(IndexError):
        v.load(2**70)  # an offset beyond any buffer is out of range, whatever its size
    # A limit beyond the table's span (limits.Limit.of refuses it first) would overflow
    # the GCRA's arithmetic: refused here as well, writing nothing.
    for interval, span in ((MAX_SPAN_US + 1, 1), (1, MAX_SPAN_US + 1), (1, -1)):
        with pytest.raises(ValueError, match="bad limit"):
            v.gcra_take(0, 4, 4, 1, 1, interval, span, 1_000)
    assert bytes(page[:256]) == bytes(256)
    v.release()


def test_breaker_window_sums_only_what_lies_in_the_window(page: mmap.mmap) -> None:
    """The C sum over bucket words (breaker.py's format): valid buckets less than n epochs
    old, or ahead of the reader's epoch, count; stale and empty ones do not."""
    v = AtomicView(page)

    def bucket(epoch: int, failures: int, calls: int) -> int:
        return L.BK_VALID | epoch << L.BK_EPOCH_SHIFT | failures << L.BK_FAIL_SHIFT | calls

    v.store(64, bucket(100, 1, 5))  # now
    v.store(72, bucket(97, 2, 3))  # 3 epochs old: in a 4-bucket window
    v.store(80, bucket(96, 7, 7))  # 4 old: out
    v.store(88, bucket(101, 1, 1))  # ahead of the reader's clock: in
    assert v.breaker_window(64, 4, 100) == (9, 4)
    v.store(88, 0)  # empty
    assert v.breaker_window(64, 4, 100) == (8, 3)
    assert v.breaker_window(64, 4, 100 + (L.BK_EPOCH_MASK + 1)) == (8, 3)  # epochs wrap
    with pytest.raises(ValueError):
        v.breaker_window(64, 2**40, 0)  # buckets beyond the buffer
    with pytest.raises(ValueError):
        v.breaker_window(60, 1, 0)  # misaligned
    v.release()
    with pytest.raises(ValueError):
        v.breaker_window(64, 4, 0)


def test_observe_is_bisect_left_plus_a_sum(page: mmap.mmap) -> None:
    v = AtomicView(page)
    bounds = (1, 2, 4, 8, 16)
    rng = random.Random(7)
    values = [rng.randrange(-3, 40) for _ in range(2_000)] + [1, 2, 16, 17]
    for x in values:
        v.observe(64, bounds, x)
    want = [0] * (len(bounds) + 1)
    for x in values:
        want[bisect.bisect_left(bounds, x)] += 1
    assert [v.load(64 + 8 * i) for i in range(len(bounds) + 1)] == want
    assert v.load(64 + 8 * (len(bounds) + 1)) == sum(values)  # the sum word after the buckets
    assert v.load(56) == 0 and v.load(64 + 8 * (len(bounds) + 2)) == 0  # nothing else
    with pytest.raises(ValueError):
        v.observe(4096 - 8 * (len(bounds) + 1), bounds, 1)  # the sum would be past the end
    with pytest.raises(ValueError):
        v.observe(4, bounds, 1)
    with pytest.raises(TypeError):
        v.observe(64, [1, 2], 1)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        AtomicView(bytes(4096)).observe(64, bounds, 1)


def test_crc32_is_zlibs_over_the_bytes_in_place() -> None:
    data = random.Random(7).randbytes(1024)
    for start in range(17):  # every alignment, and lengths around each eight-byte step
        for length in [*range(40), 141, 1024 - start]:
            end = start + length
            assert crc32(data, start, end) == zlib.crc32(data[start:end])
    for start, end in ((-1, 1), (0, 1025), (5, 4), (1025, 1025)):
        with pytest.raises(IndexError):
            crc32(data, start, end)
    with pytest.raises(TypeError):
        crc32(bytearray(data), 0, 1)  # type: ignore[arg-type]


def test_read_only_buffer_refuses_writes() -> None:
    data = bytes(range(64))
    v = AtomicView(data)
    assert v.writable is False
    assert v.load(0) == int.from_bytes(data[:8], "little", signed=True)
    with pytest.raises(TypeError, match="read-only"):
        v.store(0, 1)
    with pytest.raises(TypeError, match="read-only"):
        v.add(0, 1)
    with pytest.raises(TypeError, match="read-only"):
        v.cas(0, v.load(0), 1)
    assert data == bytes(range(64))
    v.release()


def test_released_view_raises_and_frees_the_mapping() -> None:
    mm = mmap.mmap(-1, 4096)
    v = AtomicView(mm)
    with pytest.raises(BufferError):
        mm.close()  # the view holds a buffer export: the mapping cannot vanish under it
    v.release()
    assert v.size == 0
    for call in (lambda: v.load(0), lambda: v.store(0, 1), lambda: v.add(0, 1)):
        with pytest.raises(ValueError, match="released"):
            call()
    with pytest.raises(ValueError, match="released"):
        v.cas(0, 0, 1)
    v.release()  # twice is fine
    mm.close()  # the export is gone


def _fetch_add(i: int, name: str, offset: int, m: int, start: Barrier) -> int:
    with Segment.attach(name) as s:
        start.wait(60)  # all at once, so the adds really contend
        for _ in range(m):
            s.view.add(offset, 1)
    return i


def test_fetch_add_across_processes_loses_nothing(seg: Segment) -> None:
    word = seg.layout.offset("gcra")  # any aligned word nobody else touches here
    run_children(N_PROCS, _fetch_add, seg.name, word, M_OPS, CTX.Barrier(N_PROCS))
    assert seg.view.load(word) == N_PROCS * M_OPS


def _cas_increment(i: int, name: str, offset: int, m: int, start: Barrier) -> int:
    retries = 0
    with Segment.attach(name) as s:
        v = s.view
        start.wait(60)
        for _ in range(m):
            while True:
                old = v.load(offset)
                if v.cas(offset, old, old + 1):
                    break
                retries += 1
    return retries


def test_cas_loop_across_processes_loses_nothing(seg: Segment) -> None:
    word = seg.layout.offset("gcra") + 128
    run_children(N_PROCS, _cas_increment, seg.name, word, M_OPS // 4, CTX.Barrier(N_PROCS))
    assert seg.view.load(word) == N_PROCS * (M_OPS // 4)


def _raise_then_wake(name: str, offset: int, value: int) -> None:
    seg = Segment.attach(name)
    try:
        time.sleep(0.05)  # the parent is asleep in wait_at_least by now, most likely
        seg.view.store(offset, value)
        seg.view.wake(offset)
    finally:
        seg.close()


def test_wait_at_least_sleeps_until_another_process_raises_the_word(seg: Segment) -> None:
    at = seg.layout.offset("store") + L.ST_SERVING
    seg.view.store(at, 4)
    assert seg.view.wait_at_least(at, 4, 0) is True  # already there: no sleep
    began = time.monotonic()
    assert seg.view.wait_at_least(at, 5, 30_000_000) is False  # nobody raises it
    assert time.monotonic() - began >= 0.03
    child = CTX.Process(target=_raise_then_wake, args=(seg.name, at, 7))
    child.start()
    try:
        assert seg.view.wait_at_least(at, 6, 60_000_000_000) is True
        assert seg.view.load(at) == 7
    finally:
        child.join(60)
    assert child.exitcode == 0


def test_a_view_with_a_waiter_cannot_be_released(page: mmap.mmap) -> None:
    """wait_at_least sleeps without the GIL on the buffer: releasing it meanwhile would
    unmap the word under the sleeper."""
    v = AtomicView(page)
    seen: list[BaseException] = []

    def meanwhile() -> None:
        time.sleep(0.5)  # the main thread went straight into its wait
        try:
            v.release()
        except BaseException as e:
            seen.append(e)
        v.store(8, 1)
        v.wake(8)

    helper = threading.Thread(target=meanwhile)
    helper.start()
    assert v.wait_at_least(8, 1, 60_000_000_000) is True
    helper.join(60)
    assert len(seen) == 1 and isinstance(seen[0], BufferError)
    v.release()
    assert v.size == 0


def test_no_argument_can_pull_the_buffer_from_under_a_call() -> None:
    """An argument's ``__index__`` runs Python code: converted after the word's address
    was taken, it could release the view and unmap the page (a segfault on the store),
    or point the view at a smaller buffer (a write past it); nor may a view be pointed
    elsewhere while a thread sleeps on its word without the GIL."""
    mm = mmap.mmap(-1, 4096)
    v = AtomicView(mm)

    class Releases:
        def __index__(self) -> int:
            v.release()
            mm.close()
            return 5

    releases: Any = Releases()  # passed where an int is due, as no caller of ours would
    for call in (lambda: v.store(0, releases), lambda: v.add(0, releases)):
        with pytest.raises(ValueError, match="released"):
            call()
    small = bytearray(16)
    w = AtomicView(mmap.mmap(-1, 4096))

    class Shrinks:
        def __index__(self) -> int:
            w.__init__(small)  # type: ignore[misc]
            return 1

    with pytest.raises(TypeError, match="tuple of ints"):
        w.observe(4000, (cast(int, Shrinks()),), 5)
    assert small == bytearray(16)
    waited = AtomicView(mmap.mmap(-1, 4096))
    sleeper = threading.Thread(target=lambda: waited.wait_at_least(0, 1, 2_000_000_000))
    sleeper.start()
    time.sleep(0.2)
    with pytest.raises(BufferError, match="waiter"):
        waited.__init__(bytearray(8))  # type: ignore[misc]
    waited.store(0, 1)
    waited.wake(0)
    sleeper.join(10)


def test_file_ids_are_stat_s_device_and_inode(tmp_path: Path) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    a.write_bytes(b"")
    b.write_bytes(b"")
    ids = file_ids(str(a), str(b))
    assert ids == tuple((os.stat(p).st_dev, os.stat(p).st_ino) for p in (a, b))
    assert file_ids(str(a), str(tmp_path / "missing")) is None
    assert file_ids(str(a / "under-a-file")) is None  # ENOTDIR: missing too
    with open(b, "rb"):  # held open, as a store's connection holds its files
        b.unlink()
        b.write_bytes(b"")  # the same name, another file
        assert file_ids(str(a), str(b)) != ids
    with pytest.raises(TypeError):
        file_ids(3)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        file_ids("nul\0byte")
