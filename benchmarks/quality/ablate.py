"""Which training settings make the draft better: a grid of the trainer's knobs on one GPU.

The quality benchmark (run.py) trains on the CPU, an hour per draft; this runs the
same data (the benchmark's tokenized train/eval split) through the project's own
extraction and trainer on a GPU, where a draft trains in seconds, to choose the
defaults the CPU benchmark then confirms. Each variant trains the benchmark's budget
(epochs, batch tokens, TTT steps, draft vocab) and is scored by the simulated
acceptance length: on the eval split, and on each ``--score`` split, the decode walk of
eagle3flow/train/eval_split.py (``decode_acceptance_length``), which on the target's own
greedy answers is what greedy speculative decoding measures. ``splits`` makes two such
splits from an evaluation run's baseline outputs (the target's greedy answers in vLLM,
128 tokens): the held-out prompts and MT-bench first turns, the benchmark's own traffic.

Stage 1 sweeps the learning rate for each optimizer; stage 2 adds each other knob on
top of the best of stage 1; stage 3 combines the knobs that helped and repeats the
best and the baseline over seeds::

    python benchmarks/quality/ablate.py --gguf SmolLM2-135M-Instruct.Q4_1.gguf \\
        --train train.parquet --eval eval.parquet --work /tmp/ablate --out ablate.json [--grid grid.json]
    python benchmarks/quality/ablate.py splits <work>/eval/vllm_baseline.json <dir>  # eval128, mt_bench128
    python benchmarks/quality/ablate.py table ablate_round*.json     # the markdown tables
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import torch

from eagle3flow.eval.dflash_replay import dflash_chains
from eagle3flow.eval.replay import replay_greedy_speculation
from eagle3flow.extract.shards import load_manifest
from eagle3flow.train.build import load_trained
from eagle3flow.train.dflash_train import load_train_dir
from eagle3flow.train.eval_split import evaluate_split
from eagle3flow.train.trainer import train

BUDGET = {"epochs": 3, "batch_tokens": 2048, "ttt_steps": 7}
DRAFT_VOCAB = 8192


def prepare(args) -> tuple[Path, Path, Path, Path]:
    work = args.work
    target = work / "target"
    if not (target / "config.json").is_file():
        subprocess.run([sys.executable, "-m", "eagle3flow.target.pretrained", "--out-dir", target,
                        "--gguf", args.gguf], check=True)
    manifests = extract_splits(args, target, work / "hs", {})
    vocab = work / "vocab_map.safetensors"
    if not vocab.is_file():
        subprocess.run([sys.executable, "-m", "eagle3flow.data.vocab", "--dataset", args.train, "--target", target,
                        "--config-json", json.dumps({"draft_vocab_size": DRAFT_VOCAB}), "--out", vocab,
                        "--stats", work / "vocab.json"],
                       check=True)
    return target, manifests / "train.json", manifests / "eval.json", vocab


def extract_splits(args, target: Path, manifests: Path, layers: dict) -> Path:
    """Every split's hidden states into ``manifests`` (train, eval and each ``--score``);
    ``layers``: extraction settings choosing the layers (none: the EAGLE-3 default)."""
    splits = {"train": args.train, "eval": args.eval, **dict(args.score)}
    if not all((manifests / f"{name}.json").is_file() for name in splits):
        settings = {"device": args.device, "dtype": "bfloat16" if args.device == "cuda" else "float32",
                    "max_length": 1024, **layers}
        command = [sys.executable, "-m", "eagle3flow.extract", "--target", target,
                   "--cache-root", args.work / "cache", "--config-json", json.dumps(settings)]
        for name, dataset in splits.items():
            command += ["--split-name", name, "--dataset", dataset, "--manifest", manifests / f"{name}.json"]
        subprocess.run(command, check=True)
    return manifests


def score(name: str, overrides: dict, paths, work: Path, results: dict, args=None) -> dict:
    if name in results:
        return results[name]
    if overrides.get("method") == "dflash":
        return score_dflash(name, overrides, paths, work, results, args)
    target, train_manifest, eval_manifest, vocab = paths
    config = {**BUDGET, "checkpoint_every": 10_000, "log_every": 50, **overrides}
    t0 = time.monotonic()
    out = train(train_manifest, eval_manifest, vocab, target, work / "out" / name, work / "ckpt", config)
    seconds = round(time.monotonic() - t0, 1)
    al = out["simulated_acceptance_length"]
    row = {"overrides": overrides, "al3": al["3"], "al7": al["7"], "step_accuracy": out["step_accuracy"],
           "seconds": seconds, "decode": {"eval": out["decode_acceptance_length"]}}
    model = load_trained(work / "out" / name, target, "cuda" if torch.cuda.is_available() else "cpu")
    for split in score_splits(work):
        manifest = load_manifest(work / "hs" / f"{split}.json")
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=torch.cuda.is_available()):
            if sampled_at(split) is None:
                row["decode"][split] = evaluate_split(model, manifest, config["ttt_steps"])["decode_acceptance_length"]
            else:
                # the offline estimate at temperature along the target's own sampled answers
                estimate = evaluate_split(model, manifest, config["ttt_steps"], temperature=sampled_at(split))
                row.setdefault("rejection", {})[split] = estimate["rejection_acceptance_length"]
    results[name] = row
    walks = " ".join(f"{s} {d['3']:.3f}/{d['7']:.3f}" for s, d in row["decode"].items())
    at_t = " ".join(f"{s} {d[str(config['ttt_steps'])]:.3f}" for s, d in row.get("rejection", {}).items())
    print(f"ablate: {name:40s} AL@3 {row['al3']:.4f} AL@7 {row['al7']:.4f} decode@3/7 {walks} {at_t} "
          f"({seconds}s) {overrides}", file=sys.stderr, flush=True)
    return row


def score_splits(work: Path) -> list[str]:
    return sorted(p.stem for p in (work / "hs").glob("*.json") if p.stem not in ("train", "eval"))


def sampled_at(split: str) -> float | None:
    """The temperature a ``<name>_t<T>`` split's answers were sampled at (gpu_data.py
    ``--eval-temperature``); None for the greedy splits."""
    head, _, tail = split.rpartition("_t")
    try:
        return float(tail) if head else None
    except ValueError:
        return None


def score_dflash(name: str, overrides: dict, paths, work: Path, results: dict, args) -> dict:
    """A DFlash draft (``{"method": "dflash", ...the dflash section}``) on the same data at
    the same training tokens as an EAGLE-3 variant: ``BUDGET["epochs"]`` passes over the
    train split's samples (steps = epochs x samples / samples_per_step), each step reading
    whole samples as the EAGLE-3 trainer's batches do; scored by the exact greedy block
    replay (eagle3flow/eval/dflash_replay.py) on each greedy split at K = block_size - 1."""
    target = paths[0]
    settings = {k: v for k, v in overrides.items() if k != "method"}
    layers = settings.pop("num_hidden_layers", 1)
    aux = settings.pop("aux_layer_ids", None)   # None: the DFlash default for this many draft layers
    hs = extract_splits(args, target, work / ("hs-" + "-".join(map(str, aux)) if aux else f"hs-dflash{layers}"),
                        {"aux_layer_ids": aux} if aux else {"draft_method": "dflash", "dflash_layers": layers})
    train_manifest = load_manifest(hs / "train.json")
    samples_per_step = settings.setdefault("samples_per_step", 8)
    samples = train_manifest.data["num_samples"]
    settings.setdefault("steps", max(1, round(BUDGET["epochs"] * samples / samples_per_step)))
    config = {**settings, "num_hidden_layers": layers, "device": args.device, "checkpoint_every": 10_000}
    t0 = time.monotonic()
    out = work / "out" / name
    subprocess.run([sys.executable, "-m", "eagle3flow.train.dflash_train", "--train-manifest", hs / "train.json",
                    "--eval-manifest", hs / "eval.json", "--target", target, "--out-dir", out,
                    "--cache-root", work / "ckpt-dflash", "--config-json", json.dumps(config)], check=True)
    seconds = round(time.monotonic() - t0, 1)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = load_train_dir(out, target).to(device)
    k = model.config.num_speculative_tokens
    row = {"overrides": overrides, "method": "dflash", "steps": config["steps"], "seconds": seconds,
           "training_tokens": config["steps"] * samples_per_step * train_manifest.num_tokens / samples,
           "eval": json.loads((out / "eval.json").read_text()), "decode": {}}
    for split in score_splits(work):
        if sampled_at(split) is not None:
            continue
        rounds = accepted = 0
        per_pos = [0] * k
        with torch.no_grad():
            for sample in load_manifest(hs / f"{split}.json").iter_samples():
                ids = sample["input_ids"].long()
                prompt_len = int(sample["loss_mask"].nonzero()[0]) if sample["loss_mask"].any() else ids.numel()
                chains = dflash_chains(model, sample["aux_hidden_states"].float().to(device), ids.to(device)).cpu()
                replay = replay_greedy_speculation(chains, ids.tolist(), prompt_len)
                rounds += replay["rounds"]
                accepted += replay["accepted"]
                per_pos = [a + b for a, b in zip(per_pos, replay["accepted_per_pos"])]
        row["decode"][split] = {str(k): 1.0 + accepted / rounds if rounds else None,
                                "per_position": [a / rounds for a in per_pos] if rounds else None}
    results[name] = row
    walks = " ".join(f"{s} {d[str(k)]:.3f}" for s, d in row["decode"].items())
    print(f"ablate: {name:40s} DFlash K={k} decode {walks} ({seconds}s, {config['steps']} steps) {overrides}",
          file=sys.stderr, flush=True)
    return row


def baseline_splits(baseline: Path, out_dir: Path) -> None:
    """``eval128.parquet`` and ``mt_bench128.parquet`` (the dataset stage's columns) from an
    evaluation's ``vllm_baseline.json``: each prompt's tokens then the target's greedy answer
    in vLLM, the answer masked in. MT-bench rows are those whose id starts with ``mt``."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    outputs = json.loads(baseline.read_text())["outputs"]
    out_dir.mkdir(parents=True, exist_ok=True)
    for name, rows in (("eval128", [o for o in outputs if not o["id"].startswith("mt")]),
                       ("mt_bench128", [o for o in outputs if o["id"].startswith("mt")])):
        ids = [o["prompt_token_ids"] + o["output_token_ids"] for o in rows]
        masks = [[0] * len(o["prompt_token_ids"]) + [1] * len(o["output_token_ids"]) for o in rows]
        pq.write_table(pa.table({"id": [o["id"] for o in rows], "input_ids": ids, "loss_mask": masks,
                                 "num_tokens": [len(x) for x in ids]}), out_dir / f"{name}.parquet")
        print(f"{out_dir / name}.parquet: {len(rows)} rows, {sum(map(len, ids))} tokens")


def markdown(paths: list[Path]) -> str:
    """The rounds' results as one markdown table per round. ``AL`` = the per-row mean on
    the eval split (rounds 1-5 chose by it); ``decode`` = the decode walk, what greedy
    speculative decoding measures (round 6 on), on the 128-token held-out and MT-bench splits."""
    out = []
    for path in paths:
        data = json.loads(path.read_text())
        rows = data["results"]
        base = rows.get("baseline")
        walked = any("decode" in row for row in rows.values())
        out.append(f"**{path.name}** ({data['device']}, budget {data['budget']}, draft vocab "
                   f"{data['draft_vocab_size']})\n")
        if walked:
            out.append("| variant | decode held-out @3 | @7 | decode MT-bench @3 | @7 | settings over the defaults |")
            out.append("| --- | --- | --- | --- | --- | --- |")
        else:
            out.append("| variant | AL@3 | AL@7 | settings over the trainer's defaults of the time |")
            out.append("| --- | --- | --- | --- |")
        for name, row in rows.items():
            if walked and row.get("method") == "dflash":
                # one block size: the acceptance length at K = block size - 1, in the @7 columns
                held, mt = row["decode"]["eval128"], row["decode"]["mt_bench128"]
                k = next(key for key in held if key != "per_position")
                out.append(f"| {name} (DFlash, K={k}) | - | {held[k]:.3f} | - | {mt[k]:.3f} | "
                           f"`{json.dumps(row['overrides'])}` |")
            elif walked:
                held, mt = row["decode"]["eval128"], row["decode"]["mt_bench128"]
                at_t = "".join(f" {split} @{k}: {v[k]:.3f};" for split, v in row.get("rejection", {}).items()
                               for k in v)
                out.append(f"| {name} | {held['3']:.3f} | {held['7']:.3f} | {mt['3']:.3f} | {mt['7']:.3f} | "
                           f"`{json.dumps(row['overrides'])}`{at_t} |")
            else:
                out.append(f"| {name} | {row['al3']:.3f} | {row['al7']:.3f} | `{json.dumps(row['overrides'])}` |")
        if base:
            out.append("\n(baseline: the defaults before this issue, AdamW lr 1e-4)")
        out.append("")
    return "\n".join(out)


def main(argv=None) -> int:
    if argv is None and len(sys.argv) > 1 and sys.argv[1] == "table":
        print(markdown([Path(p) for p in sys.argv[2:]]))
        return 0
    if argv is None and len(sys.argv) == 4 and sys.argv[1] == "splits":
        baseline_splits(Path(sys.argv[2]), Path(sys.argv[3]))
        return 0
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--gguf", type=Path, required=True)
    parser.add_argument("--train", type=Path, required=True)
    parser.add_argument("--eval", type=Path, required=True)
    parser.add_argument("--work", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--stages", default="1,2,3", help="comma-separated; empty: the baseline only")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--score", action="append", default=[], type=lambda s: tuple(s.split("=", 1)),
                        metavar="NAME=PARQUET", help="another split to score each variant on (decode walk)")
    parser.add_argument("--grid", type=Path, default=None,
                        help="JSON {name: train overrides}: score exactly these instead of the stages")
    args = parser.parse_args(argv)
    args.work.mkdir(parents=True, exist_ok=True)
    paths = prepare(args)
    # A rerun with the same --out continues: variants already scored there are kept.
    results: dict = json.loads(args.out.read_text())["results"] if args.out.is_file() else {}

    def save():
        args.out.write_text(json.dumps({"budget": BUDGET, "draft_vocab_size": DRAFT_VOCAB,
                                        "device": torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu",
                                        "results": results}, indent=1))

    def best_of(names):
        return max(names, key=lambda n: results[n]["al7"] + results[n]["al3"])

    if args.grid:
        for name, overrides in json.loads(args.grid.read_text()).items():
            score(name, overrides, paths, args.work, results, args)
            save()
        return 0
    stages = {int(s) for s in args.stages.split(",") if s}
    score("baseline", {}, paths, args.work, results)
    save()
    lrs = {"adamw": [3e-4, 1e-3, 3e-3], "muon": [3e-4, 1e-3, 3e-3]}
    stage1 = ["baseline"]
    if 1 in stages:
        for optimizer, values in lrs.items():
            for lr in values:
                name = f"{optimizer}-lr{lr:g}"
                score(name, {"optimizer": optimizer, "lr": lr}, paths, args.work, results)
                stage1.append(name)
                save()
    base_name = best_of(stage1)
    base = dict(results[base_name]["overrides"])
    knobs = {
        "linear": {"lr_schedule": "linear", "min_lr_ratio": 0.0},
        "decay1": {"step_loss_decay": 1.0},
        "decay0.9": {"step_loss_decay": 0.9},
        "norm_before_residual": {"draft": {"norm_before_residual": True}},
        "norm_before_fc": {"draft": {"norm_before_fc": True}},
        "norm_output": {"draft": {"norm_output": True}},
        "warmup0.01": {"warmup_ratio": 0.01},
        "wd0.01": {"weight_decay": 0.01},
    }
    helped = []
    if 2 in stages:
        for knob, extra in knobs.items():
            merged = {**base, **extra, "draft": {**base.get("draft", {}), **extra.get("draft", {})}}
            if not merged["draft"]:
                merged.pop("draft")
            name = f"{base_name}+{knob}"
            row = score(name, merged, paths, args.work, results)
            if row["al7"] + row["al3"] > results[base_name]["al7"] + results[base_name]["al3"]:
                helped.append(knob)
            save()
    if 3 in stages and helped:
        combined = dict(base)
        for knob in helped:
            extra = knobs[knob]
            combined = {**combined, **extra, "draft": {**combined.get("draft", {}), **extra.get("draft", {})}}
        if not combined.get("draft"):
            combined.pop("draft", None)
        score(f"{base_name}+" + "+".join(helped), combined, paths, args.work, results)
        save()
        final = best_of([n for n in results])
        for seed in (1, 2):
            score(f"{final}@seed{seed}", {**results[final]["overrides"], "seed": seed}, paths, args.work, results)
            score(f"baseline@seed{seed}", {"seed": seed}, paths, args.work, results)
            save()
    save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
