"""The vLLM extraction backend: same tensors as the HF backend, for Llama and DeepSeek-V3.

The slow tests share one module-scoped run: the real CLI (``python -m
eagle3flow.extract`` with backend vllm) on the CPU build of vLLM, once per target
(the embedded target's Llama shape, and a tiny DeepSeek-V3: MLA + MoE), both splits
through one engine each, the two runs in parallel. The HF backend then extracts the
same datasets in this process and every tensor is compared.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from eagle3flow.extract import __main__ as extract_cli
from eagle3flow.extract import shards
from eagle3flow.extract.extraction import LOADING_LINE, SHARD_DELAY_ENV
from eagle3flow.extract.hf import extract
from eagle3flow.extract.vllm import (capture_layer_ids, check_layer_ids, find_cache_group,
                                     gather_sample, resolve_tensor_parallel_size, restore_order)
from support.builders import write_dataset
from support.processes import live_session_members
from support.tiny_targets import make_tiny_deepseek_v3, make_tiny_llama
from support.workflow import kill_when

REPO = Path(__file__).resolve().parent.parent
# Unordered on purpose: vLLM hands them back ascending, and the extraction CLI sorts them
# (the order vLLM feeds the draft); 0 = the embeddings and N-1 = the last layer's input on
# Llama; DeepSeek cannot give 0 in vLLM.
LLAMA_AUX = [4, 0, 7, 2]
DEEPSEEK_AUX = [1, 7, 4]
SETTINGS = {"device": "cpu", "dtype": "float32", "batch_tokens": 96, "shard_tokens": 120}


# ----------------------------------------------------------------------------- fast

def test_capture_ids_and_restored_order():
    """vLLM captures sorted aux ids then N; they come back in the configured order."""
    num_layers, hidden = 8, 3
    assert capture_layer_ids(LLAMA_AUX, num_layers) == [0, 2, 4, 7, 8]
    captured = capture_layer_ids(LLAMA_AUX, num_layers)
    # states[t, c, :] = the id captured in column c, so the order is visible in the values.
    states = torch.tensor(captured, dtype=torch.float32)[None, :, None].expand(5, -1, hidden)
    aux, pre_norm = restore_order(states, LLAMA_AUX, num_layers)
    assert aux.shape == (5, len(LLAMA_AUX) * hidden)
    assert aux[0].view(len(LLAMA_AUX), hidden)[:, 0].tolist() == LLAMA_AUX
    assert pre_norm[:, 0].tolist() == [8.0] * 5


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="no GPU"))])
def test_gather_sample_reads_its_blocks(device):
    """A sample scattered over non-contiguous blocks comes back in token order, aux in
    the configured order, the last state normalized; on CUDA via pinned async copies."""
    num_layers, hidden, block_size, tokens = 8, 4, 3, 7
    captured = capture_layer_ids(LLAMA_AUX, num_layers)
    cache = torch.randn(10, len(captured), block_size, hidden, device=device)
    blocks = [6, 2, 9]
    weight, eps = torch.rand(hidden, device=device) + 0.5, 1e-5
    stream = torch.cuda.Stream() if device == "cuda" else None
    out, event = gather_sample(cache, blocks, tokens, LLAMA_AUX, num_layers, weight, eps,
                               copy_stream=stream)
    if event is not None:
        event.synchronize()
        assert out["aux"].is_pinned()
    expected = torch.cat([cache[b].transpose(0, 1) for b in blocks])[:tokens].cpu()  # [T, C, H]
    for j, k in enumerate(LLAMA_AUX):
        assert torch.equal(out["aux"][:, j * hidden:(j + 1) * hidden], expected[:, captured.index(k)])
    pre = expected[:, -1]
    torch.testing.assert_close(out["last"], weight.cpu() * pre * torch.rsqrt(pre.pow(2).mean(-1, keepdim=True) + eps))
    fp8, _ = gather_sample(cache, blocks, tokens, LLAMA_AUX, num_layers, weight, eps, fp8=True,
                           copy_stream=stream)
    if device == "cuda":
        torch.cuda.synchronize()
    assert fp8["aux"].dtype == shards.FP8 and fp8["aux_scale"].shape == (tokens, len(LLAMA_AUX))
    torch.testing.assert_close(shards.dequantize_fp8(fp8["aux"], fp8["aux_scale"], torch.float32),
                               out["aux"], rtol=0.07, atol=1e-6)


def test_cache_layout_follows_what_the_installed_vllm_offers():
    """0.32 (the CPU build here) knows LBNHC and hands the layer over captured id first;
    a vLLM that knows only NHD/HND (0.25) is asked for NHD, whose layer is token-major."""
    from vllm.v1.kv_cache_layout import KVCacheLayout

    from eagle3flow.extract.vllm_connector import (CacheLayoutPlan, ShardConnector, cache_layout_plan,
                                                   installed_layout_names)

    assert installed_layout_names() == {m.name for m in KVCacheLayout}
    assert ShardConnector.get_required_kvcache_layout(None) == "LBNHC"
    assert KVCacheLayout[ShardConnector.get_required_kvcache_layout(None)].layer_view_order == (0, 2, 1, 3)
    assert cache_layout_plan({"NHD", "HND"}) == CacheLayoutPlan("NHD", token_major=True)
    with pytest.raises(ValueError, match=r"neither LBNHC nor NHD"):
        cache_layout_plan({"HND"})


def test_token_major_cache_reads_the_same_samples():
    """The same states stored [blocks, block_size, C, H] (vLLM 0.25's NHD layer) and
    [blocks, C, block_size, H] (0.32's LBNHC layer) give the same shards' tensors."""
    from eagle3flow.extract.vllm_connector import cache_layout_plan, captured_major

    num_layers, hidden, block_size, tokens = 8, 4, 3, 7
    captured = len(capture_layer_ids(LLAMA_AUX, num_layers))
    captured_first = torch.randn(10, captured, block_size, hidden)
    token_major = captured_first.transpose(1, 2).contiguous()
    weight, eps, blocks = torch.rand(hidden) + 0.5, 1e-5, [6, 2, 9]
    new = captured_major(captured_first, cache_layout_plan({"LBNHC", "LBHNC"}), captured)
    old = captured_major(token_major, cache_layout_plan({"NHD", "HND"}), captured)
    assert old.data_ptr() == token_major.data_ptr()   # a view: the engine's cache, not a copy
    a, _ = gather_sample(new, blocks, tokens, LLAMA_AUX, num_layers, weight, eps)
    b, _ = gather_sample(old, blocks, tokens, LLAMA_AUX, num_layers, weight, eps)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    with pytest.raises(ValueError, match=r"layout NHD; expected \[blocks, block_size, C, hidden\] with C = 5"):
        captured_major(captured_first, cache_layout_plan({"NHD"}), captured)


def test_embeddings_refused_for_deepseek_only():
    with pytest.raises(ValueError, match=r"id 0 .*deepseek_v3 target \(/m/config.json\)"):
        check_layer_ids([0, 2, 5], {"model_type": "deepseek_v3"}, "/m/config.json")
    check_layer_ids([1, 2, 5], {"model_type": "deepseek_v3"}, "/m/config.json")
    check_layer_ids([0, 2, 5], {"model_type": "llama"}, "/m/config.json")


def test_tensor_parallelism_is_one_on_the_cpu_whatever_the_node_has(monkeypatch):
    """resources.gpus (8 under local-8gpu) is the engine's TP on CUDA; a GPU stage that falls
    back to the CPU (vLLM's CPU build) runs one engine: TP 8 there fails in vLLM's config
    ("Total number of attention heads (2) must be divisible by tensor parallel size (8)")."""
    assert resolve_tensor_parallel_size(8, torch.device("cpu")) == 1
    assert resolve_tensor_parallel_size(None, torch.device("cpu")) == 1
    assert resolve_tensor_parallel_size(8, torch.device("cuda")) == 8
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    assert resolve_tensor_parallel_size(None, torch.device("cuda")) == 4
    with pytest.raises(ValueError, match="must be >= 1"):
        resolve_tensor_parallel_size(0, torch.device("cuda"))


def test_cache_group_found_by_layer_name():
    """An MLA target has its own KV group beside the hidden-state one: found by name."""
    groups = [SimpleNamespace(layer_names=[f"model.layers.{i}.self_attn.attn" for i in range(8)]),
              SimpleNamespace(layer_names=["cache_only_layers.8"])]
    assert find_cache_group(SimpleNamespace(kv_cache_groups=groups), 8) == 1
    with pytest.raises(ValueError, match="cache_only_layers.4"):
        find_cache_group(SimpleNamespace(kv_cache_groups=groups), 4)


def test_tiny_deepseek_layouts(tmp_path):
    """Flat, nested (Kimi-K2.5 style) and sharded: the same tensors, found by name."""
    from eagle3flow.target.config import load_target_config
    from eagle3flow.target.weights import load_target_head

    t0 = time.monotonic()
    flat = make_tiny_deepseek_v3(tmp_path / "flat", seed=3)
    built_s = time.monotonic() - t0
    nested = make_tiny_deepseek_v3(tmp_path / "nested", seed=3, nest_text_config=True,
                                   max_shard_size="300KB")
    config = json.loads((nested / "config.json").read_text())
    assert config["architectures"] == ["KimiK25ForConditionalGeneration"]
    text = load_target_config(nested)
    assert text["model_type"] == "deepseek_v3" and text["kv_lora_rank"] == 512
    assert text["qk_rope_head_dim"] == 64 and text["first_k_dense_replace"] == 1
    assert text == load_target_config(flat) | {"tie_word_embeddings": False}
    index = json.loads((nested / "model.safetensors.index.json").read_text())["weight_map"]
    assert len(set(index.values())) > 1 and all(k.startswith("language_model.") for k in index)
    a, b = load_target_head(flat), load_target_head(nested)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert (flat / "tokenizer.json").is_file() and (nested / "tokenizer_config.json").is_file()
    assert built_s < 15, built_s  # ~3 s idle, imports included


# ----------------------------------------------------------------------------- slow: vLLM

def _cli(target: Path, work: Path, aux: list[int], backend: str) -> list[str]:
    return [sys.executable, "-m", "eagle3flow.extract",
            "--target", str(target), "--cache-root", str(work / "cache"),
            "--config-json", json.dumps({**SETTINGS, "aux_layer_ids": aux, "backend": backend}),
            "--split-name", "train", "--dataset", str(work / "train.parquet"),
            "--manifest", str(work / backend / "train" / "manifest.json"),
            "--split-name", "eval", "--dataset", str(work / "eval.parquet"),
            "--manifest", str(work / backend / "eval" / "manifest.json")]


def kill_after_first_shard(proc: subprocess.Popen, cache: Path, log: Path) -> None:
    """SIGKILL the run's process group (the CLI and vLLM's engine process) once its first
    shard is on disk; nothing of its session may live on."""
    kill_when(proc, lambda: list(cache.glob("*/shard-*.safetensors")), 300, "the first shard", log)
    deadline = time.monotonic() + 30
    while live_session_members(proc.pid):
        assert time.monotonic() < deadline, f"still running after SIGKILL: {live_session_members(proc.pid)}"
        time.sleep(0.1)


@pytest.fixture(scope="module")
def vllm_runs(tmp_path_factory):
    """Both targets extracted by the vLLM CLI, in parallel (each engine start is ~30 s).
    The llama run is first killed (SIGKILL) after its first shard, then resumed."""
    root = tmp_path_factory.mktemp("vllm_extract")
    runs = {"llama": SimpleNamespace(target=make_tiny_llama(root / "llama" / "target"), aux=LLAMA_AUX),
            "deepseek": SimpleNamespace(target=make_tiny_deepseek_v3(root / "deepseek" / "target"),
                                        aux=DEEPSEEK_AUX)}
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "VLLM_CPU_KVCACHE_SPACE": "1", "PYTHONUNBUFFERED": "1"}

    def start(run, log: Path, extra_env=None):
        return subprocess.Popen(_cli(run.target, run.work, run.aux, "vllm"), cwd=REPO,
                                env={**env, **(extra_env or {})}, stdout=open(log, "w"),
                                stderr=subprocess.STDOUT, start_new_session=True)

    procs = {}
    for name, run in runs.items():
        run.work = root / name
        write_dataset(run.work / "train.parquet", 14, seed=1)   # 2 shards
        write_dataset(run.work / "eval.parquet", 3, seed=2)
        run.log = run.work / "vllm.log"
        run.hf_models = {}  # the HF target, loaded once for both splits
    llama = runs["llama"]
    llama.killed_log = llama.work / "vllm_killed.log"
    killed = start(llama, llama.killed_log, {SHARD_DELAY_ENV: "600"})
    procs["deepseek"] = (start(runs["deepseek"], runs["deepseek"].log), time.monotonic())
    try:
        kill_after_first_shard(killed, llama.work / "cache", llama.killed_log)
    except BaseException:
        procs["deepseek"][0].kill()
        raise
    llama.shards_after_kill = sorted(p.name for p in (llama.work / "cache").glob("*/shard-*.safetensors"))
    llama.manifest_after_kill = (llama.work / "vllm" / "train" / "manifest.json").exists()
    procs["llama"] = (start(llama, llama.log), time.monotonic())
    for name, (proc, t0) in procs.items():
        try:
            rc = proc.wait(timeout=600)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        runs[name].wall_s = time.monotonic() - t0
        assert rc == 0, f"{name}: vLLM extraction failed:\n{runs[name].log.read_text()[-6000:]}"
    return runs


def _compare_with_hf(run, split: str, atol: float):
    """The HF backend on the same split; every sample's tensors side by side."""
    vllm = shards.load_manifest(run.work / "vllm" / split / "manifest.json")
    hf_data = extract(run.work / f"{split}.parquet", run.target, run.work / "hf" / split / "manifest.json",
                      run.work / "cache", aux_layer_ids=run.aux, device="cpu", dtype="float32",
                      batch_tokens=96, shard_tokens=120, split_name=split, loaded_models=run.hf_models)
    hf = shards.load_manifest(run.work / "hf" / split / "manifest.json")
    assert hf_data["fingerprint"] != vllm.data["fingerprint"]  # never each other's cache
    for key in ("aux_layer_ids", "num_samples", "num_tokens", "hidden_size", "num_layers", "dtype"):
        assert vllm.data[key] == hf.data[key], key
    assert [s["num_tokens"] for s in vllm.data["shards"]] == [s["num_tokens"] for s in hf.data["shards"]]
    hidden, count = hf.hidden_size, 0
    for a, b in zip(vllm.iter_samples(), hf.iter_samples(), strict=True):
        assert a["id"] == b["id"]
        assert torch.equal(a["input_ids"], b["input_ids"]) and torch.equal(a["loss_mask"], b["loss_mask"])
        assert a["aux_hidden_states"].dtype == b["aux_hidden_states"].dtype == torch.float32
        for j, k in enumerate(sorted(run.aux)):  # layer by layer, as extracted: ascending
            cols = slice(j * hidden, (j + 1) * hidden)
            torch.testing.assert_close(a["aux_hidden_states"][:, cols], b["aux_hidden_states"][:, cols],
                                       rtol=1e-4, atol=atol, msg=f"{a['id']} layer id {k}")
        torch.testing.assert_close(a["last_hidden_state"], b["last_hidden_state"], rtol=1e-4,
                                   atol=atol * 10, msg=f"{a['id']} last")
        count += 1
    assert count == hf.data["num_samples"] and count > 0
    return vllm


@pytest.mark.slow
def test_vllm_backend_equals_hf_on_embedded_llama(vllm_runs):
    run = vllm_runs["llama"]
    print(f"llama: vLLM CLI {run.wall_s:.1f} s")
    train = _compare_with_hf(run, "train", atol=1e-5)
    _compare_with_hf(run, "eval", atol=1e-5)
    assert len(train.data["shards"]) >= 2
    log = run.log.read_text()
    assert log.count(LOADING_LINE) == 1  # one engine for both splits
    assert train.data["storage_dtype"] == "float32"


@pytest.mark.slow
def test_vllm_run_killed_after_a_shard_resumes_from_it(vllm_runs):
    """The SIGKILLed run left its first shard and no manifest; the rerun kept that shard
    and computed the rest (the shards equal HF's: the test above)."""
    run = vllm_runs["llama"]
    assert len(run.shards_after_kill) == 1, run.shards_after_kill
    assert not run.manifest_after_kill
    assert "(1 cached)" in run.log.read_text()
    assert run.killed_log.read_text().count(LOADING_LINE) == 1


@pytest.mark.slow
def test_vllm_backend_equals_hf_on_tiny_deepseek_v3(vllm_runs):
    """MLA + MoE on the CPU build (rotary custom op off, cache group found by name)."""
    run = vllm_runs["deepseek"]
    print(f"deepseek: vLLM CLI {run.wall_s:.1f} s")
    _compare_with_hf(run, "train", atol=1e-5)
    _compare_with_hf(run, "eval", atol=1e-5)


@pytest.mark.slow
def test_exported_layer_ids_are_what_vllm_captures(vllm_runs):
    """The draft's eagle_aux_hidden_state_layer_ids are the manifest's ids, and what vLLM
    captures for id k is HF's hidden_states[k]; the last state is what lm_head consumes."""
    from transformers import AutoModelForCausalLM

    from eagle3flow.model.config import DraftConfig
    from eagle3flow.target.config import load_target_config

    for name, run in vllm_runs.items():
        manifest = shards.load_manifest(run.work / "vllm" / "eval" / "manifest.json")
        exported = DraftConfig.from_target_config(load_target_config(run.target), manifest.aux_layer_ids,
                                                  100).to_hf_config()
        assert exported["eagle_aux_hidden_state_layer_ids"] == manifest.aux_layer_ids == sorted(run.aux)
        assert exported["num_aux_hidden_states"] == len(run.aux)
        model = AutoModelForCausalLM.from_pretrained(run.target, dtype=torch.float32).eval()
        sample = next(manifest.iter_samples())
        with torch.no_grad():
            out = model(sample["input_ids"].long()[None], output_hidden_states=True)
        hidden = manifest.hidden_size
        for j, k in enumerate(exported["eagle_aux_hidden_state_layer_ids"]):
            torch.testing.assert_close(sample["aux_hidden_states"][:, j * hidden:(j + 1) * hidden],
                                       out.hidden_states[k][0], rtol=1e-4, atol=1e-5, msg=f"{name} id {k}")
        torch.testing.assert_close(model.lm_head(sample["last_hidden_state"]), out.logits[0],
                                   rtol=1e-4, atol=1e-4, msg=f"{name} logits")


@pytest.mark.slow
def test_vllm_rerun_keeps_every_shard_without_loading(vllm_runs, capsys):
    """Resume: every shard on disk verifies, so no engine starts (vLLM is not even imported)."""
    run = vllm_runs["llama"]
    files = sorted((run.work / "cache").glob("*/shard-*.safetensors"))
    before = {p: (p.stat().st_ino, p.stat().st_mtime_ns) for p in files}
    extract_cli.main(_cli(run.target, run.work, run.aux, "vllm")[3:])
    err = capsys.readouterr().err
    assert LOADING_LINE not in err and "(2 cached)" in err and "(1 cached)" in err
    assert {p: (p.stat().st_ino, p.stat().st_mtime_ns) for p in files} == before


def test_embeddings_id_on_deepseek_fails_before_loading(tmp_path, capsys):
    target = make_tiny_deepseek_v3(tmp_path / "target", num_layers=4)
    write_dataset(tmp_path / "train.parquet", 3)
    write_dataset(tmp_path / "eval.parquet", 2)
    with pytest.raises(ValueError, match="id 0 \\(the embeddings\\) cannot be captured") as error:
        extract_cli.main(_cli(target, tmp_path, [0, 2], "vllm")[3:])
    assert str(target / "config.json") in str(error.value)
    assert LOADING_LINE not in capsys.readouterr().err
