"""TTT attention: causal attention against the step-0 cache plus each row's own tail.

Step ``j`` of the TTT forward (eagle3flow/model/draft.py) lets row ``t`` attend to the
step-0 keys of rows ``0..t`` of its sample (causal) and to the ``j`` keys its own chain
wrote at steps ``1..j`` (the "tail"). Both key sets share one softmax.

Shapes (padded layout, ``B`` samples of ``T`` rows, ``h`` query / ``g`` kv heads):

* ``q [B, T, h, d]``; ``k0 [B, T, g, d]``, ``v0 [B, T, g, dv]`` (step-0 cache; ``dv = d``
  but for MLA);
* ``k_tail, v_tail [j, B, T, g, d | dv]`` (``j >= 0``; entry ``i`` = row's own step ``i+1``);
* returns ``out [B, T, h, dv]``.

Two implementations of the same function:

* :func:`exact_cache_tail_attention`: plain float32 math on the full ``[T, T+j]`` scores;
  the CPU path and the reference the tests compare with.
* :class:`FlashCacheTailAttention`: CUDA, bf16/fp16. The causal part runs through
  PyTorch's flash-attention kernel, which returns its logsumexp; the ``j`` tail scores per
  row are merged in through that logsumexp. Its backward calls the flash backward with the
  MERGED output and logsumexp: the kernel rebuilds ``P = exp(S - lse)`` and
  ``D = rowsum(dO * O)`` from what it is given, so with the merged values it yields the
  gradient of the joint softmax restricted to the cache keys (the same trick ring attention
  uses to combine blocks); the tail's share of the gradient is computed here. Nothing of
  size ``T x T`` is ever stored. The tail merge and its backward are two Triton kernels
  (one program per row and kv head, ``j`` keys each), with torch fallbacks. Values narrower
  than queries (MLA) go through cuDNN's fused attention instead, whose backward takes the
  merged output and logsumexp the same way (checked against float32 autograd in
  tests/test_cuda_paths.py); the flash kernel would need them padded to the query width.
"""
from __future__ import annotations

import os
import warnings

import torch
import torch.nn.functional as F

try:
    import triton
    import triton.language as tl
except ImportError:          # CPU-only installs: the tail merge falls back to torch ops
    triton = None

_aten = torch.ops.aten

# Whether the flash kernel took grouped K/V directly (None: not tried yet).
_FLASH_NATIVE_GQA: bool | None = None


def flash_supported(q: torch.Tensor) -> bool:
    """True where :class:`FlashCacheTailAttention` can run: CUDA, half precision, d % 8 == 0."""
    return (q.is_cuda and q.dtype in (torch.bfloat16, torch.float16)
            and q.shape[-1] % 8 == 0 and q.shape[-1] <= 256)


# The cache kernel for values narrower than queries (MLA): "cudnn" takes them as they are,
# "flash" pads them to the query width. On an H100 (benchmarks/README.md) cuDNN runs MLA's
# qk 192 / v 128 attention at 2.7 ms fwd+bwd against flash's 6.3 ms and the Kimi-shaped draft's
# step 1.11x faster. EAGLE3FLOW_MLA_CACHE_KERNEL=flash picks the padded flash kernel.
MLA_CACHE_KERNEL = os.environ.get("EAGLE3FLOW_MLA_CACHE_KERNEL", "cudnn")
# Whether cuDNN's kernel ran here (None: not tried yet); where it refuses the shapes or the GPU,
# the padded flash kernel takes over for the rest of the process.
_CUDNN_RUNS: bool | None = None


def cache_tail_attention(q, k0, v0, k_tail, v_tail, scale: float) -> torch.Tensor:
    """Dispatch: the flash path where supported, else the exact float32 path (shapes above).

    Values may be narrower than queries and keys (MLA: scores over qk_nope + qk_rope dims,
    values of v_head_dim): the exact path takes them as they are, and so does the cuDNN
    kernel where :data:`MLA_CACHE_KERNEL` picks it; the flash kernel gets them padded with
    zeros to the query width and the padded output columns are dropped, which leaves the
    result and every gradient the same.
    """
    global _CUDNN_RUNS
    if flash_supported(q):
        dv, d = v0.shape[-1], q.shape[-1]
        if dv != d and MLA_CACHE_KERNEL == "cudnn" and _CUDNN_RUNS is not False:
            try:
                out = FlashCacheTailAttention.apply(q, k0, v0, k_tail, v_tail, scale, "cudnn")
                _CUDNN_RUNS = True
                return out
            except RuntimeError as e:
                if _CUDNN_RUNS:
                    raise
                _CUDNN_RUNS = False
                warnings.warn(f"cuDNN attention refused MLA's shapes here ({e}); values padded for flash")
        if dv != d:
            pad = (0, d - dv)
            out = FlashCacheTailAttention.apply(q, k0, F.pad(v0, pad), k_tail, F.pad(v_tail, pad), scale, "flash")
            return out[..., :dv]
        return FlashCacheTailAttention.apply(q, k0, v0, k_tail, v_tail, scale, "flash")
    return exact_cache_tail_attention(q, k0, v0, k_tail, v_tail, scale)


def exact_cache_tail_attention(q, k0, v0, k_tail, v_tail, scale: float) -> torch.Tensor:
    """Reference: one softmax over ``[T causal cache keys | j tail keys]`` in float32."""
    b, t, h, d = q.shape
    groups = h // k0.shape[2]
    dtype = q.dtype
    qf = q.float().transpose(1, 2)                                   # [B, h, T, d]
    kf = k0.float().repeat_interleave(groups, 2).transpose(1, 2)     # [B, h, T, d]
    vf = v0.float().repeat_interleave(groups, 2).transpose(1, 2)
    scores = (qf @ kf.transpose(-1, -2)) * scale                     # [B, h, T, T]
    causal = torch.ones(t, t, dtype=torch.bool, device=q.device).tril()
    scores = scores.masked_fill(~causal, float("-inf"))
    kt = k_tail.float().repeat_interleave(groups, 3)                 # [j, B, T, h, d]
    vt = v_tail.float().repeat_interleave(groups, 3)
    tail = (q.float().unsqueeze(0) * kt).sum(-1) * scale             # [j, B, T, h]
    joint = torch.cat([scores, tail.permute(1, 3, 2, 0)], dim=-1)    # [B, h, T, T+j]
    probs = torch.softmax(joint, dim=-1)
    out = probs[..., :t] @ vf                                        # [B, h, T, d]
    out = out.transpose(1, 2) + (probs[..., t:].permute(3, 0, 2, 1).unsqueeze(-1) * vt).sum(0)
    return out.to(dtype)


def _repeat_kv(k, v, groups: int):
    """``k, v [B, T, g, *]`` with each kv head repeated for its ``groups`` query heads."""
    return k.repeat_interleave(groups, 2), v.repeat_interleave(groups, 2)


def _flash_forward(q, k, v, scale):
    """Causal flash attention on ``[B, T, heads, d]`` tensors: ``out [B, T, h, d]`` (a
    transposed view), ``lse [B, h, T]`` float32, and what the backward needs."""
    global _FLASH_NATIVE_GQA
    groups = q.shape[2] // k.shape[2]
    if groups > 1 and _FLASH_NATIVE_GQA is not False:
        try:
            res = _aten._scaled_dot_product_flash_attention(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), 0.0, True, False, scale=scale)
            _FLASH_NATIVE_GQA = True
            return res, False
        except RuntimeError:
            _FLASH_NATIVE_GQA = False
    repeat = groups > 1
    if repeat:
        k, v = _repeat_kv(k, v, groups)
    res = _aten._scaled_dot_product_flash_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), 0.0, True, False, scale=scale)
    return res, repeat


class _Flash:
    """The cache part through PyTorch's flash kernel (``v`` as wide as ``q``)."""

    @staticmethod
    def forward(q, k, v, scale):
        """``out [B, T, h, dv]``, ``lse [B, h, T]`` float32, what :meth:`backward` needs (saved
        tensors, other values) and whether K/V went in repeated per query head."""
        (out, lse, cu_q, cu_k, max_q, max_k, seed, offset, _), repeated = _flash_forward(q, k, v, scale)
        return out.transpose(1, 2), lse, (cu_q, cu_k, seed, offset), (max_q, max_k), repeated

    @staticmethod
    def backward(do, q, k, v, out, lse, scale, tensors, meta):
        """``[B, h, T, *]`` views in; the kernel rebuilds P from the (merged) ``out``/``lse``."""
        cu_q, cu_k, seed, offset = tensors
        max_q, max_k = meta
        return _aten._scaled_dot_product_flash_attention_backward(
            do, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, 0.0, True, seed, offset, scale=scale)


class _Cudnn:
    """The cache part through cuDNN's fused attention, which takes values narrower than
    queries (MLA) and, like flash, rebuilds P from the output and logsumexp it is given."""

    @staticmethod
    def forward(q, k, v, scale):
        groups = q.shape[2] // k.shape[2]
        repeated = groups > 1
        if repeated:
            k, v = _repeat_kv(k, v, groups)
        out, lse, cu_q, cu_k, max_q, max_k, seed, offset, _ = _aten._scaled_dot_product_cudnn_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), None, True, 0.0, True, False, scale=scale)
        shape = tuple(lse.shape)
        return (out.transpose(1, 2), lse.reshape(shape[:3]), (cu_q, cu_k, seed, offset),
                (max_q, max_k, shape), repeated)

    @staticmethod
    def backward(do, q, k, v, out, lse, scale, tensors, meta):
        cu_q, cu_k, seed, offset = tensors
        max_q, max_k, shape = meta
        return _aten._scaled_dot_product_cudnn_attention_backward(
            do, q, k, v, out, lse.reshape(shape), seed, offset, None, cu_q, cu_k, max_q, max_k, 0.0, True,
            scale=scale)


_CACHE_KERNELS = {"flash": _Flash, "cudnn": _Cudnn}


def _tail_bmm_layout(x: torch.Tensor, groups: int) -> torch.Tensor:
    """``[B, T, h, d]`` -> ``[B*T*g, groups, d]`` (query heads grouped by their kv head)."""
    b, t, h, d = x.shape
    return x.reshape(b * t * (h // groups), groups, d)


def _tails_bmm_layout(x: torch.Tensor) -> torch.Tensor:
    """``[j, B, T, g, d]`` -> ``[B*T*g, j, d]``."""
    j, b, t, g, d = x.shape
    return x.permute(1, 2, 3, 0, 4).reshape(b * t * g, j, d)


# ---- the tail merge: forward (out, lse from the cache part and the tail keys) and the tail's
# share of the backward. ``q, out_c, out, do, dq [B, T, h, d]``, ``lse_c, lse [B, T, h]``
# float32, ``k_tail, v_tail [j, B, T, g, d]``, all contiguous.

def tail_merge_torch(q, out_c, lse_c, k_tail, v_tail, scale):
    b, t, h, _ = q.shape
    g = k_tail.shape[3]
    groups = h // g
    qg = _tail_bmm_layout(q, groups).float()                          # [BTg, groups, d]
    kt = _tails_bmm_layout(k_tail).float()                             # [BTg, j, d]
    vt = _tails_bmm_layout(v_tail).float()                             # [BTg, j, dv]
    s = torch.bmm(qg, kt.transpose(1, 2)) * scale                       # [BTg, groups, j]
    lse_cg = lse_c.reshape(b * t * g, groups, 1)
    lse_g = torch.logaddexp(lse_cg, torch.logsumexp(s, dim=-1, keepdim=True))
    out_g = torch.exp(lse_cg - lse_g) * _tail_bmm_layout(out_c, groups).float() \
        + torch.bmm(torch.exp(s - lse_g), vt)
    return out_g.to(q.dtype).view(b, t, h, out_c.shape[-1]), lse_g.view(b, t, h)


def tail_backward_torch(q, do, out, lse, k_tail, v_tail, dq, scale):
    b, t, h, d = q.shape
    j, g = k_tail.shape[0], k_tail.shape[3]
    groups = h // g
    qg = _tail_bmm_layout(q, groups).float()
    dog = _tail_bmm_layout(do, groups).float()                          # [BTg, groups, dv]
    kt = _tails_bmm_layout(k_tail).float()
    vt = _tails_bmm_layout(v_tail).float()
    probs = torch.exp(torch.bmm(qg, kt.transpose(1, 2)) * scale - lse.reshape(b * t * g, groups, 1))
    delta = (dog * _tail_bmm_layout(out, groups).float()).sum(-1, keepdim=True)
    ds = probs * (torch.bmm(dog, vt.transpose(1, 2)) - delta) * scale   # [BTg, groups, j]
    dq = (dq.float() + torch.bmm(ds, kt).view(b, t, h, d)).to(q.dtype)

    def unbmm(x):                                                       # [BTg, j, *] -> [j, B, T, g, *]
        return x.view(b, t, g, j, x.shape[-1]).permute(3, 0, 1, 2, 4).to(k_tail.dtype)
    return dq, unbmm(torch.bmm(ds.transpose(1, 2), qg)), unbmm(torch.bmm(probs.transpose(1, 2), dog))


if triton is not None:
    @triton.jit
    def _tail_tile(row, kv_block, KVH: tl.constexpr, G: tl.constexpr, D: tl.constexpr,
                   BKV: tl.constexpr, BG: tl.constexpr, BD: tl.constexpr):
        """Offsets and masks of one program's tile: row ``row``, kv heads
        ``kv_block*BKV ..`` and all ``G`` query heads of each. Returns the query-side
        ``[BKV, BG, BD]`` offsets/mask, the per-head ``[BKV, BG]`` ones (lse) and the
        kv-side ``[BKV, BD]`` ones (one tail entry)."""
        ki = kv_block * BKV + tl.arange(0, BKV)
        gi = tl.arange(0, BG)
        di = tl.arange(0, BD)
        km, gm, dm = ki < KVH, gi < G, di < D
        head = ki[:, None] * G + gi[None, :]                                     # [BKV, BG]
        head_mask = km[:, None] & gm[None, :]
        q_offs = row * (KVH * G * D) + head[:, :, None] * D + di[None, None, :]
        q_mask = head_mask[:, :, None] & dm[None, None, :]
        kv_offs = row * (KVH * D) + ki[:, None] * D + di[None, :]
        kv_mask = km[:, None] & dm[None, :]
        return q_offs, q_mask, row * (KVH * G) + head, head_mask, kv_offs, kv_mask

    @triton.jit
    def _tail_fwd_kernel(q_ptr, oc_ptr, lsec_ptr, kt_ptr, vt_ptr, out_ptr, lse_ptr, J, k_stride, v_stride,
                         scale, KVH: tl.constexpr, G: tl.constexpr, D: tl.constexpr, DV: tl.constexpr,
                         BKV: tl.constexpr, BG: tl.constexpr, BD: tl.constexpr, BDV: tl.constexpr):
        # one pass of online softmax over the J tail keys, starting from the cache part; queries
        # and keys are D wide, values and outputs DV (MLA: DV < D)
        row = tl.program_id(0).to(tl.int64)
        q_offs, q_mask, h_offs, h_mask, k_offs, k_mask = _tail_tile(
            row, tl.program_id(1), KVH, G, D, BKV, BG, BD)
        o_offs, o_mask, _, _, v_offs, v_mask = _tail_tile(row, tl.program_id(1), KVH, G, DV, BKV, BG, BDV)
        q = tl.load(q_ptr + q_offs, mask=q_mask, other=0.0).to(tl.float32)     # [BKV, BG, BD]
        m = tl.load(lsec_ptr + h_offs, mask=h_mask, other=0.0)                  # [BKV, BG]
        total = tl.full(m.shape, 1.0, tl.float32)
        acc = tl.load(oc_ptr + o_offs, mask=o_mask, other=0.0).to(tl.float32)  # [BKV, BG, BDV]
        for jj in range(0, J):
            k = tl.load(kt_ptr + jj * k_stride + k_offs, mask=k_mask, other=0.0).to(tl.float32)
            v = tl.load(vt_ptr + jj * v_stride + v_offs, mask=v_mask, other=0.0).to(tl.float32)
            s = tl.sum(q * k[:, None, :], axis=2) * scale
            m_new = tl.maximum(m, s)
            alpha = tl.exp(m - m_new)
            p = tl.exp(s - m_new)
            total = total * alpha + p
            acc = acc * alpha[:, :, None] + p[:, :, None] * v[:, None, :]
            m = m_new
        tl.store(out_ptr + o_offs, (acc / total[:, :, None]).to(out_ptr.dtype.element_ty), mask=o_mask)
        tl.store(lse_ptr + h_offs, m + tl.log(total), mask=h_mask)

    @triton.jit
    def _tail_bwd_kernel(q_ptr, do_ptr, out_ptr, lse_ptr, kt_ptr, vt_ptr, dq_ptr, dkt_ptr, dvt_ptr,
                         J, k_stride, v_stride, scale, KVH: tl.constexpr, G: tl.constexpr, D: tl.constexpr,
                         DV: tl.constexpr, BKV: tl.constexpr, BG: tl.constexpr, BD: tl.constexpr,
                         BDV: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        q_offs, q_mask, h_offs, h_mask, k_offs, k_mask = _tail_tile(
            row, tl.program_id(1), KVH, G, D, BKV, BG, BD)
        o_offs, o_mask, _, _, v_offs, v_mask = _tail_tile(row, tl.program_id(1), KVH, G, DV, BKV, BG, BDV)
        q = tl.load(q_ptr + q_offs, mask=q_mask, other=0.0).to(tl.float32)
        do = tl.load(do_ptr + o_offs, mask=o_mask, other=0.0).to(tl.float32)
        delta = tl.sum(do * tl.load(out_ptr + o_offs, mask=o_mask, other=0.0).to(tl.float32), axis=2)
        lse = tl.load(lse_ptr + h_offs, mask=h_mask, other=0.0)
        dq = tl.load(dq_ptr + q_offs, mask=q_mask, other=0.0).to(tl.float32)
        for jj in range(0, J):
            k = tl.load(kt_ptr + jj * k_stride + k_offs, mask=k_mask, other=0.0).to(tl.float32)
            v = tl.load(vt_ptr + jj * v_stride + v_offs, mask=v_mask, other=0.0).to(tl.float32)
            p = tl.where(h_mask, tl.exp(tl.sum(q * k[:, None, :], axis=2) * scale - lse), 0.0)
            ds = p * (tl.sum(do * v[:, None, :], axis=2) - delta) * scale          # [BKV, BG]
            dq += ds[:, :, None] * k[:, None, :]
            tl.store(dkt_ptr + jj * k_stride + k_offs,
                     tl.sum(ds[:, :, None] * q, axis=1).to(dkt_ptr.dtype.element_ty), mask=k_mask)
            tl.store(dvt_ptr + jj * v_stride + v_offs,
                     tl.sum(p[:, :, None] * do, axis=1).to(dvt_ptr.dtype.element_ty), mask=v_mask)
        tl.store(dq_ptr + q_offs, dq.to(dq_ptr.dtype.element_ty), mask=q_mask)


# Elements of one program's query tile (rows x kv heads x group x head_dim, padded to
# powers of two) and its warps: measured on an H200 (benchmarks/README.md).
TAIL_TILE_ELEMENTS = 4096
TAIL_NUM_WARPS = 4


def _kernel_meta(q, k_tail, v_tail):
    """Grid ``(rows, kv-head blocks)`` and the constexprs: each program takes one row and
    as many kv heads (with their query heads) as fit ``TAIL_TILE_ELEMENTS``."""
    b, t, h, d = q.shape
    g, dv = k_tail.shape[3], v_tail.shape[-1]
    bg, bd, bdv = triton.next_power_of_2(h // g), triton.next_power_of_2(d), triton.next_power_of_2(dv)
    bkv = min(triton.next_power_of_2(g), max(1, TAIL_TILE_ELEMENTS // (bg * bd)))
    return (b * t, triton.cdiv(g, bkv)), dict(KVH=g, G=h // g, D=d, DV=dv, BKV=bkv, BG=bg, BD=bd, BDV=bdv,
                                               num_warps=TAIL_NUM_WARPS)


def tail_merge_triton(q, out_c, lse_c, k_tail, v_tail, scale):
    out = torch.empty_like(out_c)
    lse = torch.empty_like(lse_c)
    grid, meta = _kernel_meta(q, k_tail, v_tail)
    _tail_fwd_kernel[grid](q, out_c, lse_c, k_tail, v_tail, out, lse, k_tail.shape[0],
                           k_tail[0].numel(), v_tail[0].numel(), float(scale), **meta)
    return out, lse


def tail_backward_triton(q, do, out, lse, k_tail, v_tail, dq, scale):
    """As :func:`tail_backward_torch`, but ``dq`` (contiguous) is updated in place."""
    dk, dv = torch.empty_like(k_tail), torch.empty_like(v_tail)
    grid, meta = _kernel_meta(q, k_tail, v_tail)
    _tail_bwd_kernel[grid](q, do, out, lse, k_tail, v_tail, dq, dk, dv, k_tail.shape[0],
                           k_tail[0].numel(), v_tail[0].numel(), float(scale), **meta)
    return dq, dk, dv


def _tail_impl():
    return (tail_merge_triton, tail_backward_triton) if triton is not None else \
        (tail_merge_torch, tail_backward_torch)


class FlashCacheTailAttention(torch.autograd.Function):
    """See the module docstring. Inputs as :func:`cache_tail_attention`, and the cache
    kernel (``"flash"``, or ``"cudnn"`` for values narrower than queries)."""

    @staticmethod
    def forward(ctx, q, k0, v0, k_tail, v_tail, scale, kernel="flash"):
        q, k_tail, v_tail = q.contiguous(), k_tail.contiguous(), v_tail.contiguous()
        out_c, lse_c, tensors, meta, repeated = _CACHE_KERNELS[kernel].forward(q, k0, v0, scale)  # [B, T, h, dv]
        if k_tail.shape[0] == 0:
            out, lse = out_c, lse_c
        else:
            merge, _ = _tail_impl()
            out, lse = merge(q, out_c.contiguous(), lse_c.float().transpose(1, 2).contiguous(),
                             k_tail, v_tail, scale)
            lse = lse.transpose(1, 2).contiguous()                   # [B, h, T] for the kernel
        ctx.save_for_backward(q, k0, v0, k_tail, v_tail, out, lse, *tensors)
        ctx.meta = (scale, kernel, meta, repeated)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k0, v0, k_tail, v_tail, out, lse, *tensors = ctx.saved_tensors
        scale, kernel, meta, repeated = ctx.meta
        b, t, h, d = q.shape
        g, dv_width = k0.shape[2], v0.shape[-1]
        groups = h // g
        grad_out = grad_out.contiguous()
        k, v = _repeat_kv(k0, v0, groups) if repeated else (k0, v0)
        dq, dk, dv = _CACHE_KERNELS[kernel].backward(
            grad_out.transpose(1, 2), q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
            out.transpose(1, 2), lse, scale, tensors, meta)[:3]
        dq, dk, dv = dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)   # [B, T, *, d | dv]
        if repeated:
            dk = dk.reshape(b, t, g, groups, d).sum(3)
            dv = dv.reshape(b, t, g, groups, dv_width).sum(3)
        if k_tail.shape[0] == 0:
            return dq, dk, dv, None, None, None, None
        _, tail_backward = _tail_impl()
        dq, dk_tail, dv_tail = tail_backward(q, grad_out, out.contiguous(),
                                             lse.transpose(1, 2).contiguous(), k_tail, v_tail,
                                             dq.contiguous(), scale)
        return dq, dk, dv, dk_tail, dv_tail, None, None
