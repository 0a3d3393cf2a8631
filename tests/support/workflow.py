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

from eagle3flow.ops.plan.throughput import benchmark_seconds

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


# ----------------------------------------------------------------------------- the embedded run

# The embedded default (`--profile embedded`) at the size CI affords: a part of the
# corpus, one epoch of small batches (many steps: the draft learns from few tokens),
# shards small enough that a kill lands between finished ones; the disk sampler often.
# A checkpoint every 15 of the ~200 steps: the kills need only the first one, and each
# checkpoint runs training's evaluation (every 3 steps made training ~1.6x slower).
# `make demo` runs the profile at its full size; what the run does is the same.
EMBEDDED_CI_SIZES = {
    "dataset": {"max_samples": 1200},
    "extract": {"shard_tokens": 4096},
    "train": {"epochs": 1, "batch_tokens": 1024, "checkpoint_every": 15, "log_every": 5},
    "evaluate": {"num_prompts": 32},
    "storage": {"sample_interval_s": 0.2},
}


def embedded_args(config: Path) -> list[str]:
    """The README's `--profile embedded` with ``config`` on top (options after the targets:
    --configfile takes every word after it)."""
    return ["--profile", "profiles/embedded", "--configfile", "profiles/embedded/workflow.yaml", str(config)]


def embedded_config(path: Path, **extra) -> Path:
    """EMBEDDED_CI_SIZES with ``extra`` sections merged over them, as a config file."""
    config = json.loads(json.dumps(EMBEDDED_CI_SIZES))
    for key, value in extra.items():
        config.setdefault(key, {}).update(value)
    path.write_text(json.dumps(config))
    return path


def file_identity(paths) -> dict:
    return {str(p): (p.stat().st_ino, p.stat().st_mtime_ns) for p in paths}


def run_embedded_with_kills(build: Path, root: Path) -> dict:
    """The embedded workflow from the dataset on (the target: the session's build, made by
    the rule's own code), SIGKILLed once during extraction (after its first shard) and
    once during training (after its first checkpoint), then rerun to the end. What the
    end-to-end test checks, and the unbudgeted run the streaming tests compare with."""
    workdir = workflow_copy(root / "wf")
    place_embedded(build, workdir)
    args = embedded_args(embedded_config(root / "ci.json"))
    shard_glob = lambda: sorted((workdir / "cache" / "hidden_states").glob("*/shard-*.safetensors"))  # noqa: E731
    checkpoint_glob = lambda: sorted((workdir / "cache" / "train").glob("*/step-*/state.pt"))  # noqa: E731

    log1 = root / "run1.log"
    proc = start_snakemake(workdir, *args, log=log1, EAGLE3FLOW_TEST_SHARD_DELAY="3")
    kill_when(proc, lambda: len(shard_glob()) >= 1, 1200, "the first hidden-state shard", log1)
    finished_shards = file_identity(shard_glob())

    log2 = root / "run2.log"
    proc = start_snakemake(workdir, *args, log=log2)
    kill_when(proc, lambda: len(checkpoint_glob()) >= 1, 1200, "the first training checkpoint", log2)
    shards_after_second_run = file_identity([Path(p) for p in finished_shards])
    checkpoints_before = [p.parent.name for p in checkpoint_glob()]

    result = snakemake(workdir, *args, timeout=1800)
    return {"workdir": workdir, "args": args, "result": result, "finished_shards": finished_shards,
            "shards_after_second_run": shards_after_second_run, "checkpoints_before": checkpoints_before,
            # this run's measured peak, before a later run's sampler rewrites it
            "peak_bytes": measured_peak(workdir) if result.returncode == 0 else None}


def measured_peak(workdir: Path) -> int:
    """The peak of the last run's disk sampler, once it has seen the run end."""
    path = workdir / "results" / "plan" / "disk_peak.json"
    until = time.monotonic() + 30
    while time.monotonic() < until:
        data = json.loads(path.read_text())
        if data.get("finished") or "projected_peak_bytes" in data:
            return int(data["peak_bytes"])
        time.sleep(0.2)
    pytest.fail(f"{path}: the disk sampler did not finish")


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
