"""Drain the production vLLM unit for the GPU stages, and always bring it back.

One drain/restore *cycle* per run (docs/service.md):

* ``drain`` (rule drain_service, in front of each GPU stage that has to run) checks
  that nobody outside the unit (and outside this run's own jobs) holds the stage's
  GPUs, stops the systemd unit, waits until the unit's cgroup is empty and the GPUs'
  memory is released, and starts a detached watchdog. When the unit is already
  drained by this same live run, it only registers the stage (the GPU jobs are
  serialized by Snakemake's ``gpus`` resource; a sibling GPU job may hold the GPUs).
  Foreign GPU processes are never killed unless ``drain.kill_foreign_gpu_processes``
  is set, and then only they are: never a process carrying a run's token.
* ``stage_ended`` (called by the GPU stage wrapper, eagle3flow/ops/gpu_stage.py, with the
  stage's real exit status) restores the unit when the stage failed or when no other
  drained stage of this run is still to come (the plan ``write_plan`` records at the
  run's start).
* ``restore`` waits for the GPUs to be free, starts the unit and polls its health URL;
  the Snakefile's onsuccess/onerror call it too, and so does the watchdog once the
  Snakemake main process died (SIGKILL, lost terminal) and every job of that run has
  ended. A failed restore keeps the session (so the next run, the watchdog or the
  operator retries) and names the command to run. It is idempotent.

Runs are told apart by a token: onstart sets ``$EAGLE3FLOW_RUN`` in Snakemake's
environment (the run id of ``plan.json``), so every job of the run and everything it
starts (torchrun ranks, vLLM engine processes) carries it, through reparenting and
setsid; the stage wrapper adds ``$EAGLE3FLOW_JOB`` (itself).

State lives in ``<results>/service/``: ``session.json`` while the unit is drained
(its presence means "we stopped it"; it names the run that did, with the boot id, so
a session of a dead run, e.g. after a reboot, is reconciled with the unit's real
state instead of reused), ``plan.json`` (the run and the drained stages it will run),
``downtime.json`` (one record per cycle) and ``watchdog.log``.
"""
from __future__ import annotations

import argparse
import fcntl
import getpass
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections import Counter
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path

from eagle3flow.atomic import write_text
from eagle3flow.config import schema_defaults
from eagle3flow.ops.gpu_holders import GpuQueryError, describe_process, gpu_memory_used, gpu_processes
from eagle3flow.ops.procfs import (boot_id, boot_time, descendants, environ, pid_namespace, pids_with_env,
                                   start_ticks as process_start_ticks, verdict)
from eagle3flow.ops.gpu_env import drain_refusal

# The stages that need every GPU of the node (rules/hidden_states.smk, rules/train.smk).
DRAINED_STAGES = ("extract_hidden_states", "train_draft", "evaluate_draft",
                  # streaming partitions (rules/streaming.smk)
                  "extract_partition", "train_partition", "train_partition_last")

# The run token every job of a run inherits (set by onstart), and the GPU stage wrapper
# ("<pid>:<start ticks>") a stage's processes belong to (set by eagle3flow/ops/gpu_stage.py).
RUN_ENV = "EAGLE3FLOW_RUN"
JOB_ENV = "EAGLE3FLOW_JOB"

# Defaults of the config's `drain` section, from the schema (schemas/config.schema.yaml,
# their one home); used when this module is called by hand with --config.
DEFAULTS = schema_defaults("drain")
ACTIVE_STATES = ("active", "activating", "reloading")


class ServiceError(RuntimeError):
    """The unit could not be drained or restored; the message says why and what to do."""


def log(message: str) -> None:
    print(f"[service {datetime.now().strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def settings_of(drain_config: dict) -> dict:
    unknown = set(drain_config) - set(DEFAULTS)
    if unknown:
        raise ServiceError(f"drain: unknown key(s) {sorted(unknown)}; known: {sorted(DEFAULTS)}")
    settings = {**DEFAULTS, **drain_config}
    if isinstance(settings["systemctl"], str):
        settings["systemctl"] = settings["systemctl"].split()
    return settings


def _iso(epoch: float | None) -> str | None:
    return None if epoch is None else datetime.fromtimestamp(epoch, timezone.utc).isoformat(timespec="seconds")


def restore_command(state: "State") -> str:
    """The operator's command that restores the unit of this state directory."""
    return f"python -m eagle3flow.ops.service restore --state-dir {state.dir}"


# --- state files ---------------------------------------------------------------------

class State:
    """The files of <results>/service/, read and written under one lock."""

    def __init__(self, state_dir: str | os.PathLike):
        self.dir = Path(state_dir).absolute()
        self.session = self.dir / "session.json"
        self.plan = self.dir / "plan.json"
        self.downtime = self.dir / "downtime.json"
        self.watchdog_log = self.dir / "watchdog.log"

    @contextmanager
    def locked(self):
        self.dir.mkdir(parents=True, exist_ok=True)
        with open(self.dir / ".lock", "a") as handle:
            fcntl.flock(handle, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(handle, fcntl.LOCK_UN)

    def read(self, path: Path):
        try:
            return json.loads(path.read_text())
        except FileNotFoundError:
            return None
        except ValueError as error:
            raise ServiceError(f"{path}: not valid JSON ({error}); delete it after checking the unit") from error

    def write(self, path: Path, value) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        write_text(path, json.dumps(value, indent=1) + "\n")

    def downtime_records(self) -> list[dict]:
        return self.read(self.downtime) or []

    def add_record(self, record: dict) -> None:
        self.write(self.downtime, self.downtime_records() + [record])


# --- runs ----------------------------------------------------------------------------

def run_id_of(pid: int) -> str:
    """A run's id: its Snakemake main process, named so that no other run of this host
    (another boot, a reused pid) has the same."""
    return f"{(boot_id() or 'noboot')[:8]}-{pid}-{process_start_ticks(pid)}"


def write_plan(state_dir: str, stages: list[str], snakemake_pid: int, run_id: str | None = None) -> dict:
    """Called by the Snakefile's onstart: the run (its Snakemake main process) and the
    drained stages it will run, one entry per job (the unit stays down until the last
    job of the last stage has ended). Returns the plan; its ``run_id`` is the token
    ($EAGLE3FLOW_RUN) the run's jobs carry."""
    state = State(state_dir)
    plan = {"run_id": run_id or run_id_of(snakemake_pid), "snakemake_pid": snakemake_pid,
            "snakemake_start": process_start_ticks(snakemake_pid), "boot_id": boot_id(),
            "host": socket.gethostname(), "pid_ns": pid_namespace("self"), "user": getpass.getuser(),
            "stages": sorted(stages), "written_at": _iso(time.time())}
    with state.locked():
        state.write(state.plan, plan)
    return plan


def run_record(record: dict) -> dict:
    """The Snakemake main process a plan or session names, as procfs.verdict reads it
    (an old record without a host was written on this one: the state dir is local)."""
    return {"host": record.get("host") or socket.gethostname(), "boot_id": record.get("boot_id"),
            "pid_ns": record.get("pid_ns"), "pid": record.get("snakemake_pid"),
            "start_ticks": record.get("snakemake_start"), "user": record.get("user")}


def session_verdict(session: dict) -> tuple[str, str]:
    """("dead" | "alive" | "unknown", why) of the run that holds a session. A session
    drained by hand (no run) is "unknown" unless it is from another boot."""
    return verdict(run_record(session))


def this_run(state: State) -> dict | None:
    """The plan of the live run this process is a job of (its token is the plan's), or None
    (called by hand, or a plan of another run)."""
    token = os.environ.get(RUN_ENV)
    try:
        plan = state.read(state.plan) or {}
    except ServiceError:
        return None
    if token and plan.get("run_id") == token and verdict(run_record(plan))[0] != "dead":
        return plan
    return None


def _alive(pid: int | None, start_ticks: int | None) -> bool:
    return pid is not None and process_start_ticks(pid) is not None and (
        start_ticks is None or process_start_ticks(pid) == start_ticks)


def run_pids(run_ids) -> set[int]:
    """Processes carrying one of these run tokens: jobs of those runs and their children."""
    return {pid for run_id in run_ids if run_id for pid in pids_with_env(RUN_ENV, run_id)}


# --- the unit --------------------------------------------------------------------------

def _systemctl(settings: dict, *args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    command = [*settings["systemctl"], *args]
    # No run token to the unit: it is not a job of any run (systemd gives its units a
    # clean environment anyway; a wrapper or a test double may not).
    env = {k: v for k, v in os.environ.items() if k not in (RUN_ENV, JOB_ENV)}
    try:
        return subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env)
    except FileNotFoundError as error:
        raise ServiceError(f"{command[0]} not found (drain.systemctl)") from error


def unit_properties(settings: dict) -> dict:
    result = _systemctl(settings, "show", settings["unit"],
                        "--property=LoadState,ActiveState,MainPID,ControlGroup")
    if result.returncode != 0:
        raise ServiceError(f"systemctl show {settings['unit']} failed: {result.stderr.strip()}")
    return dict(line.split("=", 1) for line in result.stdout.splitlines() if "=" in line)


def unit_pids(settings: dict, properties: dict | None = None) -> set[int]:
    """Processes in the unit's cgroup (sub-cgroups included): vLLM's workers live there
    even when they are not children of MainPID any more."""
    properties = properties or unit_properties(settings)
    cgroup = properties.get("ControlGroup", "")
    pids: set[int] = set()
    if cgroup:
        root = Path(settings["cgroup_root"]) / cgroup.lstrip("/")
        if root.is_dir():
            for procs in root.rglob("cgroup.procs"):
                try:
                    pids.update(int(line) for line in procs.read_text().split())
                except OSError:
                    continue
            return pids
    # No readable cgroup (cgroup v1 layouts): MainPID and its descendants.
    main_pid = int(properties.get("MainPID") or 0)
    return descendants(main_pid) if main_pid > 0 else pids


def _require_unit(settings: dict) -> dict:
    if not settings["unit"]:
        raise ServiceError("drain.enabled is true but drain.unit is not set: put the systemd unit "
                           "that serves the target (e.g. vllm-kimi-k25-int4.service) in "
                           "profiles/local-8gpu/workflow.yaml or config.yaml")
    properties = unit_properties(settings)
    if properties.get("LoadState") != "loaded":
        raise ServiceError(f"systemd does not know unit {settings['unit']} "
                           f"(LoadState={properties.get('LoadState')}): check drain.unit")
    return properties


# --- GPUs ------------------------------------------------------------------------------

def _of_runs(pid: int, run_ids) -> bool:
    """Whether process ``pid`` carries one of these run tokens (a job of those runs)."""
    token = (environ(pid) or {}).get(RUN_ENV)
    return token is not None and token in [r for r in run_ids if r]


def _foreign_holders(settings: dict, gpus: list[int], own_runs=()) -> list:
    """GPU processes on `gpus` that are not in the unit's cgroup, not this process and not
    a job of the runs `own_runs` (their token, read after the holders were listed: a job
    that started in between is still the run's)."""
    holders = gpu_processes(settings["nvidia_smi"], gpus)
    ours = unit_pids(settings) | {os.getpid()}
    return [p for p in holders if p.pid not in ours and not _of_runs(p.pid, own_runs)]


def _describe_holders(holders, own_runs=()) -> str:
    by_pid: dict[int, list[int]] = {}
    for holder in holders:
        by_pid.setdefault(holder.pid, []).append(holder.gpu_index)
    return "\n".join(f"  GPU {','.join(map(str, sorted(indices)))}: {describe_process(pid)}"
                     + (" [a job of this workflow's run]" if _of_runs(pid, own_runs) else "")
                     for pid, indices in sorted(by_pid.items()))


def _kill_only(pids: set[int], grace_s: float = 10.0, what: str = "foreign GPU process",
               why: str = "drain.kill_foreign_gpu_processes") -> None:
    """SIGTERM, then SIGKILL, exactly these processes (checked by start time: never a reused pid)."""
    starts = {pid: process_start_ticks(pid) for pid in pids}
    for pid, start in starts.items():
        if start is not None:
            log(f"killing {what} {describe_process(pid)} ({why})")
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and any(_alive(p, s) for p, s in starts.items() if s):
        time.sleep(0.2)
    for pid, start in starts.items():
        if start is not None and _alive(pid, start):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def _handle_foreign(settings: dict, gpus: list[int], when: str, own_runs=()) -> None:
    holders = _foreign_holders(settings, gpus, own_runs)
    if not holders:
        return
    if not settings["kill_foreign_gpu_processes"]:
        raise ServiceError(
            f"{when}: processes outside {settings['unit']} hold GPUs this stage needs; they are not "
            f"killed (set drain.kill_foreign_gpu_processes: true to allow it, or stop them):\n"
            + _describe_holders(holders))
    _kill_only({h.pid for h in holders})


def _gpus_busy(settings: dict, gpus: list[int]) -> tuple[list, list[int]]:
    """(processes on `gpus`, GPUs whose memory is above idle)."""
    memory = gpu_memory_used(settings["nvidia_smi"])
    busy = [i for i in gpus if memory.get(i, ("", 0))[1] > settings["gpu_idle_memory_mib"]]
    return gpu_processes(settings["nvidia_smi"], gpus), busy


def _wait_until(predicate, timeout_s: float, poll_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while True:
        if predicate():
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(poll_s)


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
              "stopped_at": _iso(session["stopped_at"]), "healthy_at": None,
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
            [sys.executable, "-m", "eagle3flow.ops.service", "watchdog", "--state-dir", str(state.dir),
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
    _handle_foreign(settings, gpus, f"{stage}: after the unit was drained", own_runs)
    own = sorted({h.pid for h in gpu_processes(settings["nvidia_smi"], gpus) if _of_runs(h.pid, own_runs)})
    log(f"{settings['unit']} is drained by this run since {_iso(session['drained_at'])}: {stage} registered"
        + (f" (the run's own GPU job(s) {own} hold the GPUs now; not foreign)" if own else ""))
    return session


def drain(settings: dict, state_dir: str, stage: str, gpus: list[int], flag: str | None = None) -> None:
    """Stop the unit and wait until its cgroup is empty and `gpus` are free; fail otherwise."""
    state = State(state_dir)
    properties = _require_unit(settings)
    unit = settings["unit"]
    run = this_run(state)
    run_id = run["run_id"] if run else None
    # Jobs of a dead run whose session is still open may be ending: never foreign.
    earlier = state.read(state.session) or {}
    own_runs = [run_id, earlier.get("run_id")]
    # Foreign holders first: stopping production is pointless if the stage cannot run.
    _handle_foreign(settings, gpus, "before stopping the unit", own_runs)

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
                                          "at": _iso(time.time())}) + "\n")


def _stop_and_release(settings: dict, state: State, stage: str, gpus: list[int], properties: dict,
                      own_runs: list, stopped_at: float) -> None:
    unit = settings["unit"]
    try:
        log(f"stopping {unit} for {stage} (was {properties.get('ActiveState')})")
        try:
            result = _systemctl(settings, "stop", unit, timeout=settings["stop_timeout_s"])
            if result.returncode != 0:
                log(f"systemctl stop {unit}: rc={result.returncode} {result.stderr.strip()}")
        except subprocess.TimeoutExpired:
            log(f"systemctl stop {unit} did not return within {settings['stop_timeout_s']} s")

        def stopped() -> bool:
            props = unit_properties(settings)
            return props.get("ActiveState") in ("inactive", "failed") and not unit_pids(settings, props)

        if not _wait_until(stopped, settings["stop_timeout_s"], settings["poll_interval_s"]):
            props = unit_properties(settings)
            left = sorted(unit_pids(settings, props))
            raise ServiceError(
                f"{unit} did not stop within drain.stop_timeout_s={settings['stop_timeout_s']} s "
                f"(ActiveState={props.get('ActiveState')}); processes still in its cgroup:\n"
                + ("\n".join(f"  {describe_process(p)}" for p in left) or "  (none)")
                + f"\nnothing was loaded on the GPUs; see journalctl -u {unit}")

        def released() -> bool:
            _handle_foreign(settings, gpus, "after stopping the unit", own_runs)
            holders, busy = _gpus_busy(settings, gpus)
            return not holders and not busy

        if not _wait_until(released, settings["gpu_release_timeout_s"], settings["poll_interval_s"]):
            memory = gpu_memory_used(settings["nvidia_smi"])
            raise ServiceError(
                f"GPUs {gpus} still busy {settings['gpu_release_timeout_s']} s after {unit} stopped "
                f"(drain.gpu_release_timeout_s): used MiB "
                + ", ".join(f"GPU {i}: {memory.get(i, ('', '?'))[1]}" for i in gpus)
                + "\n" + _describe_holders(gpu_processes(settings["nvidia_smi"], gpus), own_runs))
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

def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return 200 <= response.status < 300
    except (urllib.error.URLError, OSError, ValueError):
        return False


def _start_unit(settings: dict, session: dict | None, reason: str) -> str | None:
    """Wait for the session's GPUs to be free, start the unit, wait for its health URL.
    The error, or None."""
    unit, url = settings["unit"], settings["health_url"]
    if session is not None and unit_properties(settings).get("ActiveState") not in ACTIVE_STATES:
        # The last GPU stage's processes may still be exiting: vLLM must not start on GPUs
        # they hold (it would fail, and nothing would bring it back).
        gpus = session.get("gpus") or sorted(gpu_memory_used(settings["nvidia_smi"]))
        if not _wait_until(lambda: not any(_gpus_busy(settings, gpus)), settings["gpu_release_timeout_s"],
                           settings["poll_interval_s"]):
            holders, busy = _gpus_busy(settings, gpus)
            own = [session.get("run_id"), session.get("previous_run_id")]
            return (f"GPUs {gpus} are still held {settings['gpu_release_timeout_s']} s after {reason} "
                    f"(drain.gpu_release_timeout_s); {unit} was not started on them:\n"
                    + (_describe_holders(holders, own) or f"  memory above idle on GPUs {busy}"))
    log(f"starting {unit} ({reason})")
    result = _systemctl(settings, "start", unit, timeout=settings["health_timeout_s"])
    if result.returncode != 0:
        return f"systemctl start {unit} failed (rc={result.returncode}): {result.stderr.strip()}"
    deadline = time.monotonic() + settings["health_timeout_s"]
    while not _healthy(url):
        if unit_properties(settings).get("ActiveState") == "failed":
            return f"{unit} failed while starting; see journalctl -u {unit}"
        if time.monotonic() >= deadline:
            return (f"{unit} started but {url} did not answer within "
                    f"drain.health_timeout_s={settings['health_timeout_s']} s")
        time.sleep(settings["poll_interval_s"])
    return None


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
        if session is not None:
            alive, why = session_verdict(session)
            properties = unit_properties(settings)
            if alive == "dead" and properties.get("ActiveState") in ACTIVE_STATES:
                _reconcile(settings, state, session, properties, why)
                return state.downtime_records()[-1]
            if alive == "dead":
                reason += f" (the run that drained it is dead: {why})"
        started = session is None or session.get("was_active", True)
        if started:
            error = _start_unit(settings, session, reason)
        else:
            log(f"{unit} was not running before the drain; leaving it stopped ({reason})")
            error = None
        record = None
        if session is not None:
            now = time.time()
            if error:
                session.setdefault("restore_attempts", []).append(
                    {"at": _iso(now), "reason": reason, "error": error, "pid": os.getpid()})
                state.write(state.session, session)
            else:
                record = {"unit": unit, "stages": session["stages"], "reason": reason,
                          "stopped_at": _iso(session["stopped_at"]),
                          "healthy_at": _iso(now) if started else None,
                          "downtime_s": round(now - session["stopped_at"], 1),
                          "healthy": True, "error": None,
                          "snakemake_pid": session.get("snakemake_pid"), "run_id": session.get("run_id"),
                          "ended_jobs": session.get("ended_jobs", []),
                          "restore_attempts": session.get("restore_attempts", [])}
                state.add_record(record)
                state.session.unlink()  # the watchdog sees this and exits
    if error:
        raise ServiceError(
            f"{error}\n{unit} is NOT running. The drain session stays open ({state.session}), so the "
            f"watchdog or the next run retries; once the cause is fixed, restore it now with:\n"
            f"  {restore_command(state)}")
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
        session.setdefault("ended_jobs", []).append({"stage": stage, "rc": exit_code, "at": _iso(time.time())})
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


# --- watchdog --------------------------------------------------------------------------

def _stray(pid: int) -> bool:
    """A process of a GPU stage whose wrapper is gone (its job was killed): nobody waits
    for it and nobody will take its outputs."""
    job = (environ(pid) or {}).get(JOB_ENV, "")
    wrapper, _, start = job.partition(":")
    if not wrapper.isdigit():
        return False
    return not _alive(int(wrapper), int(start) if start.isdigit() else None)


def watchdog(settings: dict, state_dir: str, pid: int, pid_start: int | None, run_id: str | None = None) -> int:
    """Detached: once Snakemake `pid` dies with the unit drained, wait until every job of
    its run has ended and the GPUs are free (at most drain.orphan_timeout_s), then
    restore (drain.restore_attempts times). Returns the exit status."""
    state = State(state_dir)
    unit = settings["unit"]
    log(f"watchdog {os.getpid()}: watching Snakemake pid {pid} (run {run_id}) for {unit}")

    def ours(session) -> bool:
        return session is not None and (session.get("run_id") == run_id if run_id
                                        else session.get("snakemake_pid") == pid)

    while True:
        if not ours(state.read(state.session)):
            log("watchdog: the unit was restored; exiting")
            return 0
        if not _alive(pid, pid_start):
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
        # Jobs of the dead run (carrying its token) live on when only the Snakemake main
        # process was killed: they end by themselves. Processes of a job whose wrapper is
        # gone (the job was killed with Snakemake) have nobody to hand their result to.
        jobs = sorted(run_pids([run_id]) - {os.getpid()}) if run_id else []
        strays = [p for p in jobs if _stray(p)]
        if strays:
            _kill_only(set(strays), what="process of a killed job of the dead run",
                       why="its job's wrapper is gone; nothing will take its outputs")
            continue
        gpus = session.get("gpus") or sorted(gpu_memory_used(settings["nvidia_smi"]))
        holders, busy = _gpus_busy(settings, gpus)
        holders = [h for h in holders if h.pid not in unit_pids(settings)]
        if not jobs and not holders and not busy:
            break
        waiting = (("jobs of the dead run still running:\n" + "\n".join(f"  {describe_process(p)}" for p in jobs)
                    if jobs else "")
                   + ("\nGPUs still held:\n" + _describe_holders(holders, [run_id]) if holders else "")
                   + (f"\nGPU memory above idle on {busy}" if busy and not holders else ""))
        if time.monotonic() > deadline:
            log(f"!!! watchdog: still waiting after drain.orphan_timeout_s={settings['orphan_timeout_s']} s; "
                f"{unit} is NOT restored and its session is kept ({state.session}).\n{waiting}\n"
                f"!!! once they have ended: {restore_command(state)}")
            with state.locked():
                session = state.read(state.session)
                if ours(session):
                    session["watchdog_gave_up"] = {"at": _iso(time.time()), "waiting_for": waiting}
                    state.write(state.session, session)
            return 1
        if waiting != said:
            log(f"watchdog: waiting before restoring {unit}: {waiting.strip()}")
            said = waiting
        time.sleep(settings["poll_interval_s"])
    for attempt in range(1, int(settings["restore_attempts"]) + 1):
        try:
            restore(settings, state_dir, reason=f"watchdog: Snakemake pid {pid} died without restoring")
            return 0
        except ServiceError as error:
            log(f"watchdog: restore attempt {attempt}/{settings['restore_attempts']} failed: {error}")
        if not ours(state.read(state.session)):
            return 0
        if attempt < int(settings["restore_attempts"]):
            time.sleep(settings["restore_retry_s"])
    log(f"!!! watchdog: {unit} could not be restored; the session is kept. Fix the unit "
        f"(journalctl -u {unit}), then: {restore_command(state)}")
    return 1


# --- reporting -------------------------------------------------------------------------

def format_downtime(records: list[dict]) -> str:
    lines = []
    for r in records:
        status = "healthy" if r["healthy"] else f"NOT HEALTHY: {r['error']}"
        basis = f" ({r['downtime_basis']})" if r.get("downtime_basis") else ""
        lines.append(f"{r['unit']} down {r['downtime_s']} s{basis} for {', '.join(r['stages'])} "
                     f"(stopped {r['stopped_at']}, {status}; {r['reason']})")
    return "\n".join(lines)


def run_summary(state_dir: str, snakemake_pid: int) -> str:
    records = [r for r in State(state_dir).downtime_records() if r.get("snakemake_pid") == snakemake_pid]
    return format_downtime(records)


# --- CLI -------------------------------------------------------------------------------

def _deep_merge(base: dict, override: dict) -> dict:
    merged = dict(base)
    for key, value in override.items():
        merged[key] = _deep_merge(merged[key], value) if isinstance(value, dict) and isinstance(
            merged.get(key), dict) else value
    return merged


def load_config_files(paths: list[str]) -> tuple[dict, str]:
    """The drain settings and state dir from config files merged in order, as Snakemake does."""
    import yaml

    merged: dict = {}
    for path in paths:
        try:
            merged = _deep_merge(merged, yaml.safe_load(Path(path).read_text()) or {})
        except (OSError, yaml.YAMLError) as error:
            raise ServiceError(f"{path}: cannot read config ({error})") from error
    drain_config = merged.get("drain") or {}
    if not isinstance(drain_config, dict):
        raise ServiceError(f"{paths}: `drain` must be a mapping")
    results = (merged.get("paths") or {}).get("results", "results")
    return settings_of(drain_config), str(Path(results) / "service")


def status(settings: dict, state_dir: str) -> dict:
    """What the state directory and the unit say: drained (by a live or unknown run), or a
    session of a dead run (after a reboot, say) with what will happen to it."""
    state = State(state_dir)
    session = state.read(state.session)
    properties = unit_properties(settings) if settings["unit"] else None
    out = {"unit": settings["unit"], "drained": False, "session": session, "unit_state": properties}
    if session is not None:
        alive, why = session_verdict(session)
        if alive == "dead":
            active = (properties or {}).get("ActiveState") in ACTIVE_STATES
            out["stale_session"] = {"run": why, "verdict": (
                f"the run that drained {settings['unit']} is dead ({why}); "
                + ("the unit is active again: the next drain or restore closes this session as reconciled"
                   if active else
                   f"{settings['unit']} was left down since {_iso(session['stopped_at'])}: "
                   f"restore it with: {restore_command(state)}"))}
        else:
            out["drained"] = True
            out["held_by"] = why
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m eagle3flow.ops.service", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    for name in ("drain", "restore", "stage-ended", "watchdog", "status"):
        p = sub.add_parser(name)
        p.add_argument("--config", action="append", default=None,
                       help="config file(s) merged in order (default: config.yaml); "
                            "pass the profile's workflow.yaml too, e.g. profiles/local-8gpu/workflow.yaml")
        p.add_argument("--settings-json", help="the drain section as JSON (what the rules pass)")
        p.add_argument("--state-dir", help="default: <paths.results>/service; alone (no --config), "
                                           "the settings of its open session are used")
        if name == "drain":
            p.add_argument("--stage", required=True)
            p.add_argument("--gpus", type=int, required=True, help="the stage uses GPUs 0..N-1")
            p.add_argument("--flag", help="written once drained (the rule's output)")
        if name == "stage-ended":
            p.add_argument("--stage", required=True)
            p.add_argument("--exit-code", type=int, required=True)
        if name == "watchdog":
            p.add_argument("--pid", type=int, required=True)
            p.add_argument("--pid-start", default="None")
            p.add_argument("--run-id", default=None)
    args = parser.parse_args(argv)
    try:
        if args.settings_json:
            settings, state_dir = settings_of(json.loads(args.settings_json)), "results/service"
        elif args.command in ("stage-ended", "restore") and args.state_dir and not args.config:
            # the settings the drain used are in its session
            state_dir = args.state_dir
            session = State(state_dir).read(State(state_dir).session)
            if session is None and args.command == "restore":
                print(f"eagle3flow.ops.service restore: no open session in {state_dir}: nothing to restore "
                      "(pass --config to make sure the unit runs)", file=sys.stderr)
                return 0
            settings = settings_of(session["settings"]) if session else dict(DEFAULTS)
        else:
            settings, state_dir = load_config_files(args.config or ["config.yaml"])
        state_dir = args.state_dir or state_dir
        if args.command == "drain":
            # no GPUs configured: the unit's GPUs are all of the node's
            gpus = list(range(args.gpus)) if args.gpus > 0 else sorted(gpu_memory_used(settings["nvidia_smi"]))
            # Before anything touches systemctl: stopping production is pointless when the
            # stages cannot use the GPUs it frees (CPU torch, vLLM's CPU build, too few GPUs).
            refusal = settings["check_gpu_environment"] and drain_refusal(len(gpus), settings["nvidia_smi"])
            if refusal:
                raise ServiceError(refusal)
            drain(settings, state_dir, args.stage, gpus, args.flag)
        elif args.command == "restore":
            record = restore(settings, state_dir, reason="manual (python -m eagle3flow.ops.service restore)")
            if record:
                print(format_downtime([record]))
        elif args.command == "stage-ended":
            stage_ended(settings, state_dir, args.stage, args.exit_code)
        elif args.command == "watchdog":
            start = None if args.pid_start == "None" else int(args.pid_start)
            return watchdog(settings, state_dir, args.pid, start, args.run_id)
        elif args.command == "status":
            print(json.dumps(status(settings, state_dir), indent=1))
            print(format_downtime(State(state_dir).downtime_records()))
    except (ServiceError, GpuQueryError) as error:
        print(f"eagle3flow.ops.service {args.command}: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
