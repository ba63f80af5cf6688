"""Bad input in bulk for three targets, shared by ``tests/test_fuzz.py`` (a bounded,
deterministic run) and ``scripts/fuzz.py`` (the long campaign), so both generate and judge
cases the same way.

* HTTP: raw bytes over real sockets to a running service (seeded ``random.Random``, one
  generator per case index, so any case can be replayed from its seed and index).
* config: TOML documents over the schema's real keys plus junk (hypothesis), and text.
* segment: a real segment corrupted in place, then attached read-only and inspected.

Every case ends in one ``Outcome``: a correct answer, a clear error, or a failure (a crash,
a hang, a wrong answer). A failure that matches a bug already reported (``KNOWN_BUGS``) is
counted as ``known`` so that a new bug still fails the suite while the old one is pinned
by its own strict-xfail test.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import io
import json
import os
import random
import re
import signal
import socket
import string
import struct
import subprocess
import sys
import threading
import time
import tomllib
import traceback
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import seed as hypothesis_seed
from hypothesis import strategies as st
from load_client import GITHUB_SOURCE, SECRET, signed
from service import Service

from ankusa_shm import config, inspect
from ankusa_shm.hooks import bounded_event_key
from ankusa_shm.http.protocol import LINGER_S, SWEEP_S
from ankusa_shm.shm import layout as L
from ankusa_shm.shm import procs, snapshot
from ankusa_shm.shm import segment as segmod
from ankusa_shm.shm.counters import Counter
from ankusa_shm.shm.segment import Segment, SegmentError
from ankusa_shm.shm.settle_queue import Op, Record, SettleQueue
from ankusa_shm.store import readers

# -- outcomes ---------------------------------------------------------------------------------

OK, ERROR, CRASH, HANG, KNOWN = "ok", "error", "crash", "hang", "known"


@dataclass(frozen=True)
class Outcome:
    kind: str  # OK | ERROR | CRASH | HANG | KNOWN
    detail: str = ""


@dataclass
class Tally:
    """Per target: how many cases, how they ended, and the first few failures in full."""

    target: str
    cases: int = 0
    counts: dict[str, int] = field(default_factory=dict)
    restarts: int = 0
    lost: int = 0
    failures: list[str] = field(default_factory=list)
    known: dict[str, int] = field(default_factory=dict)
    seconds: float = 0.0
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, outcome: Outcome, case: str = "") -> None:
        with self.lock:
            self.cases += 1
            self.counts[outcome.kind] = self.counts.get(outcome.kind, 0) + 1
            if outcome.kind == KNOWN:
                self.known[outcome.detail] = self.known.get(outcome.detail, 0) + 1
            elif outcome.kind in (CRASH, HANG) and len(self.failures) < 20:
                self.failures.append(f"{case}: {outcome.kind}: {outcome.detail}")

    def failure(self, what: str) -> None:
        """A failure found after the cases ran (a restart, a lost hook, a dirty log)."""
        with self.lock:
            if len(self.failures) < 20:
                self.failures.append(what)

    def count(self, kind: str) -> int:
        return self.counts.get(kind, 0)

    @property
    def bad(self) -> bool:
        """New failures: anything but answers, clear errors and bugs already reported."""
        return bool(self.count(CRASH) or self.count(HANG) or self.restarts or self.lost) or bool(
            self.failures
        )

    def summary(self) -> dict[str, Any]:
        return {
            "cases": self.cases,
            "ok": self.count(OK),
            "errors": self.count(ERROR),
            "crashes": self.count(CRASH),
            "hangs": self.count(HANG),
            "known_bugs": self.count(KNOWN),
            "restarts": self.restarts,
            "lost": self.lost,
            "seconds": round(self.seconds, 1),
        }


# -- bugs already reported --------------------------------------------------------------------
# A crash's signature is its exception type and the innermost frame of ankusa_shm it came
# from; each entry is a bug in the product, pinned by a strict-xfail test of its own.

KNOWN_BUGS: dict[str, str] = {}  # all fixed; a new one is pinned here with its reason


def signature(e: BaseException) -> str:
    where = "?"
    for frame in traceback.extract_tb(e.__traceback__):
        rel = frame.filename.replace(os.sep, "/")
        if "/ankusa_shm/" in rel:
            where = "ankusa_shm/" + rel.rsplit("/ankusa_shm/", 1)[1] + ":" + frame.name
    return f"{type(e).__name__}@{where}"


def crash(e: BaseException) -> Outcome:
    sig = signature(e)
    if sig in KNOWN_BUGS:
        return Outcome(KNOWN, sig)
    return Outcome(CRASH, f"{sig}: {e!r}"[:500])


class Hang(BaseException):
    """Not an Exception: no ``except Exception`` in the code under test may swallow it."""


@contextlib.contextmanager
def bounded(seconds: float) -> Iterator[None]:
    """Raise ``Hang`` in this (main) thread if the block runs past ``seconds``: a real
    interval timer, so an endless loop in the code under test ends the case, not the run."""

    def ring(_sig: int, _frame: FrameType | None) -> None:
        raise Hang(f"still running after {seconds} s")

    old = signal.signal(signal.SIGALRM, ring)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


# == config ===================================================================================

Leaf = str  # a setting's default, as describe() shows it (in TOML)


def schema() -> dict[str, Any]:
    """The config's keys as a tree, from ``config.describe()``: tables are dicts,
    ``[[sources]]`` is a one-item list holding its table, settings are their defaults."""
    root: dict[str, Any] = {}
    for key, default, _ in config.describe():
        node = root
        parts = key.split(".")
        for part in parts[:-1]:
            if part.endswith("[]"):
                node = node.setdefault(part[:-2], [{}])[0]
            else:
                node = node.setdefault(part, {})
        node[parts[-1]] = default
    limit = {f.name: "1" for f in dataclasses.fields(config.LimitSpec)}
    rl = root["rate_limits"]
    rl["default"], rl["tenants"] = dict(limit), {"*": dict(limit)}  # "*": any tenant name
    return root


NAMES = ["github", "demo", "acme", "a", "A_b.c-d", "x" * 64, "x" * 65, "", "a b", "a/b", "é"]
TRICKY = [
    "",
    " ",
    "\n",
    "\x00",
    "é",
    "127.0.0.1:8080",
    "0.0.0.0:9999",
    "[::1]:80",
    "localhost:1",
    "host:",
    ":80",
    "a:0",
    "a:65536",
    "a:-1",
    "a:²",
    "a:١٢",
    "a:\uff11",  # a fullwidth digit, which int() takes
    "redis://",
    "redis://h:²/0",
    "redis://h:99999/0",
    "redis://u:p@h/0",
    "redis://h/²",
    "redis://[::1",
    "rediss://h:6380/1",
    "unix://",
    "unix:///tmp/r.sock?db=x",
    "unix:///tmp/r.sock?db=²",
    "http://h/0",
    "7d",
    "0s",
    "36501d",
    "999999999999d",
    "1٣d",
    "a.b",
    "a..b",
    ".",
    "sha256=",
    "x-hub-signature-256",
    "bad header",
    "fsync",
    "os",
    "node",
    "fleet",
    "github",
    "stripe",
    "svix",
    "hex",
    "base64",
    "sha1",
    "sha512",
    "md5",
    *NAMES,
]
EDGE_INTS = [0, 1, -1, 2, 15, 16, 255, 1024, 65535, 65536, 2**31, 2**32, 2**63 - 1, -(2**63)]
EDGE_FLOATS = [0.0, -0.0, 1e-320, 1e-12, 0.1, 1.0, 1e6, 1e300, float("inf"), float("-inf")]
EDGE_FLOATS.append(float("nan"))

scalars = st.one_of(
    st.booleans(),
    st.integers(-(2**63), 2**63 - 1),
    st.sampled_from(EDGE_INTS),
    st.floats(),
    st.sampled_from(EDGE_FLOATS),
    st.text(max_size=40),
    st.sampled_from(TRICKY),
    st.datetimes(),
    st.dates(),
)
junk_keys = st.one_of(st.sampled_from(["x", "Server", "listen ", "", "a.b", "\n"]), st.text())
toml_values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(junk_keys, inner, max_size=3),
    max_leaves=8,
)


def _plausible(default: Leaf) -> st.SearchStrategy[Any]:
    """Mostly the default itself or a value of its type, so that most documents get past
    their first key to the checks further in; now and then anything at all."""
    try:  # as TOML, which describe() writes, "(none)" for a setting unset
        value = None if default == "(none)" else tomllib.loads(f"v = {default}")["v"]
    except tomllib.TOMLDecodeError:
        return toml_values
    if value is None:
        return weighted((3, _typed(value)), (1, toml_values))
    return weighted((3, st.just(value)), (4, _typed(value)), (1, toml_values))


def weighted(*choices: tuple[int, st.SearchStrategy[Any]]) -> st.SearchStrategy[Any]:
    """One of ``choices``, each as often as its weight says (``one_of`` favours none)."""
    picks = [i for i, (w, _) in enumerate(choices) for _ in range(w)]
    return st.sampled_from(picks).flatmap(lambda i: choices[i][1])


def _typed(value: Any) -> st.SearchStrategy[Any]:
    if isinstance(value, bool):
        return st.booleans()
    if isinstance(value, int):
        near = st.integers(min_value=value - 3, max_value=value + 3)
        return st.one_of(st.sampled_from(EDGE_INTS), near, st.integers())
    if isinstance(value, float):
        return st.one_of(st.sampled_from(EDGE_FLOATS), st.floats())
    strings = st.one_of(st.sampled_from(TRICKY), st.text(max_size=30))
    if isinstance(value, list):
        return st.lists(strings, max_size=3)
    return strings  # a string, or None (a preset): a string is what it takes


def _table(node: dict[str, Any]) -> st.SearchStrategy[dict[str, Any]]:
    optional: dict[str, st.SearchStrategy[Any]] = {}
    for name, sub in node.items():
        if name == "*":
            continue
        optional[name] = _value(name, sub)
    real = st.fixed_dictionaries({}, optional=optional)
    if "*" in node:  # a table of names (rate_limits.tenants)
        real = st.dictionaries(st.one_of(st.sampled_from(NAMES), st.text()), _table(node["*"]))
    junk = weighted((15, st.just({})), (1, st.dictionaries(junk_keys, toml_values, max_size=2)))
    return st.builds(lambda a, b: {**b, **a}, real, junk)


def _value(name: str, node: Any) -> st.SearchStrategy[Any]:
    if isinstance(node, list):
        return st.lists(_table(node[0]), max_size=3)
    if isinstance(node, dict):
        return weighted((12, _table(node)), (1, toml_values))
    if name in ("id", "tenant", "header"):
        return weighted(
            (6, st.sampled_from(NAMES[:5])), (1, st.sampled_from(NAMES)), (1, st.text())
        )
    return _plausible(node)


def documents() -> st.SearchStrategy[dict[str, Any]]:
    return _table(schema())


def _key(k: str) -> str:
    return k if k and re.fullmatch(r"[A-Za-z0-9_-]+", k) else _string(k)


def _string(s: str) -> str:
    out = []
    for c in s:
        if c in '"\\':
            out.append("\\" + c)
        elif ord(c) < 0x20 or ord(c) == 0x7F:
            out.append(f"\\u{ord(c):04x}")
        else:
            out.append(c)
    return '"' + "".join(out) + '"'


def inline(v: Any) -> str:
    """One TOML value written inline (tables as inline tables)."""
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        if v != v:
            return "nan"
        if v in (float("inf"), float("-inf")):
            return "inf" if v > 0 else "-inf"
        return repr(v)
    if isinstance(v, str):
        return _string(v)
    if isinstance(v, datetime.date):
        return v.isoformat()
    if isinstance(v, list):
        return "[" + ", ".join(inline(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{_key(k)} = {inline(x)}" for k, x in v.items()) + "}"
    raise TypeError(f"not a TOML value: {v!r}")


def emit(doc: dict[str, Any]) -> str:
    """A small TOML emitter: scalars first, then ``[table]``s, then ``[[array]]``s."""
    plain, tables, arrays = [], [], []
    for k, v in doc.items():
        if isinstance(v, dict):
            tables.append((k, v))
        elif isinstance(v, list) and v and all(isinstance(x, dict) for x in v):
            arrays.append((k, v))
        else:
            plain.append(f"{_key(k)} = {inline(v)}")
    out = plain[:]
    for k, v in tables:
        out += [f"[{_key(k)}]", *(f"{_key(a)} = {inline(b)}" for a, b in v.items())]
    for k, items in arrays:
        for item in items:
            out += [f"[[{_key(k)}]]", *(f"{_key(a)} = {inline(b)}" for a, b in item.items())]
    return "\n".join(out) + "\n"


def _mutate_text(text: str, edits: list[tuple[int, int, str]]) -> str:
    for at, cut, insert in edits:
        i = at % (len(text) + 1)
        text = text[:i] + insert + text[i + cut :]
    return text


edits = st.lists(
    st.tuples(st.integers(0, 10_000), st.integers(0, 8), st.text(max_size=3)), min_size=1
)
_INPUTS: dict[str, st.SearchStrategy[bytes]] = {
    "document": documents().map(lambda d: emit(d).encode()),
    "edited": st.builds(lambda d, e: _mutate_text(emit(d), e).encode(), documents(), edits),
    "text": st.text().map(str.encode),
    "bytes": st.binary(),
}
# Mostly documents over the schema; some edited into broken TOML, some not TOML at all.
config_inputs: st.SearchStrategy[bytes] = st.sampled_from(
    ["document"] * 7 + ["edited", "text", "bytes"]
).flatmap(_INPUTS.__getitem__)


def check_config(path: Path, data: bytes) -> Outcome:
    """``load`` gives a Config, or a one-line ConfigError that starts with the path."""
    path.write_bytes(data)
    try:
        cfg = config.load(path)
    except config.ConfigError as e:
        msg = str(e)
        if not msg.startswith(str(path)):
            return Outcome(CRASH, f"ConfigError not naming the file: {msg!r}")
        if "\n" in msg or "\r" in msg:
            if not set("\r\n") & set(msg.rsplit(": ", 1)[-1]):  # the key's part, not the why
                return Outcome(KNOWN, "ConfigError-multiline@key")
            return Outcome(CRASH, f"ConfigError of more than one line: {msg!r}")
        return Outcome(ERROR)
    except Exception as e:
        return crash(e)
    if not isinstance(cfg, config.Config):
        return Outcome(CRASH, f"load returned {type(cfg).__name__}")
    return Outcome(OK)


def run_config(
    n: int, workdir: Path, tally: Tally, derandomize: bool, seed: int | None = None
) -> None:
    """``n`` hypothesis examples of ``config_inputs``, each judged by ``check_config``."""
    path = workdir / "fuzz.toml"

    @settings(
        max_examples=n,
        derandomize=derandomize,
        database=None,
        deadline=None,
        suppress_health_check=list(HealthCheck),
        phases=[Phase.explicit, Phase.generate],
    )
    @given(config_inputs)
    def one(data: bytes) -> None:
        outcome = check_config(path, data)
        tally.add(outcome, f"config input {data[:300]!r}")

    if seed is not None:
        one = hypothesis_seed(seed)(one)
    started = time.monotonic()
    one()
    tally.seconds += time.monotonic() - started


# == segment ==================================================================================

SEG_PARAMS = segmod.make_params(queue_capacity=16, gcra_slots=16, process_slots=4)
CASE_S = 10.0  # in-process bound of one case
CLI_S = 30.0  # a subprocess's bound (its own attach may wait 2 s for "ready")


def _word(v: int) -> bytes:
    return struct.pack("<Q", v & (2**64 - 1))


MUTATIONS: tuple[str, ...] = ("bytes", "truncate", "fill", "blob", "slot", "params")
MUTATIONS += ("header", "header", "region", "region")  # the words most code reads


class SegmentFuzz:
    """One real segment, made recognisable once (config, a live process slot, queued
    records, counts), then restored from that copy before each corruption."""

    def __init__(self, name: str) -> None:
        self.name = name
        seg = Segment.create(name, SEG_PARAMS)
        try:
            seg.write_config({"fleet": {"breaker_window_ms": 20_000}, "sources": 1})
            seg.blob("sources").write(["github", "demo"])
            slot = procs.claim(seg.view, seg.layout, procs.Role.SUPERVISOR)
            slot.counters.add(Counter.REQUESTS, 5)
            q = SettleQueue(seg.view, seg.buf, seg.layout)
            for i in range(3):
                q.push(Record(Op.PROMOTE, b"k%d" % i, bytes(16), b"h%d" % i, 1, 2, 3))
            self.layout = seg.layout
            self.pristine = bytes(seg.buf)
        finally:
            seg.close()
        self.size = len(self.pristine)
        self.fd = os.open(f"/dev/shm/{name}", os.O_RDWR)

    def close(self) -> None:
        os.close(self.fd)
        segmod.unlink(self.name)

    def reset(self) -> None:
        os.ftruncate(self.fd, self.size)
        os.pwrite(self.fd, self.pristine, 0)

    def values(self, rng: random.Random) -> int:
        return rng.choice(
            [
                0,
                1,
                2,
                3,
                -1,
                -2,
                7,
                2**31 - 1,
                2**32,
                2**62,
                2**63 - 1,
                -(2**63),
                L.PID_MASK,
                L.PID_MASK + 1,
                L.MAGIC,
                L.LAYOUT_VERSION,
                self.size,
                self.size + 4096,
                L.HEADER_BYTES,
                os.getpid(),
                L.QS_WRITING | rng.randrange(64),
                L.QS_ABANDONED | rng.randrange(64),
                rng.getrandbits(64),
                rng.getrandbits(8),
                rng.getrandbits(40),
                int(time.time_ns()) + rng.choice([-1, 1]) * rng.getrandbits(60),
            ]
        )

    def mutate(self, rng: random.Random) -> str:
        """Corrupt the segment one to three ways; returns what was done, to replay it."""
        done = []
        for _ in range(rng.choice([1, 1, 1, 2, 3])):
            how = rng.choice(MUTATIONS)
            done.append(getattr(self, "_" + how)(rng))
        return "; ".join(done)

    def _put(self, at: int, data: bytes) -> None:
        os.pwrite(self.fd, data, at)

    def _bytes(self, rng: random.Random) -> str:
        at = rng.randrange(L.HEADER_BYTES if rng.random() < 0.4 else self.size)
        n = rng.choice([1, 2, 8, 16, 64, rng.randrange(1, 8192)])
        fill = rng.choice(["random", "zero", "ff"])
        data = {"random": rng.randbytes(n), "zero": bytes(n), "ff": b"\xff" * n}[fill]
        self._put(at, data)
        return f"{fill} bytes [{at}, {at + n})"

    def _truncate(self, rng: random.Random) -> str:
        bounds = [off for off, _ in self.layout.regions.values()]
        sizes = [0, 1, 8, 100, L.HEADER_BYTES - 1, L.HEADER_BYTES, L.HEADER_BYTES + 8]
        sizes += [rng.choice(bounds) + rng.choice([-8, 0, 8]), self.size - 4096, self.size - 1]
        sizes += [self.size + 4096, rng.randrange(self.size)]
        size = rng.choice(sizes)
        os.ftruncate(self.fd, size)
        return f"truncate to {size}"

    def _header(self, rng: random.Random) -> str:
        named = [L.H_MAGIC, L.H_VERSION, L.H_TOTAL_SIZE, L.H_READY, L.H_OWNER_PID]
        named += [L.H_OWNER_BIRTH_NS, L.H_CREATED_NS, L.H_OWNER_START]
        named += list(L.param_offsets().values())
        named += [o for r in L.REGIONS for o in L.region_offsets(r)]
        at = rng.choice(named) if rng.random() < 0.8 else 8 * rng.randrange(L.HEADER_BYTES // 8)
        v = self.values(rng)
        self._put(at, _word(v))
        return f"header word {at} = {v}"

    def _region(self, rng: random.Random) -> str:
        region = rng.choice(L.REGIONS)
        off, size = self.layout.regions[region]
        words = []
        for _ in range(rng.randrange(1, 6)):
            at = off + 8 * rng.randrange(min(size, 1024) // 8 if rng.random() < 0.7 else size // 8)
            v = self.values(rng)
            self._put(at, _word(v))
            words.append(f"{at}={v}")
        return f"{region} words " + ",".join(words)

    def _fill(self, rng: random.Random) -> str:
        region = rng.choice(L.REGIONS)
        off, size = self.layout.regions[region]
        fill = rng.choice(["random", "ff", "words"])
        if fill == "words":
            data = b"".join(_word(self.values(rng)) for _ in range(size // 8))
        else:
            data = rng.randbytes(size) if fill == "random" else b"\xff" * size
        self._put(off, data)
        return f"{region} filled with {fill}"

    def _blob(self, rng: random.Random) -> str:
        region = rng.choice(["config", "sources", "overrides"])
        off = self.layout.offset(region)
        doc = rng.choice(
            [
                b"[]",
                b"{}",
                b"null",
                b'"x"',
                b"1e999",
                b'{"fleet": {"breaker_window_ms": 0}}',
                b'{"fleet": {"breaker_window_ms": -5}}',
                b'{"fleet": {"breaker_window_ms": 99999999999999999999}}',
                b'{"fleet": {"breaker_window_ms": 1.5}}',
                b'{"fleet": []}',
                b'["a", 1, null, {"x": 2}]',
                json.dumps([f"s{i}" for i in range(300)]).encode(),
                b"[" * 5000,
                rng.randbytes(rng.randrange(1, 200)),
            ]
        )
        # An odd generation is a writer mid-write: a reader retries for 0.1 s, so rarely.
        gen = rng.choice([0, 2, 4] * 6 + [1, -1, 2**63 - 1])
        length = rng.choice([len(doc), len(doc), 0, -1, 2**40, L.BLOB_BYTES[region]])
        self._put(off + L.BLOB_DATA, doc[: L.BLOB_BYTES[region] - L.BLOB_DATA])
        self._put(off + L.BLOB_LENGTH, _word(length))
        self._put(off + L.BLOB_GENERATION, _word(gen))
        return f"{region} blob gen {gen} length {length} doc {doc[:40]!r}"

    def _slot(self, rng: random.Random) -> str:
        i = rng.randrange(SEG_PARAMS.process_slots)
        base = self.layout.offset("processes") + i * L.PROCESS_SLOT_BYTES
        pid = rng.choice([os.getpid(), 1, 0, L.PID_MASK, rng.randrange(1, L.PID_MASK)])
        word = (
            rng.getrandbits(L.START_BITS) << L.PS_START_SHIFT
            | rng.randrange(16) << L.PS_ROLE_SHIFT
            | rng.randrange(4) << L.PS_STATE_SHIFT
            | pid
        )
        self._put(base + L.PS_HEADER, _word(word))
        for at in (L.PS_STARTED_NS, L.PS_HEARTBEAT_MS, L.PS_CLAIMS, L.PS_REQUESTS_BASE):
            if rng.random() < 0.5:
                self._put(base + at, _word(self.values(rng)))
        return f"process slot {i} header {word:#x}"

    def _params(self, rng: random.Random) -> str:
        """A whole, consistent header for other sizes: the region table and total size
        agree with the params, so attach believes it and reads the old bytes anew."""
        p = dataclasses.replace(
            SEG_PARAMS,
            queue_capacity=rng.choice([2, 3, 16, 17, 1000]),
            gcra_slots=rng.choice([1, 8, 16, 4096]),
            process_slots=rng.choice([1, 2, 4, 64]),
        )
        lay = L.Layout.of(p)
        for fname, off in L.param_offsets().items():
            self._put(off, _word(getattr(p, fname)))
        for region, (offset, size) in lay.regions.items():
            o_off, o_size = L.region_offsets(region)
            self._put(o_off, _word(offset))
            self._put(o_size, _word(size))
        self._put(L.H_TOTAL_SIZE, _word(lay.total_size))
        return f"consistent header for {p}"


def _one_line(err: str) -> bool:
    lines = err.strip().splitlines()
    return len(lines) == 1 and lines[0].startswith("ankusa-shm inspect: ")


def check_segment(name: str, as_json: bool) -> Outcome:
    """Attach read-only and take a snapshot, then ``inspect.run`` in this process: it
    renders, or it fails with a SegmentError / exit status 2 and one line."""
    try:
        with bounded(CASE_S):
            attached = True
            try:
                seg = Segment.attach(name, readonly=True)
            except SegmentError:
                attached = False
            if attached:
                # ValueError too: inspect.run turns it into its "corrupt" line, by design.
                with seg, contextlib.suppress(SegmentError, ValueError):
                    snapshot.take(seg)
            out, err = io.StringIO(), io.StringIO()
            with contextlib.redirect_stderr(err):
                code = inspect.run(name, as_json, None, out=out)
    except Hang as e:
        return Outcome(HANG, str(e))
    except Exception as e:
        return crash(e)
    if code == 0:
        if err.getvalue() or not out.getvalue():
            return Outcome(CRASH, f"exit 0 with stderr {err.getvalue()!r}")
        if as_json:
            try:
                json.loads(out.getvalue())
            except ValueError as e:
                return Outcome(CRASH, f"--json output is not JSON: {e}")
        return Outcome(OK)
    if code == inspect.EXIT_UNUSABLE and _one_line(err.getvalue()) and not out.getvalue():
        return Outcome(ERROR)
    return Outcome(
        CRASH, f"exit {code}, stdout {out.getvalue()[:200]!r}, stderr {err.getvalue()!r}"
    )


def check_segment_cli(name: str, as_json: bool) -> Outcome:
    """The same, as the real command in a subprocess."""
    argv = [sys.executable, "-m", "ankusa_shm", "inspect", "--name", name]
    try:
        r = subprocess.run(
            argv + (["--json"] if as_json else []), capture_output=True, text=True, timeout=CLI_S
        )
    except subprocess.TimeoutExpired:
        return Outcome(HANG, f"inspect ran past {CLI_S} s")
    if "Traceback" in r.stderr:
        return Outcome(CRASH, r.stderr[-1000:])
    if r.returncode == 0 and r.stdout and not r.stderr:
        return Outcome(OK)
    if r.returncode == 2 and _one_line(r.stderr) and not r.stdout:
        return Outcome(ERROR)
    return Outcome(CRASH, f"exit {r.returncode}, stderr {r.stderr[-500:]!r}")


def run_segment(
    n: int, name: str, tally: Tally, seed: int, cli_every: int = 0, ready_wait_s: float = 0.05
) -> None:
    """``n`` corruptions of one segment; every ``cli_every``-th also as a subprocess.

    ``ready_wait_s`` shortens attach's wait for a segment marked not ready (2 s), which a
    corrupted ready word would otherwise cost every such case in this process."""
    fuzz = SegmentFuzz(name)
    saved = segmod._READY_WAIT_S
    segmod._READY_WAIT_S = ready_wait_s
    started = time.monotonic()
    try:
        for i in range(n):
            rng = random.Random(f"segment:{seed}:{i}")
            fuzz.reset()
            what = fuzz.mutate(rng)
            as_json = rng.random() < 0.5
            outcome = check_segment(name, as_json)
            if outcome.kind in (OK, ERROR) and cli_every and i % cli_every == 0:
                outcome = check_segment_cli(name, as_json)
            tally.add(outcome, f"segment case {seed}:{i} ({what}, json={as_json})")
    finally:
        segmod._READY_WAIT_S = saved
        fuzz.close()
        tally.seconds += time.monotonic() - started


# == HTTP =====================================================================================

FUZZ_SERVER: dict[str, Any] = {
    "workers": 2,
    "admin_listen": "",  # the admin listener is not this fuzzer's target
    "header_timeout_s": 0.5,
    "body_timeout_s": 0.5,
    "keepalive_timeout_s": 1.0,
    "max_body_bytes": 4096,
    "max_header_bytes": 8192,
}
MAX_BODY = FUZZ_SERVER["max_body_bytes"]
FUZZ_REST = (
    """
[rate_limits]
default = { rate = 100000, burst = 100000 }
"""
    + GITHUB_SOURCE
    + """
[[sources]]
id = "demo"
tenant = "demo"
dedupe = { json_path = "id" }

[[sources]]
id = "nested"
tenant = "demo"
dedupe = { json_path = "data.items.0.id" }
"""
)
FUZZ_ENV = {"GH_SECRET": SECRET}
# The longest a case may wait for the server to answer or close: its own timeouts (a
# request head, a body, an idle keep-alive, the linger after an error, two sweeps) and a
# margin for a loaded machine. Past this, the case is a hang.
HANG_S = sum(FUZZ_SERVER[k] for k in ("header_timeout_s", "body_timeout_s", "keepalive_timeout_s"))
HANG_S += LINGER_S + 2 * SWEEP_S + 4.0
ALLOWED = frozenset({201, 400, 401, 404, 405, 408, 409, 413, 429, 431, 501, 503})
ANY = ALLOWED


@dataclass(frozen=True)
class Expect:
    """What one request of a case must be answered."""

    statuses: frozenset[int]
    source: str = ""
    key: bytes | None = None  # the event key a 201 must be stored under
    keyed: bool = False  # whether ``key`` is known (a None key: stored without one)
    body: bytes | None = None  # the body a 201 must be stored with


@dataclass(frozen=True)
class HttpCase:
    name: str
    family: str
    data: bytes
    expects: tuple[Expect, ...] = ()
    all_answered: bool = False  # every request in ``expects`` must get its answer
    half_close: bool = True
    counted: bool = True  # no more answers than ``expects`` (when it is not empty)
    # the last of ``expects`` is a tail that may be cut short (a body that never comes,
    # then the client's half-close): it owes no answer, the requests before it do
    tail: bool = False


@dataclass(frozen=True)
class Response:
    status: int
    headers: dict[str, str]
    body: bytes


@dataclass
class CaseResult:
    case: HttpCase
    outcome: Outcome
    responses: list[Response]


# -- building requests -------------------------------------------------------------------------


def head(method: bytes, target: bytes, headers: list[tuple[bytes, bytes]], version: bytes) -> bytes:
    lines = [method + b" " + target + b" " + version]
    lines += [k + b": " + v for k, v in headers]
    return b"\r\n".join(lines) + b"\r\n\r\n"


def chunked(body: bytes, rng: random.Random) -> bytes:
    out, i = [], 0
    while i < len(body):
        n = rng.randint(1, max(1, len(body) - i))
        size = f"{n:x}"
        size = rng.choice([size, size.upper(), "0" * rng.randint(1, 3) + size])
        ext = rng.choice([b"", b"", b";a=b", b';name="v"'])
        out.append(size.encode() + ext + b"\r\n" + body[i : i + n] + b"\r\n")
        i += n
    trailer = rng.choice([b"", b"", b"x-trailer: 1\r\n"])
    return b"".join(out) + b"0\r\n" + trailer + b"\r\n"


HOSTS = [b"127.0.0.1", b"127.0.0.1:8080", b"edge.example.com", b"[::1]:8080", b"", b"a-b_c~d:"]
BAD_HOSTS = [b"a b", b"a/b", b"user@a", b"[::1", b"a:80x", b"a\xff", b"a?b", b"a:8080:1"]


def framed(
    rng: random.Random,
    path: bytes,
    headers: dict[str, str],
    body: bytes,
    method: bytes = b"POST",
    version: bytes = b"HTTP/1.1",
    extra: list[tuple[bytes, bytes]] | None = None,
) -> bytes:
    """One well-formed request, its body by Content-Length or chunked, names in any case."""
    hs = [(_case(rng, k).encode(), v.encode()) for k, v in headers.items()]
    hs += extra or []
    if version == b"HTTP/1.1" or rng.random() < 0.5:  # HTTP/1.0 may leave it out
        hs.insert(0, (_case(rng, "host").encode(), rng.choice(HOSTS)))
    use_chunks = version == b"HTTP/1.1" and rng.random() < 0.3 and body
    if use_chunks:
        hs.append((b"Transfer-Encoding", b"chunked"))
        payload = chunked(body, rng)
    else:
        hs.append((_case(rng, "content-length").encode(), str(len(body)).encode()))
        payload = body
    rng.shuffle(hs)
    return head(method, path, hs, version) + payload


def _case(rng: random.Random, name: str) -> str:
    return rng.choice([name, name.upper(), name.title()])


# -- case families --------------------------------------------------------------------------


def _github(rng: random.Random, delivery: str, n: int = 0) -> tuple[bytes, Expect]:
    body = json.dumps({"delivery": delivery, "n": n, "pad": "x" * rng.randrange(64)}).encode()
    req = framed(rng, b"/hooks/github", signed(body, delivery), body)
    return req, Expect(frozenset({201}), "github", delivery.encode(), True, body)


IDS: list[Any] = ["a", "evt_1", "ü", "", " sp ", "\u0000", "x" * 300, 0, 1, -7, 2**70]
NO_KEY: list[Any] = [1.5, True, False, None, [], {}, {"id": "inner"}, "", 10**5000]


def _demo(rng: random.Random, name: str) -> tuple[bytes, Expect]:
    """The demo (``id``) and nested (``data.items.0.id``) sources, with odd ids."""
    nested = rng.random() < 0.3
    roll = rng.random()
    if roll < 0.45:  # a key: one of a few, so resends meet their first
        v: Any = rng.choice(IDS)
    elif roll < 0.6:
        v = f"{name}-" + rng.choice(string.ascii_letters) * rng.randrange(1, 400)
    else:
        v = rng.choice(NO_KEY)
    doc: Any = {"data": {"items": [{"id": v}, 2]}} if nested else {"id": v, "amount": 42}
    if roll > 0.95:
        body = rng.choice([b"{", b"not json", b'{"id": "a"', b"\xff\xfe", b"[1,2]", b'"id"'])
    elif v == 10**5000:
        body = b'{"id": ' + b"9" * 5000 + b"}"  # an integer too long for int()
    else:
        body = json.dumps(doc, ensure_ascii=rng.random() < 0.5).encode()
    keyed = roll <= 0.95 and v != 10**5000
    key: bytes | None = None
    if keyed and isinstance(v, str) and v:
        key = v.encode("utf-8", "surrogatepass")
    elif keyed and type(v) is int:
        key = str(v).encode()
    source = "nested" if nested else "demo"
    expect = frozenset({201, 413}) if len(body) > MAX_BODY else frozenset({201})
    req = framed(rng, b"/hooks/" + source.encode(), {"content-type": "application/json"}, body)
    return req, Expect(expect, source, key, True, body)


def _bad_signature(rng: random.Random, name: str) -> tuple[bytes, Expect]:
    body = json.dumps({"bad": name}).encode()
    headers = signed(body, name)
    good = headers["x-hub-signature-256"]
    headers["x-hub-signature-256"] = rng.choice(
        [
            signed(body, secret="wrong")["x-hub-signature-256"],
            good[:-1],
            good + "0",
            good[:-1] + ("0" if good[-1] != "0" else "1"),
            good.replace("sha256=", "sha1="),
            good.replace("sha256=", ""),
            good.upper(),
            good[:7] + " " + good[7:],
            good[:7] + "zz" + good[9:],
            "sha256=",
            "",
            "sha256=" + "é" * 64,
        ]
    )
    if rng.random() < 0.15:
        del headers["x-hub-signature-256"]
    tampered = body + b" " if rng.random() < 0.1 else body
    if tampered != body:
        headers["x-hub-signature-256"] = good
    return framed(rng, b"/hooks/github", headers, tampered), Expect(frozenset({401}))


METHODS = [b"GET", b"PUT", b"DELETE", b"PATCH", b"OPTIONS", b"POST", b"post", b"PoSt"]
METHODS += [b"FOO", b"CONNECT", b"TRACE", b"G\x00T", b"", b"POST POST", b"\xff"]


def _route(rng: random.Random, name: str) -> tuple[bytes, Expect]:
    method = rng.choice(METHODS)
    path = rng.choice(
        [
            b"/",
            b"/hooks",
            b"/hooks/",
            b"/hooks/unknown",
            b"/hooks/github/extra",
            b"/hooks/demo?x=1&y",
            b"/hooks/%64emo",
            b"/hooks/../hooks/demo",
            b"/HOOKS/demo",
            b"*",
            b"http://x/hooks/demo",
            b"/hooks/" + b"a" * 3000,
            b"/hooks/d\xc3\xa9mo",
            b"/hooks/demo#frag",
            b"//hooks/demo",
            b"/hooks/demo\x00",
            b"",
        ]
    )
    body = b'{"id": "route-%s"}' % name.encode()
    req = framed(rng, path, {}, body, method=method)
    if method == b"POST" and path in (b"/hooks/demo?x=1&y", b"http://x/hooks/demo"):
        return req, Expect(frozenset({201}), "demo", body[8:-2], True, body)
    return req, Expect(ANY - {201})


def _flood(rng: random.Random, name: str) -> tuple[bytes, Expect]:
    count, size = rng.choice([(200, 64), (10, 1000), (1, 9000), (100, 10), (3000, 1)])
    over = count * (size + 10) > FUZZ_SERVER["max_header_bytes"]
    extra = [(b"x-pad-%d" % i, b"v" * size) for i in range(count)]
    body = b'{"id": "flood-%s"}' % name.encode()
    req = framed(rng, b"/hooks/demo", {}, body, extra=extra)
    if over:
        return req, Expect(frozenset({431}))
    return req, Expect(frozenset({201, 431}))


BAD_HEADERS = [
    b"bad name: v",
    b"nocolon",
    b": empty-name",
    b"x-a:\x00v",
    b"x-a: v\r\n folded",
    b"x\x7f: v",
    b"x-a: \x01\x02",
    b"x-\xc3\xa9: v",
    b"x-a : v",
    b"x-a:v\rv",
    b"x-a: \xff\xfe",
    b"(x): v",
]


def _bad_header(rng: random.Random, name: str) -> tuple[bytes, Expect]:
    body = b'{"id": "hdr-%s"}' % name.encode()
    hs = [(b"host", b"x"), (b"content-length", str(len(body)).encode())]
    good = head(b"POST", b"/hooks/demo", hs, b"HTTP/1.1")
    bad = rng.choice(BAD_HEADERS)
    at = good.index(b"\r\n") + 2
    return good[:at] + bad + b"\r\n" + good[at:] + body, Expect(ANY)


CONFLICTS = [
    [b"content-length: 2", b"content-length: 3"],
    [b"content-length: 2", b"content-length: 2"],
    [b"content-length: 2", b"transfer-encoding: chunked"],
    [b"transfer-encoding: chunked", b"content-length: 2"],
    [b"transfer-encoding: gzip"],
    [b"transfer-encoding: gzip, chunked"],
    [b"transfer-encoding: chunked, gzip"],
    [b"transfer-encoding: chunked", b"transfer-encoding: chunked"],
    [b"transfer-encoding: identity"],
    [b"transfer-encoding:  chunked "],
    [b"transfer-encoding: xchunked"],
    [b"content-length: -1"],
    [b"content-length: +2"],
    [b"content-length: 0x2"],
    [b"content-length: 2 2"],
    [b"content-length: 99999999999999999999999999"],
    [b"content-length: 4096"],
    [b"content-length: 4097"],
    [b"content-length: "],
    [b"content-length: \xd9\xa2"],
]


def _framing(rng: random.Random, name: str) -> tuple[bytes, Expect]:
    hs = rng.choice(CONFLICTS)
    body = rng.choice(
        [b"{}", b"2\r\n{}\r\n0\r\n\r\n", b"{}POST /hooks/demo HTTP/1.1\r\nhost: x\r\n\r\n"]
    )
    return b"POST /hooks/demo HTTP/1.1\r\nhost: x\r\n" + b"\r\n".join(
        hs
    ) + b"\r\n\r\n" + body, Expect(ANY)


BAD_CHUNKS = [
    b"zz\r\nab\r\n0\r\n\r\n",
    b"-1\r\nab\r\n0\r\n\r\n",
    b"2\r\nabc\r\n0\r\n\r\n",
    b"2\r\nab0\r\n\r\n",
    b"2\nab\n0\n\n",
    b"ffffffffffffffffffff\r\n",
    b"7fffffffffffffff\r\nab",
    b"1001\r\n" + b"x" * 4097 + b"\r\n0\r\n\r\n",
    b"2 \r\nab\r\n0\r\n\r\n",
    b"2;\x00\r\nab\r\n0\r\n\r\n",
    b"0\r\nbad trailer\r\n\r\n",
    b"2\r\nab\r\n",
    b"\r\n\r\n",
    b"".join(b"1000\r\n" + b"x" * 4096 + b"\r\n" for _ in range(2)) + b"0\r\n\r\n",
]


def _bad_chunks(rng: random.Random, name: str) -> tuple[bytes, Expect]:
    h = b"POST /hooks/demo HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\n\r\n"
    return h + rng.choice(BAD_CHUNKS), Expect(ANY)


def _oversize(rng: random.Random, name: str) -> tuple[bytes, Expect]:
    n = rng.choice([MAX_BODY + 1, MAX_BODY * 3, 10**9, 2**63])
    if rng.random() < 0.5:
        req = b"POST /hooks/demo HTTP/1.1\r\nhost: x\r\ncontent-length: %d\r\n\r\n" % n
        return req + b"x" * min(n, rng.choice([0, 10, 5000])), Expect(frozenset({413}))
    extra = [(b"expect", b"100-continue")] if rng.random() < 0.3 else []
    body = b"x" * rng.choice([MAX_BODY + 1, 3 * MAX_BODY])
    hs = [(b"host", b"x"), (b"transfer-encoding", b"chunked"), *extra]
    return head(b"POST", b"/hooks/demo", hs, b"HTTP/1.1") + chunked(body, rng), Expect(
        frozenset({413})
    )


def _exact_max(rng: random.Random, name: str) -> tuple[bytes, Expect]:
    delivery = f"{name}-max"
    prefix = json.dumps({"delivery": delivery, "pad": ""}).encode()
    body = prefix[:-2] + b"x" * (MAX_BODY - len(prefix)) + b'"}'
    extra = [(b"expect", b"100-continue")] if rng.random() < 0.3 else []
    req = framed(rng, b"/hooks/github", signed(body, delivery), body, extra=extra)
    return req, Expect(frozenset({201}), "github", delivery.encode(), True, body)


def _bad_host(rng: random.Random, name: str) -> tuple[bytes, Expect]:
    """An HTTP/1.1 request without a Host field, with two, or with a malformed one: 400."""
    body = b'{"id": "host-%s"}' % name.encode()
    hs = [(b"content-length", str(len(body)).encode())]
    roll = rng.randrange(3)
    if roll == 1:
        hs += [(b"host", rng.choice(HOSTS)), (_case(rng, "host").encode(), rng.choice(HOSTS))]
    elif roll == 2:
        hs.append((b"host", rng.choice(BAD_HOSTS)))
    rng.shuffle(hs)
    return head(b"POST", b"/hooks/demo", hs, b"HTTP/1.1") + body, Expect(frozenset({400}))


def _mutate_bytes(data: bytes, rng: random.Random) -> bytes:
    b = bytearray(data)
    for _ in range(rng.randint(1, 5)):
        if not b:
            break
        i = rng.randrange(len(b))
        op = rng.randrange(6)
        if op == 0:
            b[i] ^= 1 << rng.randrange(8)
        elif op == 1:
            b[i:i] = rng.randbytes(rng.randint(1, 8))
        elif op == 2:
            del b[i : i + rng.randint(1, 16)]
        elif op == 3:
            j = rng.randrange(len(b))
            b[i:i] = b[j : j + rng.randint(1, 32)]
        elif op == 4:
            b[i] = rng.choice(b"\r\n :\x00\x7f\xff0")
        else:
            b[:] = bytes(b).replace(b"\r\n", b"\n", 1)
    return bytes(b)


# A family returns (bytes, what it must be answered); a case strings one or more together.
Family = Callable[[random.Random, str], tuple[bytes, Expect]]
REQUESTS: dict[str, Family] = {
    "github": lambda rng, name: _github(rng, name),
    "resend": lambda rng, name: _github(rng, f"resend-{rng.randrange(8)}"),
    "demo": _demo,
    "bad_signature": _bad_signature,
    "route": _route,
    "flood": _flood,
    "bad_header": _bad_header,
    "framing": _framing,
    "bad_chunks": _bad_chunks,
    "oversize": _oversize,
    "exact_max": _exact_max,
    "bad_host": _bad_host,
}
WHOLE = ("github", "resend", "demo", "bad_signature", "route", "exact_max")  # keep-alive safe


def http_case(seed: int, index: int) -> HttpCase:
    rng = random.Random(f"http:{seed}:{index}")
    name = f"fz{seed}-{index}"
    roll = rng.random()
    if roll < 0.45:
        family = rng.choice(list(REQUESTS))
        data, expect = REQUESTS[family](rng, name)
        whole = family in WHOLE and expect.statuses <= {201, 401, 404, 405}
        return HttpCase(name, family, data, (expect,), all_answered=whole)
    if roll < 0.6:  # a pipeline of whole requests, perhaps ending with something bad
        parts = [REQUESTS[rng.choice(WHOLE)](rng, f"{name}-{k}") for k in range(rng.randint(2, 8))]
        tail = b""
        if rng.random() < 0.3:
            tail, _ = REQUESTS[rng.choice(list(REQUESTS))](rng, f"{name}-tail")
        data = b"".join(p for p, _ in parts) + tail
        # answered whatever the tail: an error ends the connection after them, not instead
        whole = all(e.statuses <= {201, 401, 404, 405} for _, e in parts)
        expects = tuple(e for _, e in parts) + ((Expect(ANY),) if tail else ())
        return HttpCase(
            name, "pipeline", data, expects, all_answered=whole, counted=not tail, tail=bool(tail)
        )
    if roll < 0.72:
        family = rng.choice(list(REQUESTS))
        data, _ = REQUESTS[family](rng, name)
        return HttpCase(name, "mutated-" + family, _mutate_bytes(data, rng))
    if roll < 0.78:
        start = rng.choice([b"", b"POST ", b"POST /hooks/demo HTTP/1.1\r\nhost: x\r\n"])
        return HttpCase(name, "garbage", start + rng.randbytes(rng.randint(1, 3000)))
    if roll < 0.86:  # cut short: half-closed (no answer owed) or left hanging (408)
        data, _ = REQUESTS[rng.choice(WHOLE)](rng, name)
        cut = data[: rng.randrange(1, len(data))]
        if rng.random() < 0.5:
            return HttpCase(name, "truncated", cut)
        stalled = Expect(frozenset({408, 400, 413}))  # or what its head already says
        return HttpCase(name, "stalled", cut, (stalled,), True, False)
    if roll < 0.9:  # HTTP/1.0 and connection: close, last in a pipeline
        body = b'{"id": "%s-close"}' % name.encode()
        version = rng.choice([b"HTTP/1.0", b"HTTP/1.1"])
        extra = [(b"connection", b"close")] if version == b"HTTP/1.1" or rng.random() < 0.5 else []
        req = framed(rng, b"/hooks/demo", {}, body, version=version, extra=extra)
        e = Expect(frozenset({201}), "demo", f"{name}-close".encode(), True, body)
        return HttpCase(name, "close", req, (e,), True, rng.random() < 0.5)
    if roll < 0.93:
        return HttpCase(name, "idle", b"", (), False, False)
    data, expect = REQUESTS[rng.choice(WHOLE)](rng, name)
    return HttpCase(name, "keepalive", data, (expect,), expect.statuses == {201}, False)


# -- running cases --------------------------------------------------------------------------

_STATUS = re.compile(rb"HTTP/1\.1 (\d{3}) [^\r\n]*")


def parse(stream: bytes) -> tuple[list[Response], str]:
    """The responses in ``stream``, and what is wrong with it ('' when nothing)."""
    out: list[Response] = []
    at = 0
    while at < len(stream):
        end = stream.find(b"\r\n\r\n", at)
        if end < 0:
            return out, f"a partial head at {at}: {stream[at : at + 80]!r}"
        lines = stream[at:end].split(b"\r\n")
        m = _STATUS.fullmatch(lines[0])
        if m is None:
            return out, f"not a status line: {lines[0][:80]!r}"
        headers: dict[str, str] = {}
        for line in lines[1:]:
            k, sep, v = line.partition(b": ")
            if not sep:
                return out, f"not a header line: {line[:80]!r}"
            headers[k.decode("latin-1")] = v.decode("latin-1")
        at = end + 4
        status = int(m[1])
        if status == 100:
            continue
        n = headers.get("content-length", "")
        if not n.isdigit() or at + int(n) > len(stream):
            return out, f"a {status} without its whole body"
        out.append(Response(status, headers, stream[at : at + int(n)]))
        at += int(n)
    return out, ""


def exchange(port: int, case: HttpCase) -> tuple[bytes, str]:
    """Send the case and read until the server closes; (bytes, 'hang' / 'reset' / '')."""
    deadline = time.monotonic() + HANG_S
    out = b""
    with socket.create_connection(("127.0.0.1", port), timeout=HANG_S) as s:
        try:
            s.sendall(case.data)
            if case.half_close:
                s.shutdown(socket.SHUT_WR)
        except (BrokenPipeError, ConnectionResetError):
            pass  # it stopped reading: whatever it answered is still to be read
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return out, "hang"
            s.settimeout(left)
            try:
                chunk = s.recv(65536)
            except TimeoutError:
                return out, "hang"
            except ConnectionResetError:
                return out, "reset"
            if not chunk:
                return out, ""
            out += chunk


def judge(case: HttpCase, stream: bytes, how: str) -> CaseResult:
    responses, wrong = parse(stream)
    if how == "hang":
        got = f"{len(responses)} answers" if responses else "no answer"
        return CaseResult(case, Outcome(HANG, f"not closed after {HANG_S} s ({got})"), responses)
    if wrong and not (how == "reset" and not responses):
        return CaseResult(case, Outcome(CRASH, f"malformed answer: {wrong}"), responses)
    for i, r in enumerate(responses):
        if r.status not in ALLOWED:
            return CaseResult(case, Outcome(CRASH, f"answer {i} is {r.status}"), responses)
        try:
            doc = json.loads(r.body)
        except ValueError:
            return CaseResult(case, Outcome(CRASH, f"answer {i} is not JSON"), responses)
        if r.status == 201 and not (isinstance(doc, dict) and isinstance(doc.get("id"), str)):
            return CaseResult(case, Outcome(CRASH, f"a 201 without an id: {r.body!r}"), responses)
        if i < len(case.expects) and r.status not in case.expects[i].statuses:
            want = sorted(case.expects[i].statuses)
            detail = f"answer {i} is {r.status} {r.body!r}, not one of {want}"
            return CaseResult(case, Outcome(CRASH, detail), responses)
    if case.all_answered and len(responses) < len(case.expects) - case.tail:
        detail = f"{len(responses)} answers to {len(case.expects)} requests"
        return CaseResult(case, Outcome(CRASH, detail), responses)
    if case.expects and case.counted and len(responses) > len(case.expects):
        detail = f"{len(responses)} answers to {len(case.expects)} requests"
        return CaseResult(case, Outcome(CRASH, detail), responses)
    kind = OK if responses and all(r.status == 201 for r in responses) else ERROR
    return CaseResult(case, Outcome(kind), responses)


class HttpFuzz:
    """A running service and what the fuzzer learnt of it: which event key each hook was
    stored under, and the children that must still be the same ones at the end."""

    def __init__(self, svc: Service, tally: Tally) -> None:
        self.svc = svc
        self.tally = tally
        self.pids = {role: svc.pids(role) for role in ("worker", "drainer")}
        self.ids: dict[tuple[str, bytes], str] = {}
        self.firsts: dict[tuple[str, bytes], int] = {}
        self.batches = 0

    def batch(self, cases: list[HttpCase], threads: int = 16) -> None:
        started = time.monotonic()
        with ThreadPoolExecutor(threads) as pool:
            results = list(pool.map(self._one, cases))
        for r in results:
            self.tally.add(r.outcome, f"http case {r.case.name} [{r.case.family}]")
        self._stored(results)
        self._healthy()
        self.tally.seconds += time.monotonic() - started

    def _one(self, case: HttpCase) -> CaseResult:
        try:
            stream, how = exchange(self.svc.port, case)
        except OSError as e:  # no connection at all: the service is not there
            return CaseResult(case, Outcome(CRASH, f"cannot connect: {e!r}"), [])
        return judge(case, stream, how)

    def _stored(self, results: list[CaseResult]) -> None:
        """Every 201 is in the store, under the key it was sent with; one event, one hook."""
        for r in results:
            for i, resp in enumerate(r.responses):
                if resp.status != 201:
                    continue
                doc = json.loads(resp.body)
                hook = readers.get(self.svc.store_path, doc["id"])
                if hook is None:
                    self.tally.lost += 1
                    self.tally.failure(f"http case {r.case.name}: 201 {doc['id']} is not stored")
                    continue
                e = r.case.expects[i] if i < len(r.case.expects) else None
                if e is None or not e.keyed:
                    continue
                wrong = self._keyed(e, doc, hook.event_key, hook.body)
                if wrong:
                    self.tally.failure(f"http case {r.case.name} answer {i}: {wrong}")

    def _keyed(self, e: Expect, doc: dict[str, Any], key: bytes | None, body: bytes) -> str:
        duplicate = doc.get("duplicate") is True
        want = bounded_event_key(e.key) if e.key is not None else None
        if e.key is None:
            if duplicate or key is not None:
                return f"a hook without a key was a duplicate or stored with key {key!r}"
            return "" if body == e.body else "stored with another body"
        if key != want:
            return f"stored under key {key!r}, not {want!r}"
        k = (e.source, e.key)
        first = self.ids.setdefault(k, doc["id"])
        if first != doc["id"]:
            return f"key {e.key[:60]!r} answered {doc['id']}, and {first} before"
        if not duplicate:
            self.firsts[k] = self.firsts.get(k, 0) + 1
            if self.firsts[k] > 1:
                return f"key {e.key[:60]!r} stored as new twice"
            if body != e.body:
                return "stored with another body"
        return ""

    def _healthy(self) -> None:
        """After a batch: the same children, a clean log, and a hook still gets stored."""
        self.batches += 1
        svc = self.svc
        if svc.proc is None or svc.proc.poll() is not None:
            self.tally.restarts += 1
            self.tally.failure(f"batch {self.batches}: the supervisor exited")
            return
        now = {role: svc.pids(role) for role in self.pids}
        if now != self.pids:
            self.tally.restarts += 1
            self.tally.failure(f"batch {self.batches}: children {self.pids} are now {now}")
            self.pids = now
        log = svc.log()
        for word in ("Traceback", "died", " ERROR "):
            if word in log:
                at = log.index(word)
                self.tally.failure(f"batch {self.batches}: log has {word!r}: {log[at - 300 :]}")
        body = json.dumps({"probe": self.batches}).encode()
        delivery = f"probe-{os.getpid()}-{self.batches}-{time.monotonic_ns()}"
        try:
            answer = svc.post("github", body, signed(body, delivery))
        except OSError as e:
            self.tally.failure(f"batch {self.batches}: the probe hook got no answer: {e!r}")
            return
        hook = readers.get(svc.store_path, answer.body.get("id", ""))
        if answer.status != 201 or hook is None or hook.body != body:
            self.tally.failure(f"batch {self.batches}: probe answered {answer}, stored {hook}")


def fuzz_service(tmp: Path) -> Service:
    return Service(tmp, FUZZ_REST, server=FUZZ_SERVER, env=FUZZ_ENV)


def run_http(n: int, tmp: Path, tally: Tally, seed: int, batch: int = 250) -> None:
    """``n`` cases against one fresh service, in batches, with its health after each."""
    svc = fuzz_service(tmp)
    try:
        svc.start()
        fuzz = HttpFuzz(svc, tally)
        for first in range(0, n, batch):
            fuzz.batch([http_case(seed, i) for i in range(first, min(n, first + batch))])
    finally:
        svc.close()
