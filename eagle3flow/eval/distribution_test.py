"""Losslessness at temperature, judged on distributions: does serving with the draft
change what the target says?

At temperature the same seed does not give the same text with and without the draft
(the draft's proposals and the rejection sampler consume random numbers the plain
decoder does not), so the greedy check (identical outputs) does not apply. What
speculative sampling promises is the same *distribution* of answers. For each prompt,
``n`` answers sampled without the draft and ``n`` with it are compared on their tokens
``1..m`` (``m`` = LOSSLESS_POSITIONS by default).

The test: a **stratified two-sample permutation test**. Statistic: the sum, over
prompts and over positions ``1..m``, of the unbiased estimate of the squared L2
distance ``sum_x (p(x) - q(x))^2`` between the two groups' distributions of the token at
that position (an answer already ended counts as its own category):
``sum_x [a_x(a_x-1)/(n_a(n_a-1)) + b_x(b_x-1)/(n_b(n_b-1)) - 2 a_x b_x/(n_a n_b)]`` from the
counts ``a``, ``b``. Unbiased, so its null mean is 0 however few samples a prompt has: a
plug-in distance (total variation of the empirical distributions) is dominated by the
sampling noise of 4 answers a prompt and loses most of its power. Under the null (the
draft leaves the distribution alone) the answers of a prompt are exchangeable between the
groups, so shuffling the labels within each prompt gives the statistic's exact null
distribution, whatever the vocabulary, however sparse the counts (where a chi-square
approximation would not hold).
p-value: ``(1 + #{permuted >= observed}) / (1 + permutations)``; the check fails when
``p < false_alarm_rate``, i.e. a lossless draft is flagged at most that often.

Position 0 is left out: the first token comes from the prefill, before the draft proposes
anything, and with the same seed both engines draw the same one (identical pairs would
make the permutation test blind: their distance is 0 whatever the draft does later).
From position 1 on the draft's proposals and the rejection sampler use the random numbers
differently, so the two answers of a seed are no longer coupled; tokens 1.. are where
drafts are accepted or rejected.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

LOSSLESS_POSITIONS = 4
PERMUTATIONS = 999
ENDED = -1          # the category of a position past an answer's end
TEST_NAME = ("stratified two-sample permutation test (labels shuffled within each prompt); "
             "statistic: sum over prompts and over answer positions 1..m of the unbiased squared "
             "L2 distance between the token distributions with and without the draft")


def _one_hot(columns: np.ndarray) -> np.ndarray:
    """``[samples, m]`` token ids -> ``[samples, sum of categories per position]`` 0/1."""
    blocks = []
    for j in range(columns.shape[1]):
        _, codes = np.unique(columns[:, j], return_inverse=True)
        block = np.zeros((columns.shape[0], codes.max() + 1))
        block[np.arange(columns.shape[0]), codes] = 1
        blocks.append(block)
    return np.concatenate(blocks, axis=1)


def _squared_l2(in_a: np.ndarray, onehot: np.ndarray, n_a: int, n_b: int) -> np.ndarray:
    """The unbiased squared L2 distance (module doc) for each row of group indicators
    ``in_a [R, samples]``, summed over the positions ``onehot``'s columns span."""
    a = in_a @ onehot
    b = (1 - in_a) @ onehot
    return ((a * (a - 1)).sum(1) / (n_a * (n_a - 1)) + (b * (b - 1)).sum(1) / (n_b * (n_b - 1))
            - 2 * (a * b).sum(1) / (n_a * n_b))


def _leading(answers: Sequence[Sequence[int]], m: int) -> np.ndarray:
    """Tokens ``1..m`` of each answer (position 0, the prefill's, is left out: module doc)."""
    return np.array([[int(a[j]) if j < len(a) else ENDED for j in range(1, m + 1)] for a in answers],
                    dtype=np.int64).reshape(len(answers), m)


def distribution_test(without_draft: Sequence[Sequence[Sequence[int]]],
                      with_draft: Sequence[Sequence[Sequence[int]]],
                      positions: int = LOSSLESS_POSITIONS, false_alarm_rate: float = 0.01,
                      permutations: int = PERMUTATIONS, seed: int = 0) -> dict:
    """``without_draft[p]`` / ``with_draft[p]``: prompt ``p``'s sampled answers (token ids)
    without and with the draft -> ``{"passed", "p_value", "statistic", ...}`` (module doc).

    Prompts where either group has no answer are left out."""
    if not 0 < false_alarm_rate < 1:
        raise ValueError(f"false_alarm_rate must be in (0, 1), got {false_alarm_rate}")
    if positions < 1 or permutations < 1:
        raise ValueError(f"positions and permutations must be >= 1, got {positions}, {permutations}")
    if len(without_draft) != len(with_draft):
        raise ValueError(f"{len(without_draft)} prompts without the draft, {len(with_draft)} with it")
    rng = np.random.default_rng(seed)
    observed = 0.0
    permuted = np.zeros(permutations)
    compared = samples = 0
    for a, b in zip(without_draft, with_draft):
        if len(a) < 2 or len(b) < 2:
            continue
        compared += 1
        samples += len(a) + len(b)
        onehot = _one_hot(_leading(list(a) + list(b), positions))
        in_a = np.concatenate([np.ones(len(a)), np.zeros(len(b))])
        observed += _squared_l2(in_a[None, :], onehot, len(a), len(b))[0]
        permuted += _squared_l2(rng.permuted(np.tile(in_a, (permutations, 1)), axis=1),
                                onehot, len(a), len(b))
    p_value = float((1 + np.sum(permuted >= observed - 1e-12)) / (1 + permutations)) if compared else None
    return {
        "test": TEST_NAME, "positions": int(positions), "permutations": int(permutations),
        "false_alarm_rate": float(false_alarm_rate), "num_prompts": compared,
        "num_samples": samples, "statistic": float(observed),
        "null_mean": float(permuted.mean()) if compared else None,
        "p_value": p_value,
        # No prompt compared proves nothing: not a pass.
        "passed": p_value is not None and p_value >= false_alarm_rate,
    }
