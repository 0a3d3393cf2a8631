"""The TTT training loss: the teacher's targets and the draft's weighted per-step soft cross-entropy.

``ttt_loss`` = ``sum_j decay^j * CE_j`` over the chain steps (see eagle3flow/draft_model.py for
what step ``j`` of row ``t`` sees and predicts); ``CE_j`` is the masked mean soft
cross-entropy between the teacher ``softmax(lm_head_target(last[t+j+1])[t2d])`` and the
draft's log-softmax over the draft vocab, on the rows step ``j`` is scored on.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from eagle3flow.draft_model import Eagle3Draft, PackedLayout


def teacher_targets(last: torch.Tensor, teacher_head: torch.Tensor, chunk_rows: int = 4096):
    """Teacher probabilities ``[N, Vd]`` (float32) and argmax ``[N]`` from ``last [N, H]``."""
    probs, argmax = [], []
    with torch.no_grad():
        for a in range(0, last.shape[0], chunk_rows):
            logits = (last[a:a + chunk_rows].to(teacher_head.dtype) @ teacher_head.T).float()
            probs.append(torch.softmax(logits, dim=-1))
            argmax.append(logits.argmax(-1))
    return torch.cat(probs), torch.cat(argmax)


def step_rows(layout: PackedLayout, loss_mask: torch.Tensor, step: int) -> torch.Tensor:
    """Packed row indices that step ``step`` is scored on: index ``t+step+2`` exists and is masked in."""
    valid = layout.valid(step)
    n = loss_mask.numel()
    target = (torch.arange(n, device=loss_mask.device) + step + 2).clamp(max=n - 1)
    return (valid & loss_mask[target]).nonzero().flatten()


def ttt_loss(model: Eagle3Draft, batch: dict, teacher_head: torch.Tensor, num_steps: int,
             decay: float, autocast: bool):
    """Weighted TTT loss (scalar) and per-step (loss, accuracy, rows) floats."""
    layout = PackedLayout.from_cu_seqlens(batch["cu_seqlens"], batch["input_ids"].device)
    probs, argmax = teacher_targets(batch["last"], teacher_head)
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
        _, hiddens = model.forward_ttt(batch["aux"], batch["input_ids"], batch["cu_seqlens"],
                                       num_steps, layout, compute_logits=False)
    total = hiddens[0].new_zeros((), dtype=torch.float32)
    stats = []
    for j in range(num_steps):
        rows = step_rows(layout, batch["loss_mask"], j)
        if rows.numel() == 0:
            stats.append((0.0, 0.0, 0))
            continue
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
            logits_j = model.logits(hiddens[j][rows])
        logp = F.log_softmax(logits_j.float(), dim=-1)
        target = rows + j + 1          # teacher for index t+j+2 is last[t+j+1]
        loss_j = -(probs[target] * logp).sum(-1).mean()
        total = total + (decay ** j) * loss_j
        acc = (logp.argmax(-1) == argmax[target]).float().mean()
        stats.append((float(loss_j.detach()), float(acc), int(rows.numel())))
    return total, stats
