"""The DFlash training loss: anchors sampled in the assistant tokens, one block per anchor,
cross-entropy over the block's masked slots with the DFlash paper's position weighting.

A block anchored at packed row ``g`` (the bonus token ``x[g]``, see
eagle3flow/model/dflash.py) predicts rows ``g+1..g+K`` from its slots ``1..K``. Slot ``k``
weighs ``exp(-(k-1)/gamma)`` (arXiv 2602.06036: an early slot's error ends the accepted
run, so early slots matter most), times the row's loss mask and zero past the sample's
end. The loss is the weighted mean over every scored slot of the batch.

D-PACE (``weighting="dpace"``; Wu et al., arXiv 2605.18810, the default of the established
trainers' DFlash recipes): the fixed decay replaced by weights from the draft's own
confidence, recomputed every step and held constant in the backward. With ``q_i`` the
draft's probability of slot ``i``'s label, smoothed ``q~_i = (1 - alpha) q_i + alpha`` (1 on
unscored slots), ``P_m = prod_{i <= m} q~_i`` is the chance the accepted run reaches slot
``m``, and slot ``j`` weighs ``w_j = sum_{m >= j} P_m`` over the scored ``m``: what an error
at ``j`` costs in expected accepted tokens. The loss is then ``sum_j w_j CE_j`` over the
batch's scored slots, divided by their number (speculators' normalisation: the weights'
growth as the draft improves is kept, not divided out).

Anchors: rows whose token is an assistant token (loss mask 1), that have at least one
row of context before them in their sample and one row after them to predict; up to
``anchors_per_sample`` per sample, drawn without replacement by a seeded generator so a
step's anchors (and so the CPU run) are reproducible.

Targets: ``hard`` = the data's next tokens (the paper's); ``soft`` = the target's own
distribution at that row, ``softmax(lm_head(last[g+k-1]))`` (cheap: the shards hold
``last``; the same teacher the EAGLE-3 loss uses).
"""
from __future__ import annotations

import math

import torch

from eagle3flow.model.dflash import DFlashDraft
from eagle3flow.model.draft import PackedLayout

TARGETS = ("hard", "soft")
WEIGHTINGS = ("decay", "dpace")


def position_weights(block_size: int, gamma: float, device=None) -> torch.Tensor:
    """``[K]`` float32: ``exp(-(k-1)/gamma)`` for slots ``k = 1..K``."""
    k = torch.arange(block_size - 1, dtype=torch.float32, device=device)
    return torch.exp(-k / float(gamma))


def anchor_candidates(layout: PackedLayout, loss_mask: torch.Tensor) -> torch.Tensor:
    """Bool ``[N]``: rows that may anchor a block (assistant token, context before it,
    something after it to predict)."""
    return loss_mask.bool() & (layout.positions >= 1) & (layout.positions + 1 < layout.lengths)


def sample_anchors(cu_seqlens: torch.Tensor, loss_mask: torch.Tensor, anchors_per_sample: int,
                   generator: torch.Generator) -> torch.Tensor:
    """Anchor rows ``[M]`` int64, ascending: up to ``anchors_per_sample`` per sample,
    uniformly without replacement among :func:`anchor_candidates` (on the host)."""
    cu = cu_seqlens.cpu().long()
    layout = PackedLayout.from_cu_seqlens(cu)
    candidates = anchor_candidates(layout, loss_mask.cpu())
    picked = []
    for s in range(len(cu) - 1):
        rows = candidates[cu[s]:cu[s + 1]].nonzero().flatten() + cu[s]
        if rows.numel() > anchors_per_sample:
            rows = rows[torch.randperm(rows.numel(), generator=generator)[:anchors_per_sample]]
        picked.append(rows)
    return torch.cat(picked).sort().values if picked else torch.zeros(0, dtype=torch.int64)


def block_labels(layout: PackedLayout, input_ids: torch.Tensor, loss_mask: torch.Tensor,
                 anchors: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rows [M, K], scored [M, K] bool)``: the packed row slot ``k`` predicts
    (``anchor + k``, clamped) and whether it counts (inside the sample, loss-masked)."""
    k = torch.arange(1, block_size, device=anchors.device)
    rows = anchors.unsqueeze(1) + k
    inside = (layout.positions[anchors].unsqueeze(1) + k) < layout.lengths[anchors].unsqueeze(1)
    rows = rows.clamp(max=input_ids.numel() - 1)
    return rows, inside & loss_mask.bool()[rows]


def dpace_weights(label_log_probs: torch.Tensor, scored: torch.Tensor, alpha: float) -> torch.Tensor:
    """``[M, K]`` D-PACE weights (module docstring), zero on unscored slots, no gradient."""
    with torch.no_grad():
        q = label_log_probs.float().exp()
        smoothed = torch.where(scored, (1 - alpha) * q + alpha, torch.ones_like(q))
        reach = torch.cumprod(smoothed, dim=1) * scored
        return reach.flip(1).cumsum(1).flip(1) * scored


def dflash_loss(model: DFlashDraft, batch: dict, anchors: torch.Tensor, gamma: float,
                target: str = "hard", weighting: str = "decay",
                dpace_alpha: float = 0.5) -> tuple[torch.Tensor, dict]:
    """Weighted block loss (float32 scalar) and per-slot stats.

    ``batch``: ``aux [N, A*Ht]``, ``input_ids [N]``, ``cu_seqlens [B+1]``, ``loss_mask [N]``,
    and ``last [N, H]`` for ``target="soft"``. ``anchors [M]``: :func:`sample_anchors`.
    Stats: ``slot_loss``, ``slot_accuracy`` (argmax = label) and ``slot_rows`` per slot
    ``1..K`` (lists), ``anchors``, ``loss_denominator`` (what the weighted sum was divided by:
    several processes rescale to the whole batch's).
    """
    if target not in TARGETS:
        raise ValueError(f"DFlash loss target {target!r} is not one of {TARGETS}")
    if weighting not in WEIGHTINGS:
        raise ValueError(f"DFlash position weighting {weighting!r} is not one of {WEIGHTINGS}")
    cfg = model.config
    input_ids = batch["input_ids"].long()
    layout = PackedLayout.from_cu_seqlens(batch["cu_seqlens"], input_ids.device)
    rows, scored = block_labels(layout, input_ids, batch["loss_mask"], anchors, cfg.block_size)
    logits = model.block_logits(batch["aux"], input_ids, batch["cu_seqlens"], anchors, layout).float()
    log_probs = torch.log_softmax(logits, dim=-1)                          # [M, K, V]
    labels = input_ids[rows]
    label_log_probs = log_probs.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    if target == "hard":
        per_slot = -label_log_probs
    else:
        with torch.no_grad():
            # the target's distribution for row r is its lm_head at row r-1
            teacher = torch.softmax(model.lm_head(batch["last"][rows - 1].to(model.lm_head.weight.dtype)).float(), -1)
        per_slot = -(teacher * log_probs).sum(-1)
    if weighting == "dpace":
        weights = dpace_weights(label_log_probs, scored, dpace_alpha)
        total = scored.sum().float()
    else:
        weights = position_weights(cfg.block_size, gamma, logits.device) * scored.float()
        total = weights.sum()
    loss = (per_slot * weights).sum() / total.clamp(min=1e-6)
    with torch.no_grad():
        counts = scored.sum(0)
        hits = ((logits.argmax(-1) == labels) & scored).sum(0)
        slot_loss = (per_slot * scored).sum(0) / counts.clamp(min=1)
    stats = {"slot_loss": slot_loss.tolist(), "slot_accuracy": (hits / counts.clamp(min=1)).tolist(),
             "slot_rows": counts.tolist(), "anchors": int(anchors.numel()), "loss_denominator": float(total)}
    if not math.isfinite(float(loss.detach())):
        raise FloatingPointError(f"DFlash loss is {float(loss.detach())} (stats {stats})")
    return loss, stats

