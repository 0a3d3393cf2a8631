"""``snakemake --profile profiles/embedded`` end to end on CUDA (a path: no ``make setup``
links the profiles on a GPU machine), and the evaluation of its trained draft: vLLM's counters, the replay's agreement with them, and losslessness as
eagle3flow/eval/agreement.py defines it (near-ties of the target's logits apart)."""
from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from eagle3flow.ops.drain.gpu_env import vllm_range_problem
from support.workflow import finished_job_seconds, place_embedded, workflow_copy


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = tmp_path_factory.mktemp("gpu_workflow")
    workdir = workflow_copy(root / "wf")
    # EAGLE3FLOW_EMBEDDED_DIR: an embedded build made beforehand by the same code (a CPU
    # job, minutes), as tests/conftest.py's embedded_default_build reuses one; the rule
    # itself then does not run.
    prebuilt = os.environ.get("EAGLE3FLOW_EMBEDDED_DIR")
    if prebuilt:
        place_embedded(Path(prebuilt), workdir)
    # The rules run `python -m ...`: this interpreter, whatever the machine calls python. A
    # script, not a symlink: a venv's python reached through a link elsewhere finds no
    # pyvenv.cfg beside it and runs without the venv's packages.
    bin_dir = root / "bin"
    bin_dir.mkdir()
    (bin_dir / "python").write_text(f'#!/bin/sh\nexec {shlex.quote(sys.executable)} "$@"\n')
    (bin_dir / "python").chmod(0o755)
    snakemake = shutil.which("snakemake")
    assert snakemake, "snakemake is not on PATH"
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "HF_HUB_OFFLINE": "1",
           "TRANSFORMERS_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
    t0 = time.monotonic()
    proc = subprocess.Popen([snakemake, "--profile", "profiles/embedded"], cwd=workdir, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=530)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        pytest.fail(f"ran past 530 s; finished jobs: {finished_job_seconds(workdir)}\n{output[-4000:]}")
    return {"workdir": workdir, "rc": proc.returncode, "output": output, "seconds": time.monotonic() - t0,
            "prebuilt": prebuilt}


def test_embedded_workflow_runs_every_gpu_stage_on_cuda(run, record_property):
    workdir = run["workdir"]
    record_property("workflow_s", round(run["seconds"], 1))
    record_property("embedded_target", f"prebuilt: {run['prebuilt']}" if run["prebuilt"] else "built by the rule")
    jobs = finished_job_seconds(workdir)
    record_property("job_s", {name: round(s, 1) for name, s in jobs.items() if s is not None})
    print(f"snakemake --profile embedded: {run['seconds']:.0f} s; jobs (s): {jobs}")
    assert run["rc"] == 0, run["output"][-6000:]
    logs = {p.name: p.read_text(errors="replace") for p in (workdir / "logs").rglob("*.log")}
    extract_logs = [text for name, text in logs.items() if name.startswith("extract_hidden_states")]
    assert extract_logs and all("(bfloat16 on cuda" in text for text in extract_logs), list(logs)
    assert "on cuda" in logs["train_draft.log"], logs["train_draft.log"][-2000:]
    summary = json.loads((workdir / "results" / "eval" / "summary.json").read_text())
    settings = summary["settings"]
    assert settings["device"] == "cuda" and settings["replay_device"] == "cuda", settings
    assert settings["dtype"] == "bfloat16"
    assert vllm_range_problem(settings["vllm_version"]) is None


def test_trained_draft_evaluation_on_cuda(run, record_property):
    if run["rc"] != 0:
        pytest.fail("the workflow failed (test above)")
    summary = json.loads((run["workdir"] / "results" / "eval" / "summary.json").read_text())
    k = summary["settings"]["num_speculative_tokens"]
    v, lossless = summary["vllm"], summary["lossless"]
    record_property("vllm_acceptance_length", v["acceptance_length"])
    record_property("replay_acceptance_length", summary["simulated"]["acceptance_length"])
    record_property("agreement", summary["agreement"])
    record_property("round_agreement", summary["round_agreement"])
    record_property("lossless", {key: lossless[key] for key in
                                 ("passed", "identical", "num_prompts", "num_near_ties", "num_real_mismatches",
                                  "divergences")})
    record_property("tokens_per_s", {"baseline": v["baseline_output_tokens_per_s"],
                                     "eagle3": v["eagle3_output_tokens_per_s"], "speedup": v["speedup"]})
    print(json.dumps({"vllm": v, "simulated": summary["simulated"], "agreement": summary["agreement"],
                      "round_agreement": summary["round_agreement"], "lossless": lossless}, indent=1))
    # vLLM's counters: every verify step drafts K tokens; acceptance from them alone.
    assert v["num_draft_tokens"] == k * v["num_drafts"] > 0
    assert v["acceptance_length"] == pytest.approx(1 + v["num_accepted_tokens"] / v["num_drafts"])
    assert sum(v["num_accepted_tokens_per_pos"]) == v["num_accepted_tokens"]
    assert v["acceptance_length"] >= 1.5, v
    # The replay on vLLM's own outputs agrees with vLLM within the stated tolerance.
    assert summary["agreement_ok"], (summary["agreement"], summary["agreement_tolerance"])
    # Losslessness: no real mismatch; near-ties are measured and listed, each judged.
    assert lossless["judged"] and lossless["dtype"] == "bfloat16"
    assert lossless["passed"], lossless
    assert set(lossless["divergences"]) == set(lossless["near_tie_ids"])
