"""The fault matrix: every way a run on the production box can be interrupted, for real.

Each scenario runs real Snakemake on a copy of one upstream workflow (the embedded
default with a tiny config, its CPU stages done: tests/test_drain.py's `upstream`)
with the stand-ins of tests/fixtures/service/ (a systemctl running the fake vLLM unit
as a real process group, an nvidia-smi reporting which live process holds which fake
GPU: the unit's worker, the workflow's own extraction/training/evaluation processes,
foreign processes the test starts), injects one fault, lets the workflow, its stage
wrapper and its watchdog do what they do, reruns where finished work could be
recomputed, and records one row:

* where the fault hit; whether the unit is healthy at the end (or, where a restore
  cannot succeed, whether the session was kept and the message names the command);
* the production downtime (downtime.json, every cycle of the scenario);
* foreign processes killed (a bystander and any foreign GPU holder: must be 0);
* finished shards / checkpoints recomputed by the rerun (rewritten files; consumed
  streaming partitions extracted again): must be 0;
* whether the lock and the session are consistent at the end (no lock of a dead run,
  no session unless a restore is still owed, no drain flag).

The rows go through tests/support/fault_rows.py, with those of the scenarios other
modules drive more cheaply (tests/test_drain.py: the drain commands on the stand-in
box; stages killed mid-write; ...), to fault_matrix.json and fault_matrix.md in the
run's reports folder (tests/conftest.py: REPORTS, never the checkout), and the
terminal summary prints the table; `EAGLE3FLOW_TEST_REPORTS=tests pytest ...` rewrites
the rows of the tests it ran in the committed tests/fault_matrix.json and .md. A
dry-run matrix follows: every
profile x {plain, streaming under a budget, regenerate, partitions > 1} builds its
DAG, and on b200-slurm every GPU job, the derived streaming rules included, asks for
GPUs. The last test: a dry run (or --lint, --dag) changes nothing on disk.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from support.box import UNIT, FakeBox, run_snakemake, snakemake_args, tiny_config
from support.fault_rows import DRY_RUNS, record, yes
from support.processes import alive
from support.workflow import REPO, file_identity, snakemake, start_snakemake, workflow_copy

from eagle3flow.ops import plan as plan_lib

# Small shards and checkpoints, so that a fault lands between finished ones.
SIZES = {"extract": {"shard_tokens": 1024},
         "train": {"epochs": 2, "batch_tokens": 512, "checkpoint_every": 2, "eval_max_tokens": 256}}
WATCHDOG = {"orphan_timeout_s": 300, "restore_attempts": 2, "restore_retry_s": 1}


# ----------------------------------------------------------------------------- a scenario's box

class Scenario:
    """One workflow copy (from the upstream one), its fake box, a bystander process, and
    what is measured at the end."""

    def __init__(self, upstream: Path, tmp_path: Path, **sections):
        self.box = FakeBox(tmp_path / "box")
        self.workdir = tmp_path / "wf"
        shutil.copytree(upstream, self.workdir, symlinks=True)
        # This run's drain flags and downtime copy (the unit's session is in box.state_dir).
        self.service_dir = self.workdir / "results" / "service"
        self.box.start_unit()
        drain = {**WATCHDOG, **sections.pop("drain", {})}
        self.config = tiny_config(self.box, tmp_path / "tiny.json", **drain)
        data = json.loads(self.config.read_text())
        for layer in (SIZES, sections):
            for key, value in layer.items():
                data.setdefault(key, {}).update(value)
        self.config.write_text(json.dumps(data))
        self.args = snakemake_args(self.workdir, self.config)
        self.tmp = tmp_path
        # Not the workflow's: must never be killed (0 foreign processes killed).
        self.bystanders = [subprocess.Popen(["sleep", "900"], start_new_session=True)]
        self.box.others += self.bystanders
        self.logs: list[Path] = []

    def record(self, **row) -> dict:
        """A row of the matrix, with what the box measured at the end: the unit healthy,
        the downtime, the foreign processes killed."""
        return record(**row, unit_healthy=yes(self.box.healthy()), downtime=self.downtime(),
                      foreign_killed=self.foreign_killed())

    def env(self, **extra) -> dict:
        return {k: self.box.env[k] for k in ("PATH", "FAKE_SYSTEMD_DIR", "FAKE_GPU_DIR", "FAKE_GPU_PROGRAMS")} | extra

    def start(self, *targets: str, name: str = "run", **env) -> subprocess.Popen:
        log = self.tmp / f"{name}.log"
        self.logs.append(log)
        return start_snakemake(self.workdir, *targets, *self.args, log=log, **self.env(**env))

    def run(self, *targets: str, timeout: float = 400, **env) -> subprocess.CompletedProcess:
        return run_snakemake(self.box, self.workdir, *targets, *self.args, timeout=timeout, **env)

    def wait(self, predicate, timeout: float, what: str, proc: subprocess.Popen | None = None) -> None:
        deadline = time.monotonic() + timeout
        while not predicate():
            if proc is not None and proc.poll() is not None:
                pytest.fail(f"the run ended (rc={proc.returncode}) before {what}:\n{self.tail()}")
            if time.monotonic() > deadline:
                pytest.fail(f"timed out waiting for {what}:\n{self.tail()}")
            time.sleep(0.2)

    def tail(self) -> str:
        out = [f"--- {log}\n{log.read_text()[-3000:]}" for log in self.logs[-1:] if log.exists()]
        wd = self.box.state_dir / "watchdog.log"
        if wd.exists():
            out.append(f"--- watchdog.log\n{wd.read_text()[-2000:]}")
        return "\n".join(out)

    # what is on disk
    def shards(self) -> dict:
        return file_identity((self.workdir / "cache" / "hidden_states").glob("*/shard-*.safetensors"))

    def checkpoints(self) -> dict:
        return file_identity((self.workdir / "cache" / "train").glob("*/step-*/state.pt"))

    def session(self) -> dict | None:
        return self.box.session()

    def restored(self) -> bool:
        return self.box.healthy() and self.session() is None

    def run_gone(self) -> bool:
        """No process of this scenario's box carries a run's token (the jobs have ended)."""
        from eagle3flow.procfs import environ, pids

        return not [pid for pid in pids() if (env := environ(pid) or {}).get("EAGLE3FLOW_RUN")
                    and env.get("FAKE_GPU_DIR") == str(self.box.gpus)]

    def wait_restored(self, what: str, timeout: float = 120) -> None:
        """The unit back, the session closed, every process of the killed run gone."""
        self.wait(lambda: self.restored() and self.run_gone(), timeout, what)

    def downtime(self) -> str:
        records = self.box.downtime()
        return f"{sum(r['downtime_s'] or 0 for r in records):.1f} s ({len(records)} cycle(s))"

    def foreign_killed(self, *foreign: subprocess.Popen) -> int:
        """Processes not of the workflow that were killed (ended by a signal or non-zero)."""
        return sum(1 for p in [*self.bystanders, *foreign] if p.poll() is not None and p.returncode != 0)

    def started_on_busy_gpus(self) -> list[dict]:
        return [s for s in self.box.starts() if s["gpu_holders"]]

    def consistent(self, session_expected: bool = False) -> tuple[bool, str]:
        locks = sorted(p.name for p in (self.workdir / ".snakemake" / "locks").glob("*.lock"))
        flags = sorted(p.name for p in self.service_dir.glob("drained_for_*.flag"))
        session = self.session() is not None
        ok = not locks and not flags and session == session_expected
        return ok, ("consistent" if ok else f"locks {locks}, flags {flags}, session {session}")

    def close(self) -> None:
        self.box.close()


def rewritten(before: dict, after: dict) -> int:
    """Files of ``before`` that exist in ``after`` with another identity (written again)."""
    return sum(1 for path, ident in before.items() if path in after and after[path] != ident)


def stage_pids(sc: Scenario, module: str) -> list[int]:
    """Live processes of this scenario running ``python -m module`` (the stage itself)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            argv = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")
            env = Path(f"/proc/{entry}/environ").read_bytes()
        except OSError:
            continue
        if b"-m" in argv[:3] and argv[argv.index(b"-m") + 1] == module.encode() and \
                f"FAKE_GPU_DIR={sc.box.gpus}".encode() in env and alive(int(entry)):
            found.append(int(entry))
    return found


@pytest.fixture
def scenario(upstream, tmp_path):
    made = []

    def make(**sections) -> Scenario:
        base = sections.pop("upstream", upstream)
        made.append(Scenario(base, tmp_path / f"s{len(made)}", **sections))
        return made[-1]

    yield make
    for sc in made:
        sc.close()


# Streaming needs hidden states large next to the draft (the previous link's checkpoint
# stays on disk with F partitions): more conversations than `upstream`'s 60.
STREAM_UPSTREAM = {"embedded": {"max_conversations": 400}}


@pytest.fixture(scope="module")
def stream_upstream(tmp_path_factory):
    """Like `upstream` (the CPU stages before extraction done, drain on), on 400 conversations."""
    root = tmp_path_factory.mktemp("stream_upstream")
    box = FakeBox(root / "box")
    workdir = workflow_copy(root / "wf")
    config = tiny_config(box, root / "tiny.json")
    data = json.loads(config.read_text())
    data["embedded"].update(STREAM_UPSTREAM["embedded"])
    config.write_text(json.dumps(data))
    result = run_snakemake(box, workdir, "results/dataset/train.parquet",
                           "results/vocab/vocab_map.safetensors", *snakemake_args(workdir, config))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return workdir


UNTIL = ("--until", "train_draft")
TRAINED = ("results/train/draft.safetensors",)     # streaming: train_partition_last writes it


# ----------------------------------------------------------------------------- scenarios

@pytest.mark.slow
def test_snakemake_main_process_killed_its_job_lives_on(scenario):
    """Only the Snakemake main process is SIGKILLed, during extraction and then (the rerun)
    during training: the GPU job is orphaned and runs to its end. The unit must not be
    started while it holds the GPUs, must come back once it ended, and each rerun (no
    --unlock) must recompute nothing finished. One workflow copy for both kills."""
    sc = scenario()
    stages = {"extraction": ("eagle3flow.extract", {"EAGLE3FLOW_TEST_SHARD_DELAY": "2"}, lambda: len(sc.shards()) >= 1),
              "training": ("eagle3flow.train.trainer", {"EAGLE3FLOW_TEST_STEP_DELAY": "1"},
                           lambda: len(sc.checkpoints()) >= 1)}
    killed = []   # (stage, shards, checkpoints, starts after the orphan ended)
    for stage, (module, slow, ready) in stages.items():
        proc = sc.start(*UNTIL, name=f"run-{stage}", **slow)
        sc.wait(lambda: ready() and stage_pids(sc, module), 240, f"a finished {stage} file", proc)
        shards, checkpoints = sc.shards(), sc.checkpoints()
        orphan = stage_pids(sc, module)
        os.kill(proc.pid, signal.SIGKILL)              # the main process only
        proc.wait()
        sc.wait(lambda: not any(alive(p) for p in orphan), 240, "the orphaned job to end")
        orphan_end = time.time()
        sc.wait_restored("the unit to be restored")
        killed.append((stage, shards, checkpoints, [s for s in sc.box.starts() if s["at"] >= orphan_end - 1]))
    rerun = sc.run(*UNTIL)
    ok, consistent = sc.consistent()
    rows = []
    for i, (stage, shards, checkpoints, starts_after) in enumerate(killed):
        nxt = f"the next run killed during {killed[i + 1][0]}" if i + 1 < len(killed) else \
            f"rerun rc={rerun.returncode}, no --unlock"
        rows.append(sc.record(
            scenario=f"SIGKILL of the Snakemake main process only, during {stage} (job orphaned)",
            fault_at=f"{stage}, {len(shards)} shard(s) / {len(checkpoints)} checkpoint(s) finished",
            recomputed=rewritten(shards, sc.shards()) + rewritten(checkpoints, sc.checkpoints()),
            consistent=consistent,
            notes=f"unit started on busy GPUs {len(sc.started_on_busy_gpus())} time(s); restored after the "
                  f"orphan ended ({len(starts_after)} start(s) after it); {nxt}"))
        assert starts_after, f"the unit came back after the {stage} orphan ended"
    assert rerun.returncode == 0, (rerun.stdout + rerun.stderr)[-4000:]
    assert not sc.started_on_busy_gpus(), sc.box.starts()
    for row in rows:
        assert row["unit_healthy"] == "yes" and row["foreign_killed"] == 0 and row["recomputed"] == 0 and ok, row


@pytest.mark.slow
def test_whole_process_group_killed_at_each_gpu_stage(scenario):
    """SIGKILL of Snakemake and every job of its process group (a lost session, the OOM
    killer, kill -9 -PGID) during each GPU stage in turn: extraction, then (the rerun)
    training, then (the next rerun) the evaluation. Each time the watchdog restores the
    unit once the stage's processes are gone and exits, and the rerun recomputes nothing
    finished. One workflow copy for the three kills: each rerun is the next kill's run."""
    # vLLM's CPU build serves the evaluation here: one process, no tensor parallelism.
    sc = scenario(evaluate={"device": "cpu"})
    targets = ("results/eval/summary.json",)
    modules = {"extract_hidden_states": "eagle3flow.extract", "train_draft": "eagle3flow.train.trainer",
               "evaluate_draft": "eagle3flow.eval.evaluate"}
    # Slowed only where the kill must land: between shards, between checkpoints.
    slow = {"extract_hidden_states": {"EAGLE3FLOW_TEST_SHARD_DELAY": "2"},
            "train_draft": {"EAGLE3FLOW_TEST_STEP_DELAY": "1"}, "evaluate_draft": {}}
    ready = {"extract_hidden_states": lambda: len(sc.shards()) >= 1,
             "train_draft": lambda: len(sc.checkpoints()) >= 1, "evaluate_draft": lambda: True}
    killed = []   # (stage, pid, shards, checkpoints) at each kill
    for stage in modules:
        proc = sc.start(*targets, name=f"run-{stage}", **slow[stage])
        sc.wait(lambda: ready[stage]() and stage_pids(sc, modules[stage]), 400, f"{stage} running", proc)
        if stage == "evaluate_draft":
            time.sleep(3)   # inside vLLM's start-up
        killed.append((stage, proc.pid, sc.shards(), sc.checkpoints()))
        watchdogs = sc.box.watchdogs()
        assert watchdogs and not sc.box.healthy(), sc.session()
        os.killpg(proc.pid, signal.SIGKILL)     # Snakemake and its jobs: no onerror runs
        proc.wait()
        assert all(alive(w) for w in watchdogs), "the watchdog is in its own session and survives"
        sc.wait_restored(f"the watchdog's restore after the kill during {stage}")
        # Once the unit is back it has nothing left to guard.
        sc.wait(lambda: not any(alive(w) for w in watchdogs), 10, "the watchdog to exit after its restore")
    rerun = sc.run(*targets)
    rc, jobs = rerun.returncode, plan_lib.parse_job_stats(rerun.stdout + rerun.stderr)
    ok, consistent = sc.consistent()
    records = sc.box.downtime()
    rows = []
    for i, (stage, pid, shards, checkpoints) in enumerate(killed):
        recomputed = rewritten(shards, sc.shards()) + rewritten(checkpoints, sc.checkpoints())
        if stage == "evaluate_draft":
            # Nothing upstream of the evaluation ran again.
            recomputed += sum(v for k, v in jobs.items()
                              if k not in ("evaluate_draft", "drain_service", "preflight_before_drain"))
        nxt = f"the next run killed during {killed[i + 1][0]}" if i + 1 < len(killed) else f"rerun rc={rc}, its jobs {jobs}"
        rows.append(sc.record(scenario=f"SIGKILL of the whole process group during {stage}",
                              fault_at=f"{stage}, {len(shards)} shard(s) / {len(checkpoints)} checkpoint(s) finished",
                              recomputed=recomputed, consistent=consistent,
                              notes=f"restored by the watchdog; {nxt}"))
        assert records[i]["reason"].startswith(f"watchdog: Snakemake pid {pid} died"), records
    assert rc == 0, (rerun.stdout + rerun.stderr)[-4000:]
    assert len(records) == len(killed) + 1, records     # the last run's own drain/restore cycle
    assert not sc.started_on_busy_gpus(), sc.box.starts()
    for row in rows:
        assert row["unit_healthy"] == "yes" and row["foreign_killed"] == 0 and row["recomputed"] == 0 and ok, row


@pytest.mark.slow
def test_gpu_stage_that_fails(scenario):
    """Extraction crashes after the drain (a device the node has not; the config's form
    of it is valid, so the preflight lets it pass): the stage's end restores the unit at
    once with the stage's real status."""
    sc = scenario(extract={"device": "cuda:99"})
    result = sc.run(*UNTIL)
    ok, consistent = sc.consistent()
    records = sc.box.downtime()
    # drained once, started again once (after the box's own start), nothing of the stage kept
    assert len(sc.box.calls("stop")) == 1 and len(sc.box.calls("start")) == 1 + 1, sc.box.calls("start")
    assert not (sc.workdir / "results" / "hidden_states" / "train" / "manifest.json").exists()
    row = sc.record(scenario="a GPU stage that fails", fault_at="extract_hidden_states (rc=1)",
                    recomputed=0, consistent=consistent,
                    notes=f"reason: {records[-1]['reason'] if records else '-'}; run rc={result.returncode}")
    assert result.returncode != 0 and len(records) == 1, records
    assert records[0]["reason"] == "extract_hidden_states failed (rc=1)" and records[0]["healthy"], records
    assert row["unit_healthy"] == "yes" and row["foreign_killed"] == 0 and ok, row


@pytest.mark.slow
def test_gpu_stage_signalled(scenario):
    """SIGTERM to the run's process group during extraction (systemd-run stop, tmux kill):
    the stage wrapper forwards it, records the stage's real status (143, not 0) and
    restores only once the stage's processes are gone."""
    sc = scenario()
    proc = sc.start(*UNTIL, EAGLE3FLOW_TEST_SHARD_DELAY="3")
    sc.wait(lambda: len(sc.shards()) >= 1 and stage_pids(sc, "eagle3flow.extract"), 240,
            "extraction running", proc)
    shards = sc.shards()
    os.killpg(proc.pid, signal.SIGTERM)
    proc.wait(timeout=120)
    sc.wait_restored("the unit to be restored")
    records = sc.box.downtime()
    jobs = [(j["stage"], j["rc"]) for r in records for j in r.get("ended_jobs", [])]
    rerun = sc.run(*UNTIL)
    ok, consistent = sc.consistent()
    row = sc.record(scenario="the run signalled (SIGTERM to its process group) during a GPU stage",
                    fault_at=f"extract_hidden_states, {len(shards)} shard(s) finished",
                    recomputed=rewritten(shards, sc.shards()), consistent=consistent,
                    notes=f"stage ends recorded {jobs}; reason: {records[0]['reason']}; rerun rc={rerun.returncode}")
    assert ("extract_hidden_states", 128 + signal.SIGTERM) in jobs, records
    assert records[0]["reason"] == f"extract_hidden_states failed (rc={128 + signal.SIGTERM})", records
    assert not sc.started_on_busy_gpus() and rerun.returncode == 0, (rerun.stdout + rerun.stderr)[-3000:]
    assert row["unit_healthy"] == "yes" and row["foreign_killed"] == 0 and row["recomputed"] == 0 and ok, row


@pytest.mark.slow
def test_unit_that_fails_to_start_again(scenario):
    """The unit cannot start again (vLLM fails to load): every restore fails (the stage's
    end, onsuccess, the watchdog's retries), the session is kept and the message names
    the command; once the unit is repaired that command closes the cycle."""
    sc = scenario()
    proc = sc.start(*UNTIL)
    sc.wait(lambda: stage_pids(sc, "eagle3flow.extract"), 240, "extraction running", proc)
    sc.box.break_unit()
    proc.wait(timeout=400)
    output = sc.logs[-1].read_text()
    watchdog_log = sc.box.state_dir / "watchdog.log"
    sc.wait(lambda: watchdog_log.exists() and "could not be restored; the session is kept" in watchdog_log.read_text(),
            120, "the watchdog to give up")
    session = sc.session()
    command = f"python -m eagle3flow.ops.drain.service restore --state-dir {sc.box.state_dir}"
    kept = session is not None and len(session.get("restore_attempts", [])) >= 3
    named = command in output and command in watchdog_log.read_text()
    sc.box.break_unit(False)
    again = subprocess.run(command.split(), cwd=sc.workdir, env=sc.box.env, capture_output=True, text=True,
                           timeout=120)
    ok, consistent = sc.consistent()
    row = record(scenario="the unit fails to start again", fault_at="every restore after training",
                 unit_healthy=f"no until repaired; then {yes(sc.box.healthy())} via the named command",
                 downtime=sc.downtime(), foreign_killed=sc.foreign_killed(), recomputed=0,
                 consistent=f"session kept with {len(session.get('restore_attempts', [])) if session else 0} "
                            f"failed attempts, then {consistent}",
                 notes=f"run rc={proc.returncode} (training's outputs kept); command named: {yes(named)}")
    assert proc.returncode == 0, output[-3000:]
    assert kept and named, (session, output[-3000:])
    assert again.returncode == 0 and sc.restored(), again.stderr
    assert row["foreign_killed"] == 0 and ok, row


@pytest.mark.slow
def test_stale_session_after_a_reboot(scenario):
    """Power lost mid-drain: at boot systemd started the unit again; the session file, the
    drain flags and Snakemake's lock of the dead run stayed. The next run reconciles the
    session, clears the lock of the dead boot, drains afresh with its own watchdog."""
    from eagle3flow.ops.stale_lock import record_owner

    sc = scenario()
    state = sc.box.state_dir
    state.mkdir(parents=True, exist_ok=True)
    stopped = time.time() - 3600
    previous = {"boot_id": "00000000-previous-boot", "snakemake_pid": 4242, "snakemake_start": 777}
    (state / "session.json").write_text(json.dumps({
        "unit": UNIT, "run_id": "dead-run", "stopped_at": stopped, "stages": ["extract_hidden_states"],
        "ended": [], "was_active": True, **previous, "settings": sc.box.settings(), "watchdog_pid": None}))
    sc.service_dir.mkdir(parents=True, exist_ok=True)
    (sc.service_dir / "drained_for_extract_hidden_states.0.flag").write_text("{}")
    locks = sc.workdir / ".snakemake" / "locks"
    locks.mkdir(parents=True, exist_ok=True)
    (locks / "0.output.lock").write_text("results/hidden_states/train/part-0-of-1.json\n")
    record_owner(sc.workdir, [locks / "0.output.lock"], pid=os.getpid(), run_id="dead-run")
    owners = sc.workdir / ".snakemake" / "eagle3flow" / "lock-owners.json"
    data = json.loads(owners.read_text())
    data["0.output.lock"].update(boot_id=previous["boot_id"], pid=4242, start_ticks=777)
    owners.write_text(json.dumps(data))
    status = subprocess.run([sys.executable, "-m", "eagle3flow.ops.drain.service", "status", "--config-json",
                             json.dumps(sc.box.settings()), "--state-dir", str(state)], env=sc.box.env,
                            capture_output=True, text=True, timeout=60)
    said = json.JSONDecoder().raw_decode(status.stdout)[0]
    result = sc.run(*UNTIL)
    records = sc.box.downtime()
    ok, consistent = sc.consistent()
    row = sc.record(scenario="a stale session after a simulated reboot", fault_at="before the run (previous boot)",
                    recomputed=0, consistent=consistent,
                    notes=f"status: drained={said['drained']}; first record: {records[0]['reason'][:60]}...; "
                          f"run rc={result.returncode}, no --unlock")
    assert said["drained"] is False and "dead" in said["stale_session"]["verdict"], said
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    assert records[0]["reason"].startswith("reconciled:") and records[0]["healthy"], records
    assert records[1]["reason"] == "train_draft was the last GPU stage of the run", records
    assert records[1]["downtime_s"] < time.time() - stopped - 1000, "downtime measured from the old stop"
    assert row["unit_healthy"] == "yes" and row["foreign_killed"] == 0 and ok, row


@pytest.mark.slow
def test_second_snakemake_while_the_first_runs(scenario):
    """A second terminal starts the same command while the first run extracts: its lock is
    respected (the second refuses before any job) and the first completes untouched."""
    sc = scenario()
    first = sc.start(*UNTIL, EAGLE3FLOW_TEST_SHARD_DELAY="2")
    sc.wait(lambda: stage_pids(sc, "eagle3flow.extract"), 240, "extraction running", first)
    locks_before = file_identity((sc.workdir / ".snakemake" / "locks").glob("*.lock"))
    session_before = sc.session()
    second = sc.run(*UNTIL)
    locks_after = file_identity((sc.workdir / ".snakemake" / "locks").glob("*.lock"))
    session_after = sc.session()
    first.wait(timeout=400)
    out = second.stdout + second.stderr
    ok, consistent = sc.consistent()
    row = sc.record(scenario="a second Snakemake started while the first runs", fault_at="extraction of the first",
                    recomputed=0, consistent=consistent,
                    notes=f"second rc={second.returncode} (lock kept: {yes(locks_before == locks_after)}, "
                          f"session untouched: {yes(session_before == session_after)}); first rc={first.returncode}")
    assert second.returncode != 0 and "is alive" in out and "cannot be locked" in out, out[-3000:]
    assert locks_before and locks_before == locks_after and session_before == session_after
    assert first.returncode == 0, sc.tail()
    assert row["unit_healthy"] == "yes" and row["foreign_killed"] == 0 and ok, row


@pytest.mark.slow
def test_foreign_gpu_process_appears_after_the_drain(scenario):
    """While extraction runs, someone starts a job on GPU 3. Training's drain names it and
    fails; it is not killed; the unit comes back once it has gone (the watchdog waits)."""
    sc = scenario()
    proc = sc.start(*UNTIL)
    sc.wait(lambda: stage_pids(sc, "eagle3flow.extract"), 240, "extraction running", proc)
    foreign = sc.box.hold_gpu(3, seconds=25)
    proc.wait(timeout=400)
    drain_log = sc.workdir / "logs" / "drain_service_train_draft_all.log"
    named = drain_log.exists() and f"pid {foreign.pid} " in drain_log.read_text()
    alive_at_failure = foreign.poll() is None
    foreign.wait(timeout=60)
    gone = time.time()
    sc.wait(sc.restored, 120, "the watchdog's restore once the foreign process has gone")
    ok, consistent = sc.consistent()
    row = record(scenario="a foreign GPU process appearing after the drain", fault_at="during extraction (GPU 3)",
                 unit_healthy=yes(sc.box.healthy()), downtime=sc.downtime(),
                 foreign_killed=sc.foreign_killed(foreign),
                 recomputed=0, consistent=consistent,
                 notes=f"training's drain named it: {yes(named)}; run rc={proc.returncode}; restored "
                       f"{sc.box.downtime()[-1]['healthy_at']} after it ended ({time.strftime('%H:%M:%S', time.gmtime(gone))})")
    assert proc.returncode != 0 and named and alive_at_failure and foreign.returncode == 0, sc.tail()
    assert not sc.started_on_busy_gpus(), sc.box.starts()
    assert row["unit_healthy"] == "yes" and row["foreign_killed"] == 0 and ok, row


# ----------------------------------------------------------------------------- streaming

def resolved(sc: Scenario, **extra) -> dict:
    """The config the workflow resolves for this scenario (config.yaml, the profile, the
    tiny config, the schema's defaults)."""
    from snakemake.utils import validate

    from eagle3flow.ops.drain.service import deep_merge

    merged = {}
    for path in (sc.workdir / "config.yaml", sc.workdir / "profiles" / "local-8gpu" / "workflow.yaml", sc.config):
        merged = deep_merge(merged, yaml.safe_load(Path(path).read_text()) or {})
    merged = deep_merge(merged, extra)
    validate(merged, str(REPO / "schemas" / "config.schema.yaml"), set_default=True)
    return merged


def budget_for(sc: Scenario, in_flight: int, partitions: int = 3) -> int:
    """A storage budget under which the plan streams `partitions` with `in_flight` on disk,
    halfway between the smallest such budget and the smallest for one more (the leftovers
    of a killed link must not push the rerun over it)."""
    import copy

    # resolved once: the bisection below only moves storage.max_bytes
    base = resolved(sc, extract={"partitions": partitions}, storage={"max_bytes": 1})

    def flight(budget: int) -> int:
        config = copy.deepcopy(base)
        config["storage"]["max_bytes"] = budget
        plan = plan_lib.project(config, sc.workdir)
        return plan.workload.get("streaming", {}).get("in_flight", partitions if plan.refusal is None else 0)

    def smallest(at_least: int) -> int:
        lo, hi = 1, 10 ** 10
        while lo < hi:
            mid = (lo + hi) // 2
            lo, hi = (lo, mid) if flight(mid) >= at_least else (mid + 1, hi)
        return lo

    budget = (smallest(in_flight) + smallest(in_flight + 1)) // 2
    assert flight(budget) == in_flight
    return budget


# Streaming scenarios: one epoch, fewer steps, shards a partition holds a few of; the
# shards in float32, as the CPU writes them (the plan would take bfloat16 for 8 GPUs).
STREAM_EXTRACT = {"shard_tokens": 2048, "dtype": "float32"}
STREAM_SIZES = {"extract": {"partitions": 3, **STREAM_EXTRACT},
                "train": {"epochs": 1, "batch_tokens": 2048, "checkpoint_every": 2}}


@pytest.mark.slow
def test_streaming_with_drain_killed_mid_chain(scenario, stream_upstream):
    """Streaming partitions behind the drain, two on disk at a time, with
    drain.kill_foreign_gpu_processes on: the extraction of the next link holds the GPUs
    while training's drain runs. That job is the run's own: no drain kills a process of
    the workflow, the bystander lives. The whole run is SIGKILLed while partition 1 trains:
    the watchdog restores; the rerun goes on without extracting a consumed partition
    again, and its drains kill nothing of it either."""
    sc = scenario(upstream=stream_upstream, **STREAM_UPSTREAM, train=STREAM_SIZES["train"], extract=STREAM_EXTRACT)
    budget = budget_for(sc, in_flight=2, partitions=4)
    sc = scenario(upstream=stream_upstream, **STREAM_UPSTREAM, train=STREAM_SIZES["train"],
                  extract={**STREAM_EXTRACT, "partitions": 4}, storage={"max_bytes": budget, "sample_interval_s": 0.2},
                  drain={"kill_foreign_gpu_processes": True})
    proc = sc.start(*TRAINED, EAGLE3FLOW_TEST_STEP_DELAY="1", EAGLE3FLOW_TEST_SHARD_DELAY="0.5")
    consumed0 = sc.workdir / "results" / "streaming" / "consumed-0.json"
    sc.wait(lambda: consumed0.exists() and stage_pids(sc, "eagle3flow.train.trainer"), 400, "partition 1 training", proc)
    extract0 = sc.workdir / "logs" / "extract_partition_0_0.log"
    stamp = extract0.stat().st_mtime_ns
    checkpoints = sc.checkpoints()
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    sc.wait_restored("the watchdog's restore")
    killed_run = sc.logs[-1].read_text()
    rerun = sc.run(*TRAINED, EAGLE3FLOW_TEST_SHARD_DELAY="0.5")
    jobs = plan_lib.parse_job_stats(rerun.stdout + rerun.stderr)
    ok, consistent = sc.consistent()
    again = int(extract0.stat().st_mtime_ns != stamp)
    logs = {p.name: p.read_text() for p in (sc.workdir / "logs").glob("drain_service_*.log")}
    killed = [name for name, text in logs.items() if "killing foreign GPU process" in text]
    registered = [name for name, text in logs.items() if "registered" in text]
    overlapped = [name for name, text in logs.items() if "hold the GPUs now; not foreign" in text]
    row = sc.record(scenario="streaming with drain, killed mid-chain", fault_at="train_partition 1 (partition 0 consumed)",
                    recomputed=again + rewritten(checkpoints, sc.checkpoints()), consistent=consistent,
                    notes=f"rerun rc={rerun.returncode}, jobs {jobs.get('extract_partition')} extraction(s), "
                          f"{jobs.get('train_partition', 0) + jobs.get('train_partition_last', 0)} training link(s)")
    row_kill = sc.record(scenario="kill_foreign_gpu_processes: true, streaming with 2 partitions in flight",
                         fault_at="drains while the run's own GPU jobs run",
                         recomputed=0, consistent=consistent,
                         notes=f"run killed mid-chain and rerun (rc={rerun.returncode}); workflow processes killed: "
                               f"{len(killed)}; {len(registered)} drain(s) joined the run's drain, "
                               f"{len(overlapped)} while its own GPU job held the GPUs")
    assert rerun.returncode == 0, (rerun.stdout + rerun.stderr)[-5000:]
    assert "at most 2 on disk at a time" in killed_run, killed_run[-3000:]
    # partition 1 (if its extraction was unfinished), 2 (if so) and 3: never the consumed 0
    assert 1 <= jobs.get("extract_partition", 0) <= 3, jobs
    assert not killed, (logs, (rerun.stdout + rerun.stderr)[-3000:])
    for r in (row, row_kill):
        assert r["unit_healthy"] == "yes" and r["foreign_killed"] == 0 and r["recomputed"] == 0 and ok, r


# ----------------------------------------------------------------------------- dry runs

PROFILES = ["embedded", "embedded-regenerate", "local-8gpu", "b200-slurm", "smollm2"]
VARIANTS = ["plain", "streaming under a budget", "regenerate", "partitions > 1"]
GPU_RULES = ("extract_hidden_states", "extract_partition", "train_draft", "train_partition",
             "train_partition_last", "evaluate_draft")


@pytest.fixture(scope="module")
def dry_workdir(tmp_path_factory):
    return workflow_copy(tmp_path_factory.mktemp("dry") / "wf")


def variant_config(workdir: Path, profile: str, variant: str) -> dict:
    extra: dict = {}
    if variant == "streaming under a budget":
        extra = {"extract": {"partitions": 4, "shard_tokens": 2048}}
        base = yaml.safe_load((workdir / "profiles" / profile / "workflow.yaml").read_text()) or {}
        from snakemake.utils import validate

        from eagle3flow.ops.drain.service import deep_merge
        cfg = deep_merge(deep_merge(yaml.safe_load((workdir / "config.yaml").read_text()), base), extra)
        if profile == "embedded-regenerate":
            cfg = deep_merge(cfg, yaml.safe_load((workdir / "profiles" / "embedded" / "workflow.yaml").read_text()))
            cfg = deep_merge(cfg, base)
            cfg = deep_merge(cfg, extra)
        validate(cfg, str(REPO / "schemas" / "config.schema.yaml"), set_default=True)
        plan = plan_lib.project(cfg, workdir)
        extract = next(s.bytes for s in plan.stages if s.name == "extract")
        extra["storage"] = {"max_bytes": int(plan.peak_bytes - extract * 0.6)}
    elif variant == "regenerate":
        extra = {"regenerate": {"enabled": True, "max_tokens": 64}}
    elif variant == "partitions > 1":
        extra = {"extract": {"partitions": 3}}
    return extra


def gpu_job_requests(stdout: str) -> list[tuple[str, str]]:
    """(rule, resources line) of every GPU job in a dry run's output."""
    out = []
    for block in stdout.split("\nrule ")[1:]:
        rule = block.split(":", 1)[0].strip()
        if rule in GPU_RULES:
            line = next((l for l in block.splitlines() if l.strip().startswith("resources:")), "")
            out.append((rule, line))
    return out


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("profile", PROFILES)
def test_dry_run_matrix(dry_workdir, profile, variant):
    extra = variant_config(dry_workdir, profile, variant)
    if profile == "local-8gpu":
        extra["drain"] = {"unit": "vllm.service"}   # the operator's setting; unset is refused
    configfiles = [f"profiles/{p}/workflow.yaml" for p in
                   (["embedded", "embedded-regenerate"] if profile == "embedded-regenerate" else [profile])]
    extra_file = dry_workdir / f"extra-{profile}-{variant.replace(' ', '_').replace('>', 'gt')}.json"
    extra_file.write_text(json.dumps(extra))
    result = snakemake(dry_workdir, "-n", "--profile", f"profiles/{profile}", "--configfile", *configfiles,
                       str(extra_file), timeout=300)
    out = result.stdout + result.stderr
    jobs = plan_lib.parse_job_stats(result.stdout)
    requests = gpu_job_requests(result.stdout)
    if profile == "b200-slurm":
        asking = [r for r, line in requests if "gpu=8" in line and "slurm_partition=gpu" in line]
        verdict = f"{len(asking)}/{len(requests)}"
    elif profile == "local-8gpu":
        asking = [r for r, line in requests if "gpus=8" in line]
        verdict = f"{len(asking)}/{len(requests)} (gpus=8)"
    else:
        asking, verdict = [], "- (CPU)"
    record(DRY_RUNS, profile=profile, variant=variant, builds=result.returncode == 0, jobs=sum(jobs.values()),
           gpu_requests=verdict)
    assert result.returncode == 0, out[-4000:]
    if variant == "streaming under a budget":
        assert "extract_partition" in jobs and "train_partition_last" in jobs, jobs
    if profile in ("b200-slurm", "local-8gpu"):
        assert requests and len(asking) == len(requests), requests


def snapshot(workdir: Path) -> dict:
    out = {}
    for top in ("results", "cache", "logs", ".snakemake/locks", ".snakemake/eagle3flow"):
        for p in sorted((workdir / top).rglob("*")) if (workdir / top).exists() else []:
            st = p.stat()
            out[str(p.relative_to(workdir))] = (st.st_mtime_ns, st.st_size) if p.is_file() else "dir"
    return out


def test_dry_runs_change_nothing(tmp_path):
    """-n, --lint, --dag, --summary, a second terminal: no lock removed (even a dead run's),
    no drain flag, session or plan touched, nothing written under results/ or cache/."""
    from eagle3flow.ops.stale_lock import record_owner

    workdir = workflow_copy(tmp_path / "wf")
    service = workdir / "results" / "service"
    service.mkdir(parents=True)
    (service / "drained_for_extract_hidden_states.0.flag").write_text("{}")
    (service / "session.json").write_text(json.dumps({"unit": UNIT, "stopped_at": 1.0, "stages": [],
                                                      "snakemake_pid": 4242, "snakemake_start": 1,
                                                      "boot_id": "another-boot"}))
    locks = workdir / ".snakemake" / "locks"
    locks.mkdir(parents=True)
    (locks / "0.output.lock").write_text("results/x\n")
    dead = subprocess.Popen(["true"])
    dead.wait()
    record_owner(workdir, [locks / "0.output.lock"], pid=os.getpid())
    owners = workdir / ".snakemake" / "eagle3flow" / "lock-owners.json"
    data = json.loads(owners.read_text())
    data["0.output.lock"].update(pid=dead.pid, start_ticks=1)
    owners.write_text(json.dumps(data))
    before = snapshot(workdir)
    for args in (["-n"], ["--lint"], ["--dag"], ["--summary"]):
        result = snakemake(workdir, *args, "--profile", "profiles/local-8gpu",
                           "--config", "drain={unit: vllm.service}", timeout=300)
        assert snapshot(workdir) == before, (args, result.stdout[-2000:], result.stderr[-2000:])
    assert (locks / "0.output.lock").exists() and (service / "drained_for_extract_hidden_states.0.flag").exists()
