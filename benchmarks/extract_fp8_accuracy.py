"""Does storing hidden states in fp8 cost draft accuracy? Train the embedded draft on both.

In a scratch copy of the workflow, Snakemake builds the embedded target, dataset and
vocab map (profile `embedded`); then the train and eval splits are extracted twice,
in the compute dtype (float32 on the CPU, bfloat16 with ``--device cuda``) and with
``storage_dtype="fp8"``; the draft is
trained on each with the embedded profile's training settings, and both drafts are
evaluated on the float32 eval hidden states (the target's real ones) and on the fp8
ones. Prints a markdown table; writes JSON to ``--out``.

    python benchmarks/extract_fp8_accuracy.py --out fp8_accuracy.json                 # CPU, ~15 min idle
    python benchmarks/extract_fp8_accuracy.py --device cuda --workdir W --out fp8.json  # GPU, W with results/
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from eagle3flow.extract.hf import extract  # noqa: E402
from eagle3flow.extract.shards import load_manifest  # noqa: E402
from eagle3flow.train.build import load_trained  # noqa: E402
from eagle3flow.train.eval_split import evaluate_split  # noqa: E402
from eagle3flow.train.trainer import train  # noqa: E402


def log(message: str) -> None:
    print(f"[fp8-accuracy] {message}", file=sys.stderr, flush=True)


def prepare_inputs(workdir: Path) -> None:
    for name in ("Snakefile", "config.yaml", "rules", "schemas", "profiles", "envs", "report"):
        src = REPO / name
        (shutil.copytree if src.is_dir() else shutil.copy2)(src, workdir / name)
    targets = ["results/vocab/vocab_map.safetensors", "results/dataset/train.parquet",
               "results/dataset/eval.parquet"]
    bin_dir = Path(sys.executable).parent
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}", "HF_HUB_OFFLINE": "1"}
    result = subprocess.run([str(bin_dir / "snakemake"), *targets, "--profile", "profiles/embedded"],
                            cwd=workdir, env=env, capture_output=True, text=True)
    if result.returncode != 0:
        raise SystemExit(f"snakemake failed:\n{(result.stdout + result.stderr)[-4000:]}")


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--workdir", default=None, help="reuse a workflow copy (default: a new temp dir)")
    parser.add_argument("--device", default="cpu",
                        help="cpu (float32 shards vs fp8) or cuda (bfloat16 shards vs fp8)")
    args = parser.parse_args(argv)
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="fp8_accuracy_"))
    workdir.mkdir(parents=True, exist_ok=True)
    if not (workdir / "results/vocab/vocab_map.safetensors").exists():
        log(f"building the embedded target, dataset and vocab map in {workdir}")
        prepare_inputs(workdir)
    results_dir = workdir / "results"
    target = results_dir / "embedded" / "target"
    profile = yaml.safe_load((REPO / "profiles/embedded/workflow.yaml").read_text())
    base = yaml.safe_load((REPO / "config.yaml").read_text())
    train_cfg = {**base.get("train", {}), **profile.get("train", {}), "device": args.device}
    max_length = profile["dataset"]["max_length"]

    manifests: dict = {}
    for storage in ("auto", "fp8"):
        for split in ("train", "eval"):
            out = workdir / "fp8_study" / storage / split
            t0 = time.perf_counter()
            m = extract(results_dir / "dataset" / f"{split}.parquet", target, out / "manifest.json",
                        workdir / "fp8_study" / "cache", device=args.device, max_length=max_length,
                        storage_dtype=storage, split_name=split)
            manifests[storage, split] = out / "manifest.json"
            log(f"extracted {split} ({storage}): {m['num_tokens']:,} tokens, "
                f"{sum(s['bytes'] for s in m['shards']) / 1e6:.1f} MB in {time.perf_counter() - t0:.0f} s")

    full = load_manifest(manifests["auto", "train"]).data["dtype"]  # float32 on CPU, bfloat16 on CUDA
    report: dict = {"train_config": train_cfg, "runs": {}, "device": args.device}
    vocab = results_dir / "vocab" / "vocab_map.safetensors"
    for storage in ("auto", "fp8"):
        run_dir = workdir / "fp8_study" / f"train_{storage}"
        t0 = time.perf_counter()
        train(manifests[storage, "train"], manifests[storage, "eval"], vocab, target, run_dir / "out",
              run_dir / "cache", train_cfg)
        log(f"trained on {storage} shards in {time.perf_counter() - t0:.0f} s")
        model = load_trained(run_dir / "out", target)
        draft_cfg = json.loads((run_dir / "out" / "draft_config.json").read_text())
        row = {"draft_config": draft_cfg}
        for eval_storage in ("auto", "fp8"):
            ev = evaluate_split(model, load_manifest(manifests[eval_storage, "eval"]), train_cfg["ttt_steps"])
            row[f"eval_on_{full if eval_storage == 'auto' else 'fp8'}"] = ev
        report["runs"][full if storage == "auto" else "fp8"] = row
        report["bytes"] = {(full if s == "auto" else "fp8"): sum(
            e["bytes"] for e in load_manifest(manifests[s, "train"]).data["shards"]) for s in ("auto", "fp8")}

    lines = ["| trained on | eval hidden states | step-0 acc | step-1 acc | step-2 acc | sim. acceptance length (K=3) |",
             "| --- | --- | ---: | ---: | ---: | ---: |"]
    for trained, row in report["runs"].items():
        for key in (f"eval_on_{full}", "eval_on_fp8"):
            ev = row[key]
            acc = ev["step_accuracy"]
            lines.append(f"| {trained} | {key.removeprefix('eval_on_')} | {acc[0]:.4f} | {acc[1]:.4f} | "
                         f"{acc[2]:.4f} | {ev['simulated_acceptance_length']['3']:.4f} |")
    report["table"] = "\n".join(lines)
    print(report["table"])
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2, default=str) + "\n")
    return report


if __name__ == "__main__":
    main()
