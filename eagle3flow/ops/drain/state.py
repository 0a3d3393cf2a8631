"""The drain's shared ground: its settings, its state files and the runs that hold it.

State lives in ``<results>/service/`` (docs/service.md): ``session.json`` while the unit
is drained (its presence means "we stopped it"; it names the run that did, with the boot
id, so a session of a dead run, e.g. after a reboot, is reconciled with the unit's real
state instead of reused), ``plan.json`` (the run and the drained stages it will run),
``downtime.json`` (one record per cycle) and ``watchdog.log``.

Runs are told apart by a token: onstart sets ``$EAGLE3FLOW_RUN`` in Snakemake's
environment (the run id of ``plan.json``), so every job of the run and everything it
starts (torchrun ranks, vLLM engine processes) carries it, through reparenting and
setsid; the stage wrapper (eagle3flow/ops/drain/gpu_stage.py) adds ``$EAGLE3FLOW_JOB`` (itself).
"""
from __future__ import annotations

import fcntl
import getpass
import json
import os
import socket
import sys
import time
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path

from eagle3flow.atomic import write_text
from eagle3flow.config import schema_defaults
from eagle3flow.procfs import boot_id, environ, pid_namespace, pids_with_env, running, start_ticks, verdict

# The stages that need every GPU of the node (rules/hidden_states.smk, rules/train.smk).
DRAINED_STAGES = ("extract_hidden_states", "train_draft", "evaluate_draft",
                  # streaming partitions (rules/streaming.smk)
                  "extract_partition", "train_partition", "train_partition_last")

# The run token every job of a run inherits (set by onstart), and the GPU stage wrapper
# ("<pid>:<start ticks>") a stage's processes belong to (set by eagle3flow/ops/drain/gpu_stage.py).
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


def iso_time(epoch: float | None) -> str | None:
    return None if epoch is None else datetime.fromtimestamp(epoch, timezone.utc).isoformat(timespec="seconds")


def restore_command(state: "State") -> str:
    """The operator's command that restores the unit of this state directory."""
    return f"python -m eagle3flow.ops.drain.service restore --state-dir {state.dir}"


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
    return f"{(boot_id() or 'noboot')[:8]}-{pid}-{start_ticks(pid)}"


def write_plan(state_dir: str, stages: list[str], snakemake_pid: int, run_id: str | None = None) -> dict:
    """Called by the Snakefile's onstart: the run (its Snakemake main process) and the
    drained stages it will run, one entry per job (the unit stays down until the last
    job of the last stage has ended). Returns the plan; its ``run_id`` is the token
    ($EAGLE3FLOW_RUN) the run's jobs carry."""
    state = State(state_dir)
    plan = {"run_id": run_id or run_id_of(snakemake_pid), "snakemake_pid": snakemake_pid,
            "snakemake_start": start_ticks(snakemake_pid), "boot_id": boot_id(),
            "host": socket.gethostname(), "pid_ns": pid_namespace("self"), "user": getpass.getuser(),
            "stages": sorted(stages), "written_at": iso_time(time.time())}
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


def wrapper_gone(pid: int) -> bool:
    """Whether ``pid`` is a process of a GPU stage whose wrapper ($EAGLE3FLOW_JOB) is gone:
    its job was killed, nobody waits for it or takes its outputs, and it got SIGTERM
    when the wrapper died (it is exiting)."""
    wrapper, _, ticks = ((environ(pid) or {}).get(JOB_ENV) or "").partition(":")
    if not wrapper.isdigit():
        return False
    return not running(int(wrapper), int(ticks) if ticks.isdigit() else None)


def run_pids(run_ids) -> set[int]:
    """Processes carrying one of these run tokens: jobs of those runs and their children."""
    return {pid for run_id in run_ids if run_id for pid in pids_with_env(RUN_ENV, run_id)}


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
