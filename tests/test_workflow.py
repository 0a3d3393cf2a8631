"""The whole workflow, run for real by Snakemake on the embedded default.

The end-to-end test runs the README's command (`snakemake --profile embedded`) in
a copy of the workflow, SIGKILLs it once during extraction and once during
training, reruns it, and checks that no finished shard was recomputed, that
training resumed from its checkpoint, and that vLLM speculates with the draft.
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

REPO = Path(__file__).resolve().parent.parent
WORKFLOW_FILES = ["Snakefile", "config.yaml", "rules", "schemas", "profiles", "envs", "report"]
BIN = Path(sys.executable).parent


def workflow_copy(dest: Path) -> Path:
    dest.mkdir(parents=True, exist_ok=True)
    for name in WORKFLOW_FILES:
        src = REPO / name
        if src.is_dir():
            shutil.copytree(src, dest / name)
        else:
            shutil.copy2(src, dest / name)
    return dest


def snakemake_env(**extra) -> dict:
    env = dict(os.environ)
    env["PATH"] = f"{BIN}{os.pathsep}{env.get('PATH', '')}"
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.update(extra)
    return env


def snakemake(workdir: Path, *args: str, timeout: float = 1800, **env) -> subprocess.CompletedProcess:
    return subprocess.run([str(BIN / "snakemake"), *args], cwd=workdir, env=snakemake_env(**env),
                          capture_output=True, text=True, timeout=timeout)


def start_snakemake(workdir: Path, *args: str, log: Path, **env) -> subprocess.Popen:
    out = open(log, "w")
    return subprocess.Popen([str(BIN / "snakemake"), *args], cwd=workdir, env=snakemake_env(**env),
                            stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


def kill_when(proc: subprocess.Popen, ready, timeout: float, what: str, log: Path) -> None:
    """SIGKILL the whole Snakemake process group (we started it) once ready() holds."""
    deadline = time.monotonic() + timeout
    while not ready():
        if proc.poll() is not None:
            pytest.fail(f"workflow ended (rc={proc.returncode}) before {what}:\n{log.read_text()[-4000:]}")
        if time.monotonic() > deadline:
            os.killpg(proc.pid, signal.SIGKILL)
            pytest.fail(f"timed out waiting for {what}:\n{log.read_text()[-4000:]}")
        time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def file_identity(paths) -> dict:
    return {str(p): (p.stat().st_ino, p.stat().st_mtime_ns) for p in paths}


def test_profiles_resolve_from_repo_root():
    """`snakemake --profile local-8gpu` works as typed from the repo root (dry run)."""
    for profile in ("local-8gpu", "embedded"):
        result = snakemake(REPO, "-n", "--profile", profile, "--forceall", timeout=300)
        assert result.returncode == 0, result.stdout + result.stderr
        assert f"Using profile {profile}" in result.stdout + result.stderr
        assert "extract_hidden_states" in result.stdout


def test_local_8gpu_gives_gpu_stages_all_gpus(tmp_path):
    workdir = workflow_copy(tmp_path / "wf")
    result = snakemake(workdir, "-n", "--profile", "local-8gpu", timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    blocks = result.stdout.split("\nrule ")
    gpu_rules = {b.split(":")[0]: b for b in blocks if "gpus=8" in b}
    assert set(gpu_rules) == {"extract_hidden_states", "train_draft", "evaluate_draft"}, list(gpu_rules)


def test_lint_is_clean():
    result = snakemake(REPO, "--lint", timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "Congratulations" in result.stdout + result.stderr


def place_embedded(build: Path, workdir: Path) -> None:
    """The session's embedded build as this workflow's (Snakemake then does not rebuild it)."""
    dest = workdir / "results" / "embedded"
    dest.mkdir(parents=True)
    shutil.copytree(build / "target", dest / "target")
    for name in ("conversations.jsonl", "build_stats.json"):
        shutil.copy2(build / name, dest / name)


@pytest.mark.slow
def test_embedded_default_end_to_end_with_kills(embedded_default_build, tmp_path):
    """The embedded default from the dataset on (the target build is the session's, made
    by the same code; the rule itself runs in tests/test_slurm.py), killed twice."""
    workdir = workflow_copy(tmp_path / "wf")
    place_embedded(embedded_default_build, workdir)
    shard_glob = lambda: sorted((workdir / "cache" / "hidden_states").glob("*/shard-*.safetensors"))
    checkpoint_glob = lambda: sorted((workdir / "cache" / "train").glob("*/step-*/state.pt"))

    # 1. Killed during extraction, once the first shard is complete.
    log1 = tmp_path / "run1.log"
    proc = start_snakemake(workdir, "--profile", "embedded", log=log1,
                           EAGLE3FLOW_TEST_SHARD_DELAY="3")
    kill_when(proc, lambda: len(shard_glob()) >= 1, 1200, "the first hidden-state shard", log1)
    finished_shards = file_identity(shard_glob())
    assert finished_shards

    # 2. Rerun, killed during training once a checkpoint exists.
    log2 = tmp_path / "run2.log"
    proc = start_snakemake(workdir, "--profile", "embedded", log=log2)
    kill_when(proc, lambda: len(checkpoint_glob()) >= 1, 1200, "the first training checkpoint", log2)
    assert file_identity(finished_shards_paths := [Path(p) for p in finished_shards]) == finished_shards
    checkpoints_before = [p.parent.name for p in checkpoint_glob()]

    # 3. Rerun to the end.
    result = snakemake(workdir, "--profile", "embedded", timeout=1800)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-6000:]
    assert file_identity(finished_shards_paths) == finished_shards, "a finished shard was recomputed"
    train_log = (workdir / "logs" / "train_draft.log").read_text()
    resumed_step = int(checkpoints_before[-1].split("-")[-1])
    assert f"resuming from" in train_log and f"(step {resumed_step}/" in train_log, train_log[-3000:]
    assert "draft:" in output and "summary:" in output  # where the results are

    summary = json.loads((workdir / "results" / "eval" / "summary.json").read_text())
    assert summary["lossless"]["passed"] is True, summary["lossless"]
    vllm_al = summary["vllm"]["acceptance_length"]
    assert vllm_al >= 1.5, summary["vllm"]
    simulated_al = summary["simulated"]["acceptance_length"]
    assert abs(simulated_al - vllm_al) / vllm_al <= 0.15, (simulated_al, vllm_al)

    # 4. A finished workflow reruns nothing.
    result = snakemake(workdir, "--profile", "embedded", "-n", timeout=300)
    assert "Nothing to be done" in result.stdout + result.stderr, result.stdout

    # 5. The report: one self-contained HTML with every figure, rendered in Chromium.
    from report_checks import check_embedded_report
    check_embedded_report(workdir, tmp_path / "chromium", BIN / "snakemake", env=snakemake_env())
