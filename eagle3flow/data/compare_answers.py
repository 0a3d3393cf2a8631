"""train_original_answers_draft: the same workflow, trained on the dataset's original answers.

For ``regenerate.compare_original_answers``: the draft trained on the target's own
answers is evaluated next to one trained on the answers the dataset came with. This
runs the whole workflow again, up to ``export_draft``, with regeneration off, in its
own working directory ``<results>/.workdir`` (its own Snakemake lock and metadata),
writing to ``<results>/`` and sharing the outer run's cache (stages are keyed by
fingerprints, so nothing is mixed up). Every stage of it resumes like the outer run's.

CLI::

    python -m eagle3flow.data.compare_answers --snakefile Snakefile --config-json '{...}'
        --target TARGET --dataset DATA --results results/original_answers --cache cache
        --logs logs/original_answers --cores N
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path


def original_answers_config(config: dict) -> dict:
    """The outer run's config without regenerating, and without the sections that do not
    change the draft (evaluate, regenerate), so editing them does not retrain it."""
    nested = json.loads(json.dumps(config))
    nested["regenerate"] = {"enabled": False}
    nested.pop("evaluate", None)  # the schema's defaults come back
    return nested


def nested_config(config: dict, target: str, dataset: str, results: Path, cache: Path, logs: Path) -> dict:
    """``config`` pointed at the outer run's target and dataset (the embedded ones are
    not rebuilt) and at absolute paths (the nested run works in another directory)."""
    config = json.loads(json.dumps(config))
    config["target"] = {**config.get("target", {}), "path": os.path.abspath(target)}
    config["dataset"] = {**config.get("dataset", {}),
                         "path": os.path.abspath(dataset) if os.path.exists(dataset) else dataset}
    config["paths"] = {"results": str(results), "cache": str(cache), "logs": str(logs)}
    config.setdefault("regenerate", {})["enabled"] = False
    return config


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m eagle3flow.data.compare_answers",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--snakefile", required=True)
    parser.add_argument("--config-json", type=json.loads, required=True)
    parser.add_argument("--target", required=True)
    parser.add_argument("--dataset", required=True)
    parser.add_argument("--results", type=Path, required=True)
    parser.add_argument("--cache", type=Path, required=True)
    parser.add_argument("--logs", type=Path, required=True)
    parser.add_argument("--cores", type=int, default=1)
    args = parser.parse_args(argv)
    results, workdir = args.results.resolve(), args.results.resolve() / ".workdir"
    workdir.mkdir(parents=True, exist_ok=True)
    config = nested_config(args.config_json, args.target, args.dataset, results,
                           args.cache.resolve(), args.logs.resolve())
    # Where the Snakefile's `configfile: "config.yaml"` finds it (JSON is YAML).
    config_path = workdir / "config.yaml"
    config_path.write_text(json.dumps(config, indent=1, sort_keys=True) + "\n")
    targets = [str(results / "draft" / "config.json"), str(results / "draft" / "model.safetensors")]
    command = [sys.executable, "-m", "snakemake", "--snakefile", str(Path(args.snakefile).resolve()),
               "--directory", str(workdir), "--configfile", str(config_path), "--cores", str(args.cores),
               "--rerun-incomplete", "--nocolor", *targets]
    print("compare_answers: training a draft on the original answers: " + " ".join(command),
          file=sys.stderr, flush=True)
    return subprocess.run(command).returncode


if __name__ == "__main__":
    sys.exit(main())
