"""Tiny random-weight targets of production architectures, made offline in seconds
(test support; benchmarks/mla_vs_llama.py builds its target with it too).

:func:`make_tiny_deepseek_v3` writes a ``DeepseekV3ForCausalLM`` HF directory: the
architecture of DeepSeek-V3 / Kimi-K2 (MLA attention, MoE with shared experts and
grouped routing) at toy size, with the embedded target's tokenizer (its chat
template and special tokens, see eagle3flow/embedded/tokenizer.py) so it plugs into
the same dataset/vocab stages. Used by tests of both extraction backends (HF and
vLLM) and of training on sharded / nested checkpoints.

Shape choices:
  * ``kv_lora_rank`` 512 and ``qk_rope_head_dim`` 64: the MLA dims vLLM's CPU backend
    supports (its MLA kernel is written for DeepSeek's real dims).
  * ``first_k_dense_replace`` 1: layer 0 is a dense MLP, the others are MoE layers.
  * 8 layers by default, so EAGLE-3's default aux ids ``[2, N//2, N-3]`` are distinct.

Layouts (composable options):
  * ``nest_text_config=True``: config.json as Kimi-K2.5 ships it, the language model's
    config under ``text_config`` (outer ``KimiK25ForConditionalGeneration``) and every
    weight prefixed ``language_model.``. Neither HF ``AutoModelForCausalLM`` nor vLLM
    loads that layout without the vision tower; it is for code that reads config and
    weights by name (training's target head, config checks).
  * ``max_shard_size``: a sharded checkpoint (``model-0000k-of-0000n.safetensors`` +
    ``model.safetensors.index.json``), e.g. ``"200KB"``.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

from eagle3flow.embedded.tokenizer import save_tokenizer, train_tokenizer

# A few chat turns to fit the byte-level BPE on: the tokenizer keeps every byte, so
# any text stays encodable; a small corpus only means fewer merges.
_TOKENIZER_TEXTS = (
    ("What does math.sqrt return?", "The square root of x, as a float."),
    ("How do I sort a list in place?", "Call list.sort(); sorted() returns a new list."),
    ("What is a dict comprehension?", "An expression like {k: v for k, v in pairs}."),
    ("Explain os.path.join.", "It joins path components with the right separator."),
)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def tiny_tokenizer(vocab_size: int = 4096):
    """The embedded target's tokenizer class and chat template, fit on a few turns (~0.1 s)."""
    conversations = [{"messages": [{"role": "user", "content": q},
                                   {"role": "assistant", "content": a}]}
                     for q, a in _TOKENIZER_TEXTS]
    return train_tokenizer(conversations, vocab_size)


def make_tiny_llama(out_dir: str | Path, seed: int = 0) -> Path:
    """A random ``LlamaForCausalLM`` of the embedded target's shape (eagle3flow/embedded/build.py,
    ``TargetShape``) with its tokenizer class: the embedded target without its training."""
    import torch
    from transformers import LlamaForCausalLM

    from eagle3flow.embedded.build import TargetShape, build_config

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = tiny_tokenizer(TargetShape.vocab_size)
    save_tokenizer(tokenizer, out_dir)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(build_config(TargetShape(), tokenizer)).to(torch.float32).eval()
    model.save_pretrained(out_dir)
    return out_dir


def deepseek_v3_config(vocab_size: int, num_layers: int = 8, hidden_size: int = 64,
                       num_heads: int = 2, num_experts: int = 4, experts_per_token: int = 2,
                       bos_token_id: int = 0, eos_token_id: int = 1, pad_token_id: int | None = None,
                       dtype: str = "float32"):
    """A ``DeepseekV3Config`` at toy size with vLLM-CPU-compatible MLA dims."""
    from transformers import DeepseekV3Config

    config = DeepseekV3Config(
        vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=2 * hidden_size,
        moe_intermediate_size=hidden_size // 2, num_hidden_layers=num_layers,
        num_attention_heads=num_heads, num_key_value_heads=num_heads,
        n_shared_experts=1, n_routed_experts=num_experts, num_experts_per_tok=experts_per_token,
        n_group=1, topk_group=1, routed_scaling_factor=2.5, norm_topk_prob=True,
        first_k_dense_replace=1,
        # MLA: the compressed KV (512) and the decoupled RoPE part (64) at DeepSeek's sizes,
        # the rest small. q_lora_rank as in V3 (a low-rank query path), scaled down.
        kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=32, v_head_dim=32,
        q_lora_rank=32, max_position_embeddings=2048, rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        tie_word_embeddings=False, bos_token_id=bos_token_id, eos_token_id=eos_token_id,
        pad_token_id=pad_token_id, dtype=dtype)
    # What DeepSeek-V3's config.json says and HF's modeling does (sigmoid scores, a
    # learned bias for expert choice); vLLM reads these keys to build the same router.
    config.topk_method, config.scoring_func = "noaux_tc", "sigmoid"
    return config


def make_tiny_deepseek_v3(out_dir: str | Path, seed: int = 0, num_layers: int = 8,
                          hidden_size: int = 64, num_experts: int = 4,
                          dtype: str = "float32", nest_text_config: bool = False,
                          max_shard_size: str | int | None = None,
                          tokenizer_from: str | Path | None = None) -> Path:
    """Write a random ``DeepseekV3ForCausalLM`` HF directory to ``out_dir``; return it.

    ``seed`` fixes the weights. ``dtype`` is the stored dtype (``float32`` so HF and
    vLLM on the CPU agree to float rounding; ``bfloat16`` as real checkpoints ship).
    ``tokenizer_from`` copies the tokenizer of an existing target (e.g. the embedded
    one, ``results/embedded/target``) instead of fitting one; the model's vocab is 4096
    (the embedded target's) or that tokenizer's size, whichever is larger.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    if tokenizer_from is not None:
        from transformers import AutoTokenizer
        for name in TOKENIZER_FILES:
            if (Path(tokenizer_from) / name).is_file():
                shutil.copy(Path(tokenizer_from) / name, out_dir / name)
        tokenizer = AutoTokenizer.from_pretrained(out_dir)
    else:
        tokenizer = tiny_tokenizer()
        save_tokenizer(tokenizer, out_dir)
    config = deepseek_v3_config(
        max(4096, len(tokenizer)), num_layers=num_layers, hidden_size=hidden_size,
        num_experts=num_experts, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, dtype=dtype)
    save_deepseek_v3(out_dir, config, seed, max_shard_size)
    if nest_text_config:
        _nest_as_multimodal(out_dir)
    return out_dir


def save_deepseek_v3(out_dir: Path, config, seed: int, max_shard_size: str | int | None = None) -> None:
    """Random ``DeepseekV3ForCausalLM`` weights of ``config`` (its dtype), saved with its
    config.json by ``save_pretrained`` (one file per expert projection, as checkpoints ship)."""
    import torch
    from transformers import DeepseekV3ForCausalLM

    torch.manual_seed(seed)
    model = DeepseekV3ForCausalLM(config).to(config.dtype).eval()
    with torch.no_grad():
        # HF initializes the router's bias correction to zero and its weight like any
        # linear: give every expert a real chance to be picked, so MoE routing matters.
        for module in model.modules():
            if hasattr(module, "e_score_correction_bias"):
                module.e_score_correction_bias.normal_(0.0, 0.01)
    save_kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    model.save_pretrained(out_dir, **save_kwargs)


def _nest_as_multimodal(out_dir: Path) -> None:
    """Rewrite a saved causal LM as Kimi-K2.5 lays it out: nested config, prefixed weights."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    config_file = out_dir / "config.json"
    text = json.loads(config_file.read_text())
    outer = {"architectures": ["KimiK25ForConditionalGeneration"], "model_type": "kimi_k25",
             "text_config": text, "dtype": text.get("dtype"),
             "tie_word_embeddings": text.get("tie_word_embeddings", False)}
    config_file.write_text(json.dumps(outer, indent=2) + "\n")

    prefix = "language_model."
    for file in sorted(out_dir.glob("*.safetensors")):
        with safe_open(str(file), "pt") as f:
            metadata = f.metadata()
            tensors = {prefix + name: f.get_tensor(name) for name in f.keys()}
        save_file(tensors, str(file), metadata=metadata)
    index_file = out_dir / "model.safetensors.index.json"
    if index_file.is_file():
        index = json.loads(index_file.read_text())
        index["weight_map"] = {prefix + k: v for k, v in index["weight_map"].items()}
        index_file.write_text(json.dumps(index, indent=2) + "\n")
