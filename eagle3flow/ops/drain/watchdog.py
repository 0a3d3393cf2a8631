"""The detached watchdog of a run that drained the unit: hands the unit back (restores
it, unless another run of the session still needs it down) once that run's Snakemake
died.

Started by the run's first drain with ``setsid`` (it survives the run's process group
being killed) and without a run token (it waits for the processes that carry one). Jobs of the dead
run live on when only the Snakemake main process was killed; processes of a job whose
stage wrapper is gone have nobody to hand their result to and are stopped.
"""
from __future__ import annotations

import os
import time

from eagle3flow.ops.drain.restore import record_attempt, restore
from eagle3flow.ops.drain.gpus import describe_holders, gpus_busy, kill_only
from eagle3flow.ops.drain.state import (ServiceError, State, iso_time, log, restore_command, run_pids,
                                        session_runs, wrapper_gone)
from eagle3flow.ops.drain.gpu_holders import GpuQueryError, describe_process, gpu_memory_used
from eagle3flow.procfs import running
from eagle3flow.ops.drain.systemd_unit import unit_pids

def watchdog(settings: dict, state_dir: str, pid: int, pid_start: int | None, run_id: str | None = None) -> int:
    """Detached: once Snakemake `pid` dies with the unit drained for its run `run_id`, wait
    until every job of that run has ended and the GPUs are free (at most
    drain.orphan_timeout_s), then restore (drain.restore_attempts times; the unit stays
    down while another run of the session needs it). Returns the exit status."""
    state = State(state_dir)
    try:
        return _watch(settings, state, pid, pid_start, run_id)
    except Exception as error:  # the last word of a detached process nobody waits for
        log(f"!!! watchdog: stopped by an unexpected error ({error!r}); {settings['unit']} may still be "
            f"drained. Check it, then restore it with:\n!!!   {restore_command(state)}")
        raise


def _watch(settings: dict, state: State, pid: int, pid_start: int | None, run_id: str | None) -> int:
    unit = settings["unit"]
    log(f"watchdog {os.getpid()}: watching Snakemake pid {pid} (run {run_id}) for {unit}")

    def ours(session) -> bool:
        """The session is open and this run is one of its runs."""
        return session is not None and run_id in session_runs(session)

    while True:
        if not ours(state.read(state.session)):
            log("watchdog: the unit was restored; exiting")
            return 0
        if not running(pid, pid_start):
            break
        time.sleep(settings["watchdog_poll_s"])
    log(f"watchdog: Snakemake pid {pid} ended with {unit} still drained")
    deadline = time.monotonic() + settings["orphan_timeout_s"]
    said = None
    while True:
        session = state.read(state.session)
        if not ours(session):
            log("watchdog: the unit was restored; exiting")
            return 0
        try:
            waiting = _still_running(settings, session, run_id)
        except (ServiceError, GpuQueryError) as error:
            # nvidia-smi or systemctl failing is likeliest right when GPU jobs die: it is
            # retried (recorded once per new error) until orphan_timeout_s, never fatal.
            waiting = f"cannot check the GPUs and the unit: {error}"
            if waiting != said:
                record_attempt(state, "watchdog: checking that the dead run's jobs ended", str(error))
        if waiting is None:
            break
        if time.monotonic() > deadline:
            log(f"!!! watchdog: still waiting after drain.orphan_timeout_s={settings['orphan_timeout_s']} s; "
                f"{unit} is NOT restored and its session is kept ({state.session}).\n{waiting}\n"
                f"!!! once they have ended: {restore_command(state)}")
            with state.locked():
                session = state.read(state.session)
                if ours(session):
                    session["watchdog_gave_up"] = {"at": iso_time(time.time()), "waiting_for": waiting}
                    state.write(state.session, session)
            return 1
        if waiting != said:
            log(f"watchdog: waiting before restoring {unit}: {waiting.strip()}")
            said = waiting
        time.sleep(settings["poll_interval_s"])
    for attempt in range(1, int(settings["restore_attempts"]) + 1):
        try:
            restore(settings, str(state.dir), reason=f"watchdog: Snakemake pid {pid} died without restoring",
                    releasing=run_id)
            return 0
        except ServiceError as error:
            log(f"watchdog: restore attempt {attempt}/{settings['restore_attempts']} failed: {error}")
        if not ours(state.read(state.session)):
            return 0
        if attempt < int(settings["restore_attempts"]):
            time.sleep(settings["restore_retry_s"])
    log(f"!!! watchdog: {unit} could not be restored; the session is kept. Fix the unit "
        f"(journalctl -u {unit}), then run:\n!!!   {restore_command(state)}")
    return 1


def _still_running(settings: dict, session: dict, run_id: str | None) -> str | None:
    """What the restore must still wait for once the run died (its jobs, GPU holders), or
    None. Processes of a job whose wrapper is gone have nobody to hand their result to:
    they are stopped here."""
    # Jobs of the dead run (carrying its token) live on when only the Snakemake main
    # process was killed: they end by themselves.
    jobs = sorted(run_pids([run_id]) - {os.getpid()}) if run_id else []
    strays = [p for p in jobs if wrapper_gone(p)]
    if strays:
        kill_only(set(strays), what="process of a killed job of the dead run",
                  why="its job's wrapper is gone; nothing will take its outputs")
        jobs = sorted(run_pids([run_id]) - {os.getpid()})
    gpus = session.get("gpus") or sorted(gpu_memory_used(settings["nvidia_smi"], settings["nvidia_smi_timeout_s"]))
    holders, busy = gpus_busy(settings, gpus)
    holders = [h for h in holders if h.pid not in unit_pids(settings)]
    if not jobs and not holders and not busy:
        return None
    return (("jobs of the dead run still running:\n" + "\n".join(f"  {describe_process(p)}" for p in jobs)
             if jobs else "")
            + ("\nGPUs still held:\n" + describe_holders(holders, [run_id]) if holders else "")
            + (f"\nGPU memory above idle on {busy}" if busy and not holders else ""))
