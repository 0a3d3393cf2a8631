"""The plan and the disk budget (eagle3flow/ops/plan/, rules/plan.smk).

Projections are checked against real files: a real extraction by Snakemake on a small
random target (two runs: the dataset first, so the second plan works from its stats),
a real draft and AdamW checkpoint. The budget refusal goes through real `snakemake`
runs on the embedded default, which must fail before any job (so before any model).
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml

from conftest import REPO
from support.builders import write_word_conversations
from support.targets import make_chat_target
from support.workflow import snakemake, snakemake_env, workflow_copy

from eagle3flow.ops import plan as plan_lib
from eagle3flow.ops.plan import footprint as plan_footprint
from eagle3flow.ops.plan import stages as plan_stages
from eagle3flow.ops.plan import workload as plan_workload
from eagle3flow.ops.plan import sizes

STAGE_NAMES = [name for name, *_ in plan_stages.STAGES]


def resolved_config(**sections) -> dict:
    """config.yaml's schema defaults with ``sections`` merged in, as the workflow sees it."""
    from snakemake.utils import validate

    config = {key: dict(value) for key, value in sections.items()}
    validate(config, str(REPO / "schemas" / "config.schema.yaml"), set_default=True)
    return config


# ---------------------------------------------------------------- sizes of real artifacts

def test_draft_params_and_checkpoint_bytes_match_a_real_draft(random_llama_target, tmp_path):
    """The plan's draft size is the real Eagle3Draft's, Llama and MLA, and a real AdamW
    checkpoint is 12 B/param."""
    import io

    import torch

    from eagle3flow.model.config import DraftConfig
    from eagle3flow.model.draft import Eagle3Draft
    from eagle3flow.train.optim import build_optimizers, uses_muon

    from support.tiny_targets import make_tiny_deepseek_v3

    target = json.loads((random_llama_target / "config.json").read_text())
    mla_target = json.loads((make_tiny_deepseek_v3(tmp_path / "mla") / "config.json").read_text())
    plain_query_mla = {**mla_target, "q_lora_rank": None}
    for config, overrides, draft_vocab in ((target, {}, 128), (target, {"intermediate_size": 96}, 300),
                                           (target, {"norm_before_fc": False}, 128), (mla_target, {}, 200),
                                           (mla_target, {"intermediate_size": 96}, 200), (plain_query_mla, {}, 200)):
        cfg = DraftConfig.from_target_config(config, [1, 2, 3], draft_vocab, overrides)
        model = Eagle3Draft(cfg)
        counts = plan_footprint.draft_param_counts(config, [1, 2, 3], draft_vocab, overrides)
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        matrices = sum(p.numel() for n, p in named if uses_muon(n, p))
        assert counts == {"matrices": matrices, "rest": sum(p.numel() for _, p in named) - matrices}, \
            (cfg.architecture, overrides)
    model = Eagle3Draft(DraftConfig.from_target_config(target, [2, 4, 5], 300, {"intermediate_size": 96}))

    # What train.py checkpoints: trainable weights and the optimizer state after a step,
    # for each optimizer it builds.

    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    for name in ("adamw", "muon"):
        optimizer = build_optimizers(named, {"optimizer": name, "lr": 1e-3, "adam_betas": [0.9, 0.95],
                                             "weight_decay": 0.0, "muon_weight_decay": 0.0,
                                             "muon_momentum": 0.95}, torch.device("cpu"))
        model.zero_grad()
        sum(p.float().pow(2).sum() for _, p in named).backward()
        optimizer.step()
        buffer = io.BytesIO()
        torch.save({"model": {n: p.detach() for n, p in named}, "optimizer": optimizer.state_dict()}, buffer)
        counts = plan_footprint.draft_param_counts(target, [2, 4, 5], 300, {"intermediate_size": 96})
        projected = plan_footprint.draft_checkpoint_bytes(counts, name)
        assert abs(buffer.tell() - projected) / projected < 0.05, (name, buffer.tell(), projected)


def test_a_dflash_draft_is_projected_by_its_own_size_and_checkpoint(random_llama_target, tmp_path):
    """train.method dflash: the plan's draft is the real DFlashDraft's trainable size, its
    checkpoint the trainer's real one (weights, AdamW state after a step, run state) within 5%."""
    import io

    import torch

    from eagle3flow.model.dflash import DFlashDraft
    from eagle3flow.model.dflash_config import DFlashConfig
    from eagle3flow.ops.plan.project import DFLASH_CHECKPOINT_BYTES_PER_PARAM

    target = json.loads((random_llama_target / "config.json").read_text())
    cfg = DFlashConfig.from_target_config(target, 4, 1, num_hidden_layers=2, target_layer_ids=[2, 4, 6])
    model = DFlashDraft(cfg)
    trainable = [p for p in model.parameters() if p.requires_grad]
    assert cfg.trainable_params() == sum(p.numel() for p in trainable)
    optimizer = torch.optim.AdamW(trainable)
    sum(p.pow(2).sum() for p in trainable).backward()
    optimizer.step()
    buffer = io.BytesIO()
    torch.save({"model": model.trainable_state_dict(), "optimizer": optimizer.state_dict()}, buffer)
    projected = cfg.trainable_params() * DFLASH_CHECKPOINT_BYTES_PER_PARAM
    assert abs(buffer.tell() - projected) / projected < 0.05, (buffer.tell(), projected)

    row = stage_row(plan_lib.project(resolved_config(train={"method": "dflash"}), tmp_path), "train")
    assert row.bytes_basis.startswith("DFlash:") and "context tokens/s" in row.time_basis, row


def test_parse_bytes_and_job_stats():
    assert sizes.parse_bytes("1.5TiB") == int(1.5 * 1024 ** 4)
    assert sizes.parse_bytes("500GB") == 500 * 10 ** 9
    assert sizes.parse_bytes(123) == 123
    with pytest.raises(ValueError, match="storage"):
        sizes.parse_bytes("lots")
    stats = "Job stats:\njob      count\n-----  -----\nprepare_dataset  1\nall  1\ntotal  2\n"
    assert plan_lib.parse_job_stats(stats) == {"prepare_dataset": 1, "all": 1}


# ---------------------------------------------------------------- a real run: plan vs measured

@pytest.fixture(scope="module")
def extraction_run(tmp_path_factory):
    """Snakemake runs prepare_dataset, then extraction, on a small random target."""
    root = tmp_path_factory.mktemp("plan_run")
    target = make_chat_target(root / "target", family="llama3")
    write_word_conversations(root / "chats.jsonl", 160)
    workdir = workflow_copy(root / "wf")
    config = yaml.safe_load((workdir / "config.yaml").read_text())
    config["target"]["path"] = str(target)
    config["dataset"].update(path=str(root / "chats.jsonl"), max_length=256, eval_fraction=0.1)
    config["extract"] = {"shard_tokens": 1024, "batch_tokens": 2048}
    config["vocab"] = {"draft_vocab_size": 256}
    config["storage"] = {"sample_interval_s": 0.2}
    (workdir / "config.yaml").write_text(yaml.safe_dump(config))
    first = snakemake(workdir, "--cores", "2", "results/dataset/stats.json", timeout=600)
    assert first.returncode == 0, first.stdout + first.stderr
    second = snakemake(workdir, "--cores", "2", "results/hidden_states/eval/manifest.json", timeout=600)
    assert second.returncode == 0, second.stdout + second.stderr
    return workdir, second.stdout


def test_run_prints_plan_first_and_projected_vs_actual_at_the_end(extraction_run):
    workdir, stdout = extraction_run
    plan_at = stdout.index("=== plan (eagle3flow.ops.plan) ===")
    actual_at = stdout.index("disk (actual)")
    assert plan_at < actual_at, stdout
    table = stdout[plan_at:actual_at]
    for name in ("prepare dataset", "extract", "vocab", "train", "export", "evaluate", "report"):
        row = next(line for line in table.splitlines() if line.startswith(name))
        assert re.search(r"\s\d+(s|m\d\ds|h\d\dm)\s", row), row        # a time for every stage
    assert re.search(r"extract \[GPU\]\s+run", table) and re.search(r"prepare dataset\s+cached", table)
    assert re.search(r"train \[GPU\]\s+skip", table), table


def test_projected_peak_matches_measured_peak_within_10_percent(extraction_run):
    workdir, _ = extraction_run
    plan = json.loads((workdir / "results" / "plan" / "plan.json").read_text())
    peak = json.loads((workdir / "results" / "plan" / "disk_peak.json").read_text())
    measured = peak["peak_bytes"]
    hidden = sizes.tree_bytes(workdir / "cache" / "hidden_states")
    assert hidden > 0.8 * measured                      # the hidden states are what counts
    assert abs(plan["peak_bytes"] - measured) <= 0.10 * measured, (plan["peak_bytes"], measured)
    extract = next(s for s in plan["stages"] if s["name"] == "extract")
    shards = hidden - sum(p.stat().st_size for p in (workdir / "cache" / "hidden_states").rglob("*.json"))
    assert abs(extract["bytes"] - shards) <= 0.03 * shards, (extract["bytes"], shards)
    # The throughput measured in this run is what the next plan works from.
    again = plan_lib.project(resolved_config(**yaml.safe_load((workdir / "config.yaml").read_text())),
                             workdir)
    assert "last run" in next(s for s in again.stages if s.name == "extract").time_basis


# ---------------------------------------------------------------- the budget, refused for real

@pytest.fixture(scope="module")
def embedded_copy(tmp_path_factory):
    return workflow_copy(tmp_path_factory.mktemp("plan_budget") / "wf")


# The cache key before the target's identity (eagle3flow/extract/cache.py up to 1ab9b7e):
# 16 blocks of 64 KiB spread over each weight file's data, the rest never read.
OLD_SAMPLES, OLD_BLOCK = 16, 1 << 16


def tensor_the_old_sampler_never_read(path: Path) -> tuple[str, int, int]:
    """(name, first byte, end) in the file of a float32 tensor no sampled block touched."""
    with open(path, "rb") as f:
        length = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(length))
    data_start, size = 8 + length, path.stat().st_size
    step = (size - data_start - OLD_BLOCK) / (OLD_SAMPLES - 1)
    blocks = [(data_start + int(step * k), data_start + int(step * k) + OLD_BLOCK) for k in range(OLD_SAMPLES)]
    for name, spec in sorted(header.items()):
        if name == "__metadata__" or "lm_head" in name:     # lm_head: not in the hidden states
            continue
        start, end = (data_start + o for o in spec["data_offsets"])
        if spec["dtype"] == "F32" and end - start >= 1024 and all(end <= a or start >= b for a, b in blocks):
            return name, start, end
    raise AssertionError(f"{path}: every tensor overlaps a sampled block")


def test_a_weight_rewritten_where_the_old_sampler_never_read_reruns_extraction(extraction_run):
    """The served target's weights change in place (same file, size and header; a tensor the
    old cache key never read): Snakemake sees the target's identity change and reruns
    extraction, which computes new hidden states instead of finding the old ones, and not
    the dataset, which reads no weight; an unchanged target reruns nothing. The last test of extraction_run: it changes its target."""
    workdir, _ = extraction_run
    # The extraction job's own manifests (one partition): the merge job adds nothing here.
    manifests = {split: workdir / "results" / "hidden_states" / split / "part-0-of-1.json" for split in ("train", "eval")}
    goal = ["--cores", "2", str(manifests["train"].relative_to(workdir))]
    unchanged = snakemake(workdir, "-n", *goal, timeout=300)
    assert "Nothing to be done" in unchanged.stdout + unchanged.stderr, (unchanged.stdout + unchanged.stderr)[-3000:]
    before = {split: json.loads(path.read_text()) for split, path in manifests.items()}

    target = Path(yaml.safe_load((workdir / "config.yaml").read_text())["target"]["path"])
    weights = target / "model.safetensors"
    name, start, end = tensor_the_old_sampler_never_read(weights)
    stat = weights.stat()
    with open(weights, "r+b") as f:
        f.seek(start)
        tripled = np.frombuffer(f.read(end - start), dtype=np.float32) * 3.0
        f.seek(start)
        f.write(tripled.tobytes())
    assert weights.stat().st_size == stat.st_size
    # a filesystem's mtime may be coarse: the rewrite is at least a second later
    os.utime(weights, ns=(stat.st_atime_ns, max(weights.stat().st_mtime_ns, stat.st_mtime_ns + 10**9)))

    rerun = snakemake(workdir, *goal, timeout=600)
    assert rerun.returncode == 0, (rerun.stdout + rerun.stderr)[-4000:]
    ran = rerun.stdout + rerun.stderr
    assert "rule extract_hidden_states" in ran, (name, ran[-3000:])
    assert "rule prepare_dataset" not in ran, ran[-3000:]      # it reads no weight
    for split in ("train", "eval"):
        after = json.loads(manifests[split].read_text())
        assert after["fingerprint"] != before[split]["fingerprint"], (split, name)
        assert ([s["sha256"] for s in after["shards"]] != [s["sha256"] for s in before[split]["shards"]]), (split, name)


def test_too_small_budget_is_refused_by_a_dry_run_with_what_would_fit(embedded_copy):
    result = snakemake(embedded_copy, "-n", "--profile", "profiles/embedded",
                       "--config", "storage={max_bytes: 100MB}", timeout=300)
    out = result.stdout + result.stderr
    assert result.returncode != 0, out
    assert "storage budget" in out and "over storage.max_bytes = 100.0 MB" in out, out
    assert "dataset.max_samples:" in out and "streaming" in out, out


def test_too_small_budget_fails_a_real_run_before_any_job(embedded_copy):
    result = snakemake(embedded_copy, "--profile", "profiles/embedded",
                       "--config", "storage={max_bytes: 100MB}", timeout=300)
    out = result.stdout + result.stderr
    assert result.returncode != 0 and "over storage.max_bytes" in out, out
    assert not (embedded_copy / "results" / "embedded").exists()   # no job started
    assert not (embedded_copy / "logs").exists()


def test_plan_cli_prints_every_stage_and_refuses_over_budget(embedded_copy):
    cmd = [sys.executable, "-m", "eagle3flow.ops.plan", "--profile", "profiles/embedded"]
    ok = subprocess.run(cmd, cwd=embedded_copy, env=snakemake_env(), capture_output=True,
                        text=True, timeout=300)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    for name in STAGE_NAMES:
        if name != "regenerate":
            assert any(line.startswith(name) and " run " in line for line in ok.stdout.splitlines()), \
                ok.stdout
    assert "peak disk (results/ + cache/): " in ok.stdout and "GPU-hours" in ok.stdout
    # A free-space floor no disk has: refused too, the table still printed.
    refused = subprocess.run(cmd + ["--config", "storage={min_free_bytes: 1000PB}"], cwd=embedded_copy,
                             env=snakemake_env(), capture_output=True, text=True, timeout=300)
    assert refused.returncode == 1 and "must stay free" in refused.stderr, refused.stderr
    assert "=== plan" in refused.stdout


# ---------------------------------------------------------------- what will actually run (issue 14)

def stage_row(plan, name):
    return next(s for s in plan.stages if s.name == name)


def test_hf_extraction_is_projected_at_one_devices_speed(tmp_path):
    """The HF backend loads the target on one GPU, however many the drain freed."""
    on_eight = plan_lib.project(resolved_config(resources={"gpus": 8}, extract={"backend": "hf"}), tmp_path)
    on_one = plan_lib.project(resolved_config(resources={"gpus": 1}, extract={"backend": "hf"}), tmp_path)
    assert stage_row(on_eight, "extract").seconds == pytest.approx(stage_row(on_one, "extract").seconds)
    assert "on 1 GPU(s), hf backend" in stage_row(on_eight, "extract").time_basis
    # Training is data parallel over every GPU (its process start aside); Muon's Newton-Schulz
    # runs each matrix on one GPU (muon_owners), so the step waits for the busiest GPU's share.
    from eagle3flow.ops.plan.project import ASSUMED_STAGE_START_S as start

    def train_seconds(gpus, optimizer):
        plan = plan_lib.project(resolved_config(resources={"gpus": gpus}, extract={"backend": "hf"},
                                                train={"optimizer": optimizer}), tmp_path)
        return stage_row(plan, "train").seconds - start
    assert train_seconds(8, "adamw") == pytest.approx(train_seconds(1, "adamw") / 8)
    assert train_seconds(1, "muon") > 1.001 * train_seconds(1, "adamw")
    newton_schulz_8 = train_seconds(8, "muon") - train_seconds(8, "adamw")
    newton_schulz_1 = train_seconds(1, "muon") - train_seconds(1, "adamw")
    assert newton_schulz_1 / 8 < newton_schulz_8 < newton_schulz_1


def test_own_target_on_built_in_prompts_projects_no_embedded_build(tmp_path):
    """A target of your own answering the built-in prompts writes the prompts, nothing more:
    the embedded build (fp32 weights of the target's size: 4.2 TB for a 1T model) is not
    projected."""
    make_chat_target(tmp_path / "target", family="llama3")
    plan = plan_lib.project(resolved_config(target={"path": str(tmp_path / "target")}, dataset={"path": None},
                                            regenerate={"enabled": True, "base_url": "http://127.0.0.1:8000/v1"}),
                            tmp_path)
    row = stage_row(plan, "embedded target")
    assert row.bytes_basis == "the built-in prompts" and row.bytes < 10 ** 7 and row.seconds < 60, row


def test_target_loads_count_in_gpu_stages_and_the_downtime(tmp_path):
    """Extraction loads the target once; the evaluation once per vLLM engine (the baseline,
    the draft) and once more for the replay where the target fits one GPU; and a drained unit
    loads it again to come back: a 1T-parameter target's ~25 min counts four times."""
    def plan_with(**resources):
        return plan_lib.project(resolved_config(resources={"gpus": 8, **resources},
                                                drain={"enabled": True, "unit": "vllm.service"}), tmp_path)

    without, given = plan_with(), plan_with(target_load_s=1500)
    one = without.restart_seconds
    loads = {"extract": 1, "evaluate": 3}         # the default (embedded) target fits one GPU
    for stage, n in loads.items():
        assert stage_row(given, stage).seconds == pytest.approx(stage_row(without, stage).seconds - n * one + n * 1500)
        assert "1500 s target load (resources.target_load_s)" in stage_row(given, stage).time_basis
    assert "2 vLLM engine(s) (baseline + 1 draft(s) x 1 K) + the replay's HF target" in \
        stage_row(given, "evaluate").time_basis
    assert given.restart_seconds == 1500
    assert given.downtime_seconds == pytest.approx(without.downtime_seconds - 5 * one + 5 * 1500)
    assert plan_lib.project(resolved_config(resources={"gpus": 8, "target_load_s": 1500}), tmp_path).restart_seconds == 0


def test_evaluation_loads_follow_the_engines_and_the_replay():
    evaluate = resolved_config()["evaluate"]
    kimi_params, small_params = 1_000_000_000_000, 135_000_000
    assert plan_lib.evaluation_target_loads(evaluate, small_params)[0] == 3
    loads, basis = plan_lib.evaluation_target_loads(evaluate, kimi_params)
    assert loads == 2 and "no replay (the target fits no one GPU)" in basis
    more = {**evaluate, "vllm_sweep_k": [evaluate["num_speculative_tokens"], 7], "compare_drafts": {"old": "x"}}
    assert plan_lib.evaluation_target_loads(more, kimi_params)[0] == 1 + 2 * 2
    assert plan_lib.evaluation_target_loads({**evaluate, "replay": False}, small_params)[0] == 2
    assert plan_lib.evaluation_target_loads({**evaluate, "replay": True}, kimi_params)[0] == 3


def test_evaluation_bytes_count_the_answers_sampled_at_temperature(tmp_path):
    """evaluate.temperatures above 0: every prompt sampled samples_per_prompt times in the
    baseline and the draft's engine (regenerate.temperature counts where left null)."""
    greedy = stage_row(plan_lib.project(resolved_config(), tmp_path), "evaluate")
    hot = stage_row(plan_lib.project(resolved_config(evaluate={"temperatures": [0, 0.6, 1.0],
                                                               "samples_per_prompt": 4}), tmp_path), "evaluate")
    n = resolved_config()["evaluate"]["num_prompts"]
    from eagle3flow.ops.plan.project import EVAL_BYTES_PER_ANSWER, EVAL_BYTES_PER_TOKEN

    per_answer = resolved_config()["evaluate"]["max_tokens"] * EVAL_BYTES_PER_TOKEN + EVAL_BYTES_PER_ANSWER
    assert hot.bytes - greedy.bytes == n * 4 * 2 * 2 * per_answer
    assert f"{n * 4 * 2 * 2:,} sampled answers at temperature" in hot.bytes_basis
    regenerated = resolved_config(regenerate={"enabled": True, "temperature": 0.6,
                                              "base_url": "http://127.0.0.1:8000/v1"})
    assert plan_lib.sampled_generations(regenerated, n) == n * 8 * 1 * 2


def test_backend_auto_is_vllm_on_a_multi_gpu_node_and_projected_so(tmp_path):
    node = resolved_config(resources={"gpus": 8})
    assert node["extract"]["backend"] == "auto" and plan_lib.extract_backend(node) == "vllm"
    plan = plan_lib.project(node, tmp_path)
    assert "on 8 GPU(s), vllm backend" in stage_row(plan, "extract").time_basis
    assert plan_lib.extract_backend(resolved_config(resources={"gpus": 1})) == "hf"
    assert plan_lib.extract_backend(resolved_config()) == "hf"          # the CPU
    assert plan_lib.extract_backend(resolved_config(resources={"gpus": 8}, extract={"device": "cpu"})) == "hf"


# The run of the issue: SmolLM2-135M answering 600 built-in prompts (max_tokens 128) on
# 2 cores: 99,033 train tokens, the regeneration ~7.5 min of the 33 min 49 s.
MEASURED_TRAIN_TOKENS = 99_033
MEASURED_REGENERATE_S = 450


def smollm2_config(**sections) -> dict:
    profile = yaml.safe_load((REPO / "profiles" / "smollm2" / "workflow.yaml").read_text())
    profile["dataset"]["builtin_prompts"] = 600
    profile["regenerate"]["max_tokens"] = 128
    for key, value in sections.items():
        profile.setdefault(key, {}).update(value)
    return resolved_config(**profile)


def test_plan_projects_the_regenerated_builtin_prompts(tmp_path):
    plan = plan_lib.project(smollm2_config(), tmp_path)
    train = plan.workload["train_tokens"]
    assert 0.75 * MEASURED_TRAIN_TOKENS <= train <= 1.3 * MEASURED_TRAIN_TOKENS, plan.workload
    regenerate = stage_row(plan, "regenerate")
    assert 0.5 * MEASURED_REGENERATE_S <= regenerate.seconds <= 2 * MEASURED_REGENERATE_S, regenerate
    assert "smollm2-135m shape" == plan.workload["target"]            # not the embedded target's
    assert plan.workload["hidden_size"] == 576


def test_plan_projects_more_answers_per_prompt(tmp_path):
    """answers_per_prompt 3: three times the answers to make and the train split's tokens,
    the eval split unchanged (it keeps each prompt's first answer)."""
    one = plan_lib.project(smollm2_config(), tmp_path)
    three = plan_lib.project(smollm2_config(regenerate={"answers_per_prompt": 3}), tmp_path)
    assert three.workload["regenerate"]["answers_to_make"] == pytest.approx(
        3 * one.workload["regenerate"]["answers_to_make"])
    assert three.workload["train_tokens"] == pytest.approx(3 * one.workload["train_tokens"], abs=3)
    assert three.workload["train_samples"] == 3 * one.workload["train_samples"]
    assert three.workload["eval_tokens"] == one.workload["eval_tokens"]
    startup = plan_workload.ASSUMED_SELF_SERVED_STARTUP_S
    assert stage_row(three, "regenerate").seconds - startup == pytest.approx(
        3 * (stage_row(one, "regenerate").seconds - startup))


def test_plan_projects_a_prompt_file_with_the_targets_answers(tmp_path):
    """A served target answering a prompt-only file: the prompts' bytes say nothing of the
    answers the dataset will hold."""
    from eagle3flow.data.builtin_prompts import write_prompts
    from eagle3flow.target.shapes import SMOLLM2_135M

    target = tmp_path / "target"
    target.mkdir()
    (target / "config.json").write_text(json.dumps(SMOLLM2_135M))
    write_prompts(tmp_path / "prompts.jsonl", 600)
    config = smollm2_config(target={"path": str(target)}, dataset={"path": str(tmp_path / "prompts.jsonl")},
                            regenerate={"base_url": "http://127.0.0.1:9"})
    plan = plan_lib.project(config, tmp_path)
    assert 0.75 * MEASURED_TRAIN_TOKENS <= plan.workload["train_tokens"] <= 1.3 * MEASURED_TRAIN_TOKENS, \
        plan.workload


def test_plan_refines_the_answers_from_the_cache_and_the_measured_rate(tmp_path):
    """Killed mid-regeneration: the answers so far give their length, the rate measured
    while answering gives the time of the rest."""
    cache = tmp_path / "cache" / "regenerate" / "0123456789abcdef"
    cache.mkdir(parents=True)
    with open(cache / "responses.jsonl", "w") as f:
        for i in range(100):
            f.write(json.dumps({"id": f"p{i}", "completion_tokens": 60, "finish_reasons": ["stop"]}) + "\n")
    (cache / "rate.json").write_text(json.dumps({"completion_tokens": 6000, "seconds": 100.0}))
    plan = plan_lib.project(smollm2_config(), tmp_path)
    regen = plan.workload["regenerate"]
    assert regen["answer_tokens"] == 60 and "mean of the 100 answers" in regen["answer_basis"]
    assert regen["answers_to_make"] == pytest.approx(600 * plan_workload.BUILTIN_ANSWERS_PER_PROMPT - 100)
    row = stage_row(plan, "regenerate")
    assert row.seconds == pytest.approx(regen["answers_to_make"] * 60 / 60.0 + plan_workload.ASSUMED_SELF_SERVED_STARTUP_S)
    assert "measured while answering" in row.time_basis
    tokens = 600 * plan_workload.BUILTIN_ANSWERS_PER_PROMPT * (plan_workload.BUILTIN_PROMPT_TOKENS + 60
                                                               + plan_workload.TEMPLATE_TOKENS_PER_TURN)
    assert plan.workload["train_tokens"] + plan.workload["eval_tokens"] == pytest.approx(tokens, rel=0.01)


def test_plan_says_when_the_targets_own_code_runs(tmp_path):
    """target.trust_remote_code on: the printed plan says so; off: not a word."""
    on = plan_lib.render(plan_lib.project(resolved_config(target={"trust_remote_code": True}), tmp_path))
    assert "target.trust_remote_code is on" in on
    assert "trust_remote_code" not in plan_lib.render(plan_lib.project(resolved_config(), tmp_path))


def test_the_plan_says_when_the_disk_cannot_feed_the_gpus(tmp_path):
    """Training's read rate (projected tokens/s x bytes per token) against the disk under
    the cache, measured by a probe written, evicted and read back there (none left behind):
    past 80% of it, a note names both rates and what lowers the need."""
    from eagle3flow.ops.plan.read_rate import HEADROOM, measure_read_rate, read_rate_note

    measured = measure_read_rate(tmp_path / "cache" / "hidden_states")   # not there yet: its parent's disk
    assert measured and measured > 1e6 and list(tmp_path.iterdir()) == []
    assert read_rate_note(1000, 32768, 1e9, tmp_path, "bfloat16") is None
    note = read_rate_note(40_000, 32768, 1e9, tmp_path, "bfloat16")
    assert "1.31 GB/s" in note and "1.00 GB/s" in note and "extract.storage_dtype: fp8" in note
    assert f"{HEADROOM * 1e9 / 32768:,.0f} tokens/s" in note
    assert "storage_dtype: fp8" not in read_rate_note(40_000, 16448, 1e8, tmp_path, "float8_e4m3fn")
    # A node of 8 GPUs training a small draft needs more than any disk reads; a CPU run never
    # asks, nor the plan made when the workflow is read (it reads files only).
    on_eight = plan_lib.project(resolved_config(resources={"gpus": 8}), tmp_path, probe_disk=True)
    assert any("would read hidden states at" in n for n in on_eight.notes), on_eight.notes
    on_cpu = plan_lib.project(resolved_config(resources={"gpus": 0}), tmp_path, probe_disk=True)
    assert not any("would read hidden states at" in n for n in on_cpu.notes)
    when_read, _ = plan_lib.plan_when_read(resolved_config(resources={"gpus": 8}), tmp_path)
    assert not any("would read hidden states at" in n for n in when_read.notes)
