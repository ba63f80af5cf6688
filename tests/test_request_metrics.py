"""Request counts by source and status, histograms and blobs in a real segment, written by
real forked processes (one of them SIGKILLed mid-run)."""

from __future__ import annotations

import logging
import os
import signal
import time
from multiprocessing.synchronize import Event
from pathlib import Path

import pytest
from proc_helpers import CTX, Children, run_children

from ankusa_shm import overrides
from ankusa_shm.shm import histograms, procs, requests, snapshot
from ankusa_shm.shm import layout as L
from ankusa_shm.shm.blob import Blob, BlobTooLarge
from ankusa_shm.shm.histograms import Histogram, HistogramRow
from ankusa_shm.shm.requests import RequestRow
from ankusa_shm.shm.segment import Segment

MS = 1_000_000


def test_source_table_is_append_only_and_overflows_to_its_own_row(seg: Segment) -> None:
    table = seg.blob("sources")
    assert requests.assign(table, ["github", "stripe"]) == ["github", "stripe"]
    # A reload that drops github and adds shopify: github keeps its row, nothing moves.
    assert requests.assign(table, ["shopify", "stripe"]) == ["github", "stripe", "shopify"]
    rows = requests.source_rows(table, ["stripe", "shopify", "github"])
    assert rows == {"github": 2, "stripe": 3, "shopify": 4}
    room = L.SOURCE_ROWS - requests.FIRST_SOURCE_ROW
    many = [f"s{i}" for i in range(room)]
    names = requests.assign(table, many)
    assert len(names) == room
    assert requests.source_rows(table, ["s0", many[-1]])[many[-1]] == requests.OVERFLOW


def _count(i: int, name: str, n: int) -> int:
    with Segment.attach(name) as seg:
        slot = procs.claim(seg.view, seg.layout, procs.Role.WORKER)
        rows = requests.source_rows(seg.blob("sources"), ["github"])
        row = RequestRow(seg.view, seg.layout, slot.index)
        hist = HistogramRow(seg.view, seg.layout, slot.index)
        for k in range(n):
            row.add(rows["github"], 201 if k % 4 else 429)
            row.add(requests.UNROUTED, 404)
            hist.observe(Histogram.REQUEST, (k % 10) * MS)
        return slot.index


def test_rows_of_several_processes_sum_exactly(seg: Segment) -> None:
    requests.assign(seg.blob("sources"), ["github"])
    n = 4_000
    run_children(3, _count, seg.name, n)  # a slot freed by an early finisher may be reused
    snap = snapshot.take(seg)
    assert snap.requests == {
        ("github", "201"): 3 * n * 3 // 4,
        ("github", "429"): 3 * n // 4,
        ("", "404"): 3 * n,
    }
    t = snap.histograms[Histogram.REQUEST]
    assert t.count == 3 * n
    assert t.sum == 3 * sum((k % 10) * MS for k in range(n))
    # 0..9 ms, evenly: a tenth at 0 (bucket 0.25 ms), the median between 4 and 5 ms.
    assert t.cumulative()[0] == (0.00025, 3 * n // 10)
    median = t.quantile(0.5)
    assert median is not None and 0.0025 <= median <= 0.005


def _observe_until_killed(i: int, name: str, started: Event) -> None:
    with Segment.attach(name) as seg:
        slot = procs.claim(seg.view, seg.layout, procs.Role.WORKER)
        hist = HistogramRow(seg.view, seg.layout, slot.index)
        for _ in range(1_000):
            hist.observe(Histogram.COMMIT, 3 * MS)
        started.set()
        while True:
            hist.observe(Histogram.COMMIT, 3 * MS)


def test_a_killed_process_keeps_its_observations_and_its_slot_successor_adds(
    seg: Segment,
) -> None:
    started = CTX.Event()
    with Children() as kids:
        victim = kids.start(_observe_until_killed, 0, seg.name, started)
        assert started.wait(60)
        time.sleep(0.05)
        assert victim.pid is not None
        os.kill(victim.pid, signal.SIGKILL)
        victim.join(60)
    before = histograms.totals(seg.view, seg.layout)[Histogram.COMMIT]
    assert before.count >= 1_000
    # Killed between an observation's two fetch-adds, the last one is counted without its
    # value (seen once in the suite); nothing else may be lost.
    assert before.sum in (before.count * 3 * MS, (before.count - 1) * 3 * MS)
    # The dead process's slot is claimed again: the row is not zeroed, only added to.
    slot = procs.claim(seg.view, seg.layout, procs.Role.WORKER)
    HistogramRow(seg.view, seg.layout, slot.index).observe(Histogram.COMMIT, 3 * MS)
    after = histograms.totals(seg.view, seg.layout)[Histogram.COMMIT]
    assert after.count == before.count + 1


def test_values_land_in_the_first_bucket_at_or_above_them(seg: Segment) -> None:
    slot = procs.claim(seg.view, seg.layout, procs.Role.WORKER)
    hist = HistogramRow(seg.view, seg.layout, slot.index)
    for v in (1, 2, 3, 1024, 1025, 10**9):
        hist.observe(Histogram.BATCH, v)
    t = histograms.totals(seg.view, seg.layout)[Histogram.BATCH]
    counts = dict(zip([*Histogram.BATCH.bounds, "inf"], t.buckets, strict=True))
    assert (counts[1], counts[2], counts[4], counts[1024], counts["inf"]) == (1, 1, 1, 1, 2)
    assert t.quantile(1.0) == 1024.0  # in +Inf: reported as the largest finite bound
    assert histograms.totals(seg.view, seg.layout)[Histogram.REQUEST].quantile(0.5) is None


def _rewrite(i: int, name: str, rounds: int) -> int:
    with Segment.attach(name) as seg:
        blob = seg.blob("overrides")
        for k in range(rounds):
            overrides.publish(blob, {f"t{j}": (float(k), k + 1) for j in range(50)})
        return rounds


def test_a_blob_reader_never_sees_a_torn_document(seg: Segment) -> None:
    with Children() as kids:
        kids.start(_rewrite, 0, seg.name, 3_000)
        blob = seg.blob("overrides")
        seen = 0
        while kids.procs[0].is_alive() or not seen:
            doc = blob.read()
            if doc is None:
                continue
            rates = {rate for rate, _ in doc.values()}
            assert len(doc) == 50 and len(rates) == 1  # one write, whole
            seen += 1
        assert kids.collect() == [3_000]
    assert blob.generation() == 2 * 3_000
    assert overrides.read(blob)["t0"].burst == 3_000


def test_blob_refuses_what_does_not_fit_and_reads_none_before_any_write(seg: Segment) -> None:
    blob = Blob(seg.view, seg.buf, seg.layout, "sources")
    assert blob.read() is None
    with pytest.raises(BlobTooLarge):
        blob.write(["x" * blob.capacity])
    assert blob.read() is None and blob.generation() == 0


def test_an_override_that_does_not_validate_is_left_out(seg: Segment) -> None:
    blob = seg.blob("overrides")
    blob.write({"good": [5, 10], "zero": [0, 10], "junk": "x"})
    got = overrides.read(blob)
    assert list(got) == ["good"] and got["good"].burst == 10


def test_overrides_of_a_store_without_its_tables_yet_are_none_and_quiet(
    seg: Segment, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A worker creates the store's file, then its tables: a publisher that reads in
    between found 'no such table' and warned at start. Nothing can be stored there yet."""
    store = tmp_path / "hooks.db"
    store.touch()
    blob = seg.blob("overrides")
    with caplog.at_level(logging.WARNING, logger="ankusa_shm.overrides"):
        overrides.publish_stored(blob, str(store))
    assert caplog.records == [] and blob.read() is None
    store.write_bytes(b"not a database, and longer than a header" * 100)
    with caplog.at_level(logging.WARNING, logger="ankusa_shm.overrides"):
        overrides.publish_stored(blob, str(store))
    assert "tenant overrides not published" in caplog.text  # a damaged one still is said
