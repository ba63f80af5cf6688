"""Is a process still there? The one liveness check every structure uses.

A pid alone does not name a process: the kernel hands a freed pid to the next process
that comes round to it (quickly where ``pid_max`` is 32768), and a process that has died
but is not yet reaped (a zombie) still answers ``kill(pid, 0)``. So where the segment
names a process it records the pid together with the process's start time -- field 22 of
``/proc/<pid>/stat``, clock ticks since boot, fixed for the life of a process -- and a
process is alive when its pid exists, is not a zombie and started at that time. (A tick
is 10 ms at the usual 100 Hz; the pid counter cannot lap pid_max that fast.)

Every function here answers for any int at all: a word read from a corrupt or foreign
segment is "not alive", never an exception.
"""

from __future__ import annotations

import os

from ankusa_shm.shm import layout as L

_PROC = os.path.exists("/proc/self/stat")


def valid_pid(pid: int) -> bool:
    """Linux pids lie below pid_max, which is at most 2**22; anything else names nobody."""
    return 0 < pid <= L.PID_MASK


def _stat(pid: int) -> tuple[bytes, int] | None:
    """(state letter, start ticks) from ``/proc/<pid>/stat``; None if there is no such pid.

    The comm field (2) is in parentheses and may itself hold spaces and parentheses, so
    the fields are counted from the last ``)``: state is field 3, start time field 22.
    """
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except (FileNotFoundError, ProcessLookupError):
        return None
    rest = data.rpartition(b")")[2].split()
    try:
        return rest[0], int(rest[19])
    except (IndexError, ValueError):
        return None


def start_ticks(pid: int) -> int | None:
    """When ``pid`` started (clock ticks since boot), or None: no such live process, or its
    start time cannot be read (no /proc, or one mounted with hidepid)."""
    if not valid_pid(pid) or not _PROC:
        return None
    try:
        st = _stat(pid)
    except OSError:
        return None
    if st is None or st[0] == b"Z":
        return None
    return st[1]


_mine: tuple[int, int] = (0, 0)


def my_start() -> int:
    """This process's start ticks (0 where they cannot be read); cached per pid, since a
    forked child is another process."""
    global _mine
    pid = os.getpid()
    if _mine[0] != pid:
        _mine = (pid, start_ticks(pid) or 0)
    return _mine[1]


def pid_alive(pid: int, start: int | None = None) -> bool:
    """Whether ``pid`` is a live process -- not a zombie and, when ``start`` is given, the
    one that started at ``start`` ticks (compared modulo 2**START_BITS, as the segment's
    words keep them)."""
    if not valid_pid(pid):
        return False
    if not _PROC:
        return _exists(pid)
    try:
        st = _stat(pid)
    except PermissionError:
        return _exists(pid)  # /proc with hidepid: it exists, but who it is cannot be told
    except OSError:
        return False
    if st is None or st[0] == b"Z":
        return False
    return start is None or (st[1] ^ start) & L.START_MASK == 0


def _exists(pid: int) -> bool:
    """Signal 0, as varnishstat does: EPERM means it exists but is not ours."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
