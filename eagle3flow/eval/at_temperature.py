"""The numbers of one draft on one prompt set at one sampling temperature: vLLM's acceptance
with its confidence interval, the distributional lossless test, and the offline estimate
beside them (evaluate.py puts them under ``summary.json``'s ``by_temperature``).

The answers come from the engines' sampled runs (eagle3flow/serving/vllm_runner.py,
``temperature_runs``): every prompt ``samples_per_prompt`` times, with the same seeds with
and without the draft.
"""
from __future__ import annotations

from collections import defaultdict

from eagle3flow.eval.aggregate import vllm_acceptance
from eagle3flow.eval.confidence import acceptance_length_ci, within
from eagle3flow.eval.distribution_test import distribution_test
from eagle3flow.train.rejection_estimate import acceptance_length


def temperature_key(temperature: float) -> str:
    """``by_temperature``'s key: ``0.6``, ``1.0`` (a float's shortest repr, so 1 and 1.0 meet)."""
    return repr(float(temperature))


def by_prompt(outputs: list[dict]) -> dict[str, list[dict]]:
    """A sampled run's outputs grouped by prompt, samples in order."""
    grouped: dict[str, list[dict]] = defaultdict(list)
    for o in sorted(outputs, key=lambda o: o["sample"]):
        grouped[o["id"]].append(o)
    return dict(grouped)


def served_ci(spec_outputs: list[dict], confidence: float, seed: int) -> dict:
    """The interval of vLLM's acceptance length from its per-request counts (per prompt, its
    samples summed); null bounds where this vLLM reports no per-request counts."""
    per_prompt = []
    for samples in by_prompt(spec_outputs).values():
        steps = [(o.get("spec_decode") or {}).get("per_step_accepted") for o in samples]
        if any(s is None for s in steps):
            return {**acceptance_length_ci([], confidence), "num_prompts": None}
        per_prompt.append((sum(sum(s) for s in steps), sum(len(s) for s in steps)))
    return acceptance_length_ci(per_prompt, confidence, seed)


def temperature_row(base_set: dict, spec_set: dict, walks: dict | None, options) -> dict:
    """Everything measured for one draft on one set at one temperature. ``walks``: the
    offline estimate's expected walk per generation (``{"<id>#<sample>": walk}``), None
    where the replay did not run. ``options``: the EvalOptions (confidence, lossless_*)."""
    vllm = vllm_acceptance(spec_set["spec_decode"], base_set, spec_set)
    ci = served_ci(spec_set["outputs"], options.confidence, options.sample_seed)
    vllm.update(ci_low=ci["ci_low"], ci_high=ci["ci_high"], confidence=ci["confidence"],
                ci_method=ci["method"], num_generations=len(spec_set["outputs"]))
    base, spec = by_prompt(base_set["outputs"]), by_prompt(spec_set["outputs"])
    ids = [i for i in base if i in spec]
    lossless = distribution_test([[o["output_token_ids"] for o in base[i]] for i in ids],
                                 [[o["output_token_ids"] for o in spec[i]] for i in ids],
                                 positions=options.lossless_positions,
                                 false_alarm_rate=options.lossless_false_alarm_rate,
                                 seed=options.sample_seed)
    offline = None
    if walks is not None:
        chosen = [walks[f"{o['id']}#{o['sample']}"] for o in base_set["outputs"]]
        estimate = acceptance_length(chosen)
        rounds = sum(w["rounds"] for w in chosen)
        width = len(chosen[0]["accepted_per_pos"]) if chosen else 0
        offline = {
            "acceptance_length": estimate,
            "acceptance_rate_per_position": [sum(w["accepted_per_pos"][j] for w in chosen) / rounds
                                             if rounds else None for j in range(width)],
            "expected_rounds": rounds,
            "num_generations": len(chosen),
            "agreement": (estimate / vllm["acceptance_length"]
                          if estimate and vllm["acceptance_length"] else None),
            # Within vLLM's interval: the check the offline estimate is held to.
            "within_ci": within(estimate, ci),
        }
    return {"vllm": vllm, "lossless": lossless, "offline": offline}

