"""Processes from /proc (Linux): ancestry, identity, environment.

A pid alone names nothing durable: it is reused, means another process in another pid
namespace, and nothing after a reboot. An *identity* (:func:`identity`) is the host,
the boot id, the pid namespace, the pid and its start time in clock ticks; with it
:func:`verdict` can tell "this process is provably dead" from "alive" and from
"cannot be told from here" (another host, another pid namespace).
"""
from __future__ import annotations

import ctypes
import getpass
import os
import signal
import socket
import time
from pathlib import Path


def stat_fields(pid: int | str) -> list[str] | None:
    """``/proc/<pid>/stat`` from its third field on (man 5 proc): ``[state, ppid, pgrp,
    session, ...]``, start time at index 19; None when it cannot be read (gone, another
    pid namespace)."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # the command name may hold spaces and parentheses: the fields follow the last ')'
    fields = text.rsplit(")", 1)[-1].split()
    return fields if len(fields) > 19 else None


def pids() -> list[int]:
    """Every pid /proc lists now (zombies included)."""
    return [int(entry) for entry in os.listdir("/proc") if entry.isdigit()]


def parent_pid(pid: int) -> int | None:
    """The parent of ``pid``, or None when it cannot be read."""
    fields = stat_fields(pid)
    return int(fields[1]) if fields else None


def ancestor_chain(pid: int) -> list[int]:
    """``pid`` and its ancestors, innermost first, up to (not including) init."""
    chain: list[int] = []
    while pid is not None and pid > 1 and pid not in chain:
        chain.append(pid)
        pid = parent_pid(pid)
    return chain


def start_ticks(pid: int) -> int | None:
    """The process's start time in clock ticks since boot (tells a pid from a reused
    one); None when it is gone (or a zombie: it has ended, only its parent's wait() is missing)."""
    fields = stat_fields(pid)
    return None if fields is None or fields[0] in ("Z", "X") else int(fields[19])


def running(pid: int | None, recorded_start: int | None = None) -> bool:
    """Whether ``pid`` runs and is the process that started at ``recorded_start`` clock
    ticks (any process with that pid, when None): never a reused pid."""
    now = start_ticks(pid) if pid is not None else None
    return now is not None and (recorded_start is None or now == recorded_start)


def is_zombie(pid: int) -> bool:
    """Whether ``pid`` has ended and only its parent's wait() is missing."""
    fields = stat_fields(pid)
    return fields is not None and fields[0] == "Z"


def pid_alive(pid: int) -> bool:
    """Whether a process ``pid`` exists here and has not ended: a zombie (ended, not yet
    reaped) is dead; another user's process is alive. Works without /proc (signal 0)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return not is_zombie(pid)


def live_group_members(pgid: int) -> list[int]:
    """Pids of process group ``pgid`` that still run (zombies excluded: a group made
    only of zombies has ended, although killpg still finds it)."""
    members = []
    for pid in pids():
        fields = stat_fields(pid)
        if fields is not None and int(fields[2]) == pgid and fields[0] not in ("Z", "X"):
            members.append(pid)
    return members


def descendants(pid: int) -> set[int]:
    """``pid`` and all its descendants."""
    children: dict[int, list[int]] = {}
    for child in pids():
        parent = parent_pid(child)
        if parent is not None:
            children.setdefault(parent, []).append(child)
    found, todo = set(), [pid]
    while todo:
        current = todo.pop()
        if current not in found:
            found.add(current)
            todo.extend(children.get(current, []))
    return found


def cmdline(pid: int) -> str | None:
    """The command line, arguments joined by spaces ('' for a kernel thread); None when
    it cannot be read."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return None


def owner_uid(pid: int) -> int | None:
    """The real uid the process runs as; None when it cannot be read."""
    try:
        with open(f"/proc/{pid}/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("Uid:"))
    except (OSError, StopIteration, ValueError):
        return None


def cwd(pid: int) -> str | None:
    """The process's working directory (resolved); None when it cannot be read."""
    try:
        return os.readlink(f"/proc/{pid}/cwd")
    except OSError:
        return None


def boot_id() -> str | None:
    """This boot's random id (a new one after every reboot)."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return None


def pid_namespace(pid: int | str = "self") -> int | None:
    """The inode of the process's pid namespace (equal for processes that see the same pids)."""
    try:
        return os.stat(f"/proc/{pid}/ns/pid").st_ino
    except OSError:
        return None


# The kernel's initial pid namespace, the host's: its inode is fixed (PROC_PID_INIT_INO,
# include/linux/proc_ns.h).
HOST_PID_NAMESPACE = 0xEFFFFFFC


def in_host_pid_namespace() -> bool:
    """Whether this process sees the host's pids, as nvidia-smi reports them; in a
    container's pid namespace they name other processes here, or none."""
    return pid_namespace("self") == HOST_PID_NAMESPACE


def boot_time() -> float | None:
    """When this boot started (unix time), from /proc/stat's btime."""
    try:
        for line in Path("/proc/stat").read_text().splitlines():
            if line.startswith("btime "):
                return float(line.split()[1])
    except (OSError, ValueError):
        pass
    return None


def identity(pid: int | None = None) -> dict:
    """What names process ``pid`` (default: this one) durably, for records others check."""
    pid = os.getpid() if pid is None else pid
    return {"host": socket.gethostname(), "boot_id": boot_id(),
            "pid_ns": pid_namespace(pid if pid != os.getpid() else "self"), "pid": pid,
            "start_ticks": start_ticks(pid), "user": getpass.getuser(), "started_at": time.time()}


def verdict(record: dict) -> tuple[str, str]:
    """("dead" | "alive" | "unknown", why) for a process :func:`identity` recorded.

    Dead only when provable from here: same host and another boot (it died with the
    reboot), or same host, boot and pid namespace and the pid is gone or now belongs to
    a process started at another time."""
    details = ([f"user {record['user']}"] if record.get("user") else []) + (
        [f"started {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(record['started_at']))}"]
        if record.get("started_at") else [])
    who = f"pid {record.get('pid')} on {record.get('host')}" + (f" ({', '.join(details)})" if details else "")
    if record.get("host") != socket.gethostname():
        return "unknown", f"{who}: another host; check there whether it still runs"
    if record.get("boot_id") and record.get("boot_id") != boot_id():
        return "dead", f"{who}: died with the reboot (another boot id)"
    if record.get("pid_ns") is not None and record.get("pid_ns") != pid_namespace("self"):
        return "unknown", f"{who}: another pid namespace (a container?); check there whether it still runs"
    pid = record.get("pid")
    if not isinstance(pid, int) or pid <= 0:
        return "unknown", f"{who}: no pid recorded"
    now = start_ticks(pid)
    if now is None:
        return "dead", f"{who}: gone"
    if record.get("start_ticks") is not None and now != record["start_ticks"]:
        return "dead", f"{who}: gone (the pid now belongs to another process)"
    if record.get("start_ticks") is None:
        return "unknown", f"{who}: a process with that pid runs; no start time recorded to tell"
    return "alive", f"{who}: is alive"


def environ(pid: int) -> dict[str, str] | None:
    """The environment ``pid`` was started with, or None when it cannot be read
    (another user's process, gone)."""
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return None
    return dict(kv.split("=", 1) for kv in raw.decode(errors="replace").split("\0") if "=" in kv)


def pids_with_env(name: str, value: str) -> list[int]:
    """Live processes (zombies excluded) started with ``name=value`` in their environment:
    inherited by every descendant, through reparenting and setsid."""
    return sorted(pid for pid in pids()
                  if (environ(pid) or {}).get(name) == value and start_ticks(pid) is not None)


def signal_on_parent_death(sig: int = signal.SIGTERM) -> bool:
    """Have the kernel send ``sig`` to this process when its parent dies, even by SIGKILL
    (``prctl(PR_SET_PDEATHSIG)``). True when set; Linux only, elsewhere a no-op (False).
    In a ``preexec_fn`` the parent is the process that starts the child."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, int(sig))  # 1 = PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return False
    return True


def usable_cores() -> int:
    """The cores this process may run on (its affinity: taskset, cgroups, SLURM), where
    the platform says (Linux); else every core."""
    affinity = getattr(os, "sched_getaffinity", None)
    return len(affinity(0)) if affinity else (os.cpu_count() or 1)
