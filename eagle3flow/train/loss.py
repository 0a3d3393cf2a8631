"""The TTT training loss: the teacher's targets and the draft's weighted per-step soft cross-entropy.

``ttt_loss`` = ``sum_j decay^j * CE_j`` over the chain steps (see eagle3flow/model/draft.py for
what step ``j`` of row ``t`` sees and predicts); ``CE_j`` is the masked mean soft
cross-entropy between the teacher ``softmax(lm_head_target(last[t+j+1])[t2d])`` and the
draft's log-softmax over the draft vocab, on the rows step ``j`` is scored on.
"""
from __future__ import annotations

import torch

from eagle3flow.model.draft import Eagle3Draft, PackedLayout, host_to_device
from eagle3flow.model.kernels.soft_cross_entropy import linear_soft_cross_entropy, row_logsumexp_argmax


def teacher_targets(last: torch.Tensor, teacher_head: torch.Tensor, chunk_rows: int = 4096):
    """Teacher probabilities ``[N, Vd]`` (float32) and argmax ``[N]`` from ``last [N, H]``."""
    probs, argmax = [], []
    with torch.no_grad():
        for a in range(0, last.shape[0], chunk_rows):
            logits = (last[a:a + chunk_rows].to(teacher_head.dtype) @ teacher_head.T).float()
            probs.append(torch.softmax(logits, dim=-1))
            argmax.append(logits.argmax(-1))
    return torch.cat(probs), torch.cat(argmax)


def teacher_logits(last: torch.Tensor, teacher_head: torch.Tensor, chunk_rows: int = 8192):
    """The teacher over the draft vocab, kept compact for :func:`soft_cross_entropy`:
    logits ``[N, Vd]`` in the head's dtype, their logsumexp ``[N]`` float32, argmax ``[N]``."""
    n = last.shape[0]
    logits = last.new_empty((n, teacher_head.shape[0]), dtype=teacher_head.dtype)
    lse = last.new_empty(n, dtype=torch.float32)
    argmax = last.new_empty(n, dtype=torch.int64)
    with torch.no_grad():
        for a in range(0, n, chunk_rows):
            chunk = torch.mm(last[a:a + chunk_rows].to(teacher_head.dtype), teacher_head.T,
                             out=logits[a:a + chunk_rows])
            row_logsumexp_argmax(chunk, lse[a:a + chunk_rows], argmax[a:a + chunk_rows])
    return logits, lse, argmax


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
             decay: float, autocast: bool, denominators: list[int] | None = None):
    """Weighted TTT loss (float32 scalar) and :class:`StepStats` (per-step loss, accuracy, rows).

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
    t_logits, t_lse, t_argmax = teacher_logits(batch["last"], teacher_head)
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
        _, normed = model.forward_ttt(batch["aux"], batch["input_ids"], batch["cu_seqlens"],
                                      num_steps, layout, compute_logits=False, normed=True)
    stats = torch.zeros(num_steps, 3, device=device)
    if sum(counts) == 0:
        return normed[0].new_zeros((), dtype=torch.float32), StepStats(stats)
    # Every step's scored rows through the lm_head and the loss at once: one GEMM per
    # direction and one lm_head gradient instead of one per step.
    rows_per_step = rows.split(counts)
    x = _GatherRows.apply(rows_per_step, *normed)
    count_t = host_to_device(counts, device, torch.float32)
    step_id = torch.repeat_interleave(torch.arange(num_steps, device=device), count_t.long(),
                                      output_size=rows.numel())
    # the teacher for index t+j+2 is last[t+j+1]
    target = rows + step_id + 1
    denominator = count_t if denominators is None else host_to_device(denominators, device, torch.float32)
    decays = host_to_device([decay ** j for j in range(num_steps)], device, torch.float32)
    row_scale = (decays / denominator.clamp(min=1))[step_id]
    total, row_ce, hits = linear_soft_cross_entropy(x, model.lm_head.weight.to(x.dtype), t_logits, t_lse,
                                                    target, t_argmax, row_scale)
    stats[:, 0] = torch.zeros(num_steps, device=device).index_add_(0, step_id, row_ce) / denominator.clamp(min=1)
    stats[:, 1] = torch.zeros(num_steps, device=device).index_add_(0, step_id, hits.float()) / count_t.clamp(min=1)
    stats[:, 2] = count_t
    return total, StepStats(stats)
