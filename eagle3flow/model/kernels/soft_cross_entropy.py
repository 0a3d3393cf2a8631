"""Soft cross-entropy of the draft's logits against the teacher's, without float32 copies.

For scored rows ``r``: teacher row ``target[r]`` of ``teacher_logits [Nt, V]`` (with its
logsumexp ``teacher_lse [Nt]``, so ``p = exp(t - lse_t)``) and draft logits ``x [n, V]``:

    CE_r = -sum_v p_v * log_softmax(x_r)_v = lse(x_r) * sum_v p_v - sum_v p_v * x_rv
    dCE_r / dx_r = softmax(x_r) * sum_v p_v - p

:func:`soft_cross_entropy` returns ``scale * sum_r CE_r`` and the number of rows whose
draft argmax equals the teacher's (``teacher_argmax [Nt]``). On CUDA one Triton kernel
reads each row twice and writes its gradient in the forward (the loss is a leaf of the
graph: the backward only scales it), so neither ``[n, V]`` float32 log-probabilities
nor a gathered copy of the teacher rows exist. Elsewhere it is plain autograd math.
"""
from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:          # CPU-only installs
    triton = None


def soft_cross_entropy(logits: torch.Tensor, teacher_logits: torch.Tensor, teacher_lse: torch.Tensor,
                       target: torch.Tensor, teacher_argmax: torch.Tensor, scale: float):
    """``(sum_r scale_r * CE_r, correct)``: float32 scalar loss (differentiable w.r.t. ``logits
    [n, V]``) and an int64 scalar count. ``target [n]`` indexes the teacher's rows; ``scale``
    is a float or a float32 ``[n]`` tensor of per-row weights."""
    if triton is not None and logits.is_cuda:
        return _TritonSoftCE.apply(logits, teacher_logits, teacher_lse, target, teacher_argmax, scale)
    return soft_cross_entropy_reference(logits, teacher_logits, teacher_lse, target, teacher_argmax, scale)


def soft_cross_entropy_reference(logits, teacher_logits, teacher_lse, target, teacher_argmax, scale):
    """The same in float32 autograd ops (the CPU path and the tests' reference)."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    p = torch.exp(teacher_logits[target].float() - teacher_lse[target].unsqueeze(-1))
    loss = -((p * logp).sum(-1) * torch.as_tensor(scale, dtype=torch.float32)).sum()
    correct = (logp.argmax(-1) == teacher_argmax[target]).sum()
    return loss, correct


if triton is not None:
    @triton.jit
    def _soft_ce_kernel(x_ptr, x_stride, t_ptr, t_stride, t_lse_ptr, t_argmax_ptr, target_ptr,
                        grad_ptr, grad_stride, loss_ptr, hit_ptr, V, scale_ptr, BLOCK: tl.constexpr):
        r = tl.program_id(0).to(tl.int64)
        scale = tl.load(scale_ptr + r)
        trow = tl.load(target_ptr + r).to(tl.int64)
        x_row = x_ptr + r * x_stride
        t_row = t_ptr + trow * t_stride
        t_lse = tl.load(t_lse_ptr + trow)
        m = float("-inf")
        s = 0.0
        dot = 0.0
        psum = 0.0
        best = float("-inf")
        best_idx = 0
        # pass 1: online logsumexp of x, sum p*x, sum p, argmax of x
        for off in range(0, V, BLOCK):
            cols = off + tl.arange(0, BLOCK)
            mask = cols < V
            x = tl.load(x_row + cols, mask=mask, other=float("-inf")).to(tl.float32)
            t = tl.load(t_row + cols, mask=mask, other=float("-inf")).to(tl.float32)
            p = tl.exp(t - t_lse)
            dot += tl.sum(tl.where(mask, p * x, 0.0))
            psum += tl.sum(p)
            block_max = tl.max(x, axis=0)
            block_arg = tl.argmax(x, axis=0)
            better = block_max > best
            best_idx = tl.where(better, off + block_arg, best_idx)
            best = tl.where(better, block_max, best)
            m_new = tl.maximum(m, block_max)
            s = s * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new))
            m = m_new
        lse = m + tl.log(s)
        tl.store(loss_ptr + r, lse * psum - dot)
        tl.store(hit_ptr + r, (best_idx == tl.load(t_argmax_ptr + trow)).to(tl.int32))
        # pass 2: the gradient, scaled
        g_row = grad_ptr + r * grad_stride
        for off in range(0, V, BLOCK):
            cols = off + tl.arange(0, BLOCK)
            mask = cols < V
            x = tl.load(x_row + cols, mask=mask, other=float("-inf")).to(tl.float32)
            t = tl.load(t_row + cols, mask=mask, other=float("-inf")).to(tl.float32)
            g = (tl.exp(x - lse) * psum - tl.exp(t - t_lse)) * scale
            tl.store(g_row + cols, g.to(grad_ptr.dtype.element_ty), mask=mask)


    @triton.jit
    def _row_lse_argmax_kernel(x_ptr, x_stride, lse_ptr, argmax_ptr, V, BLOCK: tl.constexpr):
        r = tl.program_id(0).to(tl.int64)
        x_row = x_ptr + r * x_stride
        m = float("-inf")
        s = 0.0
        best_idx = 0
        for off in range(0, V, BLOCK):
            cols = off + tl.arange(0, BLOCK)
            x = tl.load(x_row + cols, mask=cols < V, other=float("-inf")).to(tl.float32)
            block_max = tl.max(x, axis=0)
            best_idx = tl.where(block_max > m, off + tl.argmax(x, axis=0), best_idx)
            m_new = tl.maximum(m, block_max)
            s = s * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new))
            m = m_new
        tl.store(lse_ptr + r, m + tl.log(s))
        tl.store(argmax_ptr + r, best_idx.to(tl.int64))


def row_logsumexp_argmax(logits: torch.Tensor, lse: torch.Tensor, argmax: torch.Tensor) -> None:
    """Per row of ``logits [n, V]``: logsumexp into ``lse [n]`` (float32, computed in float32)
    and the first index of the maximum into ``argmax [n]`` (int64). On CUDA one pass of
    one Triton kernel over the half-precision rows, no float32 copy."""
    if triton is not None and logits.is_cuda and logits.shape[0]:
        _row_lse_argmax_kernel[(logits.shape[0],)](logits, logits.stride(0), lse, argmax,
                                                   logits.shape[1], BLOCK=4096, num_warps=8)
        return
    lse.copy_(torch.logsumexp(logits.float(), dim=-1))
    argmax.copy_(logits.argmax(-1))


def _launch(logits, grad, teacher_logits, teacher_lse, target, teacher_argmax, row_scale, row_loss, hits):
    """Per-row CE, argmax hits and the scaled gradient (``grad`` may be ``logits`` itself:
    each program reads its row before writing it)."""
    n, v = logits.shape
    if n:
        _soft_ce_kernel[(n,)](logits, logits.stride(0), teacher_logits, teacher_logits.stride(0),
                              teacher_lse, teacher_argmax, target, grad, grad.stride(0), row_loss, hits,
                              v, row_scale, BLOCK=4096, num_warps=8)


def _prepare(teacher_logits, teacher_lse, target, teacher_argmax, row_scale, n, device):
    row_scale = torch.as_tensor(row_scale, dtype=torch.float32, device=device).expand(n).contiguous()
    return (teacher_logits.contiguous(), teacher_lse.float().contiguous(), target.contiguous(),
            teacher_argmax.contiguous(), row_scale)


class _TritonSoftCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, teacher_logits, teacher_lse, target, teacher_argmax, scale):
        n = logits.shape[0]
        logits = logits.contiguous()
        teacher = _prepare(teacher_logits, teacher_lse, target, teacher_argmax, scale, n, logits.device)
        grad = torch.empty_like(logits)
        row_loss = torch.empty(n, device=logits.device, dtype=torch.float32)
        hits = torch.empty(n, device=logits.device, dtype=torch.int32)
        _launch(logits, grad, *teacher[:4], teacher[4], row_loss, hits)
        ctx.save_for_backward(grad)
        correct = hits.sum()
        ctx.mark_non_differentiable(correct)
        return (row_loss * teacher[4]).sum(), correct

    @staticmethod
    def backward(ctx, grad_loss, _grad_hits):
        (grad,) = ctx.saved_tensors
        return grad * grad_loss.to(grad.dtype), None, None, None, None, None


def linear_soft_cross_entropy(x: torch.Tensor, weight: torch.Tensor, teacher_logits: torch.Tensor,
                              teacher_lse: torch.Tensor, target: torch.Tensor,
                              teacher_argmax: torch.Tensor, row_scale: torch.Tensor,
                              max_chunk_elements: int = 2 ** 31):
    """The lm_head and the soft cross-entropy in one: ``logits = x @ weight.T``.

    ``x [n, H]``, ``weight [V, H]``, ``row_scale [n]`` float32. Returns
    ``(sum_r row_scale[r] * CE_r, CE [n] float32, hits [n] bool)``; only the loss is
    differentiable. On CUDA the logits exist one chunk of rows at a time (at most
    ``max_chunk_elements``), the gradient overwrites them in place and is turned into
    the input and weight gradients straight away (one GEMM each per chunk), so the
    backward only scales those by the incoming gradient.
    """
    if triton is not None and x.is_cuda:
        return _TritonLinearSoftCE.apply(x, weight, teacher_logits, teacher_lse, target,
                                         teacher_argmax, row_scale, max_chunk_elements)
    return linear_soft_cross_entropy_reference(x, weight, teacher_logits, teacher_lse, target,
                                               teacher_argmax, row_scale)


def linear_soft_cross_entropy_reference(x, weight, teacher_logits, teacher_lse, target, teacher_argmax,
                                        row_scale):
    """:func:`linear_soft_cross_entropy` in plain autograd ops (CPU path, tests' reference)."""
    logp = torch.log_softmax(torch.nn.functional.linear(x, weight).float(), dim=-1)
    p = torch.exp(teacher_logits[target].float() - teacher_lse[target].float().unsqueeze(-1))
    ce = -(p * logp).sum(-1)
    hits = logp.argmax(-1) == teacher_argmax[target]
    return (ce * row_scale).sum(), ce.detach(), hits


class _TritonLinearSoftCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, teacher_logits, teacher_lse, target, teacher_argmax, row_scale,
                max_chunk_elements):
        n, v = x.shape[0], weight.shape[0]
        x = x.contiguous()
        teacher = _prepare(teacher_logits, teacher_lse, target, teacher_argmax, row_scale, n, x.device)
        row_loss = torch.empty(n, device=x.device, dtype=torch.float32)
        hits = torch.empty(n, device=x.device, dtype=torch.int32)
        grad_x = torch.empty_like(x)
        grad_w = torch.zeros_like(weight)
        chunk = max(1, max_chunk_elements // v)
        with torch.autocast("cuda", enabled=False):      # bf16 already; out= needs no autocast
            for a in range(0, n, chunk):
                b = min(n, a + chunk)
                logits = x[a:b] @ weight.T                               # [c, V]
                _launch(logits, logits, teacher[0], teacher[1], teacher[2][a:b], teacher[3],
                        teacher[4][a:b], row_loss[a:b], hits[a:b])
                torch.mm(logits, weight, out=grad_x[a:b])
                grad_w.addmm_(logits.T, x[a:b])
                del logits
        ctx.save_for_backward(grad_x, grad_w)
        ce, hit = row_loss, hits.bool()
        ctx.mark_non_differentiable(ce, hit)
        return (row_loss * teacher[4]).sum(), ce, hit

    @staticmethod
    def backward(ctx, grad_loss, _grad_ce, _grad_hits):
        grad_x, grad_w = ctx.saved_tensors
        g = grad_loss.to(grad_x.dtype)
        return grad_x * g, grad_w * g, None, None, None, None, None, None
