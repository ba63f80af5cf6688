"""The shared-memory segment's layout: the one place that says where every byte lives.

Every process of one ankusa-shm instance -- supervisor, request workers, the drainer, and
read-only tools such as ``inspect`` -- maps one named POSIX segment. This module defines
its bytes; the modules beside it (``breaker``, ``settle_queue``, ``gcra``, ...) only
operate on the offsets given here.

Regions, in order, each aligned to a 128-byte line (two x86 cache lines, so the adjacent-
line prefetcher never makes two regions or two writers share a line):

    header       magic, layout version, sizes, region table, owner pid/birth, ready flag
    config       a blob (below): JSON snapshot of the effective configuration
    sources      a blob: the JSON list of source ids, in the order their request-count
                 rows were handed out (append-only, so a row never changes source)
    overrides    a blob: JSON {tenant: [rate, burst]}, the tenant limits set at run time
    epoch        a blob: the fleet store's epoch keys as the drainer last read them
    breaker      one packed state word; 32 time buckets of the sliding call window
    degraded     per kind (rate_limit, dedupe): a flag word, when it was last warned
                 about, when a call last failed, whether an outage line stands
    processes    one 128-byte slot per process: header word, start time, heartbeat,
                 the slot's request count when it was claimed
    counters     one padded row of counters per process slot, summed on read
    requests     per process slot, one word per (source row, status): requests answered
    histograms   per process slot, each histogram's bucket words and its sum word
    store        the commit word: bumped after every store commit, for long-polls; the
                 store writers' ticket queue (``turns``)
    queue        settle queue: enqueue and dequeue positions on lines of their own,
                 the consumer's pid and identity and how far its drops are made good,
                 then fixed-size slots (sequence word + record)
    gcra         node-scope rate limits: per tenant a key word and a tagged TAT word

A blob is a seqlocked byte string: a generation word (odd while its one writer rewrites
it), a length word, then the bytes. A reader copies the bytes between two loads of the
generation and keeps them only if both were the same even number.

Who writes what. The supervisor writes the header, config and sources, and overrides at
start, and on a segment it made ``Q_FIRST_SEQ``; after that the admin process alone
writes overrides, and the drainer alone writes epoch. Any process that claims a process
slot writes that slot and adds to its counter row, the breaker, the degraded flags, the
GCRA table and the queue's enqueue side. Only the drainer (the queue's single consumer,
named by its pid) advances the dequeue side and writes ``Q_MENDED_MS``. Readers write
nothing.

Memory ordering. Every word is a naturally aligned signed 64-bit integer touched only
through ``_atomics`` (sequentially consistent load/store/fetch-add/compare-and-swap). Byte
payloads (config JSON, queue records) are plain copies that are published by a later
atomic store of a word and read after an atomic load of it, so a reader that sees the
word sees the bytes.

How a reader knows a slot is whole -- two words are not one:

* breaker: state, owner pid and since-time are packed in one word; window buckets pack
  epoch, failures and calls in one word. No breaker fact spans two words (the re-check
  word beside the state is a hint: a stale read costs one window scan, or one missed).
* process slot: the header word (pid, state, role and the holder's start time) is written
  last by a claimer; a reader takes a slot as whole when the header word reads the same
  before and after the rest.
* GCRA slot: the key word holds the tenant's hash; the TAT word carries a 14-bit tag of
  that hash beside the time. A TAT word whose tag is not the key's tag belongs to a slot
  being (re)assigned and means a fresh bucket; a stale compare-and-swap from a process
  that still believes in the old tenant fails because the tag changed.
* queue slot: the record is whole once its sequence word says "published" (Vyukov).
* counters: a row belongs to its process slot, not to a process. It is only ever added
  to -- never folded elsewhere, never zeroed -- and keeps counting across the processes
  that hold the slot in turn, so a total (the sum of the rows) is exact whatever instant a
  process dies at, and never goes backwards. What one process counted is its row now less
  the baseline its claim recorded in the slot (``PS_REQUESTS_BASE``).

Processes are named by pid *and* start time (``/proc/<pid>/stat`` field 22, clock ticks
since boot, kept modulo 2**START_BITS): pids are reused, and a process is alive only while
a live, non-zombie process of that pid started at that time (``pids.pid_alive``). The
breaker's state word has no room for a start time; a zombie or dead probe owner is still
noticed, and a reused one lasts no longer than the probe timeout.

Times are monotonic (CLOCK_MONOTONIC is one clock for every process on a host) in ms,
or in microseconds for GCRA. The wall clock appears in the header and the process slots
(nanoseconds, for people) and in the settle queue's ``Q_MENDED_MS`` (milliseconds, to
compare with the store's received-at times).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, fields

MAGIC = int.from_bytes(b"ANKUSHM\x01", "little")
LAYOUT_VERSION = 6
LINE = 128
WORD = 8
PID_BITS = 22  # Linux's pid_max is at most 2**22
PID_MASK = (1 << PID_BITS) - 1
START_BITS = 35  # process start time, clock ticks mod 2**35: 10 years of uptime at 100 Hz
START_MASK = (1 << START_BITS) - 1

# -- header: word offsets ---------------------------------------------------------------
HEADER_BYTES = 4096
H_MAGIC = 0
H_VERSION = 8
H_TOTAL_SIZE = 16
H_READY = 24
H_OWNER_PID = 32
H_OWNER_BIRTH_NS = 40  # wall clock, ns, when the owner took the segment: for people
H_CREATED_NS = 48  # wall clock, ns, when the segment itself was created
H_OWNER_START = 56  # the owner's start ticks: with H_OWNER_PID, who the owner is
H_PARAMS = 64  # the Params fields, one word each, in declaration order
H_REGIONS = 256  # (offset, size) word pairs, one per region in REGIONS order

REGIONS = (
    "config",
    "sources",
    "overrides",
    "epoch",
    "breaker",
    "degraded",
    "processes",
    "counters",
    "requests",
    "histograms",
    "store",
    "queue",
    "gcra",
)

# -- blobs: config, sources, overrides, epoch -----------------------------------------------
BLOB_GENERATION = 0  # odd while its writer rewrites it
BLOB_LENGTH = 8
BLOB_DATA = 16
BLOB_BYTES = {"config": 16_384, "sources": 8_192, "overrides": 65_536, "epoch": 8_192}
CONFIG_BYTES = BLOB_BYTES["config"]

# -- request counts -------------------------------------------------------------------------
# A process slot's row: SOURCE_ROWS rows of one word per status column (``requests``
# says which). Row 0 counts requests that named no source, row 1 sources past the table.
SOURCE_ROWS = 64
OVERFLOW_LABEL = "_overflow"  # row 1's source label, which no source may have (``config``)

# -- store ----------------------------------------------------------------------------------
ST_COMMITS = 0  # store transactions committed, by every writer of this host
# The writers' turns (``turns``): the next ticket to hand out, and the ticket whose turn it
# is. Both start at zero, so a segment made before they were used holds a valid queue.
ST_TICKETS = 8
ST_SERVING = 16
ST_WATCHERS = 24  # threads asleep on the commit word: a commit wakes them only if any

# -- breaker --------------------------------------------------------------------------------
BREAKER_BUCKETS = 32
BR_STATE = 0
# Monotonic ms until which a success re-checks the failure rate (0: it need not): set when
# a failure finds too few calls to judge but failures enough that more calls could open.
BR_RECHECK_UNTIL_MS = 8
# Calls failed in a row, by any process: monotonic ms of the last one (39 bits) << 16 |
# how many (16 bits). A success zeroes it.
BR_FAILURE_RUN = 16
BR_BUCKETS = LINE  # BREAKER_BUCKETS words
# State word: state (2 bits) | owner pid (22 bits) | since, monotonic ms (39 bits).
BR_STATE_SHIFT = 61
BR_PID_SHIFT = 39
BR_SINCE_MASK = (1 << 39) - 1
# Bucket word: valid (1 bit) | epoch (30 bits) | failures (16 bits) | calls (16 bits).
BK_VALID = 1 << 62
BK_EPOCH_SHIFT = 32
BK_EPOCH_MASK = (1 << 30) - 1
BK_FAIL_SHIFT = 16
BK_COUNT_MASK = 0xFFFF

# -- degraded flags -----------------------------------------------------------------------
KINDS = ("rate_limit", "dedupe")
DG_FLAG = 0  # within each kind's line: 1 while answered node-local
DG_WARNED_MS = 8  # monotonic ms of the last warning, 0 = never
DG_FAILED_MS = 16  # monotonic ms of the last call that failed (or was not made), about
DG_SAID = 24  # 1 from a warning until the line that says the fleet answers again

# -- process slots --------------------------------------------------------------------------
PROCESS_SLOT_BYTES = LINE
# Header word: start ticks (START_BITS) << 28 | role (4 bits) << 24 | state (2 bits) << 22
# | pid (PID_BITS). One word, so a reader never sees one process's pid with another's start.
PS_HEADER = 0
PS_STATE_SHIFT = PID_BITS
PS_ROLE_SHIFT = 24
PS_START_SHIFT = 28
PS_STARTED_NS = 8  # wall clock
PS_HEARTBEAT_MS = 16  # monotonic
PS_CLAIMS = 24  # how many times this slot was claimed (a new process => a new value)
PS_REQUESTS_BASE = 32  # the row's REQUESTS when this holder claimed the slot

# -- settle queue ---------------------------------------------------------------------------
Q_ENQUEUE = 0
# The consumer asleep (1) or not; and the word it sleeps on, which a producer that finds it
# asleep bumps and wakes. On the producers' line: every push reads the first.
Q_SLEEPING = 8
Q_WAKE = 16
Q_DEQUEUE = LINE
Q_CONSUMER = LINE + 8  # pid of the one consumer, for readers
# The consumer's identity, start ticks << PID_BITS | pid: the word the role is taken by
# (compare-and-swap), so the pid and the start time it is judged by are one word.
Q_CONSUMER_ID = LINE + 16
# Wall ms before which every operation the ring dropped for want of room has been made
# good (``repromote.Drops``); 0: not known. The consumer's alone, kept for the next one.
Q_MENDED_MS = LINE + 24
# The first store seq whose settle went through this ring: what was committed before it
# settled through an earlier segment, or never (``repromote.Drops``). Set by the supervisor
# that made the segment, before any worker runs; 0: not known.
Q_FIRST_SEQ = LINE + 32
Q_SLOTS = 2 * LINE
QS_SEQ = 0
QS_RECORD = 8
# A reserved slot's sequence word with this bit set: its producer is copying the record.
QS_WRITING = 1 << 62
# With this bit: the consumer gave the slot up (its producer never published), and frees
# it once the dequeue position is past it.
QS_ABANDONED = 1 << 61
# Record: a check, then its body -- op, hook-id length, key length, dedupe ttl ms,
# claimed-at ms, enqueued-at ms, token, then the Redis key and the hook id bytes. The check
# is the CRC-32 of the body exclusive-or the low 32 bits of the record's position: a reader
# tells the record its position was given from a torn one, one written a lap early by a
# producer that stalled mid-copy, or damage.
RECORD_CHECK = struct.Struct("<I")
RECORD_BODY = struct.Struct("<BBHqqq16s")
RECORD = struct.Struct(RECORD_CHECK.format + RECORD_BODY.format.removeprefix("<"))

# The largest record a valid config and a valid hook make, declared once: config checks
# names against MAX_NAME, the fleet store hashes a longer event key to "sha256:<hex>"
# (71 bytes), and the slot below is sized to hold the largest record these allow.
MAX_NAME = 64  # key prefix, tenant and source id
MAX_EVENT_KEY = 200
MAX_HOOK_ID = 64


def dedupe_key(prefix: str, tenant: str, source: str, event_key: bytes) -> bytes:
    """The fleet key of one event's claim. The tenant in braces is the Redis Cluster hash
    tag: all of a tenant's keys live in one slot."""
    return f"{prefix}:{{{tenant}}}:dd:{source}:".encode() + event_key


_LONGEST = "n" * MAX_NAME
MAX_DEDUPE_KEY = len(dedupe_key(_LONGEST, _LONGEST, _LONGEST, bytes(MAX_EVENT_KEY)))
# Whole lines, so that producers writing neighbouring slots never share a line pair.
QUEUE_SLOT_BYTES = -(-(QS_RECORD + RECORD.size + MAX_DEDUPE_KEY + MAX_HOOK_ID) // LINE) * LINE
RECORD_MAX_PAYLOAD = QUEUE_SLOT_BYTES - QS_RECORD - RECORD.size  # key + hook id, at most

# -- GCRA table -----------------------------------------------------------------------------
GCRA_SLOT_BYTES = 16
GS_KEY = 0  # the tenant's 64-bit hash (never 0); 0 = empty slot
GS_TAT = 8  # tag (14 bits) << 49 | theoretical arrival time, monotonic us, mod 2**49
GCRA_TAG_SHIFT = 49
GCRA_TAG_MASK = (1 << 14) - 1
GCRA_TAT_MASK = (1 << 49) - 1
GCRA_PROBE = 16  # slots looked at from a tenant's home slot


@dataclass(frozen=True)
class Params:
    """The sizes a segment is built with; two processes agree on a layout iff these match."""

    counters: int  # len(counters.Counter): adding a counter changes the layout
    statuses: int  # status columns of a request-count row (``requests``)
    histogram_words: int  # words of one slot's histogram row (``histograms``)
    queue_capacity: int = 50_000
    gcra_slots: int = 65_536
    process_slots: int = 256

    def check(self) -> None:
        for f in fields(self):
            v = getattr(self, f.name)
            if not isinstance(v, int) or v < 1 or v > 1 << 32:
                raise ValueError(f"segment parameter {f.name}={v!r} is out of range")
        if self.queue_capacity < 2:
            # With one slot, "published" (pos + 1) and "free on the next lap" (pos +
            # capacity) are one sequence number: every push would overwrite unread records.
            raise ValueError(f"segment parameter queue_capacity={self.queue_capacity} is below 2")


def _up(n: int, to: int = LINE) -> int:
    return (n + to - 1) // to * to


@dataclass(frozen=True)
class Layout:
    """Offsets and sizes of every region, derived from Params by ``Layout.of``."""

    params: Params
    regions: dict[str, tuple[int, int]]
    total_size: int
    counter_row: int  # bytes per process row of counters, padded to LINE
    request_row: int  # bytes per process row of request counts, padded to LINE
    histogram_row: int  # bytes per process row of histograms, padded to LINE

    @classmethod
    def of(cls, params: Params) -> Layout:
        params.check()
        counter_row = _up(params.counters * WORD)
        request_row = _up(SOURCE_ROWS * params.statuses * WORD)
        histogram_row = _up(params.histogram_words * WORD)
        sizes = {
            **BLOB_BYTES,
            "breaker": BR_BUCKETS + BREAKER_BUCKETS * WORD,
            "degraded": len(KINDS) * LINE,
            "processes": params.process_slots * PROCESS_SLOT_BYTES,
            "counters": params.process_slots * counter_row,
            "requests": params.process_slots * request_row,
            "histograms": params.process_slots * histogram_row,
            "store": LINE,
            "queue": Q_SLOTS + params.queue_capacity * QUEUE_SLOT_BYTES,
            "gcra": params.gcra_slots * GCRA_SLOT_BYTES,
        }
        regions: dict[str, tuple[int, int]] = {}
        at = HEADER_BYTES
        for name in REGIONS:
            regions[name] = (at, _up(sizes[name]))
            at += _up(sizes[name])
        return cls(params, regions, _up(at, 4096), counter_row, request_row, histogram_row)

    def offset(self, region: str) -> int:
        return self.regions[region][0]


def param_offsets() -> dict[str, int]:
    """Header offset of each Params field."""
    return {f.name: H_PARAMS + i * WORD for i, f in enumerate(fields(Params))}


def region_offsets(name: str) -> tuple[int, int]:
    """Header offsets of the (offset, size) words that describe region ``name``."""
    i = REGIONS.index(name)
    return H_REGIONS + 2 * i * WORD, H_REGIONS + (2 * i + 1) * WORD
