"""Greedy block drafting replayed exactly on known greedy outputs: the acceptance vLLM
would count for a DFlash draft, per position, without vLLM.

A DFlash round needs only the verified prefix: the block anchored at the bonus token
``x[a]`` reads the target's states of rows ``0..a-1`` and drafts ``x[a+1..a+K]`` in one
pass, never its own guesses. So one :meth:`DFlashDraft.predict_blocks` pass over
``prompt + output`` gives every round's proposal, and the rounds are
eagle3flow/eval/replay.py's :func:`replay_greedy_speculation` on them (its row ``t``
guesses indices ``t+2..``: the block anchored at ``t+1``). The first ``K`` columns are the
draft served with ``num_speculative_tokens = K`` (the masked slots beyond K are not in
the block then, and a non-causal block's earlier slots see them: vLLM at a smaller K
serves a different block, so only ``K = block_size - 1`` is exact).
"""
from __future__ import annotations

import torch

from eagle3flow.eval.replay import replay_greedy_speculation
from eagle3flow.model.dflash import DFlashDraft


def dflash_chains(model: DFlashDraft, aux: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """``[T, K]`` in replay_greedy_speculation's convention: row ``t`` = the block anchored
    at ``t+1`` (the last row, with no token after it, is 0)."""
    blocks = model.predict_blocks(aux, token_ids)
    return torch.cat([blocks[1:], torch.zeros_like(blocks[:1])])


def replay_dflash(model: DFlashDraft, aux: torch.Tensor, token_ids, prompt_len: int,
                  end: int | None = None) -> dict:
    """The replay (rounds, accepted, accepted_per_pos, per_round) of one generation: ``aux
    [T, A*Ht]`` the target's states of ``token_ids`` (prompt + greedy output) at the
    draft's target layers. ``end``: where the generation stopped, when ``token_ids`` go
    on with the target's greedy continuation (K more tokens make the count exact at the
    end, see :func:`replay_greedy_speculation`)."""
    ids = torch.as_tensor(token_ids).long()
    return replay_greedy_speculation(dflash_chains(model, aux, ids), ids.tolist(), prompt_len, end)
