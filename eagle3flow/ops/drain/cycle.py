"""One drain/restore cycle of the unit: drain for a GPU stage, restore after the run's
last one (or its failure), and reconcile the session a dead run left.

* ``drain`` checks that nobody outside the unit (and outside this run's own jobs) holds
  the stage's GPUs, stops the unit, waits until its cgroup is empty and the GPUs'
  memory is released, and starts the detached watchdog (eagle3flow/ops/drain/watchdog.py).
  When the unit is already drained by this same live run, it only registers the stage.
* ``stage_ended`` restores the unit when the stage failed or when no other drained
  stage of this run is still to come (the plan ``write_plan`` records at the run's start).
* ``restore`` waits for the GPUs to be free, starts the unit and polls its health URL.
  A failed restore keeps the session and names the command to run. It is idempotent.
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
from eagle3flow.ops.drain.state import (ACTIVE_STATES, JOB_ENV, RUN_ENV, ServiceError, State, iso_time,
                                        log, restore_command, run_record, session_verdict, this_run)
from eagle3flow.ops.drain.gpu_holders import GpuQueryError, describe_process, gpu_memory_used, gpu_processes
from eagle3flow.procfs import boot_id, boot_time, pid_namespace, verdict
from eagle3flow.ops.drain.systemd_unit import require_unit, systemctl, unit_healthy, unit_pids, unit_properties

# --- a session of a dead run -----------------------------------------------------------

def _reconcile(settings: dict, state: State, session: dict, properties: dict, why: str) -> dict:
    """Under the lock: close the session of a run that is provably dead (a reboot, a kill
    that took its watchdog too) against the unit's real state, and say what the next
    session inherits. Unit active: systemd (or someone) started it again; the cycle is
    closed as such. Unit down: the dead run left it down; that is recorded up to now
    and the next session must bring it back (it inherits ``was_active``)."""
    unit, now = settings["unit"], time.time()
    active = properties.get("ActiveState") in ACTIVE_STATES
    rebooted = bool(session.get("boot_id")) and session.get("boot_id") != boot_id()
    btime = boot_time()
    if active and rebooted and btime:
        downtime, basis = max(0.0, btime - session["stopped_at"]), "until the reboot (at least)"
    else:
        downtime, basis = now - session["stopped_at"], ("until it was found active (at most)" if active
                                                        else "until now; it was still down")
    record = {"unit": unit, "stages": session.get("stages", []),
              "reason": (f"reconciled: the run that drained {unit} is dead ({why}); "
                         + (f"{unit} was found active again" if active else f"it left {unit} down")),
              "stopped_at": iso_time(session["stopped_at"]), "healthy_at": None,
              "downtime_s": round(downtime, 1), "downtime_basis": basis, "healthy": active,
              "error": None if active else "left down by a dead run",
              "snakemake_pid": session.get("snakemake_pid"), "run_id": session.get("run_id"),
              "ended_jobs": session.get("ended_jobs", []),
              "restore_attempts": session.get("restore_attempts", [])}
    state.add_record(record)
    state.session.unlink(missing_ok=True)
    log(record["reason"] + f" ({record['downtime_s']} s {basis})")
    return {"was_active": session.get("was_active", True) if not active else None,
            "previous_run_id": session.get("run_id")}


# --- drain -----------------------------------------------------------------------------

def _start_watchdog(settings: dict, state: State, run: dict | None) -> int | None:
    if run is None:
        log("no live Snakemake run above this job: no watchdog (restore by hand if the run dies)")
        return None
    env = {k: v for k, v in os.environ.items() if k not in (RUN_ENV, JOB_ENV)}
    with open(state.watchdog_log, "a") as out:
        # setsid: the watchdog survives the run's process group being killed. It carries no
        # run token: it waits for the processes that do.
        proc = subprocess.Popen(
            [sys.executable, "-m", "eagle3flow.ops.drain.service", "watchdog", "--state-dir", str(state.dir),
             "--settings-json", json.dumps(settings), "--pid", str(run["snakemake_pid"]),
             "--pid-start", str(run.get("snakemake_start")), "--run-id", str(run["run_id"])],
            start_new_session=True, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
            cwd="/", close_fds=True, env=env)
    return proc.pid


def _join_drain(settings: dict, state: State, stage: str, gpus: list[int], own_runs: list) -> dict:
    """This run already drains (or drained) the unit: wait until that drain finished, check
    that nobody outside the run took the GPUs since, and register ``stage``. Its GPU jobs
    may hold the GPUs now (a sibling stage): they are the run's own."""
    deadline = time.monotonic() + settings["stop_timeout_s"] + settings["gpu_release_timeout_s"] + 60
    while True:
        session = state.read(state.session)
        if session is None or session.get("run_id") != own_runs[0]:
            raise ServiceError(f"the drain {stage} joined did not complete (the session closed); "
                               "see the other drain_service logs")
        if session.get("drained_at"):
            break
        if time.monotonic() > deadline:
            raise ServiceError(f"the drain {stage} joined did not finish in time; see the other drain_service logs")
        time.sleep(settings["poll_interval_s"])
    _stop_if_started_again(settings, state, stage, gpus, own_runs)
    handle_foreign(settings, gpus, f"{stage}: after the unit was drained", own_runs)
    own = sorted({h.pid for h in gpu_processes(settings["nvidia_smi"], gpus) if of_runs(h.pid, own_runs)})
    log(f"{settings['unit']} is drained by this run since {iso_time(session['drained_at'])}: {stage} registered"
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
    """Stop the unit and wait until its cgroup is empty and `gpus` are free; fail otherwise."""
    state = State(state_dir)
    properties = require_unit(settings)
    unit = settings["unit"]
    run = this_run(state)
    run_id = run["run_id"] if run else None
    # Jobs of a dead run whose session is still open may be ending: never foreign.
    earlier = state.read(state.session) or {}
    own_runs = [run_id, earlier.get("run_id")]
    # Foreign holders first: stopping production is pointless if the stage cannot run.
    handle_foreign(settings, gpus, "before stopping the unit", own_runs)

    with state.locked():
        session = state.read(state.session)
        inherited: dict = {}
        if session is not None:
            alive, why = session_verdict(session)
            if alive == "dead":
                inherited = _reconcile(settings, state, session, properties, why)
                session = None
                properties = unit_properties(settings)
        if session is not None and session.get("run_id") in (run_id, None):
            # Drained by this run (or by hand): register the stage, do not drain again.
            if session.get("run_id") is None and run is not None:
                log(f"adopting the session drained by hand for this run ({run_id})")
                session.update(run_id=run_id, snakemake_pid=run["snakemake_pid"],
                               snakemake_start=run.get("snakemake_start"))
                session["watchdog_pid"] = _start_watchdog(settings, state, run)
            session["stages"] = sorted(set(session["stages"]) | {stage})
            session.setdefault("drained_at", session.get("stopped_at"))
            state.write(state.session, session)
            joining = True
        elif session is not None:
            raise ServiceError(
                f"{unit} is drained by another run that is not provably dead "
                f"({session_verdict(session)[1]}); its session is {state.session}. If no Snakemake "
                f"runs there any more, restore it: {restore_command(state)}")
        else:
            # An operator who had the unit stopped gets it back stopped.
            was_active = inherited.get("was_active")
            if was_active is None:
                was_active = properties.get("ActiveState") in ACTIVE_STATES
            session = {"unit": unit, "run_id": run_id, "stopped_at": time.time(), "stages": [stage],
                       "ended": [], "ended_jobs": [], "was_active": was_active,
                       "snakemake_pid": run["snakemake_pid"] if run else None,
                       "snakemake_start": run.get("snakemake_start") if run else None,
                       "boot_id": boot_id(), "host": socket.gethostname(), "pid_ns": pid_namespace("self"),
                       "user": getpass.getuser(), "gpus": list(gpus), "settings": settings, "drained_at": None,
                       "restore_attempts": [], "previous_run_id": inherited.get("previous_run_id")}
            state.write(state.session, session)
            session["watchdog_pid"] = _start_watchdog(settings, state, run)
            state.write(state.session, session)
            joining = False

    if joining:
        _join_drain(settings, state, stage, gpus, own_runs)
    else:
        _stop_and_release(settings, state, stage, gpus, properties, own_runs, session["stopped_at"])
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
        memory = gpu_memory_used(settings["nvidia_smi"])
        raise ServiceError(
            f"GPUs {gpus} still busy {settings['gpu_release_timeout_s']} s after {settings['unit']} stopped "
            f"(drain.gpu_release_timeout_s): used MiB "
            + ", ".join(f"GPU {i}: {memory.get(i, ('', '?'))[1]}" for i in gpus)
            + "\n" + describe_holders(gpu_processes(settings["nvidia_smi"], gpus), own_runs))


def _stop_and_release(settings: dict, state: State, stage: str, gpus: list[int], properties: dict,
                      own_runs: list, stopped_at: float) -> None:
    unit = settings["unit"]
    try:
        _stop_unit(settings, stage, properties)
        _wait_released(settings, gpus, own_runs, "after stopping the unit", siblings_may_hold=False)
    except (ServiceError, GpuQueryError) as error:
        log(f"drain failed: {error}")
        log("bringing the unit back before failing")
        try:
            restore(settings, str(state.dir), reason=f"drain for {stage} failed")
        except ServiceError as restore_error:
            log(f"restore failed too: {restore_error}")
        raise ServiceError(str(error)) from error

    with state.locked():
        session = state.read(state.session)
        if session is not None:
            session["drained_at"] = time.time()
            state.write(state.session, session)
    log(f"{unit} stopped; GPUs {gpus} free after {time.time() - stopped_at:.1f} s")


# --- restore ---------------------------------------------------------------------------

def _wait_for_free_gpus(settings: dict, gpus: list[int], own: list) -> str | None:
    """Wait until no process holds ``gpus`` and their memory is idle; the reason it did
    not happen, or None. nvidia-smi failing counts as busy (and is retried until the
    timeout): the unit is never started on GPUs nobody could check."""
    last: dict = {}

    def free() -> bool:
        try:
            last["holders"], last["busy"] = gpus_busy(settings, gpus)
            last.pop("error", None)
        except GpuQueryError as error:
            last["error"] = error
            return False
        return not last["holders"] and not last["busy"]

    if wait_until(free, settings["gpu_release_timeout_s"], settings["poll_interval_s"]):
        return None
    if "error" in last:
        return f"nvidia-smi could not tell whether GPUs {gpus} are free ({last['error']})"
    return f"GPUs {gpus} are still held:\n" + (describe_holders(last["holders"], own)
                                              or f"  memory above idle on GPUs {last['busy']}")


def _start_unit(settings: dict, session: dict | None, reason: str) -> str | None:
    """Wait for the session's GPUs to be free, start the unit, wait for its health URL.
    The error, or None."""
    unit, url = settings["unit"], settings["health_url"]
    if session is not None and unit_properties(settings).get("ActiveState") not in ACTIVE_STATES:
        # The last GPU stage's processes may still be exiting: vLLM must not start on GPUs
        # they hold (it would fail, and nothing would bring it back).
        gpus = session.get("gpus") or sorted(gpu_memory_used(settings["nvidia_smi"]))
        held = _wait_for_free_gpus(settings, gpus, [session.get("run_id"), session.get("previous_run_id")])
        if held:
            return (f"{held}\n{settings['gpu_release_timeout_s']} s after {reason} "
                    f"(drain.gpu_release_timeout_s); {unit} was not started on them")
    log(f"starting {unit} ({reason})")
    result = systemctl(settings, "start", unit, timeout=settings["health_timeout_s"])
    if result.returncode != 0:
        return f"systemctl start {unit} failed (rc={result.returncode}): {result.stderr.strip()}"
    deadline = time.monotonic() + settings["health_timeout_s"]
    while not unit_healthy(url):
        if unit_properties(settings).get("ActiveState") == "failed":
            return f"{unit} failed while starting; see journalctl -u {unit}"
        if time.monotonic() >= deadline:
            return (f"{unit} started but {url} did not answer within "
                    f"drain.health_timeout_s={settings['health_timeout_s']} s")
        time.sleep(settings["poll_interval_s"])
    return None


def _add_attempt(session: dict, reason: str, error: str) -> None:
    session.setdefault("restore_attempts", []).append(
        {"at": iso_time(time.time()), "reason": reason, "error": error, "pid": os.getpid()})


def record_attempt(state: State, reason: str, error: str) -> None:
    """A failed step of a restore, kept in the open session (and later in its downtime record)."""
    with state.locked():
        session = state.read(state.session)
        if session is not None:
            _add_attempt(session, reason, error)
            state.write(state.session, session)


def not_restored(unit: str, error: str, state: State) -> ServiceError:
    """The error of a restore that gave up: what failed, and the operator's command."""
    return ServiceError(
        f"{error}\n!!! {unit} is NOT running. The drain session stays open ({state.session}), so the "
        f"watchdog or the next run retries; once the cause is fixed, restore it now with:\n"
        f"!!!   {restore_command(state)}")


def restore(settings: dict, state_dir: str, reason: str = "manual") -> dict | None:
    """Wait for the GPUs, start the unit and wait for its health URL. Idempotent: with no
    open session it still makes sure the unit runs. Returns the downtime record of the
    closed cycle. On failure the session stays (with the attempt recorded) and
    ServiceError names the command that retries."""
    state = State(state_dir)
    if not settings["unit"]:
        raise ServiceError("drain.unit is not set: nothing to restore")
    unit = settings["unit"]
    with state.locked():
        session = state.read(state.session)
        started = session is None or session.get("was_active", True)
        # Every step may fail (systemctl hanging, nvidia-smi failing): each failure is a
        # recorded attempt that keeps the session, never an exception that loses it.
        try:
            if session is not None:
                alive, why = session_verdict(session)
                properties = unit_properties(settings)
                if alive == "dead" and properties.get("ActiveState") in ACTIVE_STATES:
                    _reconcile(settings, state, session, properties, why)
                    return state.downtime_records()[-1]
                if alive == "dead":
                    reason += f" (the run that drained it is dead: {why})"
            if started:
                error = _start_unit(settings, session, reason)
            else:
                log(f"{unit} was not running before the drain; leaving it stopped ({reason})")
                error = None
        except (ServiceError, GpuQueryError) as failure:
            error = str(failure)
        record = None
        if session is not None:
            now = time.time()
            if error:
                _add_attempt(session, reason, error)
                state.write(state.session, session)
            else:
                record = {"unit": unit, "stages": session["stages"], "reason": reason,
                          "stopped_at": iso_time(session["stopped_at"]),
                          "healthy_at": iso_time(now) if started else None,
                          "downtime_s": round(now - session["stopped_at"], 1),
                          "healthy": True, "error": None,
                          "snakemake_pid": session.get("snakemake_pid"), "run_id": session.get("run_id"),
                          "ended_jobs": session.get("ended_jobs", []),
                          "restore_attempts": session.get("restore_attempts", [])}
                state.add_record(record)
                state.session.unlink()  # the watchdog sees this and exits
    if error:
        raise not_restored(unit, error, state)
    if started:
        log(f"{unit} healthy at {settings['health_url']}" + (f"; down {record['downtime_s']} s" if record else ""))
    return record


def restore_if_drained(settings: dict, state_dir: str, reason: str) -> dict | None:
    """For the Snakefile's onsuccess/onerror: restore only when this workflow drained."""
    if not settings.get("enabled") or State(state_dir).read(State(state_dir).session) is None:
        return None
    return restore(settings, state_dir, reason)


def stage_ended(settings: dict, state_dir: str, stage: str, exit_code: int) -> None:
    """A GPU stage's job ended with ``exit_code`` (its real status: a signal n is 128+n):
    restore unless another drained stage of this live run follows."""
    state = State(state_dir)
    with state.locked():
        session = state.read(state.session)
        if session is None:
            log(f"{stage} ended (rc={exit_code}); the unit is not drained (nothing to restore)")
            return
        # One entry per ended job: a stage may run several (partitions, streaming links).
        session["ended"] = sorted(session["ended"] + [stage])
        session.setdefault("ended_jobs", []).append({"stage": stage, "rc": exit_code, "at": iso_time(time.time())})
        state.write(state.session, session)
        plan = state.read(state.plan) or {}
    run_alive = (plan.get("run_id") == session.get("run_id")
                 and verdict(run_record(plan))[0] != "dead") if plan else False
    # The plan lists a stage once per job this run will run.
    remaining = Counter(plan.get("stages", [])) - Counter(session["ended"])
    pending = sorted(remaining) if run_alive else []
    if exit_code != 0:
        reason = f"{stage} failed (rc={exit_code})"
    elif pending:
        log(f"{stage} done; {settings['unit']} stays down for {', '.join(pending)}")
        return
    elif run_alive or not plan:
        reason = f"{stage} was the last GPU stage of the run"
    else:
        reason = f"{stage} ended after its run's Snakemake process died: no GPU stage follows"
    restore(settings, state_dir, reason)
