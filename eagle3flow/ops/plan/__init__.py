"""The plan: per stage, what will run, the disk it will take, the time and GPU-hours it
will cost, and after the run the same table with what it actually took.

Everything here is cheap (no torch, no model): it runs at the top of every workflow
run, before any job, from ``rules/plan.smk``. This module is the entry (the CLI, and
what the rules call when the workflow is read); the pieces live beside it:

* ``stages``: the stages, their paths, :class:`Plan` and :class:`StageRow`;
* ``workload``: the target's config, tokens and samples per split, regeneration;
* ``footprint``: bytes per token of hidden states, the draft's parameters and
  checkpoint bytes, the target's parameters;
* ``throughput``: extraction backend, measured and recorded throughputs;
* ``project``: the projection per stage, with streaming partitions when needed;
* ``budget``: the storage budget's verdict; ``table``: the text table;
* ``sizes``: bytes of a tree, free space, sizes as text; ``disk_sampler``: the peak.

Disk, per stage, from the dataset stats when ``results/dataset/stats.json`` exists,
else from an estimate of the raw dataset, and from the target's config.json:

* hidden states: ``tokens x ((A+1) x H x dtype_bytes + 5)`` (A aux layers + the last
  layer, plus int32 input_ids and uint8 loss_mask) for both splits;
* training cache: ``keep_checkpoints`` checkpoints of fp32 weights and the optimizer
  state (12 B/param under AdamW, 8 B/param for the matrices Muon steps), plus
  ``draft_params x 4`` for ``results/train``; one more checkpoint exists for a moment
  before the oldest is deleted: the peak counts it;
* export: ``draft_params x dtype_bytes`` plus the vocab map.

A stage whose files already exist counts with their measured size. The projected peak
is the sum over stages (every artifact stays until the end of the run) plus whatever
else already lies in ``results/`` and ``cache/`` (old fingerprints count: they take
the same disk).

Time, per stage, from measured throughputs, best first: this results directory's last
run (extraction's ``throughput.jsonl``, training's ``metrics.jsonl``, the rules'
``results/benchmarks/*.tsv``) recorded per profile in ``results/plan/throughput.json``;
else a FLOP count at an assumed rate (said so in the table).

The budget (config ``storage``): ``max_bytes`` caps the projected peak of
``results/`` + ``cache/``; ``min_free_bytes`` is the free space that must be left on
their filesystem after the bytes still to be written. A plan that does not fit is
refused before any job runs, with the settings that would fit.

CLI::

    python -m eagle3flow.ops.plan [--profile embedded] [--config KEY=VALUE ...]   # the plan, dry
    python -m eagle3flow.ops.plan sample-disk --path results --path cache --out F --pid PID
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

from eagle3flow.atomic import write_json
# rules/*.smk reach the planner through this module (`plan_lib`): besides what it uses
# itself, it names what they call when the workflow is read and after the run.
from eagle3flow.ops.plan.disk_sampler import read_peak, sample_disk, start_sampler
from eagle3flow.ops.plan.project import evaluation_target_loads, project, sampled_generations
from eagle3flow.ops.plan.stages import Plan
from eagle3flow.ops.plan.table import render
from eagle3flow.ops.plan.throughput import attach_actuals, extract_backend, record_throughputs
from eagle3flow.ops.plan.workload import target_config
from eagle3flow.ops.plan.sizes import parse_bytes
from eagle3flow.ops.streaming import Chain

__all__ = ["PLAN_CONFIG_ENV", "attach_actuals", "extract_backend", "main", "parse_job_stats", "plan_when_read",
           "project", "read_peak", "record_throughputs", "render", "start_sampler", "streaming_chain",
           "target_config", "try_project"]

# `python -m eagle3flow.ops.plan` gets the workflow's resolved config through this file.
PLAN_CONFIG_ENV = "EAGLE3FLOW_PLAN_CONFIG"


def streaming_chain(config: dict, root: str | os.PathLike, plan: "Plan | None" = None):
    """The chain the workflow streams (eagle3flow.ops.streaming.Chain), or None, from the plan
    made when the workflow is read (made here when not given)."""
    if plan is None:
        plan, _ = try_project(config, root, quiet=True)
    if plan is None or "streaming" not in plan.workload:
        return None
    s = plan.workload["streaming"]
    return Chain(s["partitions"], s["epochs"], s["in_flight"], s["part_bytes"])


def plan_when_read(config: dict, root: str | os.PathLike, quiet: bool = False):
    """When the workflow is read: (the plan of the whole run or None, its budget refusal or
    None), projected once for everything the Snakefile needs (the refusal, the streaming
    chain). Reads files only.

    Under ``python -m eagle3flow.ops.plan`` ($PLAN_CONFIG_ENV set) the resolved config
    (profile, --config, schema defaults) is also handed back through that file.
    """
    if os.environ.get(PLAN_CONFIG_ENV):
        write_json(Path(os.environ[PLAN_CONFIG_ENV]), config)
    return try_project(config, root, quiet=quiet)


def try_project(config: dict, root: str | os.PathLike, will_run: dict[str, int] | None = None,
                quiet: bool = False, probe_disk: bool = False):
    """(plan, refusal). A plan that cannot be made (the target's config.json or the dataset
    not here yet) is a refusal only when a budget is set; else a warning and (None, None)."""
    try:
        plan = project(config, root, will_run, probe_disk)
    except (OSError, KeyError, ValueError) as error:
        storage = config.get("storage") or {}
        if storage.get("max_bytes") is not None or parse_bytes(storage.get("min_free_bytes")):
            return None, f"storage budget: cannot project the disk this run needs: {error}"
        if not quiet:
            print(f"eagle3flow.ops.plan: no plan ({error})", file=sys.stderr)
        return None, None
    return plan, plan.refusal


# ----------------------------------------------------------------------------- CLI

JOB_STATS_ROW = re.compile(r"^(\S+)\s+(\d+)\s*$")


def parse_job_stats(text: str) -> dict[str, int]:
    """Jobs per rule from Snakemake's dry-run "Job stats" table."""
    counts, in_table = {}, False
    for line in text.splitlines():
        if line.startswith("Job stats"):
            in_table = True
            continue
        if in_table:
            m = JOB_STATS_ROW.match(line.strip())
            if m and m.group(1) != "total":
                counts[m.group(1)] = int(m.group(2))
            elif line.strip().startswith("total"):
                break
    return counts


def plan_via_snakemake(snakemake_args: list[str], workdir: Path) -> tuple[Plan | None, str, int]:
    """Ask Snakemake (dry run) what will run; the workflow hands its resolved config back
    through $EAGLE3FLOW_PLAN_CONFIG (rules/plan.smk). Returns the plan, output, return code."""
    with tempfile.TemporaryDirectory() as tmp:
        config_out = Path(tmp) / "config.json"
        env = {**os.environ, PLAN_CONFIG_ENV: str(config_out)}
        exe = Path(sys.executable).parent / "snakemake"
        cmd = [str(exe) if exe.exists() else "snakemake", "-n",
               *snakemake_args]
        result = subprocess.run(cmd, cwd=workdir, env=env, capture_output=True, text=True)
        output = result.stdout + result.stderr
        if not config_out.is_file():
            return None, output, result.returncode or 1
        with open(config_out) as f:
            config = json.load(f)
    will_run = parse_job_stats(output) if result.returncode == 0 else None
    return try_project(config, workdir, will_run, probe_disk=True)[0], output, result.returncode


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["sample-disk"]:
        parser = argparse.ArgumentParser(prog="python -m eagle3flow.ops.plan sample-disk")
        parser.add_argument("--path", action="append", required=True)
        parser.add_argument("--out", type=Path, required=True)
        parser.add_argument("--pid", type=int, required=True)
        parser.add_argument("--interval", type=float, default=1.0)
        args = parser.parse_args(argv[1:])
        sample_disk(args.path, args.out, args.pid, args.interval)
        return 0
    parser = argparse.ArgumentParser(
        prog="python -m eagle3flow.ops.plan",
        description="Print the plan (per stage: runs or cached, disk, time, GPU-hours, downtime) "
                    "without running anything. Other arguments go to `snakemake -n`, e.g. "
                    "--profile embedded --config storage='{max_bytes: 500GB}'.")
    parser.add_argument("--workdir", type=Path, default=Path.cwd())
    parser.add_argument("--json", type=Path, default=None, help="also write the plan as JSON here")
    args, snakemake_args = parser.parse_known_args(argv)
    plan, output, rc = plan_via_snakemake(snakemake_args, args.workdir)
    if plan is None:
        print(output, file=sys.stderr)
        return rc or 1
    print(render(plan))
    if args.json:
        write_json(args.json, plan.to_json())
    if plan.refusal:
        print("\n" + plan.refusal, file=sys.stderr)
        return 1
    if rc:
        print(output, file=sys.stderr)
    return rc

