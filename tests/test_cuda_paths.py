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

from eagle3flow.model.kernels.fp8_linear import fp8_device
from support.targets import make_random_llama

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
    from eagle3flow.export.checkpoint import export_draft
    from eagle3flow.extract.hf import extract
    from eagle3flow.extract.shards import load_manifest
    from eagle3flow.train.trainer import train
    from eagle3flow.data.vocab import build_vocab_map

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


# ---- the fast TTT training path (eagle3flow/model/kernels/ttt_attention.py, soft_cross_entropy.py) against
# the exact float32 path it replaces on CUDA

def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


@pytest.mark.parametrize("heads,kv_heads,head_dim,v_dim,tails,kernel", [
    (8, 2, 64, 64, 0, "flash"), (8, 2, 64, 64, 3, "flash"), (4, 4, 112, 112, 2, "flash"),
    # MLA (qk 192 / v 128): values padded for the flash kernel, as they are for cuDNN's
    (4, 4, 192, 128, 3, "flash"), (4, 4, 192, 128, 3, "cudnn"), (4, 4, 192, 128, 0, "cudnn")])
def test_flash_cache_tail_attention_matches_exact(heads, kv_heads, head_dim, v_dim, tails, kernel, monkeypatch):
    from eagle3flow.model.kernels import ttt_attention

    monkeypatch.setattr(ttt_attention, "MLA_CACHE_KERNEL", kernel)
    torch.manual_seed(heads + tails)
    b, t = 3, 333                           # not a multiple of the kernel's tiles
    shapes = [(b, t, heads, head_dim), (b, t, kv_heads, head_dim), (b, t, kv_heads, v_dim),
              (tails, b, t, kv_heads, head_dim), (tails, b, t, kv_heads, v_dim)]
    inputs = [(torch.randn(s, device="cuda") * 2).to(torch.bfloat16).requires_grad_() for s in shapes]
    reference = [x.detach().double().requires_grad_() for x in inputs]
    scale = head_dim ** -0.5
    out = ttt_attention.cache_tail_attention(*inputs, scale)
    ref = ttt_attention.exact_cache_tail_attention(*reference, scale)
    if kernel == "cudnn":
        assert ttt_attention._CUDNN_RUNS, "cuDNN's kernel did not run (the padded flash one took over)"
    assert torch.isfinite(out).all()
    assert _rel(out, ref) < 1e-2
    grad = torch.randn_like(ref)
    out.backward(grad.to(out.dtype))
    ref.backward(grad)
    for name, x, r in zip(["q", "k0", "v0", "k_tail", "v_tail"], inputs, reference):
        if r.numel():
            assert _rel(x.grad, r.grad) < 2e-2, name


def test_triton_soft_cross_entropy_matches_reference():
    from eagle3flow.model.kernels.soft_cross_entropy import soft_cross_entropy, soft_cross_entropy_reference

    torch.manual_seed(0)
    n_teacher, n, vocab = 50, 40, 32000
    teacher = (torch.randn(n_teacher, vocab, device="cuda") * 3).to(torch.bfloat16)
    lse = torch.logsumexp(teacher.float(), -1)
    argmax = teacher.float().argmax(-1)
    target = torch.randint(0, n_teacher, (n,), device="cuda")
    logits = (torch.randn(n, vocab, device="cuda") * 3).to(torch.bfloat16)
    logits[:10] = teacher[target[:10]]           # rows whose argmax agrees
    fast_in = logits.clone().requires_grad_()
    ref_in = logits.double().requires_grad_()
    loss, correct = soft_cross_entropy(fast_in, teacher, lse, target, argmax, scale=0.25)
    ref_loss, ref_correct = soft_cross_entropy_reference(ref_in, teacher.double(), lse.double(), target,
                                                         argmax, scale=0.25)
    assert int(correct) == int(ref_correct) >= 10
    assert float(loss) == pytest.approx(float(ref_loss), rel=1e-4)
    (loss * 3).backward()
    (ref_loss * 3).backward()
    assert _rel(fast_in.grad, ref_in.grad) < 1e-2


def cuda_draft_and_batch():
    """A random Llama-layer draft on the GPU (norm weights away from 1, so folding them into
    the GEMMs shows) and a batch of three packed samples of unequal lengths."""
    from eagle3flow.model.config import DraftConfig
    from eagle3flow.model.draft import Eagle3Draft

    cfg = DraftConfig(hidden_size=256, target_hidden_size=256, num_attention_heads=8,
                      num_key_value_heads=2, head_dim=32, intermediate_size=512, rms_norm_eps=1e-6,
                      rope_theta=10000.0, max_position_embeddings=1024, vocab_size=1000,
                      draft_vocab_size=600, aux_layer_ids=[1, 3, 5])
    torch.manual_seed(0)
    model = Eagle3Draft(cfg)
    with torch.no_grad():
        model.reset_parameters(std=0.05)
        model.embed_tokens.weight.normal_()
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    model = model.cuda()
    lengths = [300, 97, 211]
    n = sum(lengths)
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), device="cuda")
    batch = {"aux": torch.randn(n, 3 * cfg.hidden_size, device="cuda"),
             "last": torch.randn(n, cfg.hidden_size, device="cuda"),
             "input_ids": torch.randint(0, cfg.vocab_size, (n,), device="cuda"),
             "loss_mask": torch.rand(n, device="cuda") < 0.6, "cu_seqlens": cu}
    return cfg, model, batch


def test_ttt_loss_bf16_fast_path_tracks_fp32():
    """ttt_loss under bf16 autocast (flash attention, Triton CE, folded weights) gives the loss
    and gradients of the float32 exact path, on packed samples of unequal lengths."""
    from eagle3flow.train.loss import ttt_loss

    cfg, model, batch = cuda_draft_and_batch()
    head = torch.randn(cfg.draft_vocab_size, cfg.hidden_size, device="cuda") * 0.1
    results = {}
    for autocast in (False, True):
        model.zero_grad(set_to_none=True)
        loss, stats = ttt_loss(model, batch, head.to(torch.bfloat16) if autocast else head, 4, 0.8, autocast)
        loss.backward()
        results[autocast] = (float(loss), [s[2] for s in stats],
                             {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None})
    (loss32, rows32, grads32), (loss16, rows16, grads16) = results[False], results[True]
    assert rows32 == rows16 and min(rows32) > 0
    assert loss16 == pytest.approx(loss32, rel=2e-2)
    assert set(grads16) == set(grads32)
    for name in grads32:
        assert _rel(grads16[name], grads32[name]) < 5e-2, name


fp8_tensor_cores = pytest.mark.skipif(
    not torch.cuda.is_available() or not fp8_device(torch.device("cuda")),
    reason="needs fp8 tensor cores (compute capability 8.9 or newer)")


@fp8_tensor_cores
def test_fp8_linear_on_cuda_matches_its_cpu_emulation():
    """torch._scaled_mm's three products (rowwise scales, 77 tokens: the weight gradient's
    token dimension padded) against the same casts multiplied in float32 on the CPU."""
    from eagle3flow.model.kernels.fp8_linear import fp8_linear, fp8_weight

    torch.manual_seed(0)
    x, w, dy = torch.randn(77, 256), torch.randn(384, 256) * 0.05, torch.randn(77, 384)
    out = {}
    for device in ("cpu", "cuda"):
        xd = x.to(device, torch.bfloat16).requires_grad_()
        wd = w.to(device, torch.bfloat16).requires_grad_()
        y = fp8_linear(xd, fp8_weight(wd))
        y.backward(dy.to(device, torch.bfloat16))
        out[device] = [t.detach().float().cpu() for t in (y, xd.grad, wd.grad)]
    for name, cpu, cuda in zip(("y", "dx", "dw"), out["cpu"], out["cuda"]):
        assert _rel(cuda, cpu) < 1e-2, name


@fp8_tensor_cores
def test_ttt_loss_with_fp8_matmuls_tracks_bf16():
    """The compiled bf16-autocast TTT step with train.fp8_matmuls: loss and gradients within
    fp8's precision of the same step in bf16."""
    from eagle3flow.train.loss import ttt_loss

    cfg, model, batch = cuda_draft_and_batch()
    head = (torch.randn(cfg.draft_vocab_size, cfg.hidden_size, device="cuda") * 0.1).to(torch.bfloat16)
    results = {}
    for fp8 in (False, True):
        model.fp8_matmuls = fp8
        model.zero_grad(set_to_none=True)
        loss, _ = ttt_loss(model, batch, head, 4, 0.8, True)
        loss.backward()
        results[fp8] = (loss.item(), {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None})
    (loss16, grads16), (loss8, grads8) = results[False], results[True]
    assert loss8 != loss16 and loss8 == pytest.approx(loss16, rel=3e-2)
    assert set(grads8) == set(grads16)
    for name in grads16:
        assert _rel(grads8[name], grads16[name]) < 0.1, name


def test_fused_linear_soft_cross_entropy_matches_reference():
    from eagle3flow.model.kernels.soft_cross_entropy import _TritonLinearSoftCE, linear_soft_cross_entropy_reference

    torch.manual_seed(1)
    n, hidden, vocab = 300, 256, 32000
    x = torch.randn(n, hidden, device="cuda").to(torch.bfloat16)
    w = (torch.randn(vocab, hidden, device="cuda") * 0.2).to(torch.bfloat16)
    teacher = (torch.randn(400, vocab, device="cuda") * 3).to(torch.bfloat16)
    lse, argmax = torch.logsumexp(teacher.float(), -1), teacher.float().argmax(-1)
    target = torch.randint(0, 400, (n,), device="cuda")
    scale = torch.rand(n, device="cuda")
    fast = [x.clone().requires_grad_(), w.clone().requires_grad_()]
    ref = [x.double().requires_grad_(), w.double().requires_grad_()]
    loss, ce, hits = _TritonLinearSoftCE.apply(*fast, teacher, lse, target, argmax, scale, 128 * vocab)
    ref_loss, ref_ce, ref_hits = linear_soft_cross_entropy_reference(*ref, teacher.double(), lse.double(),
                                                                     target, argmax, scale.double())
    assert float(loss) == pytest.approx(float(ref_loss), rel=1e-2)
    assert _rel(ce, ref_ce) < 1e-2 and float((hits == ref_hits).float().mean()) > 0.95
    (loss * 2).backward()
    (ref_loss * 2).backward()
    for a, b in zip(fast, ref):
        assert _rel(a.grad, b.grad) < 2e-2


def test_chunked_linear_acceptance_loss_matches_reference():
    """The acceptance losses' CUDA path (bf16 lm_head, float32 chunks) against the float64 reference."""
    from eagle3flow.model.kernels.acceptance import _ChunkedLinearAcceptance, linear_acceptance_loss_reference

    torch.manual_seed(2)
    n, hidden, vocab = 300, 256, 32000
    x = torch.randn(n, hidden, device="cuda").to(torch.bfloat16)
    w = (torch.randn(vocab, hidden, device="cuda") * 0.2).to(torch.bfloat16)
    teacher = (torch.randn(400, vocab, device="cuda") * 3).to(torch.bfloat16)
    lse, argmax = torch.logsumexp(teacher.float(), -1), teacher.float().argmax(-1)
    target_lse = lse + 0.3      # a quarter of the target's mass outside the draft vocab
    target = torch.randint(0, 400, (n,), device="cuda")
    weights = [torch.rand(n, device="cuda") for _ in range(3)]
    fast = [x.clone().requires_grad_(), w.clone().requires_grad_()]
    ref = [x.double().requires_grad_(), w.double().requires_grad_()]
    loss, ce, alpha, hits = _ChunkedLinearAcceptance.apply(*fast, teacher, lse, target_lse, target, argmax,
                                                           *weights, 128 * vocab)
    ref_loss, ref_ce, ref_alpha, ref_hits = linear_acceptance_loss_reference(
        *ref, teacher.double(), lse.double(), target_lse.double(), target, argmax,
        *(weight.double() for weight in weights))
    assert float(loss) == pytest.approx(float(ref_loss), rel=1e-2)
    assert _rel(ce, ref_ce) < 1e-2 and _rel(alpha, ref_alpha) < 2e-2
    assert float((hits == ref_hits).float().mean()) > 0.95
    (loss * 2).backward()
    (ref_loss * 2).backward()
    # Looser than forward KL's 2e-2: min(p, q) switches side wherever bf16 moves p across q,
    # and the gradient jumps there (an H200 measured 0.044 on 2026-12-04).
    for a, b in zip(fast, ref):
        assert _rel(a.grad, b.grad) < 6e-2


def test_ttt_loss_bf16_acceptance_mix_tracks_fp32():
    """ttt_loss with a mix of forward KL, nla and lk_hybrid at temperature 0.8 under bf16
    autocast gives the loss and gradients of float32 on the same GPU."""
    from eagle3flow.config import section_settings
    from eagle3flow.model.config import DraftConfig
    from eagle3flow.model.draft import Eagle3Draft
    from eagle3flow.train.loss import ttt_loss
    from eagle3flow.train.objective import Objective

    cfg = DraftConfig(hidden_size=256, target_hidden_size=256, num_attention_heads=8,
                      num_key_value_heads=2, head_dim=32, intermediate_size=512, rms_norm_eps=1e-6,
                      rope_theta=10000.0, max_position_embeddings=1024, vocab_size=1000,
                      draft_vocab_size=600, aux_layer_ids=[1, 3, 5])
    torch.manual_seed(0)
    model = Eagle3Draft(cfg)
    with torch.no_grad():
        model.reset_parameters(std=0.05)
        model.embed_tokens.weight.normal_()
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    model = model.cuda()
    lengths = [300, 97, 211]
    n = sum(lengths)
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), device="cuda")
    batch = {"aux": torch.randn(n, 3 * cfg.hidden_size, device="cuda"),
             "last": torch.randn(n, cfg.hidden_size, device="cuda"),
             "input_ids": torch.randint(0, cfg.vocab_size, (n,), device="cuda"),
             "loss_mask": torch.rand(n, device="cuda") < 0.6, "cu_seqlens": cu}
    head = torch.randn(cfg.draft_vocab_size, cfg.hidden_size, device="cuda") * 0.1
    unreachable = torch.randn(cfg.vocab_size - cfg.draft_vocab_size, cfg.hidden_size, device="cuda") * 0.1
    objective = Objective.of(section_settings("train", {"loss": {"forward_kl": 0.5, "nla": 0.25, "lk_hybrid": 0.5},
                                                        "loss_temperature": 0.8}))
    results = {}
    for autocast in (False, True):
        dtype = torch.bfloat16 if autocast else torch.float32
        model.zero_grad(set_to_none=True)
        loss, stats = ttt_loss(model, batch, head.to(dtype), 4, 0.8, autocast, objective=objective,
                               unreachable_head=unreachable.to(dtype))
        loss.backward()
        results[autocast] = (float(loss), [s[2] for s in stats],
                             {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None})
    (loss32, rows32, grads32), (loss16, rows16, grads16) = results[False], results[True]
    assert rows32 == rows16 and min(rows32) > 0
    assert loss16 == pytest.approx(loss32, rel=2e-2)
    assert set(grads16) == set(grads32)
    for name in grads32:
        assert _rel(grads16[name], grads32[name]) < 5e-2, name


def test_batch_loader_copies_ahead_and_dequantizes_fp8_on_the_gpu(tmp_path):
    # The CUDA loader's batches (copied on their own stream, fp8 dequantized on the GPU) are
    # bitwise the host path's, in order, each complete when the training stream reads it.
    from eagle3flow.extract import shards
    from eagle3flow.train.data import BatchLoader, ShardData, collate
    from support.builders import make_random_shards

    data = ShardData(shards.load_manifest(make_random_shards(tmp_path, [300, 17, 256, 90, 400, 33], hidden=64)))
    plan = [[(0, 0), (0, 1)], [(1, 1)], [(0, 3), (0, 2), (1, 0)]]
    for workers in (0, 2):
        loader = BatchLoader(data, plan, 3, torch.device("cuda"), workers, 2)
        for share in plan:
            got = loader.next()
            torch.cuda._sleep(10**6)            # the training stream busy while the next copy runs
            want = collate(data, share, num_steps=3)
            assert set(got) == set(want)
            for key, value in want.items():
                assert torch.equal(got[key].cpu(), value), (workers, key)
            assert got["aux"].is_cuda and got["aux"].dtype == data.hidden_dtype
            assert not got["cu_seqlens"].is_cuda        # host keys stay on the host
