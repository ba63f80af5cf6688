"""Create, attach to and remove the named POSIX shared-memory segment.

Only the supervisor creates, re-attaches as owner, or unlinks; children attach read-write;
tools attach read-only (``O_RDONLY`` + ``PROT_READ``), which works for a user who may only
read the segment and can never write to it. ``close()`` is this process letting go;
``unlink()`` removes the name for everyone and is the owner's job, once.
"""

from __future__ import annotations

import logging
import mmap
import os
import stat
import time
from dataclasses import dataclass

import posix_ipc

from ankusa_shm._atomics import AtomicView
from ankusa_shm.shm import histograms, requests
from ankusa_shm.shm import layout as L
from ankusa_shm.shm.blob import Blob, BlobTooLarge
from ankusa_shm.shm.counters import Counter
from ankusa_shm.shm.pids import my_start, pid_alive
from ankusa_shm.shm.settle_queue import SettleQueue

log = logging.getLogger("ankusa_shm.segment")

DEFAULT_NAME = "ankusa-shm"
_READY_WAIT_S = 2.0


class SegmentError(Exception):
    """A segment that cannot be used; the message says which and why, in one line."""


class SegmentMissing(SegmentError):
    pass


class ForeignSegment(SegmentError):
    """Not an ankusa-shm segment at all (wrong magic or too small to hold a header)."""


class LayoutMismatch(SegmentError):
    """An ankusa-shm segment of another layout version or other sizes. The header's first
    words (magic, version, owner) sit where they did in every layout, so who made it and
    whether its owner lives can be told even so."""

    def __init__(self, message: str, version: int, owner_pid: int, owner_start: int) -> None:
        super().__init__(message)
        self.version, self.owner_pid, self.owner_start = version, owner_pid, owner_start


class CorruptSegment(SegmentError):
    """Claims to be ours, but its header contradicts itself or its size."""


class SegmentDenied(SegmentError):
    """This user may not open the segment (it belongs to another service user)."""


class SegmentInUse(SegmentError):
    """Another live supervisor owns the segment."""


def shm_name(name: str) -> str:
    """POSIX names are '/x' with no other slash; accept 'x' or '/x'."""
    bare = name.removeprefix("/")
    if not bare or "/" in bare or len(bare) > 250:
        raise SegmentError(f"invalid segment name {name!r}: one path component, 1-250 chars")
    return "/" + bare


_SHM_DIR = "/dev/shm"  # where Linux keeps POSIX shared memory, each name a file


def _lstat(path: str) -> os.stat_result | None:
    """The file a segment's name is, not followed; None where there is no such file (or,
    off Linux, no such directory to look in)."""
    try:
        return os.lstat(_SHM_DIR + path)
    except OSError:
        return None


def make_params(
    queue_capacity: int = 50_000, gcra_slots: int = 65_536, process_slots: int = 256
) -> L.Params:
    """Params for this build: the counter count is the build's, the sizes the config's."""
    return L.Params(
        counters=len(Counter),
        statuses=requests.COLUMNS,
        histogram_words=histograms.WORDS,
        queue_capacity=queue_capacity,
        gcra_slots=gcra_slots,
        process_slots=process_slots,
    )


@dataclass(frozen=True)
class Header:
    version: int
    total_size: int
    ready: bool
    owner_pid: int
    owner_start: int  # start ticks: with the pid, which process the owner is
    owner_birth_ns: int
    created_ns: int
    params: L.Params


class Segment:
    """One process's mapping of the segment: ``view`` for words, ``buf`` for bytes."""

    # Class-level defaults so close() works after a constructor that failed halfway.
    _mmap: mmap.mmap | None = None
    _view: AtomicView | None = None
    _buf: memoryview | None = None

    def __init__(self, name: str, mm: mmap.mmap, lay: L.Layout, readonly: bool) -> None:
        self.name = name
        self._mmap = mm
        self.layout = lay
        self.readonly = readonly
        self._buf = memoryview(mm)
        self._view = AtomicView(mm)

    @property
    def view(self) -> AtomicView:
        if self._view is None:
            raise SegmentError(f"segment {self.name} is closed")
        return self._view

    @property
    def buf(self) -> memoryview:
        if self._buf is None:
            raise SegmentError(f"segment {self.name} is closed")
        return self._buf

    # -- lifecycle ----------------------------------------------------------------------

    @classmethod
    def create(cls, name: str, params: L.Params) -> Segment:
        """Create a new segment (fails if the name exists), initialised and marked ready."""
        lay = L.Layout.of(params)
        try:
            shm = posix_ipc.SharedMemory(
                shm_name(name), posix_ipc.O_CREX, mode=0o600, size=lay.total_size
            )
        except posix_ipc.ExistentialError:
            raise SegmentError(f"segment {shm_name(name)} already exists") from None
        try:
            os.fchmod(shm.fd, 0o600)  # shm_open's mode is filtered by the umask
            mm = mmap.mmap(shm.fd, lay.total_size)
        finally:
            shm.close_fd()
        seg = cls(shm_name(name), mm, lay, readonly=False)
        seg._initialise()
        return seg

    @classmethod
    def attach(cls, name: str, *, readonly: bool = False) -> Segment:
        """Attach to an existing, ready segment whose header this build understands."""
        path = shm_name(name)
        st = _lstat(path)
        if st is not None and not stat.S_ISREG(st.st_mode):  # a FIFO would block the open
            raise ForeignSegment(f"segment {path} is not a shared-memory file ({_SHM_DIR}{path})")
        try:
            shm = posix_ipc.SharedMemory(path, read_only=readonly)
        except posix_ipc.ExistentialError:
            raise SegmentMissing(f"no segment named {path} (is ankusa-shm running?)") from None
        except posix_ipc.PermissionsError:
            raise SegmentDenied(f"no permission to open segment {path}") from None
        except OSError as e:  # a name swapped for a symlink since: ELOOP
            raise ForeignSegment(f"cannot open segment {path}: {e.strerror}") from None
        try:
            size = os.fstat(shm.fd).st_size
            if size < L.HEADER_BYTES:
                raise ForeignSegment(
                    f"segment {path} is {size} bytes, too small for an ankusa-shm header"
                )
            access = mmap.ACCESS_READ if readonly else mmap.ACCESS_WRITE
            mm = mmap.mmap(shm.fd, size, access=access)
        finally:
            shm.close_fd()
        try:
            lay = _validate(path, mm, size)
        except BaseException:
            mm.close()
            raise
        return cls(path, mm, lay, readonly)

    @classmethod
    def open_for_owner(cls, name: str, params: L.Params) -> Segment:
        """The supervisor's entry: re-attach to a matching segment left by a dead owner, or
        replace an unusable one (logging what is lost), or create a fresh one."""
        path = shm_name(name)
        st = _lstat(path)
        if st is not None and st.st_uid != os.geteuid():  # /dev/shm is anyone's to write
            raise SegmentDenied(
                f"segment {path} belongs to uid {st.st_uid}, not to this service's "
                f"({os.geteuid()}): remove it, or choose another server.segment"
            )
        try:
            seg = cls.attach(path)
        except SegmentMissing:
            return cls.create(path, params)
        except SegmentDenied as e:  # someone else's: never ours to replace
            if st is None or not stat.S_ISREG(st.st_mode):
                raise
            raise SegmentDenied(
                f"{e} (mode {st.st_mode & 0o777:04o}): chmod 600 {_SHM_DIR}{path}, "
                "or choose another server.segment"
            ) from None
        except LayoutMismatch as e:
            if _held_by_another(e.owner_pid, e.owner_start):
                raise SegmentInUse(
                    f"{e}, and is owned by live process {e.owner_pid} (another build of "
                    "ankusa-shm): stop it first, or choose another server.segment"
                ) from None
            if e.version > L.LAYOUT_VERSION:  # a downgrade: what it queued is that build's
                raise LayoutMismatch(
                    f"{e}: a newer build made it, and may have left settle operations in it "
                    f"that only it can send. Start that build, or remove {_SHM_DIR}{path} "
                    "to drop them",
                    e.version,
                    e.owner_pid,
                    e.owner_start,
                ) from None
            return replace(path, params, str(e))
        except SegmentError as e:
            return replace(path, params, str(e))
        hdr = seg.header()
        if _held_by_another(hdr.owner_pid, hdr.owner_start):
            seg.close()
            raise SegmentInUse(f"segment {path} is owned by live process {hdr.owner_pid}")
        if hdr.params != params:
            lost = seg.queue_depth()
            seg.close()
            return replace(path, params, f"built with {hdr.params}, now {params}", lost)
        queue = SettleQueue(seg.view, seg.buf, seg.layout)
        damage = queue.check()
        if damage is not None:
            kept, lost = queue.rebuild()
            log.warning(
                "segment %s: its settle queue was damaged (%s); rebuilt with the %d queued "
                "operations that passed their checks, %d slots lost",
                path,
                damage,
                kept,
                lost,
            )
        seg._take_ownership()
        _make_private(path)
        log.info(
            "re-attached segment %s; %d queued settle operations kept", path, seg.queue_depth()
        )
        return seg

    def close(self) -> None:
        """Unmap in this process; idempotent."""
        if self._view is not None:
            self._view.release()
            self._view = None
        if self._buf is not None:
            self._buf.release()
            self._buf = None
        if self._mmap is not None:
            self._mmap.close()
            self._mmap = None

    def __enter__(self) -> Segment:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- header -------------------------------------------------------------------------

    def header(self) -> Header:
        v = self.view
        return Header(
            version=v.load(L.H_VERSION),
            total_size=v.load(L.H_TOTAL_SIZE),
            ready=v.load(L.H_READY) == 1,
            owner_pid=v.load(L.H_OWNER_PID),
            owner_start=v.load(L.H_OWNER_START),
            owner_birth_ns=v.load(L.H_OWNER_BIRTH_NS),
            created_ns=v.load(L.H_CREATED_NS),
            params=_read_params(v),
        )

    def blob(self, region: str) -> Blob:
        """One of the segment's JSON documents: config, sources, overrides, epoch."""
        return Blob(self.view, self.buf, self.layout, region)

    def write_config(self, snapshot: dict[str, object]) -> None:
        """Publish the effective configuration for readers (supervisor only)."""
        try:
            self.blob("config").write(snapshot)
        except BlobTooLarge:
            self.blob("config").write({"truncated": True})

    def read_config(self) -> dict[str, object]:
        """The published configuration snapshot; {} if none was written."""
        loaded = self.blob("config").read()
        return loaded if isinstance(loaded, dict) else {}

    def queue_depth(self) -> int:
        return SettleQueue(self.view, self.buf, self.layout).depth()

    def _initialise(self) -> None:
        v, lay = self.view, self.layout
        now = time.time_ns()
        v.store(L.H_MAGIC, L.MAGIC)
        v.store(L.H_VERSION, L.LAYOUT_VERSION)
        v.store(L.H_TOTAL_SIZE, lay.total_size)
        v.store(L.H_CREATED_NS, now)
        for fname, off in L.param_offsets().items():
            v.store(off, getattr(lay.params, fname))
        for region, (offset, size) in lay.regions.items():
            o_off, o_size = L.region_offsets(region)
            v.store(o_off, offset)
            v.store(o_size, size)
        SettleQueue(v, self.buf, lay).format()
        self._take_ownership(now)

    def _take_ownership(self, birth_ns: int | None = None) -> None:
        v = self.view
        v.store(L.H_OWNER_START, my_start() & L.START_MASK)
        v.store(L.H_OWNER_PID, os.getpid())
        v.store(L.H_OWNER_BIRTH_NS, birth_ns or time.time_ns())
        v.store(L.H_READY, 1)


def unlink(name: str) -> bool:
    """Remove the name (mappings stay valid until closed). False if it was already gone."""
    try:
        posix_ipc.unlink_shared_memory(shm_name(name))
    except posix_ipc.ExistentialError:
        return False
    return True


_BUILD_PARAMS = {
    "counters": "counters",
    "statuses": "status columns",
    "histogram_words": "histogram words",
}


def _held_by_another(owner_pid: int, owner_start: int) -> bool:
    """Whether a live process other than this one owns the segment. The owner's pid may
    since have gone to another process: it is judged by its start time too."""
    return owner_pid != os.getpid() and pid_alive(owner_pid, owner_start)


def replace(path: str, params: L.Params, why: str, queued: int | None = None) -> Segment:
    """A new segment in place of one that cannot be used. Whatever it held queued is
    dropped here; a fleet-scope drainer promotes again, from the store, what was stored
    since the last stop that left every hook settled."""
    try:
        unlink(path)
    except OSError as e:  # a directory at the name
        raise ForeignSegment(
            f"{why}; cannot remove {_SHM_DIR}{path} ({e.strerror}): remove it by hand, "
            "or choose another server.segment"
        ) from None
    log.warning(
        "replacing segment %s: %s; %s dropped (a fleet-scope drainer promotes again, from "
        "the store, what was stored since the last stop that left every hook settled)",
        path,
        why,
        "anything queued in it" if queued is None else f"its {queued} queued settle operations",
    )
    return Segment.create(path, params)


def _make_private(path: str) -> None:
    """0600 again, for a segment re-attached with a wider mode (made by an older build, or
    changed by hand): what it holds is the service's alone."""
    shm = posix_ipc.SharedMemory(path)
    try:
        mode = os.fstat(shm.fd).st_mode & 0o777
        if mode != 0o600:
            os.fchmod(shm.fd, 0o600)
            log.warning("segment %s was mode %04o; made 0600", path, mode)
    finally:
        shm.close_fd()


def _read_params(v: AtomicView) -> L.Params:
    return L.Params(**{name: v.load(off) for name, off in L.param_offsets().items()})


def _validate(path: str, mm: mmap.mmap, size: int) -> L.Layout:
    v = AtomicView(mm)
    try:
        if v.load(L.H_MAGIC) != L.MAGIC:
            raise ForeignSegment(f"segment {path} is not an ankusa-shm segment (bad magic)")
        version = v.load(L.H_VERSION)
        owner = (v.load(L.H_OWNER_PID), v.load(L.H_OWNER_START))
        if version != L.LAYOUT_VERSION:
            raise LayoutMismatch(
                f"segment {path} has layout version {version}; "
                f"this build reads version {L.LAYOUT_VERSION}",
                version,
                *owner,
            )
        deadline = time.monotonic() + _READY_WAIT_S
        while v.load(L.H_READY) != 1:
            if time.monotonic() > deadline:
                raise CorruptSegment(f"segment {path} never became ready (creator died?)")
            time.sleep(0.01)
        try:
            lay = L.Layout.of(_read_params(v))
        except ValueError as e:
            raise CorruptSegment(f"segment {path}: {e}") from None
        # What the build decides, not the config: another build's rows mean other things.
        ours = make_params()
        for field, what in _BUILD_PARAMS.items():
            theirs, mine = getattr(lay.params, field), getattr(ours, field)
            if theirs != mine:
                raise LayoutMismatch(
                    f"segment {path} has {theirs} {what}; this build has {mine}", version, *owner
                )
        if v.load(L.H_TOTAL_SIZE) != lay.total_size or size < lay.total_size:
            raise CorruptSegment(
                f"segment {path} is {size} bytes; its header describes {lay.total_size}"
            )
        for region, (offset, rsize) in lay.regions.items():
            o_off, o_size = L.region_offsets(region)
            if (v.load(o_off), v.load(o_size)) != (offset, rsize):
                raise CorruptSegment(f"segment {path}: region table entry {region!r} is wrong")
        return lay
    finally:
        v.release()
