"""Bringing the unit back: when no run of its session still needs it down, once its GPUs
are free; and closing the session a dead run left.

* ``restore`` starts the unit only when no other run of the session (another checkout,
  another results folder) still has GPU stages to run, or jobs of a dead run still run
  under a live watchdog: then the unit stays down for them, and their end restores it.
  Otherwise it waits for the GPUs to be free, starts the unit and polls its health URL.
  Every failed step is an attempt recorded in the session, which stays open, and the
  error names the command to run. It is idempotent.
* ``reconcile`` closes the session of runs that are all provably dead (a reboot) against
  the unit's real state.
"""
from __future__ import annotations

import os
import time
from collections import Counter
from contextlib import contextmanager

from eagle3flow.ops.drain.gpus import describe_holders, gpus_busy, wait_until
from eagle3flow.ops.drain.gpu_holders import GpuQueryError, gpu_memory_used
from eagle3flow.ops.drain.state import (ACTIVE_STATES, ServiceError, State, iso_time, log, restore_command,
                                        run_pids, run_record, session_runs, session_verdict,
                                        unit_state_dir, unregister_run)
from eagle3flow.ops.drain.systemd_unit import systemctl, unit_healthy, unit_properties
from eagle3flow.procfs import boot_id, boot_time, running, start_ticks, verdict


def service_dirs(session: dict) -> list[str]:
    """The results' service folders of the session's runs (each gets the cycle's record)."""
    return [entry["service_dir"] for entry in session_runs(session).values() if entry.get("service_dir")]


def cycle_record(session: dict, **fields) -> dict:
    """A downtime record of the session's cycle."""
    runs = list(session_runs(session))
    first = session_runs(session)[runs[0]] if runs else session
    return {"unit": session.get("unit"), "stages": session.get("stages", []), **fields,
            "snakemake_pid": first.get("snakemake_pid"), "run_id": runs[0] if runs else session.get("run_id"),
            "run_ids": runs, "ended_jobs": session.get("ended_jobs", []),
            "external_starts": session.get("external_starts", []),
            "restore_attempts": session.get("restore_attempts", [])}


# --- a session of dead runs ------------------------------------------------------------

def reconcile(settings: dict, state: State, session: dict, properties: dict, why: str) -> dict:
    """Under the lock: close the session of runs that are all provably dead (a reboot, a
    kill that took their watchdogs too) against the unit's real state, and say what the
    next session inherits. Unit active: systemd (or someone) started it again; the cycle
    is closed as such. Unit down: the dead runs left it down; that is recorded up to now
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
    record = cycle_record(
        session, reason=(f"reconciled: the run that drained {unit} is dead ({why}); "
                         + (f"{unit} was found active again" if active else f"it left {unit} down")),
        stopped_at=iso_time(session["stopped_at"]), healthy_at=None, downtime_s=round(downtime, 1),
        downtime_basis=basis, healthy=active, error=None if active else "left down by a dead run")
    state.add_record(record, service_dirs(session))
    state.session.unlink(missing_ok=True)
    log(record["reason"] + f" ({record['downtime_s']} s {basis})")
    return {"was_active": session.get("was_active", True) if not active else None,
            "previous_run_ids": record["run_ids"] or [record["run_id"]]}


# --- who still needs the unit down -----------------------------------------------------

def still_needed(session: dict, releasing: str | None) -> list[str]:
    """Why the unit must stay down for a run of the session other than ``releasing``
    (one line each), or nothing. A live run (or one that cannot be told) with GPU stages
    still to run needs it; so does a dead run whose jobs still run while its watchdog
    lives (it restores the unit once they have ended). A run that released the unit
    needs it no more."""
    needs = []
    for run_id, entry in session_runs(session).items():
        if run_id == releasing or entry.get("released"):
            continue
        alive, why = verdict(run_record(entry))
        where = entry.get("service_dir") or "?"
        if alive != "dead":
            pending = sorted((Counter(entry.get("stages", [])) - Counter(entry.get("ended", []))).elements())
            if pending:
                needs.append(f"run {run_id} ({where}; {why}) still has GPU stage(s) to run: "
                             f"{', '.join(pending)}; the end of its last one restores the unit")
        elif run_pids([run_id]) and running(entry.get("watchdog_pid"), entry.get("watchdog_start")):
            needs.append(f"run {run_id} ({where}) is dead but its jobs {sorted(run_pids([run_id]))} still "
                         f"run; its watchdog (pid {entry['watchdog_pid']}) restores the unit once they end")
    return needs


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

    if free():
        return None
    log(f"waiting up to {settings['gpu_release_timeout_s']} s (drain.gpu_release_timeout_s) for GPUs {gpus} "
        f"to be free before starting {settings['unit']}")
    if wait_until(free, settings["gpu_release_timeout_s"], settings["poll_interval_s"]):
        return None
    if "error" in last:
        return f"nvidia-smi could not tell whether GPUs {gpus} are free ({last['error']})"
    return f"GPUs {gpus} are still held:\n" + (describe_holders(last["holders"], own)
                                             or f"  memory above idle on GPUs {last['busy']}")


def _start_unit(settings: dict, session: dict | None, reason: str) -> str | None:
    """Wait for the GPUs to be free, start the unit, wait for its health URL. The error, or None."""
    unit, url = settings["unit"], settings["health_url"]
    if unit_properties(settings).get("ActiveState") not in ACTIVE_STATES:
        # The last GPU stage's processes may still be exiting, or a job of a run holds a
        # GPU while nobody drained for it: vLLM must not start on GPUs they hold (it would
        # fail, and nothing would bring it back).
        gpus = (session or {}).get("gpus") or sorted(gpu_memory_used(settings["nvidia_smi"], settings["nvidia_smi_timeout_s"]))
        held = _wait_for_free_gpus(settings, gpus, list(session_runs(session)) if session else [])
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


def _restore_under_way(state: State) -> dict | None:
    """The restore another process is running now (its marker), or None (none, or its
    process died mid-way)."""
    marker = state.read(state.restoring)
    if marker and marker.get("pid") != os.getpid() and running(marker.get("pid"), marker.get("start")):
        return marker
    return None


@contextmanager
def locked_between_restores(settings: dict, state: State, before: str):
    """The state's lock, taken while no other process's restore is under way (a restore
    waits for the GPUs and the unit's health without the lock): waits for it, saying
    for what, at most as long as such a restore can take."""
    limit = settings["gpu_release_timeout_s"] + 2 * settings["health_timeout_s"] + 120
    deadline, said = time.monotonic() + limit, False
    while True:
        with state.locked():
            under_way = _restore_under_way(state)
            if under_way is None:
                yield
                return
        if not said:
            log(f"waiting for the restore of {settings['unit']} by pid {under_way['pid']} ({under_way['reason']}; "
                f"since {under_way['at']}) to end before {before}")
            said = True
        if time.monotonic() > deadline:
            raise ServiceError(f"the restore of {settings['unit']} by pid {under_way['pid']} has not ended after "
                               f"{limit:.0f} s; see {state.watchdog_log} and journalctl -u {settings['unit']}")
        time.sleep(settings["poll_interval_s"])


def restore(settings: dict, state_dir: str, reason: str = "manual", releasing: str | None = None) -> dict | None:
    """Bring the unit back unless another run of the session still needs it down; run
    ``releasing`` (whose stage ended, or which ended) needs it no more. Waits for the
    GPUs, starts the unit and waits for its health URL, without holding the lock
    (``restoring.json`` says a restore is under way). Idempotent: with no open session
    it still makes sure the unit runs. Returns the downtime record of the closed cycle
    (None when there was none, or the unit stays down for another run: then the session
    stays open). On failure the session stays (with the attempt recorded) and
    ServiceError names the command that retries."""
    state = State(state_dir)
    if not settings["unit"]:
        raise ServiceError("drain.unit is not set: nothing to restore")
    unit = settings["unit"]
    error = None
    with locked_between_restores(settings, state, f"restoring ({reason})"):
        session = state.read(state.session)
        started = session is None or session.get("was_active", True)
        # Every step may fail (systemctl hanging, nvidia-smi failing): each failure is a
        # recorded attempt that keeps the session, never an exception that loses it.
        try:
            if session is not None:
                if releasing in session_runs(session):
                    session_runs(session)[releasing]["released"] = True
                    state.write(state.session, session)
                alive, why = session_verdict(session)
                properties = unit_properties(settings)
                if alive == "dead" and properties.get("ActiveState") in ACTIVE_STATES:
                    reconcile(settings, state, session, properties, why)
                    return state.downtime_records()[-1]
                if alive == "dead":
                    reason += f" (the run that drained it is dead: {why})"
                needed = still_needed(session, releasing)
                if needed:
                    log(f"{unit} stays down ({reason}): " + "; ".join(needed))
                    return None
        except (ServiceError, GpuQueryError) as failure:
            error = str(failure)
            if session is not None:
                _add_attempt(session, reason, error)
                state.write(state.session, session)
        if error is None:
            state.write(state.restoring, {"pid": os.getpid(), "start": start_ticks(os.getpid()),
                                          "at": iso_time(time.time()), "reason": reason})
    if error is not None:
        raise not_restored(unit, error, state)
    record, error = None, "the restore was interrupted"   # what stays recorded if it is killed mid-way
    try:
        if started:
            error = _start_unit(settings, session, reason)
        else:
            log(f"{unit} was not running before the drain; leaving it stopped ({reason})")
            error = None
    except (ServiceError, GpuQueryError) as failure:
        error = str(failure)
    finally:
        with state.locked():
            session = state.read(state.session)     # stages may have ended meanwhile
            if session is not None and error:
                _add_attempt(session, reason, error)
                state.write(state.session, session)
            elif session is not None:
                now = time.time()
                record = cycle_record(session, reason=reason, stopped_at=iso_time(session["stopped_at"]),
                                      healthy_at=iso_time(now) if started else None,
                                      downtime_s=round(now - session["stopped_at"], 1), healthy=True, error=None)
                state.add_record(record, service_dirs(session))
                state.session.unlink()  # the watchdogs see this and exit
            state.restoring.unlink(missing_ok=True)
    if error:
        raise not_restored(unit, error, state)
    if started:
        log(f"{unit} healthy at {settings['health_url']}" + (f"; down {record['downtime_s']} s" if record else ""))
    return record


def restore_if_drained(settings: dict, reason: str, run_id: str | None) -> dict | None:
    """For the Snakefile's onsuccess/onerror: the run has ended and needs the unit no more.
    Restore it if it is drained and no other run needs it down, and unregister the run."""
    if not settings.get("enabled") or not settings.get("unit"):
        return None
    state = State(unit_state_dir(settings))
    try:
        if state.read(state.session) is None:
            return None
        return restore(settings, str(state.dir), reason, releasing=run_id)
    finally:
        with state.locked():
            unregister_run(state, run_id)
