"""The supervisor: owns the segment and the sockets, forks and watches the children.

Signal handlers only enqueue; one main loop does everything else, woken by the signal
pipe, a child's readiness pipe or a one-second tick: reap with ``waitpid(-1, WNOHANG)``,
handle what was signalled, keep the right children running, and stop a child whose
heartbeat in the segment went silent (SIGABRT, then SIGKILL after ``KILL_AFTER_S``).
A reaped child's process slot is freed here: a child never gives it back itself.

- TERM: stop accepting, let the workers finish in-flight requests, then let the drainer
  empty the settle queue; exit 0 within ``server.graceful_timeout_s`` (what is still
  running then is killed). INT/QUIT: the same without waiting.
- HUP: read and validate the config again; an invalid one is logged and the old one
  keeps serving. Workers are replaced one at a time -- a new one serves before an old
  one is told to stop, and the next starts only after that, so a reload runs at most one
  worker over the count -- and no connection is refused. A new worker that cannot boot
  abandons the reload (the old ones keep serving); one still booting when another HUP
  comes is stopped (it never served), so a burst of HUPs boots no more workers at a
  time than the worker count.
- TTIN/TTOU: one worker more / less; no more than the segment's process slots allow.
- The drainer is not started while another live process -- a standalone ``ankusa-shm
  drainer`` -- holds the settle queue's consumer role: that one drains it (STATUS says
  so), and ours starts once it is gone. One that finds the role taken exits
  ``QUEUE_TAKEN`` and waits the same way, instead of a respawn loop.
- A child that exits ``BOOT_ERROR`` when nothing else could serve -- during the first
  start, or with no worker left serving -- stops the supervisor with its message instead
  of a respawn loop. One of a configuration that was superseded is dropped with it; one
  of the running configuration while workers serve is logged and tried again with
  backoff. Any other death is respawned, with backoff when it keeps dying young.
"""

from __future__ import annotations

import contextlib
import enum
import errno
import logging
import os
import select
import signal
import socket
import time
from collections import deque
from dataclasses import dataclass, field

import setproctitle

from ankusa_shm import child, config, fds, overrides
from ankusa_shm.clock import monotonic_ms, wall_of
from ankusa_shm.config import Config
from ankusa_shm.shm import procs, requests, segment
from ankusa_shm.shm.procs import Role
from ankusa_shm.shm.segment import Segment, make_params
from ankusa_shm.shm.settle_queue import SettleQueue
from ankusa_shm.store import schema
from ankusa_shm.supervisor import recovery, reload
from ankusa_shm.supervisor import sockets as socks
from ankusa_shm.supervisor.notify import Notifier

log = logging.getLogger("ankusa_shm.supervisor")

KILL_AFTER_S = 2.0  # SIGABRT, then SIGKILL if it is still there
FAST_STOP_S = 2.0  # INT/QUIT: how long children get before SIGKILL
YOUNG_S = 1.0  # a child dying younger than this backs off its respawn
BACKOFF_MAX_S = 5.0
TICK_S = 1.0
# A loop that comes round this much later than its tick did not run meanwhile: stopped,
# or the host paused (a frozen cgroup, a paused VM) with the monotonic clock running on.
PAUSED_S = 3 * TICK_S

_HANDLED = (
    signal.SIGTERM,
    signal.SIGINT,
    signal.SIGQUIT,
    signal.SIGHUP,
    signal.SIGTTIN,
    signal.SIGTTOU,
    signal.SIGCHLD,
)
# Until the loop runs, these wait blocked: their default actions would end the supervisor
# (HUP) or stop it (TTIN, TTOU). TERM, INT and QUIT keep theirs: before anything is forked,
# to stop at once is to stop gracefully.
_DEFERRED = (signal.SIGHUP, signal.SIGTTIN, signal.SIGTTOU)


class Kind(enum.Enum):
    WORKER = "worker"
    DRAINER = "drainer"
    ADMIN = "admin"


@dataclass(eq=False)
class Child:
    pid: int
    kind: Kind
    cfg: Config  # the configuration it was forked with: current while it is ``self.cfg``
    started: float  # monotonic s
    ready_fd: int | None  # read end of the readiness pipe, until the child is ready
    lane: int  # which lane's sockets a worker accepts on (``sockets.Listeners``)
    ready: bool = False
    recovering: int | None = None  # a worker's: the recovery it does before it serves
    resetting: list[str] = field(default_factory=list)  # a worker's: buckets it forgets first
    retired_at: float | None = None  # monotonic s when it was told to stop
    abort_sent: float | None = None  # monotonic s of the SIGABRT for a silent heartbeat
    heard_ms: int | None = None  # monotonic ms of its heartbeat when last looked at

    @property
    def retiring(self) -> bool:
        return self.retired_at is not None


@dataclass
class _Backoff:
    delay: float = 0.0
    not_before: float = 0.0


@dataclass
class _Stop:
    graceful: bool
    deadline: float
    drainer_told: bool = False


@dataclass
class Arbiter:
    cfg: Config
    config_path: str | None
    notifier: Notifier = field(default_factory=Notifier)

    def __post_init__(self) -> None:
        self._children: dict[int, Child] = {}
        self._signals: deque[int] = deque()
        self._previous: Config | None = None  # the config a failed reload goes back to
        self._target = _worker_count(self.cfg)
        self._backoff = {k: _Backoff() for k in Kind}
        self._stop: _Stop | None = None
        self._halt: str | None = None
        self._announced_ready = False
        # The kinds of child one of which has served. Past the first start (READY sent,
        # and one of its kind served), a child that cannot start is tried again while
        # workers serve; before, it stops the service.
        self._served: set[Kind] = set()
        self._last_watchdog = 0.0
        self._ticked = time.monotonic()  # when the loop last came round
        self._awake_since = 0.0  # monotonic s: silence before it is not the children's
        self._seg: Segment | None = None
        self._queue: SettleQueue | None = None
        self._other_drainer: int | None = None  # pid of a live consumer that is not ours
        self._listeners: socks.Listeners | None = None
        self._admin_socket: socket.socket | None = None
        # Set when a worker died, or the last supervisor did: the next worker promotes
        # what was stored since then (``Worker``), closing the gap a crash between a
        # commit and its settle leaves. Owed again if that worker goes before it serves.
        self._recover_since_ms: int | None = None
        # Tenants whose limit a reload changed: the next worker forgets their buckets (this
        # host's and the fleet's) before it serves; owed again if it goes before it does.
        self._reset_tenants: list[str] = []
        # Nothing this run did can have left a hook unsettled in Redis but what the settle
        # queue holds, or a crash recovery still owed: every recovery was done whole (it
        # reads at most half a queue, and may fail), and no worker or drainer was killed
        # stopping. A graceful stop that ends so, with the queue empty and no recovery
        # owed, is kept in the store (``recovery.keep_settled``).
        self._settles_clean = True
        self._wake_r, self._wake_w = -1, -1

    # -- the life of the supervisor -------------------------------------------------------

    def run(self) -> int:
        cfg = self.cfg
        began_ns = time.time_ns()
        signal.pthread_sigmask(signal.SIG_BLOCK, _DEFERRED)
        fds.raise_limit()  # before any fork: every child inherits it
        fds.say_if_short(cfg.server.max_connections)
        try:
            # The sockets before the segment: a second service started on the same ports
            # stops here, before it has touched the segment of the one running.
            self._listeners = socks.Listeners(cfg.server.listen, cfg.server.backlog)
            if cfg.server.admin_listen:
                (self._admin_socket,) = socks.bind([cfg.server.admin_listen], config.ADMIN_BACKLOG)
            schema.check_ours(cfg.store.path)  # a newer build's: before its segment is touched
            params = make_params(cfg.settle_capacity)
            self._seg = _of_this_store(Segment.open_for_owner(cfg.server.segment, params), cfg)
            self._queue = SettleQueue(self._seg.view, self._seg.buf, self._seg.layout)
            if self._seg.header().created_ns < began_ns:  # re-attached: its owner may have died
                if recovery.stopped_settled(cfg, self._seg):
                    log.info("the last stop left every hook settled: no recovery owed")
                else:
                    self._recover_from(recovery.start(cfg, recovery.last_heard_ms(self._seg)))
                # its children's slots, read for their last heartbeats above, are free now
                procs.release_gone(self._seg.view, self._seg.layout)
            else:
                # A new one: what an earlier segment held queued (lost with a reboot, or
                # with a segment replaced on upgrade) is unknown, and its drainer promotes
                # again what was stored before this one, since the last stop that left
                # every hook settled, or in the dedupe window (``repromote.Drops``).
                recovery.mark_new_segment(cfg, self._queue)
            self._publish(cfg)
            overrides.publish_stored(self._seg.blob("overrides"), cfg.store.path)
            self._install_signals()
            setproctitle.setproctitle(f"ankusa-shm: supervisor [{self._seg.name.lstrip('/')}]")
            log.info(
                "listening on %s; starting %d worker%s (segment %s, store %s)",
                self._listeners.describe(),
                self._target,
                "" if self._target == 1 else "s",
                self._seg.name,
                cfg.store.path,
            )
            return self._loop()
        finally:
            if self._listeners is not None:
                self._listeners.close()
            if self._admin_socket is not None:
                self._admin_socket.close()
            self.notifier.close()
            if self._seg is not None:
                self._close_segment(began_ns)

    def _close_segment(self, began_ns: int) -> None:
        """Unmap the segment, and remove it too if this start made it and never served:
        tens of MiB of /dev/shm that hold nothing (no settlement is queued in it) are not
        left behind by a start that failed."""
        assert self._seg is not None
        seg, name = self._seg, self._seg.name
        empty = seg.header().created_ns >= began_ns and seg.queue_depth() == 0
        seg.close()
        if empty and self._halt is not None and not self._announced_ready:
            segment.unlink(name)
            log.info("segment %s removed: this start made it, and never served", name)

    def _loop(self) -> int:
        while True:
            while self._signals:
                self._on_signal(self._signals.popleft())
            self._reap()
            now = time.monotonic()
            if self._halt is not None and self._stop is None:
                log.error("stopping: %s", self._halt)
                self._begin_stop(graceful=False)
            if self._stop is not None:
                if self._advance_stop(now):
                    return 1 if self._halt else 0
                self._wait()
                continue
            self._keep_running(now)
            self._notice_pause(now)
            self._watch_heartbeats(now)
            self._report(now)
            self._wait()

    def _wait(self) -> None:
        fds = [self._wake_r]
        fds += [c.ready_fd for c in self._children.values() if c.ready_fd is not None]
        timeout = min(TICK_S, self.notifier.watchdog_s or TICK_S)
        now = time.monotonic()
        for b in self._backoff.values():  # a respawn due sooner than the next tick
            if b.not_before > now:
                timeout = min(timeout, b.not_before - now)
        try:
            readable, _, _ = select.select(fds, [], [], timeout)
        except InterruptedError:
            return
        for fd in readable:
            if fd == self._wake_r:
                with contextlib.suppress(BlockingIOError):
                    while os.read(self._wake_r, 4096):
                        pass
                continue
            self._on_ready_pipe(fd)

    # -- signals ----------------------------------------------------------------------------

    def _install_signals(self) -> None:
        self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        signal.set_wakeup_fd(self._wake_w, warn_on_full_buffer=False)
        for sig in _HANDLED:
            signal.signal(sig, self._enqueue)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, _DEFERRED)  # what came meanwhile: queued

    def _enqueue(self, signum: int, _frame: object) -> None:
        self._signals.append(signum)

    def _on_signal(self, sig: int) -> None:
        if sig == signal.SIGCHLD:
            return  # reaped right after
        if sig == signal.SIGTERM:
            self._begin_stop(graceful=True)
        elif sig in (signal.SIGINT, signal.SIGQUIT):
            self._begin_stop(graceful=False)
        elif self._stop is not None:
            return
        elif sig == signal.SIGHUP:
            self._reload()
        elif sig == signal.SIGTTIN:
            if self._free_slots() < 2:  # one for it, one for a replacement on reload
                log.warning(
                    "TTIN refused: the segment's process slots are taken (%d workers)",
                    self._target,
                )
                return
            self._target += 1
            log.info("one worker more: %d", self._target)
        elif sig == signal.SIGTTOU:
            if self._target == 1:
                log.warning("TTOU ignored: one worker is the fewest")
                return
            self._target -= 1
            log.info("one worker less: %d", self._target)

    def _free_slots(self) -> int:
        """Process slots of the segment that no live process holds and no child of ours,
        started or still to be, is about to claim."""
        assert self._seg is not None
        lay = self._seg.layout
        held = [p.pid for p in procs.read(self._seg.view, lay) if p.alive]
        coming = sum(1 for pid in self._children if pid not in held)
        workers = sum(1 for c in self._children.values() if c.kind is Kind.WORKER)
        return lay.params.process_slots - len(held) - coming - max(0, self._target - workers)

    # -- children ---------------------------------------------------------------------------

    def _spawn(self, kind: Kind, lane: int = 0) -> None:
        assert self._seg is not None and self._listeners is not None
        mine: list[socket.socket] = []
        if kind is Kind.WORKER:
            # Bound here, not in the worker, so that the lane outlives it: a worker that
            # exits closes only its copy, and what the kernel queued on the lane waits for
            # the next worker instead of being reset (a reload reset a few connections
            # each time its second worker was replaced).
            try:
                mine = self._listeners.lane(lane, listen=False)
            except socks.BindError as e:
                self._back_off(kind, young=True)
                log.error("%s; trying again in %.1f s", e, self._backoff[kind].delay)
                return
        ready_r, ready_w = os.pipe2(os.O_CLOEXEC)
        recover, reset = None, []
        if kind is Kind.WORKER:  # taken here, in the supervisor: one worker does these
            recover, self._recover_since_ms = self._recover_since_ms, None
            reset, self._reset_tenants = self._reset_tenants, []
        # A child inherits our handlers, which queue a signal for our loop, not its own:
        # one sent to it before it has put its own in place would be lost (a TERM so lost
        # kept a new worker serving through a stop). Blocked across the fork, it waits for
        # the child's handlers (``child.run``).
        mask = signal.pthread_sigmask(signal.SIG_BLOCK, _HANDLED)
        try:
            pid = os.fork()
        except OSError:  # EAGAIN: the task limit
            signal.pthread_sigmask(signal.SIG_SETMASK, mask)
            raise
        if pid == 0:
            os.close(ready_r)
            self._in_child(kind, ready_w, mine, recover, reset)
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        os.close(ready_w)
        c = Child(
            pid,
            kind,
            self.cfg,
            time.monotonic(),
            ready_r,
            lane,
            recovering=recover,
            resetting=reset,
        )
        self._children[pid] = c
        log.info("%s %d started", kind.value, pid)

    def _in_child(
        self,
        kind: Kind,
        ready_w: int,
        mine: list[socket.socket],
        recover: int | None,
        reset: list[str],
    ) -> None:
        """In the forked child: let go of what is the supervisor's, then run."""
        parent = os.getppid()
        os.close(self._wake_r)
        os.close(self._wake_w)
        for c in self._children.values():
            if c.ready_fd is not None:
                os.close(c.ready_fd)
        seg, cfg, listeners, admin_socket = self._seg, self.cfg, self._listeners, self._admin_socket
        assert seg is not None and listeners is not None
        for s in listeners.all():  # the other lanes' sockets are not this child's
            if s not in mine:
                s.close()
        if admin_socket is not None and kind is not Kind.ADMIN:
            admin_socket.close()
        title = f"ankusa-shm: {kind.value} [{seg.name.lstrip('/')}]"

        def ready(recovered: bool = True) -> None:
            os.write(ready_w, b"1" if recovered else b"2")
            os.close(ready_w)

        def body() -> int:  # each child imports only what it runs
            if kind is Kind.DRAINER:
                from ankusa_shm.fleet import drainer

                slot = procs.claim(seg.view, seg.layout, Role.DRAINER)
                return drainer.main(cfg, seg, slot, ready)
            if kind is Kind.ADMIN:
                from ankusa_shm.admin import process as admin

                assert admin_socket is not None
                slot = procs.claim(seg.view, seg.layout, Role.ADMIN)
                return admin.main(cfg, seg, slot, admin_socket, ready)
            from ankusa_shm import worker

            slot = procs.claim(seg.view, seg.layout, Role.WORKER)
            return worker.Worker(cfg, seg, slot, mine, ready, recover, reset).run()

        child.run(title, parent, body)

    def _on_ready_pipe(self, fd: int) -> None:
        c = next((c for c in self._children.values() if c.ready_fd == fd), None)
        if c is None:
            return
        data = os.read(fd, 1)
        os.close(fd)
        c.ready_fd = None
        if data:
            c.ready = True
            self._served.add(c.kind)
            if data == b"2":  # it said why in its log
                self._settles_clean = False
            c.recovering, c.resetting = None, []
            log.info("%s %d serving", c.kind.value, c.pid)

    def _reap(self) -> None:
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            c = self._children.pop(pid, None)
            if c is None:
                continue
            assert self._seg is not None
            procs.release_dead(self._seg.view, self._seg.layout, pid)
            if c.ready_fd is not None:
                os.close(c.ready_fd)
            self._on_exit(c, status)

    def _on_exit(self, c: Child, status: int) -> None:
        code = os.waitstatus_to_exitcode(status)
        how = f"exit status {code}" if code >= 0 else f"signal {signal.Signals(-code).name}"
        if c.recovering is not None:  # gone before its recovery was done: the next one's
            self._recover_from(c.recovering)
        self._reset_tenants = sorted({*self._reset_tenants, *c.resetting})
        if c.retiring or self._stop is not None:
            log.info("%s %d stopped (%s)", c.kind.value, c.pid, how)
            # killed with a commit or a delivery half done (a worker not yet serving had none)
            if code != 0 and (c.kind is Kind.DRAINER or (c.kind is Kind.WORKER and c.ready)):
                self._settles_clean = False
            return
        if code == child.BOOT_ERROR:
            self._on_boot_error(c)
            return
        if c.kind is Kind.DRAINER and code == child.QUEUE_TAKEN:
            return  # started again only once that consumer is gone (``_drainer_elsewhere``)
        log.warning("%s %d died (%s); starting another", c.kind.value, c.pid, how)
        if c.kind is Kind.WORKER:  # from its last heartbeat: it may have hung long before
            self._recover_from(recovery.start(c.cfg, wall_of(c.heard_ms)))
        self._back_off(c.kind, young=time.monotonic() - c.started < YOUNG_S)

    def _recover_from(self, since_ms: int) -> None:
        """The next worker promotes what was stored since ``since_ms``, or since a recovery
        still owed, whichever is earlier."""
        owed = self._recover_since_ms
        self._recover_since_ms = since_ms if owed is None else min(owed, since_ms)

    def _back_off(self, kind: Kind, young: bool) -> None:
        b = self._backoff[kind]
        b.delay = min(max(2 * b.delay, 0.1), BACKOFF_MAX_S) if young else 0.0
        b.not_before = time.monotonic() + b.delay

    def _on_boot_error(self, c: Child) -> None:
        """Halt only when nothing else could serve; otherwise drop the configuration that
        cannot start, or keep trying the child of the running one."""
        if c.cfg is not self.cfg:  # superseded by a later HUP, or already gone back from
            log.error(
                "%s %d of a superseded configuration cannot start; dropped",
                c.kind.value,
                c.pid,
            )
            return
        if self._previous is not None:
            log.error(
                "%s %d of the new configuration cannot start; going back to the previous one",
                c.kind.value,
                c.pid,
            )
            self.cfg, self._previous = self._previous, None
            self._target = _worker_count(self.cfg)
            self._publish(self.cfg)
            self._ready_again()
            return  # the failed config's children are now old, and replaced as such
        serving = len(self._serving())
        if not (self._announced_ready and c.kind in self._served) or not serving:
            self._halt = f"{c.kind.value} {c.pid} cannot start (its error is logged above)"
            return
        self._back_off(c.kind, young=True)  # however long it took: it will fail again soon
        if c.kind is Kind.WORKER and self._listeners is not None:
            self._listeners.drop(c.lane)  # its connections go to the lanes that are served
        log.error(
            "%s %d cannot start; trying again in %.1f s (workers serving: %d)",
            c.kind.value,
            c.pid,
            self._backoff[c.kind].delay,
            serving,
        )

    def _serving(self) -> list[Child]:
        """The workers accepting connections now."""
        return [
            c
            for c in self._children.values()
            if c.kind is Kind.WORKER and c.ready and not c.retiring and c.abort_sent is None
        ]

    def _retire(self, c: Child, why: str, sig: int = signal.SIGTERM) -> None:
        if not c.retiring:
            c.retired_at = time.monotonic()
            log.info("%s %d stopping: %s", c.kind.value, c.pid, why)
            _kill(c.pid, sig)

    def _keep_running(self, now: float) -> None:
        """Start what is missing; replace old-generation children one at a time."""
        for c in self._children.values():
            if c.kind is Kind.WORKER and c.cfg is not self.cfg and not c.ready:
                self._retire(c, "its configuration was superseded before it served")
        live = [c for c in self._children.values() if not c.retiring]
        workers = [c for c in live if c.kind is Kind.WORKER]
        current = [c for c in workers if c.cfg is self.cfg]
        old = [c for c in workers if c.cfg is not self.cfg]
        starting = any(not c.ready for c in current)
        b = self._backoff[Kind.WORKER]
        if len(workers) < self._target and now >= b.not_before:
            self._spawn(Kind.WORKER, _free_lane(workers, self._target))
        elif len(workers) > self._target and not starting:
            # one too many (a replacement serves, or TTOU): before any further replacement,
            # so that a reload never runs more than one worker over the count
            lanes = {c.lane for c in current}
            extra = [c for c in old if c.lane in lanes or c.lane >= self._target]
            victim = (extra or old)[0] if old else max(current, key=lambda c: (c.lane, c.started))
            self._retire(victim, "replaced" if victim.cfg is not self.cfg else "one too many")
        elif old and not starting and len(current) < self._target:
            # the replacement of an old one, on its lane, before it goes
            self._spawn(Kind.WORKER, _free_lane(current, self._target))
        # A lane above the worker count goes as soon as no serving worker is on it -- when
        # its worker is retired, not when it exits: the kernel would go on queueing
        # connections on a lane nobody accepts from any more.
        assert self._listeners is not None
        if not any(c.lane >= self._target for c in workers if not c.retiring):
            self._listeners.trim(self._target)

        drainers = [c for c in self._children.values() if c.kind is Kind.DRAINER]
        want_drainer = bool(self.cfg.fleet_kinds)
        for d in drainers:
            stale = d.cfg is not self.cfg or not want_drainer
            if stale and not d.retiring and not old:  # after the workers, whose settles it drains
                if want_drainer and _other_fleet_store(d.cfg, self.cfg):
                    # What it holds goes to the new store, its window with it (``epoch``):
                    # no waiting out drain_on_stop_ms on an old one that may not answer.
                    self._retire(d, "the fleet store was replaced", signal.SIGINT)
                else:
                    self._retire(d, "its configuration was replaced")
        d_b = self._backoff[Kind.DRAINER]
        if (
            want_drainer
            and not drainers
            and now >= d_b.not_before
            and not self._drainer_elsewhere()
        ):
            self._spawn(Kind.DRAINER)  # only once the last one is gone: one consumer

        admins = [c for c in self._children.values() if c.kind is Kind.ADMIN]
        for a in admins:
            if a.cfg is not self.cfg and not a.retiring:
                self._retire(a, "its configuration was replaced")
        a_b = self._backoff[Kind.ADMIN]
        if self._admin_socket is not None and not admins and now >= a_b.not_before:
            self._spawn(Kind.ADMIN)  # once the old one is gone: one writer of the overrides

        drainer_current = not want_drainer or any(
            d.cfg is self.cfg and d.ready and not d.retiring for d in drainers
        )
        # the admin process of the new config too: one that cannot start sends the reload
        # back (it was retried for good instead, with /healthz unanswered meanwhile)
        admin_current = self._admin_socket is None or any(
            a.cfg is self.cfg and a.ready and not a.retiring for a in admins
        )
        if (
            self._previous is not None
            and not old
            and not starting
            and drainer_current
            and admin_current
        ):
            log.info("reload complete")
            self._previous = None
            self._ready_again()

    def _drainer_elsewhere(self) -> bool:
        """Whether a live process other than our children holds the settle queue's
        consumer role; said once when one is found, and once when it is gone."""
        assert self._queue is not None
        holder = self._queue.live_consumer()
        other = holder if holder is not None and holder not in self._children else None
        if other != self._other_drainer:
            if other is not None:
                log.warning(
                    "the settle queue is drained by pid %d, not a child of this supervisor; "
                    "no drainer of ours while it does",
                    other,
                )
            else:
                log.info("the settle queue's other consumer is gone; starting our drainer")
            self._other_drainer = other
            self.notifier.send(self._status())
        return other is not None

    def _notice_pause(self, now: float) -> None:
        """After a pause of the supervisor (or of the whole service: a host suspended with
        its monotonic clock running) every child looks silent, having had no more chance to
        run than we had: all were aborted and replaced, connections and all. Their silence
        counts from our waking up instead."""
        if now - self._ticked > PAUSED_S:
            self._awake_since = now
            log.warning(
                "the supervisor did not run for %.1f s; its children's silence counts from now",
                now - self._ticked,
            )
        self._ticked = now

    def _watch_heartbeats(self, now: float) -> None:
        assert self._seg is not None
        # Live slots only: a dead holder's slot may name a pid the kernel has since given
        # to one of our children, with a heartbeat long stale.
        live = [p for p in procs.read(self._seg.view, self._seg.layout) if p.alive]
        beats = {p.pid: p.heartbeat_ms for p in live}
        silent_ms = self.cfg.server.heartbeat_timeout_s * 1000
        # A child told to stop has no heartbeat (it ends with its serving), and may finish
        # a slow request for up to the graceful timeout: aborted as silent, a reload cut a
        # slow upload short at heartbeat_timeout_s.
        stopping_ms = (self.cfg.server.graceful_timeout_s + KILL_AFTER_S) * 1000
        now_ms = monotonic_ms()
        awake = self._awake_since
        for c in self._children.values():
            if c.abort_sent is not None:
                if now - c.abort_sent > KILL_AFTER_S:
                    _kill(c.pid, signal.SIGKILL)
                continue
            beat = beats.get(c.pid)
            if beat is not None:
                c.heard_ms = beat
            if c.retired_at is not None:
                how, since_s, limit_ms = "still stopping after", c.retired_at, stopping_ms
            elif not c.ready:
                how, since_s, limit_ms = "not serving after", c.started, silent_ms
            elif beat is not None:
                how, since_s, limit_ms = "silent for", beat / 1000, silent_ms
            else:
                continue
            quiet_ms = now_ms - max(since_s, awake) * 1000
            if quiet_ms > limit_ms:
                log.error("%s %d %s %.1f s; aborting it", c.kind.value, c.pid, how, quiet_ms / 1000)
                c.abort_sent = now
                _kill(c.pid, signal.SIGABRT)

    def _ready_again(self) -> None:
        """A reload ended (done, or given up): READY=1 again, if the first was sent (before
        it, neither RELOADING=1 nor this means anything to systemd)."""
        if self._announced_ready:
            self.notifier.send("READY=1", self._status())

    def _healthy_workers(self) -> int:
        """How many workers serve and have not been given up on; 0 also when the settle
        queue has no drainer (with a fleet scope)."""
        drainer_ok = (
            not self.cfg.fleet_kinds
            or self._other_drainer is not None
            or any(c.kind is Kind.DRAINER and c.abort_sent is None for c in self._children.values())
        )
        if not drainer_ok:
            return 0
        return sum(
            1
            for c in self._children.values()
            if c.kind is Kind.WORKER and c.ready and c.abort_sent is None
        )

    def _report(self, now: float) -> None:
        """READY=1 once every worker serves (and the drainer, with a fleet scope);
        WATCHDOG=1 while any does. A worker that
        cannot start again while another serves is retried here, and a restart by the
        watchdog would only swap a host that serves for one that stops at its first
        start; a hung supervisor, or no worker serving, still goes without pings."""
        self.notifier.flush()  # what a slow receiver left waiting
        healthy = self._healthy_workers()
        if healthy >= self._target and not self._announced_ready:
            self._announced_ready = True
            log.info("ready: %s", self._status().removeprefix("STATUS="))
            self.notifier.send("READY=1", self._status())
        interval = self.notifier.watchdog_s
        if healthy and interval is not None and now - self._last_watchdog >= interval:
            self._last_watchdog = now
            self.notifier.send("WATCHDOG=1", self._status())

    def _describe(self) -> str:
        return self._listeners.describe() if self._listeners is not None else "nothing"

    def _status(self) -> str:
        workers = sum(1 for c in self._children.values() if c.kind is Kind.WORKER and c.ready)
        fleet = "+".join(self.cfg.fleet_kinds) or "node only"
        if self._other_drainer is not None:
            drainer = f", settle queue drained by pid {self._other_drainer} (not ours)"
        elif any(c.kind is Kind.DRAINER for c in self._children.values()):
            drainer = ", drainer up"
        else:
            drainer = ""
        short = f" of {self._target}" if workers < self._target else ""
        return (
            f"STATUS=serving on {self._describe()}: {workers}{short} workers, "
            f"fleet {fleet}{drainer}"
        )

    def _publish(self, cfg: Config) -> None:
        """What readers and the children take from the segment: the config snapshot and
        the source table, before any child of this config is forked."""
        assert self._seg is not None
        self._seg.write_config(cfg.public())
        requests.assign(self._seg.blob("sources"), [s.id for s in cfg.sources])

    # -- reload -----------------------------------------------------------------------------

    def _reload(self) -> None:
        if self.config_path is None:
            log.info("HUP: running on embedded defaults; nothing to re-read")
            return
        assert self._seg is not None
        new = reload.read(self.config_path, self.cfg, self._seg.layout.params.queue_capacity)
        if new is None:
            return
        if self._announced_ready:  # before the first READY=1, systemd has nothing to reload
            self.notifier.send("RELOADING=1", f"MONOTONIC_USEC={time.monotonic_ns() // 1000}")
        signalled = self._target if self._target != _worker_count(self.cfg) else None
        tenants = {s.tenant for s in (*self.cfg.sources, *new.sources)}
        changed = self.cfg.rate_limits.changed(new.rate_limits, tenants)
        self._reset_tenants = sorted(changed.union(self._reset_tenants))
        self._previous, self.cfg = self._previous or self.cfg, new
        self._target = _worker_count(new)
        self._publish(new)
        log.info(
            "HUP: %s read; replacing workers one at a time, %d of them (server.workers%s)",
            self.config_path,
            self._target,
            f", not the {signalled} TTIN/TTOU had made it" if signalled else "",
        )

    # -- stopping ---------------------------------------------------------------------------

    def _begin_stop(self, graceful: bool) -> None:
        now = time.monotonic()
        if self._stop is not None:
            if not graceful and self._stop.graceful:  # TERM then INT: hurry up
                self._stop = _Stop(False, min(self._stop.deadline, now + FAST_STOP_S))
                self._signal_all(signal.SIGQUIT)
            return
        timeout = self.cfg.server.graceful_timeout_s if graceful else FAST_STOP_S
        self._stop = _Stop(graceful, now + timeout)
        self.notifier.send("STOPPING=1", "STATUS=stopping")
        log.info("stopping (%s)", "graceful" if graceful else "fast")
        if self._listeners is not None:  # the port goes once the workers close theirs too
            self._listeners.close()
        for c in self._children.values():
            if c.kind is Kind.WORKER or not graceful:
                c.retired_at = c.retired_at or now
                _kill(c.pid, signal.SIGTERM if graceful else signal.SIGQUIT)

    def _signal_all(self, sig: int) -> None:
        now = time.monotonic()
        for c in self._children.values():
            c.retired_at = c.retired_at or now
            _kill(c.pid, sig)

    def _advance_stop(self, now: float) -> bool:
        """One step of stopping; True once every child is gone."""
        stop = self._stop
        assert stop is not None
        if not self._children:
            if stop.graceful:
                self._keep_settled()
            log.info("stopped")
            return True
        if now >= stop.deadline:
            log.warning("children still running at the stop deadline; killing them")
            self._signal_all(signal.SIGKILL)
            stop.deadline = now + 3600  # reap what was killed; no second round
            return False
        workers_left = any(c.kind is Kind.WORKER for c in self._children.values())
        if stop.graceful and not workers_left and not stop.drainer_told:
            stop.drainer_told = True  # the queue is complete now: let it empty it
            self._signal_all(signal.SIGTERM)
        return False

    def _keep_settled(self) -> None:
        """Every child gone after a graceful stop: keep the moment in the store if nothing
        is owed to the fleet (``recovery.keep_settled``)."""
        if self._seg is not None and self._queue is not None:
            recovery.keep_settled(
                self.cfg,
                self._seg,
                self._queue,
                clean=self._settles_clean,
                recovery_owed=self._recover_since_ms is not None,
                other_drainer=self._other_drainer is not None,
            )


def _free_lane(workers: list[Child], target: int) -> int:
    """The first lane none of ``workers`` accepts on."""
    taken = {c.lane for c in workers}
    return next(i for i in range(target + len(taken) + 1) if i not in taken)


def _other_fleet_store(old: Config, new: Config) -> bool:
    """Whether ``new`` settles into another Redis, or under another prefix, than ``old``."""
    a, b = old.fleet, new.fleet
    return (a.redis_url, a.cluster, a.key_prefix) != (b.redis_url, b.cluster, b.key_prefix)


def _worker_count(cfg: Config) -> int:
    """``server.workers``, or one per CPU this process may run on."""
    return cfg.server.workers or len(os.sched_getaffinity(0))


def _of_this_store(seg: Segment, cfg: Config) -> Segment:
    """``seg``, if it served this config's store, or was just made. What another store's
    service left queued in it is for that store's hooks: refused while it holds any, and
    made anew if it holds none (so that neither its queue nor its marks of what was settled
    are taken for this store's)."""
    held, mine = seg.read_config().get("store"), cfg.store.file
    if not isinstance(held, str) or held == mine:
        return seg
    depth = seg.queue_depth()
    name, params = seg.name, seg.layout.params
    seg.close()
    if depth:
        raise segment.SegmentError(
            f"segment {name} holds {depth} settle operations queued by the service of the "
            f"store {held}, not this config's {mine}: start that service to send them, or "
            f"choose another server.segment (if the store was moved, remove /dev/shm{name}: "
            "a start on a new segment promotes them again from the store)"
        )
    return segment.replace(name, params, f"it served the store {held}, not {mine}", 0)


def _kill(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except OSError as e:
        if e.errno != errno.ESRCH:
            raise
