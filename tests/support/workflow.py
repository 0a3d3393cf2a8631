"""The workflow run for real in tests: a copy of it in a temporary directory, and Snakemake
(this environment's) started in that copy, waited for or killed at a chosen moment."""
from __future__ import annotations

import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pytest

from eagle3flow.ops.plan_throughput import benchmark_seconds

REPO = Path(__file__).resolve().parent.parent.parent
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
    """Run Snakemake to its end. Past ``timeout`` its whole process group is killed (a
    vLLM server it started would otherwise go on taking a test worker's core) and the
    test fails with the time each finished job took and the end of the output."""
    proc = subprocess.Popen([str(BIN / "snakemake"), *args], cwd=workdir, env=snakemake_env(**env),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        pytest.fail(f"snakemake {' '.join(args)} ran past {timeout:.0f} s; finished jobs (wall s): "
                    f"{finished_job_seconds(workdir)}\n{(stdout + stderr)[-4000:]}")
    return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)


def finished_job_seconds(workdir: Path) -> dict[str, float | None]:
    """Each finished job's wall time from its ``benchmark:`` file (results/benchmarks/)."""
    return {tsv.stem: benchmark_seconds(tsv) for tsv in sorted((workdir / "results" / "benchmarks").glob("*.tsv"))}


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


def place_embedded(build: Path, workdir: Path) -> None:
    """The session's embedded build as this workflow's (Snakemake then does not rebuild it)."""
    dest = workdir / "results" / "embedded"
    dest.mkdir(parents=True)
    shutil.copytree(build / "target", dest / "target")
    for name in ("conversations.jsonl", "build_stats.json"):
        shutil.copy2(build / name, dest / name)


# ----------------------------------------------------------------------------- its results

def greedy_answers(results: Path, prompt_set: str = "eval") -> list[list[int]]:
    """The target's greedy answers to a prompt set in an evaluation (its vLLM baseline run)."""
    baseline = json.loads((results / "eval" / "vllm_baseline.json").read_text())
    outputs = next(s for s in baseline["sets"] if s["name"] == prompt_set)["outputs"]
    return [list(o["output_token_ids"]) for o in outputs]


def answers_matching_evaluation(results: Path) -> tuple[int, int]:
    """(eval prompts whose regenerated first answer opens with the target's greedy answer
    in the evaluation's vLLM baseline run, eval prompts): text compared, so that
    retokenizing the answer cannot differ."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(results / "pretrained" / "target")
    with open(results / "regenerate" / "responses.jsonl") as f:
        answers = {row["id"]: next(m["content"] for m in row["messages"] if m["role"] == "assistant")
                   for row in map(json.loads, f)}
    baseline = json.loads((results / "eval" / "vllm_baseline.json").read_text())
    outputs = next(s for s in baseline["sets"] if s["name"] == "eval")["outputs"]
    same = sum(answers[o["id"]].strip().startswith(
        # a cut multi-byte character decodes as U+FFFD
        tok.decode(o["output_token_ids"], skip_special_tokens=True).strip().rstrip("\ufffd")) for o in outputs)
    return same, len(outputs)


def answer_diversity(answers: list[list[int]]) -> tuple[float, float]:
    """(fraction of answers that no other answer equals, median answer length in tokens)."""
    counts: dict[tuple, int] = {}
    for a in answers:
        counts[tuple(a)] = counts.get(tuple(a), 0) + 1
    unique = sum(1 for a in answers if counts[tuple(a)] == 1)
    return unique / len(answers), statistics.median(len(a) for a in answers)
