"""The drain side of a cycle of the unit: drain for a GPU stage, and hand the unit back
(eagle3flow/ops/drain/restore.py) after a run's last GPU stage or a failed one.

* ``drain`` checks that nobody outside the unit (and outside this run's own jobs) holds
  the stage's GPUs, stops the unit, waits until its cgroup is empty and the GPUs'
  memory is released, and starts the run's detached watchdog
  (eagle3flow/ops/drain/watchdog.py). When the unit is already drained, by this run or
  by another (another checkout, another results folder: the session is the unit's,
  eagle3flow/ops/drain/state.py), it joins that session: it checks that the unit is
  still stopped (and stops it again if someone started it) and registers the stage.
* ``stage_ended`` hands the unit back when the stage failed or when no other drained
  stage of this run is still to come (the plan ``write_plan`` registered at the run's
  start); the restore then waits for any other run of the session that still needs it.
"""
from __future__ import annotations

import getpass
import json
import os
import socket
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

from eagle3flow.ops.drain.gpus import describe_holders, gpus_busy, handle_foreign, of_runs, wait_until
from eagle3flow.ops.drain.gpu_holders import GpuQueryError, describe_process, gpu_memory_used, gpu_processes
from eagle3flow.ops.drain.restore import reconcile, locked_between_restores, restore
from eagle3flow.ops.drain.state import (ACTIVE_STATES, JOB_ENV, RUN_ENV, ServiceError, State, iso_time, log,
                                        restore_command, run_record, session_runs, session_verdict, this_run)
from eagle3flow.ops.drain.systemd_unit import require_unit, systemctl, unit_pids, unit_properties
from eagle3flow.procfs import boot_id, pid_namespace, start_ticks, verdict


def _start_watchdog(settings: dict, state: State, run: dict) -> dict:
    """The run's watchdog, detached; its identity for the session."""
    env = {k: v for k, v in os.environ.items() if k not in (RUN_ENV, JOB_ENV)}
    with open(state.watchdog_log, "a") as out:
        # setsid: the watchdog survives the run's process group being killed. It carries no
        # run token: it waits for the processes that do.
        proc = subprocess.Popen(
            [sys.executable, "-m", "eagle3flow.ops.drain.service", "watchdog", "--state-dir", str(state.dir),
             "--config-json", json.dumps(settings), "--pid", str(run["snakemake_pid"]),
             "--pid-start", str(run.get("snakemake_start")), "--run-id", str(run["run_id"])],
            start_new_session=True, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
            cwd="/", close_fds=True, env=env)
    return {"watchdog_pid": proc.pid, "watchdog_start": start_ticks(proc.pid)}


def _run_entry(settings: dict, state: State, run: dict) -> dict:
    """A run in the session: who it is, the GPU stages it plans, its watchdog."""
    identity = ("snakemake_pid", "snakemake_start", "boot_id", "host", "pid_ns", "user", "service_dir")
    return {**{key: run.get(key) for key in identity}, "stages": run.get("stages", []), "ended": [],
            "released": False, **_start_watchdog(settings, state, run)}


def _join_drain(settings: dict, state: State, stage: str, gpus: list[int], run_id: str | None) -> dict:
    """The unit is drained already (or being drained): wait until that drain finished, check
    that the unit is still stopped and that nobody outside this run took the GPUs since,
    and register ``stage``. This run's GPU jobs may hold the GPUs now (a sibling stage):
    they are its own; another run's are not."""
    own_runs = [run_id]
    deadline = time.monotonic() + settings["stop_timeout_s"] + settings["gpu_release_timeout_s"] + 60
    while True:
        session = state.read(state.session)
        if session is None or (run_id is not None and run_id not in session_runs(session)):
            raise ServiceError(f"the drain {stage} joined did not complete (the session closed); "
                               "see the other drain_service logs")
        if session.get("drained_at"):
            break
        if time.monotonic() > deadline:
            raise ServiceError(f"the drain {stage} joined did not finish in time; see the other drain_service logs")
        time.sleep(settings["poll_interval_s"])
    _stop_if_started_again(settings, state, stage, gpus, own_runs)
    handle_foreign(settings, gpus, f"{stage}: after the unit was drained", own_runs)
    own = sorted({h.pid for h in gpu_processes(settings["nvidia_smi"], gpus, settings["nvidia_smi_timeout_s"]) if of_runs(h.pid, own_runs)})
    log(f"{settings['unit']} is drained since {iso_time(session['drained_at'])}: {stage} registered"
        + (f" (the run's own GPU job(s) {own} hold the GPUs now; not foreign)" if own else ""))
    return session


def _stop_if_started_again(settings: dict, state: State, stage: str, gpus: list[int], own_runs: list) -> None:
    """Someone (an operator, a timer, systemd's Restart=) started the unit while it was
    drained for this run: the stage would load on GPUs production holds. Stop it again,
    recorded in the session (the cycle's downtime is then not one stretch)."""
    properties = unit_properties(settings)
    if unit_stopped(settings, properties):
        return
    unit = settings["unit"]
    log(f"!!! {unit} was started again while drained for this run (ActiveState="
        f"{properties.get('ActiveState')}): stopping it again for {stage}")
    with state.locked():
        session = state.read(state.session)
        if session is not None:
            session.setdefault("external_starts", []).append(
                {"found_at": iso_time(time.time()), "stage": stage, "state": properties.get("ActiveState")})
            state.write(state.session, session)
    _stop_unit(settings, stage, properties)
    _wait_released(settings, gpus, own_runs, f"{stage}: after stopping {unit} again", siblings_may_hold=True)


def drain(settings: dict, state_dir: str, stage: str, gpus: list[int], flag: str | None = None) -> None:
    """Stop the unit and wait until its cgroup is empty and `gpus` are free, or join its
    open session; fail otherwise."""
    state = State(state_dir)
    properties = require_unit(settings)
    unit = settings["unit"]
    run = this_run(state)
    run_id = run["run_id"] if run else None
    # Jobs of dead runs whose session is still open may be ending: not foreign (a fresh
    # drain waits until they have released the GPUs). A live run's jobs are never ours.
    earlier = state.read(state.session) or {}
    own_runs = [run_id] + [r for r, entry in session_runs(earlier).items()
                           if verdict(run_record(entry))[0] == "dead"]
    # Foreign holders first: stopping production is pointless if the stage cannot run.
    handle_foreign(settings, gpus, "before stopping the unit", own_runs)

    with locked_between_restores(settings, state, f"draining it for {stage}"):
        session = state.read(state.session)
        inherited: dict = {}
        if session is not None:
            alive, why = session_verdict(session)
            if alive == "dead":
                inherited = reconcile(settings, state, session, properties, why)
                session = None
                properties = unit_properties(settings)
        if session is not None:
            runs = session_runs(session)
            if run is None and runs:
                raise ServiceError(
                    f"{unit} is drained by run(s) {', '.join(runs)} ({session_verdict(session)[1]}); its "
                    f"session is {state.session}. If none of them runs any more, restore it: "
                    f"{restore_command(state)}")
            if run is not None and run_id not in runs:
                log(f"{unit} is drained already ("
                    + (f"by run(s) {', '.join(runs)}" if runs else "by hand")
                    + f"): run {run_id} ({run.get('service_dir')}) joins its session")
                runs[run_id] = _run_entry(settings, state, run)
            elif run is not None:
                runs[run_id]["released"] = False    # a failed stage released it; this one needs it again
            session["stages"] = sorted(set(session["stages"]) | {stage})
            session["gpus"] = sorted(set(session.get("gpus") or []) | set(gpus))   # what the restore waits for
            session.setdefault("drained_at", session.get("stopped_at"))
            state.write(state.session, session)
            joining = True
        else:
            # An operator who had the unit stopped gets it back stopped.
            was_active = inherited.get("was_active")
            if was_active is None:
                was_active = properties.get("ActiveState") in ACTIVE_STATES
            session = {"unit": unit, "stopped_at": time.time(), "stages": [stage], "ended_jobs": [],
                       "was_active": was_active, "boot_id": boot_id(), "host": socket.gethostname(),
                       "pid_ns": pid_namespace("self"), "user": getpass.getuser(), "gpus": list(gpus),
                       "settings": settings, "drained_at": None, "restore_attempts": [],
                       "previous_run_ids": inherited.get("previous_run_ids", []), "runs": {}}
            if run is None:
                log("no live Snakemake run above this job: no watchdog (restore by hand if the run dies)")
            else:
                session["runs"][run_id] = _run_entry(settings, state, run)
            state.write(state.session, session)
            joining = False

    if joining:
        _join_drain(settings, state, stage, gpus, run_id)
    else:
        _stop_and_release(settings, state, stage, gpus, properties, own_runs, session["stopped_at"], run_id)
    if flag:
        Path(flag).parent.mkdir(parents=True, exist_ok=True)
        Path(flag).write_text(json.dumps({"unit": unit, "stage": stage, "run_id": run_id,
                                          "at": iso_time(time.time())}) + "\n")


def _stop_unit(settings: dict, stage: str, properties: dict) -> None:
    """``systemctl stop`` the unit and wait until it is inactive with an empty cgroup."""
    unit = settings["unit"]
    log(f"stopping {unit} for {stage} (was {properties.get('ActiveState')})")
    try:
        result = systemctl(settings, "stop", unit, timeout=settings["stop_timeout_s"])
        if result.returncode != 0:
            log(f"systemctl stop {unit}: rc={result.returncode} {result.stderr.strip()}")
    except ServiceError as error:
        log(f"{error}; waiting for {unit} to stop anyway")
    if not wait_until(lambda: unit_stopped(settings), settings["stop_timeout_s"], settings["poll_interval_s"]):
        props = unit_properties(settings)
        left = sorted(unit_pids(settings, props))
        raise ServiceError(
            f"{unit} did not stop within drain.stop_timeout_s={settings['stop_timeout_s']} s "
            f"(ActiveState={props.get('ActiveState')}); processes still in its cgroup:\n"
            + ("\n".join(f"  {describe_process(p)}" for p in left) or "  (none)")
            + f"\nnothing was loaded on the GPUs; see journalctl -u {unit}")


def unit_stopped(settings: dict, properties: dict | None = None) -> bool:
    props = properties or unit_properties(settings)
    return props.get("ActiveState") in ("inactive", "failed") and not unit_pids(settings, props)


def _wait_released(settings: dict, gpus: list[int], own_runs: list, when: str, siblings_may_hold: bool) -> None:
    """Wait until no process holds ``gpus`` and their memory is idle (foreign holders fail
    at once). ``siblings_may_hold``: the run's own GPU jobs may hold them (a drain that
    joins while a sibling stage runs); their memory is theirs then."""
    def released() -> bool:
        handle_foreign(settings, gpus, when, own_runs)
        holders, busy = gpus_busy(settings, gpus)
        if siblings_may_hold:
            others = [h for h in holders if not of_runs(h.pid, own_runs)]
            siblings = len(holders) > len(others)
            return not others and (siblings or not busy)
        return not holders and not busy

    if not wait_until(released, settings["gpu_release_timeout_s"], settings["poll_interval_s"]):
        memory = gpu_memory_used(settings["nvidia_smi"], settings["nvidia_smi_timeout_s"])
        raise ServiceError(
            f"GPUs {gpus} still busy {settings['gpu_release_timeout_s']} s after {settings['unit']} stopped "
            f"(drain.gpu_release_timeout_s): used MiB "
            + ", ".join(f"GPU {i}: {memory.get(i, ('', '?'))[1]}" for i in gpus)
            + "\n" + describe_holders(gpu_processes(settings["nvidia_smi"], gpus, settings["nvidia_smi_timeout_s"]), own_runs))


def _stop_and_release(settings: dict, state: State, stage: str, gpus: list[int], properties: dict,
                      own_runs: list, stopped_at: float, run_id: str | None) -> None:
    unit = settings["unit"]
    try:
        _stop_unit(settings, stage, properties)
        _wait_released(settings, gpus, own_runs, "after stopping the unit", siblings_may_hold=False)
    except (ServiceError, GpuQueryError) as error:
        log(f"drain failed: {error}")
        log("bringing the unit back before failing")
        try:
            restore(settings, str(state.dir), reason=f"drain for {stage} failed", releasing=run_id)
        except ServiceError as restore_error:
            log(f"restore failed too: {restore_error}")
        raise ServiceError(str(error)) from error

    with state.locked():
        session = state.read(state.session)
        if session is not None:
            session["drained_at"] = time.time()
            state.write(state.session, session)
    log(f"{unit} stopped; GPUs {gpus} free after {time.time() - stopped_at:.1f} s")


# --- a GPU job ended -------------------------------------------------------------------

def stage_ended(settings: dict, state_dir: str, stage: str, exit_code: int) -> None:
    """A GPU stage's job of this run ($EAGLE3FLOW_RUN) ended with ``exit_code`` (its real
    status: a signal n is 128+n): hand the unit back unless another drained stage of
    this live run follows."""
    state = State(state_dir)
    token = os.environ.get(RUN_ENV)
    with state.locked():
        session = state.read(state.session)
        if session is None:
            log(f"{stage} ended (rc={exit_code}); the unit is not drained (nothing to restore)")
            return
        # One entry per ended job: a stage may run several (partitions, streaming links).
        session.setdefault("ended_jobs", []).append(
            {"stage": stage, "rc": exit_code, "at": iso_time(time.time()), "run_id": token})
        entry = session_runs(session).get(token)
        if entry is not None:
            entry["ended"].append(stage)
        state.write(state.session, session)
    run_alive = entry is not None and verdict(run_record(entry))[0] != "dead"
    # The plan lists a stage once per job this run will run.
    pending = sorted(Counter(entry["stages"]) - Counter(entry["ended"])) if run_alive else []
    if exit_code != 0:
        reason = f"{stage} failed (rc={exit_code})"
    elif pending:
        log(f"{stage} done; {settings['unit']} stays down for {', '.join(pending)}")
        return
    elif run_alive or entry is None:
        reason = f"{stage} was the last GPU stage of the run"
    else:
        reason = f"{stage} ended after its run's Snakemake process died: no GPU stage follows"
    restore(settings, state_dir, reason, releasing=token)
