"""Naming a process for as long as it lives: its pid and its start time, so a reused pid never counts as it.

The lifeline (``hetrain.runtime.lifeline``) watches the process that launched a run by such a name, and the
run directory (``hetrain.rundir``) tells its live workers by the names in their pid files.
"""

from __future__ import annotations

import os


def start_time(pid: int) -> str | None:
    """The process's start time in clock ticks since boot (``/proc/PID/stat`` field 22); None when it is gone."""
    try:
        stat = open(f"/proc/{pid}/stat", "rb").read()  # noqa: SIM115 - one read
    except OSError:
        return None
    fields = stat.rsplit(b")", 1)[-1].split()
    return fields[19].decode() if len(fields) > 19 and fields[0] != b"Z" else None


def owner_token(pid: int | None = None) -> str:
    """``PID:START`` naming this process (or ``pid``) for as long as it lives, never a later one with its pid."""
    pid = os.getpid() if pid is None else pid
    return f"{pid}:{start_time(pid) or ''}"


def alive(token: str) -> bool:
    """Whether the process an ``owner_token`` names still runs (True where it cannot be told)."""
    pid, _, started = token.partition(":")
    if not pid.isdigit():
        return True
    if not started:  # no /proc when the token was made: the pid alone
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            pass
        return True
    return start_time(int(pid)) == started
