"""Is a process still there? The one liveness check every structure uses."""

from __future__ import annotations

import os


def pid_alive(pid: int) -> bool:
    """Signal 0, as varnishstat does: EPERM means it exists but is not ours."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
