"""Acceptance at temperature estimated offline: the expected rounds of speculative
sampling along an answer the target sampled itself.

Under rejection sampling (speculative sampling) a drafted token ``x ~ q`` is accepted
with probability ``min(1, p(x)/q(x))``, so a step is accepted with probability
``alpha = sum_x min(p(x), q(x))`` (``p``: the target's distribution at the serving
temperature, ``q``: the draft's). A round of K steps accepts ``N`` tokens with
``P(N >= i) = alpha_0 * ... * alpha_{i-1}``; after it the target adds one token and the
next round starts ``N + 1`` positions later.

:func:`expected_acceptance` walks those rounds in expectation over one answer (a
distribution over where each round starts, not one sampled walk), so the estimate is
``1 + E[accepted] / E[rounds]``: the same ratio vLLM's counters give. With every
``alpha`` 0 or 1 (a greedy draft against a greedy target) it is exactly the greedy replay
(eagle3flow/eval/replay.py, ``replay_greedy_speculation``).

Approximation, stated: the ``alpha`` of a round's later steps are read along the
target's own sampled tokens, while in serving an accepted token is distributed as
``min(p, q) / alpha``; the two agree where the draft is good, and the evaluation compares
the estimate with vLLM's interval (evaluate.py) rather than assuming it.
"""
from __future__ import annotations

from typing import Sequence

import torch


def step_acceptance(p_target: torch.Tensor, q_draft: torch.Tensor) -> torch.Tensor:
    """``sum_x min(p(x), q(x))`` over the last dimension (both are distributions over the
    same ids)."""
    return torch.minimum(p_target, q_draft).sum(-1)


def tempered(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """The distribution a sampler at ``temperature`` draws from (0: the argmax, one-hot)."""
    if temperature <= 0:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).to(torch.float32)
    return torch.softmax(logits.float() / temperature, dim=-1)


def expected_acceptance(alpha: Sequence[Sequence[float]], prompt_len: int, total: int) -> dict:
    """Expected rounds and accepted tokens of speculative sampling over one answer.

    ``alpha[t][j]``: the probability that step ``j`` of a round started at row ``t`` is
    accepted given steps ``< j`` were (row ``t``: the verified prefix ends at index
    ``t + 1``; step ``j`` proposes index ``t + 2 + j``), for rows ``0..total-1``; steps
    past the answer's end are never accepted, as in the greedy replay. Rounds start at
    ``prompt_len - 1`` and go on while a token remains to be generated.

    Returns ``{"rounds", "accepted", "accepted_per_pos" [K]}`` as expectations (floats).
    """
    k = len(alpha[0]) if len(alpha) else 0
    if len(alpha) != total:
        raise ValueError(f"alpha has {len(alpha)} rows but the sequence has {total} tokens")
    if not 1 <= prompt_len <= total:
        raise ValueError(f"prompt_len {prompt_len} not in 1..{total}")
    start = [0.0] * (total + k + 2)     # probability that a round starts at row t
    start[prompt_len - 1] = 1.0
    rounds = accepted = 0.0
    per_pos = [0.0] * k
    for t in range(prompt_len - 1, total):
        if start[t] == 0.0 or t + 2 > total - 1:
            continue
        rounds += start[t]
        survive = 1.0                    # P(N >= j)
        for j in range(k + 1):
            ok = j < k and t + 2 + j < total
            reach = survive * (float(alpha[t][j]) if ok else 0.0)   # P(N >= j + 1)
            start[t + j + 1] += start[t] * (survive - reach)         # N == j
            if reach == 0.0:
                break
            per_pos[j] += start[t] * reach
            accepted += start[t] * reach
            survive = reach
    return {"rounds": rounds, "accepted": accepted, "accepted_per_pos": per_pos}


def acceptance_length(walks: list[dict]) -> float | None:
    """``1 + E[accepted] / E[rounds]`` summed over answers (vLLM's ratio of sums)."""
    rounds = sum(w["rounds"] for w in walks)
    return 1.0 + sum(w["accepted"] for w in walks) / rounds if rounds else None
