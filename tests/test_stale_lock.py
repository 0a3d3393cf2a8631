"""Snakemake's lock of a run is removed by the workflow only when it provably belongs to
a dead process of this host; any other lock is left, with what to check.

Snakemake's lock files hold file lists, no owner: onstart records one for this run's
lock files (.snakemake/eagle3flow/lock-owners.json: host, boot id, pid namespace, pid
and start time of the Snakemake main process, user). These tests write such records
for real processes (alive, dead, reused pids) and real lock files.
"""
from __future__ import annotations

import getpass
import json
import os
import socket
import subprocess
import time
from pathlib import Path

import pytest

from support.deadline import deadline
from eagle3flow.procfs import start_ticks as process_start_ticks
from eagle3flow.ops.stale_lock import clear_stale_lock


def make_lock(workdir: Path, name: str = "0.output.lock") -> Path:
    locks = workdir / ".snakemake" / "locks"
    locks.mkdir(parents=True, exist_ok=True)
    (locks / name).write_text("results/x\n")
    return locks / name


def boot_id() -> str:
    return Path("/proc/sys/kernel/random/boot_id").read_text().strip()


def owner_of(pid: int, **overrides) -> dict:
    """The owner record onstart writes for a Snakemake main process ``pid``."""
    return {"host": socket.gethostname(), "boot_id": boot_id(),
            "pid_ns": os.stat("/proc/self/ns/pid").st_ino, "pid": pid,
            "start_ticks": process_start_ticks(pid), "user": getpass.getuser(),
            "started_at": time.time(), **overrides}


def record(workdir: Path, lock: Path, owner: dict) -> None:
    """An owner record for ``lock`` as it is now (the file's identity included)."""
    st = lock.stat()
    path = workdir / ".snakemake" / "eagle3flow" / "lock-owners.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    owners = json.loads(path.read_text()) if path.exists() else {}
    owners[lock.name] = {**owner, "lock": {"inode": st.st_ino, "mtime_ns": st.st_mtime_ns, "size": st.st_size}}
    path.write_text(json.dumps(owners))


def dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


@pytest.fixture
def live(tmp_path):
    """A live process standing for a Snakemake main process elsewhere (another cwd,
    no 'snakemake' in its command line: what a run of another user or namespace looks like)."""
    (tmp_path / "elsewhere").mkdir()
    proc = subprocess.Popen(["sleep", "300"], cwd=tmp_path / "elsewhere")
    yield proc
    proc.kill()
    proc.wait()


def test_lock_of_a_dead_process_of_this_host_is_cleared(tmp_path, capsys):
    lock = make_lock(tmp_path)
    record(tmp_path, lock, owner_of(dead_pid(), start_ticks=12345))
    assert clear_stale_lock(tmp_path) is True
    assert not lock.exists()
    assert "removed the lock of a dead run" in capsys.readouterr().err
    assert clear_stale_lock(tmp_path) is False  # nothing left to clear


def test_lock_whose_pid_now_belongs_to_another_process_is_cleared(tmp_path, live):
    lock = make_lock(tmp_path)
    record(tmp_path, lock, owner_of(live.pid, start_ticks=process_start_ticks(live.pid) - 1))
    assert clear_stale_lock(tmp_path) is True and not lock.exists()


def test_lock_from_before_a_reboot_is_cleared(tmp_path, live):
    lock = make_lock(tmp_path)
    # Same host, another boot: whatever runs under that pid now, the owner died with the reboot.
    record(tmp_path, lock, owner_of(live.pid, boot_id="0" * 8 + "-previous-boot"))
    assert clear_stale_lock(tmp_path) is True and not lock.exists()


def test_lock_of_a_live_run_elsewhere_is_kept(tmp_path, live, capsys):
    """A live owner keeps its lock, whatever its cwd or command line says."""
    lock = make_lock(tmp_path)
    record(tmp_path, lock, owner_of(live.pid))
    assert clear_stale_lock(tmp_path) is False
    assert lock.exists()
    err = capsys.readouterr().err
    assert f"pid {live.pid}" in err and "is alive" in err, err


def test_lock_of_another_host_is_kept_with_what_to_check(tmp_path, capsys):
    """A run started from another login node on the shared file system SLURM needs."""
    lock = make_lock(tmp_path)
    record(tmp_path, lock, owner_of(dead_pid(), host="login2.cluster", user="alice"))
    assert clear_stale_lock(tmp_path) is False and lock.exists()
    err = capsys.readouterr().err
    for what in ("login2.cluster", "alice", "snakemake --unlock", str(tmp_path)):
        assert what in err, (what, err)


def test_lock_of_another_pid_namespace_is_kept(tmp_path, capsys):
    """A run in a container (another pid namespace): its pid means nothing here."""
    lock = make_lock(tmp_path)
    record(tmp_path, lock, owner_of(dead_pid(), pid_ns=1))
    assert clear_stale_lock(tmp_path) is False and lock.exists()
    assert "pid namespace" in capsys.readouterr().err


def test_lock_without_owner_is_kept_with_advice(tmp_path, capsys):
    """No record (a Snakemake of another version, another user's run, one still starting):
    nothing proves it dead."""
    lock = make_lock(tmp_path)
    assert clear_stale_lock(tmp_path) is False and lock.exists()
    err = capsys.readouterr().err
    assert "no owner" in err and "snakemake --unlock" in err, err


def test_record_of_an_older_lock_file_of_the_same_name_does_not_count(tmp_path):
    """A dead run's record must not clear a new lock file that reused its name."""
    lock = make_lock(tmp_path)
    record(tmp_path, lock, owner_of(dead_pid()))
    lock.unlink()
    time.sleep(0.01)
    lock = make_lock(tmp_path)   # another run's, which has not recorded itself yet
    lock.write_text("results/y\nresults/z\n")
    assert clear_stale_lock(tmp_path) is False and lock.exists()


def test_only_the_provably_dead_lock_files_are_removed(tmp_path, live):
    dead = make_lock(tmp_path, "0.output.lock")
    alive = make_lock(tmp_path, "1.output.lock")
    record(tmp_path, dead, owner_of(dead_pid()))
    record(tmp_path, alive, owner_of(live.pid))
    assert clear_stale_lock(tmp_path) is True
    assert not dead.exists() and alive.exists()


def test_record_owner_names_this_process(tmp_path):
    from eagle3flow.ops.stale_lock import record_owner

    lock = make_lock(tmp_path)
    record_owner(tmp_path, [lock])
    owners = json.loads((tmp_path / ".snakemake" / "eagle3flow" / "lock-owners.json").read_text())
    owner = owners[lock.name]
    assert owner["pid"] == os.getpid() and owner["boot_id"] == boot_id()
    assert owner["start_ticks"] == process_start_ticks(os.getpid())
    assert owner["lock"]["inode"] == lock.stat().st_ino
    assert clear_stale_lock(tmp_path) is False and lock.exists()   # this process lives


@pytest.mark.parametrize("argv, runs", [
    (["snakemake", "--profile", "local-8gpu"], True),
    (["snakemake", "-c2", "all"], True),
    (["snakemake", "-n", "--profile", "x"], False),
    (["snakemake", "-np"], False),
    (["snakemake", "--dry-run"], False),
    (["snakemake", "--lint"], False),
    (["snakemake", "--report", "report.html"], False),
    (["snakemake", "--unlock"], False),
    (["snakemake", "--summary"], False),
    (["snakemake", "--list-rules"], False),
    (["snakemake", "--dag"], False),
    (["snakemake", "--rulegraph"], False),
    (["snakemake", "--touch"], False),
    (["snakemake", "--cores", "2", "--configfile", "a.yaml", "b.yaml", "-n"], False),
    (["python", "-m", "something.else"], False),
])
def test_only_invocations_that_run_jobs_count(argv, runs):
    from eagle3flow.ops.invocation import runs_jobs

    assert runs_jobs(argv) is runs


def job_of(run_id: str, wrapper: int, seconds: float) -> subprocess.Popen:
    """A process of run ``run_id``'s GPU stage whose wrapper is ``wrapper``."""
    env = {**os.environ, "EAGLE3FLOW_RUN": run_id,
           "EAGLE3FLOW_JOB": f"{wrapper}:{process_start_ticks(wrapper) or 1}"}
    return subprocess.Popen(["sleep", str(seconds)], env=env)


def test_lock_of_a_killed_run_waits_for_its_exiting_stage(tmp_path, capsys):
    """A rerun right after a SIGKILL of the whole run: the stage (its wrapper gone) is still
    exiting. The lock goes once it has ended (no --unlock), not before."""
    lock = make_lock(tmp_path)
    record(tmp_path, lock, {**owner_of(dead_pid(), start_ticks=12345), "run_id": "killed-run"})
    stage = job_of("killed-run", dead_pid(), seconds=2)
    try:
        assert clear_stale_lock(tmp_path) is True
        assert stage.poll() is not None, "removed the lock while the killed run's stage still ran"
        assert not lock.exists()
    finally:
        stage.kill()
        stage.wait()


def test_lock_of_a_dead_run_whose_orphaned_job_runs_is_kept(tmp_path, live, capsys):
    """Only the Snakemake main process was killed: its job (the wrapper alive) runs on."""
    lock = make_lock(tmp_path)
    record(tmp_path, lock, {**owner_of(dead_pid(), start_ticks=12345), "run_id": "orphaning-run"})
    job = job_of("orphaning-run", live.pid, seconds=120)
    try:
        with deadline(60, "clear_stale_lock waited for a job that runs on (120 s)"):
            assert clear_stale_lock(tmp_path) is False
        assert lock.exists()
        assert f"jobs of that run still run here: pid(s) [{job.pid}]" in capsys.readouterr().err
    finally:
        job.kill()
        job.wait()
