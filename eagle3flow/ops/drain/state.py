"""The drain's shared ground: its settings, the unit's state and the runs that hold it.

The state belongs to the unit, not to a checkout: one directory per unit on the host,
``<drain.state_dir>/<unit>/`` (:func:`unit_state_dir`; default ``/var/lib/eagle3flow/drain``,
docs/service.md), the same for every checkout, results directory and working directory,
read and written under one lock:

* ``session.json`` while the unit is drained (its presence means "we stopped it"): the
  unit's state before the first drain, the GPUs, and every run that drained it
  (``runs``: each run's identity, its planned GPU stages and ended jobs, its watchdog,
  whether it released the unit), with the boot id, so that a session whose runs are all
  dead (after a reboot, say) is reconciled with the unit's real state instead of reused;
* ``runs/<run id>.json``: each run registered by its onstart (the drained stages it will
  run, its ``<results>/service`` folder), until it ends;
* ``restoring.json`` while a restore waits for the GPUs and the unit's health, which it
  does without the lock: drains and other restores wait for it (and say so), every
  other step (a run registering, a stage ending) goes on;
* ``downtime.json``: one record per cycle on this host; each record also goes to
  ``<results>/service/downtime.json`` of every run of its cycle (the report reads it);
* ``watchdog.log``.

Runs are told apart by a token: onstart sets ``$EAGLE3FLOW_RUN`` in Snakemake's
environment (the run id it registers), so every job of the run and everything it
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
from eagle3flow.layout import DOWNTIME_FILE
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
# Where the units' state lives when drain.state_dir is null: the same for every run on
# the host, and kept across a reboot (a session a reboot cut short is reconciled).
DEFAULT_STATE_ROOT = "/var/lib/eagle3flow/drain"


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


def unit_state_dir(settings: dict) -> Path:
    """The unit's state folder: one per unit on the host, wherever a run lives (a user
    unit, ``systemctl --user``, is one per user)."""
    unit = settings.get("unit")
    if not unit:
        raise ServiceError("drain.unit is not set: put the systemd unit that serves the target (e.g. "
                           "vllm-kimi-k25-int4.service) in profiles/local-8gpu/workflow.yaml or config.yaml")
    root = settings.get("state_dir") or DEFAULT_STATE_ROOT
    if not os.path.isabs(root):
        raise ServiceError(f"drain.state_dir must be an absolute path, not {root!r}: every run and "
                           "command on the host must find the unit's one session")
    owner = f"user-{os.getuid()}-" if "--user" in settings["systemctl"] else ""
    return Path(root) / (owner + unit.replace("/", "_"))


def iso_time(epoch: float | None) -> str | None:
    return None if epoch is None else datetime.fromtimestamp(epoch, timezone.utc).isoformat(timespec="seconds")


def restore_command(state: "State") -> str:
    """The operator's command that restores the unit of this state directory."""
    return f"python -m eagle3flow.ops.drain.service restore --state-dir {state.dir}"


# --- state files ---------------------------------------------------------------------

class State:
    """The files of one unit's state folder, read and written under one lock."""

    def __init__(self, state_dir: str | os.PathLike):
        self.dir = Path(state_dir).absolute()
        self.session = self.dir / "session.json"
        self.downtime = self.dir / "downtime.json"
        self.watchdog_log = self.dir / "watchdog.log"
        self.runs = self.dir / "runs"
        # A restore under way (it waits for the GPUs and the unit's health unlocked).
        self.restoring = self.dir / "restoring.json"

    def make(self) -> None:
        try:
            self.runs.mkdir(parents=True, exist_ok=True)
        except OSError as error:
            raise ServiceError(
                f"cannot create the unit's state folder {self.dir} ({error}): create its parent once, "
                f"writable for every user who runs the workflow (e.g. sudo install -d -m 2775 -g <group> "
                f"{self.dir.parent}), or set drain.state_dir (docs/service.md)") from error

    @contextmanager
    def locked(self):
        self.make()
        # Read-only is enough for flock: another user's lock file (mode 644) still locks.
        fd = os.open(self.dir / ".lock", os.O_RDONLY | os.O_CREAT, 0o666)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)

    def read(self, path: Path):
        try:
            return json.loads(path.read_text())
        except FileNotFoundError:
            return None
        except ValueError as error:
            raise ServiceError(f"{path}: not valid JSON ({error}); delete it after checking the unit") from error

    def write(self, path: Path, value) -> None:
        self.make()
        write_text(path, json.dumps(value, indent=1) + "\n")

    def downtime_records(self) -> list[dict]:
        return self.read(self.downtime) or []

    def add_record(self, record: dict, service_dirs=()) -> None:
        """The host's record of the cycle, and each run's copy in its results folder."""
        self.write(self.downtime, self.downtime_records() + [record])
        for folder in sorted(set(service_dirs)):
            path = Path(folder) / DOWNTIME_FILE
            try:
                earlier = json.loads(path.read_text()) if path.exists() else []
                path.parent.mkdir(parents=True, exist_ok=True)
                write_text(path, json.dumps(earlier + [record], indent=1) + "\n")
            except (OSError, ValueError) as error:
                log(f"could not add the downtime record to {path} ({error}); it is in {self.downtime}")

    def run_file(self, run_id: str) -> Path:
        return self.runs / f"{run_id}.json"


# --- runs ----------------------------------------------------------------------------

def run_id_of(pid: int) -> str:
    """A run's id: its Snakemake main process, named so that no other run of this host
    (another boot, a reused pid) has the same."""
    return f"{(boot_id() or 'noboot')[:8]}-{pid}-{start_ticks(pid)}"


def write_plan(drain_config: dict, service_dir: str, stages: list[str], snakemake_pid: int,
               run_id: str | None = None) -> dict:
    """Called by the Snakefile's onstart: register the run (its Snakemake main process, its
    results' service folder) with the unit, and the drained stages it will run, one entry
    per job (the unit stays down until the last job of the last stage has ended).
    Returns the plan; its ``run_id`` is the token ($EAGLE3FLOW_RUN) the run's jobs carry."""
    state = State(unit_state_dir(settings_of(drain_config)))
    plan = {"run_id": run_id or run_id_of(snakemake_pid), "snakemake_pid": snakemake_pid,
            "snakemake_start": start_ticks(snakemake_pid), "boot_id": boot_id(),
            "host": socket.gethostname(), "pid_ns": pid_namespace("self"), "user": getpass.getuser(),
            "stages": sorted(stages), "service_dir": str(Path(service_dir).absolute()),
            "written_at": iso_time(time.time())}
    with state.locked():
        for path in state.runs.glob("*.json"):
            _drop_if_gone(state, path)
        state.write(state.run_file(plan["run_id"]), plan)
    return plan


def _drop_if_gone(state: State, path: Path) -> None:
    """Forget a registered run that is provably dead and whose jobs have all ended."""
    try:
        record = state.read(path) or {}
    except ServiceError:
        record = {}
    if verdict(run_record(record))[0] == "dead" and not run_pids([record.get("run_id")]):
        path.unlink(missing_ok=True)


def unregister_run(state: State, run_id: str | None) -> None:
    """onsuccess/onerror: the run has ended."""
    if run_id:
        state.run_file(run_id).unlink(missing_ok=True)


def run_record(record: dict) -> dict:
    """The Snakemake main process a plan or a session names, as procfs.verdict reads it
    (an old record without a host was written on this one: the state dir is local)."""
    return {"host": record.get("host") or socket.gethostname(), "boot_id": record.get("boot_id"),
            "pid_ns": record.get("pid_ns"), "pid": record.get("snakemake_pid"),
            "start_ticks": record.get("snakemake_start"), "user": record.get("user")}


def session_runs(session: dict) -> dict[str, dict]:
    """The runs that drained the unit in this session: {run id: entry} (an entry added
    here is the session's)."""
    return session.setdefault("runs", {})


def session_verdict(session: dict) -> tuple[str, str]:
    """("dead" | "alive" | "unknown", why) of the runs that hold a session: alive while any
    of them is, dead only when all provably are. A session drained by hand (no run) is
    "unknown" unless it is from another boot."""
    runs = session_runs(session)
    if not runs:
        return verdict(run_record(session))
    verdicts = [(v, f"run {run_id}: {why}") for run_id, entry in runs.items()
                for v, why in [verdict(run_record(entry))]]
    for wanted in ("alive", "unknown"):
        found = [why for v, why in verdicts if v == wanted]
        if found:
            return wanted, "; ".join(found)
    return "dead", "; ".join(why for _, why in verdicts)


def this_run(state: State) -> dict | None:
    """The registered plan of the live run this process is a job of (its token), or None
    (called by hand, or a token no live run registered)."""
    token = os.environ.get(RUN_ENV)
    if not token:
        return None
    try:
        plan = state.read(state.run_file(token))
    except ServiceError:
        return None
    if plan and plan.get("run_id") == token and verdict(run_record(plan))[0] != "dead":
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


def run_summary(service_dir: str, run_id: str | None) -> str:
    """The cycles a run took part in, from its results' copy of the records."""
    path = Path(service_dir) / DOWNTIME_FILE
    try:
        records = json.loads(path.read_text()) if path.exists() else []
    except (OSError, ValueError):
        return ""
    return format_downtime([r for r in records if run_id in r.get("run_ids", [r.get("run_id")])])
