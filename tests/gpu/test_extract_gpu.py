"""vLLM extraction on CUDA equals the HF backend on CUDA, per target and dtype.

The real CLI (``python -m eagle3flow.extract``, backend vllm: the engine, this
project's KV connector, the shard writer) on a random Llama of the embedded target's
shape and on a tiny DeepSeek-V3 (MLA + MoE), then the HF backend on the same data in
the same dtype; every sample compared layer by layer. One engine at a time: each takes
the GPU memory share vLLM asks for.

Tolerances per dtype (a sample's layer: cosine of the flattened states, and the largest
difference over the largest magnitude): two implementations of the same forward in
float32 differ by accumulation order only; in bfloat16 each of ~8 layers rounds to 8
significant bits; fp8 storage (e4m3: 4 significant bits) rounds each element once more,
in both backends independently.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from eagle3flow.extract import shards
from eagle3flow.extract.hf import extract
from support.builders import write_dataset
from support.tiny_targets import make_tiny_deepseek_v3, make_tiny_llama

REPO = Path(__file__).resolve().parents[2]
LLAMA_AUX = [0, 2, 4, 7]         # 0: the embeddings, bit-identical in both backends
DEEPSEEK_AUX = [1, 4, 7]         # vLLM cannot capture DeepSeek's embeddings
# (min cosine, max |vllm - hf| / max |hf|) per sample and layer.
TOLERANCE = {"float32": (0.99999, 5e-3), "bfloat16": (0.999, 0.06), "fp8": (0.995, 0.15)}
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}

RUNS = {   # name: (target, dtype, storage dtype)
    "llama-float32": ("llama", "float32", "auto"),
    "llama-bfloat16-fp8": ("llama", "bfloat16", "fp8"),
    "deepseek-bfloat16": ("deepseek", "bfloat16", "auto"),
}
# No MLA in float32: vLLM's CUDA MLA backends take 16-bit activations only (seen on an H200,
# vLLM 0.25: "No valid attention backend found ... use_mla=True", every backend "dtype not
# supported"), so an MLA target extracts in bfloat16 as it is served.


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("gpu_extract")
    make_tiny_llama(root / "llama" / "target", seed=0)
    make_tiny_deepseek_v3(root / "deepseek" / "target")
    write_dataset(root / "train.parquet", 14, seed=1)     # 2 shards at 120 tokens
    return root


def run_vllm_cli(work: Path, name: str) -> tuple[Path, float, str]:
    target, dtype, storage = RUNS[name]
    aux = LLAMA_AUX if target == "llama" else DEEPSEEK_AUX
    out = work / name
    settings = {"backend": "vllm", "aux_layer_ids": aux, "device": "cuda", "dtype": dtype,
                "storage_dtype": storage, "batch_tokens": 96, "shard_tokens": 120}
    cmd = [sys.executable, "-m", "eagle3flow.extract", "--target", str(work / target / "target"),
           "--cache-root", str(work / "cache"), "--config-json", json.dumps(settings), "--split-name", "train", "--dataset", str(work / "train.parquet"),
           "--manifest", str(out / "vllm" / "manifest.json")]
    t0 = time.monotonic()
    result = subprocess.run(cmd, cwd=REPO, env=ENV, capture_output=True, text=True, timeout=240)
    seconds = time.monotonic() - t0
    log = result.stdout + result.stderr
    (work / f"{name}.log").write_text(log)
    assert result.returncode == 0, f"{name}: vLLM extraction failed:\n{log[-6000:]}"
    return out, seconds, log


def worst_difference(a: torch.Tensor, b: torch.Tensor) -> tuple[float, float]:
    a, b = a.float().flatten(), b.float().flatten()
    cosine = torch.nn.functional.cosine_similarity(a, b, dim=0).item()
    return cosine, ((a - b).abs().max() / b.abs().max().clamp_min(1e-12)).item()


@pytest.mark.parametrize("name", list(RUNS))
def test_vllm_extraction_equals_hf_on_cuda(work, name, record_property):
    target, dtype, storage = RUNS[name]
    aux = LLAMA_AUX if target == "llama" else DEEPSEEK_AUX
    out, seconds, log = run_vllm_cli(work, name)
    record_property("vllm_cli_s", round(seconds, 1))
    vllm = shards.load_manifest(out / "vllm" / "manifest.json")
    extract(work / "train.parquet", work / target / "target", out / "hf" / "manifest.json", work / "cache",
            aux_layer_ids=aux, device="cuda", dtype=dtype, batch_tokens=96, shard_tokens=120,
            storage_dtype=storage, split_name="train")
    hf = shards.load_manifest(out / "hf" / "manifest.json")
    for key in ("aux_layer_ids", "num_samples", "num_tokens", "hidden_size", "num_layers", "dtype",
                "storage_dtype"):
        assert vllm.data[key] == hf.data[key], key
    assert vllm.data["dtype"] == dtype
    assert [s["num_tokens"] for s in vllm.data["shards"]] == [s["num_tokens"] for s in hf.data["shards"]]
    assert len(vllm.data["shards"]) >= 2
    if storage == "fp8":
        stored, _ = shards.read_shard(vllm.shard_paths[0], dequantize=False)
        assert stored["aux_hidden_states"].dtype == shards.FP8
        assert stored["aux_hidden_states_scale"].shape == (stored["aux_hidden_states"].shape[0], len(aux))
    min_cos, max_rel = TOLERANCE["fp8" if storage == "fp8" else dtype]
    hidden, worst_cos, worst_rel, count = hf.hidden_size, 1.0, 0.0, 0
    for a, b in zip(vllm.iter_samples(), hf.iter_samples(), strict=True):
        assert a["id"] == b["id"]
        assert torch.equal(a["input_ids"], b["input_ids"]) and torch.equal(a["loss_mask"], b["loss_mask"])
        layers = [(k, a["aux_hidden_states"][:, j * hidden:(j + 1) * hidden],
                   b["aux_hidden_states"][:, j * hidden:(j + 1) * hidden]) for j, k in enumerate(sorted(aux))]
        layers.append(("last", a["last_hidden_state"], b["last_hidden_state"]))
        for k, x, y in layers:
            if k == 0 and storage != "fp8":
                assert torch.equal(x, y), f"{a['id']}: the embeddings differ"
            cosine, rel = worst_difference(x, y)
            worst_cos, worst_rel = min(worst_cos, cosine), max(worst_rel, rel)
            assert cosine >= min_cos and rel <= max_rel, (name, a["id"], k, cosine, rel)
        count += 1
    assert count == hf.data["num_samples"] > 0
    record_property("min_cosine", worst_cos)
    record_property("max_relative_difference", worst_rel)
    print(f"{name}: vLLM CLI {seconds:.1f} s, min cosine {worst_cos:.7f}, max relative {worst_rel:.2e}")
