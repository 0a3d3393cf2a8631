"""The one command of every GPU rule: run the stage, record its real status, release the drain.

    python -m eagle3flow.ops.drain.gpu_stage --stage extract_hidden_states --gpus 8 \\
        [--drain --state-dir /var/lib/eagle3flow/drain/<unit>] --log logs/x.log -- python -m eagle3flow.extract ...

* The stage sees GPUs 0..N-1 numbered as nvidia-smi numbers them
  (``CUDA_DEVICE_ORDER=PCI_BUS_ID``, ``CUDA_VISIBLE_DEVICES=0..N-1``: the ones the drain
  freed), or the first N of a CUDA_VISIBLE_DEVICES it inherits (the drain checks the
  same ones); under SLURM the devices it allocated are kept.
* With ``--drain`` it refuses to start unless the unit is drained for this very run:
  the unit's ``session.json`` exists and lists the live run whose token
  ($EAGLE3FLOW_RUN) this job carries.
* The stage runs in its own process group, with this job's token
  ($EAGLE3FLOW_JOB = this wrapper) in its environment, under a small guard (``--guard``,
  the group's leader) that gets SIGTERM when this wrapper dies (PR_SET_PDEATHSIG) and
  then stops the whole group (SIGTERM, then SIGKILL after the grace): a SIGKILLed job
  leaves no stage behind, its grandchildren (a stage that starts the trainer as a
  subprocess) included. SIGTERM, SIGINT and
  SIGHUP are forwarded to the stage's whole group; the wrapper waits until every
  process of that group has exited (the GPUs are then the driver's again).
* Its status is the child's real one (killed by signal n: 128 + n), handed to
  eagle3flow.ops.drain.cycle.stage_ended (which restores the unit after a failure or the run's
  last GPU stage) and returned as this job's exit status. A failed restore is reported
  loudly but never changes the job's status: the stage's outputs stay valid, and the
  kept session makes onsuccess/onerror, the watchdog or the operator retry.
* The stage's output goes to ``--log`` (the rule's log) and to this job's stderr; this
  wrapper's own messages too.
"""
from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import threading
import time

from eagle3flow.ops.drain.cycle import stage_ended
from eagle3flow.ops.drain.gpus import job_devices
from eagle3flow.ops.drain.state import (JOB_ENV, RUN_ENV, ServiceError, State, restore_command, run_record,
                                        session_runs, settings_of)
from eagle3flow.procfs import live_group_members, signal_on_parent_death, start_ticks, verdict

FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
# How long the stage's group may take to exit after its main process did (or after a
# forwarded signal) before it is killed.
GROUP_EXIT_GRACE_S = 60.0


class Tee:
    """Writes to the log file and to this job's stderr (the latter best effort: a
    terminal gone or a reader killed must not kill the wrapper)."""

    def __init__(self, log_path: str | None):
        self.log = open(log_path, "wb", buffering=0) if log_path else None
        self.stderr = sys.stderr.buffer
        self.echo = True
        self.lock = threading.Lock()

    def write_bytes(self, data: bytes) -> None:
        with self.lock:
            if self.log is not None:
                self.log.write(data)
            if self.echo:
                try:
                    self.stderr.write(data)
                    self.stderr.flush()
                except (OSError, ValueError):
                    self.echo = False

    # a text stream for print(..., file=tee) and for sys.stderr
    def write(self, text: str) -> int:
        self.write_bytes(text.encode(errors="replace"))
        return len(text)

    def flush(self) -> None:
        pass


def _die_with_parent() -> None:
    """In the child: its own process group, and SIGTERM when this wrapper dies."""
    os.setpgid(0, 0)
    signal_on_parent_death(signal.SIGTERM)


def guard(command: list[str]) -> int:
    """The stage group's leader (``--guard``): runs ``command`` in this group and returns
    its status (a signal n as 128 + n). Signals the wrapper forwards reach the whole group
    by themselves; when the wrapper is gone (PR_SET_PDEATHSIG, or reparented), the guard
    stops the group: nothing of a killed job runs on."""
    parent, group = os.getppid(), os.getpgrp()
    orphaned: list[float] = []

    def stop_group(signum=None, frame=None) -> None:
        if os.getppid() == parent or orphaned:
            return          # the wrapper's forwarded signal: the group has it already
        orphaned.append(time.monotonic())
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        try:
            os.killpg(group, signal.SIGTERM)
        except ProcessLookupError:
            pass

    for sig in FORWARDED:
        signal.signal(sig, stop_group)
    try:
        child = subprocess.Popen(command)
    except OSError as error:
        print(f"[gpu_stage] cannot start {command[0]}: {error}", file=sys.stderr, flush=True)
        return 127
    while True:
        try:
            status = child.wait(timeout=0.5)
            break
        except subprocess.TimeoutExpired:
            pass
        except InterruptedError:
            continue
        if os.getppid() != parent:
            stop_group()
            if time.monotonic() - orphaned[0] > GROUP_EXIT_GRACE_S:
                os.killpg(group, signal.SIGKILL)
    if os.getppid() != parent:
        # Orphaned: what else of the group is left (a stage's own children) goes too.
        stop_group()
        while _group_alive(group, but=os.getpid()):
            if time.monotonic() - orphaned[0] > GROUP_EXIT_GRACE_S:
                os.killpg(group, signal.SIGKILL)
            time.sleep(0.2)
    return 128 - status if status < 0 else status


def _group_alive(pgid: int, but: int | None = None) -> bool:
    """Whether a live process (not a zombie, not ``but``) is in process group ``pgid``."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return any(pid != but for pid in live_group_members(pgid))


def stage_environment(gpus: int, base: dict | None = None) -> dict:
    """The stage's environment: its GPUs (job_devices; SLURM's allocation as it is)."""
    env = dict(os.environ if base is None else base)
    if gpus > 0:
        env["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"
        if not env.get("SLURM_JOB_ID"):
            env["CUDA_VISIBLE_DEVICES"] = ",".join(job_devices(gpus, env))
    return env


def drain_refusal(state_dir: str | None) -> str | None:
    """Why a drained stage must not start here, or None (the unit is drained for this live run)."""
    if not state_dir:
        return "drain.unit is not set: the drain_service job in front of this stage says what to set"
    state = State(state_dir)
    token = os.environ.get(RUN_ENV)
    try:
        session = state.read(state.session)
    except ServiceError as error:
        return str(error)
    if session is None:
        return (f"the service is not drained ({state.session} missing): rerun the workflow, whose "
                "drain_service job stops the unit first")
    runs = session_runs(session)
    if not token or token not in runs:
        return (f"the service is drained by another run ({', '.join(runs) or 'by hand'}), not by this one "
                f"({token}); if that run is gone: {restore_command(state)}, then rerun the workflow")
    alive, why = verdict(run_record(runs[token]))
    if alive == "dead":
        return f"the run holding the drain is dead ({why}); rerun the workflow"
    return None


def run(stage: str, gpus: int, command: list[str], drained: bool, state_dir: str | None,
        log_path: str | None) -> int:
    tee = Tee(log_path)
    sys.stderr = tee                            # this module's and the drain's messages
    signal.signal(signal.SIGPIPE, signal.SIG_IGN)

    def say(message: str) -> None:
        print(f"[gpu_stage {time.strftime('%H:%M:%S')}] {message}", file=tee, flush=True)

    if drained:
        refusal = drain_refusal(state_dir)
        if refusal:
            say(f"{stage}: not started: {refusal}")
            return 1
    try:
        env = stage_environment(gpus)
    except ServiceError as error:
        say(f"{stage}: not started: {error}")
        return 1
    env[JOB_ENV] = f"{os.getpid()}:{start_ticks(os.getpid())}"
    received: list[int] = []
    child: subprocess.Popen | None = None

    def forward(signum, frame):
        received.append(signum)
        if child is not None:
            try:
                os.killpg(child.pid, signum)
            except ProcessLookupError:
                pass

    for sig in FORWARDED:
        signal.signal(sig, forward)
    try:
        child = subprocess.Popen([sys.executable, "-m", "eagle3flow.ops.drain.gpu_stage", "--guard", "--", *command], env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                 stderr=subprocess.STDOUT, preexec_fn=_die_with_parent)
    except OSError as error:
        say(f"{stage}: cannot start {command[0]}: {error}")
        rc = 127
    else:
        if received:                           # a signal came before the child existed
            forward(received[-1], None)

        def pump():
            for chunk in iter(lambda: child.stdout.read1(65536), b""):
                tee.write_bytes(chunk)

        reader = threading.Thread(target=pump, daemon=True)
        reader.start()
        while True:
            try:
                status = child.wait()
                break
            except InterruptedError:
                continue
        rc = 128 - status if status < 0 else status
        # Every process of the stage's group gone: its GPU memory is the driver's again.
        deadline = time.monotonic() + GROUP_EXIT_GRACE_S
        while _group_alive(child.pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        if _group_alive(child.pid):
            say(f"{stage}: processes of the stage still run {GROUP_EXIT_GRACE_S:.0f} s after it "
                "ended; killing its process group")
            try:
                os.killpg(child.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        reader.join(timeout=5)
    if received:
        say(f"{stage}: received {signal.Signals(received[0]).name}; the stage exited with rc={rc}")
    if drained:
        state = State(state_dir)
        try:
            session = state.read(state.session)
            settings = settings_of(session["settings"]) if session else None
            if settings is None:
                say(f"{stage} ended (rc={rc}); the unit is not drained (nothing to restore)")
            else:
                stage_ended(settings, state_dir, stage, rc)
        except ServiceError as error:   # it names the command to run
            say(f"!!! {stage}: the unit could not be restored: {error}")
        except Exception as error:  # whatever else fails, the stage's status stands and the failure is loud
            say(f"!!! {stage}: the unit could not be restored: {error!r}\n"
                f"!!! once the cause is fixed: {restore_command(state)}")
    return rc


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--" not in argv:
        print("python -m eagle3flow.ops.drain.gpu_stage: give the stage's command after --", file=sys.stderr)
        return 2
    split = argv.index("--")
    if argv[:split] == ["--guard"]:
        return guard(argv[split + 1:])
    parser = argparse.ArgumentParser(prog="python -m eagle3flow.ops.drain.gpu_stage",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--stage", required=True, help="the rule (a drained stage: DRAINED_STAGES)")
    parser.add_argument("--gpus", type=int, default=0,
                        help="the stage uses N GPUs: 0..N-1, or the first N of CUDA_VISIBLE_DEVICES (0: none)")
    parser.add_argument("--drain", action="store_true", help="the unit is drained for this stage")
    parser.add_argument("--state-dir", default=None, help="the unit's state folder (with --drain)")
    parser.add_argument("--log", default=None, help="the rule's log file")
    args = parser.parse_args(argv[:split])
    command = argv[split + 1:]
    if not command:
        parser.error("no command after --")
    return run(args.stage, args.gpus, command, args.drain, args.state_dir, args.log)


if __name__ == "__main__":
    sys.exit(main())
