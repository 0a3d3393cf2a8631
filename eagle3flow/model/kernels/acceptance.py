"""The draft's lm_head and a weighted mix of soft cross-entropy and acceptance losses in one.

For a scored row with draft logits ``z`` (``d = softmax(z)`` over the draft vocabulary),
the teacher's logits ``t`` over the draft vocabulary, their logsumexp ``lse_d`` and the
target's full-vocabulary logsumexp ``lse_t`` (``>= lse_d``: the target's tokens outside the
draft vocabulary count there):

    p = exp(t - lse_d)                     the teacher renormalised (forward KL's target)
    q = exp(t - lse_t)                     the target's own probability of each draft token
    CE    = lse(z) * sum p - sum p * z      dCE/dz    = d * sum p - p
    alpha = sum min(d, q)                   dalpha/dz = d * (1[d < q] - s),  s = sum_{d < q} d

The row's loss is ``w_ce * CE + w_tv * (1 - alpha) + w_nla * -log(alpha)`` with per-row
weights (the TTT step's decay and normaliser, the mix, lk_hybrid's blend already folded
in). ``alpha`` below ALPHA_FLOOR is held there in ``-log``: such a row adds a bounded
value and no gradient to nla instead of an infinite one.

:func:`linear_acceptance_loss` is plain float32 autograd off CUDA (the CPU path and the
tests' reference). On CUDA the logits exist one chunk of rows at a time and each chunk's
gradient is turned into the input and weight gradients at once, as
eagle3flow/model/kernels/soft_cross_entropy.py's fused path does (there with a Triton
kernel, here with float32 torch ops on the chunk).
"""
from __future__ import annotations

import torch

ALPHA_FLOOR = 1e-6


def row_terms(logits: torch.Tensor, teacher_logits: torch.Tensor, teacher_lse: torch.Tensor,
              target_lse: torch.Tensor, target: torch.Tensor):
    """``(CE [n], alpha [n])`` of draft ``logits [n, V]`` against teacher rows ``target [n]``,
    in float32, differentiable in ``logits``."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    t = teacher_logits[target].float()
    p = torch.exp(t - teacher_lse[target].float().unsqueeze(-1))
    q = torch.exp(t - target_lse[target].float().unsqueeze(-1))
    ce = -(p * logp).sum(-1)
    alpha = torch.minimum(logp.exp(), q).sum(-1)
    return ce, alpha


def mixed_row_loss(ce: torch.Tensor, alpha: torch.Tensor, ce_weight, tv_weight, nla_weight) -> torch.Tensor:
    """``w_ce * CE + w_tv * (1 - alpha) + w_nla * -log(alpha)`` per row (see the module's docstring)."""
    return ce_weight * ce + tv_weight * (1 - alpha) - nla_weight * torch.log(alpha.clamp_min(ALPHA_FLOOR))


def linear_acceptance_loss(x: torch.Tensor, weight: torch.Tensor, teacher_logits: torch.Tensor,
                           teacher_lse: torch.Tensor, target_lse: torch.Tensor, target: torch.Tensor,
                           teacher_argmax: torch.Tensor, ce_weight: torch.Tensor, tv_weight: torch.Tensor,
                           nla_weight: torch.Tensor, max_chunk_elements: int = 2 ** 26):
    """``logits = x @ weight.T`` and the mixed loss of every row.

    ``x [n, H]``, ``weight [V, H]``; ``teacher_logits [Nt, V]`` with ``teacher_lse [Nt]``
    (over the draft vocabulary) and ``target_lse [Nt]`` (over the target's), ``target [n]``
    their rows; ``*_weight [n]`` float32. Returns ``(sum of the rows' losses, CE [n], alpha
    [n], hits [n] bool)``; only the first is differentiable (in ``x`` and ``weight``).
    """
    if x.is_cuda:
        return _ChunkedLinearAcceptance.apply(x, weight, teacher_logits, teacher_lse, target_lse, target,
                                              teacher_argmax, ce_weight, tv_weight, nla_weight, max_chunk_elements)
    return linear_acceptance_loss_reference(x, weight, teacher_logits, teacher_lse, target_lse, target,
                                            teacher_argmax, ce_weight, tv_weight, nla_weight)


def linear_acceptance_loss_reference(x, weight, teacher_logits, teacher_lse, target_lse, target, teacher_argmax,
                                     ce_weight, tv_weight, nla_weight):
    """:func:`linear_acceptance_loss` in plain autograd ops (CPU path, tests' reference)."""
    logits = torch.nn.functional.linear(x, weight)
    ce, alpha = row_terms(logits, teacher_logits, teacher_lse, target_lse, target)
    total = mixed_row_loss(ce, alpha, ce_weight, tv_weight, nla_weight).sum()
    hits = logits.argmax(-1) == teacher_argmax[target]
    return total, ce.detach(), alpha.detach(), hits


def _chunk(logits: torch.Tensor, teacher_logits, teacher_lse, target_lse, target):
    """Everything a chunk's loss and gradient need, float32, without autograd."""
    z = logits.float()
    lse = torch.logsumexp(z, dim=-1, keepdim=True)
    d = torch.exp(z - lse)
    t = teacher_logits[target].float()
    p = torch.exp(t - teacher_lse[target].float().unsqueeze(-1))
    q = torch.exp(t - target_lse[target].float().unsqueeze(-1))
    below = d < q
    psum = p.sum(-1, keepdim=True)
    ce = (lse * psum - (p * z).sum(-1, keepdim=True)).squeeze(-1)
    alpha = torch.where(below, d, q).sum(-1)
    s = (d * below).sum(-1, keepdim=True)
    return z, d, p, psum, below, s, ce, alpha


def _rows_per_chunk(vocab: int, max_chunk_elements: int) -> int:
    return max(1, max_chunk_elements // max(vocab, 1))


@torch.no_grad()
def row_acceptance(x: torch.Tensor, weight: torch.Tensor, teacher_logits: torch.Tensor, teacher_lse: torch.Tensor,
                   target_lse: torch.Tensor, target: torch.Tensor, max_chunk_elements: int = 2 ** 26) -> torch.Tensor:
    """``alpha [n]`` float32 of ``logits = x @ weight.T``, no gradient, one chunk of rows at a
    time (lk_hybrid's blend needs every row's before any gradient)."""
    n = x.shape[0]
    alpha = torch.empty(n, dtype=torch.float32, device=x.device)
    chunk = _rows_per_chunk(weight.shape[0], max_chunk_elements)
    for a in range(0, n, chunk):
        b = min(n, a + chunk)
        logits = torch.nn.functional.linear(x[a:b], weight)
        alpha[a:b] = _chunk(logits, teacher_logits, teacher_lse, target_lse, target[a:b])[7]
    return alpha


class _ChunkedLinearAcceptance(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, teacher_logits, teacher_lse, target_lse, target, teacher_argmax,
                ce_weight, tv_weight, nla_weight, max_chunk_elements):
        n, v = x.shape[0], weight.shape[0]
        x = x.contiguous()
        ce = torch.empty(n, dtype=torch.float32, device=x.device)
        alpha = torch.empty(n, dtype=torch.float32, device=x.device)
        hits = torch.empty(n, dtype=torch.bool, device=x.device)
        grad_x = torch.empty_like(x)
        grad_w = torch.zeros_like(weight)
        chunk = _rows_per_chunk(v, max_chunk_elements)
        with torch.autocast("cuda", enabled=False):      # x and weight share a dtype already
            for a in range(0, n, chunk):
                b = min(n, a + chunk)
                logits = x[a:b] @ weight.T
                z, d, p, psum, below, s, ce[a:b], alpha[a:b] = _chunk(
                    logits, teacher_logits, teacher_lse, target_lse, target[a:b])
                hits[a:b] = z.argmax(-1) == teacher_argmax[target[a:b]]
                # d(-log alpha)/d alpha = -1/alpha, none where alpha is held at the floor
                nla = torch.where(alpha[a:b] >= ALPHA_FLOOR, nla_weight[a:b] / alpha[a:b].clamp_min(ALPHA_FLOOR), 0)
                acceptance_weight = (tv_weight[a:b] + nla).unsqueeze(-1)
                grad = ce_weight[a:b].unsqueeze(-1) * (d * psum - p) - acceptance_weight * d * (below.to(d.dtype) - s)
                del z, d, p, below
                logits.copy_(grad)
                del grad
                torch.mm(logits, weight, out=grad_x[a:b])
                grad_w.addmm_(logits.T, x[a:b])
                del logits
        ctx.save_for_backward(grad_x, grad_w)
        total = mixed_row_loss(ce, alpha, ce_weight, tv_weight, nla_weight).sum()
        ctx.mark_non_differentiable(ce, alpha, hits)
        return total, ce, alpha, hits

    @staticmethod
    def backward(ctx, grad_loss, _grad_ce, _grad_alpha, _grad_hits):
        grad_x, grad_w = ctx.saved_tensors
        g = grad_loss.to(grad_x.dtype)
        return grad_x * g, grad_w * g, None, None, None, None, None, None, None, None, None
