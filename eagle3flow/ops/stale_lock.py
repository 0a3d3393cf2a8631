"""Rerun after a kill: clear the Snakemake lock of a run that provably died on this host.

A SIGKILLed or power-cut Snakemake leaves ``.snakemake/locks/`` behind, and the next
run refuses to start until someone runs ``--unlock``. The operator's rerun after a kill
on this host must just continue, but removing the lock of a run that is alive lets a
second run redo the first one's in-flight outputs (``rerun-incomplete``). Snakemake's
lock files hold file lists, no owner, so the workflow records one:

* onstart (after Snakemake took its locks) writes, for each of this run's lock files,
  the identity of the Snakemake main process (eagle3flow/procfs.py: host, boot id, pid
  namespace, pid and start time, user), the run's token ($EAGLE3FLOW_RUN, which its
  jobs carry), whether its jobs run on this host, and the lock file's own identity
  (inode, mtime, size) to ``.snakemake/eagle3flow/lock-owners.json``;
* when the workflow is read by an invocation that runs jobs (never a dry run, --lint,
  --report, ...: eagle3flow/ops/invocation.py), a lock file is removed only if its record
  matches the file and names a process that is provably dead (same host and another
  boot, or same host, boot and pid namespace and the pid gone or reused) whose jobs
  are gone too (none of this host carries its token; not a cluster executor's run,
  whose jobs may still run elsewhere). Every other lock (no record, another host,
  another pid namespace, a live owner, its jobs still running) is left to Snakemake,
  which refuses to run, and the workflow prints what to check first.
"""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

from eagle3flow.atomic import write_text
from eagle3flow.ops.drain.state import RUN_ENV, wrapper_gone
from eagle3flow.procfs import ancestor_chain, cmdline, cwd, identity, pids, pids_with_env, verdict

# A rerun right after a SIGKILL of the whole run finds the GPU stages still exiting (their
# wrapper died; they got SIGTERM from it: eagle3flow/ops/drain/gpu_stage.py): wait this long for them.
DYING_GRACE_S = 30.0

OWNERS = Path(".snakemake") / "eagle3flow" / "lock-owners.json"


def _owners_file(workdir) -> Path:
    return Path(workdir) / OWNERS


def _read_owners(workdir) -> dict:
    try:
        return json.loads(_owners_file(workdir).read_text())
    except (OSError, ValueError):
        return {}


def _file_identity(path: Path) -> dict | None:
    try:
        st = path.stat()
    except OSError:
        return None
    return {"inode": st.st_ino, "mtime_ns": st.st_mtime_ns, "size": st.st_size}


def _write_owners(workdir, owners: dict) -> None:
    write_text(_owners_file(workdir), json.dumps(owners, indent=1) + "\n")


def record_owner(workdir, lock_files, pid: int | None = None, run_id: str | None = None,
                 local_exec: bool = True) -> None:
    """onstart: this run (Snakemake main process ``pid``, default this one; its jobs carry
    ``run_id``; they run on this host unless ``local_exec`` is false) owns ``lock_files``."""
    locks = Path(workdir) / ".snakemake" / "locks"
    owners = {name: rec for name, rec in _read_owners(workdir).items() if (locks / name).exists()}
    owner = {**identity(pid), "run_id": run_id, "local_exec": bool(local_exec)}
    for lock in map(Path, lock_files):
        file_id = _file_identity(lock)
        if file_id is not None:
            owners[lock.name] = {**owner, "lock": file_id}
    _write_owners(workdir, owners)


def snakemake_lock_files(workflow) -> list[str]:
    """The lock files this run's Snakemake wrote (its file persistence keeps them; other
    backends have none)."""
    persistence = getattr(workflow, "persistence", None)
    return [str(f) for f in (getattr(persistence, "_lockfile", None) or {}).values()]


def live_snakemake_pids(workdir: str | os.PathLike) -> list[int]:
    """PIDs of other processes on this host whose cwd is ``workdir`` and whose command
    line mentions snakemake (this process and its ancestors excluded): one more reason
    to keep a lock, whatever its record says."""
    workdir = os.path.realpath(workdir)
    mine = set(ancestor_chain(os.getpid()))
    return [pid for pid in pids() if pid not in mine and cwd(pid) == workdir
            and "snakemake" in (cmdline(pid) or "")]


def _jobs_left(run_id: str, grace_s: float = DYING_GRACE_S) -> list[int]:
    """Processes of run ``run_id`` still alive, after waiting up to ``grace_s`` while all of
    them are stages of killed jobs that are exiting (an orphaned job whose wrapper lives,
    one that runs for hours, is not waited for)."""
    deadline = time.monotonic() + grace_s
    while True:
        jobs = pids_with_env(RUN_ENV, run_id)
        if not jobs or not all(wrapper_gone(p) for p in jobs) or time.monotonic() > deadline:
            return jobs
        time.sleep(0.2)


def clear_stale_lock(workdir: str | os.PathLike = ".") -> bool:
    """Remove the lock files of ``workdir/.snakemake/locks`` whose owner provably died on
    this host; say what to check for every other one. True if anything was removed."""
    locks = Path(workdir) / ".snakemake" / "locks"
    files = sorted(locks.glob("*.lock")) if locks.is_dir() else []
    if not files:
        return False
    live = live_snakemake_pids(workdir)
    owners = _read_owners(workdir)
    removed, kept = [], []
    for lock in files:
        rec = owners.get(lock.name)
        if rec is None or rec.get("lock") != _file_identity(lock):
            kept.append((lock, "no owner recorded for it (a run still starting, another "
                               "Snakemake version, or written by hand)"))
            continue
        state, why = verdict(rec)
        jobs = _jobs_left(rec["run_id"]) if state == "dead" and rec.get("run_id") else []
        if state == "dead" and jobs:
            kept.append((lock, f"{why}, but jobs of that run still run here: pid(s) {jobs}; they end by "
                               "themselves (or stop them), then rerun"))
        elif state == "dead" and rec.get("local_exec") is False:
            kept.append((lock, f"{why}; its jobs ran through a cluster executor and may still run there "
                               f"(check e.g. squeue -u {rec.get('user')})"))
        elif state == "dead" and not live:
            lock.unlink(missing_ok=True)
            removed.append((lock, why))
        elif state == "dead":
            kept.append((lock, f"{why}, but Snakemake process(es) {live} of this host run in "
                               f"{os.path.realpath(workdir)}"))
        else:
            kept.append((lock, why))
    if removed:
        _write_owners(workdir, {n: r for n, r in owners.items() if (locks / n).exists()})
        if not any(locks.iterdir()):
            locks.rmdir()
        for lock, why in removed:
            print(f"eagle3flow: removed the lock of a dead run ({lock}: {why}); continuing from "
                  "the cache", file=sys.stderr)
    if kept:
        print(f"eagle3flow: left Snakemake's lock in {locks} (Snakemake will refuse to run while it is "
              "there):", file=sys.stderr)
        for lock, why in kept:
            print(f"  {lock.name}: {why}", file=sys.stderr)
        print(f"  if no Snakemake runs in {os.path.realpath(workdir)} any more (check the host, pid "
              "and user above), run `snakemake --unlock` there, then rerun", file=sys.stderr)
    return bool(removed)
