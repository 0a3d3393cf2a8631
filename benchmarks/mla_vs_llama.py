"""MLA against Llama-style EAGLE-3 drafts for an MLA target, on the same target and data.

Part 1 (measured, CPU): the tiny DeepSeek-V3 target the tests build (MLA + MoE, random
weights, offline) writes greedy continuations of random prompts; the project's HF
extraction captures its hidden states; both drafts train on them with the same budget
(``train.draft.architecture: mla`` and ``llama``). Reported: simulated acceptance length
(teacher-forced on the target's own greedy tokens, which is greedy decoding's), vLLM's
acceptance for the draft vLLM can serve on this target (on vLLM's CPU build a Llama-style
draft cannot run beside an MLA target: the two attention backends share no KV block
size), trainable parameters, and draft KV-cache bytes per token.

Part 2 (computed): the same two figures for Kimi-K2.5-shaped drafts (H 7168, 64 heads,
MLA dims of the target), from the draft configs the workflow derives.

    PYTHONPATH=. python benchmarks/mla_vs_llama.py --work /tmp/mla_vs_llama --out benchmarks/results/mla_vs_llama_cpu.json
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from eagle3flow.model.config import DraftConfig
from eagle3flow.model.draft import Eagle3Draft

# The tiny DeepSeek-V3 builder is test support (tests/support/tiny_targets.py), not the package's.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

KIMI_K25 = {"model_type": "kimi_k2", "hidden_size": 7168, "intermediate_size": 18432, "num_attention_heads": 64,
            "num_key_value_heads": 64, "kv_lora_rank": 512, "q_lora_rank": 1536, "qk_nope_head_dim": 128,
            "qk_rope_head_dim": 64, "v_head_dim": 128, "max_position_embeddings": 262144, "rms_norm_eps": 1e-5,
            "rope_theta": 50000.0, "vocab_size": 163840, "dtype": "bfloat16",
            "rope_scaling": {"type": "yarn", "factor": 64.0, "original_max_position_embeddings": 4096,
                             "beta_fast": 1.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}}


def kv_bytes_per_token(cfg: DraftConfig, dtype_bytes: int = 2) -> int:
    """What the draft's one layer keeps in vLLM's KV cache per token: MLA the latent and the
    rope key (kv_lora_rank + qk_rope_head_dim), GQA a key and a value per KV head."""
    if cfg.architecture == "mla":
        return (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * dtype_bytes
    return 2 * cfg.num_key_value_heads * cfg.head_dim * dtype_bytes


def trainable_params(cfg: DraftConfig) -> int:
    """Counted on meta tensors (a Kimi-shaped draft is ~1B parameters); the rope's
    frequencies need real numbers and are no parameters."""
    from unittest import mock

    with mock.patch("eagle3flow.model.draft.rope_inv_freq", lambda c: (torch.zeros(1), 1.0)), \
            torch.device("meta"):
        model = Eagle3Draft(cfg)
    return sum(p.numel() for n, p in model.named_parameters() if n != "embed_tokens.weight")


def greedy_dataset(target: Path, out: Path, num_samples: int, seed: int) -> Path:
    """Random 6-token prompts and the target's greedy continuation, loss on the continuation."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(seed)
    prompts = torch.randint(3, model.config.vocab_size, (num_samples, 6), generator=g)
    with torch.no_grad():
        full = model.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=58,
                              min_new_tokens=58, do_sample=False, pad_token_id=0)
    rows = {"id": [f"s{seed}-{i}" for i in range(num_samples)], "input_ids": full.int().tolist(),
            "loss_mask": [[0] * 6 + [1] * 58 for _ in range(num_samples)], "num_tokens": [64] * num_samples}
    pq.write_table(pa.table(rows, schema=pa.schema([("id", pa.string()), ("input_ids", pa.list_(pa.int32())),
                                                    ("loss_mask", pa.list_(pa.int8())),
                                                    ("num_tokens", pa.int32())])), out)
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--work", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--epochs", type=int, default=6)
    args = parser.parse_args(argv)
    from eagle3flow.extract.hf import extract
    from support.tiny_targets import make_tiny_deepseek_v3
    from eagle3flow.train.trainer import train
    from eagle3flow.data.vocab import build_vocab_map

    work = args.work
    work.mkdir(parents=True, exist_ok=True)
    target = work / "target"
    if not (target / "config.json").is_file():
        make_tiny_deepseek_v3(target, seed=0)
    manifests = {}
    for split, n, seed in (("train", 96, 0), ("eval", 16, 1)):
        data = greedy_dataset(target, work / f"{split}.parquet", n, seed)
        manifests[split] = work / "hs" / split / "manifest.json"
        extract(data, target, manifests[split], work / "hs_cache", aux_layer_ids=[2, 4, 5], device="cpu",
                dtype="float32", split_name=split)
    vocab = json.loads((target / "config.json").read_text())["vocab_size"]
    vmap = work / "vocab_map.safetensors"
    build_vocab_map([work / "train.parquet"], vocab, 512, vmap, work / "vocab.json")
    rows = {}
    for arch in ("mla", "llama"):
        t0 = time.monotonic()
        result = train(manifests["train"], manifests["eval"], vmap, target, work / arch, work / "ckpt",
                       {"ttt_steps": 3, "epochs": args.epochs, "batch_tokens": 512, "device": "cpu",
                        "draft": {"architecture": arch}})
        cfg = DraftConfig.from_dict(json.loads((work / arch / "draft_config.json").read_text()))
        rows[arch] = {"simulated_acceptance_length": result["simulated_acceptance_length"],
                      "step_accuracy": result["step_accuracy"], "trainable_params": trainable_params(cfg),
                      "kv_cache_bytes_per_token_bf16": kv_bytes_per_token(cfg),
                      "train_seconds": round(time.monotonic() - t0, 1)}
        print(f"{arch}: {rows[arch]}", file=sys.stderr, flush=True)
    kimi = {}
    for arch in ("mla", "llama"):
        cfg = DraftConfig.from_target_config(KIMI_K25, [2, 30, 58], 32000, {"architecture": arch})
        kimi[arch] = {"trainable_params": trainable_params(cfg), "kv_cache_bytes_per_token_bf16": kv_bytes_per_token(cfg)}
    out = {"target": "tiny DeepSeek-V3 (tests/support/tiny_targets.py: H 64, 8 layers, MLA kv_lora 512, MoE 4 experts, random)",
           "data": "96 train / 16 eval greedy continuations of random 6-token prompts, 58 tokens each",
           "budget": {"epochs": args.epochs, "batch_tokens": 512, "ttt_steps": 3, "draft_vocab_size": 512},
           "device": "cpu (float32)", "tiny_target": rows, "kimi_k25_shape": kimi}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1) + "\n")
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
