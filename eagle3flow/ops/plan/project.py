"""The projection: per stage, the disk it will hold and the time it will take, from the
workload, the footprint formulas and the best throughput known (this profile's last
run, this directory's last run, else an assumed FLOP rate), then the budget's verdict;
with streaming partitions (eagle3flow/ops/streaming.py) when the budget cannot hold the
full hidden states. No torch."""
from __future__ import annotations

import math
import os
from pathlib import Path

from eagle3flow.config import default_temperatures
from eagle3flow.ops import streaming
from eagle3flow.model.dflash_config import DFLASH_KEEP_CHECKPOINTS, DFlashConfig
from eagle3flow.ops.plan.budget import allowed_peak, budget_refusal
from eagle3flow.model.optimizer_flops import busiest_rank_flops_per_step
from eagle3flow.ops.plan.footprint import (DTYPE_BYTES, aux_layer_ids, draft_checkpoint_bytes, draft_config,
                                           hidden_state_bytes_per_token, storage_dtype, target_params)
from eagle3flow.ops.plan.stages import (FINGERPRINTED, STAGES, Plan, StageRow, measure, real_path,
                                        stage_outputs_exist)
from eagle3flow.ops.plan.throughput import (cpu_speed, extract_backend, extract_devices, measured_throughputs,
                                            profile_key, recorded_throughputs)
from eagle3flow.ops.plan.workload import (EMBEDDED_BUILD_STEP_TOKENS, EMBEDDED_BUILD_TOKENS_PER_S_PER_CORE,
                                          EMBEDDED_JSONL_BYTES_PER_TOKEN,
                                          EMBEDDED_TOKENS_PER_CONVERSATION, PARQUET_BYTES_PER_TOKEN,
                                          serving_rate, target_config, workload)
from eagle3flow.ops.plan.read_rate import measure_read_rate, read_rate_note
from eagle3flow.ops.plan.sizes import newest_subdirs_bytes, tree_bytes
from eagle3flow.procfs import usable_cores

# Effective FLOP/s when nothing is measured: CPU per core the job holds, from `make demo`
# on 2 AMD EPYC cores without AVX-512, the mean of three runs up to 30% apart (2026-12-04,
# 2026-12-05 twice: extraction 2 x 4.65M params x 7,600 / 8,630 / 8,630 tokens/s, training
# 6 x 0.76M x 7 x 1,940 / 2,460 / 2,650 tokens/s, each on both cores), scaled by the host's
# one-core matmul rate (throughput.py cpu_speed); GPU an assumed 40% of a dense bf16 H100/H200.
ASSUMED_FLOPS = {("cpu", "extract"): 3.85e10, ("cpu", "train"): 3.75e10,
                 ("gpu", "extract"): 4.0e14, ("gpu", "train"): 4.0e14}
# A stage process's start before its first token: Python, torch, the target or the shards.
ASSUMED_STAGE_START_S = 10.0
# Seconds of the small stages when this directory has never run them.
ASSUMED_SECONDS = {"prepare dataset": 20.0, "vocab": 5.0, "export": 5.0, "report": 15.0, "built-in prompts": 5.0}
# CPU: make demo's evaluation (two vLLM engines, greedy and at temperature 1, the replay):
# 1m39s, 1m33s and 1m15s (2026-12-04, 2026-12-05 twice).
ASSUMED_EVALUATE_S = {"cpu": 85.0, "gpu": 900.0}
ASSUMED_PRETRAINED_BUILD_S = 60.0
# Per answer, greedy or sampled, in each engine's JSON (indented: its ids, its prompt's ids,
# the baseline's top logits): make demo wrote 2.38 MB for 48 prompts + 192 sampled answers
# of at most 64 tokens (2026-12-05).
EVAL_BYTES_PER_TOKEN = 40
EVAL_BYTES_PER_ANSWER = 7000
# Reading, sharding and warming up a target on GPUs (vLLM's CUDA graphs included), per byte
# of its weights: ~25 min for Kimi-K2.5 INT4's ~595 GB, as its production unit restarts.
ASSUMED_TARGET_LOAD_BYTES_PER_S = 0.4e9
# One GPU's memory when the plan must guess whether evaluate.replay: auto will load the HF
# target on one device (the evaluation decides from the device itself: eval/replay.py).
ASSUMED_REPLAY_DEVICE_BYTES = 80e9


def project(config: dict, root: str | os.PathLike = ".", will_run: dict[str, int] | None = None,
            probe_disk: bool = False) -> Plan:
    """The plan for ``config`` (validated, defaults filled) in workflow directory ``root``.

    ``will_run``: jobs per rule Snakemake will run (its DAG); None = judge each stage by
    whether its files exist. ``probe_disk``: measure the cache disk's read rate (a probe
    file written and read back) for the note on whether it feeds the GPUs: the run's own
    plan and the plan CLI, never the plan made when the workflow is read (which reads only).
    """
    root = Path(root)
    target, target_basis = target_config(config, root)
    work = workload(config, root)
    gpus = int(config["resources"]["gpus"])
    device_class = "gpu" if gpus > 0 else "cpu"
    aux_ids = aux_layer_ids(config, target)
    aux = len(aux_ids)
    hidden = int(target["hidden_size"])
    dtype = storage_dtype(config)
    per_token = hidden_state_bytes_per_token(aux, hidden, dtype)
    tokens = work["train_tokens"] + work["eval_tokens"]
    samples = work["train_samples"] + work["eval_samples"]
    draft_vocab = min(int(config["vocab"]["draft_vocab_size"]), int(target["vocab_size"]))
    train_cfg = config["train"]
    draft = draft_config(target, aux_ids, draft_vocab, train_cfg.get("draft", {}))
    draft_counts = draft.trainable_param_counts()
    draft_params = sum(draft_counts.values())
    checkpoint = draft_checkpoint_bytes(draft_counts, train_cfg["optimizer"])
    total_params, active_params = target_params(target)
    target_dtype = str(target.get("torch_dtype") or target.get("dtype") or "bfloat16").replace("torch.", "")
    export_bytes_per_param = 4 if target_dtype == "float32" else 2
    vocab_map_bytes = draft_vocab * 8 + int(target["vocab_size"])

    load_s, load_basis = target_load(config, root, total_params, target_dtype) if gpus else (0.0, "")

    measured = measured_throughputs(config, root)
    recorded = recorded_throughputs(config, root)
    # Per stage, the devices it runs on: extraction with the HF backend loads the target on one.
    devices = {"extract": extract_devices(config), "train": gpus}
    seconds_of = {**measured["seconds"], **recorded.get("seconds", {})}
    backend = extract_backend(config)

    def rate(stage: str, flops_per_token: float) -> tuple[float, str]:
        key = f"{stage}_tokens_per_s"
        if recorded.get(key):
            return recorded[key], f"last run ({profile_key(config)})"
        if key in measured:
            return measured[key], "last run in results/"
        on = (f" on {devices[stage]} GPU(s)" + (f", {backend} backend" if stage == "extract" else "")
              if gpus else "")
        # On the CPU a compute job holds every core of the node (rules/common.smk COMPUTE_THREADS).
        units = devices[stage] if gpus else usable_cores()
        flops = ASSUMED_FLOPS[(device_class, stage)] * max(units, 1)
        if gpus:
            return flops / flops_per_token, f"assumed {flops:.1e} FLOP/s{on}"
        factor, host = cpu_speed()
        return (flops * factor / flops_per_token,
                f"assumed {flops * factor:.1e} FLOP/s on {units} core(s) ({host})")

    def scaled_seconds(rule: str, now_tokens: float, fallback: float, fallback_basis: str):
        """A small stage's seconds from its last benchmark, scaled by tokens when known."""
        if rule in seconds_of:
            then = recorded.get("tokens")
            factor = now_tokens / then if then and now_tokens else 1.0
            return seconds_of[rule] * factor, "last run"
        return fallback, fallback_basis

    # --- projected bytes and seconds per stage
    proj: dict[str, tuple[int, str, float, str]] = {}
    emb = config["embedded"]
    builtin = config["target"].get("builtin") or "embedded"
    if config["target"]["path"] is not None and config["dataset"]["path"] is None:
        # your own target answering the built-in prompts: only the prompts are written here
        s, sb = scaled_seconds("write_builtin_prompts", 0, ASSUMED_SECONDS["built-in prompts"], "assumed")
        proj["embedded target"] = (samples * 300, "the built-in prompts", s, sb)
    elif config["target"]["path"] is None and builtin != "embedded":
        s, sb = scaled_seconds("build_pretrained_target", 0, ASSUMED_PRETRAINED_BUILD_S, "assumed")
        proj["embedded target"] = (total_params * 4 + samples * 300, f"{builtin}: {total_params / 1e6:.0f}M "
                                   "fp32 params + the built-in prompts", s, sb)
    elif config["target"]["path"] is None:
        emb_tokens = emb["max_conversations"] * EMBEDDED_TOKENS_PER_CONVERSATION
        b = total_params * 4 + int(emb_tokens * EMBEDDED_JSONL_BYTES_PER_TOKEN) + 300_000
        factor, host = cpu_speed()
        build_rate = EMBEDDED_BUILD_TOKENS_PER_S_PER_CORE * usable_cores() * factor
        s, sb = scaled_seconds("build_embedded_target", 0, emb["train_steps"] * EMBEDDED_BUILD_STEP_TOKENS / build_rate,
                               f"assumed {build_rate:,.0f} tokens/s ({EMBEDDED_BUILD_TOKENS_PER_S_PER_CORE:,} per "
                               f"core, {host})")
        proj["embedded target"] = (b, f"{total_params / 1e6:.1f}M fp32 params + conversations", s, sb)
    if (config.get("regenerate") or {}).get("enabled"):
        regen = work.get("regenerate") or {}
        serve_rate, startup, rate_basis = serving_rate(config, root)
        to_make = float(regen.get("answer_tokens_to_make", tokens))
        seconds = (to_make / serve_rate + startup) if to_make else 0.0
        proj["regenerate"] = (int(tokens * EMBEDDED_JSONL_BYTES_PER_TOKEN * 2), "new answers (JSONL)", seconds,
                              f"{to_make:,.0f} answer tokens still to generate at {serve_rate:,.0f} tokens/s "
                              f"({rate_basis})" + (f" + {startup:.0f}s start-up" if startup and to_make else ""))
    s, sb = scaled_seconds("prepare_dataset", tokens, ASSUMED_SECONDS["prepare dataset"], "assumed")
    proj["prepare dataset"] = (int(tokens * PARQUET_BYTES_PER_TOKEN) + samples * 300,
                               f"{tokens:,} tokens x {PARQUET_BYTES_PER_TOKEN} B + prompts", s, sb)
    # Hidden states: both splits; shard headers hold the sample ids.
    hs_bytes = tokens * per_token + samples * 40
    r, rb = rate("extract", 2 * active_params)
    proj["extract"] = (hs_bytes, f"{tokens:,} tokens x {per_token:,} B ({aux}+1 x {hidden} x {dtype})",
                       tokens / r + load_s + ASSUMED_STAGE_START_S,
                       f"{r:,.0f} tokens/s, {rb}" + load_basis + f" + {ASSUMED_STAGE_START_S:.0f}s start")
    proj["vocab"] = (vocab_map_bytes + 1000, f"d2t/t2d for {draft_vocab} of {target['vocab_size']}",
                     *scaled_seconds("build_vocab_map", tokens, ASSUMED_SECONDS["vocab"], "assumed"))
    train_rate = None      # an EAGLE-3 draft's projected tokens/s (the disk probe's basis)
    if train_cfg["method"] == "dflash":
        draft_params, checkpoint, proj["train"] = dflash_train_projection(config, target, aux_ids, work, rate)
    else:
        keep = int(train_cfg.get("keep_checkpoints", 2))
        train_tokens = work["train_tokens"] * int(train_cfg["epochs"])
        steps = max(1, math.ceil(train_tokens / int(train_cfg["batch_tokens"])))
        metrics_bytes = (steps // int(train_cfg.get("log_every", 10)) + 1) * 600 * 2
        # Muon's Newton-Schulz runs once per step, whatever the batch, each matrix on one GPU:
        # the step waits for the busiest, so the GPUs together spend world x its share.
        world = devices["train"] if gpus else 1
        optimizer_flops = world * busiest_rank_flops_per_step(draft, train_cfg["optimizer"], world)
        r, rb = rate("train", 6 * draft_params * int(train_cfg["ttt_steps"])
                     + optimizer_flops / int(train_cfg["batch_tokens"]))
        train_rate = r
        # What stays: keep_checkpoints checkpoints; one more exists while the newest is written
        # (before the oldest goes): the peak counts it (assemble), the stage's bytes do not.
        proj["train"] = (keep * checkpoint + draft_params * 4 + metrics_bytes,
                         f"{draft_params / 1e6:.2f}M draft params, {checkpoint / draft_params:.1f} B/param "
                         f"({train_cfg['optimizer']}) x {keep} checkpoints (+1 while one is written) + weights",
                         train_tokens / r + ASSUMED_STAGE_START_S,
                         f"{r:,.0f} tokens/s, {rb} + {ASSUMED_STAGE_START_S:.0f}s start")
    proj["export"] = (draft_params * export_bytes_per_param + vocab_map_bytes + 2000,
                      f"draft in {'float32' if export_bytes_per_param == 4 else 'bfloat16'}",
                      *scaled_seconds("export_draft", 0, ASSUMED_SECONDS["export"], "assumed"))
    ev = config["evaluate"]
    n_prompts = ev.get("num_prompts") or work["eval_samples"]
    s, sb = scaled_seconds("evaluate_draft", 0, ASSUMED_EVALUATE_S[device_class], "assumed")
    if sb == "assumed" and load_s:     # a last run's time has its loads in it already
        loads, loads_basis = evaluation_target_loads(ev, total_params)
        s, sb = s + loads * load_s, f"{sb} + {loads} x{load_basis[2:]}: {loads_basis}"
    sampled = sampled_generations(config, n_prompts)
    per_answer = ev["max_tokens"] * EVAL_BYTES_PER_TOKEN + EVAL_BYTES_PER_ANSWER
    proj["evaluate"] = ((n_prompts + sampled) * per_answer + 20_000,
                        "outputs and requests" + (f", {sampled:,} sampled answers at temperature"
                                                  if sampled else ""), s, sb)
    proj["report"] = (600_000, "plots and tables",
                      *scaled_seconds("build_report", 0, ASSUMED_SECONDS["report"], "assumed"))

    # --- status per stage, measured bytes, the peak
    now_per_stage, now_total = measure(config, root)

    def assemble(proj: dict, fingerprinted: dict = FINGERPRINTED) -> Plan:
        rows, accounted, to_write = [], 0, 0
        for stage in STAGES:
            name, prefixes, gpu, paths = stage.name, stage.rules, stage.gpu, stage.folders
            if name not in proj:
                if now_per_stage[name]:
                    accounted += now_per_stage[name]
                continue
            b, bb, s, sb = proj[name]
            existing = now_per_stage[name]
            done = stage_outputs_exist(stage, config, root)
            if will_run is not None:
                jobs = sum(n for rule, n in will_run.items() if rule.startswith(prefixes))
                # Not in the DAG and never made: the targets asked for do not need it.
                status = "run" if jobs else "cached" if done else "skip"
            else:
                jobs = 0 if done else 1
                status = "cached" if done else "run"
            if status == "skip":
                final, s = existing, 0.0
            elif status == "cached":
                final = existing or b
            else:
                # What a stage rewrites in results/ is replaced; its cache keeps old fingerprints
                # and resumes the newest (taken as this run's partial work).
                stale = sum(tree_bytes(real_path(p, config, root)) for p in paths if p.startswith("cache/"))
                current = sum(newest_subdirs_bytes(real_path(p, config, root), fingerprinted[p])
                              for p in paths if p in fingerprinted)
                final = stale + max(0, b - current)
                to_write += max(0, final - existing)
            accounted += existing
            rows.append(StageRow(name, gpu, status, int(final), bb, float(s), sb, jobs))
        other = max(0, now_total - accounted)
        writing_checkpoint = checkpoint if any(r.name == "train" and r.status == "run" for r in rows) else 0
        peak = other + sum(r.bytes for r in rows) + writing_checkpoint
        plan = Plan(rows, other, int(peak), int(to_write), gpus, bool(config["drain"]["enabled"]),
                    {**work, "target": target_basis, "draft_params": draft_params,
                     "checkpoint_bytes": int(checkpoint), "hidden_state_bytes_per_token": per_token, "storage_dtype": dtype,
                     "aux_layers": aux, "hidden_size": hidden,
                     "hidden_state_bytes": int(hs_bytes)}, profile_key(config))
        plan.refusal = budget_refusal(plan, config, root)
        plan.restart_seconds = load_s if plan.drain else 0.0
        return plan

    plan = _with_streaming(assemble(proj), assemble, proj, config, root, target)
    training = any(r.name == "train" and r.status == "run" for r in plan.stages)
    if probe_disk and gpus and train_rate and training:
        # The GPUs' appetite for hidden states against the disk they sit on (its own probe).
        cache = real_path("cache/hidden_states", config, root)
        note = read_rate_note(train_rate, per_token, measure_read_rate(cache), cache, dtype)
        if note:
            plan.notes.append(note)
    if config["target"].get("trust_remote_code"):
        plan.notes.append("target.trust_remote_code is on: every stage that loads the target "
                          "(tokenizer, transformers, vLLM) runs the Python code it ships (auto_map)")
    return plan


def sampled_generations(config: dict, n_prompts: int) -> int:
    """The answers the evaluation samples at temperature (evaluate.temperatures above 0, null:
    config.default_temperatures), each written by the baseline and every draft's engine."""
    ev = config["evaluate"]
    temperatures = ev.get("temperatures")
    if temperatures is None:
        temperatures = default_temperatures(config) or []
    hot = len({float(t) for t in temperatures if float(t) > 0})
    engines = 1 + 1 + len(ev.get("compare_drafts") or {})
    return n_prompts * int(ev.get("samples_per_prompt") or 0) * hot * engines


def evaluation_target_loads(evaluate: dict, total_params: int) -> tuple[int, str]:
    """How many times the evaluation loads the target, and which: one vLLM engine for the
    baseline and one per draft and K served (eval/evaluate.py), and the HF target of the
    replay where ``evaluate.replay`` will run it (auto: the target's bf16 weights within
    85% of one ASSUMED_REPLAY_DEVICE_BYTES GPU, as eval/replay.py decides on the device)."""
    ks = {int(evaluate["num_speculative_tokens"]), *(int(k) for k in evaluate.get("vllm_sweep_k") or [])}
    drafts = 1 + len(evaluate.get("compare_drafts") or {})
    engines = 1 + drafts * len(ks)
    setting = evaluate.get("replay", "auto")
    replay = setting is True or (setting == "auto" and total_params * 2 <= 0.85 * ASSUMED_REPLAY_DEVICE_BYTES)
    return engines + int(replay), (f"{engines} vLLM engine(s) (baseline + {drafts} draft(s) x {len(ks)} K)"
                                   + (" + the replay's HF target" if replay else
                                      ", no replay (evaluate.replay)" if setting is False else
                                      ", no replay (the target fits no one GPU)"))


def target_load(config: dict, root: Path, total_params: int, target_dtype: str) -> tuple[float, str]:
    """Seconds the target takes to load on the GPUs, and the basis: resources.target_load_s,
    else its weight files' bytes (or its parameters') at ASSUMED_TARGET_LOAD_BYTES_PER_S."""
    given = config["resources"].get("target_load_s")
    if given:
        return float(given), f" + {given:.0f} s target load (resources.target_load_s)"
    path = config["target"]["path"]
    weights = sum(f.stat().st_size for f in Path(root, path).glob("*.safetensors")) if path else 0
    basis = "weight files"
    if not weights:
        weights, basis = total_params * DTYPE_BYTES.get(target_dtype, 2), f"{target_dtype} parameters"
    seconds = weights / ASSUMED_TARGET_LOAD_BYTES_PER_S
    return seconds, (f" + {seconds:.0f} s target load ({weights / 1e9:,.0f} GB of {basis} at "
                     f"{ASSUMED_TARGET_LOAD_BYTES_PER_S / 1e9:.1f} GB/s assumed; resources.target_load_s sets it)")


def _with_streaming(plan: Plan, assemble, proj: dict, config: dict, root: Path, target: dict) -> Plan:
    """The plan with streaming partitions (eagle3flow/ops/streaming.py) when the budget cannot
    hold the full hidden states, or when a chain is already in progress here.

    Streamed, the hidden states on disk at once are the eval split's plus F train
    partitions ("in flight"): F = what the room left by every other stage holds, and the
    extraction of the last epochs is repeated per epoch."""
    pinned = streaming.pinned_chain(config, root)
    if plan.refusal is None and pinned is None:
        return plan
    extract = next((s for s in plan.stages if s.name == "extract"), None)
    if extract is None:
        return plan
    w = plan.workload
    per_token = w["hidden_state_bytes_per_token"]
    n, epochs = int(config["extract"]["partitions"]), streaming.chain_epochs(config)
    exact = streaming.train_partition_tokens(config, root, target) if n > 1 else None
    shard_tokens = int(config["extract"]["shard_tokens"])
    if exact:
        part_tokens = max(exact)
    else:   # partitions are runs of whole shards
        shards = max(1, math.ceil(w["train_tokens"] / shard_tokens))
        part_tokens = min(w["train_tokens"], math.ceil(shards / n) * shard_tokens)
    if n > 1 and (exact and min(exact) == 0 or w["train_tokens"] < n * shard_tokens):
        plan.refusal = (plan.refusal or "storage budget: the plan does not fit.") + (
            f"\n  - streaming needs at least one shard per partition: extract.shard_tokens "
            f"{shard_tokens:,} with {w['train_tokens']:,} train tokens makes fewer than "
            f"extract.partitions = {n} shards; set extract.shard_tokens <= {w['train_tokens'] // n:,}")
        return plan
    # Shard headers hold ~40 bytes of sample id per sample (as in the full projection).
    part_bytes = part_tokens * per_token + math.ceil(w["train_samples"] / n) * 40
    eval_bytes = w["eval_tokens"] * per_token + w["eval_samples"] * 40
    full_bytes = proj["extract"][0]
    # The previous link's final checkpoint and outputs (fp32 weights) stay until the next
    # link is consumed.
    previous_link = w["checkpoint_bytes"] + 4 * w["draft_params"]
    if pinned is not None:
        chain = streaming.Chain(pinned.partitions, pinned.epochs, pinned.in_flight, part_bytes)
    else:
        allowed = allowed_peak(plan, config, root)
        # What the extract row holds besides this run's hidden states (old fingerprints).
        others = extract.bytes - max(0, full_bytes) if extract.status == "run" else 0
        room = allowed - (plan.peak_bytes - extract.bytes) - max(0, others) - eval_bytes - previous_link
        chain, why = streaming.chain_from_budget(n, epochs, room, part_bytes)
        if chain is None:
            if why:
                plan.refusal = (plan.refusal or "storage budget: the plan does not fit.") + f"\n  - {why}"
            return plan
    b, _, s, sb = proj["extract"]
    streamed = dict(proj)
    streamed["extract"] = (eval_bytes + chain.in_flight * part_bytes,
                           f"streamed: eval + {chain.in_flight} of {n} partitions x {part_tokens:,} tokens x "
                           f"{per_token:,} B", s * epochs, sb + (f", x {epochs} epochs" if epochs > 1 else ""))
    tb, tbb, ts, tsb = proj["train"]
    streamed["train"] = (tb + previous_link, tbb + " + the previous link's", ts, tsb)
    # The previous link's run and outputs are this run's too (counted in the train row).
    plan = assemble(streamed, {**FINGERPRINTED, "cache/train": 2, "cache/streaming": 2})
    plan.workload["streaming"] = {**chain.to_json(), "part_tokens": part_tokens, "pinned": pinned is not None}
    plan.notes.append(chain.describe() + (" (pinned by results/streaming/chain.json)" if pinned else ""))
    return plan


# A DFlash checkpoint: fp32 weights and AdamW's two moments, plus the run's state.
DFLASH_CHECKPOINT_BYTES_PER_PARAM = 12


def dflash_train_projection(config: dict, target: dict, aux_ids: list[int], work: dict, rate):
    """``(trainable params, one checkpoint's bytes, (bytes, what, seconds, basis))`` of a DFlash draft's training
    (train.method dflash). Per context row of a step: the context projections (fc, every
    layer's k/v) run on every row, the layers and the frozen lm_head (forward and input
    gradient) on the anchors' block slots only."""
    d = config["dflash"]
    cfg = DFlashConfig.from_target_config(target, d["block_size"], 0, d["num_hidden_layers"], aux_ids, d["draft"])
    params = cfg.trainable_params()
    sample_tokens = work["train_tokens"] / max(work["train_samples"], 1)
    slot_share = min(1.0, d["anchors_per_sample"] * d["block_size"] / max(sample_tokens, 1.0))
    context_params = cfg.num_aux * cfg.target_hidden_size * cfg.hidden_size + cfg.num_hidden_layers * 2 * (
        cfg.hidden_size * cfg.num_key_value_heads * cfg.head_dim)
    flops_per_token = 6 * context_params + slot_share * (6 * params + 4 * cfg.hidden_size * cfg.vocab_size)
    r, rb = rate("train", flops_per_token)
    rows = d["steps"] * d["samples_per_step"] * sample_tokens
    checkpoint = params * DFLASH_CHECKPOINT_BYTES_PER_PARAM
    return params, checkpoint, (DFLASH_KEEP_CHECKPOINTS * checkpoint + params * 4 + d["steps"] * 400,
                                f"DFlash: {params / 1e6:.2f}M draft params, {DFLASH_CHECKPOINT_BYTES_PER_PARAM} "
                                f"B/param x {DFLASH_KEEP_CHECKPOINTS} checkpoints (+1 while one is written) + weights",
                                rows / r + ASSUMED_STAGE_START_S,
                                f"{r:,.0f} context tokens/s, {rb} + {ASSUMED_STAGE_START_S:.0f}s start")
