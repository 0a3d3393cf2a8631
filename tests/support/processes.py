"""Process checks from /proc: is a pid alive, which pids are still in a session."""
from __future__ import annotations

import os
from pathlib import Path


def stat_fields(pid: int) -> list[str]:
    """/proc/PID/stat after the command name: state, ppid, pgrp, session, ..."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()


def alive(pid: int) -> bool:
    try:
        return stat_fields(pid)[0] not in "ZX"
    except OSError:
        return False


def session_of(pid: int) -> int | None:
    try:
        return int(stat_fields(pid)[3])
    except OSError:
        return None


def live_session_members(sid: int) -> list[int]:
    """Pids of session ``sid`` that are still running (zombies excluded): a process
    started with ``start_new_session`` and everything it started that stayed in it."""
    return [int(p) for p in os.listdir("/proc") if p.isdigit() and alive(int(p))
            and session_of(int(p)) == sid]
