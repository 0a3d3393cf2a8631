"""One fake production node for the drain tests: a fake vLLM unit that holds fake GPUs,
and the stand-in tools (tests/fixtures/service: systemctl, nvidia-smi) on PATH.

systemd and GPUs cannot run here: `systemctl` runs each unit as a real process group (a
small HTTP server with /health whose worker child "holds" every fake GPU, and which, like
vLLM, fails to start on GPUs another process holds) and exposes its pids as a
cgroup.procs file; `nvidia-smi` reports which live pid holds which fake GPU (the
workflow's own extraction/training/evaluation processes hold the devices they see).
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from eagle3flow.serving.vllm_server import free_port
from support.processes import alive, live_session_members
from support.workflow import BIN

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures" / "service"
UNIT = "fake-vllm.service"
NUM_GPUS = 8
# The workflow's stage programs that hold the fake GPUs they see (fixtures/service/nvidia-smi).
GPU_PROGRAMS = "eagle3flow.extract:eagle3flow.train.trainer:eagle3flow.eval.evaluate"


class FakeBox:
    """One node: a fake vLLM unit holding NUM_GPUS fake GPUs, and the stand-in tools.

    ``server(port)``: the command of a real server the unit runs as its GPU-holding
    worker instead of the stand-in's sleeping one (fixtures/service/fake_vllm.py ``--``),
    listening on ``port``, where the drain's health URL points: e.g. vLLM serving a test
    target, which the workflow's regenerate stage then asks as it asks production."""

    def __init__(self, root: Path, ignore_sigterm: bool = False, server=None):
        self.root = root
        self.systemd, self.gpus = root / "systemd", root / "gpus"
        (self.systemd / "units").mkdir(parents=True)
        self.gpus.mkdir()
        (self.gpus / "count").write_text(str(NUM_GPUS))
        self.port = free_port()
        command = [sys.executable, str(FIXTURES / "fake_vllm.py"), "--port", str(self.port),
                   "--gpu-dir", str(self.gpus), "--gpus", str(NUM_GPUS), "--startup-s", "0.3",
                   "--broken-if", str(root / "unit-broken")]
        if ignore_sigterm:
            command.append("--ignore-sigterm")
        if server is not None:
            command += ["--", *server(self.port)]
        unit = {"exec": command,
                "stop_wait_s": 1 if ignore_sigterm else 10, "kill_after_stop_wait": not ignore_sigterm}
        (self.systemd / "units" / f"{UNIT}.json").write_text(json.dumps(unit))
        self.env = {**os.environ, "FAKE_SYSTEMD_DIR": str(self.systemd), "FAKE_GPU_DIR": str(self.gpus),
                    "PATH": f"{FIXTURES}{os.pathsep}{BIN}{os.pathsep}{os.environ['PATH']}",
                    "FAKE_GPU_PROGRAMS": GPU_PROGRAMS, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
        self.env.pop("EAGLE3FLOW_RUN", None)
        # The host's drain state (drain.state_dir) and the unit's folder in it.
        self.state_root = root / "drain-state"
        self.state_dir = self.state_root / UNIT
        self.others: list[subprocess.Popen] = []

    def settings(self, **overrides) -> dict:
        # check_gpu_environment off: the stand-in GPUs are driven by the CPU torch on purpose
        # (the tests that turn it on show that a real box in that state is refused).
        return {"enabled": True, "unit": UNIT, "health_url": f"http://127.0.0.1:{self.port}/health",
                "state_dir": str(self.state_root), "cgroup_root": str(self.systemd / "cgroup"), "stop_timeout_s": 3,
                "gpu_release_timeout_s": 3, "health_timeout_s": 20, "poll_interval_s": 0.1,
                "watchdog_poll_s": 0.3, "check_gpu_environment": False, **overrides}

    def systemctl(self, *args: str) -> subprocess.CompletedProcess:
        return subprocess.run([str(FIXTURES / "systemctl"), *args], env=self.env, capture_output=True, text=True)

    def service(self, *args: str, run_env: dict | None = None, cwd: Path | None = None,
                **overrides) -> subprocess.CompletedProcess:
        """``python -m eagle3flow.ops.drain.service ARGS`` as a rule runs it (in ``cwd``)."""
        return subprocess.run([sys.executable, "-m", "eagle3flow.ops.drain.service", *args,
                               "--config-json", json.dumps(self.settings(**overrides))],
                              env={**self.env, **(run_env or {})}, capture_output=True, text=True, timeout=120,
                              cwd=cwd)

    def live_run(self, stages: list[str], service_dir: Path | None = None) -> dict:
        """A live process standing for a run's Snakemake main process, registered with the
        unit as onstart registers it (its results in ``service_dir``); returns the
        environment its jobs get (its run token)."""
        from eagle3flow.ops.drain.state import write_plan

        run = subprocess.Popen(["sleep", "300"])
        self.others.append(run)
        plan = write_plan(self.settings(), str(service_dir or self.root / "results" / "service"), stages, run.pid)
        return {"EAGLE3FLOW_RUN": plan["run_id"]}

    def session(self) -> dict | None:
        path = self.state_dir / "session.json"
        return json.loads(path.read_text()) if path.exists() else None

    def watchdogs(self) -> list[int]:
        """The watchdogs of the runs in the open session."""
        return [entry["watchdog_pid"] for entry in (self.session() or {}).get("runs", {}).values()
                if entry.get("watchdog_pid")]

    def start_unit(self, timeout: float = 20) -> None:
        assert self.systemctl("start", UNIT).returncode == 0
        assert self.wait_healthy(timeout), "the fake unit did not come up: " + self.unit_log()[-3000:]

    def unit_log(self) -> str:
        """What the unit's processes wrote (every start appends)."""
        log = self.systemd / "run" / f"{UNIT}.log"
        return log.read_text(errors="replace") if log.exists() else ""

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

    def starts(self) -> list[dict]:
        """Every `systemctl start`, with the GPU holders at that moment."""
        log = self.systemd / "starts.log"
        return [json.loads(l) for l in log.read_text().splitlines()] if log.exists() else []

    def break_unit(self, broken: bool = True) -> None:
        """The unit's next start fails (like vLLM that cannot load) until repaired."""
        flag = self.root / "unit-broken"
        flag.touch() if broken else flag.unlink(missing_ok=True)

    def break_nvidia_smi(self, broken: bool = True) -> None:
        """nvidia-smi fails (NVML's "Unknown Error", exit 9) until repaired."""
        flag = self.gpus / "broken"
        flag.touch() if broken else flag.unlink(missing_ok=True)

    def hang_nvidia_smi(self, hanging: bool = True) -> None:
        """nvidia-smi hangs (a driver stuck after an Xid error) until released."""
        flag = self.gpus / "hang"
        flag.touch() if hanging else flag.unlink(missing_ok=True)

    def hang_systemctl(self, verb: str, hanging: bool = True) -> None:
        """`systemctl <verb>` hangs (a systemd that does not answer) until released."""
        flag = self.systemd / f"hang-{verb}"
        flag.touch() if hanging else flag.unlink(missing_ok=True)

    def downtime(self) -> list[dict]:
        path = self.state_dir / "downtime.json"
        return json.loads(path.read_text()) if path.exists() else []

    def hold_gpu(self, index: int | list[int], seconds: float = 300, env: dict | None = None,
                 args: tuple[str, ...] = ()) -> subprocess.Popen:
        """A process outside the unit with a context on fake GPU(s) `index` for `seconds`
        (a foreign one, or with a run's `env` one of that run's jobs), `args` on its command line."""
        proc = subprocess.Popen(["sleep", str(seconds), *args] if not args else
                                [sys.executable, "-c", f"import time; time.sleep({seconds})", *args],
                                start_new_session=True, env={**self.env, **(env or {})})
        self.others.append(proc)
        for i in [index] if isinstance(index, int) else index:
            (self.gpus / str(i)).mkdir(exist_ok=True)
            (self.gpus / str(i) / str(proc.pid)).write_text("1200")
        return proc

    def close(self) -> None:
        # Only what this test started: watchdogs still waiting, the unit's group, helpers.
        for watchdog in self.watchdogs():
            if alive(watchdog):
                os.kill(watchdog, signal.SIGKILL)
        pgid_file = self.systemd / "run" / f"{UNIT}.pgid"
        if pgid_file.exists() and self.unit_pids():
            os.killpg(int(pgid_file.read_text()), signal.SIGKILL)
        for proc in self.others:
            if proc.poll() is None:
                proc.kill()
            proc.wait()


# ----------------------------------------------------------------------------- the workflow on it

def tiny_config(box: FakeBox, path: Path, **drain) -> Path:
    """A config file for a minutes-long embedded run, draining ``box`` (``drain`` overrides)."""
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
    """The local-8gpu profile (resources.gpus=8: every GPU stage drains) with ``config`` on top."""
    return ["--profile", str(workdir / "profiles" / "local-8gpu"), "--cores", "2",
            "--configfile", str(workdir / "profiles" / "local-8gpu" / "workflow.yaml"), str(config)]


def run_snakemake(box: FakeBox, workdir: Path, *args: str, timeout: float = 300,
                  **env) -> subprocess.CompletedProcess:
    """Snakemake in ``workdir`` with the box's stand-in tools on PATH."""
    return subprocess.run([str(BIN / "snakemake"), *args], cwd=workdir, env={**box.env, **env},
                          capture_output=True, text=True, timeout=timeout)
