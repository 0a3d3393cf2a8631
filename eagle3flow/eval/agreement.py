"""How the served draft and the replay compare: greedy losslessness per prompt, and
per-round agreement between the replay and vLLM's per-request accepted counts.

Losslessness on a GPU: in bf16, speculative verification runs other kernels and batch
shapes than plain decoding, so where the target's two best next tokens are within its
dtype's rounding of each other, either may come out of either run. At the first
divergence between a prompt's baseline and speculative outputs the target's own logits
for that position are read (``logits_at``: the HF target on prompt + the common prefix),
and the divergence is a **near-tie** when the two emitted tokens are the target's top two
and their logits differ by at most ``NEAR_TIE_ULPS`` units in the last place of the
serving dtype at their magnitude (bf16: 8 significant bits, so 4 ulps is a relative gap of
at most 2^-5, ~3%, of the larger logit; float32: 4 x 2^-23, i.e. an exact tie in practice).
Anything else (another token, a wider gap, an output missing or cut short) is a **real
mismatch** and fails the check. Near-ties are reported apart, never silently.
"""
from __future__ import annotations

import math
from typing import Callable, Sequence

NEAR_TIE_ULPS = 4
# Explicit significand bits of the dtypes vLLM serves in.
SIGNIFICAND_BITS = {"bfloat16": 7, "float16": 10, "float32": 23}
NEAR_TIE_RULE = (f"a divergence is a numerical near-tie when the two emitted tokens are the target's "
                 f"top two at that position and their logits differ by <= {NEAR_TIE_ULPS} ulps of the "
                 f"serving dtype at their magnitude; any other divergence is a real mismatch")


def dtype_ulp(value: float, dtype: str) -> float:
    """The spacing of ``dtype`` numbers at ``|value|`` (normal range)."""
    if dtype not in SIGNIFICAND_BITS:
        raise ValueError(f"no near-tie resolution for dtype {dtype!r}; known: {sorted(SIGNIFICAND_BITS)}")
    magnitude = max(abs(float(value)), 2.0 ** -126)
    return 2.0 ** (math.floor(math.log2(magnitude)) - SIGNIFICAND_BITS[dtype])


def classify_divergence(logits: Sequence[float], baseline_token: int, speculative_token: int,
                        dtype: str) -> dict:
    """The target's logits at a first divergence -> near-tie or real mismatch (module doc)."""
    values = [float(x) for x in logits]
    top2 = sorted(range(len(values)), key=lambda i: -values[i])[:2]
    a, b = values[baseline_token], values[speculative_token]
    resolution = dtype_ulp(max(abs(a), abs(b)), dtype)
    gap = abs(a - b)
    near_tie = set(top2) == {baseline_token, speculative_token} and gap <= NEAR_TIE_ULPS * resolution
    return {"baseline_token": int(baseline_token), "speculative_token": int(speculative_token),
            "target_top2": [int(i) for i in top2], "logit_gap": gap, "ulp": resolution,
            "gap_ulps": gap / resolution, "near_tie": near_tie}


def compare_outputs(baseline: list[dict], speculative: list[dict],
                    logits_at: Callable[[list[int]], Sequence[float]] | None = None,
                    dtype: str | None = None) -> dict:
    """Greedy equality per prompt: ids that differ, where they first diverge, and (with
    ``logits_at`` and the serving ``dtype``) whether each divergence is a numerical
    near-tie or a real mismatch. ``passed``: no real mismatch; ``identical``: no
    difference at all. Without ``logits_at`` every difference is a real mismatch."""
    spec_by_id = {o["id"]: o["output_token_ids"] for o in speculative}
    mismatched, first, divergences, real = [], {}, {}, []
    for o in baseline:
        a, b = o["output_token_ids"], spec_by_id.get(o["id"])
        if b is not None and a == b:
            continue
        mismatched.append(o["id"])
        if b is None:
            real.append(o["id"])
            continue
        pos = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        first[o["id"]] = pos
        if logits_at is None or pos >= min(len(a), len(b)):
            real.append(o["id"])    # not judged, or one output is a prefix of the other
            continue
        context = list(o.get("prompt_token_ids") or []) + list(a[:pos])
        verdict = classify_divergence(logits_at(context), a[pos], b[pos], dtype)
        divergences[o["id"]] = {"position": pos, **verdict}
        if not verdict["near_tie"]:
            real.append(o["id"])
    near = [i for i in mismatched if i not in real]
    return {"passed": not real, "identical": not mismatched, "num_prompts": len(baseline),
            "num_mismatched": len(mismatched), "mismatched_ids": mismatched,
            "num_near_ties": len(near), "near_tie_ids": near,
            "num_real_mismatches": len(real), "real_mismatch_ids": real,
            "first_divergence": first, "divergences": divergences,
            "judged": logits_at is not None, "dtype": dtype, "rule": NEAR_TIE_RULE}


def lossless_cell(lossless: dict) -> str:
    """A table cell for the report and the model card: ``identical``, ``identical up to
    N/M near-ties`` (passed), or ``N/M differ`` (real mismatches; failed)."""
    n, near = lossless.get("num_prompts"), lossless.get("num_near_ties", 0)
    if lossless["passed"]:
        return f"identical up to {near}/{n} near-ties" if near else "identical"
    real = lossless.get("num_real_mismatches", lossless.get("num_mismatched"))
    return f"{real}/{n} differ" + (f" (+{near} near-ties)" if near else "")


def lossless_text(lossless: dict) -> str:
    """One line for the summary, report and model card: PASS/FAIL with near-ties apart."""
    n = lossless["num_prompts"]
    if lossless.get("identical", not lossless["num_mismatched"]):
        return f"PASS (identical on {n}/{n})"
    near = lossless.get("num_near_ties", 0)
    real = lossless.get("num_real_mismatches", lossless["num_mismatched"])
    ties = f"{near}/{n} differ after a numerical near-tie"
    if lossless["passed"]:
        return f"PASS ({ties})"
    return f"FAIL ({real}/{n} real mismatches" + (f"; {ties})" if near else ")")


def round_agreement(replays: list[dict], speculative: list[dict]) -> dict | None:
    """How many prompts' replayed rounds match vLLM's per-request accepted counts exactly.

    vLLM counts, in a request's last round, draft tokens accepted past ``max_tokens``
    (then cut), which the replay cannot see; rounds are compared without that last one.
    """
    by_id = {o["id"]: (o.get("spec_decode") or {}).get("per_step_accepted") for o in speculative}
    if not any(by_id.values()):
        return None
    exact = prefix_equal = compared = 0
    for r in replays:
        served = by_id.get(r["id"])
        if served is None:
            continue
        compared += 1
        exact += served == r["per_round"]
        prefix_equal += served[:-1] == r["per_round"][:-1]
    return {"prompts_compared": compared, "prompts_rounds_equal": exact,
            "prompts_rounds_equal_but_last": prefix_equal}


def per_prompt(replays: list[dict], baseline: list[dict], speculative: list[dict]) -> list[dict]:
    spec_by_id = {o["id"]: o for o in speculative}
    rows = []
    for r, o in zip(replays, baseline):
        served = (spec_by_id.get(o["id"], {}).get("spec_decode") or {}).get("per_step_accepted")
        rows.append({"id": r["id"], "output_tokens": len(o["output_token_ids"]),
                     "rounds": r["rounds"], "accepted": r["accepted"],
                     "vllm_rounds": len(served) if served is not None else None,
                     "vllm_accepted": sum(served) if served is not None else None})
    return rows
