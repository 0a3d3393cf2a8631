"""Throughputs: which extraction backend and devices the run uses, what this directory's
last run measured (extraction's throughput logs, training's metrics, the rules'
benchmark TSVs), the record of earlier runs per profile (``results/plan/throughput.json``),
and after a run the measured bytes and seconds beside the projection. No torch."""
from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from eagle3flow.atomic import write_json
from eagle3flow.ops.plan.footprint import uses_gpu
from eagle3flow.layout import STAGES, Layout
from eagle3flow.ops.plan.stages import Plan, measure
from eagle3flow.ops.plan.workload import workload
from eagle3flow.procfs import usable_cores

def extract_backend(config: dict) -> str:
    """The extraction backend that will run: extract.backend, with auto resolved as the job
    does (eagle3flow/extract/__main__.py resolve_backend): vllm where the node has several GPUs."""
    ext = config["extract"]
    backend = ext.get("backend") or "auto"
    if backend == "auto":
        backend = "vllm" if config["resources"]["gpus"] > 1 and uses_gpu(config, ext.get("device", "auto")) else "hf"
    return backend


def extract_devices(config: dict) -> int:
    """Devices the extraction runs on: the node's GPUs with vLLM (tensor parallel), one with
    transformers (the HF backend loads the target on one device)."""
    gpus = int(config["resources"]["gpus"])
    return gpus if extract_backend(config) == "vllm" else min(gpus, 1)


def profile_key(config: dict) -> str:
    """What throughputs are comparable across: the GPU count, the stages' devices, the
    extraction backend."""
    return (f"gpus={config['resources']['gpus']},extract={config['extract'].get('device', 'auto')},"
            f"train={config['train'].get('device', 'auto')},backend={extract_backend(config)}")


def benchmark_seconds(path: Path) -> float | None:
    """A job's wall seconds from its Snakemake ``benchmark:`` file; None if unreadable."""
    try:
        with open(path) as f:
            lines = f.read().strip().splitlines()
        return float(lines[-1].split("\t")[0])
    except (OSError, ValueError, IndexError):
        return None


def measured_throughputs(config: dict, root: Path) -> dict:
    """From this directory's last run: extraction and training tokens/s, each rule's seconds."""
    layout = Layout.of(config)
    found: dict = {"seconds": {}}
    tokens = seconds = 0.0
    for path in (root / layout.folder("results/hidden_states")).rglob("*throughput.jsonl"):
        with open(path) as f:
            for line in f:
                try:
                    row = json.loads(line)
                    tokens += row["num_tokens"]
                    seconds += row["compute_s"]
                except (ValueError, KeyError):
                    continue
    if tokens and seconds:
        found["extract_tokens_per_s"] = tokens / seconds
    rates = []
    metrics = root / layout.train("metrics.jsonl")
    if metrics.is_file():
        with open(metrics) as f:
            for line in f:
                try:
                    rates.append(float(json.loads(line)["tokens_per_s"]))
                except (ValueError, KeyError):
                    continue
    if rates:
        found["train_tokens_per_s"] = sorted(rates)[len(rates) // 2]
    for tsv in (root / layout.benchmarks).glob("*.tsv"):
        s = benchmark_seconds(tsv)
        if s is not None:
            found["seconds"][tsv.stem] = s
    return found


def recorded_throughputs(config: dict, root: Path) -> dict:
    """Throughputs of earlier runs of this profile (results/plan/throughput.json)."""
    path = root / Layout.of(config).plan_throughputs
    try:
        with open(path) as f:
            return json.load(f).get(profile_key(config), {})
    except (OSError, ValueError):
        return {}


def record_throughputs(config: dict, root: Path) -> None:
    """After a run: keep its throughputs (and the tokens they were measured on) for this
    profile, so the next plan uses them."""
    measured = measured_throughputs(config, root)
    work = workload(config, root)
    if work["basis"].endswith("stats.json"):
        measured["tokens"] = work["train_tokens"] + work["eval_tokens"]
    path = root / Layout.of(config).plan_throughputs
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, ValueError):
        data = {}
    previous = data.get(profile_key(config), {})
    merged = {**previous, **{k: v for k, v in measured.items() if k != "seconds"},
              "seconds": {**previous.get("seconds", {}), **measured["seconds"]},
              "recorded_at": time.time()}
    data[profile_key(config)] = merged
    write_json(path, data)


def attach_actuals(plan: Plan, config: dict, root: Path, peak: int | None) -> Plan:
    """Measured bytes per stage and the rules' seconds (results/benchmarks) beside the projection."""
    per_stage, total = measure(config, root)
    seconds = measured_throughputs(config, root)["seconds"]
    for s in plan.stages:
        s.actual_bytes = per_stage[s.name]
        prefixes = next(stage.rules for stage in STAGES if stage.name == s.name)
        ran = [v for rule, v in seconds.items() if rule.startswith(prefixes)]
        s.actual_seconds = sum(ran) if ran else None
    plan.actual_peak_bytes = max(peak or 0, total)
    return plan


# One core's fp32 matmul rate (numpy, 512^3, best of 7, one thread) on the hosts the plan's
# assumed CPU figures were calibrated on (`make demo` on 2 AMD EPYC cores, 2026-12-04 and
# 2026-12-05). An assumed CPU rate is scaled by this host's per-core rate over it.
REFERENCE_CPU_MATMUL_FLOPS_PER_CORE = 91e9
CPU_MATMUL_SIZE = 512
# Run in a child whose BLAS has one thread: the planner's own process may have any number
# (Snakemake's OMP_NUM_THREADS, or all cores), and a rate divided by the wrong count read a
# host at half its speed (make demo 2026-12-05: x0.64 in its final plan, x1.13 in a shell).
MATMUL_PROBE = f"""
import time, numpy as np
rng = np.random.default_rng(0)
a = rng.standard_normal(({CPU_MATMUL_SIZE}, {CPU_MATMUL_SIZE}), dtype=np.float32)
b = rng.standard_normal(({CPU_MATMUL_SIZE}, {CPU_MATMUL_SIZE}), dtype=np.float32)
a @ b
best = float("inf")
for _ in range(7):
    t0 = time.perf_counter()
    a @ b
    best = min(best, time.perf_counter() - t0)
print(2 * {CPU_MATMUL_SIZE} ** 3 / best)
"""
ONE_THREAD = {name: "1" for name in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS",
                                     "BLIS_NUM_THREADS", "VECLIB_MAXIMUM_THREADS")}


@functools.lru_cache(maxsize=1)
def cpu_speed() -> tuple[float, str]:
    """``(factor, basis)``: this host's one-core fp32 matmul rate over the calibration
    hosts' (REFERENCE_CPU_MATMUL_FLOPS_PER_CORE), measured once per process in a child
    with one BLAS thread (~0.3 s); 1.0 where the probe cannot run."""
    try:
        out = subprocess.run([sys.executable, "-c", MATMUL_PROBE], env={**os.environ, **ONE_THREAD},
                             capture_output=True, text=True, timeout=60, check=True).stdout
        per_core = float(out.strip().splitlines()[-1])
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return 1.0, "x1.00: this host's matmul rate could not be measured"
    factor = per_core / REFERENCE_CPU_MATMUL_FLOPS_PER_CORE
    return factor, (f"x{factor:.2f}: this host's fp32 matmul {per_core / 1e9:.0f} GFLOP/s on one core against "
                    f"{REFERENCE_CPU_MATMUL_FLOPS_PER_CORE / 1e9:.0f} where calibrated")
