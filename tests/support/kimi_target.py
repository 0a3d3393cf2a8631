"""A Kimi-K2.5 target at toy size, laid out as moonshotai/Kimi-K2.5 ships, made offline in seconds.

:func:`make_kimi_k25_target` writes the files the real checkpoint has (names, schema,
tensor names and dtypes as in its config.json and weight index):

  config.json                  ``KimiK25ForConditionalGeneration`` / ``kimi_k25``; the
                               language model (DeepSeek-V3: MLA + MoE, YaRN RoPE) under
                               ``text_config`` (``model_type`` ``kimi_k2``), a 1-block MoonViT
                               under ``vision_config``, ``auto_map`` as the hub has it (the
                               fixture ships no modeling_kimi_k25.py: no HF model class loads it)
  configuration_kimi_k25.py    remote config code (tests/fixtures/kimi_k25/)
  tiktoken.model               a tiktoken BPE ranks file fit on a few chat turns
  tokenization_kimi.py         remote tokenizer code: a slow tiktoken tokenizer
  tokenizer_config.json        Kimi's 256 special tokens after the ranks, ``auto_map``
                               ``{"AutoTokenizer": ["tokenization_kimi.TikTokenTokenizer", null]}``
  chat_template.jinja          Kimi's chat format; assistant turns keep ``<think>...</think>``
  preprocessor_config.json     ``media_proc_cfg`` for vLLM's Kimi-K2.5 image processor
  model-0000k-of-0000n.safetensors + model.safetensors.index.json
                               ``language_model.model.*`` / ``language_model.lm_head.weight``,
                               ``vision_tower.*``, ``mm_projector.*``; the head, the projector
                               and the tower in shards of their own, as there

Toy sizes: MLA ``kv_lora_rank`` 512 and ``qk_rope_head_dim`` 64 (the dims vLLM's CPU MLA
kernel supports), the rest small (tests/support/tiny_targets.py ``deepseek_v3_config``).
The 256 special tokens follow the BPE ranks as the real ones follow its 163,584: ``[BOS]``,
``[EOS]``, ``<|media_pad|>`` and ``[PAD]`` at the offsets of the real config.json's ids
(+0, +1, +21, +255), the others in Kimi-K2's order. The ranks are fit with a byte-level
split, not Kimi's, so some tokens span Kimi's split points: a tokenizer that does not
split as Kimi's does (transformers' own tiktoken conversion) gives other ids here.

Experts: ``int4_experts=True`` stores the routed experts as the real one does,
compressed-tensors pack-quantized INT4 W4A16 (``weight_packed`` int32, ``weight_scale``
bf16 per group of 32, ``weight_shape``), and its ``quantization_config`` (outer and in
``text_config``, with the real ``ignore`` list: lm_head, attention, shared experts, the
dense MLP; the tower needs none, vLLM drops compressed-tensors for it). vLLM 0.32's CPU
build has INT4 MoE kernels only for x86 with AMX (or zentorch); elsewhere it refuses
them: "NotImplementedError: No WNA16 MoE backend supports the deployment
configuration." So ``int4_experts=False`` (default) stores them dense in the model
dtype, without a quantization_config, which the CPU build runs.

The vision side is random and never run (the tests send text): the wrapper must only
build and load it. Its sizes are in ``vision_config`` twice: as the hub's remote code
reads them (``vt_*``) and as transformers' ``Kimi_K25Config`` does, which vLLM uses
whatever ``trust_remote_code`` says; the real tower's sizes are that class's defaults, a
toy tower's are not. ``image_token_id`` likewise (the real one is the class default).
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

from support.tiny_targets import deepseek_v3_config, save_deepseek_v3

FIXTURE_FILES = Path(__file__).resolve().parent.parent / "fixtures" / "kimi_k25"
REMOTE_CODE = ("tokenization_kimi.py", "configuration_kimi_k25.py", "chat_template.jinja")
AUTO_MAP = {"AutoConfig": "configuration_kimi_k25.KimiK25Config",
            "AutoModel": "modeling_kimi_k25.KimiK25ForConditionalGeneration",
            "AutoModelForCausalLM": "modeling_kimi_k25.KimiK25ForConditionalGeneration"}
TOKENIZER_AUTO_MAP = {"AutoTokenizer": ["tokenization_kimi.TikTokenTokenizer", None]}

# Kimi's special tokens by offset from the first id after the BPE ranks (the others are
# <|reserved_token_{id}|>). The chat template uses these; vLLM's Kimi-K2.5 processor
# looks up <|media_pad|>.
SPECIAL_TOKENS = {0: "[BOS]", 1: "[EOS]", 2: "<|im_end|>", 3: "<|im_user|>", 4: "<|im_assistant|>",
                  6: "<|start_header_id|>", 7: "<|end_header_id|>", 9: "[EOT]", 10: "<|im_system|>",
                  11: "<|tool_calls_section_begin|>", 12: "<|tool_calls_section_end|>",
                  13: "<|tool_call_begin|>", 14: "<|tool_call_argument_begin|>", 15: "<|tool_call_end|>",
                  17: "<|im_middle|>", 18: "<|media_begin|>", 19: "<|media_content|>", 20: "<|media_end|>",
                  21: "<|media_pad|>", 22: "<think>", 23: "</think>", 254: "[UNK]", 255: "[PAD]"}
NUM_SPECIAL = 256
ADDITIONAL_SPECIAL = ["<|im_end|>", "<|im_user|>", "<|im_assistant|>", "<|start_header_id|>",
                      "<|end_header_id|>", "[EOT]", "<|im_system|>", "<|im_middle|>"]

# Text the BPE ranks are fit on: English, code identifiers and Chinese, so both of
# Kimi's split rules (camelCase, Han runs) meet merges.
BPE_TEXTS = [
    "What is the capital of France? Paris is the capital of France.",
    "Let me think about it step by step before I answer the question.",
    "def getValue(self): return self.currentValue  # getValue returns currentValue",
    "The quick brown fox jumps over the lazy dog; the dog sleeps.",
    "你好，世界。今天天气很好。我们一起学习中文吧。",
    "Say exactly: hello world. hello world!",
]

# compressed-tensors' description of Kimi-K2.5's INT4 experts (its config.json).
INT4_GROUP_SIZE = 32
QUANTIZATION_CONFIG = {
    "quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
    "kv_cache_scheme": None,
    "config_groups": {"group_0": {
        "targets": ["Linear"], "input_activations": None, "output_activations": None,
        "weights": {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group",
                    "group_size": INT4_GROUP_SIZE, "dynamic": False, "actorder": None,
                    "block_structure": None, "observer": "minmax", "observer_kwargs": {}}}},
    "ignore": ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*",
               r"re:.*mlp\.(gate|up|gate_up|down)_proj.*"],
}

VISION = {"patch_size": 14, "hidden_size": 64, "num_attention_heads": 2, "num_hidden_layers": 1,
          "intermediate_size": 128, "pos_emb": 8, "pos_emb_time": 4, "merge": 2}


def make_kimi_k25_target(out_dir: str | Path, seed: int = 0, num_layers: int = 8,
                         hidden_size: int = 64, num_experts: int = 4, dtype: str = "bfloat16",
                         int4_experts: bool = False, max_shard_size: int = 200_000) -> Path:
    """Write the Kimi-K2.5-layout target to ``out_dir`` and return it.

    ``seed`` fixes every weight; the language model's are those of
    ``save_deepseek_v3(config, seed)`` (see :func:`plain_language_model`). ``dtype``
    is the stored dtype of everything not INT4 (the real checkpoint: ``bfloat16``).
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    num_ranks = write_tokenizer(out_dir)
    ids = {name: num_ranks + offset for offset, name in SPECIAL_TOKENS.items()}
    text = language_model_config(num_ranks + NUM_SPECIAL, ids, num_layers, hidden_size, num_experts, dtype)

    import torch
    from safetensors.torch import load_file

    save_deepseek_v3(out_dir, text, seed)
    weights = {"language_model." + name: tensor
               for name, tensor in load_file(str(out_dir / "model.safetensors")).items()}
    (out_dir / "model.safetensors").unlink()
    if int4_experts:
        weights = quantize_experts(weights)
    groups = [{k: v for k, v in weights.items() if ".layers." in k},
              {k: v for k, v in weights.items() if ".layers." not in k},
              *vision_weights(hidden_size, getattr(torch, dtype), seed)]
    write_shards(out_dir, groups, max_shard_size)

    text_dict = json.loads((out_dir / "config.json").read_text())
    text_dict.update(model_type="kimi_k2", architectures=["DeepseekV3ForCausalLM"])
    config = {"architectures": ["KimiK25ForConditionalGeneration"], "model_type": "kimi_k25",
              "auto_map": AUTO_MAP, "dtype": dtype, "tie_word_embeddings": False,
              "bos_token_id": ids["[BOS]"], "eos_token_id": ids["[EOS]"], "pad_token_id": ids["[PAD]"],
              "media_placeholder_token_id": ids["<|media_pad|>"], "image_token_id": ids["<|media_pad|>"],
              "ignore_index": -100, "use_unified_vision_chunk": True,
              "video_placeholder": "<|kimi_k25_video_placeholder|>",
              "text_config": text_dict, "vision_config": vision_config(hidden_size)}
    if int4_experts:
        config["quantization_config"] = text_dict["quantization_config"] = QUANTIZATION_CONFIG
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out_dir / "preprocessor_config.json").write_text(json.dumps({"media_proc_cfg": {
        "patch_size": VISION["patch_size"], "merge_kernel_size": VISION["merge"],
        # small limits: vLLM profiles the tower with a 3000x3000 image cut to these
        "in_patch_limit": 256, "patch_limit_on_one_side": 16, "in_patch_limit_each_frame": 256,
        "in_patch_limit_video": None, "fixed_output_tokens": None,
        "temporal_merge_kernel_size": VISION["pos_emb_time"],
        "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5]}}, indent=2) + "\n")
    return out_dir


def language_model_config(vocab_size: int, ids: dict[str, int], num_layers: int, hidden_size: int,
                          num_experts: int, dtype: str):
    """The tiny DeepSeek-V3 config with Kimi's token ids and RoPE (YaRN, factor 64)."""
    config = deepseek_v3_config(vocab_size, num_layers=num_layers, hidden_size=hidden_size,
                                num_experts=num_experts, bos_token_id=ids["[BOS]"],
                                eos_token_id=ids["[EOS]"], pad_token_id=ids["[PAD]"], dtype=dtype)
    config.rope_parameters = {"rope_type": "yarn", "rope_theta": 50000.0, "factor": 64.0,
                              "original_max_position_embeddings": 32, "beta_fast": 32.0,
                              "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}
    return config


# ----------------------------------------------------------------------------- tokenizer

def write_tokenizer(out_dir: Path) -> int:
    """Kimi's tokenizer files in ``out_dir``; returns the number of BPE ranks."""
    num_ranks = write_tiktoken_ranks(out_dir / "tiktoken.model", BPE_TEXTS, 600)
    for name in REMOTE_CODE:
        shutil.copy(FIXTURE_FILES / name, out_dir / name)
    decoder = {str(num_ranks + offset): {"content": name, "lstrip": False, "normalized": False,
                                         "rstrip": False, "single_word": False, "special": True}
               for offset, name in SPECIAL_TOKENS.items()}
    (out_dir / "tokenizer_config.json").write_text(json.dumps({
        "added_tokens_decoder": decoder, "additional_special_tokens": ADDITIONAL_SPECIAL,
        "auto_map": TOKENIZER_AUTO_MAP, "tokenizer_class": "TikTokenTokenizer",
        "bos_token": "[BOS]", "eos_token": "[EOS]", "pad_token": "[PAD]", "unk_token": "[UNK]",
        "clean_up_tokenization_spaces": False, "model_max_length": 1048576}, indent=2) + "\n")
    return num_ranks


def write_tiktoken_ranks(path: Path, texts: list[str], vocab_size: int) -> int:
    """A byte-level BPE fit on ``texts`` (every byte kept) saved as tiktoken ranks
    (``base64(token) rank`` lines, merges in the order learned); returns their number."""
    import base64

    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.train_from_iterator(texts * 4, trainers.BpeTrainer(
        vocab_size=vocab_size, show_progress=False, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    byte_of = {c: b for b, c in bytes_to_unicode().items()}
    # The trainer numbers the alphabet first, then each merge as it is learned: that
    # order is the rank order tiktoken merges by.
    tokens = sorted(tokenizer.get_vocab().items(), key=lambda item: item[1])
    lines = [base64.b64encode(bytes(byte_of[c] for c in token)).decode() + f" {rank}"
             for rank, (token, _) in enumerate(tokens)]
    path.write_text("\n".join(lines) + "\n")
    return len(lines)


# ----------------------------------------------------------------------------- weights

def quantize_experts(weights: dict) -> dict:
    """The routed experts' projections as compressed-tensors pack-quantized INT4: symmetric
    per group of 32 inputs, eight 4-bit values (offset by 8) to an int32, lowest first."""
    import torch

    out = {}
    for name, weight in weights.items():
        if ".mlp.experts." not in name:
            out[name] = weight
            continue
        rows, cols = weight.shape
        groups = weight.float().view(rows, cols // INT4_GROUP_SIZE, INT4_GROUP_SIZE)
        scale = groups.abs().amax(-1, keepdim=True).clamp(min=1e-8) / 7
        q = (groups / scale).round().clamp(-8, 7).to(torch.int32).view(rows, cols) + 8
        shifts = torch.arange(0, 32, 4, dtype=torch.int32)
        packed = (q.view(rows, cols // 8, 8) << shifts).sum(-1, dtype=torch.int32)
        stem = name.removesuffix(".weight")
        out[stem + ".weight_packed"] = packed
        out[stem + ".weight_scale"] = scale.squeeze(-1).to(torch.bfloat16)
        out[stem + ".weight_shape"] = torch.tensor([rows, cols], dtype=torch.int32)
    return out


def vision_config(text_hidden_size: int) -> dict:
    v = VISION
    return {
        # as the hub's remote code reads them ...
        "vt_hidden_size": v["hidden_size"], "vt_num_attention_heads": v["num_attention_heads"],
        "vt_num_hidden_layers": v["num_hidden_layers"], "vt_intermediate_size": v["intermediate_size"],
        "init_pos_emb_height": v["pos_emb"], "init_pos_emb_width": v["pos_emb"],
        "init_pos_emb_time": v["pos_emb_time"],
        # ... and as transformers' Kimi_K25VisionConfig (vLLM) does
        "hidden_size": v["hidden_size"], "num_attention_heads": v["num_attention_heads"],
        "num_hidden_layers": v["num_hidden_layers"], "intermediate_size": v["intermediate_size"],
        "pos_emb_height": v["pos_emb"], "pos_emb_width": v["pos_emb"], "pos_emb_time": v["pos_emb_time"],
        "patch_size": v["patch_size"], "merge_kernel_size": [v["merge"], v["merge"]],
        "pos_emb_type": "divided_fixed", "merge_type": "sd2_tpool", "video_attn_type": "spatial_temporal",
        "mm_projector_type": "patchmerger", "mm_hidden_size": v["hidden_size"],
        "projector_hidden_act": "gelu", "projector_ln_eps": 1e-5, "text_hidden_size": text_hidden_size,
    }


def vision_weights(text_hidden_size: int, dtype, seed: int) -> list[dict]:
    """Random ``mm_projector.*`` and ``vision_tower.*`` tensors under the checkpoint's names."""
    import torch

    v = VISION
    h, ff, p = v["hidden_size"], v["intermediate_size"], v["patch_size"]
    merged = h * v["merge"] ** 2
    g = torch.Generator().manual_seed(seed + 1)

    def rand(*shape):
        return (torch.randn(*shape, generator=g) * 0.02).to(dtype)

    projector = {"mm_projector.pre_norm.weight": torch.ones(h, dtype=dtype),
                 "mm_projector.pre_norm.bias": rand(h),
                 "mm_projector.proj.0.weight": rand(merged, merged), "mm_projector.proj.0.bias": rand(merged),
                 "mm_projector.proj.2.weight": rand(text_hidden_size, merged),
                 "mm_projector.proj.2.bias": rand(text_hidden_size)}
    tower = {"vision_tower.patch_embed.proj.weight": rand(h, 3, p, p),
             "vision_tower.patch_embed.proj.bias": rand(h),
             "vision_tower.patch_embed.pos_emb.weight": rand(v["pos_emb"], v["pos_emb"], h),
             "vision_tower.encoder.final_layernorm.weight": torch.ones(h, dtype=dtype),
             "vision_tower.encoder.final_layernorm.bias": rand(h)}
    for i in range(v["num_hidden_layers"]):
        block = f"vision_tower.encoder.blocks.{i}."
        for norm in ("norm0", "norm1"):
            tower[block + norm + ".weight"] = torch.ones(h, dtype=dtype)
            tower[block + norm + ".bias"] = rand(h)
        for name, (rows, cols) in {"wqkv": (3 * h, h), "wo": (h, h),
                                   "mlp.fc0": (ff, h), "mlp.fc1": (h, ff)}.items():
            tower[block + name + ".weight"] = rand(rows, cols)
            tower[block + name + ".bias"] = rand(rows)
    return [projector, tower]


def write_shards(out_dir: Path, groups: list[dict], max_shard_size: int) -> None:
    """``model-0000k-of-0000n.safetensors`` and the index: each group in shards of its own,
    a group split where a shard would pass ``max_shard_size`` bytes."""
    from safetensors.torch import save_file

    shards: list[dict] = []
    for group in groups:
        shards.append({})
        for name in sorted(group, key=_natural):
            tensor = group[name]
            size = sum(t.numel() * t.element_size() for t in shards[-1].values())
            if shards[-1] and size + tensor.numel() * tensor.element_size() > max_shard_size:
                shards.append({})
            shards[-1][name] = tensor
    weight_map, total = {}, 0
    for k, shard in enumerate(shards, 1):
        file = f"model-{k:05d}-of-{len(shards):05d}.safetensors"
        save_file({n: t.contiguous() for n, t in shard.items()}, str(out_dir / file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, file))
        total += sum(t.numel() * t.element_size() for t in shard.values())
    (out_dir / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2) + "\n")


def _natural(name: str) -> list:
    """Sort key: layer 2 before layer 10."""
    return [int(part) if part.isdigit() else part for part in name.split(".")]


def plain_language_model(kimi_dir: str | Path, out_dir: str | Path) -> Path:
    """The fixture's language model as a plain ``DeepseekV3ForCausalLM`` directory (no
    tokenizer): the same tensors without the ``language_model.`` prefix, its ``text_config``
    as config.json."""
    from safetensors.torch import load_file

    kimi_dir, out_dir = Path(kimi_dir), Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    config = json.loads((kimi_dir / "config.json").read_text())
    text = {**config["text_config"], "model_type": "deepseek_v3"}
    (out_dir / "config.json").write_text(json.dumps(text, indent=2) + "\n")
    weights = {}
    for file in sorted(kimi_dir.glob("model-*.safetensors")):
        weights.update({name.removeprefix("language_model."): tensor
                        for name, tensor in load_file(str(file)).items()
                        if name.startswith("language_model.")})
    write_shards(out_dir, [weights], 1 << 40)
    return out_dir
