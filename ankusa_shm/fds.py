"""How many client connections a worker may hold, given the open-file limit.

A process out of file descriptors cannot accept: the event loop then takes each waiting
connection off the backlog and closes it at once, so every hook sent meanwhile is reset,
and nothing says why. The supervisor raises the soft limit to the hard one before it
forks (as Go's runtime does; the systemd unit sets both), and each worker keeps its
connections ``RESERVE`` short of the limit, for what else it opens: the store's files,
the Redis connection, listening sockets, pipes.
"""

from __future__ import annotations

import contextlib
import logging
import resource

log = logging.getLogger("ankusa_shm.supervisor")  # said as it starts, or reloads

RESERVE = 64


def raise_limit() -> None:
    """Raise this process's soft open-file limit to its hard one (inherited by children
    forked after); where the kernel refuses (a hard limit above nr_open), leave it."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def connection_cap(configured: int) -> int:
    """The connections a worker may hold: ``configured``, or fewer if the soft open-file
    limit leaves less room."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return configured
    return max(1, min(configured, soft - RESERVE))


def say_if_short(wanted: int) -> None:
    """Warn if the open-file limit holds the workers under ``wanted`` connections each
    (``server.max_connections``)."""
    cap = connection_cap(wanted)
    if cap < wanted:
        log.warning(
            "the open-file limit leaves room for %d client connections per worker, not "
            "server.max_connections = %d: raise it (LimitNOFILE= in the unit, ulimit -n)",
            cap,
            wanted,
        )
