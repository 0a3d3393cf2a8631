"""The TTT forward against a serving loop written from vLLM's llama_eagle3.py."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from eagle3flow.model.config import DraftConfig
from eagle3flow.model.draft import Eagle3Draft, PackedLayout


def tiny_config(**kw) -> DraftConfig:
    values = dict(hidden_size=32, target_hidden_size=32, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=8, intermediate_size=48, rms_norm_eps=1e-6,
                  rope_theta=10000.0, max_position_embeddings=256, vocab_size=64,
                  draft_vocab_size=40, aux_layer_ids=[2, 4, 5])
    values.update(kw)
    return DraftConfig(**values)


def random_draft(cfg: DraftConfig, seed: int = 0) -> Eagle3Draft:
    torch.manual_seed(seed)
    model = Eagle3Draft(cfg)
    with torch.no_grad():
        model.reset_parameters(std=0.3)      # large weights: attention far from uniform
        model.embed_tokens.weight.normal_()
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
        kept = torch.randperm(cfg.vocab_size)[:cfg.draft_vocab_size].sort().values
        model.t2d.zero_()
        model.t2d[kept] = True
        model.d2t.copy_(kept - torch.arange(cfg.draft_vocab_size))
    return model.eval()


# ---- the reference: one token at a time with an explicit KV cache (vLLM's computation)

def ref_rms(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def ref_rope(x, pos, theta):
    d = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d, 2).float() / d)
    ang = pos * inv
    cos, sin = torch.cat([ang, ang]).cos(), torch.cat([ang, ang]).sin()
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    return x * cos + torch.cat([-x2, x1], -1) * sin


def ref_rope_interleaved(x, pos, inv_freq, scale=1.0):
    """DeepSeek's rotary as vLLM applies it (is_neox_style=False): pairs (2i, 2i+1)."""
    ang = pos * inv_freq
    cos, sin = ang.cos() * scale, ang.sin() * scale
    even, odd = x[..., 0::2], x[..., 1::2]
    return torch.stack([even * cos - odd * sin, odd * cos + even * sin], -1).flatten(-2)


class ServingReference:
    """The draft run as vLLM's proposer does: one query at a time, a growing KV cache."""

    def __init__(self, model: Eagle3Draft):
        self.m, self.c = model, model.config
        self.cache: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def mla_qkv(self, x: torch.Tensor, pos: int):
        """deepseek_v2.py's MLA for one token: q, k [h, nope+rope], v [h, v_dim]."""
        c, A = self.c, self.m.midlayer.self_attn
        h, nope, rope = c.num_attention_heads, c.qk_nope_head_dim, c.qk_rope_head_dim
        if c.q_lora_rank:
            q = A.q_b_proj.weight @ ref_rms(A.q_a_proj.weight @ x, A.q_a_layernorm.weight, c.rms_norm_eps)
        else:
            q = A.q_proj.weight @ x
        q = q.view(h, nope + rope)
        inv, scale = self.m.inv_freq, self.m.rope_scale
        q = torch.cat([q[:, :nope], ref_rope_interleaved(q[:, nope:], pos, inv, scale)], -1)
        kv_a = A.kv_a_proj_with_mqa.weight @ x
        latent = ref_rms(kv_a[:c.kv_lora_rank], A.kv_a_layernorm.weight, c.rms_norm_eps)
        k_rope = ref_rope_interleaved(kv_a[c.kv_lora_rank:], pos, inv, scale)
        kv = (A.kv_b_proj.weight @ latent).view(h, nope + c.v_head_dim)
        k = torch.cat([kv[:, :nope], k_rope.expand(h, rope)], -1)
        return q, k, kv[:, nope:]

    def step(self, token: int, hidden: torch.Tensor, pos: int):
        """One query: logits and the hidden state the next step is fed (vLLM's aux output)."""
        m, c, L = self.m, self.c, self.m.midlayer
        e = m.embed_tokens.weight[token]
        normed_hidden = ref_rms(hidden, L.hidden_norm.weight, c.rms_norm_eps)
        residual = normed_hidden if c.norm_before_residual else hidden
        x = torch.cat([ref_rms(e, L.input_layernorm.weight, c.rms_norm_eps), normed_hidden])
        if c.architecture == "mla":
            q, k, v = self.mla_qkv(x, pos)
            self.cache[pos] = (k, v)
            keys = torch.stack([self.cache[p][0] for p in range(pos + 1)])    # [S, h, dq]
            vals = torch.stack([self.cache[p][1] for p in range(pos + 1)])    # [S, h, dv]
            out = [F.softmax(keys[:, i] @ q[i] * m.attention_scale, dim=0) @ vals[:, i]
                   for i in range(c.num_attention_heads)]
            return self.finish(residual, torch.cat(out))
        q = (L.self_attn.q_proj.weight @ x).view(c.num_attention_heads, c.head_dim)
        k = (L.self_attn.k_proj.weight @ x).view(c.num_key_value_heads, c.head_dim)
        v = (L.self_attn.v_proj.weight @ x).view(c.num_key_value_heads, c.head_dim)
        q, k = ref_rope(q, pos, c.rope_theta), ref_rope(k, pos, c.rope_theta)
        self.cache[pos] = (k, v)            # a later write at this position overwrites
        keys = torch.stack([self.cache[p][0] for p in range(pos + 1)])    # [S, kvh, d]
        vals = torch.stack([self.cache[p][1] for p in range(pos + 1)])
        g = c.num_attention_heads // c.num_key_value_heads
        out = []
        for h in range(c.num_attention_heads):
            w = F.softmax(keys[:, h // g] @ q[h] / c.head_dim ** 0.5, dim=0)
            out.append(w @ vals[:, h // g])
        return self.finish(residual, torch.cat(out))

    def finish(self, residual: torch.Tensor, attn_out: torch.Tensor):
        m, c, L = self.m, self.c, self.m.midlayer
        h1 = residual + L.self_attn.o_proj.weight @ attn_out
        n = ref_rms(h1, L.post_attention_layernorm.weight, c.rms_norm_eps)
        mlp = L.mlp.down_proj.weight @ (F.silu(L.mlp.gate_proj.weight @ n) * (L.mlp.up_proj.weight @ n))
        h_out = h1 + mlp
        final = ref_rms(h_out, m.norm.weight, c.rms_norm_eps)
        return m.lm_head.weight @ final, final if c.norm_output else h_out

    def fc(self, aux: torch.Tensor) -> torch.Tensor:
        if self.c.norm_before_fc:
            aux = ref_rms(aux, self.m.input_norm.weight, self.c.rms_norm_eps)
        if self.c.fc_norm:
            aux = torch.cat([ref_rms(chunk, norm.weight, self.c.rms_norm_eps)
                             for chunk, norm in zip(aux.chunk(self.c.num_aux), self.m.fc_norm)])
        return self.m.fc.weight @ aux


def serve_chains(model, aux, ids, num_steps, feed_own: bool):
    """For every row t: prefill positions 0..t (step 0), then draft steps 1..K-1."""
    T = ids.numel()
    logits_out = torch.full((T, num_steps, model.config.draft_vocab_size), float("nan"))
    for t in range(T - 1):
        ref = ServingReference(model)
        for s in range(t + 1):              # verified prefix: target states, token x[s+1]
            logits, hidden = ref.step(int(ids[s + 1]), ref.fc(aux[s]), s)
        logits_out[t, 0] = logits
        for j in range(1, num_steps):
            if feed_own:
                d = int(logits.argmax())
                token = d + int(model.d2t[d])
            elif t + j + 1 < T:
                token = int(ids[t + j + 1])
            else:
                break
            logits, hidden = ref.step(token, hidden, t + j)
            logits_out[t, j] = logits
    return logits_out


MLA = dict(architecture="mla", num_attention_heads=4, num_key_value_heads=4, head_dim=24, q_lora_rank=12,
           kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=16, v_head_dim=10)
ARCHITECTURES = [
    {},
    {"norm_before_fc": True, "norm_output": True},           # the project's default
    {"norm_before_residual": True},
    {"norm_before_fc": True, "norm_before_residual": True, "norm_output": True},
    {"fc_norm": True},
    {**MLA, "norm_output": True},                            # an MLA target's default
    {**MLA, "q_lora_rank": None, "fc_norm": True, "norm_before_residual": True},
    {**MLA, "rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
                             "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}},
]


def flags_id(flags: dict) -> str:
    return "+".join(k if v is True else f"{k}={v}" for k, v in flags.items()
                    if k in ("architecture", "norm_before_fc", "norm_before_residual", "norm_output", "fc_norm",
                             "q_lora_rank", "rope_scaling") and v is not None)[:80] or "paper"


@pytest.mark.parametrize("flags", ARCHITECTURES, ids=flags_id)
def test_forward_ttt_matches_serving_loop(flags):
    cfg = tiny_config(**flags)
    model = random_draft(cfg)
    torch.manual_seed(1)
    lengths = [9, 5, 12]
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist())
    aux = torch.randn(sum(lengths), cfg.num_aux * cfg.target_hidden_size)
    ids = torch.randint(0, cfg.vocab_size, (sum(lengths),))
    K = 4
    with torch.no_grad():
        logits, hiddens = model.forward_ttt(aux, ids, cu, K)
    layout = PackedLayout.from_cu_seqlens(cu)
    checked = 0
    for b, T in enumerate(lengths):
        a = int(cu[b])
        ref = serve_chains(model, aux[a:a + T], ids[a:a + T], K, feed_own=False)
        for j in range(K):
            for t in range(T):
                if t + j + 2 < T:
                    assert layout.valid(j)[a + t]
                    torch.testing.assert_close(logits[j][a + t], ref[t, j], rtol=1e-4, atol=1e-4)
                    checked += 1
                else:
                    assert not layout.valid(j)[a + t]
    assert checked == sum(max(0, T - j - 2) for T in lengths for j in range(K))


@pytest.mark.parametrize("flags", ARCHITECTURES, ids=flags_id)
def test_predict_chains_matches_greedy_serving(flags):
    cfg = tiny_config(**{"num_attention_heads": 2, "num_key_value_heads": 2, "head_dim": 16, "rope_theta": 500.0,
                         **flags})
    model = random_draft(cfg, seed=3)
    torch.manual_seed(2)
    T, K = 10, 3
    aux = torch.randn(T, cfg.num_aux * cfg.target_hidden_size)
    ids = torch.randint(0, cfg.vocab_size, (T,))
    chains = model.predict_chains(aux, ids, K)
    ref = serve_chains(model, aux, ids, K, feed_own=True)
    assert chains.shape == (T, K) and chains.dtype == torch.int64
    for t in range(T - 1):
        for j in range(K):
            d = int(ref[t, j].argmax())
            assert int(chains[t, j]) == d + int(model.d2t[d])
            assert model.t2d[chains[t, j]]


def test_ttt_gradients_flow_through_cache_logsumexp():
    """A loss on step 2 only must reach k/v (cache and tail) and fc; embeddings stay frozen."""
    cfg = tiny_config()
    model = random_draft(cfg).train()
    cu = torch.tensor([0, 7, 16])
    aux = torch.randn(16, cfg.num_aux * cfg.target_hidden_size)
    ids = torch.randint(0, cfg.vocab_size, (16,))
    logits, _ = model.forward_ttt(aux, ids, cu, 3)
    logits[2].sum().backward()
    for name in ("fc.weight", "midlayer.self_attn.k_proj.weight", "midlayer.self_attn.v_proj.weight"):
        assert dict(model.named_parameters())[name].grad.abs().sum() > 0, name
    assert model.embed_tokens.weight.grad is None


def test_config_from_targets():
    llama = {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
             "intermediate_size": 128, "rms_norm_eps": 1e-5, "vocab_size": 512,
             "max_position_embeddings": 512, "rope_parameters": {"rope_type": "default", "rope_theta": 5e5},
             "dtype": "float32"}
    cfg = DraftConfig.from_target_config(llama, [2, 4, 5], 100, {"intermediate_size": 96})
    assert (cfg.head_dim, cfg.rope_theta, cfg.intermediate_size, cfg.torch_dtype) == (16, 5e5, 96, "float32")
    assert (cfg.norm_before_fc, cfg.norm_output, cfg.norm_before_residual) == (True, True, False)
    hf = cfg.to_hf_config()
    assert hf["norm_before_fc"] is True and hf["norm_output"] is True and "norm_before_residual" not in hf
    paper = DraftConfig.from_target_config(llama, [2, 4, 5], 100, {"norm_before_fc": False, "norm_output": False})
    assert not any(k in paper.to_hf_config() for k in ("norm_before_fc", "norm_output"))
    assert hf["architectures"] == ["LlamaForCausalLMEagle3"] and hf["num_hidden_layers"] == 1
    assert hf["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]
    assert hf["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 3, 4]
    assert DraftConfig.from_hf_config(hf) == cfg
    dsv3 = {"model_type": "deepseek_v3", "hidden_size": 7168, "num_attention_heads": 128,
            "num_key_value_heads": 128, "intermediate_size": 18432, "kv_lora_rank": 512,
            "q_lora_rank": 1536, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
            "vocab_size": 129280, "rope_theta": 10000, "max_position_embeddings": 163840,
            "rope_scaling": {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096,
                             "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}}
    # auto: an MLA draft for an MLA target, its dims and rope the target's own
    mla = DraftConfig.from_target_config({"text_config": dsv3}, [2, 30, 58], 32000, {})
    assert (mla.architecture, mla.head_dim, mla.q_lora_rank, mla.kv_lora_rank, mla.v_head_dim) == \
        ("mla", 192, 1536, 512, 128)
    assert mla.rope_scaling == {"rope_type": "yarn", "factor": 40, "original_max_position_embeddings": 4096,
                                "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}
    hf = mla.to_hf_config()
    assert hf["architectures"] == ["Eagle3DeepseekV2ForCausalLM"] and hf["model_type"] == "deepseek_v2"
    assert DraftConfig.from_hf_config(hf) == mla
    assert not mla.norm_before_fc and mla.norm_output, "vLLM's MLA draft has no input_norm"
    # a Llama-style draft when asked: the value head size, YaRN written out for Llama
    cfg = DraftConfig.from_target_config({"text_config": dsv3}, [2, 30, 58], 32000, {"architecture": "llama"})
    assert cfg.architecture == "llama" and cfg.head_dim == 128 and cfg.rope_scaling["rope_type"] == "yarn"
    assert "attention_factor" in cfg.rope_scaling
    with pytest.raises(ValueError, match="needs an MLA target"):
        DraftConfig.from_target_config(llama, [2, 4, 5], 100, {"architecture": "mla"})
    qwen3 = dict(llama, head_dim=128)
    assert DraftConfig.from_target_config(qwen3, [1], 10, {}).head_dim == 128


@pytest.mark.parametrize("scaling", [
    None,
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 256},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256},
])
def test_rope_matches_vllm(scaling):
    """Our cos/sin equal vLLM's get_rope for the draft's rope_parameters (incl. scaled ropes)."""
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.rotary_embedding import get_rope

    from eagle3flow.model.draft import apply_rope

    cfg = tiny_config(rope_theta=50000.0, head_dim=16, rope_scaling=scaling, max_position_embeddings=1024)
    model = Eagle3Draft(cfg)
    with set_current_vllm_config(VllmConfig()):
        rope = get_rope(16, max_position=1024, rope_parameters=cfg.rope_parameters(),
                        is_neox_style=True, dtype=torch.float32)
        pos = torch.arange(0, 1000, 7)
        q, k = torch.randn(len(pos), 4 * 16), torch.randn(len(pos), 2 * 16)
        q_ref, k_ref = rope.forward_native(pos, q.clone(), k.clone())
    cos, sin = model.rope(pos, torch.float32)
    torch.testing.assert_close(apply_rope(q.view(-1, 4, 16), cos, sin).reshape(len(pos), -1), q_ref)
    torch.testing.assert_close(apply_rope(k.view(-1, 2, 16), cos, sin).reshape(len(pos), -1), k_ref)


@pytest.mark.parametrize("scaling", [
    None,
    {"rope_type": "yarn", "factor": 32.0, "original_max_position_embeddings": 128, "beta_fast": 32,
     "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0},
    {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 512, "beta_fast": 32,
     "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 1.0},
])
def test_mla_rope_and_softmax_scale_match_vllm(scaling):
    """An MLA draft rotates and scales its scores as vLLM's DeepseekV2MLAAttention does:
    get_rope(qk_rope_head_dim, is_neox_style=False) on the target's rope (DeepSeek YaRN), and
    scaling = (qk_nope + qk_rope)^-0.5 * yarn_get_mscale(factor, mscale_all_dim)^2."""
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.rotary_embedding import get_rope
    from vllm.model_executor.models.deepseek_v2 import yarn_get_mscale

    from eagle3flow.model.draft import apply_rope_interleaved

    cfg = tiny_config(**{**MLA, "rope_theta": 10000.0, "rope_scaling": scaling, "max_position_embeddings": 4096})
    model = Eagle3Draft(cfg)
    params = cfg.rope_parameters()
    if scaling:      # what deepseek_v2.py does to the config's rope before get_rope
        params["rope_type"] = "deepseek_yarn"
    with set_current_vllm_config(VllmConfig()):
        rope = get_rope(cfg.qk_rope_head_dim, max_position=4096, rope_parameters=params,
                        is_neox_style=False, dtype=torch.float32)
        pos = torch.arange(0, 4000, 13)
        # [tokens, heads, rope dims], as deepseek_v2.py passes q_pe and k_pe
        q, k = torch.randn(len(pos), 3, 16), torch.randn(len(pos), 1, 16)
        q_ref, k_ref = rope.forward_native(pos, q.clone(), k.clone())
    cos, sin = model.rope(pos, torch.float32)
    torch.testing.assert_close(apply_rope_interleaved(q, cos, sin), q_ref.view_as(q), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(apply_rope_interleaved(k, cos, sin), k_ref.view_as(k), rtol=1e-5, atol=1e-5)
    expected = (8 + 16) ** -0.5
    if scaling:
        expected *= yarn_get_mscale(scaling["factor"], scaling["mscale_all_dim"]) ** 2
    assert model.attention_scale == pytest.approx(expected)


@pytest.mark.parametrize("flags", [ARCHITECTURES[1], ARCHITECTURES[5]], ids=flags_id)
def test_compiled_step_parts_match_eager(flags):
    """torch.compile of each architecture's step pieces (the CUDA default) computes the same
    logits and gradients as the eager functions (MLA's pre-attention included)."""
    cfg = tiny_config(**flags)
    cu = torch.tensor([0, 7, 16])
    torch.manual_seed(4)
    aux = torch.randn(16, cfg.num_aux * cfg.target_hidden_size)
    ids = torch.randint(0, cfg.vocab_size, (16,))
    results = []
    for compiled in (False, True):
        model = random_draft(cfg).train()
        model.compile_steps = compiled
        logits, _ = model.forward_ttt(aux, ids, cu, 3)
        torch.stack(logits).square().mean().backward()
        results.append((torch.stack(logits).detach(),
                        {n: p.grad for n, p in model.named_parameters() if p.grad is not None}))
    (eager, eager_grads), (comp, comp_grads) = results
    torch.testing.assert_close(comp, eager, rtol=1e-4, atol=1e-5)
    assert eager_grads.keys() == comp_grads.keys() and len(eager_grads) > 5
    for name, grad in eager_grads.items():
        torch.testing.assert_close(comp_grads[name], grad, rtol=1e-4, atol=1e-5, msg=name)
