"""Where one training step's GPU time goes (benchmarks/train_throughput.py ``--profile``).

One step under torch.profiler with CPU and CUDA activities, read three ways:

* ``categories``: every CUDA kernel's time summed by what it is (GEMMs, attention, the TTT tail
  kernels, the compiled step's fused Triton kernels, PyTorch's own element-wise kernels,
  concatenations, the optimizer's multi-tensor kernels, ...), in ms per step; the kernel names
  alone decide, so the sums add up to the GPU's busy time;
* ``ops``: the PyTorch operators that launched the most GPU time (``aten::add_``,
  ``aten::cat``, ``CompiledFunctionBackward``, ...), each with its own kernels' time only: which
  call in the step an element-wise kernel comes from, which the kernel names do not say;
* ``busy_ms`` beside ``wall_ms``: GPU idle time inside the step (host syncs, launch gaps).
"""
from __future__ import annotations

import re
import time

import torch

# first match wins; GEMM names: cuBLAS (nvjet, *gemm*), CUTLASS, and the older sm90_xmma kernels.
# Attention comes first: the flash kernels' template arguments name cutlass types.
KERNEL_CATEGORIES = (
    ("attention (flash / cuDNN)", r"sdpa|flash|fmha"),
    ("GEMM (cuBLAS / CUTLASS)", r"nvjet|gemm|cutlass|xmma"),
    ("TTT tail kernels", r"_tail_"),
    ("soft cross-entropy and teacher", r"_soft_ce|_teacher|_acceptance"),
    ("compiled step (Triton, fused)", r"^triton_"),
    ("optimizer and clipping (multi-tensor)", r"multi_tensor|fused_adam|_amp_foreach"),
    ("concatenations", r"CatArray"),
    ("copies and fills", r"[Mm]emcpy|[Mm]emset|copy_kernel|fill_kernel|FillFunctor"),
    ("reductions", r"reduce_kernel"),
    ("element-wise (PyTorch's own)", r"elementwise_kernel"),
)


def kernel_category(name: str) -> str:
    for category, pattern in KERNEL_CATEGORIES:
        if re.search(pattern, name):
            return category
    return "other"


def _self_device_us(event) -> float:
    """The event's own GPU time (its kernels, not its children's), in microseconds; torch >= 2.4
    names it device time, older releases cuda time."""
    return float(getattr(event, "self_device_time_total", getattr(event, "self_cuda_time_total", 0.0)))


def profile_step(step, sync, top: int = 25) -> dict:
    """Run ``step()`` once under the profiler (``sync()`` after it) and summarise its GPU time."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        step()
        sync()
        wall_ms = (time.perf_counter() - start) * 1e3
    averages = prof.key_averages()
    # GPU user annotations (the optimizer's "Optimizer.step#AdamW.step" range) span kernels
    # counted already: not kernels themselves
    kernels = [e for e in averages if e.device_type == torch.autograd.DeviceType.CUDA
               and not getattr(e, "is_user_annotation", False)]
    categories: dict[str, float] = {}
    for e in kernels:
        c = kernel_category(e.key)
        categories[c] = categories.get(c, 0.0) + _self_device_us(e) / 1e3
    ops = sorted((e for e in averages if e.device_type == torch.autograd.DeviceType.CPU
                  and _self_device_us(e) > 0), key=lambda e: -_self_device_us(e))
    return {
        "wall_ms": wall_ms,
        "busy_ms": sum(categories.values()),
        "categories": dict(sorted(categories.items(), key=lambda kv: -kv[1])),
        "ops": [{"op": e.key, "ms": _self_device_us(e) / 1e3, "calls": e.count} for e in ops[:top]],
        "kernels": [{"kernel": e.key, "category": kernel_category(e.key), "ms": _self_device_us(e) / 1e3,
                     "calls": e.count} for e in sorted(kernels, key=lambda e: -_self_device_us(e))[:top]],
    }


def profile_text(p: dict) -> str:
    """The three readings as plain tables (stderr of train_throughput.py)."""
    lines = [f"profiled step: {p['wall_ms']:.1f} ms wall, GPU busy {p['busy_ms']:.1f} ms "
             f"(idle {max(p['wall_ms'] - p['busy_ms'], 0.0):.1f} ms; the profiler's own overhead included)",
             "", "ms per step by kernel category:"]
    lines += [f"  {ms:8.2f}  {c}" for c, ms in p["categories"].items()]
    lines += ["", "ms per step by the operator that launched it (its own kernels):"]
    lines += [f"  {o['ms']:8.2f}  {o['calls']:5d}x  {o['op']}" for o in p["ops"]]
    lines += ["", "largest kernels:"]
    lines += [f"  {k['ms']:8.2f}  {k['calls']:5d}x  [{k['category']}]  {k['kernel'][:110]}" for k in p["kernels"]]
    return "\n".join(lines)
