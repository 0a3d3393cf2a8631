"""The storage budget (config ``storage``): whether a plan's projected peak and the bytes
it still writes fit ``max_bytes`` and ``min_free_bytes``, and when not, the settings
that would fit. No torch."""
from __future__ import annotations

import math
from pathlib import Path

from eagle3flow.ops.plan.footprint import DTYPE_BYTES, hidden_state_bytes_per_token
from eagle3flow.layout import Layout
from eagle3flow.ops.plan.stages import Plan
from eagle3flow.ops.plan.sizes import format_bytes, free_bytes, parse_bytes


def budget_refusal(plan: Plan, config: dict, root: Path) -> str | None:
    """Why the plan does not fit the storage budget, with what would; None when it fits."""
    storage = config.get("storage") or {}
    max_bytes = parse_bytes(storage.get("max_bytes"))
    min_free = parse_bytes(storage.get("min_free_bytes")) or 0
    problems = []
    if not plan.to_write_bytes:
        return None                     # nothing left to write: nothing to refuse
    if max_bytes is not None and plan.peak_bytes > max_bytes:
        problems.append(f"the projected peak of results/ + cache/ is {format_bytes(plan.peak_bytes)}, "
                        f"over storage.max_bytes = {format_bytes(max_bytes)}")
    cache_dir = root / Layout.of(config).cache
    free = free_bytes(cache_dir)
    if free - plan.to_write_bytes < min_free:
        problems.append(f"{format_bytes(plan.to_write_bytes)} are still to be written but "
                        f"{cache_dir} has {format_bytes(free)} free and storage.min_free_bytes "
                        f"= {format_bytes(min_free)} must stay free")
    if not problems:
        return None
    allowed = allowed_peak(plan, config, root)
    return "storage budget: " + "; ".join(problems) + ".\n" + "\n".join(
        "  - " + s for s in what_would_fit(plan, config, allowed))


def allowed_peak(plan: Plan, config: dict, root: Path) -> int:
    """The largest peak of results/ + cache/ that passes both checks of the budget."""
    storage = config.get("storage") or {}
    max_bytes = parse_bytes(storage.get("max_bytes"))
    min_free = parse_bytes(storage.get("min_free_bytes")) or 0
    free = free_bytes(root / Layout.of(config).cache)
    return min(x for x in (max_bytes, free - min_free + plan.peak_bytes - plan.to_write_bytes)
               if x is not None)


def what_would_fit(plan: Plan, config: dict, allowed: int) -> list[str]:
    """Settings under which the plan's peak would be at most ``allowed`` bytes."""
    hs = plan.workload["hidden_state_bytes"]
    fixed = plan.peak_bytes - next(s.bytes for s in plan.stages if s.name == "extract")
    per_token = plan.workload["hidden_state_bytes_per_token"]
    # dataset.max_samples caps prompts; with regenerate.answers_per_prompt N a training
    # prompt is N samples.
    per_prompt = plan.workload.get("answers_per_prompt", 1)
    samples = plan.workload["train_samples"] // per_prompt + plan.workload["eval_samples"]
    out = []
    room = allowed - fixed
    if room <= 0:
        out.append(f"even without hidden states the run takes {format_bytes(fixed)}: raise the budget "
                   "or free space (old fingerprints in cache/ can be deleted by hand)")
        return out
    fraction = room / hs
    if fraction < 1:
        fit = int(samples * fraction)
        unit = " prompts" if per_prompt > 1 else ""
        out.append(f"fewer samples: dataset.max_samples: {fit} (of {samples}{unit}) would need "
                   f"{format_bytes(fixed + hs * fit / samples)}")
    w = plan.workload
    if "storage_dtype" in config["extract"] and DTYPE_BYTES[w["storage_dtype"]] > 1:
        fp8 = hs * hidden_state_bytes_per_token(w["aux_layers"], w["hidden_size"], "fp8") / per_token
        verdict = "fits" if fixed + fp8 <= allowed else "still does not fit"
        out.append(f"fp8 shards: extract.storage_dtype: fp8 would need "
                   f"{format_bytes(fixed + fp8)} ({verdict})")
    partitions = max(2, math.ceil(hs / max(room / 2, 1)))
    out.append(f"streaming: extract.partitions: {partitions} (at most 2 on disk at a time) would need "
               f"~{format_bytes(fixed + 2 * hs / partitions)}")
    out.append(f"or raise storage.max_bytes to {format_bytes(plan.peak_bytes * 1.05)}")
    return out


