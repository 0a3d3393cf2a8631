"""The EAGLE-3 draft head and its training-time-test (TTT) forward.

The module computes exactly what vLLM's ``LlamaForCausalLMEagle3``
(vllm/model_executor/models/llama_eagle3.py, one decoder layer, the default
``norm_before_residual=False``) computes at serving time::

    h_in    = fc(aux)                      step 0: from the target's aux states [A*Ht]
            | h_out of the previous step   step j > 0
    e       = embed_tokens(token)          the target's embeddings, frozen
    x       = cat[input_layernorm(e), hidden_norm(h_in)]            [2H]
    r       = h_in + o_proj(attn(q/k/v_proj(x), rope(position)))     residual = un-normed h_in
    h_out   = r + mlp(post_attention_layernorm(r))                   fed to the next step
    logits  = lm_head(norm(h_out))                                   [Vd], target id = d + d2t[d]

TTT semantics (the serving loop, teacher-forced). A sample has target aux states
``aux[t]``, tokens ``x[t]``, teacher final states ``last[t]`` and loss mask ``m[t]``,
``t = 0..T-1``. Chain row ``t``, step ``j = 0..K-1``:

* input hidden: ``fc(aux[t])`` at step 0, else the row's own step ``j-1`` ``h_out``;
* input token ``x[t+j+1]``, rotary position ``t+j``;
* it predicts token index ``t+j+2``: teacher = softmax over the draft vocab of
  ``lm_head_target(last[t+j+1])[t2d]``, weight ``m[t+j+2]``; rows with
  ``t+j+2 >= T`` are invalid;
* attention: keys/values of step 0 at rows ``0..t`` (positions ``0..t``, causal) plus
  the keys/values of steps ``1..j`` of row ``t`` itself (positions ``t+1..t+j``) —
  vLLM's draft KV cache: verified positions hold step-0 entries (recomputed from the
  target's states after each verification), the speculative tail holds the chain's.

The attention is computed without a ``T x (K*T)`` mask: causal attention against
the step-0 K/V (with its logsumexp) plus ``j`` per-row diagonal scores, combined by
one joint softmax through logsumexp (eagle3flow/model/kernels/ttt_attention.py: a flash-attention
path on CUDA, an exact float32 path elsewhere). GQA is supported.

Batch layout: samples packed back to back, ``[N]`` rows with ``cu_seqlens [B+1]``
(sample ``b`` = rows ``cu[b]:cu[b+1]``, positions restart at 0 per sample), the
same layout as the hidden-state shards. Attention runs on a padded ``[B, Tmax]``
view of the packed rows; every other op runs on the packed rows.

This module is the head and its forward only (one concept; most of its length is the
fused TTT step): its config is eagle3flow/model/config.py, loading an exported draft
eagle3flow/export/load.py. No I/O, no parallelism.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from eagle3flow.model.config import DraftConfig
from eagle3flow.model.kernels.fp8_linear import Fp8Weight, fp8_weight, linear
from eagle3flow.model.kernels.ttt_attention import cache_tail_attention


class RMSNorm(nn.Module):
    """vLLM's RMSNorm: normalise in float32, cast back, then scale."""

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return xf.to(dtype) * self.weight.to(dtype)


class Attention(nn.Module):
    def __init__(self, cfg: DraftConfig):
        super().__init__()
        h, d = cfg.num_attention_heads, cfg.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = h, cfg.num_key_value_heads, d
        self.q_proj = nn.Linear(2 * cfg.hidden_size, h * d, bias=False)
        self.k_proj = nn.Linear(2 * cfg.hidden_size, self.num_kv_heads * d, bias=False)
        self.v_proj = nn.Linear(2 * cfg.hidden_size, self.num_kv_heads * d, bias=False)
        self.o_proj = nn.Linear(h * d, cfg.hidden_size, bias=False)


class MLP(nn.Module):
    def __init__(self, cfg: DraftConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class MLAAttention(nn.Module):
    """DeepSeek's multi-head latent attention over the midlayer's 2H input, with vLLM's
    parameter names (deepseek_v2.py): the query through a low-rank ``q_a -> norm -> q_b``
    (or one ``q_proj``), the key/value through the compressed ``kv_a`` (``kv_lora_rank``
    latent + one shared ``qk_rope_head_dim`` rotary key), normed and up-projected per head
    by ``kv_b``. Scores use ``qk_nope + qk_rope`` dims, values ``v_head_dim``."""

    def __init__(self, cfg: DraftConfig):
        super().__init__()
        h, two_h = cfg.num_attention_heads, 2 * cfg.hidden_size
        qk = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
        self.num_heads = self.num_kv_heads = h
        self.head_dim = qk
        if cfg.q_lora_rank:
            self.q_a_proj = nn.Linear(two_h, cfg.q_lora_rank, bias=False)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps)
            self.q_b_proj = nn.Linear(cfg.q_lora_rank, h * qk, bias=False)
        else:
            self.q_proj = nn.Linear(two_h, h * qk, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(two_h, cfg.kv_lora_rank + cfg.qk_rope_head_dim, bias=False)
        self.kv_a_layernorm = RMSNorm(cfg.kv_lora_rank, cfg.rms_norm_eps)
        self.kv_b_proj = nn.Linear(cfg.kv_lora_rank, h * (cfg.qk_nope_head_dim + cfg.v_head_dim), bias=False)
        self.o_proj = nn.Linear(h * cfg.v_head_dim, cfg.hidden_size, bias=False)


class MidLayer(nn.Module):
    def __init__(self, cfg: DraftConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = MLAAttention(cfg) if cfg.architecture == "mla" else Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)


def rope_inv_freq(cfg: DraftConfig) -> tuple[torch.Tensor, float]:
    """Inverse frequencies ``[rotary dims/2]`` and the cos/sin scale, as transformers/vLLM
    derive them. A Llama draft rotates its whole ``head_dim``; an MLA draft its
    ``qk_rope_head_dim`` (DeepSeek's YaRN: the cos/sin scale is
    ``mscale(factor, mscale) / mscale(factor, mscale_all_dim)``, as in vLLM's
    DeepseekScalingRotaryEmbedding and HF's yarn init)."""
    params = cfg.rope_parameters()
    d = cfg.qk_rope_head_dim if cfg.architecture == "mla" else cfg.head_dim
    if params.get("rope_type", "default") == "default":
        inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
        return inv, 1.0
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    if cfg.architecture == "mla":
        rope = {k: v for k, v in params.items()}
        rope["rope_type"] = "yarn" if rope["rope_type"] in ("yarn", "deepseek_yarn") else rope["rope_type"]
        hf = LlamaConfig(hidden_size=cfg.hidden_size, num_attention_heads=cfg.num_attention_heads,
                         head_dim=d, max_position_embeddings=cfg.max_position_embeddings,
                         rope_parameters=rope)
    else:
        hf = LlamaConfig(**{k: v for k, v in cfg.to_hf_config().items()
                            if k not in ("architectures", "rope_scaling", "rope_theta")})
    inv, scale = ROPE_INIT_FUNCTIONS[hf.rope_parameters["rope_type"]](hf, torch.device("cpu"))
    return inv.float(), float(scale)


def mla_softmax_scale(cfg: DraftConfig) -> float:
    """``(qk_nope + qk_rope)^-0.5``, times ``mscale(factor, mscale_all_dim)^2`` under
    DeepSeek's YaRN (vLLM's DeepseekV2MLAAttention)."""
    scale = (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim) ** -0.5
    rope = cfg.rope_scaling or {}
    if rope.get("rope_type", rope.get("type")) in ("yarn", "deepseek_yarn") and rope.get("mscale_all_dim"):
        factor = float(rope["factor"])
        mscale = 0.1 * float(rope["mscale_all_dim"]) * math.log(factor) + 1.0 if factor > 1 else 1.0
        scale *= mscale * mscale
    return scale


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Neox-style rotary. ``x [N, heads, d]``, ``cos/sin [N, 1, d]``."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    rotated = torch.cat((-x2, x1), dim=-1)
    return x * cos + rotated * sin


def apply_rope_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """GPT-J-style rotary (DeepSeek's; vLLM's ``is_neox_style=False``): pairs
    ``(x[2i], x[2i+1])`` turn by frequency ``i``. ``x [N, heads, d]``, ``cos/sin [N, 1, d]``
    (each frequency twice, as :meth:`Eagle3Draft.rope` builds them)."""
    even, odd = x[..., 0::2], x[..., 1::2]
    c, s = cos[..., : x.shape[-1] // 2], sin[..., : x.shape[-1] // 2]
    return torch.stack((even * c - odd * s, odd * c + even * s), dim=-1).flatten(-2)


def host_to_device(values, device: torch.device, dtype=None) -> torch.Tensor:
    """A host tensor or list on ``device`` without waiting for the device's queue (pinned,
    non-blocking: a plain ``.to(cuda)`` synchronises the stream)."""
    t = torch.as_tensor(values, dtype=dtype)
    if device.type != "cuda" or t.is_cuda:
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


@dataclass
class PackedLayout:
    """Where packed rows ``[N]`` live in the padded ``[B, Tmax]`` view, and their positions."""
    cu_seqlens: torch.Tensor    # int64 [B+1]
    positions: torch.Tensor     # int64 [N], position within the sample
    lengths: torch.Tensor       # int64 [N], the length of the row's sample
    batch_index: torch.Tensor   # int64 [N]
    max_len: int
    uniform: bool = False       # every sample has max_len rows: padded view == packed rows

    @classmethod
    def from_cu_seqlens(cls, cu_seqlens: torch.Tensor, device=None) -> "PackedLayout":
        cu = cu_seqlens.to(torch.int64).cpu()
        lengths = cu[1:] - cu[:-1]
        if (lengths <= 0).any():
            raise ValueError(f"cu_seqlens {cu.tolist()} has an empty sample")
        batch_index = torch.repeat_interleave(torch.arange(len(lengths)), lengths)
        positions = torch.arange(int(cu[-1])) - cu[:-1][batch_index]
        dev = torch.device(device or cu_seqlens.device)
        max_len = int(lengths.max())
        return cls(host_to_device(cu, dev), host_to_device(positions, dev),
                   host_to_device(lengths[batch_index], dev), host_to_device(batch_index, dev),
                   max_len, bool((lengths == max_len).all()))

    @property
    def num_samples(self) -> int:
        return self.cu_seqlens.numel() - 1

    def valid(self, step: int) -> torch.Tensor:
        """Bool ``[N]``: rows whose step-``step`` prediction (index ``t+step+2``) exists."""
        return self.positions + step + 2 < self.lengths

    @property
    def flat_index(self) -> torch.Tensor:
        """``[N]`` row of each packed row in the flattened ``[B*Tmax]`` padded view."""
        return self.batch_index * self.max_len + self.positions

    def to_padded(self, x: torch.Tensor) -> torch.Tensor:
        """``[N, ...]`` -> ``[B, Tmax, ...]`` (zeros in the padding; a view when uniform)."""
        rest = tuple(x.shape[1:])
        if self.uniform:
            return x.reshape((self.num_samples, self.max_len) + rest)
        out = x.new_zeros((self.num_samples * self.max_len,) + rest).index_copy(0, self.flat_index, x)
        return out.view((self.num_samples, self.max_len) + rest)

    def from_padded(self, x: torch.Tensor) -> torch.Tensor:
        """``[B, Tmax, ...]`` -> ``[N, ...]``."""
        flat = x.reshape((-1,) + tuple(x.shape[2:]))
        return flat if self.uniform else flat.index_select(0, self.flat_index)


def rms_normalize(x: torch.Tensor, eps: float) -> torch.Tensor:
    """vLLM's RMSNorm without its weight: normalise in float32, cast back to ``x``'s dtype."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def pre_attention(embeds: torch.Tensor, hidden: torch.Tensor, w_embed: torch.Tensor,
                  w_hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, eps: float,
                  heads: int, kv_heads: int, head_dim: int):
    """The midlayer up to attention: rotated ``q [N,h,d]``, ``k, v [N,kvh,d]``.

    ``qkv_proj(cat[input_layernorm(e), hidden_norm(h)])`` with the norms' weights folded
    into the two column halves of the stacked q/k/v weight (``w_embed``, ``w_hidden``
    ``[(h+2kvh)*d, H]``): the same product, and the backward skips the input gradient of
    the embedding half (the embeddings are frozen). Halves given as :class:`Fp8Weight` are
    multiplied in fp8, each on its own.
    """
    n = hidden.shape[0]
    if isinstance(w_embed, Fp8Weight) or isinstance(w_hidden, Fp8Weight):
        qkv = linear(rms_normalize(embeds, eps), w_embed) + linear(rms_normalize(hidden, eps), w_hidden)
    else:
        qkv = torch.addmm(F.linear(rms_normalize(embeds, eps), w_embed), rms_normalize(hidden, eps),
                          w_hidden.t())
    q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    q = apply_rope(q.view(n, heads, head_dim), cos, sin)
    k = apply_rope(k.view(n, kv_heads, head_dim), cos, sin)
    return q, k, v.reshape(n, kv_heads, head_dim)


def post_attention(hidden: torch.Tensor, attn_out: torch.Tensor, w_o: torch.Tensor,
                   w_post_norm: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor,
                   w_final_norm: torch.Tensor, eps: float):
    """Attention output ``[N, h*d]`` + residual ``hidden [N, H]`` -> the step's ``h_out``
    (o_proj, post-attention norm, SiLU MLP with gate/up stacked in one weight) and
    ``norm(h_out)``, the lm_head's input (both ``[N, H]``). Weights given as
    :class:`Fp8Weight` are multiplied in fp8."""
    residual = hidden + linear(attn_out, w_o)
    gate, up = linear(rms_normalize(residual, eps) * w_post_norm, w_gate_up).chunk(2, dim=-1)
    h_out = residual + linear(F.silu(gate) * up, w_down)
    return h_out, rms_normalize(h_out, eps) * w_final_norm


def mla_pre_attention(embeds: torch.Tensor, hidden: torch.Tensor, w: dict[str, torch.Tensor],
                      cos: torch.Tensor, sin: torch.Tensor, eps: float, heads: int, qk_nope: int,
                      qk_rope: int, v_dim: int, kv_lora: int):
    """The MLA midlayer up to attention: ``q, k [N, h, qk_nope+qk_rope]``, ``v [N, h, v_dim]``.

    ``x = cat[input_layernorm(e), hidden_norm(h)]``; the query ``q_b(norm(q_a x))`` (or
    ``q_proj x``), its last ``qk_rope`` dims rotated; ``kv_a x`` = the ``kv_lora`` latent
    (normed, then up-projected by ``kv_b`` into each head's no-rope key part and value)
    and one rotated rope key shared by every head. The products of ``x`` (``q_a`` or ``q``,
    and ``kv_a``) are one GEMM over stacked weights with the norms' weights folded into their
    embedding and hidden column halves (``w["embed"]``, ``w["hidden"]``), as
    :func:`pre_attention` does: the backward skips the frozen embeddings' input gradient.
    """
    n = hidden.shape[0]
    first = torch.addmm(F.linear(rms_normalize(embeds, eps), w["embed"]), rms_normalize(hidden, eps),
                        w["hidden"].t())
    q, kv_a = first.split([first.shape[-1] - kv_lora - qk_rope, kv_lora + qk_rope], dim=-1)
    if "q_b" in w:
        q = F.linear(rms_normalize(q, eps) * w["q_a_norm"], w["q_b"])
    q = q.reshape(n, heads, qk_nope + qk_rope)
    q = torch.cat([q[..., :qk_nope], apply_rope_interleaved(q[..., qk_nope:], cos, sin)], -1)
    latent = rms_normalize(kv_a[:, :kv_lora], eps) * w["kv_a_norm"]
    k_rope = apply_rope_interleaved(kv_a[:, kv_lora:].reshape(n, 1, qk_rope), cos, sin)
    kv = F.linear(latent, w["kv_b"]).view(n, heads, qk_nope + v_dim)
    k = torch.cat([kv[..., :qk_nope], k_rope.expand(n, heads, qk_rope)], -1)
    return q, k, kv[..., qk_nope:]


_COMPILED: dict[str, object] = {}


def compiled_step_parts(architecture: str = "llama"):
    """The architecture's pre-attention (``pre_attention`` or ``mla_pre_attention``) and
    ``post_attention`` through torch.compile (fused element-wise work)."""
    if not _COMPILED:
        # default dynamic=None: static first, one dynamic recompile when the row count changes
        _COMPILED["llama"] = torch.compile(pre_attention)
        _COMPILED["mla"] = torch.compile(mla_pre_attention)
        _COMPILED["post"] = torch.compile(post_attention)
    return _COMPILED[architecture], _COMPILED["post"]


def compute_dtype(device: torch.device, param_dtype: torch.dtype) -> torch.dtype:
    """The autocast dtype where autocast is on for ``device``, else the parameters' dtype."""
    if device.type == "cuda" and torch.is_autocast_enabled("cuda"):
        return torch.get_autocast_dtype("cuda")
    return param_dtype


# ---------------------------------------------------------------------------- model

class Eagle3Draft(nn.Module):
    """EAGLE-3 draft head; parameter names are the exported names (plus ``embed_tokens``)."""

    def __init__(self, cfg: DraftConfig):
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.embed_tokens.weight.requires_grad_(False)     # the target's, frozen, not exported
        if cfg.norm_before_fc:
            self.input_norm = RMSNorm(cfg.num_aux * cfg.target_hidden_size, cfg.rms_norm_eps)
        if cfg.fc_norm:
            self.fc_norm = nn.ModuleList([RMSNorm(cfg.target_hidden_size, cfg.rms_norm_eps)
                                          for _ in range(cfg.num_aux)])
        self.fc = nn.Linear(cfg.num_aux * cfg.target_hidden_size, cfg.hidden_size, bias=False)
        self.midlayer = MidLayer(cfg)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.int64))
        self.register_buffer("t2d", torch.zeros(cfg.vocab_size, dtype=torch.bool))
        inv_freq, self.rope_scale = rope_inv_freq(cfg)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.attention_scale = (mla_softmax_scale(cfg) if cfg.architecture == "mla"
                                else cfg.head_dim ** -0.5)
        self.reset_parameters()

    def reset_parameters(self, std: float = 0.02) -> None:
        for name, p in self.named_parameters():
            if name.endswith("norm.weight"):
                nn.init.ones_(p)
            elif name != "embed_tokens.weight":
                nn.init.normal_(p, std=std)

    # -- pieces shared by the training forward and the serving-style reference

    def rope(self, positions: torch.Tensor, dtype: torch.dtype):
        """cos/sin ``[N, 1, d]`` for positions ``[N]`` (computed in float32 like vLLM's cache)."""
        freqs = positions.float().unsqueeze(-1) * self.inv_freq.unsqueeze(0)
        emb = torch.cat((freqs, freqs), dim=-1)
        cos = (emb.cos() * self.rope_scale).to(dtype).unsqueeze(1)
        sin = (emb.sin() * self.rope_scale).to(dtype).unsqueeze(1)
        return cos, sin

    def step_weights(self, dtype: torch.dtype, fp8: bool = False) -> dict[str, torch.Tensor]:
        """The midlayer's weights in ``dtype``, stacked/folded for :func:`pre_attention` (or
        :func:`mla_pre_attention`) and :func:`post_attention`; built once per forward
        (differentiable w.r.t. the parameters). ``fp8``: the Llama layer's q/k/v halves and
        both layers' o_proj and MLP weights come with their fp8 casts (:class:`Fp8Weight`),
        which those functions multiply in fp8."""
        layer, attn, mlp = self.midlayer, self.midlayer.self_attn, self.midlayer.mlp
        hid = self.config.hidden_size
        weights = {
            "w_o": attn.o_proj.weight.to(dtype),
            "w_post_norm": layer.post_attention_layernorm.weight.to(dtype),
            "w_gate_up": torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]).to(dtype),
            "w_down": mlp.down_proj.weight.to(dtype),
            "w_final_norm": self.norm.weight.to(dtype),
        }
        if self.config.architecture == "mla":
            query = attn.q_a_proj.weight if self.config.q_lora_rank else attn.q_proj.weight
            first = torch.cat([query, attn.kv_a_proj_with_mqa.weight]).to(dtype)
            mla = {"embed": first[:, :hid] * layer.input_layernorm.weight.to(dtype),
                   "hidden": first[:, hid:] * layer.hidden_norm.weight.to(dtype),
                   "kv_a_norm": attn.kv_a_layernorm.weight, "kv_b": attn.kv_b_proj.weight}
            if self.config.q_lora_rank:
                mla.update(q_a_norm=attn.q_a_layernorm.weight, q_b=attn.q_b_proj.weight)
            weights["mla"] = {k: v.to(dtype) for k, v in mla.items()}
        else:
            w_qkv = torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]).to(dtype)
            weights.update(w_embed=w_qkv[:, :hid] * layer.input_layernorm.weight.to(dtype),
                           w_hidden=w_qkv[:, hid:] * layer.hidden_norm.weight.to(dtype))
        if fp8:
            for key in ("w_o", "w_gate_up", "w_down", "w_embed", "w_hidden"):
                if key in weights:
                    weights[key] = fp8_weight(weights[key])
        return weights

    def fc_input(self, aux: torch.Tensor) -> torch.Tensor:
        """``aux [N, A*Ht]`` as fc reads it: normed as a whole (norm_before_fc), per aux
        state (fc_norm), or as it is."""
        cfg = self.config
        if cfg.norm_before_fc:
            return rms_normalize(aux, cfg.rms_norm_eps) * self.input_norm.weight.to(aux.dtype)
        if cfg.fc_norm:
            chunks = aux.view(aux.shape[0], cfg.num_aux, -1)
            weights = torch.stack([norm.weight for norm in self.fc_norm]).to(aux.dtype)
            return (rms_normalize(chunks, cfg.rms_norm_eps) * weights).view_as(aux)
        return aux

    def logits(self, h_out: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(h_out))

    def draft_to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.d2t[draft_ids]

    # -- training-time test

    def forward_ttt(self, aux: torch.Tensor, input_ids: torch.Tensor, cu_seqlens: torch.Tensor,
                    num_steps: int, layout: PackedLayout | None = None,
                    step_tokens: list[torch.Tensor] | None = None, compute_logits: bool = True,
                    normed: bool = False):
        """Teacher-forced TTT over packed samples (see the module docstring).

        ``aux [N, A*Ht]``, ``input_ids [N]``, ``cu_seqlens [B+1]``. Returns
        ``(logits, hiddens)``: ``num_steps`` tensors ``[N, Vd]`` and ``[N, H]``; row ``r``
        of step ``j`` predicts packed row ``r+j+2`` (valid where ``layout.valid(j)``).
        ``hiddens`` are the steps' ``h_out``, or with ``normed=True`` ``norm(h_out)`` (the
        lm_head's input, computed in the same fused step).
        ``step_tokens`` (optional) overrides the input token of step ``j`` with
        ``step_tokens[j] [N]`` (used to feed the draft's own predictions).
        With ``compute_logits=False`` the logits list is empty: training computes them
        only on the rows it scores, a third of the lm_head's work on chat data.
        Runs in the autocast dtype where CUDA autocast is on (weights cast once per call);
        attention goes through eagle3flow/model/kernels/ttt_attention.py (flash kernel on CUDA).
        The per-step pieces run through torch.compile on CUDA (``self.compile_steps``:
        ``None`` = on CUDA only, or force ``True``/``False``; ~15 s of compilation once).
        ``self.fp8_matmuls`` (``train.fp8_matmuls``; off unless set): the layer's GEMMs in
        fp8 (MLA's: o_proj and the MLP; eagle3flow/model/kernels/fp8_linear.py).
        """
        layout = layout or PackedLayout.from_cu_seqlens(cu_seqlens, aux.device)
        n = input_ids.shape[0]
        cfg, attn = self.config, self.midlayer.self_attn
        scale = self.attention_scale
        dtype = compute_dtype(aux.device, self.fc.weight.dtype)
        weights = self.step_weights(dtype, fp8=getattr(self, "fp8_matmuls", False))
        compile_steps = getattr(self, "compile_steps", None)
        if compile_steps is None:
            compile_steps = aux.is_cuda
        pre, post = compiled_step_parts(cfg.architecture) if compile_steps else \
            (mla_pre_attention if cfg.architecture == "mla" else pre_attention, post_attention)
        if cfg.architecture == "mla":
            mla, mla_pre = weights["mla"], pre

            def pre(embeds, hidden, _w_embed, _w_hidden, cos, sin, eps, *_heads):
                return mla_pre(embeds, hidden, mla, cos, sin, eps, cfg.num_attention_heads,
                               cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank)
        hidden = F.linear(self.fc_input(aux.to(dtype)), self.fc.weight.to(dtype))
        hidden_norm = self.midlayer.hidden_norm.weight.to(dtype)
        rows = torch.arange(n, device=input_ids.device)
        k0 = v0 = None
        tail_k, tail_v = [], []          # padded K/V of steps 1..j, each row's own chain
        all_logits, all_hidden = [], []
        for j in range(num_steps):
            if step_tokens is not None and j < len(step_tokens) and step_tokens[j] is not None:
                tokens = step_tokens[j]
            else:
                # x[t+j+1]; out-of-sample rows are invalid for this and later steps
                src = rows + j + 1
                ok = layout.positions + j + 1 < layout.lengths
                tokens = torch.where(ok, input_ids[src.clamp(max=n - 1)], torch.zeros_like(input_ids))
            cos, sin = self.rope(layout.positions + j, dtype)
            q, k, v = pre(self.embed_tokens(tokens).to(dtype), hidden, weights.get("w_embed"),
                          weights.get("w_hidden"), cos, sin, cfg.rms_norm_eps, attn.num_heads,
                          attn.num_kv_heads, attn.head_dim)
            if j == 0:
                k0, v0 = layout.to_padded(k), layout.to_padded(v)
            else:
                tail_k.append(layout.to_padded(k))
                tail_v.append(layout.to_padded(v))
            out = cache_tail_attention(layout.to_padded(q), k0, v0,
                                       torch.stack(tail_k) if tail_k else k0.new_zeros((0,) + tuple(k0.shape)),
                                       torch.stack(tail_v) if tail_v else v0.new_zeros((0,) + tuple(v0.shape)),
                                       scale)
            residual = rms_normalize(hidden, cfg.rms_norm_eps) * hidden_norm if cfg.norm_before_residual else hidden
            h_out, final = post(residual, layout.from_padded(out).reshape(n, -1), weights["w_o"],
                                weights["w_post_norm"], weights["w_gate_up"], weights["w_down"],
                                weights["w_final_norm"], cfg.rms_norm_eps)
            hidden = final if cfg.norm_output else h_out
            all_hidden.append(final if normed else h_out)
            if compute_logits:
                all_logits.append(F.linear(final, self.lm_head.weight.to(dtype)))
        return all_logits, all_hidden

    @torch.no_grad()
    def predict_chains(self, aux: torch.Tensor, input_ids: torch.Tensor, num_steps: int) -> torch.Tensor:
        """Greedy draft chains of one sample as served: ``aux [T, A*Ht]``, ``input_ids [T]``
        -> LongTensor ``[T, K]`` of TARGET ids; ``[t, j]`` is the draft's guess for index
        ``t+j+2`` given the verified prefix ``x[0..t+1]``. Step ``j>0`` is fed the draft's
        own step ``j-1`` guess, as vLLM does (identical to teacher forcing while the
        chain is correct, so leading-match counts are the served acceptance)."""
        device = self.fc.weight.device
        aux, input_ids = aux.to(device), input_ids.to(device).long()
        cu = torch.tensor([0, input_ids.numel()], device=device)
        layout = PackedLayout.from_cu_seqlens(cu, device)
        step_tokens: list[torch.Tensor | None] = [None]
        preds = []
        for j in range(num_steps):
            # Recomputing the prefix each step keeps one code path; chains are short.
            logits, _ = self.forward_ttt(aux, input_ids, cu, j + 1, layout, step_tokens)
            target_ids = self.draft_to_target(logits[j].argmax(-1))
            preds.append(target_ids)
            step_tokens.append(target_ids)
        return torch.stack(preds, 1)

    # -- export

    def trainable_state_dict(self) -> dict[str, torch.Tensor]:
        """Exported tensors by their exported names (no embed_tokens)."""
        state = {name: p.detach() for name, p in self.named_parameters() if name != "embed_tokens.weight"}
        state["d2t"], state["t2d"] = self.d2t, self.t2d
        return state
