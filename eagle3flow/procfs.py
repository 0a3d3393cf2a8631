"""Process ancestry from /proc (Linux)."""
from __future__ import annotations


def parent_pid(pid: int) -> int | None:
    """The parent of ``pid``, or None when it cannot be read."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            # the command name may hold spaces and parentheses: ppid follows the last ')'
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return None


def ancestor_chain(pid: int) -> list[int]:
    """``pid`` and its ancestors, innermost first, up to (not including) init."""
    chain: list[int] = []
    while pid is not None and pid > 1 and pid not in chain:
        chain.append(pid)
        pid = parent_pid(pid)
    return chain
