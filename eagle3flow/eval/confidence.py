"""A confidence interval for acceptance length measured on sampled answers.

At temperature an acceptance length is a random quantity: the answers, and so the
rounds, differ from seed to seed. vLLM's figure is a ratio of sums
(``1 + accepted / drafts`` over every generation); its interval here is a **percentile
bootstrap over prompts**: prompts are drawn with replacement (each with all its samples,
since samples of one prompt are not independent of each other), the ratio of sums is
recomputed, and the interval is the central ``confidence`` share of BOOTSTRAP_RESAMPLES
such ratios. Prompts, not rounds, are the unit because rounds of one answer share its
context: resampling rounds would make the interval too narrow.
"""
from __future__ import annotations

import numpy as np

BOOTSTRAP_RESAMPLES = 2000
CI_METHOD = (f"percentile bootstrap over prompts ({BOOTSTRAP_RESAMPLES} resamples, each prompt "
             f"with all its samples), of the ratio of sums 1 + accepted/drafts")


def acceptance_length_ci(per_prompt: list[tuple[int, int]], confidence: float = 0.95,
                         seed: int = 0) -> dict:
    """``per_prompt [(accepted, drafts), ...]`` summed over each prompt's samples ->
    ``{"acceptance_length", "ci_low", "ci_high", "confidence", "num_prompts", "method"}``.

    Prompts with no draft round (an answer of one token) carry no information and are
    left out; with fewer than two informative prompts the interval is null."""
    if not 0 < confidence < 1:
        raise ValueError(f"confidence must be in (0, 1), got {confidence}")
    counts = np.array([(a, d) for a, d in per_prompt if d > 0], dtype=np.float64).reshape(-1, 2)
    result = {"acceptance_length": None, "ci_low": None, "ci_high": None,
              "confidence": confidence, "num_prompts": int(len(counts)), "method": CI_METHOD}
    if not len(counts):
        return result
    result["acceptance_length"] = float(1 + counts[:, 0].sum() / counts[:, 1].sum())
    if len(counts) < 2:
        return result
    rng = np.random.default_rng(seed)
    picks = rng.integers(0, len(counts), size=(BOOTSTRAP_RESAMPLES, len(counts)))
    accepted, drafts = counts[picks, 0].sum(1), counts[picks, 1].sum(1)
    ratios = 1 + accepted / drafts        # every prompt kept has drafts > 0
    tail = (1 - confidence) / 2
    result["ci_low"], result["ci_high"] = (float(x) for x in np.quantile(ratios, [tail, 1 - tail]))
    return result


def within(value: float | None, interval: dict) -> bool | None:
    """Whether ``value`` lies in ``interval`` (:func:`acceptance_length_ci`); None where
    either is unknown."""
    if value is None or interval.get("ci_low") is None:
        return None
    return interval["ci_low"] <= value <= interval["ci_high"]
