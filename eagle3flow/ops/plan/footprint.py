"""What the run's artifacts weigh: bytes per token of hidden states, the draft's
trainable parameters and checkpoint bytes, the target's parameters. Computed from the
target's config dict and the workflow config, without torch (the draft's shape is the
DraftConfig training builds; the shard formula mirrors eagle3flow/extract/shards.py;
tests/test_plan.py checks both against the real artifacts)."""
from __future__ import annotations

from eagle3flow.layers import default_layer_ids
from eagle3flow.model.config import DraftConfig

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


def aux_layer_ids(config: dict, target: dict) -> list[int]:
    """extract.aux_layer_ids, or the default ids of the draft kind for the target's depth."""
    return config["extract"].get("aux_layer_ids") or default_layer_ids(
        int(target["num_hidden_layers"]), config["train"]["method"], config["dflash"]["num_hidden_layers"])


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


def draft_config(target: dict, aux_layer_ids: list[int], draft_vocab: int, overrides: dict) -> DraftConfig:
    """The DraftConfig training builds for this target (eagle3flow/model/config.py)."""
    return DraftConfig.from_target_config(target, aux_layer_ids, draft_vocab, overrides or {})


def draft_param_counts(target: dict, aux_layer_ids: list[int], draft_vocab: int, overrides: dict) -> dict:
    """The draft's trainable parameters, ``matrices`` and ``rest``."""
    return draft_config(target, aux_layer_ids, draft_vocab, overrides).trainable_param_counts()


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


