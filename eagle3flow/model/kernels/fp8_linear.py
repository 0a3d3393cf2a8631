"""A linear layer whose three products (forward, input gradient, weight gradient) run in fp8.

Every operand is cast to ``float8_e4m3fn`` with one scale per row along the product's
contraction dimension (the "rowwise" recipe: an outlier costs precision in its own row only),
and the product accumulates in float32 and comes out in the input's dtype:

* forward ``y = x W^T``:       rows of ``x`` and rows of ``W`` (both along ``in``);
* input gradient ``dx = dy W``: rows of ``dy`` and rows of ``W^T`` (along ``out``);
* weight gradient ``dW = dy^T x``: rows of ``dy^T`` and rows of ``x^T`` (along the tokens).

The weight's two casts are made once per forward of the draft (:func:`fp8_weight`) and
shared by the TTT steps that use it. On CUDA the products are ``torch._scaled_mm`` (Hopper or
newer); elsewhere the same casts are undone in float32 and multiplied there, which gives the
same numbers up to the order of the sums: the CPU tests check the recipe, the GPU test the
kernel against it.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max
# torch._scaled_mm needs both matrix sides of each product to be multiples of 16
ALIGN = 16


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [R, C]`` (any strides) -> its fp8 cast ``[R, C]``, row-major as the kernel takes it,
    and float32 scales ``[R, 1]`` (``x ~ q * scale``)."""
    amax = x.abs().amax(dim=1, keepdim=True).float().clamp(min=1e-12)
    scale = amax / FP8_MAX
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8).contiguous(), scale


def scaled_mm(a: torch.Tensor, a_scale: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor,
              out_dtype: torch.dtype) -> torch.Tensor:
    """``(a * a_scale) @ (b * b_scale)^T`` for row-quantized ``a [M, K]`` and ``b [N, K]``."""
    if a.is_cuda:
        # b [N, K] row-major is the column-major [K, N] operand the kernel takes
        return torch._scaled_mm(a, b.t(), scale_a=a_scale, scale_b=b_scale.t(), out_dtype=out_dtype)
    return ((a.float() * a_scale) @ (b.float() * b_scale).t()).to(out_dtype)


class Fp8Weight(NamedTuple):
    """A weight ``[out, in]`` (the tensor autograd sees) and its two fp8 casts."""
    weight: torch.Tensor
    rows: torch.Tensor             # [out, in] fp8, for the forward
    rows_scale: torch.Tensor       # [out, 1]
    cols: torch.Tensor             # [in, out] fp8 (W^T), for the input gradient
    cols_scale: torch.Tensor       # [in, 1]


def fp8_device(device: torch.device) -> bool:
    """Whether fp8 products run on ``device``: anywhere but a CUDA GPU without fp8 tensor cores
    (compute capability below 8.9); off CUDA through the float32 emulation."""
    return device.type != "cuda" or torch.cuda.get_device_capability(device) >= (8, 9)


def fp8_supported(weight: torch.Tensor) -> bool:
    """Whether :func:`fp8_linear` can take this weight: both sides multiples of 16, on a
    device :func:`fp8_device` accepts."""
    if weight.dim() != 2 or weight.shape[0] % ALIGN or weight.shape[1] % ALIGN:
        return False
    return fp8_device(weight.device)


_COMPILED_QUANTIZE = []


def _quantize_weight(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`quantize_rows` of a weight outside the compiled step: one fused pass on CUDA."""
    if not w.is_cuda:
        return quantize_rows(w)
    if not _COMPILED_QUANTIZE:
        _COMPILED_QUANTIZE.append(torch.compile(quantize_rows))
    return _COMPILED_QUANTIZE[0](w)


def fp8_weight(weight: torch.Tensor) -> Fp8Weight | torch.Tensor:
    """The weight with its casts, or the weight as it is where fp8 cannot take it."""
    if not fp8_supported(weight):
        return weight
    with torch.no_grad():
        rows, rows_scale = _quantize_weight(weight)
        cols, cols_scale = _quantize_weight(weight.t())
    return Fp8Weight(weight, rows, rows_scale, cols, cols_scale)


def _pad_tokens(x: torch.Tensor) -> torch.Tensor:
    """``x [M, C]`` with zero rows up to a multiple of 16 (the weight gradient sums over M)."""
    pad = -x.shape[0] % ALIGN
    return F.pad(x, (0, 0, 0, pad)) if pad else x


class _Fp8Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, rows, rows_scale, cols, cols_scale):
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        xq, xs = quantize_rows(x2)
        y = scaled_mm(xq, xs, rows, rows_scale, x.dtype)
        # what the weight gradient needs, cast now: x^T's rows, half the bytes of x
        xtq, xts = quantize_rows(_pad_tokens(x2).t())
        ctx.save_for_backward(xtq, xts, cols, cols_scale)
        ctx.shape, ctx.dtype = shape, x.dtype
        return y.view(*shape[:-1], y.shape[-1])

    @staticmethod
    def backward(ctx, dy):
        xtq, xts, cols, cols_scale = ctx.saved_tensors
        dy2 = dy.reshape(-1, dy.shape[-1])
        dx = dw = None
        if ctx.needs_input_grad[0]:
            dyq, dys = quantize_rows(dy2)
            dx = scaled_mm(dyq, dys, cols, cols_scale, ctx.dtype).view(ctx.shape)
        if ctx.needs_input_grad[1]:
            dytq, dyts = quantize_rows(_pad_tokens(dy2).t())
            dw = scaled_mm(dytq, dyts, xtq, xts, ctx.dtype)
        return dx, dw, None, None, None, None


def fp8_linear(x: torch.Tensor, w: Fp8Weight) -> torch.Tensor:
    """``x @ w.weight^T`` with every product in fp8 (the module docstring)."""
    return _Fp8Linear.apply(x, w.weight, w.rows, w.rows_scale, w.cols, w.cols_scale)


def linear(x: torch.Tensor, w: Fp8Weight | torch.Tensor) -> torch.Tensor:
    """``F.linear`` for a plain weight, :func:`fp8_linear` for one with its fp8 casts."""
    return fp8_linear(x, w) if isinstance(w, Fp8Weight) else F.linear(x, w)
