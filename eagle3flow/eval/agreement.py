"""How the served draft and the replay compare: greedy losslessness per prompt, and
per-round agreement between the replay and vLLM's per-request accepted counts.

Losslessness on a GPU: in bf16, speculative verification runs other kernels and batch
shapes than plain decoding, so where the target's two best next tokens are within its
dtype's rounding of each other, either may come out of either run. At the first
divergence between a prompt's baseline and speculative outputs the target's own logits
for that position are read: the two best raw logits the serving engine itself computed
there in the baseline run (each baseline output's ``top_logits``,
eagle3flow/serving/vllm_runner.py), so judging costs no second load of the target (a
1T-parameter target fits no single device; the engine's numbers are the served ones). The
divergence is a **near-tie** when the two emitted tokens are the target's top two
and their logits differ by at most ``NEAR_TIE_ULPS`` units in the last place of the
serving dtype at their magnitude (bf16: 8 significant bits, so 4 ulps is a relative gap of
at most 2^-5, ~3%, of the larger logit; float32: 4 x 2^-23, i.e. an exact tie in practice).
Anything else (another token, a wider gap, an output missing or cut short) is a **real
mismatch** and fails the check. Near-ties are reported apart, never silently.
"""
from __future__ import annotations

import math
from typing import Sequence

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


def classify_divergence(top: Sequence[Sequence], baseline_token: int, speculative_token: int,
                        dtype: str) -> dict:
    """The target's best ``[token, logit]`` pairs at a first divergence (best first, at least
    two) -> near-tie or real mismatch (module doc). A speculative token outside the top two
    is a real mismatch whatever its logit."""
    logit_of = {int(token): float(logit) for token, logit in top}
    top2 = [int(token) for token, _ in top[:2]]
    verdict = {"baseline_token": int(baseline_token), "speculative_token": int(speculative_token),
               "target_top2": top2}
    if set(top2) != {baseline_token, speculative_token}:
        return {**verdict, "logit_gap": None, "ulp": None, "gap_ulps": None, "near_tie": False}
    a, b = logit_of[baseline_token], logit_of[speculative_token]
    resolution = dtype_ulp(max(abs(a), abs(b)), dtype)
    gap = abs(a - b)
    return {**verdict, "logit_gap": gap, "ulp": resolution, "gap_ulps": gap / resolution,
            "near_tie": gap <= NEAR_TIE_ULPS * resolution}


def compare_outputs(baseline: list[dict], speculative: list[dict], dtype: str | None = None) -> dict:
    """Greedy equality per prompt: ids that differ, where they first diverge, and (where
    the baseline output carries the engine's ``top_logits`` and the serving ``dtype`` is
    given) whether each divergence is a numerical near-tie or a real mismatch. ``passed``:
    no real mismatch; ``identical``: no difference at all. A divergence without those
    logits is a real mismatch (``judged`` false)."""
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
        top = (o.get("top_logits") or [])[pos:pos + 1]
        if dtype is None or not top or len(top[0]) < 2 or pos >= min(len(a), len(b)):
            real.append(o["id"])    # not judged, or one output is a prefix of the other
            continue
        verdict = classify_divergence(top[0], a[pos], b[pos], dtype)
        divergences[o["id"]] = {"position": pos, **verdict}
        if not verdict["near_tie"]:
            real.append(o["id"])
    near = [i for i in mismatched if i not in real]
    return {"passed": not real, "identical": not mismatched, "num_prompts": len(baseline),
            "num_mismatched": len(mismatched), "mismatched_ids": mismatched,
            "num_near_ties": len(near), "near_tie_ids": near,
            "num_real_mismatches": len(real), "real_mismatch_ids": real,
            "first_divergence": first, "divergences": divergences,
            "judged": dtype is not None and all("top_logits" in o for o in baseline),
            "dtype": dtype, "rule": NEAR_TIE_RULE}


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
