"""The DFlash block-parallel draft and its training forward.

It computes what vLLM's ``DFlashQwen3ForCausalLM`` (vllm/model_executor/models/
qwen3_dflash.py, with vllm/v1/spec_decode/dflash.py driving it) computes at serving time.
A round starts once the target has verified the prefix ``x[0..a-1]`` and sampled the
bonus token ``x[a]`` (the *anchor*)::

    c[t]      = hidden_norm(fc(aux[t]))                t < a: the target's states, concatenated
    ctx K/V   = rope(k_norm(k_proj_l(c))), v_proj_l(c)  per draft layer l, no input norm
    block     = embed([x[a], M, M, ..., M])            positions a..a+K, M = mask_token_id
    h         = block through the draft layers (pre-norm Qwen3 layers: q/k norms, rope)
                each block query attends to ctx K/V at positions < a and to the whole
                block, non-causally (vLLM's default for a DFlash draft without layer_types)
    logits[k] = lm_head(norm(h[k]))                     k = 1..K predicts x[a+k]

``embed_tokens`` and ``lm_head`` are the target's, frozen and not exported: a draft
checkpoint without them makes vLLM share the target's (llm_base_proposer's
``_maybe_share_embeddings`` / ``_maybe_share_lm_head``). The mask slot's embedding is the
target's row ``mask_token_id``.

Batch layout: samples packed back to back (``[N]`` rows, ``cu_seqlens [B+1]``, positions
restarting at 0 per sample), the hidden-state shards' layout. Anchors are packed row
indices; anchor ``g`` of sample ``s`` sees context rows ``cu[s]..g-1``. Attention runs
densely (one joint softmax over the context rows and the block), exact in float32.

The config is eagle3flow/model/dflash_config.py; this module is the model only: no I/O.
"""
from __future__ import annotations

import torch
import torch.nn as nn

from eagle3flow.model.dflash_config import DFlashConfig
from eagle3flow.model.draft import MLP, PackedLayout, RMSNorm, apply_rope


def dflash_inv_freq(cfg: DFlashConfig) -> tuple[torch.Tensor, float]:
    """Inverse frequencies ``[head_dim/2]`` and the cos/sin scale, as transformers/vLLM derive them."""
    d = cfg.head_dim
    if not cfg.rope_scaling:
        return 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d)), 1.0
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf = LlamaConfig(hidden_size=cfg.hidden_size, num_attention_heads=cfg.num_attention_heads, head_dim=d,
                     max_position_embeddings=cfg.max_position_embeddings, rope_parameters=cfg.rope_parameters())
    inv, scale = ROPE_INIT_FUNCTIONS[hf.rope_parameters["rope_type"]](hf, torch.device("cpu"))
    return inv.float(), float(scale)


class DFlashAttention(nn.Module):
    def __init__(self, cfg: DFlashConfig):
        super().__init__()
        h, kvh, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = h, kvh, d
        self.q_proj = nn.Linear(cfg.hidden_size, h * d, bias=False)
        self.k_proj = nn.Linear(cfg.hidden_size, kvh * d, bias=False)
        self.v_proj = nn.Linear(cfg.hidden_size, kvh * d, bias=False)
        self.o_proj = nn.Linear(h * d, cfg.hidden_size, bias=False)
        self.q_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(d, cfg.rms_norm_eps)

    def keys_values(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """Rotated, normed keys ``[..., kvh, d]`` and values of ``x [..., H]``."""
        shape = x.shape[:-1] + (self.num_kv_heads, self.head_dim)
        k = apply_rope(self.k_norm(self.k_proj(x).view(shape)), cos, sin)
        return k, self.v_proj(x).view(shape)


class DFlashLayer(nn.Module):
    def __init__(self, cfg: DFlashConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = DFlashAttention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        # the SiLU MLP with vLLM's parameter names (gate/up/down), as the EAGLE-3 draft's
        self.mlp = MLP(cfg)


class DFlashDraft(nn.Module):
    """DFlash draft; parameter names are the exported names (plus the frozen
    ``embed_tokens`` and ``lm_head``, the target's)."""

    def __init__(self, cfg: DFlashConfig):
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.embed_tokens.weight.requires_grad_(False)
        self.lm_head.weight.requires_grad_(False)
        self.fc = nn.Linear(cfg.num_aux * cfg.target_hidden_size, cfg.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.layers = nn.ModuleList([DFlashLayer(cfg) for _ in range(cfg.num_hidden_layers)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        inv_freq, self.rope_scale = dflash_inv_freq(cfg)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.reset_parameters()

    FROZEN = ("embed_tokens.weight", "lm_head.weight")

    def reset_parameters(self, std: float = 0.02) -> None:
        for name, p in self.named_parameters():
            if name in self.FROZEN:
                continue
            if name.endswith("norm.weight"):
                nn.init.ones_(p)
            else:
                nn.init.normal_(p, std=std)

    def rope(self, positions: torch.Tensor, dtype: torch.dtype):
        """cos/sin ``[..., 1, d]`` for ``positions [...]`` (float32, like vLLM's cache)."""
        freqs = positions.float().unsqueeze(-1) * self.inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        return ((emb.cos() * self.rope_scale).to(dtype).unsqueeze(-2),
                (emb.sin() * self.rope_scale).to(dtype).unsqueeze(-2))

    def context(self, aux: torch.Tensor) -> torch.Tensor:
        """``hidden_norm(fc(aux))`` ``[N, H]``: what every draft layer projects its context K/V from."""
        return self.hidden_norm(self.fc(aux))

    def block_hidden(self, aux: torch.Tensor, input_ids: torch.Tensor, cu_seqlens: torch.Tensor,
                     anchors: torch.Tensor, layout: PackedLayout | None = None,
                     anchor_chunk: int = 256) -> torch.Tensor:
        """``norm(h)`` ``[M, B, H]`` of the block of each anchor (the lm_head's input).

        ``aux [N, A*Ht]``, ``input_ids [N]``, ``cu_seqlens [B+1]``, ``anchors [M]`` packed
        rows. Block ``m`` holds ``[x[anchors[m]], M, ..., M]`` at positions
        ``pos(anchor)..pos(anchor)+B-1``; slot ``k`` predicts row ``anchors[m]+k``.
        Anchors are processed ``anchor_chunk`` at a time; the dense context scores are
        ``[chunk, heads, B, rows the chunk spans]``, short when anchors ascend.
        """
        layout = layout or PackedLayout.from_cu_seqlens(cu_seqlens, aux.device)
        cfg = self.config
        dtype = self.fc.weight.dtype
        ctx = self.context(aux.to(dtype))
        ctx_cos, ctx_sin = self.rope(layout.positions, dtype)
        ctx_kv = [layer.self_attn.keys_values(ctx, ctx_cos, ctx_sin) for layer in self.layers]
        outs = [self._blocks(input_ids, layout, anchors[a:a + anchor_chunk], ctx_kv, dtype)
                for a in range(0, anchors.numel(), anchor_chunk)]
        if not outs:
            return ctx.new_zeros((0, cfg.block_size, cfg.hidden_size))
        return torch.cat(outs)

    def _blocks(self, input_ids, layout: PackedLayout, anchors, ctx_kv, dtype) -> torch.Tensor:
        cfg = self.config
        bsz = cfg.block_size
        m = anchors.numel()
        tokens = torch.full((m, bsz), cfg.mask_token_id, dtype=torch.long, device=input_ids.device)
        tokens[:, 0] = input_ids[anchors]
        positions = layout.positions[anchors].unsqueeze(1) + torch.arange(bsz, device=anchors.device)
        cos, sin = self.rope(positions, dtype)                               # [M, B, 1, d]
        # context rows the block sees: its own sample's rows before the anchor. The chunk
        # needs only the rows from its earliest anchor's sample start to its last anchor
        # (a sample or a few when anchors ascend), not all N.
        start = layout.cu_seqlens[layout.batch_index[anchors]]
        lo, hi = int(start.min()), int(anchors.max())
        rows = torch.arange(lo, hi, device=anchors.device)
        visible = (rows >= start.unsqueeze(1)) & (rows < anchors.unsqueeze(1))   # [M, span]
        ctx_kv = [(k[lo:hi], v[lo:hi]) for k, v in ctx_kv]
        hidden = self.embed_tokens(tokens).to(dtype)                          # [M, B, H]
        for layer, (k_ctx, v_ctx) in zip(self.layers, ctx_kv):
            attn = layer.self_attn
            x = layer.input_layernorm(hidden)
            q = apply_rope(attn.q_norm(attn.q_proj(x).view(m, bsz, attn.num_heads, attn.head_dim)), cos, sin)
            k_blk, v_blk = attn.keys_values(x, cos, sin)                     # [M, B, kvh, d]
            out = block_attention(q, k_blk, v_blk, k_ctx, v_ctx, visible)
            hidden = hidden + attn.o_proj(out.reshape(m, bsz, -1))
            hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
        return self.norm(hidden)

    def block_logits(self, aux, input_ids, cu_seqlens, anchors, layout=None) -> torch.Tensor:
        """Logits ``[M, B-1, V]`` of the masked slots (slot ``k`` predicts row ``anchor+k``)."""
        return self.lm_head(self.block_hidden(aux, input_ids, cu_seqlens, anchors, layout)[:, 1:])

    @torch.no_grad()
    def predict_blocks(self, aux: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        """Greedy blocks of one sample as served: ``[T, K]`` target ids; row ``a`` (``a >= 1``)
        is the block vLLM drafts once the target has produced ``x[a]`` (the bonus token; the
        target's states of ``x[0..a-1]`` are the context): guesses for indices ``a+1..a+K``.
        Row 0 has no context and is left 0. One block pass drafts all K tokens: nothing
        depends on the draft's own earlier guesses."""
        device = self.fc.weight.device
        aux, input_ids = aux.to(device), input_ids.to(device).long()
        t = input_ids.numel()
        cu = torch.tensor([0, t], device=device)
        out = torch.zeros((t, self.config.num_speculative_tokens), dtype=torch.long, device=device)
        if t > 1:
            anchors = torch.arange(1, t, device=device)
            out[1:] = self.block_logits(aux, input_ids, cu, anchors).argmax(-1)
        return out

    def trainable_state_dict(self) -> dict[str, torch.Tensor]:
        """Exported tensors by their exported names (without the target's embed_tokens/lm_head)."""
        return {name: p.detach() for name, p in self.named_parameters() if name not in self.FROZEN}


def block_attention(q, k_blk, v_blk, k_ctx, v_ctx, visible) -> torch.Tensor:
    """Each block's queries over its visible context rows and its whole block, one softmax.

    ``q [M, B, h, d]``, ``k_blk/v_blk [M, B, kvh, d]``, ``k_ctx/v_ctx [N, kvh, d]``,
    ``visible [M, N]`` bool. Returns ``[M, B, h, d]``. The block always sees itself, so no
    row of the softmax is empty.
    """
    heads, kv_heads, d = q.shape[2], k_blk.shape[2], q.shape[3]
    group = heads // kv_heads
    scale = d ** -0.5
    qf = q.float().view(q.shape[0], q.shape[1], kv_heads, group, d)
    s_ctx = torch.einsum("mbkgd,nkd->mkgbn", qf, k_ctx.float()) * scale
    s_ctx = s_ctx.masked_fill(~visible[:, None, None, None, :], float("-inf"))
    s_blk = torch.einsum("mbkgd,mckd->mkgbc", qf, k_blk.float()) * scale
    p = torch.softmax(torch.cat([s_ctx, s_blk], dim=-1), dim=-1)
    n = k_ctx.shape[0]
    out = (torch.einsum("mkgbn,nkd->mbkgd", p[..., :n], v_ctx.float())
           + torch.einsum("mkgbc,mckd->mbkgd", p[..., n:], v_blk.float()))
    return out.reshape(q.shape).to(q.dtype)

