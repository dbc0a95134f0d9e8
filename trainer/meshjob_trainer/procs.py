"""Whether a process still runs, for the resources meshjob leaves named after a process id."""

from __future__ import annotations

import os


def pid_alive(pid: int) -> bool:
    """Whether process `pid` still runs. A zombie (dead, not yet reaped by its parent) does not; a
    process of another user that we may not signal does."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (OSError, IndexError):
        return True
