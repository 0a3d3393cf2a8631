"""The CUDA paths (bf16 extraction, bf16-autocast training, export) on a real GPU.

Skipped where no GPU exists (CI); run on a GPU machine with
``pytest tests/test_cuda_paths.py``.
"""
from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest
import torch

from helpers import make_random_llama

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def write_dataset(path: Path, vocab: int, num_samples: int = 64, seed: int = 0) -> Path:
    g = torch.Generator().manual_seed(seed)
    rows = []
    for i in range(num_samples):
        n = int(torch.randint(32, 96, (1,), generator=g))
        # A repeating pattern gives the draft something learnable.
        period = int(torch.randint(3, 7, (1,), generator=g))
        base = torch.randint(3, vocab, (period,), generator=g)
        ids = base.repeat(n // period + 1)[:n]
        mask = (torch.arange(n) >= n // 4).to(torch.int8)
        rows.append({"id": f"s{i}", "input_ids": ids.int().tolist(), "loss_mask": mask.tolist(),
                     "num_tokens": n})
    pd.DataFrame(rows).to_parquet(path)
    return path


def test_extract_train_export_on_cuda(tmp_path):
    from eagle3flow.export import export_draft
    from eagle3flow.hidden_states import extract
    from eagle3flow.shards import load_manifest
    from eagle3flow.train import train
    from eagle3flow.vocab import build_vocab_map

    target = make_random_llama(tmp_path / "target", hidden_size=256, heads=4, kv_heads=2,
                               intermediate_size=512)
    dataset = write_dataset(tmp_path / "train.parquet", vocab=512)
    manifest_path = tmp_path / "hs" / "manifest.json"
    extract(dataset, target, manifest_path, tmp_path / "cache", device="cuda", dtype="auto",
            shard_tokens=2048)
    manifest = load_manifest(manifest_path)
    assert manifest.data["dtype"] == "bfloat16"
    build_vocab_map([dataset], 512, 256, tmp_path / "vocab.safetensors", tmp_path / "vocab.json")

    config = {"ttt_steps": 3, "epochs": 2, "batch_tokens": 1024, "lr": 3e-3, "log_every": 1}
    runs = {}
    for device in ("cpu", "cuda"):
        train(manifest_path, manifest_path, tmp_path / "vocab.safetensors", target,
              tmp_path / f"train_{device}", tmp_path / f"train_cache_{device}",
              {**config, "device": device})
        lines = (tmp_path / f"train_{device}" / "metrics.jsonl").read_text().splitlines()
        runs[device] = [json.loads(line) for line in lines]
    # Same data, seed and steps: bf16 autocast on the GPU tracks fp32 on the CPU.
    assert [m["step"] for m in runs["cpu"]] == [m["step"] for m in runs["cuda"]]
    for cpu, cuda in zip(runs["cpu"], runs["cuda"]):
        assert cuda["loss"] == pytest.approx(cpu["loss"], rel=0.02), (cpu, cuda)

    export_draft(tmp_path / "train_cuda", tmp_path / "vocab.safetensors", target, tmp_path / "draft")
    config = json.loads((tmp_path / "draft" / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"]
    torch.cuda.synchronize()
    print("peak GPU memory (MiB):", torch.cuda.max_memory_allocated() / 2**20)
