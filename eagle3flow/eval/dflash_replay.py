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

from pathlib import Path

import torch

from eagle3flow.eval.replay import per_answer, replay_greedy_speculation
from eagle3flow.export.dflash import load_exported_dflash
from eagle3flow.extract.hf import capture
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


def simulate_dflash_on_outputs(draft_dir: Path, target_path: Path, units: list[dict], k: int, device: str,
                               dtype: str, replay_path: Path, key: str, loaded: dict | None = None,
                               label: str = "replay", trust_remote_code: bool = False) -> dict[str, dict]:
    """eagle3flow/eval/replay.py's simulate_on_outputs for a DFlash draft: per generation
    (prompt + its vLLM greedy output) the target's states of the draft's layers, one block
    pass, the rounds replayed; only at ``k`` (the K vLLM served, ``block_size - 1``: a block
    at another K is another block, module docstring). Returns ``{unit key: {"by_k": {"K": replay}}}``."""
    def by_k(target, draft, aux_layer_ids, ids, prompt_len, torch_device):
        if k != draft.config.num_speculative_tokens:
            raise ValueError(f"{draft_dir}: a DFlash draft of blocks of {draft.config.block_size} replays only "
                             f"at K = {draft.config.num_speculative_tokens}, not {k}")
        input_ids = torch.tensor([ids], dtype=torch.long, device=torch_device)
        aux, _ = capture(target, input_ids, torch.ones_like(input_ids), aux_layer_ids)
        return {str(k): replay_dflash(draft, aux[0], input_ids[0].cpu(), prompt_len)}

    def load(path, target, torch_dtype, torch_device):
        return load_exported_dflash(path, target, dtype=torch_dtype).to(torch_device)

    return per_answer(draft_dir, target_path, units, device, dtype, replay_path, key,
                       {} if loaded is None else loaded, label, trust_remote_code, by_k,
                       describe=f"DFlash blocks, K={k}", load_draft=load)
