"""FLOPs of a training step and the FLOP/s they are measured against (MFU).

One home for both, so the trainer's log and the training benchmark (benchmarks/train_*)
report the same MFU against the same named denominator.

The count follows the draft the config builds (eagle3flow/model/draft.py: a Llama layer
with GQA, or DeepSeek's MLA) and counts the matrix products one step of
eagle3flow/train/loss.py runs, multiply-add = 2 FLOPs; element-wise work (norms, rope,
softmax, the optimizer) is not counted. A weight's product over a row costs
``2 * fan_in * fan_out`` forward; its backward computes the weight's gradient (as much
again) and the input's gradient only where the input needs one, which is not the case for

* the frozen embeddings' half of the layer's first products (the Llama layer's q/k/v, MLA's
  q_a (or q) and kv_a, stacked): the input norm's weight is folded into that half of the
  weight, so its gradient comes from the weight's;
* fc's aux states, unless a trainable norm (``norm_before_fc``, ``fc_norm``) reads them first.

The draft's lm_head runs only on the rows a step scores (loss.py), and the teacher head
(the target lm_head's ``t2d`` rows) on every row, forward only: it has no gradient.
Attention counts ``QK^T`` and ``PV`` over the keys a row attends (its causal prefix,
``mean_context`` on average, plus ``j`` chain entries at step ``j``), the useful work: the
flash kernel's skipped blocks (and MLA's values padded to the query width where the padded
flash kernel runs them instead of cuDNN's) are not.
Muon's Newton-Schulz products are the optimizer's, once per optimizer step whatever the
batch: eagle3flow/model/optimizer_flops.py counts them apart (the MFU the trainer prints adds
them).
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Product:
    """One weight's product over a row, and whether its backward needs the input's gradient."""
    fan_in: int
    fan_out: int
    input_grad: bool = True

    @property
    def forward(self) -> int:
        return 2 * self.fan_in * self.fan_out

    @property
    def backward(self) -> int:
        return self.forward * (2 if self.input_grad else 1)


def layer_products(cfg) -> dict[str, Product]:
    """The products one TTT step of the draft layer runs per row, by the weights' names."""
    hidden, two_h, heads = cfg.hidden_size, 2 * cfg.hidden_size, cfg.num_attention_heads
    mlp = {"gate_up_proj": Product(hidden, 2 * cfg.intermediate_size),
           "down_proj": Product(cfg.intermediate_size, hidden)}
    if cfg.architecture == "mla":
        qk = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
        first = (cfg.q_lora_rank or heads * qk) + cfg.kv_lora_rank + cfg.qk_rope_head_dim
        query = {"q_b_proj": Product(cfg.q_lora_rank, heads * qk)} if cfg.q_lora_rank else {}
        return {"q_a_proj|q_proj + kv_a_proj_with_mqa (embeddings)": Product(hidden, first, input_grad=False),
                "q_a_proj|q_proj + kv_a_proj_with_mqa (hidden)": Product(hidden, first), **query,
                "kv_b_proj": Product(cfg.kv_lora_rank, heads * (cfg.qk_nope_head_dim + cfg.v_head_dim)),
                "o_proj": Product(heads * cfg.v_head_dim, hidden), **mlp}
    qkv = (heads + 2 * cfg.num_key_value_heads) * cfg.head_dim
    return {"qkv_proj (embeddings)": Product(hidden, qkv, input_grad=False),
            "qkv_proj (hidden)": Product(hidden, qkv),
            "o_proj": Product(heads * cfg.head_dim, hidden), **mlp}


def attention_widths(cfg) -> tuple[int, int]:
    """The widths of a head's scores (``QK^T``) and values (``PV``)."""
    if cfg.architecture == "mla":
        return cfg.qk_nope_head_dim + cfg.qk_rope_head_dim, cfg.v_head_dim
    return cfg.head_dim, cfg.head_dim


def train_flops_per_token(cfg, ttt_steps: int, mean_context: float, teacher_vocab: int | None = None,
                          scored_share: float = 1.0) -> dict:
    """FLOPs per token of one training step, and its pieces.

    ``cfg``: a :class:`eagle3flow.model.config.DraftConfig`; ``mean_context``: keys a row
    attends to, averaged over tokens (causally ``(L+1)/2`` for samples of ``L`` tokens, see
    :func:`mean_causal_context`); ``scored_share``: the (row, TTT step) pairs the loss
    scores over all ``rows x ttt_steps`` (1 = every one). ``teacher_vocab`` defaults to the
    draft vocabulary (the teacher head is the target lm_head's ``t2d`` rows).

    ``per_row`` is what every packed row costs, ``per_scored`` what each scored (row, step)
    adds (the draft lm_head, forward and backward): a step of ``N`` rows, ``S`` of them
    scored, costs ``N * per_row + S * per_scored``; ``total`` is that per token. The pieces:
    ``fc``, ``layer`` (all TTT steps), ``lm_head`` forward + backward, ``attention_forward``,
    ``teacher`` (forward only), and the draft's ``forward`` and ``backward``.
    """
    hidden = cfg.hidden_size
    fc = Product(cfg.num_aux * cfg.target_hidden_size, hidden,
                 input_grad=bool(cfg.norm_before_fc or cfg.fc_norm))
    products = layer_products(cfg).values()
    score_width, value_width = attention_widths(cfg)
    keys = sum(mean_context + j for j in range(ttt_steps))
    attention = 2 * cfg.num_attention_heads * (score_width + value_width) * keys  # backward: 2x (dQ, dK; dP, dV)
    lm_head = Product(hidden, cfg.draft_vocab_size)
    teacher = 2 * hidden * (teacher_vocab or cfg.draft_vocab_size)
    scored = scored_share * ttt_steps
    forward = fc.forward + ttt_steps * sum(p.forward for p in products) + attention + scored * lm_head.forward
    backward = fc.backward + ttt_steps * sum(p.backward for p in products) + 2 * attention + scored * lm_head.backward
    per_scored = lm_head.forward + lm_head.backward
    return {"forward": float(forward), "backward": float(backward), "teacher": float(teacher),
            "fc": float(fc.forward + fc.backward),
            "layer": float(ttt_steps * sum(p.forward + p.backward for p in products)),
            "attention_forward": float(attention), "lm_head": float(scored * per_scored),
            "per_row": float(forward + backward + teacher - scored * per_scored), "per_scored": float(per_scored),
            "total": float(forward + backward + teacher)}


def mean_causal_context(lengths) -> float:
    """Keys attended per token under causal attention, averaged over the tokens of
    samples of the given ``lengths``: ``sum L(L+1)/2 / sum L``."""
    lengths = [int(n) for n in lengths]
    total = sum(lengths)
    return sum(n * (n + 1) / 2 for n in lengths) / total if total else 0.0


# ---------------------------------------------------------------------------- the denominator

# Dense (no sparsity) bf16 tensor-core peaks from the vendors' datasheets, by a part of the
# device's name: printed beside the measured rate, the figure other reports' MFU divide by.
DATASHEET_BF16_PEAKS = {"H200": 989e12}
# What is printed in place of a utilisation above 100%: the counted FLOPs were not all done.
OVER_PEAK = "!!! over 100%: FLOP count wrong"


def matmul_size(device: torch.device) -> int:
    """The side of the square matmul measured on ``device``: large enough to reach the GPU's
    peak, small enough to take a moment on a CPU."""
    return 8192 if device.type == "cuda" else 512


def measure_matmul_flops(device: torch.device, dtype: torch.dtype | None = None,
                         size: int | None = None, repeats: int = 5) -> float:
    """Best FLOP/s of a square matmul on ``device`` (bf16 on CUDA, timed by events, fp32 on
    CPU; :func:`matmul_size`): the rate MFU is measured against when none is configured."""
    if dtype is None:
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    size = size or matmul_size(device)
    g = torch.Generator(device).manual_seed(0)      # leaves the global RNG (resume exactness) alone
    a = torch.randn(size, size, device=device, dtype=dtype, generator=g)
    b = torch.randn(size, size, device=device, dtype=dtype, generator=g)
    for _ in range(3 if device.type == "cuda" else 1):     # clocks up, kernel chosen
        a @ b
    best = float("inf")
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            a @ b
            end.record()
            end.synchronize()
            seconds = start.elapsed_time(end) / 1e3
        else:
            t0 = time.perf_counter()
            a @ b
            seconds = time.perf_counter() - t0
        best = min(best, seconds)
    return 2 * size ** 3 / best


def datasheet_peak(device: torch.device) -> tuple[str, float] | None:
    """``(part, dense bf16 FLOP/s)`` of ``device`` where :data:`DATASHEET_BF16_PEAKS` knows it."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next(((part, peak) for part, peak in DATASHEET_BF16_PEAKS.items() if part in name), None)


class PeakFlops:
    """The FLOP/s one device's MFU is relative to: ``configured`` (``train.peak_flops``), else
    a matmul measured in this run; the device's datasheet peak beside it where known.

    An MFU above 100% is never reported. A measurement taken while the machine was busy
    comes out low, so the rate is measured once more; if the achieved rate still exceeds it,
    the FLOP count is wrong: the MFU is None and :meth:`describe` says so."""

    def __init__(self, device: torch.device, configured: float | None = None, size: int | None = None):
        self.device, self.configured, self.size = device, configured, size or matmul_size(device)
        self.value = float(configured) if configured else measure_matmul_flops(device, size=size)
        self.basis = "configured" if configured else "measured matmul"
        self.datasheet = datasheet_peak(device)
        self.remeasured = False

    def rate_text(self) -> str:
        """The denominators in words, e.g. ``811.2 TFLOP/s measured matmul (H200 datasheet
        dense bf16 989 TFLOP/s)``."""
        text = f"{self.value / 1e12:.4g} TFLOP/s {self.basis}"
        if self.datasheet:
            text += f" ({self.datasheet[0]} datasheet dense bf16 {self.datasheet[1] / 1e12:.0f} TFLOP/s)"
        return text

    def mfu(self, achieved_per_device: float) -> dict:
        """``{"mfu", "mfu_peak_flops", "mfu_basis", "mfu_datasheet", "datasheet_peak_flops"}``
        for a training rate (FLOP/s per device); the MFUs are fractions, None when over 1."""
        if achieved_per_device > self.value and not self.configured and not self.remeasured:
            self.value = max(self.value, measure_matmul_flops(self.device, size=self.size, repeats=20))
            self.remeasured = True
        peak = self.datasheet[1] if self.datasheet else None
        return {"mfu": achieved_per_device / self.value if achieved_per_device <= self.value else None,
                "mfu_peak_flops": self.value, "mfu_basis": self.basis,
                "mfu_datasheet": achieved_per_device / peak if peak and achieved_per_device <= peak else None,
                "datasheet_peak_flops": peak}

    def describe(self, row: dict) -> str:
        """:meth:`mfu`'s fractions in words, each with its denominator."""
        if row["mfu"] is None:
            culprit = " (or train.peak_flops)" if self.configured else ""
            return f"{OVER_PEAK}{culprit}, of {self.value / 1e12:.4g} TFLOP/s {self.basis}"
        text = f"{row['mfu']:.1%} of {self.value / 1e12:.4g} TFLOP/s {self.basis}"
        if self.datasheet:
            share = OVER_PEAK if row["mfu_datasheet"] is None else f"{row['mfu_datasheet']:.1%}"
            text += f", {share} of the {self.datasheet[0]}'s dense bf16 {self.datasheet[1] / 1e12:.0f} TFLOP/s"
        return text
