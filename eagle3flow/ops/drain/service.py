"""Drain the production vLLM unit for the GPU stages, and always bring it back: the CLI.

One drain/restore *cycle* per run (docs/service.md):

* ``drain`` (rule drain_service, in front of each GPU stage that has to run) checks
  that nobody outside the unit (and outside this run's own jobs) holds the stage's
  GPUs, stops the systemd unit, waits until the unit's cgroup is empty and the GPUs'
  memory is released, and starts the run's detached watchdog. When the unit is already
  drained (by this run, or by a run of another checkout or results folder: the session
  is the unit's), it joins that session and registers the stage, after checking the
  unit is still stopped (the GPU jobs of a run are serialized by Snakemake's ``gpus``
  resource; a sibling GPU job may hold the GPUs).
  Foreign GPU processes are never killed unless ``drain.kill_foreign_gpu_processes``
  is set, and then only they are: never a process carrying a run's token.
* ``stage-ended`` (called by the GPU stage wrapper, eagle3flow/ops/drain/gpu_stage.py, with the
  stage's real exit status) restores the unit when the stage failed or when no other
  drained stage of this run is still to come (the plan ``write_plan`` records at the
  run's start).
* ``restore`` leaves the unit down while another run of the session still has GPU
  stages to run; otherwise it waits for the GPUs to be free, starts the unit and polls
  its health URL; the Snakefile's onsuccess/onerror call it too, and so does the
  watchdog once the Snakemake main process died (SIGKILL, lost terminal) and every job
  of that run has ended. A failed restore keeps the session (so the next run, the
  watchdog or the operator retries) and names the command to run. It is idempotent.
* ``watchdog`` (started by the drain) and ``status`` (what the state and the unit say).

Where each part lives: eagle3flow/ops/drain/state.py (settings, the unit's state folder
``<drain.state_dir>/<unit>/``, the runs and their token ``$EAGLE3FLOW_RUN``),
systemd_unit.py (systemctl), gpus.py (GPU holders, foreign or ours),
cycle.py (drain, stage_ended), restore.py, watchdog.py.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import yaml

from eagle3flow.ops.drain.cycle import drain, stage_ended
from eagle3flow.ops.drain.restore import restore
from eagle3flow.ops.drain.state import (ACTIVE_STATES, DEFAULTS, RUN_ENV, ServiceError, State, format_downtime,
                                        iso_time, restore_command, session_verdict, settings_of,
                                        unit_state_dir)
from eagle3flow.ops.drain.gpu_env import drain_refusal
from eagle3flow.ops.drain.gpu_holders import GpuQueryError, gpu_memory_used
from eagle3flow.ops.drain.gpus import job_gpu_indices
from eagle3flow.ops.drain.systemd_unit import unit_properties
from eagle3flow.ops.drain.watchdog import watchdog


def deep_merge(base: dict, override: dict) -> dict:
    merged = dict(base)
    for key, value in override.items():
        merged[key] = deep_merge(merged[key], value) if isinstance(value, dict) and isinstance(
            merged.get(key), dict) else value
    return merged


def load_config_files(paths: list[str]) -> dict:
    """The drain settings from config files merged in order, as Snakemake does."""
    merged: dict = {}
    for path in paths:
        try:
            merged = deep_merge(merged, yaml.safe_load(Path(path).read_text()) or {})
        except (OSError, yaml.YAMLError) as error:
            raise ServiceError(f"{path}: cannot read config ({error})") from error
    drain_config = merged.get("drain") or {}
    if not isinstance(drain_config, dict):
        raise ServiceError(f"{paths}: `drain` must be a mapping")
    return settings_of(drain_config)


def status(settings: dict, state_dir: str) -> dict:
    """What the state directory and the unit say: drained (by a live or unknown run), or a
    session of a dead run (after a reboot, say) with what will happen to it."""
    state = State(state_dir)
    session = state.read(state.session)
    properties = unit_properties(settings) if settings["unit"] else None
    out = {"unit": settings["unit"], "state_dir": str(state.dir), "drained": False, "session": session,
           "unit_state": properties}
    if session is not None:
        alive, why = session_verdict(session)
        if alive == "dead":
            active = (properties or {}).get("ActiveState") in ACTIVE_STATES
            out["stale_session"] = {"run": why, "verdict": (
                f"the run that drained {settings['unit']} is dead ({why}); "
                + ("the unit is active again: the next drain or restore closes this session as reconciled"
                   if active else
                   f"{settings['unit']} was left down since {iso_time(session['stopped_at'])}: "
                   f"restore it with: {restore_command(state)}"))}
        else:
            out["drained"] = True
            out["held_by"] = why
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m eagle3flow.ops.drain.service", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    for name in ("drain", "restore", "stage-ended", "watchdog", "status"):
        p = sub.add_parser(name)
        p.add_argument("--config", action="append", default=None,
                       help="config file(s) merged in order (default: config.yaml); "
                            "pass the profile's workflow.yaml too, e.g. profiles/local-8gpu/workflow.yaml")
        p.add_argument("--config-json", help="the drain section as JSON (what the rules pass)")
        p.add_argument("--state-dir", help="the unit's state folder (default: <drain.state_dir>/<unit>); "
                                           "alone (no --config), the settings of its open session are used")
        if name == "drain":
            p.add_argument("--stage", required=True)
            p.add_argument("--gpus", type=int, required=True,
                           help="the stage uses N GPUs: 0..N-1, or the first N of CUDA_VISIBLE_DEVICES")
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
        if args.config_json:
            settings = settings_of(json.loads(args.config_json))
        elif args.command in ("stage-ended", "restore") and args.state_dir and not args.config:
            # the settings the drain used are in its session
            session = State(args.state_dir).read(State(args.state_dir).session)
            if session is None and args.command == "restore":
                print(f"eagle3flow.ops.drain.service restore: no open session in {args.state_dir}: nothing to "
                      "restore (pass --config to make sure the unit runs)", file=sys.stderr)
                return 0
            settings = settings_of(session["settings"]) if session else dict(DEFAULTS)
        else:
            settings = load_config_files(args.config or ["config.yaml"])
        # The unit's one state folder, whatever the working directory (docs/service.md).
        state_dir = args.state_dir or str(unit_state_dir(settings))
        if args.command == "drain":
            # no GPUs configured: the unit's GPUs are all of the node's
            gpus = (job_gpu_indices(settings, args.gpus) if args.gpus > 0
                    else sorted(gpu_memory_used(settings["nvidia_smi"], settings["nvidia_smi_timeout_s"])))
            # Before anything touches systemctl: stopping production is pointless when the
            # stages cannot use the GPUs it frees (CPU torch, vLLM's CPU build, too few GPUs).
            refusal = settings["check_gpu_environment"] and drain_refusal(len(gpus), settings["nvidia_smi"])
            if refusal:
                raise ServiceError(refusal)
            drain(settings, state_dir, args.stage, gpus, args.flag)
        elif args.command == "restore":
            # Called by a job of a run (its token), the restore speaks for that run.
            record = restore(settings, state_dir, reason="manual (python -m eagle3flow.ops.drain.service restore)",
                             releasing=os.environ.get(RUN_ENV))
            if record:
                print(format_downtime([record]))
            if State(state_dir).read(State(state_dir).session) is not None:
                print(f"eagle3flow.ops.drain.service restore: {settings['unit']} stays drained: another run "
                      "still needs it (above); it comes back after that run's last GPU stage", file=sys.stderr)
                return 1
        elif args.command == "stage-ended":
            stage_ended(settings, state_dir, args.stage, args.exit_code)
        elif args.command == "watchdog":
            start = None if args.pid_start == "None" else int(args.pid_start)
            return watchdog(settings, state_dir, args.pid, start, args.run_id)
        elif args.command == "status":
            print(json.dumps(status(settings, state_dir), indent=1))
            print(format_downtime(State(state_dir).downtime_records()))
    except (ServiceError, GpuQueryError) as error:
        print(f"eagle3flow.ops.drain.service {args.command}: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
