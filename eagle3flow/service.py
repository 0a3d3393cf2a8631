"""Drain the production vLLM unit for the GPU stages, and always bring it back.

One drain/restore *cycle* per run (docs/service.md):

* ``drain`` (rule drain_service, in front of each GPU stage that has to run) checks
  that nobody outside the unit holds the stage's GPUs, stops the systemd unit, waits
  until the unit's cgroup is empty and the GPUs' memory is released, and starts a
  detached watchdog. Foreign GPU processes are never killed unless
  ``drain.kill_foreign_gpu_processes`` is set, and then only they are.
* ``stage-ended`` (an EXIT trap of each GPU stage's shell) restores the unit when
  the stage failed or when no other drained stage of this run is still to come
  (the plan ``write_plan`` records at the run's start).
* ``restore`` starts the unit and polls its health URL; the Snakefile's
  onsuccess/onerror call it too, and so does the watchdog when the Snakemake main
  process dies without restoring (SIGKILL, lost terminal). It is idempotent.

State lives in ``<results>/service/``: ``session.json`` while the unit is drained
(its presence means "we stopped it"), ``plan.json`` (the drained stages this run
will run), ``downtime.json`` (one record per cycle) and ``watchdog.log``.
"""
from __future__ import annotations

import argparse
import fcntl
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections import Counter
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path

from eagle3flow.procfs import ancestor_chain

from eagle3flow.gpu_holders import (GpuQueryError, children_of, describe_process,
                                    gpu_memory_used, gpu_processes, process_start_ticks)
from eagle3flow.gpu_env import drain_refusal

# The stages that need every GPU of the node (rules/hidden_states.smk, rules/train.smk).
DRAINED_STAGES = ("extract_hidden_states", "train_draft", "evaluate_draft",
                  # streaming partitions (rules/streaming.smk)
                  "extract_partition", "train_partition", "train_partition_last")

# Defaults of the config's `drain` section (schemas/config.schema.yaml holds the same,
# with descriptions); used when this module is called by hand with --config.
DEFAULTS = {
    "enabled": False,
    "unit": None,
    "health_url": "http://127.0.0.1:8000/health",
    "systemctl": ["systemctl"],
    "nvidia_smi": "nvidia-smi",
    "cgroup_root": "/sys/fs/cgroup",
    "stop_timeout_s": 300,
    "gpu_release_timeout_s": 120,
    "gpu_idle_memory_mib": 1024,
    "health_timeout_s": 3600,
    "poll_interval_s": 2.0,
    "kill_foreign_gpu_processes": False,
    "watchdog_poll_s": 5.0,
    "check_gpu_environment": True,
}


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
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(value, indent=1) + "\n")
        tmp.replace(path)

    def downtime_records(self) -> list[dict]:
        return self.read(self.downtime) or []


def write_plan(state_dir: str, stages: list[str], snakemake_pid: int) -> None:
    """Called by the Snakefile's onstart: the drained stages this run will run, one entry
    per job (the unit stays down until the last job of the last stage has ended)."""
    state = State(state_dir)
    with state.locked():
        state.write(state.plan, {"snakemake_pid": snakemake_pid,
                                 "snakemake_start": process_start_ticks(snakemake_pid),
                                 "stages": sorted(stages), "written_at": _iso(time.time())})


def _alive(pid: int | None, start_ticks: int | None) -> bool:
    return pid is not None and process_start_ticks(pid) is not None and (
        start_ticks is None or process_start_ticks(pid) == start_ticks)


# --- the unit --------------------------------------------------------------------------

def _systemctl(settings: dict, *args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    command = [*settings["systemctl"], *args]
    try:
        return subprocess.run(command, capture_output=True, text=True, timeout=timeout)
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
    return children_of(main_pid) if main_pid > 0 else pids


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

def _foreign_holders(settings: dict, gpus: list[int]) -> list:
    """GPU processes on `gpus` that are not in the unit's cgroup (nor this process)."""
    ours = unit_pids(settings) | {os.getpid()}
    return [p for p in gpu_processes(settings["nvidia_smi"], gpus) if p.pid not in ours]


def _describe_holders(holders) -> str:
    by_pid: dict[int, list[int]] = {}
    for holder in holders:
        by_pid.setdefault(holder.pid, []).append(holder.gpu_index)
    return "\n".join(f"  GPU {','.join(map(str, sorted(indices)))}: {describe_process(pid)}"
                     for pid, indices in sorted(by_pid.items()))


def _kill_only(pids: set[int], grace_s: float = 10.0) -> None:
    """SIGTERM, then SIGKILL, exactly these processes (checked by start time: never a reused pid)."""
    starts = {pid: process_start_ticks(pid) for pid in pids}
    for pid, start in starts.items():
        if start is not None:
            log(f"killing foreign GPU process {describe_process(pid)} (drain.kill_foreign_gpu_processes)")
            os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and any(_alive(p, s) for p, s in starts.items() if s):
        time.sleep(0.2)
    for pid, start in starts.items():
        if start is not None and _alive(pid, start):
            os.kill(pid, signal.SIGKILL)


def _handle_foreign(settings: dict, gpus: list[int], when: str) -> None:
    holders = _foreign_holders(settings, gpus)
    if not holders:
        return
    if not settings["kill_foreign_gpu_processes"]:
        raise ServiceError(
            f"{when}: processes outside {settings['unit']} hold GPUs this stage needs; they are not "
            f"killed (set drain.kill_foreign_gpu_processes: true to allow it, or stop them):\n"
            + _describe_holders(holders))
    _kill_only({h.pid for h in holders})


def _wait_until(predicate, timeout_s: float, poll_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while True:
        if predicate():
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(poll_s)


# --- drain -----------------------------------------------------------------------------

def _snakemake_main_pid(state: State) -> tuple[int | None, int | None]:
    """The Snakemake main process this job belongs to: the plan's pid when it is one of
    our ancestors, otherwise the outermost ancestor whose command line says snakemake."""
    ancestors = ancestor_chain(os.getppid())
    plan = state.read(state.plan) or {}
    if plan.get("snakemake_pid") in ancestors:
        return plan["snakemake_pid"], plan.get("snakemake_start")
    found = None
    for pid in ancestors:
        try:
            if b"snakemake" in Path(f"/proc/{pid}/cmdline").read_bytes():
                found = pid
        except OSError:
            continue
    return found, process_start_ticks(found) if found else None


def _start_watchdog(settings: dict, state: State, pid: int | None, start: int | None) -> int | None:
    if pid is None:
        log("no Snakemake process above this job: no watchdog (restore by hand if the run dies)")
        return None
    with open(state.watchdog_log, "a") as out:
        # setsid: the watchdog survives the run's process group being killed.
        proc = subprocess.Popen(
            [sys.executable, "-m", "eagle3flow.service", "watchdog", "--state-dir", str(state.dir),
             "--settings-json", json.dumps(settings), "--pid", str(pid), "--pid-start", str(start)],
            start_new_session=True, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
            cwd="/", close_fds=True)
    return proc.pid


def drain(settings: dict, state_dir: str, stage: str, gpus: list[int], flag: str | None = None) -> None:
    """Stop the unit and wait until its cgroup is empty and `gpus` are free; fail otherwise."""
    state = State(state_dir)
    properties = _require_unit(settings)
    unit = settings["unit"]
    # Foreign holders first: stopping production is pointless if the stage cannot run.
    _handle_foreign(settings, gpus, "before stopping the unit")

    with state.locked():
        session = state.read(state.session)
        if session is None:
            pid, start = _snakemake_main_pid(state)
            # An operator who had the unit stopped gets it back stopped.
            was_active = properties.get("ActiveState") in ("active", "activating", "reloading")
            session = {"unit": unit, "stopped_at": time.time(), "stages": [], "ended": [],
                       "was_active": was_active, "snakemake_pid": pid, "snakemake_start": start,
                       "settings": settings}
            state.write(state.session, session)
            session["watchdog_pid"] = _start_watchdog(settings, state, pid, start)
        session["stages"] = sorted(set(session["stages"]) | {stage})
        state.write(state.session, session)

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
            _handle_foreign(settings, gpus, "after stopping the unit")
            memory = gpu_memory_used(settings["nvidia_smi"])
            busy = [i for i in gpus if memory.get(i, ("", 0))[1] > settings["gpu_idle_memory_mib"]]
            return not gpu_processes(settings["nvidia_smi"], gpus) and not busy

        if not _wait_until(released, settings["gpu_release_timeout_s"], settings["poll_interval_s"]):
            memory = gpu_memory_used(settings["nvidia_smi"])
            raise ServiceError(
                f"GPUs {gpus} still busy {settings['gpu_release_timeout_s']} s after {unit} stopped "
                f"(drain.gpu_release_timeout_s): used MiB "
                + ", ".join(f"GPU {i}: {memory.get(i, ('', '?'))[1]}" for i in gpus)
                + "\n" + _describe_holders(gpu_processes(settings["nvidia_smi"], gpus)))
    except (ServiceError, GpuQueryError) as error:
        log(f"drain failed: {error}")
        log("bringing the unit back before failing")
        try:
            restore(settings, state_dir, reason=f"drain for {stage} failed")
        except ServiceError as restore_error:
            log(f"restore failed too: {restore_error}")
        raise ServiceError(str(error)) from error

    log(f"{unit} stopped; GPUs {gpus} free after {time.time() - session['stopped_at']:.1f} s")
    if flag:
        Path(flag).parent.mkdir(parents=True, exist_ok=True)
        Path(flag).write_text(json.dumps({"unit": unit, "stage": stage, "at": _iso(time.time())}) + "\n")


# --- restore ---------------------------------------------------------------------------

def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return 200 <= response.status < 300
    except (urllib.error.URLError, OSError, ValueError):
        return False


def restore(settings: dict, state_dir: str, reason: str = "manual") -> dict | None:
    """Start the unit and wait for its health URL. Idempotent: with no open session it
    still makes sure the unit runs. Returns the downtime record of the closed cycle."""
    state = State(state_dir)
    if not settings["unit"]:
        raise ServiceError("drain.unit is not set: nothing to restore")
    unit, url = settings["unit"], settings["health_url"]
    with state.locked():
        session = state.read(state.session)
        error = None
        if session is not None and not session.get("was_active", True):
            log(f"{unit} was not running before the drain; leaving it stopped ({reason})")
            result = None
        else:
            log(f"starting {unit} ({reason})")
            result = _systemctl(settings, "start", unit, timeout=settings["health_timeout_s"])
        if result is None:
            pass
        elif result.returncode != 0:
            error = f"systemctl start {unit} failed (rc={result.returncode}): {result.stderr.strip()}"
        else:
            deadline = time.monotonic() + settings["health_timeout_s"]
            while not _healthy(url):
                if unit_properties(settings).get("ActiveState") == "failed":
                    error = f"{unit} failed while starting; see journalctl -u {unit}"
                    break
                if time.monotonic() >= deadline:
                    error = (f"{unit} started but {url} did not answer within "
                             f"drain.health_timeout_s={settings['health_timeout_s']} s")
                    break
                time.sleep(settings["poll_interval_s"])
        record = None
        if session is not None:
            now = time.time()
            record = {"unit": unit, "stages": session["stages"], "reason": reason,
                      "stopped_at": _iso(session["stopped_at"]),
                      "healthy_at": None if error else _iso(now),
                      "downtime_s": round(now - session["stopped_at"], 1),
                      "healthy": error is None, "error": error,
                      "snakemake_pid": session.get("snakemake_pid")}
            state.write(state.downtime, state.downtime_records() + [record])
            state.session.unlink()  # the watchdog sees this and exits
    if error:
        raise ServiceError(error + " (restore by hand: python -m eagle3flow.service restore)")
    if result is not None:
        log(f"{unit} healthy at {url}" + (f"; down {record['downtime_s']} s" if record else ""))
    return record


def restore_if_drained(settings: dict, state_dir: str, reason: str) -> dict | None:
    """For the Snakefile's onsuccess/onerror: restore only when this workflow drained."""
    if not settings.get("enabled") or State(state_dir).read(State(state_dir).session) is None:
        return None
    return restore(settings, state_dir, reason)


def stage_ended(settings: dict, state_dir: str, stage: str, exit_code: int) -> None:
    """EXIT trap of a GPU stage: restore unless another drained stage of this run follows."""
    state = State(state_dir)
    with state.locked():
        session = state.read(state.session)
        if session is None:
            log(f"{stage} ended; the unit is not drained (nothing to restore)")
            return
        # One entry per ended job: a stage may run several (partitions, streaming links).
        session["ended"] = sorted(session["ended"] + [stage])
        state.write(state.session, session)
        plan = state.read(state.plan) or {}
    run_alive = _alive(plan.get("snakemake_pid"), plan.get("snakemake_start"))
    # The plan lists a stage once per job this run will run.
    remaining = Counter(plan.get("stages", [])) - Counter(session["ended"])
    pending = sorted(remaining) if run_alive else []
    if exit_code != 0:
        reason = f"{stage} failed (rc={exit_code})"
    elif pending:
        log(f"{stage} done; {settings['unit']} stays down for {', '.join(pending)}")
        return
    else:
        reason = f"{stage} was the last GPU stage of the run"
    restore(settings, state_dir, reason)


def watchdog(settings: dict, state_dir: str, pid: int, pid_start: int | None) -> None:
    """Detached: restore the unit if Snakemake `pid` dies while the unit is drained."""
    state = State(state_dir)
    log(f"watchdog {os.getpid()}: watching Snakemake pid {pid} for {settings['unit']}")
    while True:
        session = state.read(state.session)
        if session is None or session.get("snakemake_pid") != pid:
            log("watchdog: the unit was restored; exiting")
            return
        if not _alive(pid, pid_start):
            break
        time.sleep(settings["watchdog_poll_s"])
    log(f"watchdog: Snakemake pid {pid} ended with {settings['unit']} still drained")
    # Orphaned GPU jobs of the dead run may still hold the GPUs: let them go first.
    gpus = sorted(gpu_memory_used(settings["nvidia_smi"]))
    _wait_until(lambda: not [p for p in gpu_processes(settings["nvidia_smi"], gpus)
                             if p.pid not in unit_pids(settings)],
                settings["gpu_release_timeout_s"], settings["poll_interval_s"])
    restore(settings, state_dir, reason=f"watchdog: Snakemake pid {pid} died without restoring")


# --- reporting -------------------------------------------------------------------------

def format_downtime(records: list[dict]) -> str:
    lines = []
    for r in records:
        status = "healthy" if r["healthy"] else f"NOT HEALTHY: {r['error']}"
        lines.append(f"{r['unit']} down {r['downtime_s']} s for {', '.join(r['stages'])} "
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m eagle3flow.service", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    for name in ("drain", "restore", "stage-ended", "watchdog", "status"):
        p = sub.add_parser(name)
        p.add_argument("--config", action="append", default=None,
                       help="config file(s) merged in order (default: config.yaml); "
                            "pass the profile's workflow.yaml too, e.g. profiles/local-8gpu/workflow.yaml")
        p.add_argument("--settings-json", help="the drain section as JSON (what the rules pass)")
        p.add_argument("--state-dir", help="default: <paths.results>/service")
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
    args = parser.parse_args(argv)
    try:
        if args.settings_json:
            settings, state_dir = settings_of(json.loads(args.settings_json)), "results/service"
        elif args.command == "stage-ended":
            # the GPU stage's trap: the settings the drain used are in its session
            state_dir = args.state_dir or "results/service"
            session = State(state_dir).read(State(state_dir).session)
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
            record = restore(settings, state_dir, reason="manual (python -m eagle3flow.service restore)")
            if record:
                print(format_downtime([record]))
        elif args.command == "stage-ended":
            stage_ended(settings, state_dir, args.stage, args.exit_code)
        elif args.command == "watchdog":
            start = None if args.pid_start == "None" else int(args.pid_start)
            watchdog(settings, state_dir, args.pid, start)
        elif args.command == "status":
            state = State(state_dir)
            session = state.read(state.session)
            print(json.dumps({"unit": settings["unit"], "drained": session is not None, "session": session,
                              "unit_state": unit_properties(settings) if settings["unit"] else None},
                             indent=1))
            print(format_downtime(state.downtime_records()))
    except (ServiceError, GpuQueryError) as error:
        print(f"eagle3flow.service {args.command}: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
