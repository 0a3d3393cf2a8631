"""Evaluate an exported EAGLE-3 draft: vLLM's own acceptance, losslessness, and our simulation.

Four measurements, all written to ``summary.json`` (docs/formats.md, Evaluation):

1. vLLM, served as it will be: the target alone (baseline) and the target with the
   exported draft (``method: eagle3``), greedy, on the held-out prompts rendered once
   with the target's chat template. From vLLM's spec-decode counters:
   ``acceptance_length = 1 + accepted / drafts`` and per-position acceptance
   ``accepted_per_pos / drafts``. Lossless check: greedy outputs identical per prompt,
   except where the first divergence is a numerical near-tie of the target's own logits,
   read from the baseline engine's raw logits (eagle3flow/eval/agreement.py states the
   rule); near-ties are counted apart.
   Speedup = output tokens/s ratio (reported, meaningless on CPU).
2. The same acceptance simulated on vLLM's own baseline outputs (``evaluate.replay``: where
   the target fits one device, eagle3flow/eval/replay.py ``replay_decision``): the HF target captures
   the aux states of ``prompt + output``, the draft predicts its chains
   (``Eagle3Draft.predict_chains``) and ``replay_greedy_speculation`` replays greedy
   speculative decoding round by round (eagle3flow/eval/replay.py). This is the number that must agree with (1);
   ``agreement = simulated / vLLM``.
3. Teacher-forced per-step accuracy and simulated acceptance on the eval split
   (eagle3flow/train/eval_split.py on the eval manifest).
4. At each sampling temperature of ``evaluate.temperatures`` (the same engines, sampled
   after the greedy run; eagle3flow/eval/at_temperature.py): vLLM's acceptance length with a
   bootstrap interval over prompts, losslessness as a distributional test (the answers'
   leading tokens with and without the draft, same prompts and seeds), and, where the
   replay runs, the offline estimate of acceptance under rejection sampling along the
   target's own sampled answers (replay.estimate_at_temperature), checked against that
   interval. Under ``summary.json``'s ``by_temperature``; the greedy keys stay as they were.
5. The same for more prompt sets (MT-bench question files, answered turn by turn, or
   any ``{"id", "messages"}`` file, per category: eagle3flow/eval/prompt_sets.py) and more drafts side by side (one
   vLLM engine per draft, all on the same baseline outputs), and the replayed
   acceptance length for every K up to the draft's TTT steps from the one baseline run
   (``acceptance_length_vs_k``); optionally vLLM itself at more Ks (``vllm_sweep_k``).

Resumable: each vLLM run's result and each prompt's replay are kept next to
``summary.json`` (``vllm_baseline.json``, ``vllm_eagle3.json``, ``replay.jsonl``), keyed
by a fingerprint of everything that determines them, and reused on a rerun
(eagle3flow/eval/cache.py). The per-set numbers and their agreement:
eagle3flow/eval/aggregate.py, eagle3flow/eval/agreement.py.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from eagle3flow.export.load import load_exported_draft
from eagle3flow.atomic import write_json
from eagle3flow.config import EVALUATE_BORROWED, cli_settings, schema_defaults
from eagle3flow.eval.aggregate import generation_units, set_result, vllm_acceptance
from eagle3flow.eval.at_temperature import temperature_key, temperature_row
from eagle3flow.eval.agreement import compare_outputs, lossless_text
from eagle3flow.eval.cache import cached_vllm_run, dir_stamp, fingerprint
from eagle3flow.eval.prompt_sets import load_prompt_set, longest_context
from eagle3flow.eval.dflash_replay import simulate_dflash_on_outputs
from eagle3flow.eval.replay import (REPLAY_VERSION, draft_layer_ids, draft_method, estimate_at_temperature,
                                    read_draft_config, replay_decision, resolve_precision, simulate_on_outputs)
from eagle3flow.progress import Progress
from eagle3flow.serving.vllm_runner import is_mla
from eagle3flow.target.config import load_target_config
from eagle3flow.target.remote_code import check_remote_code
from eagle3flow.target.tokenizer import load_tokenizer
from eagle3flow.train.eval_split import evaluate_split

# The config's `evaluate` section with its defaults (schemas/config.schema.yaml).
EVAL_DEFAULTS = schema_defaults("evaluate")


@dataclass
class EvalOptions:
    """The settings of :func:`evaluate`: the config's ``evaluate`` section (defaults: EVAL_DEFAULTS).

    Prompt sets: ``eval`` (the held-out prompts, first ``num_prompts``; None: all) plus
    ``prompt_sets {name: jsonl}`` and the ``optional_prompt_sets`` whose file exists
    (:func:`load_prompt_set`; first ``prompt_set_num_prompts`` rows each). Drafts: the
    main one (named ``draft_name``) plus ``compare_drafts {name: exported draft dir}``,
    each served by vLLM at ``num_speculative_tokens`` (K) on every set and replayed for
    K = 1..``replay_max_k`` (default K) on the baseline's outputs. ``vllm_sweep_k``: more
    Ks every draft is served at (one engine each). ``agreement_tolerance``: how far
    simulated / vLLM acceptance may be from 1. ``eval_split_max_tokens`` caps the eval
    split's step accuracy. ``replay``: auto / true / false (:func:`replay_decision`).
    ``temperatures``: the sampling temperatures measured besides greedy (None: greedy
    alone), ``samples_per_prompt`` answers a prompt each, seeded from ``sample_seed``;
    ``confidence``, ``lossless_positions``, ``lossless_false_alarm_rate``: their interval and
    lossless test (measurement 4).
    """
    num_speculative_tokens: int = EVAL_DEFAULTS["num_speculative_tokens"]
    max_tokens: int = EVAL_DEFAULTS["max_tokens"]
    num_prompts: int | None = EVAL_DEFAULTS["num_prompts"]
    device: str = EVAL_DEFAULTS["device"]
    dtype: str = EVAL_DEFAULTS["dtype"]
    max_model_len: int | None = EVAL_DEFAULTS["max_model_len"]
    tensor_parallel_size: int | None = EVAL_DEFAULTS["tensor_parallel_size"]
    vllm_python: str | None = EVAL_DEFAULTS["vllm_python"]
    ignore_eos: bool = EVAL_DEFAULTS["ignore_eos"]
    eval_split_max_tokens: int | None = EVAL_DEFAULTS["eval_split_max_tokens"]
    agreement_tolerance: float = EVAL_DEFAULTS["agreement_tolerance"]
    draft_name: str = EVAL_DEFAULTS["draft_name"]
    prompt_sets: dict = field(default_factory=dict)
    optional_prompt_sets: dict = field(default_factory=dict)
    prompt_set_num_prompts: int | None = EVAL_DEFAULTS["prompt_set_num_prompts"]
    compare_drafts: dict = field(default_factory=dict)
    replay_max_k: int | None = EVAL_DEFAULTS["replay_max_k"]
    vllm_sweep_k: list = field(default_factory=list)
    replay: str | bool = EVAL_DEFAULTS["replay"]
    temperatures: list | None = EVAL_DEFAULTS["temperatures"]
    samples_per_prompt: int = EVAL_DEFAULTS["samples_per_prompt"]
    sample_seed: int = EVAL_DEFAULTS["sample_seed"]
    confidence: float = EVAL_DEFAULTS["confidence"]
    lossless_positions: int = EVAL_DEFAULTS["lossless_positions"]
    lossless_false_alarm_rate: float = EVAL_DEFAULTS["lossless_false_alarm_rate"]


def job_gpus(torch_device: torch.device, vllm_python: str | None) -> int:
    """vLLM's tensor parallelism left unset (evaluate.tensor_parallel_size null on a node
    with GPUs): every GPU this job sees (the stage wrapper gave it the node's
    resources.gpus). Where this interpreter's torch runs on the CPU and runs vLLM too,
    vLLM is the CPU build: 1, not one engine worker per GPU the job was given. A separate
    vLLM (``vllm_python``) takes the devices CUDA_VISIBLE_DEVICES names."""
    if torch_device.type == "cuda":
        return max(1, torch.cuda.device_count())
    visible = [d for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
    return max(1, len(visible)) if vllm_python else 1


def safe_name(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in name)


def evaluate(draft_dir, target_path, eval_prompts_jsonl, eval_manifest, out_json,
             options: EvalOptions | None = None, trust_remote_code: bool = False) -> dict:
    """Run the whole evaluation and write ``out_json`` (summary); returns the summary dict.

    ``draft_dir``: the exported draft; ``eval_manifest`` may be None to skip the
    eval-split step accuracy; everything else is ``options`` (:class:`EvalOptions`).
    The top-level ``vllm``/``simulated``/``lossless``/... keys are the main draft's on
    ``eval``; ``results[set][draft]`` holds every pair. ``trust_remote_code``
    (``target.trust_remote_code``) goes to every load of the target: its tokenizer, the vLLM
    engines and the HF target of the replay.
    """
    o = options or EvalOptions()
    draft_dir, target_path, out_json = Path(draft_dir), Path(target_path), Path(out_json)
    draft_name, max_tokens = o.draft_name, o.max_tokens
    k = int(o.num_speculative_tokens)
    if k < 1:
        raise ValueError(f"num_speculative_tokens must be >= 1, got {k}")
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    if not Path(eval_prompts_jsonl).is_file():
        raise FileNotFoundError(f"{eval_prompts_jsonl}: eval prompts file missing")
    sampled = sampled_temperatures(o)
    sweep = sorted({int(x) for x in (o.vllm_sweep_k or [])})
    if any(x < 1 for x in sweep):
        raise ValueError(f"vllm_sweep_k: every K must be >= 1, got {sweep}")
    drafts = {draft_name: draft_dir}
    for name, path in (o.compare_drafts or {}).items():
        if name in drafts:
            raise ValueError(f"compare_drafts: name {name!r} is taken (the new draft is "
                             f"{draft_name!r}); pick another")
        drafts[name] = Path(path)
    draft_configs = {name: read_draft_config(path) for name, path in drafts.items()}
    methods = {name: draft_method(c) for name, c in draft_configs.items()}
    k = dflash_k(draft_configs, methods, k)
    max_k = max(k, int(o.replay_max_k or k)) if methods[draft_name] == "eagle3" else k
    # Optional sets whose file is there (MT-bench beside a checkout), then the required ones.
    extra_sets = {**{name: path for name, path in (o.optional_prompt_sets or {}).items() if Path(path).is_file()},
                  **(o.prompt_sets or {})}
    if "eval" in extra_sets:
        raise ValueError("prompt_sets: 'eval' is the held-out split's name; pick another")
    check_remote_code(target_path, trust_remote_code)   # before anything is written
    out_dir = out_json.parent
    out_dir.mkdir(parents=True, exist_ok=True)
    t_start = time.monotonic()

    tokenizer = load_tokenizer(target_path, trust_remote_code)
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(f"{target_path}: the tokenizer has no chat_template; cannot render "
                         f"the prompts")
    sets = [load_prompt_set("eval", eval_prompts_jsonl, tokenizer, o.num_prompts)]
    sets += [load_prompt_set(name, path, tokenizer, o.prompt_set_num_prompts)
             for name, path in extra_sets.items()]
    longest = max(longest_context(s, tokenizer, int(max_tokens)) for s in sets)
    max_model_len = o.max_model_len
    if max_model_len is None:
        max_model_len = longest + max([k] + sweep) + 8
    elif longest > max_model_len:
        raise ValueError(f"max_model_len {max_model_len} < longest prompt + max_tokens "
                         f"({longest} tokens)")
    torch_device, _, dtype_name = resolve_precision(o.device, o.dtype)
    vllm_device = o.device if o.device == "auto" else torch_device.type
    tensor_parallel_size = o.tensor_parallel_size or job_gpus(torch_device, o.vllm_python)
    mla = is_mla(load_target_config(target_path))
    dense_mla = mla and "dflash" in methods.values()
    if dense_mla:
        print("evaluate: a DFlash draft of an MLA target: where vLLM runs on the CPU, every engine runs the target's "
              "attention dense (VLLM_MLA_DISABLE), since vLLM's CPU MLA and standard attention caches "
              "share no block size", file=sys.stderr, flush=True)
    base_request = {
        "target": str(target_path.resolve()), "max_tokens": int(max_tokens),
        "sets": [{"name": s["name"], "prompts": s["prompts"],
                  "conversations": s["conversations"]} for s in sets],
        "max_model_len": int(max_model_len), "dtype": dtype_name, "device": vllm_device,
        "tensor_parallel_size": int(tensor_parallel_size), "ignore_eos": bool(o.ignore_eos),
        "target_stamp": dir_stamp(target_path),   # only for the fingerprint
        # Only when set: the runs cached before the key existed keep their fingerprints.
        **({"trust_remote_code": True} if trust_remote_code else {}),
        # A DFlash draft of an MLA target: on the CPU every engine runs the target's attention
        # dense (serving/vllm_runner.py); only when so, as above.
        **({"dense_mla_on_cpu": True} if dense_mla else {}),
        # The sampled runs, in the same engines; only when asked for (as above).
        **({"temperatures": sampled, "samples_per_prompt": int(o.samples_per_prompt),
            "sample_seed": int(o.sample_seed)} if sampled else {}),
    }

    def spec_request(name: str, path: Path, num_tokens: int) -> dict:
        request = dict(base_request, speculative_config={
            "method": methods[name], "model": str(Path(path).resolve()),
            "num_speculative_tokens": int(num_tokens)}, draft_stamp=dir_stamp(path))
        if not sampled:
            return request
        if num_tokens != k:     # the K sweep stays greedy: one sampled K is what is reported
            return {key: v for key, v in request.items()
                    if key not in ("temperatures", "samples_per_prompt", "sample_seed")}
        return dict(request, probabilistic_draft=True)

    def run_name(name: str, num_tokens: int) -> str:
        base = "vllm_eagle3" if name == draft_name else f"vllm_eagle3_{safe_name(name)}"
        return base if num_tokens == k else f"{base}_k{num_tokens}"

    # The baseline keeps the engine's two best raw logits per position: they judge a
    # divergence (agreement.compare_outputs) without loading the target again.
    runs = [("vllm_baseline", dict(base_request, top_logits=2))]
    runs += [(run_name(name, x), spec_request(name, path, x)) for x in [k] + [x for x in sweep if x != k]
             for name, path in drafts.items()]
    # Engine runs dominate on GPUs and CPUs alike: count them for the ETA.
    progress = Progress("evaluate[vLLM runs]", total=len(runs), unit="runs", interval=0)
    results = {}
    for name, request in runs:
        results[name] = cached_vllm_run(name, request, out_dir, o.vllm_python)
        progress.update(1, extra=name)
    progress.close()
    baseline = results["vllm_baseline"]
    base_sets = {s["name"]: s for s in baseline["sets"]}

    # Replays are keyed by what determines them: the baseline outputs, the draft, K, dtype.
    units = generation_units(sets, baseline)
    loaded: dict = {}
    by_draft = {name: None for name in drafts}
    walks = {(name, t): None for name in drafts for t in sampled}   # the offline estimates
    replay = replay_decision(o.replay, target_path, o.device, o.dtype)
    print(f"evaluate: replay {'runs' if replay['run'] else 'skipped'}: {replay['reason']}",
          file=sys.stderr, flush=True)
    for name, path in drafts.items():
        if not replay["run"]:
            break
        replay_key = fingerprint([REPLAY_VERSION, baseline["request_fingerprint"],
                                  dir_stamp(path), max_k, dtype_name, torch_device.type])
        replay_file = ("replay.jsonl" if name == draft_name
                       else f"replay_{safe_name(name)}.jsonl")
        if methods[name] == "dflash":
            by_draft[name] = simulate_dflash_on_outputs(path, target_path, units, k, o.device, o.dtype,
                                                        out_dir / replay_file, replay_key, loaded,
                                                        label=f"replay {name}", trust_remote_code=trust_remote_code)
            if sampled:
                print(f"evaluate: no offline estimate at temperature for the DFlash draft {name!r} (EAGLE-3 "
                      "drafts only); vLLM's acceptance and the lossless test still run", file=sys.stderr)
            continue
        by_draft[name] = simulate_on_outputs(path, target_path, units, max_k, o.device, o.dtype,
                                             out_dir / replay_file, replay_key, loaded,
                                             label=f"replay {name}", trust_remote_code=trust_remote_code)
        # The draft proposes as the engine let it: sampled at the temperature, or its argmax.
        probabilistic = results[run_name(name, k)].get("draft_sample_method") == "probabilistic"
        for t, run in zip(sampled, baseline.get("temperature_runs") or []):
            draft_t = t if probabilistic else 0.0
            estimate_key = fingerprint([REPLAY_VERSION, "temperature", t, draft_t, baseline["request_fingerprint"],
                                        dir_stamp(path), k, dtype_name, torch_device.type])
            estimate_file = (f"estimate_t{t:g}.jsonl" if name == draft_name
                             else f"estimate_t{t:g}_{safe_name(name)}.jsonl")
            walks[(name, t)] = {unit: row["by_k"][str(k)] for unit, row in estimate_at_temperature(
                path, target_path, sampled_units(run), k, t, o.device, o.dtype, out_dir / estimate_file,
                estimate_key, loaded, label=f"estimate {name} T={t:g}",
                trust_remote_code=trust_remote_code, draft_temperature=draft_t).items()}
    serving_dtype = baseline["dtype"]

    per_set: dict[str, dict] = {}
    for s in sets:
        per_set[s["name"]] = {}
        for name in drafts:
            spec_sets = {x["name"]: x for x in results[run_name(name, k)]["sets"]}
            per_set[s["name"]][name] = set_result(s, base_sets[s["name"]],
                                                  spec_sets[s["name"]], by_draft[name], k,
                                                  o.agreement_tolerance, serving_dtype)
    by_temperature = temperature_results(sets, drafts, sampled, baseline,
                                         {name: results[run_name(name, k)] for name in drafts},
                                         walks, draft_name, o)
    k_sweep_by_draft = vllm_k_sweep(sets, drafts, sweep, base_sets,
                                    {(name, x): results[run_name(name, x)] for name in drafts for x in sweep},
                                    serving_dtype)
    loaded.clear()
    k_sweep = {set_name: by_name[draft_name] for set_name, by_name in k_sweep_by_draft.items()}

    eval_split = None
    if eval_manifest is not None and methods[draft_name] == "eagle3":   # DFlash: the trainer's eval.json
        eval_split = evaluate_eval_split(draft_dir, target_path, eval_manifest, max_k, torch_device,
                                         o.eval_split_max_tokens)

    main = per_set["eval"][draft_name]
    speculative = results["vllm_eagle3"]
    summary = {
        "settings": {
            "num_speculative_tokens": k, "num_prompts": len(base_sets["eval"]["outputs"]),
            "max_tokens": int(max_tokens), "replay_max_k": max_k, "vllm_sweep_k": sweep,
            "max_model_len": int(max_model_len), "device": speculative["device"],
            "replay_device": torch_device.type, "dtype": dtype_name,
            "tensor_parallel_size": int(tensor_parallel_size), "ignore_eos": bool(o.ignore_eos),
            "vllm_version": speculative["vllm_version"], "draft": str(draft_dir),
            "target": str(target_path), "eval_prompts": str(eval_prompts_jsonl),
            "eval_manifest": str(eval_manifest) if eval_manifest is not None else None,
            "aux_layer_ids": draft_layer_ids(draft_configs[draft_name]),
            "method": methods[draft_name], "methods": methods,
            "replay": replay,
            "mla_attention": ("dense" if speculative.get("dense_mla") else "latent") if mla else None,
            "temperatures": [0.0] + sampled,
            **({"samples_per_prompt": int(o.samples_per_prompt), "sample_seed": int(o.sample_seed),
                "confidence": float(o.confidence), "lossless_positions": int(o.lossless_positions),
                "lossless_false_alarm_rate": float(o.lossless_false_alarm_rate),
                "draft_sample_method": speculative.get("draft_sample_method"),
                "draft_sample_note": speculative.get("draft_sample_note")} if sampled else {}),
        },
        "main_draft": draft_name,
        "drafts": {name: str(path) for name, path in drafts.items()},
        "prompt_sets": {s["name"]: {
            "source": s["source"], "num_prompts": len(s["category_of"]),
            "num_generations": len(base_sets[s["name"]]["outputs"]),
            "multi_turn": bool(s["conversations"]),
            "categories": sorted(set(s["category_of"].values())),
            "baseline_output_tokens_per_s": base_sets[s["name"]]["output_tokens_per_s"],
            "baseline_num_output_tokens": base_sets[s["name"]]["num_output_tokens"],
        } for s in sets},
        "results": {name: {d: {key: v for key, v in r.items() if key != "per_prompt"}
                           for d, r in by_set.items()} for name, by_set in per_set.items()},
        "vllm_k_sweep": k_sweep,
        "vllm_k_sweep_by_draft": k_sweep_by_draft,
        # The main draft on the held-out prompts, as before sets and drafts existed.
        "vllm": main["vllm"],
        "lossless": main["lossless"],
        "simulated": main["simulated"],
        "acceptance_length_vs_k": main["acceptance_length_vs_k"],
        "agreement": main["agreement"],
        "agreement_tolerance": o.agreement_tolerance,
        "agreement_ok": main["agreement_ok"],
        "round_agreement": main["round_agreement"],
        "eval_split": eval_split,
        "per_prompt": main["per_prompt"],
        # Acceptance at each sampling temperature (measurement 4); greedy is the keys above.
        "by_temperature": by_temperature,
        "elapsed_s": time.monotonic() - t_start,
    }
    write_json(out_json, summary)
    print(format_summary(summary), file=sys.stderr, flush=True)
    return summary


def dflash_k(draft_configs: dict, methods: dict, k: int) -> int:
    """The K every draft is served at: evaluate.num_speculative_tokens, or where a DFlash
    draft is among them its ``block_size - 1`` (a DFlash draft proposes its whole block;
    the others are served at the same K, so the drafts compare at equal K)."""
    blocks = {name: int(draft_configs[name]["block_size"]) - 1 for name, m in methods.items() if m == "dflash"}
    if not blocks:
        return k
    if len(set(blocks.values())) > 1:
        raise ValueError(f"evaluate: DFlash drafts of different block sizes {blocks} (K = block_size - 1) "
                         "cannot be served at one K; compare them in separate evaluations")
    dflash = next(iter(blocks.values()))
    if dflash != k:
        print(f"evaluate: serving at K = {dflash} (the DFlash draft's block_size - 1), not "
              f"evaluate.num_speculative_tokens {k}", file=sys.stderr, flush=True)
    return dflash


def sampled_temperatures(o: EvalOptions) -> list[float]:
    """The temperatures sampled besides greedy (0 always runs: it is the greedy run), sorted,
    each once; a bad one refused naming its key, before anything loads."""
    temperatures = o.temperatures if o.temperatures is not None else []
    if not isinstance(temperatures, (list, tuple)) or any(
            isinstance(t, bool) or not isinstance(t, (int, float)) or t < 0 for t in temperatures):
        raise ValueError(f"evaluate.temperatures: expected a list of numbers >= 0, got {temperatures!r}")
    sampled = sorted({float(t) for t in temperatures if t > 0})
    if sampled and int(o.samples_per_prompt) < 2:
        raise ValueError(f"evaluate.samples_per_prompt: the lossless test at temperature needs "
                         f">= 2 answers a prompt, got {o.samples_per_prompt}")
    if sampled and int(o.lossless_positions) < 1:
        raise ValueError(f"evaluate.lossless_positions: must be >= 1, got {o.lossless_positions}")
    return sampled


def sampled_units(run: dict) -> list[dict]:
    """One sampled run's answers (every set) as the offline estimate takes them."""
    return [{"key": f"{s['name']}/{out['id']}#{out['sample']}", "prompt_token_ids": out["prompt_token_ids"],
             "output_token_ids": out["output_token_ids"]} for s in run["sets"] for out in s["outputs"]]


def temperature_results(sets: list[dict], drafts: dict, sampled: list[float], baseline: dict,
                        speculative: dict, walks: dict, draft_name: str, o: EvalOptions) -> dict:
    """``by_temperature``: per temperature, every draft on every set (at_temperature.py), and
    the main draft on ``eval`` at the top of each (as the greedy keys are)."""
    out = {}
    for i, t in enumerate(sampled):
        base_sets = {x["name"]: x for x in baseline["temperature_runs"][i]["sets"]}
        results: dict = {}
        for s in sets:
            results[s["name"]] = {}
            for name in drafts:
                spec_sets = {x["name"]: x for x in speculative[name]["temperature_runs"][i]["sets"]}
                set_walks = None
                if walks[(name, t)] is not None:
                    prefix = s["name"] + "/"
                    set_walks = {unit[len(prefix):]: walk for unit, walk in walks[(name, t)].items()
                                 if unit.startswith(prefix)}
                results[s["name"]][name] = temperature_row(base_sets[s["name"]], spec_sets[s["name"]],
                                                           set_walks, o)
        main = results["eval"][draft_name]
        out[temperature_key(t)] = {
            "temperature": t, "samples_per_prompt": int(o.samples_per_prompt),
            "draft_sample_method": speculative[draft_name].get("draft_sample_method"),
            "vllm": main["vllm"], "lossless": main["lossless"], "offline": main["offline"],
            "results": results,
        }
    return out


def vllm_k_sweep(sets: list[dict], drafts: dict, sweep: list[int], base_sets: dict, runs: dict,
                 dtype: str | None = None) -> dict:
    """vLLM itself at every swept K, for every draft: ``{set: {draft: {K: acceptance}}}``;
    ``runs[(draft, K)]``: that engine run's result."""
    k_sweep_by_draft = {}
    for s in sets:
        k_sweep_by_draft[s["name"]] = {}
        for name in drafts:
            by_k = k_sweep_by_draft[s["name"]][name] = {}
            for x in sweep:
                spec_set = {y["name"]: y for y in runs[(name, x)]["sets"]}[s["name"]]
                acc = vllm_acceptance(spec_set["spec_decode"], base_sets[s["name"]], spec_set)
                acc["lossless"] = compare_outputs(base_sets[s["name"]]["outputs"],
                                                  spec_set["outputs"], dtype)["passed"]
                by_k[str(x)] = acc
    return k_sweep_by_draft


def evaluate_eval_split(draft_dir: Path, target_path: Path, eval_manifest, k: int, torch_device,
                        max_tokens: int | None) -> dict:
    """Teacher-forced step accuracy and simulated acceptance on the eval split (measurement 3)."""
    print(f"evaluate: step accuracy on {eval_manifest}", file=sys.stderr, flush=True)
    # float32 like training's own eval, so the numbers compare with metrics.jsonl.
    draft = load_exported_draft(draft_dir, target_path, dtype=torch.float32,
                                      device=torch_device).eval()
    return evaluate_split(draft, eval_manifest, k, max_tokens=max_tokens)


def _fmt(x, spec=".3f"):
    return "n/a" if x is None else format(x, spec)


def format_summary(s: dict) -> str:
    v, sim, loss = s["vllm"], s["simulated"], s["lossless"]
    lines = [
        f"evaluate: K={s['settings']['num_speculative_tokens']} prompts={s['settings']['num_prompts']} "
        f"max_tokens={s['settings']['max_tokens']} device={s['settings']['device']} "
        f"vllm={s['settings']['vllm_version']}",
        f"  vLLM acceptance length   {_fmt(v['acceptance_length'])}  per position "
        f"[{', '.join(_fmt(a) for a in v['acceptance_rate_per_position'])}]",
        *([f"  simulated (replay)       {_fmt(sim['acceptance_length'])}  per position "
           f"[{', '.join(_fmt(a) for a in sim['acceptance_rate_per_position'])}]",
           f"  agreement sim/vLLM       {_fmt(s['agreement'])} "
           f"({'ok' if s['agreement_ok'] else 'OUTSIDE'} +-{s['agreement_tolerance']:.0%})"] if sim else
          [f"  replay                   skipped: {s['settings']['replay']['reason']}"]),
        f"  lossless greedy          {lossless_text(loss)}"
        f"{' real: ' + ', '.join(map(str, loss['real_mismatch_ids'][:5])) if loss.get('real_mismatch_ids') else ''}"
        f"{' near-tie: ' + ', '.join(map(str, loss['near_tie_ids'][:5])) if loss.get('near_tie_ids') else ''}",
        f"  tokens/s                 baseline {_fmt(v['baseline_output_tokens_per_s'], '.1f')}, "
        f"eagle3 {_fmt(v['eagle3_output_tokens_per_s'], '.1f')}, speedup {_fmt(v['speedup'], '.2f')}x",
    ]
    if s.get("acceptance_length_vs_k"):
        lines.append("  replayed AL vs K          " + ", ".join(
            f"K={j}: {_fmt(a, '.2f')}" for j, a in s["acceptance_length_vs_k"].items()))
    for set_name, by_draft in (s.get("results") or {}).items():
        for draft, r in by_draft.items():
            lines.append(f"  [{set_name}] {draft:<12} vLLM AL {_fmt(r['vllm']['acceptance_length'])}"
                         f"  replay AL {_fmt((r['simulated'] or {}).get('acceptance_length'))}"
                         f"  speedup {_fmt(r['vllm']['speedup'], '.2f')}x"
                         f"  lossless {lossless_text(r['lossless'])}")
    for row in (s.get("by_temperature") or {}).values():
        v, off, loss = row["vllm"], row["offline"], row["lossless"]
        lines.append(f"  T={row['temperature']:g} vLLM AL {_fmt(v['acceptance_length'])} "
                     f"[{_fmt(v['ci_low'])}, {_fmt(v['ci_high'])}] ({v['confidence']:.0%} CI, "
                     f"{row['samples_per_prompt']} samples a prompt, draft {row['draft_sample_method']})"
                     f"  offline {_fmt((off or {}).get('acceptance_length'))}"
                     f"{'' if not off else (' in CI' if off['within_ci'] else ' OUTSIDE CI')}"
                     f"  lossless {'PASS' if loss['passed'] else 'FAIL'} (p={_fmt(loss['p_value'])})")
    if s.get("eval_split"):
        e = s["eval_split"]
        lines.append(f"  eval split step accuracy [{', '.join(_fmt(a) for a in e['step_accuracy'])}], "
                     f"acceptance (decode walk) {e.get('decode_acceptance_length')}")
    return "\n".join(lines)


def main(argv=None) -> None:
    """CLI: artifact paths as flags, the settings as one ``--config-json '<the evaluate config
    section>'`` (keys: EVAL_DEFAULTS, and trust_remote_code, target.trust_remote_code: run
    the target's own code; what it leaves out takes the schema's default).

    python -m eagle3flow.eval.evaluate --draft results/draft --target DIR \\
        --eval-prompts results/dataset/eval_prompts.jsonl \\
        --eval-manifest results/hidden_states/eval/manifest.json \\
        --out results/eval/summary.json --config-json '{"num_speculative_tokens": 3, ...}'
    """
    parser = argparse.ArgumentParser(prog="python -m eagle3flow.eval.evaluate", description=main.__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--draft", required=True, help="exported draft dir (config.json + model.safetensors)")
    parser.add_argument("--target", required=True, help="HF target model dir")
    parser.add_argument("--eval-prompts", required=True, help="eval_prompts.jsonl")
    parser.add_argument("--eval-manifest", default=None,
                        help="eval hidden-state manifest.json (omit to skip step accuracy)")
    parser.add_argument("--out", required=True, help="summary.json to write")
    parser.add_argument("--config-json", default="{}",
                        help="the evaluate section: JSON object of EVAL_DEFAULTS keys, and trust_remote_code")
    parser.add_argument("--prompt-set", action="append", default=[], metavar="NAME=JSONL",
                        help="another prompt set (MT-bench questions or {id, messages} rows); repeat")
    parser.add_argument("--compare-draft", action="append", default=[], metavar="NAME=DIR",
                        help="another exported draft evaluated side by side; repeat")
    args = parser.parse_args(argv)
    config = cli_settings(parser, "evaluate", args.config_json, borrowed=EVALUATE_BORROWED)
    trust_remote_code = config.pop("trust_remote_code")
    if config["num_prompts"] is not None and int(config["num_prompts"]) <= 0:
        config["num_prompts"] = None
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    evaluate(args.draft, args.target, args.eval_prompts, args.eval_manifest, args.out, EvalOptions(**config),
             trust_remote_code=trust_remote_code)


if __name__ == "__main__":
    main()
