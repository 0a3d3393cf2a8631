"""Training on production-shaped targets: a DeepSeek-V3 (MLA) target laid out as Kimi-K2.5
ships it (config nested under text_config, prefixed weights, many shards), INT4
compressed-tensors checkpoints, and draft configs derived for Llama, Qwen3 and Kimi."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from eagle3flow.model.config import DraftConfig
from eagle3flow.model.draft import rope_inv_freq
from eagle3flow.extract.hf import extract
from eagle3flow.target.weights import load_target_head
from eagle3flow.train.trainer import train
from support.builders import make_vocab_map, write_dataset
from support.tiny_targets import make_tiny_deepseek_v3

HEAD_TENSORS = ("language_model.model.embed_tokens.weight", "language_model.model.norm.weight",
                "language_model.lm_head.weight")


def test_deepseek_v3_nested_sharded_target_trains_end_to_end(tmp_path):
    plain = make_tiny_deepseek_v3(tmp_path / "plain", seed=0)
    nested = make_tiny_deepseek_v3(tmp_path / "nested", seed=0, nest_text_config=True, max_shard_size="100KB")
    index = json.loads((nested / "model.safetensors.index.json").read_text())["weight_map"]
    files = set(index.values())
    head_files = {index[name] for name in HEAD_TENSORS}
    assert len(files) >= 10 and len(head_files) < len(files)
    # Training must never open the other shards (a real Kimi-K2.5 has 64 of ~10 GB):
    # overwrite them with garbage of the same size.
    for name in files - head_files:
        size = (nested / name).stat().st_size
        (nested / name).write_bytes(b"\0" * size)

    # Hidden states by the HF extraction, from the same weights in the plain layout.
    vocab = json.loads((plain / "config.json").read_text())["vocab_size"]
    data = write_dataset(tmp_path / "train.parquet", 12, seed=0, min_len=16, vocab=vocab)
    manifest = tmp_path / "hs" / "manifest.json"
    extract(data, plain, manifest, tmp_path / "hs_cache", dtype="float32", device="cpu", shard_tokens=150)
    vmap = make_vocab_map(manifest, vocab, 256, tmp_path / "vocab_map.safetensors")

    config = {"ttt_steps": 2, "epochs": 4, "batch_tokens": 128, "lr": 5e-3, "warmup_ratio": 0.1,
              "log_every": 1, "checkpoint_every": 100, "device": "cpu"}
    result = train(manifest, manifest, vmap, nested, tmp_path / "out", tmp_path / "cache", config)
    draft = json.loads((tmp_path / "out" / "draft_config.json").read_text())
    # MLA target -> an MLA draft (architecture auto) with the target's MLA dims
    assert (draft["architecture"], draft["head_dim"], draft["num_attention_heads"], draft["q_lora_rank"],
            draft["kv_lora_rank"], draft["qk_rope_head_dim"], draft["v_head_dim"]) == ("mla", 96, 2, 32, 512, 64, 32)
    assert draft["hidden_size"] == 64 and draft["intermediate_size"] == 128
    assert draft["aux_layer_ids"] == [2, 4, 5]
    rows = [json.loads(l) for l in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["loss"] < rows[0]["loss"] and result["steps"] == len(rows)
    assert set(result["simulated_acceptance_length"]) == {"1", "2"}
    # the draft's norm is the target's final norm, read by its prefixed name
    weights = load_target_head(plain, parts=("norm",))
    nested_head = load_target_head(nested)
    assert torch.equal(nested_head["norm"], weights["norm"])


def write_int4_checkpoint(path: Path, quantize_lm_head: bool = False) -> Path:
    """A compressed-tensors INT4 checkpoint as Kimi-K2.5's: packed experts, bf16 head, 3 shards."""
    path.mkdir()
    vocab, hidden = 96, 32
    g = torch.Generator().manual_seed(0)
    bf16 = lambda *shape: torch.randn(*shape, generator=g).to(torch.bfloat16)   # noqa: E731
    shards = {
        "model-00001-of-00003.safetensors": {"model.embed_tokens.weight": bf16(vocab, hidden)},
        "model-00002-of-00003.safetensors": {
            "model.layers.0.mlp.experts.0.down_proj.weight_packed": torch.zeros(hidden, 8, dtype=torch.int32),
            "model.layers.0.mlp.experts.0.down_proj.weight_scale": bf16(hidden, 2),
            "model.layers.0.mlp.experts.0.down_proj.weight_shape": torch.tensor([hidden, 64])},
        "model-00003-of-00003.safetensors": {"model.norm.weight": bf16(hidden)},
    }
    if quantize_lm_head:
        shards["model-00003-of-00003.safetensors"]["lm_head.weight_packed"] = torch.zeros(vocab, 4, dtype=torch.int32)
    else:
        shards["model-00003-of-00003.safetensors"]["lm_head.weight"] = bf16(vocab, hidden)
    weight_map = {}
    for file, tensors in shards.items():
        save_file(tensors, str(path / file))
        weight_map.update({name: file for name in tensors})
    (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    (path / "config.json").write_text(json.dumps({
        "model_type": "deepseek_v3", "hidden_size": hidden, "vocab_size": vocab, "torch_dtype": "bfloat16",
        "quantization_config": {"quant_method": "compressed-tensors", "format": "pack-quantized",
                                "ignore": ["lm_head"], "config_groups": {"group_0": {
                                    "weights": {"num_bits": 4, "type": "int", "group_size": 32}}}}}))
    return path


def test_int4_compressed_tensors_head_is_read_by_name(tmp_path):
    head = load_target_head(write_int4_checkpoint(tmp_path / "int4"))
    assert {k: (v.dtype, tuple(v.shape)) for k, v in head.items()} == {
        "embed_tokens": (torch.bfloat16, (96, 32)), "norm": (torch.bfloat16, (32,)),
        "lm_head": (torch.bfloat16, (96, 32))}
    with pytest.raises(ValueError, match="lm_head.weight_packed is quantized"):
        load_target_head(write_int4_checkpoint(tmp_path / "int4_head", quantize_lm_head=True))


LLAMA_31_8B = {"model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336,
               "num_attention_heads": 32, "num_key_value_heads": 8, "max_position_embeddings": 131072,
               "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "vocab_size": 128256,
               "rope_scaling": {"factor": 8.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                                "original_max_position_embeddings": 8192, "rope_type": "llama3"}}
QWEN3_8B = {"model_type": "qwen3", "hidden_size": 4096, "intermediate_size": 12288, "head_dim": 128,
            "num_attention_heads": 32, "num_key_value_heads": 8, "max_position_embeddings": 40960,
            "rms_norm_eps": 1e-6, "rope_theta": 1000000, "rope_scaling": None, "vocab_size": 151936}
KIMI_K25 = {"architectures": ["KimiK25ForConditionalGeneration"], "model_type": "kimi_k25", "text_config": {
    "model_type": "kimi_k2", "hidden_size": 7168, "intermediate_size": 18432, "moe_intermediate_size": 2048,
    "num_attention_heads": 64, "num_key_value_heads": 64, "kv_lora_rank": 512, "q_lora_rank": 1536,
    "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128, "max_position_embeddings": 262144,
    "rms_norm_eps": 1e-5, "rope_theta": 50000.0, "vocab_size": 163840,
    "rope_scaling": {"type": "yarn", "factor": 64.0, "original_max_position_embeddings": 4096,
                     "beta_fast": 1.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}}}


def test_draft_config_for_llama_qwen3_and_kimi():
    llama = DraftConfig.from_target_config(LLAMA_31_8B, [2, 16, 29], 32000)
    assert (llama.num_attention_heads, llama.num_key_value_heads, llama.head_dim) == (32, 8, 128)
    assert llama.rope_scaling["rope_type"] == "llama3" and llama.rope_theta == 500000.0
    qwen = DraftConfig.from_target_config(QWEN3_8B, [2, 18, 33], 32000)
    assert (qwen.head_dim, qwen.intermediate_size, qwen.rope_scaling) == (128, 12288, None)
    mla = DraftConfig.from_target_config(KIMI_K25, [2, 30, 58], 32000)
    assert (mla.architecture, mla.head_dim, mla.q_lora_rank, mla.kv_lora_rank, mla.v_head_dim,
            mla.intermediate_size) == ("mla", 192, 1536, 512, 128, 18432)
    assert mla.rope_scaling["mscale_all_dim"] == 1.0 and "attention_factor" not in mla.rope_scaling
    # the Llama-style draft of the published Kimi-K2 drafts, when asked for
    kimi = DraftConfig.from_target_config(KIMI_K25, [2, 30, 58], 32000, {"architecture": "llama"})
    assert (kimi.hidden_size, kimi.num_attention_heads, kimi.num_key_value_heads, kimi.head_dim,
            kimi.intermediate_size, kimi.vocab_size) == (7168, 64, 64, 128, 18432, 163840)
    # YaRN as vLLM's llama_eagle3 reads it: explicit cos/sin scale (mscale / mscale_all_dim = 1)
    assert kimi.rope_scaling == {"rope_type": "yarn", "factor": 64.0, "original_max_position_embeddings": 4096,
                                 "attention_factor": 1.0, "beta_fast": 1.0, "beta_slow": 1.0}
    hf = kimi.to_hf_config()
    assert hf["rope_parameters"]["rope_theta"] == 50000.0 and hf["rope_parameters"]["rope_type"] == "yarn"
    inv, scale = rope_inv_freq(kimi)
    assert scale == 1.0 and inv.shape == (64,) and inv[-1] < 1.0 / (50000.0 ** (126 / 128))  # interpolated
    # without mscale keys, yarn's default magnitude scale 0.1 ln(factor) + 1
    plain_yarn = {**KIMI_K25["text_config"], "rope_scaling": {"type": "yarn", "factor": 4.0,
                                                              "original_max_position_embeddings": 4096}}
    assert DraftConfig.from_target_config(plain_yarn, [1], 10, {"architecture": "llama"}).rope_scaling[
        "attention_factor"] == pytest.approx(1.1386294)
    # train.draft overrides any field but the hidden size
    small = DraftConfig.from_target_config(KIMI_K25, [2, 30, 58], 32000,
                                           {"architecture": "llama", "intermediate_size": 8192,
                                            "num_key_value_heads": 8})
    assert (small.intermediate_size, small.num_key_value_heads) == (8192, 8)
    with pytest.raises(ValueError, match="not a draft config field"):
        DraftConfig.from_target_config(KIMI_K25, [2], 32000, {"num_layers": 2})
