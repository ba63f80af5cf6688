"""Shared pieces of the fleet tests: configs, segments, forked "hosts", drainers, Redis.

A *host* here is one segment created by the test. Its request workers are children forked
with ``multiprocessing``'s fork context: each attaches to the segment by name, claims a
process slot and builds its own ``RedisStore`` and ``Fleet`` inside the child (never
inherited across fork), waits at a barrier shared by every child of the run so they all
start together, runs ``uvloop.run(body(worker))`` and sends the body's return value back
through a queue. A child that raised sends its traceback and the test fails with it.
Children are always joined with a timeout and killed if still running.

Everything else (fleets and drainers run by the test process itself, configs, TOML files,
subprocess drainers, Redis helpers) lives here too so the test files stay short.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import multiprocessing
import os
import queue
import signal
import subprocess
import sys
import time
import traceback
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Mapping, Sequence
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass
from multiprocessing.process import BaseProcess
from multiprocessing.queues import Queue
from multiprocessing.synchronize import Barrier
from pathlib import Path
from typing import Any, TypeVar

import redis
import uvloop

from ankusa_shm import config
from ankusa_shm.clock import Clock, monotonic_ns
from ankusa_shm.config import Config, Source
from ankusa_shm.fleet.admission import Admitted, Fleet
from ankusa_shm.fleet.drainer import Drainer
from ankusa_shm.fleet.redis_store import RedisStore
from ankusa_shm.hooks import Committed, Envelope, NewHook
from ankusa_shm.shm import counters, procs
from ankusa_shm.shm import layout as L
from ankusa_shm.shm import segment as segmod
from ankusa_shm.shm.counters import Counter
from ankusa_shm.shm.procs import Role
from ankusa_shm.shm.segment import Segment
from ankusa_shm.store.writer import Writer

T = TypeVar("T")

CTX = multiprocessing.get_context("fork")
TIMEOUT_S = 60.0  # generous: a loaded 2-core machine may be slow, never this slow
REPO = Path(__file__).resolve().parent.parent

TENANT = "acme"
KEY_PREFIX = "ankusa"

# What a test's own redis-py connection adds to INFO commandstats.
TEST_TRAFFIC = frozenset({"hello", "info", "config|resetstat", "client|setinfo", "ping"})

# Fleet settings of every test config unless a test says otherwise: budgets generous
# enough that a loaded machine never falls back by accident, a breaker that does not
# open unless a test asks it to.
FLEET_DEFAULTS: dict[str, Any] = {
    "timeout_ms": 5_000,
    "breaker_min_calls": 100_000,
    "pending_ttl_ms": 60_000,
    "settle_timeout_ms": 10_000,
    "drain_on_stop_ms": 60_000,
}


def source_id(tenant: str) -> str:
    return f"src-{tenant}"


# -- configs ----------------------------------------------------------------------------------


def fleet_raw(
    redis_url: str,
    segment: str,
    *,
    rate_scope: str = "fleet",
    dedupe_scope: str = "fleet",
    rate: float = 1000.0,
    burst: int = 100_000,
    tenants: Sequence[str] = (TENANT,),
    **fleet: Any,
) -> dict[str, Any]:
    """The raw (TOML-shaped) config of a test host: one source per tenant, named
    ``src-<tenant>``, whose event key is the ``x-id`` header."""
    return {
        "server": {"segment": segment},
        "rate_limits": {"scope": rate_scope, "default": {"rate": rate, "burst": burst}},
        "dedupe": {"scope": dedupe_scope},
        "fleet": {"redis_url": redis_url, **FLEET_DEFAULTS, **fleet},
        "sources": [
            {"id": source_id(t), "tenant": t, "dedupe": {"header": "x-id"}} for t in tenants
        ],
    }


def fleet_config(redis_url: str, segment: str, **kw: Any) -> Config:
    return config.parse(fleet_raw(redis_url, segment, **kw), "fleet-test")


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int | float):
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v)
    if isinstance(v, Mapping):
        return "{ " + ", ".join(f"{k} = {_toml_value(x)}" for k, x in v.items()) + " }"
    if isinstance(v, list):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    raise TypeError(f"no TOML for {v!r}")


def to_toml(raw: Mapping[str, Any]) -> str:
    """Enough TOML for ``fleet_raw``'s shape: tables of scalars and inline tables, and
    arrays of tables."""
    lines: list[str] = []
    for section, body in raw.items():
        items: list[Mapping[str, Any]] = body if isinstance(body, list) else [body]
        for item in items:
            lines.append(f"[[{section}]]" if isinstance(body, list) else f"[{section}]")
            lines += [f"{k} = {_toml_value(v)}" for k, v in item.items()]
    return "\n".join(lines) + "\n"


def write_config(path: Path, raw: Mapping[str, Any]) -> Path:
    """Write ``raw`` as TOML and check that it loads back as the same config."""
    path.write_text(to_toml(raw), encoding="utf-8")
    assert config.load(path) == config.parse(raw, str(path))
    return path


# -- segments, clocks, counters ---------------------------------------------------------------


def params(queue_capacity: int = 1024) -> L.Params:
    return segmod.make_params(queue_capacity=queue_capacity, gcra_slots=1024, process_slots=32)


def bare(seg: Segment) -> str:
    """The name a config carries (``Segment.name`` has the POSIX leading slash)."""
    return seg.name.removeprefix("/")


@contextmanager
def segments(n: int, queue_capacity: int = 1024) -> Iterator[list[Segment]]:
    """``n`` fresh segments (one per host), closed and unlinked afterwards."""
    names = [f"ankusa-fleet-{os.getpid()}-{uuid.uuid4().hex[:8]}-{i}" for i in range(n)]
    made: list[Segment] = []
    try:
        for name in names:
            made.append(Segment.create(name, params(queue_capacity)))
        yield made
    finally:
        for s in made:
            s.close()
        for name in names:
            segmod.unlink(name)


def totals(seg: Segment) -> dict[Counter, int]:
    return counters.totals(seg.view, seg.layout)


def total(segs: Sequence[Segment], counter: Counter) -> int:
    return sum(totals(s)[counter] for s in segs)


class FakeClock:
    """An injectable monotonic clock (ns) that moves only when told."""

    def __init__(self, start_ms: int = 1_000_000) -> None:
        self.ns = start_ms * 1_000_000

    def __call__(self) -> int:
        return self.ns

    def advance(self, ms: int) -> None:
        self.ns += ms * 1_000_000


# -- fleets and drainers in the test process --------------------------------------------------


def run(coro: Awaitable[T]) -> T:
    """Run a coroutine on a fresh uvloop loop, as a worker would."""

    async def bounded() -> T:
        async with asyncio.timeout(TIMEOUT_S):
            return await coro

    return uvloop.run(bounded())


@asynccontextmanager
async def open_fleet(
    cfg: Config, seg: Segment, *, clock: Clock = monotonic_ns, store: RedisStore | None = None
) -> AsyncIterator[Fleet]:
    """A Fleet for this process on ``seg``, with its own store unless one is given; the
    store is closed afterwards."""
    slot = procs.claim(seg.view, seg.layout, Role.WORKER)
    if store is None and cfg.fleet_kinds:
        store = RedisStore.from_config(cfg.fleet)
    fleet = Fleet(cfg, seg, slot, store, clock)
    try:
        yield fleet
    finally:
        await fleet.close()


def source(cfg: Config, tenant: str = TENANT) -> Source:
    src = cfg.source(source_id(tenant))
    assert src is not None
    return src


async def admit(fleet: Fleet, cfg: Config, key: str | None, tenant: str = TENANT) -> Admitted:
    """Admit one hook of ``tenant``'s source whose event key is ``key``."""
    return await fleet.admit(source(cfg, tenant), Envelope(None if key is None else key.encode()))


async def drain_all(
    cfg: Config, seg: Segment, *, store: RedisStore | None = None, clock: Clock = monotonic_ns
) -> None:
    """Run a Drainer on ``seg`` until its queue is empty (or drain_on_stop_ms passes)."""
    own = store is None
    if store is None:
        store = RedisStore.from_config(cfg.fleet)
    slot = procs.claim(seg.view, seg.layout, Role.DRAINER)
    stop = asyncio.Event()
    stop.set()
    try:
        await Drainer(cfg, seg, slot, store, clock).run(stop)
    finally:
        slot.release()
        if own:
            await store.close()


@asynccontextmanager
async def drainer_running(cfg: Config, seg: Segment) -> AsyncIterator[None]:
    """A Drainer on ``seg`` in a task of this loop while the block runs, then stopped:
    cancelled, so that a Redis still down does not hold it for ``drain_on_stop_ms``."""
    slot = procs.claim(seg.view, seg.layout, Role.DRAINER)
    store = RedisStore.from_config(cfg.fleet)
    stop = asyncio.Event()
    task = asyncio.create_task(Drainer(cfg, seg, slot, store).run(stop))
    try:
        yield
    finally:
        stop.set()
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await store.close()
        slot.release()


def dd_key(key: str, tenant: str = TENANT) -> bytes:
    """The Redis key of an event key's dedupe claim (redis_store's documented shape)."""
    return f"{KEY_PREFIX}:{{{tenant}}}:dd:{source_id(tenant)}:{key}".encode()


def rl_key(tenant: str = TENANT) -> bytes:
    return f"{KEY_PREFIX}:{{{tenant}}}:rl".encode()


def pending_value(token: bytes) -> bytes:
    return b"p:" + token.hex().encode()


def reset_stats(client: redis.Redis) -> None:
    client.config_resetstat()


@contextmanager
def stopped(pid: int) -> Iterator[None]:
    """SIGSTOP a process for the block; SIGCONT it whatever happens."""
    os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(pid, signal.SIGCONT)


def wait_until(cond: Callable[[], bool], what: str, timeout: float = TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)


async def await_until(cond: Callable[[], bool], what: str, timeout: float = TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.01)


# -- hosts: forked request workers ------------------------------------------------------------


@dataclass
class Worker:
    """What a child's body gets; everything in it was built inside the child."""

    index: int
    cfg: Config
    seg: Segment
    store: RedisStore
    fleet: Fleet

    async def admit(self, key: str | None, tenant: str = TENANT) -> Admitted:
        return await admit(self.fleet, self.cfg, key, tenant)


Body = Callable[[Worker], Awaitable[Any]]


@dataclass(frozen=True)
class Job:
    """One worker process: the host config (whose server.segment names the host), what it
    runs, and optionally a file its ``ankusa_shm`` log lines go to."""

    cfg: Config
    body: Body
    log_file: Path | None = None


def _log_to(path: Path) -> None:
    handler = logging.FileHandler(path)
    handler.setFormatter(logging.Formatter("%(process)d %(levelname)s %(name)s %(message)s"))
    logger = logging.getLogger("ankusa_shm")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)


def _worker_main(barrier: Barrier, index: int, job: Job, warm: bool) -> Any:
    if job.log_file is not None:
        _log_to(job.log_file)
    seg = Segment.attach(job.cfg.server.segment)
    try:
        slot = procs.claim(seg.view, seg.layout, Role.WORKER)

        async def main() -> Any:
            store = RedisStore.from_config(job.cfg.fleet)
            fleet = Fleet(job.cfg, seg, slot, store)
            try:
                if warm:  # connect before the start line, so the burst is only admits
                    await store.client.send([(b"warm", ("PING",))])
                barrier.wait(TIMEOUT_S)
                return await job.body(Worker(index, job.cfg, seg, store, fleet))
            finally:
                await fleet.close()

        try:
            return uvloop.run(main())
        finally:
            slot.release()
    finally:
        seg.close()


def _worker_child(
    results: Queue[tuple[int, bool, Any]], barrier: Barrier, index: int, job: Job, warm: bool
) -> None:
    try:
        value = _worker_main(barrier, index, job, warm)
    except BaseException:
        barrier.abort()  # the others must not wait for this one at the start line
        results.put((index, False, traceback.format_exc()))
        raise
    results.put((index, True, value))


def _collect(
    results: Queue[tuple[int, bool, Any]], kids: Sequence[BaseProcess], timeout: float
) -> dict[int, Any]:
    got: dict[int, Any] = {}
    deadline = time.monotonic() + timeout
    while len(got) < len(kids):
        try:
            index, ok, value = results.get(timeout=0.2)
        except queue.Empty:
            missing = [i for i in range(len(kids)) if i not in got]
            if any(kids[i].exitcode is not None for i in missing):
                try:  # an exited child has flushed its result: one more look
                    index, ok, value = results.get(timeout=2)
                except queue.Empty:
                    codes = {i: kids[i].exitcode for i in missing}
                    raise AssertionError(f"workers exited without a result: {codes}") from None
            elif time.monotonic() > deadline:
                raise AssertionError(f"workers {missing} did not finish in {timeout} s") from None
            else:
                continue
        if not ok:
            raise AssertionError(f"worker {index} failed:\n{value}")
        got[index] = value
    return got


def run_workers(jobs: Sequence[Job], *, warm: bool = True, timeout: float = TIMEOUT_S) -> list[Any]:
    """Fork one worker per job, start them together, and return their bodies' results in
    job order. Every child is joined (and must exit 0) or killed before this returns."""
    results: Queue[tuple[int, bool, Any]] = CTX.Queue()
    barrier = CTX.Barrier(len(jobs))
    kids: list[BaseProcess] = []
    try:
        for i, job in enumerate(jobs):
            kid = CTX.Process(target=_worker_child, args=(results, barrier, i, job, warm))
            kid.daemon = True
            kid.start()
            kids.append(kid)
        got = _collect(results, kids, timeout)
        deadline = time.monotonic() + timeout
        for p in kids:
            p.join(max(0.0, deadline - time.monotonic()))
        codes = [p.exitcode for p in kids]
        assert codes == [0] * len(kids), f"worker exit codes: {codes}"
        return [got[i] for i in range(len(jobs))]
    finally:
        for p in kids:
            if p.is_alive():
                p.kill()
            p.join(10)
        results.close()
        results.join_thread()


@contextmanager
def forked(target: Callable[..., object], *args: object) -> Iterator[BaseProcess]:
    """One forked child running ``target(*args)``, killed and reaped after the block."""
    kid = CTX.Process(target=target, args=args, daemon=True)
    kid.start()
    try:
        yield kid
    finally:
        if kid.is_alive():
            kid.kill()
        kid.join(10)


# -- the drainer as a real process ------------------------------------------------------------


@dataclass
class DrainerProcess:
    """``ankusa-shm drainer --config FILE`` as a subprocess; its output goes to ``log``."""

    proc: subprocess.Popen[bytes]
    log: Path

    @classmethod
    def start(cls, config_file: Path, log: Path) -> DrainerProcess:
        with log.open("ab") as out:
            proc = subprocess.Popen(
                [sys.executable, "-m", "ankusa_shm", "drainer", "--config", str(config_file)],
                cwd=REPO,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
            )
        return cls(proc, log)

    def output(self) -> str:
        return self.log.read_text(encoding="utf-8", errors="replace")

    def signal(self, sig: signal.Signals) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, sig)

    def wait(self, timeout: float = TIMEOUT_S) -> int:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"drainer did not exit:\n{self.output()}") from None

    def kill(self) -> None:
        """SIGKILL (if still running) and reap."""
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)


@contextmanager
def drainer_process(config_file: Path, log: Path) -> Iterator[DrainerProcess]:
    d = DrainerProcess.start(config_file, log)
    try:
        yield d
    finally:
        d.kill()


def committed_values(client: redis.Redis, keys: Sequence[bytes]) -> list[bytes | None]:
    """The values of ``keys`` (MGET in chunks); None for a missing key."""
    values: list[bytes | None] = []
    for i in range(0, len(keys), 1000):
        for v in client.mget(keys[i : i + 1000]):
            assert v is None or isinstance(v, bytes)
            values.append(v)
    return values


async def store_hooks(cfg: Config, hooks: list[NewHook]) -> None:
    """Commit ``hooks`` to ``cfg``'s store, as a worker's writer does."""
    writer = Writer(cfg.store)
    writer.start(asyncio.get_running_loop())
    for h in hooks:
        assert await writer.commit(h) == Committed(h.id)
    await writer.close()
