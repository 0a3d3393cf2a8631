"""The lock of a killed run is cleared; the lock of a live run is kept."""
import os
import signal
import subprocess
import sys
import time

from eagle3flow.stale_lock import clear_stale_lock, live_snakemake_pids


def make_lock(workdir):
    locks = workdir / ".snakemake" / "locks"
    locks.mkdir(parents=True)
    (locks / "0.output.lock").write_text("results/x\n")
    return locks


def standin(cwd):
    """A live process whose command line says snakemake, once it has started."""
    ready = cwd / ".standin-ready"
    code = "import pathlib, sys, time; pathlib.Path(sys.argv[1]).touch(); time.sleep(120)"
    proc = subprocess.Popen([sys.executable, "-c", code, str(ready), "snakemake-standin"], cwd=cwd)
    deadline = time.monotonic() + 60
    while not ready.exists():
        assert proc.poll() is None and time.monotonic() < deadline, "stand-in did not start"
        time.sleep(0.05)
    return proc


def test_stale_lock_is_cleared(tmp_path):
    locks = make_lock(tmp_path)
    assert clear_stale_lock(tmp_path) is True
    assert not locks.exists()
    assert clear_stale_lock(tmp_path) is False  # nothing left to clear


def test_lock_of_a_live_snakemake_is_kept(tmp_path):
    locks = make_lock(tmp_path)
    # A real process whose command line says snakemake, running in the workdir.
    proc = standin(tmp_path)
    try:
        assert proc.pid in live_snakemake_pids(tmp_path)
        assert clear_stale_lock(tmp_path) is False
        assert locks.exists()
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert clear_stale_lock(tmp_path) is True


def test_other_directories_do_not_count(tmp_path):
    make_lock(tmp_path / "a")
    (tmp_path / "b").mkdir()
    proc = standin(tmp_path / "b")
    try:
        assert clear_stale_lock(tmp_path / "a") is True
    finally:
        proc.kill()
        proc.wait()
    assert os.path.exists(tmp_path / "b")
