"""FLOPs per trained token and the peak FLOP/s they are measured against (MFU).

One formula for the trainer's log and the training benchmark (benchmarks/train_*),
so both report the same MFU. Counted (multiply-add = 2 FLOPs, matmuls only):

* draft forward, per token: ``fc`` once (``A*Ht -> H``), then per TTT step the
  q/k/v/o projections (input ``2H``), the SwiGLU MLP (``3 * H * I``), the draft
  ``lm_head`` (``H -> Vd``) and attention (``QK^T`` and ``PV`` over the keys the
  row attends: the causal prefix, ``mean_context`` on average, plus ``j`` chain
  entries at step ``j``);
* draft backward = 2 x forward (weight and input gradients);
* the teacher's ``lm_head`` forward over the draft vocabulary (the ``t2d`` rows the
  loss needs): ``2 * H * Vd``.
"""
from __future__ import annotations

import time

import torch


def train_flops_per_token(cfg, ttt_steps: int, mean_context: float,
                          teacher_vocab: int | None = None) -> dict:
    """FLOPs per token of one training step, with the pieces.

    ``cfg``: a :class:`eagle3flow.model.config.DraftConfig`; ``mean_context``: keys a
    row attends to causally, averaged over tokens (``(L+1)/2`` for samples of ``L``
    tokens, see :func:`mean_causal_context`). ``teacher_vocab`` defaults to the
    draft vocabulary (the teacher head is the target lm_head's ``t2d`` rows).
    """
    h, d = cfg.num_attention_heads, cfg.head_dim
    hidden, inter = cfg.hidden_size, cfg.intermediate_size
    kv = cfg.num_key_value_heads * d
    fc = 2 * cfg.num_aux * cfg.target_hidden_size * hidden
    projections = 2 * (2 * hidden) * (h * d + 2 * kv) + 2 * (h * d) * hidden
    mlp = 2 * 3 * hidden * inter
    lm_head = 2 * hidden * cfg.draft_vocab_size
    attention = sum(4 * h * d * (mean_context + j) for j in range(ttt_steps))
    forward = fc + ttt_steps * (projections + mlp + lm_head) + attention
    teacher = 2 * hidden * (teacher_vocab or cfg.draft_vocab_size)
    return {"forward": float(forward), "backward": float(2 * forward), "teacher": float(teacher),
            "attention_forward": float(attention), "total": float(3 * forward + teacher)}


def mean_causal_context(lengths) -> float:
    """Keys attended per token under causal attention, averaged over the tokens of
    samples of the given ``lengths``: ``sum L(L+1)/2 / sum L``."""
    lengths = [int(n) for n in lengths]
    total = sum(lengths)
    return sum(n * (n + 1) / 2 for n in lengths) / total if total else 0.0


def measure_matmul_flops(device: torch.device, dtype: torch.dtype | None = None,
                         size: int | None = None, repeats: int = 5) -> float:
    """Best FLOP/s of a square matmul on ``device`` (bf16 ``8192^3`` on CUDA, fp32
    ``512^3`` on CPU): the peak MFU is measured against when none is configured."""
    if dtype is None:
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    if size is None:
        size = 8192 if device.type == "cuda" else 512
    g = torch.Generator(device).manual_seed(0)      # leaves the global RNG (resume exactness) alone
    a = torch.randn(size, size, device=device, dtype=dtype, generator=g)
    b = torch.randn(size, size, device=device, dtype=dtype, generator=g)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    a @ b
    sync()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        a @ b
        sync()
        best = min(best, time.perf_counter() - t0)
    return 2 * size ** 3 / best
