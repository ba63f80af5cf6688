"""Creating, attaching to, validating, re-attaching and replacing the segment."""

from __future__ import annotations

import logging
import mmap
import os
import secrets
from pathlib import Path

import posix_ipc
import pytest
from conftest import SMALL, cannot_run
from proc_helpers import Children, dead_pid, live_pid, reused_pid, run_children

from ankusa_shm.shm import layout as L
from ankusa_shm.shm import pids
from ankusa_shm.shm import segment as segmod
from ankusa_shm.shm.segment import (
    CorruptSegment,
    ForeignSegment,
    LayoutMismatch,
    Segment,
    SegmentDenied,
    SegmentError,
    SegmentInUse,
    SegmentMissing,
)
from ankusa_shm.shm.settle_queue import Op, Record, SettleQueue


def _raw_segment(name: str, data: bytes) -> None:
    """A segment of exactly ``data`` that no ankusa-shm code wrote."""
    shm = posix_ipc.SharedMemory("/" + name, posix_ipc.O_CREX, mode=0o600, size=len(data))
    try:
        with mmap.mmap(shm.fd, len(data)) as mm:
            mm[:] = data
    finally:
        shm.close_fd()


def _records(n: int) -> list[Record]:
    return [
        Record(
            op=Op.PROMOTE if i % 2 else Op.RELEASE,
            key=f"ankusa:{{acme}}:dd:github:{i}".encode(),
            token=i.to_bytes(16, "little"),
            hook_id=f"hook-{i}".encode(),
            ttl_ms=1000 + i,
            claimed_ms=2000 + i,
            enqueued_ms=3000 + i,
        )
        for i in range(n)
    ]


def _push(seg: Segment, records: list[Record]) -> None:
    q = SettleQueue(seg.view, seg.buf, seg.layout)
    for r in records:
        assert q.push(r).value == "ok"


def test_create_is_private_ready_and_self_describing(seg: Segment, seg_name: str) -> None:
    assert os.stat("/dev/shm/" + seg_name).st_mode & 0o777 == 0o600
    h = seg.header()
    assert h.version == L.LAYOUT_VERSION
    assert h.ready
    assert h.owner_pid == os.getpid()
    assert h.owner_start == pids.my_start() > 0
    assert h.params == SMALL
    assert h.total_size == seg.layout.total_size == os.stat("/dev/shm/" + seg_name).st_size
    assert seg.view.load(L.H_MAGIC) == L.MAGIC
    assert seg.queue_depth() == 0


def test_create_ignores_a_permissive_umask(seg_name: str) -> None:
    old = os.umask(0)
    try:
        with Segment.create(seg_name, SMALL):
            assert os.stat("/dev/shm/" + seg_name).st_mode & 0o777 == 0o600
    finally:
        os.umask(old)


def test_create_refuses_an_existing_name(seg: Segment) -> None:
    with pytest.raises(SegmentError, match="already exists"):
        Segment.create(seg.name, SMALL)


def test_attach_missing(seg_name: str) -> None:
    with pytest.raises(SegmentMissing, match=seg_name):
        Segment.attach(seg_name)
    with pytest.raises(SegmentMissing):
        Segment.attach(seg_name, readonly=True)


@pytest.mark.parametrize("name", ["", "/", "a/b", "x" * 251])
def test_invalid_names(name: str) -> None:
    with pytest.raises(SegmentError, match="invalid segment name"):
        Segment.attach(name)


def test_attach_garbage_is_foreign(seg_name: str) -> None:
    data = secrets.token_bytes(8192)
    if data[:8] == L.MAGIC.to_bytes(8, "little"):  # pragma: no cover - 2**-64
        data = bytes(8) + data[8:]
    _raw_segment(seg_name, data)
    with pytest.raises(ForeignSegment, match="bad magic"):
        Segment.attach(seg_name)
    with pytest.raises(ForeignSegment):
        Segment.attach(seg_name, readonly=True)


@pytest.mark.parametrize("size", [8, 1000, L.HEADER_BYTES - 8])
def test_attach_truncated_is_foreign(seg_name: str, size: int) -> None:
    _raw_segment(seg_name, L.MAGIC.to_bytes(8, "little") + bytes(size - 8))
    with pytest.raises(ForeignSegment, match="too small"):
        Segment.attach(seg_name)


def test_attach_another_layout_version(seg: Segment) -> None:
    with Segment.attach(seg.name) as w:
        w.view.store(L.H_VERSION, L.LAYOUT_VERSION + 1)
    with pytest.raises(LayoutMismatch, match=f"layout version {L.LAYOUT_VERSION + 1}"):
        Segment.attach(seg.name)
    with pytest.raises(LayoutMismatch):
        Segment.attach(seg.name, readonly=True)


@pytest.mark.parametrize(
    ("param", "named"),
    [
        ("counters", "counters"),
        ("statuses", "status columns"),
        ("histogram_words", "histogram words"),
    ],
)
def test_attach_another_builds_rows(seg: Segment, param: str, named: str) -> None:
    """Counters, status columns and histograms are the build's: another build's segment
    is refused by name, not read as if its rows meant ours."""
    seg.view.store(L.param_offsets()[param], getattr(SMALL, param) + 1)
    with pytest.raises(LayoutMismatch, match=f"{getattr(SMALL, param) + 1} {named}; this build"):
        Segment.attach(seg.name)


@pytest.mark.parametrize("region", L.REGIONS)
def test_attach_altered_region_table(seg: Segment, region: str) -> None:
    o_off, o_size = L.region_offsets(region)
    seg.view.add(o_off, L.LINE)
    with pytest.raises(CorruptSegment, match=repr(region)):
        Segment.attach(seg.name)
    seg.view.add(o_off, -L.LINE)
    seg.view.add(o_size, -L.LINE)
    with pytest.raises(CorruptSegment, match=repr(region)):
        Segment.attach(seg.name, readonly=True)
    seg.view.add(o_size, L.LINE)
    Segment.attach(seg.name).close()  # restored: whole again


def test_attach_header_contradicting_its_size(seg: Segment, seg_name: str) -> None:
    seg.view.store(L.H_TOTAL_SIZE, seg.layout.total_size + 4096)
    with pytest.raises(CorruptSegment):
        Segment.attach(seg_name)
    seg.view.store(L.H_TOTAL_SIZE, seg.layout.total_size)
    seg.view.store(L.param_offsets()["queue_capacity"], 0)
    with pytest.raises(CorruptSegment, match="queue_capacity"):
        Segment.attach(seg_name)


def test_attach_truncated_real_segment(seg: Segment, seg_name: str) -> None:
    shm = posix_ipc.SharedMemory("/" + seg_name)
    try:
        os.ftruncate(shm.fd, L.HEADER_BYTES)  # the header survives, the regions do not
    finally:
        shm.close_fd()
    with pytest.raises(CorruptSegment, match="bytes"):
        Segment.attach(seg_name)


def test_attach_never_ready(seg: Segment, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(segmod, "_READY_WAIT_S", 0.1)
    seg.view.store(L.H_READY, 0)
    with pytest.raises(CorruptSegment, match="never became ready"):
        Segment.attach(seg.name)


def test_read_only_attach_reads_live_and_cannot_write(seg: Segment) -> None:
    with Segment.attach(seg.name, readonly=True) as r:
        assert r.readonly
        assert r.view.writable is False
        assert r.header() == seg.header()
        word = seg.layout.offset("gcra")
        seg.view.store(word, 42)
        assert r.view.load(word) == 42  # one mapping of the same memory
        with pytest.raises(TypeError):
            r.view.store(word, 1)
        with pytest.raises(TypeError):
            r.view.add(word, 1)
        with pytest.raises(TypeError):
            r.view.cas(word, 42, 1)
        with pytest.raises(TypeError):
            r.buf[word] = 1
        assert seg.view.load(word) == 42


def test_open_for_owner_creates_when_missing(seg_name: str) -> None:
    with Segment.open_for_owner(seg_name, SMALL) as s:
        assert s.header().owner_pid == os.getpid()
        assert s.header().params == SMALL


def test_open_for_owner_reattaches_and_keeps_the_queue(seg: Segment) -> None:
    records = _records(5)
    _push(seg, records)
    seg.write_config({"hello": "world"})
    created = seg.header().created_ns
    gone = dead_pid()
    seg.view.store(L.H_OWNER_PID, gone)
    seg.close()

    with Segment.open_for_owner(seg.name, SMALL) as s:
        h = s.header()
        assert h.owner_pid == os.getpid()
        assert h.created_ns == created  # the same segment, not a new one
        assert s.queue_depth() == 5
        q = SettleQueue(s.view, s.buf, s.layout)
        q.become_consumer()
        batch, skipped = q.peek(100, now_ms=0)
        assert skipped == 0
        assert batch.records == records
        assert s.read_config() == {"hello": "world"}


def test_open_for_owner_rebuilds_a_damaged_queue_and_keeps_its_records(
    seg: Segment, caplog: pytest.LogCaptureFixture
) -> None:
    records = _records(4)
    _push(seg, records)
    created = seg.header().created_ns
    seg.view.store(seg.layout.offset("queue") + L.Q_ENQUEUE, 10**12)  # a stray write
    seg.view.store(L.H_OWNER_PID, dead_pid())
    seg.close()
    with caplog.at_level(logging.WARNING, logger="ankusa_shm.segment"):
        s = Segment.open_for_owner(seg.name, SMALL)
    with s:
        assert s.header().created_ns == created  # repaired in place, not replaced
        assert s.queue_depth() == 4
        q = SettleQueue(s.view, s.buf, s.layout)
        q.become_consumer()
        batch, skipped = q.peek(100, now_ms=0)
        assert (batch.records, batch.corrupt, batch.corrupt_skipped, skipped) == (records, 0, 0, 0)
    assert "settle queue was damaged" in caplog.text
    assert "rebuilt with the 4 queued operations" in caplog.text


def test_open_for_owner_replaces_other_params(
    seg: Segment, caplog: pytest.LogCaptureFixture
) -> None:
    _push(seg, _records(3))
    seg.view.store(L.H_OWNER_PID, dead_pid())
    seg.close()
    other = segmod.make_params(queue_capacity=512, gcra_slots=1024, process_slots=64)
    with caplog.at_level(logging.WARNING, logger="ankusa_shm.segment"):
        s = Segment.open_for_owner(seg.name, other)
    with s:
        assert s.header().params == other
        assert s.queue_depth() == 0
        assert s.header().owner_pid == os.getpid()
    assert "its 3 queued settle operations dropped" in caplog.text


def test_a_re_attached_segment_is_made_0600_again(
    seg: Segment, seg_name: str, caplog: pytest.LogCaptureFixture
) -> None:
    seg.view.store(L.H_OWNER_PID, dead_pid())
    os.chmod(f"/dev/shm/{seg_name}", 0o644)
    with caplog.at_level(logging.WARNING, logger="ankusa_shm.segment"):
        Segment.open_for_owner(seg_name, seg.header().params).close()
    assert os.stat(f"/dev/shm/{seg_name}").st_mode & 0o777 == 0o600
    assert "was mode 0644; made 0600" in caplog.text


def test_open_for_owner_replaces_a_foreign_segment(seg_name: str) -> None:
    _raw_segment(seg_name, secrets.token_bytes(8192))
    with Segment.open_for_owner(seg_name, SMALL) as s:
        assert s.header().params == SMALL
    Segment.attach(seg_name).close()


def test_open_for_owner_refuses_a_live_owner(seg: Segment) -> None:
    _push(seg, _records(2))
    with live_pid() as pid:
        start = pids.start_ticks(pid)
        assert start is not None
        seg.view.store(L.H_OWNER_START, start)
        seg.view.store(L.H_OWNER_PID, pid)
        with pytest.raises(SegmentInUse, match=str(pid)):
            Segment.open_for_owner(seg.name, SMALL)
        # Untouched: still the live owner's, queue intact.
        assert seg.header().owner_pid == pid
        assert seg.queue_depth() == 2


def test_another_builds_segment_with_a_live_owner_is_refused_not_replaced(seg: Segment) -> None:
    """Another layout version, still served by the build that made it: replaced, it went on
    serving from an unlinked mapping that nobody could inspect, and lost what it queued."""
    _push(seg, _records(2))
    seg.view.store(L.H_VERSION, L.LAYOUT_VERSION - 1)
    with live_pid() as pid:
        start = pids.start_ticks(pid)
        assert start is not None
        seg.view.store(L.H_OWNER_START, start)
        seg.view.store(L.H_OWNER_PID, pid)
        with pytest.raises(SegmentInUse, match=f"layout version .* live process {pid}"):
            Segment.open_for_owner(seg.name, SMALL)
    seg.view.store(L.H_VERSION, L.LAYOUT_VERSION)
    with Segment.attach(seg.name) as again:  # the same segment, its queue intact
        assert again.header().owner_pid == pid and again.queue_depth() == 2


def test_a_newer_builds_segment_is_refused_an_older_ones_replaced(
    seg: Segment, caplog: pytest.LogCaptureFixture
) -> None:
    """A downgrade must not drop what the newer build queued: only it can read its queue.
    An older build's segment is replaced, and the log says what that drops."""
    _push(seg, _records(2))
    seg.view.store(L.H_OWNER_PID, dead_pid())
    seg.view.store(L.H_VERSION, L.LAYOUT_VERSION + 1)
    with pytest.raises(LayoutMismatch, match=r"a newer build made it.*remove /dev/shm/"):
        Segment.open_for_owner(seg.name, SMALL)
    assert seg.view.load(L.H_VERSION) == L.LAYOUT_VERSION + 1  # still the newer build's
    seg.view.store(L.H_VERSION, L.LAYOUT_VERSION - 1)
    with caplog.at_level(logging.WARNING, logger="ankusa_shm.segment"):
        fresh = Segment.open_for_owner(seg.name, SMALL)
    with fresh:
        assert fresh.header().version == L.LAYOUT_VERSION and fresh.queue_depth() == 0
    assert "anything queued in it dropped" in caplog.text


def test_a_directory_at_the_name_is_a_clear_refusal(seg_name: str) -> None:
    path = Path(f"/dev/shm/{seg_name}")
    path.mkdir()
    try:
        with pytest.raises(ForeignSegment, match=r"cannot remove .*remove it by hand"):
            Segment.open_for_owner(seg_name, SMALL)
        assert path.is_dir()
    finally:
        path.rmdir()


def _open_own_segment_of_mode_0400(_: int, name: str) -> str:
    """As a user who is not root (root may open any mode): the service's own segment,
    made unreadable to it by hand."""
    if os.getuid() == 0:
        os.setgid(65534)
        os.setuid(65534)
    Segment.create(name, SMALL).close()
    os.chmod(f"/dev/shm/{name}", 0o400)
    try:
        Segment.open_for_owner(name, SMALL).close()
        return "opened"
    except SegmentDenied as e:
        return str(e)
    finally:
        segmod.unlink(name)


def test_a_segment_of_ours_we_may_not_write_says_how_to_mend_it(seg_name: str) -> None:
    if os.geteuid() != 0:
        cannot_run("only root can run a child as another user")
    (said,) = run_children(1, _open_own_segment_of_mode_0400, seg_name)
    assert f"(mode 0400): chmod 600 /dev/shm/{seg_name}" in said, said


def _own_push_and_exit(name: str) -> int:
    with Segment.open_for_owner(name, SMALL) as s:
        _push(s, _records(3))
        return os.getpid()  # exits without unlinking, as a killed supervisor does


def test_a_restarted_owner_takes_back_a_segment_whose_owner_pid_was_reused(
    seg_name: str,
) -> None:
    with Children() as kids:
        kids.start(_own_push_and_exit, seg_name)
        (gone,) = kids.collect()
        kids.join()
    # Another process now has the dead supervisor's pid.
    with reused_pid(gone), Segment.open_for_owner(seg_name, SMALL) as s:
        h = s.header()
        assert (h.owner_pid, h.owner_start) == (os.getpid(), pids.my_start())
        assert s.queue_depth() == 3  # re-attached, not replaced


def test_open_for_owner_by_the_owner_itself(seg: Segment) -> None:
    _push(seg, _records(2))
    with Segment.open_for_owner(seg.name, SMALL) as s:
        assert s.queue_depth() == 2


def _open_as_another_user(_: int, name: str) -> str:
    """In a child that is not the segment's owner (root drops to nobody to be one)."""
    if os.getuid() == 0:
        os.setgid(65534)
        os.setuid(65534)
    results = []
    for as_owner in (False, True):
        try:
            if as_owner:
                Segment.open_for_owner(name, SMALL).close()
            else:
                Segment.attach(name, readonly=True).close()
            results.append("opened")
        except SegmentDenied:
            results.append("denied")
    return ",".join(results)


def test_another_users_segment_is_denied_never_replaced(seg: Segment, seg_name: str) -> None:
    path = f"/dev/shm/{seg_name}"
    if os.getuid() != 0:
        os.chmod(path, 0)  # not root: a mode that denies even the owner plays "another user"
    try:
        (outcome,) = run_children(1, _open_as_another_user, seg_name)
    finally:
        os.chmod(path, 0o600)
    assert outcome == "denied,denied"
    with Segment.attach(seg_name) as again:
        assert again.header() == seg.header()  # still there, untouched


def test_a_segment_of_another_user_that_anyone_may_write_is_never_taken(
    seg: Segment, seg_name: str
) -> None:
    """/dev/shm is anyone's to write: another user may make the name first, with a mode
    that lets us in. The supervisor refuses it rather than re-attach to it (whose owner
    could read and change what it holds)."""
    if os.geteuid() != 0:
        cannot_run("only root can give a file to another user")
    path = f"/dev/shm/{seg_name}"
    os.chown(path, 65534, 65534)
    os.chmod(path, 0o666)
    with pytest.raises(SegmentDenied, match="belongs to uid 65534"):
        Segment.open_for_owner(seg_name, SMALL)
    assert os.stat(path).st_uid == 65534 and os.stat(path).st_mode & 0o777 == 0o666


@pytest.mark.parametrize("kind", ["symlink", "fifo"])
def test_a_name_that_is_not_a_shared_memory_file_is_foreign(
    seg_name: str, tmp_path: Path, kind: str
) -> None:
    """A symlink at the name was a traceback (ELOOP), a FIFO a hang (its open blocks):
    both are foreign to a reader, and the supervisor puts a segment in their place."""
    path = Path(f"/dev/shm/{seg_name}")
    target = tmp_path / "target"
    target.write_bytes(b"not yours")
    if kind == "symlink":
        path.symlink_to(target)
    else:
        os.mkfifo(path)
    with pytest.raises(ForeignSegment):
        Segment.attach(seg_name, readonly=True)
    with Segment.open_for_owner(seg_name, SMALL) as fresh:
        assert fresh.header().params == SMALL
    assert path.is_file() and not path.is_symlink() and target.read_bytes() == b"not yours"


def test_config_snapshot_round_trip(seg: Segment) -> None:
    assert seg.read_config() == {}
    snap: dict[str, object] = {"fleet": {"breaker_window_ms": 10_000}, "sources": 2, "ü": [1]}
    seg.write_config(snap)
    assert seg.read_config() == snap
    gen = seg.view.load(seg.layout.offset("config") + L.BLOB_GENERATION)
    assert gen % 2 == 0 and gen > 0
    seg.write_config({"a": 1})  # shorter than the last: no tail of the old one
    assert seg.read_config() == {"a": 1}
    with Segment.attach(seg.name, readonly=True) as r:
        assert r.read_config() == {"a": 1}


def test_config_snapshot_too_large(seg: Segment) -> None:
    seg.write_config({"x": "y" * L.CONFIG_BYTES})
    assert seg.read_config() == {"truncated": True}


def test_close_twice_and_use_after_close(seg_name: str) -> None:
    s = Segment.create(seg_name, SMALL)
    s.close()
    s.close()
    with pytest.raises(SegmentError, match="closed"):
        _ = s.view
    with pytest.raises(SegmentError, match="closed"):
        _ = s.buf
    with Segment.attach(seg_name, readonly=True) as r:
        pass
    r.close()


def test_unlink(seg: Segment) -> None:
    assert segmod.unlink(seg.name) is True
    assert segmod.unlink(seg.name) is False
    with pytest.raises(SegmentMissing):
        Segment.attach(seg.name)
    seg.view.store(seg.layout.offset("gcra"), 1)  # the mapping stays valid until closed
