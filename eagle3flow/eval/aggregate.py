"""The numbers of one draft on one prompt set: vLLM's acceptance and speed, the replay's
totals, their agreement, and the per-category and per-prompt tables."""
from __future__ import annotations

from eagle3flow.eval.agreement import compare_outputs, per_prompt, round_agreement
from eagle3flow.eval.replay import acceptance_summary


def vllm_acceptance(counters: dict, base_set: dict, spec_set: dict) -> dict:
    acc = acceptance_summary(counters["num_drafts"], counters["num_accepted_tokens"],
                             counters["num_accepted_tokens_per_pos"])
    acc["num_draft_tokens"] = counters["num_draft_tokens"]
    acc["draft_acceptance_rate"] = (counters["num_accepted_tokens"] / counters["num_draft_tokens"]
                                    if counters["num_draft_tokens"] else None)
    base_tps, spec_tps = base_set["output_tokens_per_s"], spec_set["output_tokens_per_s"]
    acc.update(baseline_output_tokens_per_s=base_tps, eagle3_output_tokens_per_s=spec_tps,
               speedup=spec_tps / base_tps if base_tps and spec_tps else None,
               baseline_wall_time_s=base_set["wall_time_s"],
               eagle3_wall_time_s=spec_set["wall_time_s"])
    return acc


def replay_totals(replays: list[dict], k: int) -> dict:
    rows = [r["by_k"][str(k)] for r in replays]
    return acceptance_summary(sum(r["rounds"] for r in rows), sum(r["accepted"] for r in rows),
                              [sum(r["accepted_per_pos"][j] for r in rows) for j in range(k)])


def per_category(prompt_set: dict, spec_outputs: list[dict], replays: dict | None, k: int) -> dict:
    """Accepted draft tokens per category, from vLLM's per-request counts and the replay
    (its columns null where the replay did not run)."""
    table: dict[str, dict] = {}
    for o in spec_outputs:
        cat = prompt_set["category_of"][o.get("conversation") or o["id"]]
        row = table.setdefault(cat, {"generations": 0, "output_tokens": 0, "vllm_drafts": 0,
                                     "vllm_accepted": 0, "replay_drafts": 0,
                                     "replay_accepted": 0})
        served = (o.get("spec_decode") or {}).get("per_step_accepted") or []
        row["generations"] += 1
        row["output_tokens"] += len(o["output_token_ids"])
        row["vllm_drafts"] += len(served)
        row["vllm_accepted"] += sum(served)
        if replays is not None:
            replay = replays[f"{prompt_set['name']}/{o['id']}"]["by_k"][str(k)]
            row["replay_drafts"] += replay["rounds"]
            row["replay_accepted"] += replay["accepted"]
    for row in table.values():
        if replays is None:
            row.update(replay_drafts=None, replay_accepted=None, replay_acceptance_length=None)
        for src in ("vllm",) + (("replay",) if replays is not None else ()):
            drafts = row[f"{src}_drafts"]
            row[f"{src}_acceptance_length"] = (1 + row[f"{src}_accepted"] / drafts
                                               if drafts else None)
    return dict(sorted(table.items()))


def set_result(prompt_set: dict, base_set: dict, spec_set: dict, replays: dict | None, k: int,
               tolerance: float, dtype: str | None = None) -> dict:
    """Everything measured for one draft on one prompt set; ``dtype``: the serving dtype
    that judges a divergence (agreement.compare_outputs). ``replays`` None: the replay did
    not run (``evaluate.replay``), and what it measures is null (vLLM's numbers stay)."""
    name = prompt_set["name"]
    vllm_acc = vllm_acceptance(spec_set["spec_decode"], base_set, spec_set)
    result = {
        "vllm": vllm_acc,
        "lossless": compare_outputs(base_set["outputs"], spec_set["outputs"], dtype),
        "simulated": None, "agreement": None, "agreement_ok": None, "round_agreement": None,
        "acceptance_length_vs_k": None,
        "per_category": per_category(prompt_set, spec_set["outputs"], replays, k),
        "per_prompt": None,
    }
    if replays is None:
        return result
    set_replays = [replays[f"{name}/{o['id']}"] for o in base_set["outputs"]]
    simulated = replay_totals(set_replays, k)
    simulated["num_output_tokens"] = base_set["num_output_tokens"]
    agreement = (simulated["acceptance_length"] / vllm_acc["acceptance_length"]
                 if simulated["acceptance_length"] and vllm_acc["acceptance_length"] else None)
    at_k = [{"id": o["id"], **r["by_k"][str(k)]} for o, r in zip(base_set["outputs"], set_replays)]
    return {
        **result,
        "simulated": simulated,
        "agreement": agreement,
        "agreement_ok": agreement is not None and abs(agreement - 1.0) <= tolerance,
        "round_agreement": round_agreement(at_k, spec_set["outputs"]),
        # every K the replays hold (an EAGLE-3 draft's 1..replay_max_k; a DFlash draft's one K)
        "acceptance_length_vs_k": {str(j): replay_totals(set_replays, j)["acceptance_length"]
                                   for j in sorted(int(x) for x in set_replays[0]["by_k"])} if set_replays else {},
        "per_prompt": per_prompt(at_k, base_set["outputs"], spec_set["outputs"]),
    }


def generation_units(prompt_sets: list[dict], baseline: dict) -> list[dict]:
    by_name = {s["name"]: s for s in baseline["sets"]}
    return [{"key": f"{s['name']}/{o['id']}", "prompt_token_ids": o["prompt_token_ids"],
             "output_token_ids": o["output_token_ids"]}
            for s in prompt_sets for o in by_name[s["name"]]["outputs"]]
