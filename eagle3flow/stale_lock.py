"""Rerun after a kill: clear the Snakemake lock a killed run left behind.

A SIGKILLed or power-cut Snakemake leaves ``.snakemake/locks/`` behind, and the next
run refuses to start until someone runs ``--unlock``. The operator's rerun must just
continue, so the workflow removes the lock itself, but only when no Snakemake
process on this host still runs in the same working directory (a real concurrent
run keeps its lock and Snakemake reports it as usual).
"""
from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

from eagle3flow.procfs import ancestor_chain


def live_snakemake_pids(workdir: str | os.PathLike) -> list[int]:
    """PIDs of other processes on this host whose cwd is ``workdir`` and whose command
    line mentions snakemake (this process and its ancestors excluded)."""
    workdir = os.path.realpath(workdir)
    mine = set(ancestor_chain(os.getpid()))
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) in mine:
            continue
        try:
            if os.path.realpath(entry / "cwd") != workdir:
                continue
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if "snakemake" in cmdline:
            found.append(int(entry.name))
    return found


def clear_stale_lock(workdir: str | os.PathLike = ".") -> bool:
    """Remove ``workdir/.snakemake/locks`` if it exists and no live Snakemake owns it."""
    locks = Path(workdir) / ".snakemake" / "locks"
    if not locks.is_dir() or not any(locks.glob("*.lock")):
        return False
    if live_snakemake_pids(workdir):
        return False
    shutil.rmtree(locks)
    print(f"eagle3flow: removed the lock a killed run left in {locks}; continuing from the cache",
          file=sys.stderr)
    return True
