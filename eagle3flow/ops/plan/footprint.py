"""What the run's artifacts weigh: bytes per token of hidden states, the draft's
trainable parameters and checkpoint bytes, the target's parameters. Computed from the
target's config dict and the workflow config, without torch (the formulas mirror
eagle3flow/extract/shards.py and eagle3flow/model/{config,draft}.py; tests/test_plan.py checks
them against the real draft)."""
from __future__ import annotations

DTYPE_BYTES = {"float32": 4, "fp32": 4, "bfloat16": 2, "bf16": 2, "float16": 2, "fp16": 2,
               "float8_e4m3fn": 1, "fp8": 1}
# fp8 shards keep one float32 scale per token and layer (eagle3flow/extract/shards.py).
FP8_SCALE_BYTES = 4
# Per token besides the hidden states: int32 input_ids + uint8 loss_mask.
TOKEN_OVERHEAD_BYTES = 5
# Checkpoint bytes per trainable parameter: the fp32 weight plus AdamW's exp_avg and
# exp_avg_sq, or plus Muon's one momentum buffer.
CHECKPOINT_BYTES_PER_PARAM = 12
MUON_CHECKPOINT_BYTES_PER_PARAM = 8


def aux_layer_count(config: dict, target: dict) -> int:
    ids = config["extract"].get("aux_layer_ids")
    return len(ids) if ids else 3


def storage_dtype(config: dict) -> str:
    """The dtype shards are written in: extract.storage_dtype (fp8) when set, else
    extract.dtype (auto = float32 on CPU, bfloat16 on GPU)."""
    ext = config["extract"]
    chosen = ext.get("storage_dtype") or "auto"
    if chosen in ("fp8", "float8_e4m3fn"):
        return "float8_e4m3fn"
    chosen = ext.get("dtype", "auto")
    if chosen == "auto":
        return "bfloat16" if uses_gpu(config, ext.get("device", "auto")) else "float32"
    return chosen


def uses_gpu(config: dict, device: str) -> bool:
    if device == "auto":
        return config["resources"]["gpus"] > 0
    return device.startswith("cuda")


def hidden_state_bytes_per_token(aux: int, hidden: int, dtype: str) -> int:
    """Bytes one token takes in a shard: ``(A+1) x H`` hidden values (+ a scale per layer in
    fp8) + input_ids + loss_mask; the same as eagle3flow.extract.shards.bytes_per_token, without torch."""
    scales = FP8_SCALE_BYTES if DTYPE_BYTES[dtype] == 1 else 0
    return (aux + 1) * (hidden * DTYPE_BYTES[dtype] + scales) + TOKEN_OVERHEAD_BYTES


def draft_shape(target: dict, overrides: dict) -> dict:
    """The draft's dimensions as DraftConfig.from_target_config derives them (eagle3flow/model/config.py)."""
    hidden = int(target["hidden_size"])
    heads = int(target["num_attention_heads"])
    is_mla = "kv_lora_rank" in target or str(target.get("model_type", "")).startswith("deepseek")
    shape = {"hidden_size": hidden, "num_attention_heads": heads,
             "num_key_value_heads": int(target.get("num_key_value_heads") or heads),
             "head_dim": hidden // heads if is_mla else int(target.get("head_dim") or hidden // heads),
             "intermediate_size": int(target["intermediate_size"])}
    shape.update({k: v for k, v in (overrides or {}).items() if k in shape})
    return shape


def draft_trainable_params(target: dict, aux: int, draft_vocab: int, overrides: dict) -> int:
    """Trainable parameters of the EAGLE-3 draft (Eagle3Draft minus the frozen embeddings)."""
    return sum(draft_param_counts(target, aux, draft_vocab, overrides).values())


def draft_param_counts(target: dict, aux: int, draft_vocab: int, overrides: dict) -> dict:
    """The draft's trainable parameters as the optimizers split them (optim.uses_muon):
    ``matrices``: fc ``[H, A*Ht]`` and the decoder layer's projections (its attention reads
    ``2H``); ``rest``: lm_head ``[Vd, H]``, four RMSNorms ``[H]`` and the aux states'
    RMSNorm ``[A*Ht]`` where the draft has one."""
    d = draft_shape(target, overrides)
    h, hd = d["hidden_size"], d["head_dim"]
    q, kv = d["num_attention_heads"] * hd, d["num_key_value_heads"] * hd
    attention = 2 * h * q + 2 * (2 * h * kv) + q * h
    mlp = 3 * h * d["intermediate_size"]
    aux_width = aux * int(target["hidden_size"])
    overrides = overrides or {}
    architecture = overrides.get("architecture", "auto")
    is_mla_draft = architecture == "mla" or (architecture == "auto" and "kv_lora_rank" in target)
    # model.config.DEFAULT_FLAGS: a Llama draft has norm_before_fc, an MLA draft has not
    aux_norms = aux_width * (int(bool(overrides.get("norm_before_fc", not is_mla_draft)))
                             + int(bool(overrides.get("fc_norm", False))))
    return {"matrices": aux_width * h + attention + mlp, "rest": aux_norms + 4 * h + h * draft_vocab}


def draft_checkpoint_bytes(counts: dict, optimizer: str) -> int:
    """A training checkpoint: fp32 weights and the optimizer state, i.e. two AdamW
    moments, or Muon's one momentum for the matrices it steps (optim.build_optimizers)."""
    if optimizer == "muon":
        return counts["matrices"] * MUON_CHECKPOINT_BYTES_PER_PARAM + counts["rest"] * CHECKPOINT_BYTES_PER_PARAM
    return sum(counts.values()) * CHECKPOINT_BYTES_PER_PARAM


def target_params(target: dict) -> tuple[int, int]:
    """(total, active per token) parameters of a Llama/Qwen/DeepSeek-style target, roughly."""
    h, layers, vocab = int(target["hidden_size"]), int(target["num_hidden_layers"]), int(target["vocab_size"])
    heads = int(target["num_attention_heads"])
    hd = int(target.get("head_dim") or h // heads)
    kv = int(target.get("num_key_value_heads") or heads)
    attention = h * heads * hd * 2 + 2 * h * kv * hd
    dense_mlp = 3 * h * int(target["intermediate_size"])
    experts = int(target.get("n_routed_experts") or target.get("num_experts") or 0)
    if experts:
        moe_i = int(target.get("moe_intermediate_size") or target["intermediate_size"])
        shared = int(target.get("n_shared_experts") or 0)
        per_tok = int(target.get("num_experts_per_tok") or 1)
        mlp_total, mlp_active = 3 * h * moe_i * (experts + shared), 3 * h * moe_i * (per_tok + shared)
    else:
        mlp_total = mlp_active = dense_mlp
    embed = vocab * h * (1 if target.get("tie_word_embeddings") else 2)
    return embed + layers * (attention + mlp_total), embed + layers * (attention + mlp_active)


