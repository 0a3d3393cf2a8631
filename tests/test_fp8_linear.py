"""fp8 GEMMs (train.fp8_matmuls): the rowwise recipe's three products, on the CPU's emulation
of the kernel (tests/test_cuda_paths.py checks torch._scaled_mm against it)."""
from __future__ import annotations

import pytest
import torch

from eagle3flow.model.config import DraftConfig
from eagle3flow.model.draft import Eagle3Draft
from eagle3flow.model.kernels.fp8_linear import Fp8Weight, fp8_linear, fp8_weight, quantize_rows
from eagle3flow.train.data import to_device
from eagle3flow.train.loss import ttt_loss


def exactly_castable(rows: int, cols: int, seed: int) -> torch.Tensor:
    """Entries in {0, +-1, +-2, +-4} with a 4 in every row and column: every row cast of it and of
    its transpose (scale 4/448, values +-112, +-224, +-448) is exact in e4m3."""
    g = torch.Generator().manual_seed(seed)
    values = torch.tensor([0.0, 1.0, -1.0, 2.0, -2.0, 4.0, -4.0])
    x = values[torch.randint(0, len(values), (rows, cols), generator=g)]
    x[:, 0] = 4.0
    x[0, :] = -4.0
    return x


def products(x, w, dy):
    """fp8_linear's output and both gradients for ``x [M, K]``, ``w [N, K]``, upstream ``dy``."""
    x = x.clone().requires_grad_()
    w = w.clone().requires_grad_()
    y = fp8_linear(x, fp8_weight(w))
    y.backward(dy)
    return y.detach(), x.grad, w.grad


def test_the_three_products_are_exact_where_every_cast_is():
    # 37 tokens: the weight gradient's token dimension is padded to 48 on the way
    x, w, dy = exactly_castable(37, 64, 0), exactly_castable(48, 64, 1), exactly_castable(37, 48, 2)
    y, dx, dw = products(x, w, dy)
    d = torch.float64
    torch.testing.assert_close(y.double(), x.double() @ w.double().t(), rtol=1e-6, atol=1e-4)
    torch.testing.assert_close(dx.double(), dy.double() @ w.double(), rtol=1e-6, atol=1e-4)
    torch.testing.assert_close(dw.double(), dy.double().t() @ x.to(d), rtol=1e-6, atol=1e-4)


def test_the_products_keep_fp8_precision_on_random_data():
    torch.manual_seed(0)
    x, w, dy = torch.randn(40, 96), torch.randn(80, 96) * 0.05, torch.randn(40, 80)
    y, dx, dw = products(x, w, dy)
    rel = lambda a, b: float((a - b).norm() / b.norm())  # noqa: E731
    # e4m3 keeps 3 mantissa bits: ~3.5% relative error per product, where a transposed operand
    # or a scale on the wrong side would be off by ~100%
    assert rel(y, x @ w.t()) < 0.06
    assert rel(dx, dy @ w) < 0.06
    assert rel(dw, dy.t() @ x) < 0.06


def test_rows_are_scaled_to_the_fp8_range():
    x = torch.tensor([[1e-3, -2e-3, 0.0], [300.0, 5.0, -900.0]])
    q, scale = quantize_rows(x)
    assert q.dtype == torch.float8_e4m3fn and q.is_contiguous()
    assert q.float().abs().amax(1).tolist() == [448.0, 448.0]
    torch.testing.assert_close(q.float() * scale, x, rtol=0.07, atol=0)


def test_a_weight_the_kernel_cannot_take_stays_bf16():
    assert isinstance(fp8_weight(torch.randn(32, 48)), Fp8Weight)
    plain = torch.randn(32, 40)            # 40 is no multiple of 16
    assert fp8_weight(plain) is plain


@pytest.mark.parametrize("target", [
    {"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
     "intermediate_size": 128, "vocab_size": 97, "max_position_embeddings": 256},
    {"model_type": "deepseek_v3", "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 4,
     "intermediate_size": 128, "vocab_size": 97, "max_position_embeddings": 256, "q_lora_rank": 32,
     "kv_lora_rank": 16, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16},
], ids=["llama", "mla"])
def test_a_ttt_step_with_fp8_matmuls_matches_bf16_within_fp8_precision(target):
    cfg = DraftConfig.from_target_config(target, [1, 2, 3], 50)
    torch.manual_seed(0)
    model = Eagle3Draft(cfg)
    model.t2d[:50] = True
    head = torch.randn(50, 64)
    cu = torch.tensor([0, 20, 45])
    n = int(cu[-1])
    batch = to_device({"aux": torch.randn(n, 192), "last": torch.randn(n, 64),
                       "input_ids": torch.randint(0, 97, (n,)), "loss_mask": torch.ones(n, dtype=torch.long),
                       "cu_seqlens": cu}, torch.device("cpu"))
    results = []
    for fp8 in (False, True):
        model.fp8_matmuls = fp8
        model.zero_grad()
        loss, _ = ttt_loss(model, batch, head, 3, 0.8, False)
        loss.backward()
        results.append((loss.item(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}))
    weights = model.step_weights(torch.float32, fp8=True)
    fp8_keys = {k for k, v in weights.items() if isinstance(v, Fp8Weight)}
    assert {"w_o", "w_gate_up", "w_down"} <= fp8_keys
    assert ({"w_embed", "w_hidden"} <= fp8_keys) == (cfg.architecture == "llama")
    (loss_bf16, grads_bf16), (loss_fp8, grads_fp8) = results
    assert loss_fp8 != loss_bf16 and abs(loss_fp8 - loss_bf16) < 0.02 * abs(loss_bf16)
    assert grads_fp8.keys() == grads_bf16.keys()
    for name, g in grads_bf16.items():
        cosine = float(torch.nn.functional.cosine_similarity(grads_fp8[name].flatten(), g.flatten(), dim=0))
        assert cosine > 0.98, (name, cosine)
