"""The TTT training loss: the teacher's targets and the draft's weighted per-step soft cross-entropy.

``ttt_loss`` = ``sum_j decay^j * CE_j`` over the chain steps (see eagle3flow/model/draft.py for
what step ``j`` of row ``t`` sees and predicts); ``CE_j`` is the masked mean soft
cross-entropy between the teacher ``softmax(lm_head_target(last[t+j+1])[t2d])`` and the
draft's log-softmax over the draft vocab, on the rows step ``j`` is scored on.

``train.loss`` other than that (eagle3flow/train/objective.py: the LK acceptance losses, a
mix, another temperature) replaces ``CE_j`` by the objective's masked mean over the same
rows (:func:`objective_step_loss`); the step weights stay.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from eagle3flow.model.draft import Eagle3Draft, PackedLayout, host_to_device
from eagle3flow.model.kernels.acceptance import linear_acceptance_loss, mixed_row_loss, row_acceptance
from eagle3flow.model.kernels.soft_cross_entropy import linear_soft_cross_entropy, row_logsumexp_argmax
from eagle3flow.train.objective import Objective


def teacher_targets(last: torch.Tensor, teacher_head: torch.Tensor, chunk_rows: int = 4096):
    """Teacher probabilities ``[N, Vd]`` (float32) and argmax ``[N]`` from ``last [N, H]``."""
    probs, argmax = [], []
    with torch.no_grad():
        for a in range(0, last.shape[0], chunk_rows):
            logits = (last[a:a + chunk_rows].to(teacher_head.dtype) @ teacher_head.T).float()
            probs.append(torch.softmax(logits, dim=-1))
            argmax.append(logits.argmax(-1))
    return torch.cat(probs), torch.cat(argmax)


def teacher_logits(last: torch.Tensor, teacher_head: torch.Tensor, chunk_rows: int = 8192,
                   temperature: float = 1.0):
    """The teacher over the draft vocab, kept compact for :func:`soft_cross_entropy`:
    logits ``[N, Vd]`` in the head's dtype (divided by ``temperature``), their logsumexp
    ``[N]`` float32, argmax ``[N]``."""
    n = last.shape[0]
    logits = last.new_empty((n, teacher_head.shape[0]), dtype=teacher_head.dtype)
    lse = last.new_empty(n, dtype=torch.float32)
    argmax = last.new_empty(n, dtype=torch.int64)
    with torch.no_grad():
        for a in range(0, n, chunk_rows):
            chunk = torch.mm(last[a:a + chunk_rows].to(teacher_head.dtype), teacher_head.T,
                             out=logits[a:a + chunk_rows])
            if temperature != 1.0:
                chunk.div_(temperature)
            row_logsumexp_argmax(chunk, lse[a:a + chunk_rows], argmax[a:a + chunk_rows])
    return logits, lse, argmax


def target_logsumexp(last: torch.Tensor, draft_vocab_lse: torch.Tensor, unreachable_head: torch.Tensor,
                     temperature: float = 1.0, max_chunk_elements: int = 2 ** 28) -> torch.Tensor:
    """The target's logsumexp over its whole vocab ``[N]`` float32: the draft vocab's
    (``draft_vocab_lse``, from :func:`teacher_logits`) and that of ``unreachable_head``, the
    lm_head rows of the tokens outside it (eagle3flow/train/build.py), one chunk of rows at
    a time so the ``[N, Vt - Vd]`` logits never exist whole."""
    n, outside = last.shape[0], unreachable_head.shape[0]
    if outside == 0:
        return draft_vocab_lse
    lse = last.new_empty(n, dtype=torch.float32)
    argmax = last.new_empty(n, dtype=torch.int64)
    chunk_rows = max(1, max_chunk_elements // outside)
    with torch.no_grad():
        for a in range(0, n, chunk_rows):
            chunk = last[a:a + chunk_rows].to(unreachable_head.dtype) @ unreachable_head.T
            if temperature != 1.0:
                chunk.div_(temperature)
            row_logsumexp_argmax(chunk, lse[a:a + chunk_rows], argmax[a:a + chunk_rows])
            del chunk
    return torch.logaddexp(draft_vocab_lse, lse)


def scored_mask(layout: PackedLayout, loss_mask: torch.Tensor, num_steps: int) -> torch.Tensor:
    """Bool ``[K, N]``: row ``t`` is scored at TTT step ``j`` where index ``t+j+2`` is
    inside ``t``'s sample and masked in (on ``loss_mask``'s device)."""
    n = loss_mask.numel()
    index = torch.arange(n, device=loss_mask.device)
    mask = loss_mask.bool()
    return torch.stack([layout.valid(j) & mask[(index + j + 2).clamp(max=n - 1)]
                        for j in range(num_steps)])


def scored_rows(cu_seqlens: torch.Tensor, loss_mask: torch.Tensor, num_steps: int):
    """The packed rows each TTT step is scored on (:func:`scored_mask`).

    Returns ``(rows, counts)``: ``rows [S]`` int64, step 0's rows then step 1's ..., and
    ``counts`` (a list of ``num_steps`` ints). Computed where ``loss_mask`` lives: the
    training loader calls it on the host (eagle3flow/train/data.py), so the step on the
    GPU never waits for it; on a device it costs one sync.
    """
    if num_steps == 0:
        return torch.zeros(0, dtype=torch.int64, device=loss_mask.device), []
    scored = scored_mask(PackedLayout.from_cu_seqlens(cu_seqlens, loss_mask.device), loss_mask,
                         num_steps)
    return scored.flatten().nonzero().flatten() % max(loss_mask.numel(), 1), scored.sum(1).tolist()


class _GatherRows(torch.autograd.Function):
    """``cat_j xs[j][rows_j]``. A step's rows are distinct, so the backward writes each
    step's gradient with a plain scatter (``index_copy_``) instead of ``index_select``'s
    atomic ``index_add_``."""

    @staticmethod
    def forward(ctx, rows_per_step, *xs):
        ctx.rows_per_step = rows_per_step
        ctx.shapes = [x.shape for x in xs]
        return torch.cat([x.index_select(0, rows) for x, rows in zip(xs, rows_per_step)])

    @staticmethod
    def backward(ctx, grad):
        grads = grad.split([rows.numel() for rows in ctx.rows_per_step])
        return (None, *(grad.new_zeros(shape).index_copy_(0, rows, g)
                        for shape, rows, g in zip(ctx.shapes, ctx.rows_per_step, grads)))


class StepStats:
    """Per-step ``(loss, accuracy, rows)`` kept on the device until first read.

    ``tensor [K, 3]`` float32. Indexing or iterating copies it to the host once (a sync),
    so a training loop that reads the stats only when it logs never waits for the GPU.
    """

    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor
        self._rows: list[tuple[float, float, int]] | None = None

    def _host(self) -> list[tuple[float, float, int]]:
        if self._rows is None:
            self._rows = [(loss, acc, int(rows)) for loss, acc, rows in self.tensor.tolist()]
        return self._rows

    def __getitem__(self, index):
        return self._host()[index]

    def __iter__(self):
        return iter(self._host())

    def __len__(self) -> int:
        return self.tensor.shape[0]


def ttt_loss(model: Eagle3Draft, batch: dict, teacher_head: torch.Tensor, num_steps: int,
             decay: float, autocast: bool, denominators: list[int] | None = None,
             objective: Objective | None = None, unreachable_head: torch.Tensor | None = None,
             reduce_sum: Callable[[torch.Tensor], torch.Tensor] | None = None):
    """Weighted TTT loss (float32 scalar) and :class:`StepStats` (per-step loss, accuracy, rows).

    ``objective`` (eagle3flow/train/objective.py; None: forward KL at temperature 1, the
    original path): any other loss goes through :func:`objective_step_loss`, which needs
    ``unreachable_head`` for the acceptance losses and, for lk_hybrid under data
    parallelism, ``reduce_sum`` (a sum over ranks; every rank calls it exactly once).

    ``denominators[j]`` (data parallelism, eagle3flow/train/trainer.py): divide step ``j``'s summed
    cross-entropy by the scored rows of the whole global batch instead of this rank's
    share's, so the gradients summed over ranks are those of the global batch's mean loss.

    ``batch``: ``aux [N, A*Ht]``, ``input_ids [N]``, ``cu_seqlens [B+1]``, ``last [N, H]``,
    ``loss_mask [N]``. The draft's logits are computed only on each step's scored rows, all
    steps in one fused lm_head + soft cross-entropy that reads the teacher's rows in place
    (eagle3flow/model/kernels/soft_cross_entropy.py).
    ``scored_rows`` / ``step_rows`` (optional, from the training loader): :func:`scored_rows`
    computed on the host, the rows on the device and the counts on the host; then the step
    never syncs with the host (otherwise it costs one sync). The stats stay on the device.
    """
    device = batch["input_ids"].device
    layout = PackedLayout.from_cu_seqlens(batch["cu_seqlens"], device)
    if "scored_rows" in batch:
        rows, counts = batch["scored_rows"], [int(c) for c in batch["step_rows"]]
    else:
        rows, counts = scored_rows(batch["cu_seqlens"], batch["loss_mask"], num_steps)
    if objective is not None and not objective.is_forward_kl:
        return objective_step_loss(model, batch, teacher_head, num_steps, decay, autocast, denominators,
                                   objective, unreachable_head, reduce_sum, layout, rows, counts)
    t_logits, t_lse, t_argmax = teacher_logits(batch["last"], teacher_head)
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
        _, normed = model.forward_ttt(batch["aux"], batch["input_ids"], batch["cu_seqlens"],
                                      num_steps, layout, compute_logits=False, normed=True)
    if sum(counts) == 0:
        return normed[0].new_zeros((), dtype=torch.float32), StepStats(torch.zeros(num_steps, 3, device=device))
    # Every step's scored rows through the lm_head and the loss at once: one GEMM per
    # direction and one lm_head gradient instead of one per step.
    scored = gather_scored_rows(normed, rows, counts, num_steps, decay, denominators)
    total, row_ce, hits = linear_soft_cross_entropy(scored.x, model.lm_head.weight.to(scored.x.dtype), t_logits,
                                                    t_lse, scored.target, t_argmax, scored.row_scale)
    return total, step_stats(scored, row_ce, hits, num_steps)


@dataclass
class ScoredRows:
    """Every TTT step's scored rows as one batch: the draft's normed states ``x [S, H]``,
    each row's step ``step_id [S]`` and teacher row ``target [S]``, the steps' row counts
    ``counts [K]`` and normalisers ``denominator [K]`` (float32), and each row's weight
    ``row_scale [S]`` = ``decay**j / denominator[j]``."""
    x: torch.Tensor
    step_id: torch.Tensor
    target: torch.Tensor
    counts: torch.Tensor
    denominator: torch.Tensor
    row_scale: torch.Tensor


def gather_scored_rows(normed: list[torch.Tensor], rows: torch.Tensor, counts: list[int], num_steps: int,
                       decay: float, denominators: list[int] | None) -> ScoredRows:
    device = normed[0].device
    x = _GatherRows.apply(rows.split(counts), *normed)
    count_t = host_to_device(counts, device, torch.float32)
    step_id = torch.repeat_interleave(torch.arange(num_steps, device=device), count_t.long(),
                                      output_size=rows.numel())
    # the teacher for index t+j+2 is last[t+j+1]
    target = rows + step_id + 1
    denominator = count_t if denominators is None else host_to_device(denominators, device, torch.float32)
    decays = host_to_device([decay ** j for j in range(num_steps)], device, torch.float32)
    row_scale = (decays / denominator.clamp(min=1))[step_id]
    return ScoredRows(x, step_id, target, count_t, denominator, row_scale)


def step_stats(scored: ScoredRows, row_loss: torch.Tensor, hits: torch.Tensor, num_steps: int) -> StepStats:
    """Each step's mean loss (over its global normaliser), argmax accuracy and rows."""
    device = row_loss.device
    stats = torch.zeros(num_steps, 3, device=device)
    stats[:, 0] = (torch.zeros(num_steps, device=device).index_add_(0, scored.step_id, row_loss)
                   / scored.denominator.clamp(min=1))
    stats[:, 1] = (torch.zeros(num_steps, device=device).index_add_(0, scored.step_id, hits.float())
                   / scored.counts.clamp(min=1))
    stats[:, 2] = scored.counts
    return StepStats(stats)


def objective_step_loss(model: Eagle3Draft, batch: dict, teacher_head: torch.Tensor, num_steps: int,
                        decay: float, autocast: bool, denominators: list[int] | None, objective: Objective,
                        unreachable_head: torch.Tensor | None, reduce_sum, layout: PackedLayout,
                        rows: torch.Tensor, counts: list[int]):
    """:func:`ttt_loss` for any ``objective`` but today's: the same rows, step weights and
    normalisers, the loss of eagle3flow/train/objective.py at its temperature.

    The per-step loss in the stats is the objective's value; for lk_hybrid, each step's
    blend ``lambda_j = exp(-eta * mean alpha_j)`` comes from the mean acceptance of its
    scored rows over the global batch (``reduce_sum`` sums over ranks) and is constant
    in the backward, as in the LK losses' paper.
    """
    device = batch["input_ids"].device
    temperature = objective.temperature
    t_logits, t_lse, t_argmax = teacher_logits(batch["last"], teacher_head, temperature=temperature)
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
        _, normed = model.forward_ttt(batch["aux"], batch["input_ids"], batch["cu_seqlens"],
                                      num_steps, layout, compute_logits=False, normed=True)
    empty = sum(counts) == 0
    if empty and not objective.needs_step_acceptance:
        return normed[0].new_zeros((), dtype=torch.float32), StepStats(torch.zeros(num_steps, 3, device=device))
    scored = gather_scored_rows(normed, rows, counts, num_steps, decay, denominators)
    # The temperature divides the draft's logits too: through the weight, so autograd
    # carries the 1/T into the lm_head's and the hidden states' gradients.
    weight = model.lm_head.weight.to(scored.x.dtype)
    if temperature != 1.0:
        weight = weight / temperature
    kl_weight = objective.weight("forward_kl")
    if not objective.needs_target_mass:
        total, row_ce, hits = linear_soft_cross_entropy(scored.x, weight, t_logits, t_lse, scored.target, t_argmax,
                                                        scored.row_scale * kl_weight)
        return total, step_stats(scored, kl_weight * row_ce, hits, num_steps)
    if unreachable_head is None:
        raise ValueError(f"train.loss {dict(objective.weights)} compares with the target's full "
                         "distribution: the lm_head rows outside the draft vocab are needed")
    target_lse = target_logsumexp(batch["last"], t_lse, unreachable_head, temperature)
    ce_w = torch.full_like(scored.row_scale, kl_weight)
    tv_w = torch.full_like(scored.row_scale, objective.weight("tv"))
    nla_w = torch.full_like(scored.row_scale, objective.weight("nla"))
    if objective.needs_step_acceptance:
        # before the empty return: every rank takes part in the blend's sum over ranks
        blend = hybrid_blend(scored, weight, t_logits, t_lse, target_lse, num_steps, objective.hybrid_eta,
                             reduce_sum)[scored.step_id]
        ce_w = ce_w + objective.weight("lk_hybrid") * blend
        tv_w = tv_w + objective.weight("lk_hybrid") * (1 - blend)
    if empty:
        return normed[0].new_zeros((), dtype=torch.float32), StepStats(torch.zeros(num_steps, 3, device=device))
    total, row_ce, alpha, hits = linear_acceptance_loss(
        scored.x, weight, t_logits, t_lse, target_lse, scored.target, t_argmax,
        ce_w * scored.row_scale, tv_w * scored.row_scale, nla_w * scored.row_scale)
    return total, step_stats(scored, mixed_row_loss(row_ce, alpha, ce_w, tv_w, nla_w), hits, num_steps)


def hybrid_blend(scored: ScoredRows, weight: torch.Tensor, t_logits, t_lse, target_lse, num_steps: int,
                 eta: float, reduce_sum) -> torch.Tensor:
    """lk_hybrid's ``lambda [K]``: ``exp(-eta * mean acceptance)`` of each TTT step over the
    global batch, no gradient. Every rank calls ``reduce_sum`` once, rows or none."""
    alpha = row_acceptance(scored.x.detach(), weight.detach(), t_logits, t_lse, target_lse, scored.target)
    sums = torch.zeros(num_steps, device=alpha.device).index_add_(0, scored.step_id, alpha)
    if reduce_sum is not None:
        sums = reduce_sum(sums)
    return torch.exp(-eta * sums / scored.denominator.clamp(min=1))
