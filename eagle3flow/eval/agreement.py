"""How the served draft and the replay compare: greedy losslessness per prompt, and
per-round agreement between the replay and vLLM's per-request accepted counts."""
from __future__ import annotations


def compare_outputs(baseline: list[dict], speculative: list[dict]) -> dict:
    """Greedy equality per prompt: ids that differ and where they first diverge."""
    spec_by_id = {o["id"]: o["output_token_ids"] for o in speculative}
    mismatched, first = [], {}
    for o in baseline:
        a, b = o["output_token_ids"], spec_by_id.get(o["id"])
        if b is None or a != b:
            mismatched.append(o["id"])
            if b is not None:
                first[o["id"]] = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y),
                                      min(len(a), len(b)))
    return {"passed": not mismatched, "num_prompts": len(baseline),
            "num_mismatched": len(mismatched), "mismatched_ids": mismatched,
            "first_divergence": first}



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
