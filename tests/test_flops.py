"""The FLOP count the MFU divides by (eagle3flow/model/flops.py) against torch's own count of
one real training step, and the MFU's denominators."""
from __future__ import annotations

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from eagle3flow.model.config import DraftConfig
from eagle3flow.model.draft import Eagle3Draft
from eagle3flow.model.flops import OVER_PEAK, PeakFlops, attention_widths, train_flops_per_token
from eagle3flow.train.loss import ttt_loss

MLA = dict(architecture="mla", num_key_value_heads=4, head_dim=24, q_lora_rank=32, kv_lora_rank=32,
           qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16)
DRAFTS = {
    "llama": {"norm_before_fc": True, "norm_output": True},     # the project's Llama default
    "llama-paper": {},                                           # fc reads the raw aux states
    "mla": {**MLA, "norm_output": True},                         # the project's MLA default
    "mla-q_proj-fc_norm": {**MLA, "q_lora_rank": None, "fc_norm": True},
}


def tiny_config(**kw) -> DraftConfig:
    values = dict(hidden_size=64, target_hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=16, intermediate_size=128, rms_norm_eps=1e-6, rope_theta=10000.0,
                  max_position_embeddings=256, vocab_size=256, draft_vocab_size=128, aux_layer_ids=[1, 2, 3])
    return DraftConfig(**{**values, **kw})


@pytest.mark.parametrize("draft", DRAFTS)
def test_flop_count_matches_torch_counting_a_training_step(draft):
    """ttt_loss and its backward, as the trainer runs them, under FlopCounterMode."""
    cfg = tiny_config(**DRAFTS[draft])
    torch.manual_seed(0)
    model = Eagle3Draft(cfg).train()
    model.t2d[:cfg.draft_vocab_size] = True
    samples, length, steps = 2, 32, 3
    n = samples * length
    g = torch.Generator().manual_seed(1)
    batch = {"aux": torch.randn(n, cfg.num_aux * cfg.target_hidden_size, generator=g),
             "last": torch.randn(n, cfg.hidden_size, generator=g),
             "input_ids": torch.randint(0, cfg.vocab_size, (n,), generator=g),
             "loss_mask": torch.rand(n, generator=g) < 0.6,        # a chat mask: the lm_head skips rows
             "cu_seqlens": torch.arange(samples + 1) * length}
    teacher_head = torch.randn(cfg.draft_vocab_size, cfg.hidden_size, generator=g)
    with FlopCounterMode(display=False) as counter:
        loss, stats = ttt_loss(model, batch, teacher_head, steps, 0.8, autocast=False)
        loss.backward()
    counted = counter.get_total_flops()
    scored = sum(rows for _, _, rows in stats)
    # The CPU attention (exact_cache_tail_attention) scores every key of the padded sample,
    # not only the causal ones a flash kernel visits: its context is the whole sample.
    flops = train_flops_per_token(cfg, steps, mean_context=length, scored_share=scored / (n * steps))
    formula = n * flops["total"]
    assert formula == pytest.approx(counted, rel=0.05), (formula / counted, counter.get_flop_counts()["Global"])
    # Exactly, but for the chain's own keys, which that path scores element-wise (uncounted).
    score_width, value_width = attention_widths(cfg)
    tail = n * 3 * 2 * cfg.num_attention_heads * (score_width + value_width) * sum(range(steps))
    assert formula - tail == pytest.approx(counted, rel=1e-9)
    assert n * flops["per_row"] + scored * flops["per_scored"] == pytest.approx(formula)


def test_mla_counts_its_own_projections_not_a_llama_layers():
    """A Kimi-K2.5-shaped MLA draft: its low-rank q/kv projections are far cheaper than the
    Llama layer of the same heads the count once took it for."""
    kimi = {"model_type": "kimi_k2", "hidden_size": 7168, "intermediate_size": 18432, "num_attention_heads": 64,
            "num_key_value_heads": 64, "kv_lora_rank": 512, "q_lora_rank": 1536, "qk_nope_head_dim": 128,
            "qk_rope_head_dim": 64, "v_head_dim": 128, "vocab_size": 163840, "max_position_embeddings": 4096}
    mla = DraftConfig.from_target_config(kimi, [2, 30, 58], 32000)
    as_llama = DraftConfig.from_target_config(kimi, [2, 30, 58], 32000, {"architecture": "llama"})
    # per row and step, forward: q_a, q_b, kv_a, kv_b, o, then gate/up and down
    projections = 2 * (14336 * 1536 + 1536 * 64 * 192 + 14336 * 576 + 512 * 64 * 256 + 64 * 128 * 7168)
    mlp = 2 * 3 * 7168 * 18432
    # backward: the weights' and inputs' gradients, but none for the frozen embeddings' half of
    # the stacked q_a/kv_a product
    frozen_input_grad = 2 * 7168 * (1536 + 576)
    layer = train_flops_per_token(mla, 1, 0)["layer"]
    assert layer == 3 * (projections + mlp) - frozen_input_grad
    assert train_flops_per_token(as_llama, 1, 0)["layer"] > layer


def test_mfu_names_its_denominators_and_is_never_above_one():
    """A rate measured while the machine was busy comes out low: it is measured again; an
    achieved rate above it even then means the FLOP count is wrong, and the line says so."""
    peak = PeakFlops(torch.device("cpu"), None)
    first = peak.value
    half = peak.mfu(first / 2)
    assert half["mfu"] == pytest.approx(0.5) and half["mfu_basis"] == "measured matmul"
    assert half["mfu_datasheet"] is None and half["datasheet_peak_flops"] is None     # no datasheet for a CPU
    assert peak.describe(half) == f"50.0% of {first / 1e12:.4g} TFLOP/s measured matmul"
    too_fast = peak.mfu(first * 1000)
    assert too_fast["mfu"] is None and peak.remeasured and too_fast["mfu_peak_flops"] >= first
    assert peak.describe(too_fast).startswith(OVER_PEAK)
    configured = PeakFlops(torch.device("cpu"), 1e12)
    assert configured.mfu(5e11) == {"mfu": 0.5, "mfu_peak_flops": 1e12, "mfu_basis": "configured",
                                    "mfu_datasheet": None, "datasheet_peak_flops": None}
    assert configured.mfu(2e12)["mfu"] is None


def test_an_h200_reports_its_datasheet_peak_beside_the_measured_rate(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H200")
    monkeypatch.setattr("eagle3flow.model.flops.measure_matmul_flops", lambda *a, **kw: 800e12)
    peak = PeakFlops(torch.device("cuda"), None)
    row = peak.mfu(400e12)
    assert row["mfu"] == pytest.approx(0.5) and row["mfu_datasheet"] == pytest.approx(400 / 989)
    assert peak.describe(row) == "50.0% of 800 TFLOP/s measured matmul, 40.4% of the H200's dense bf16 989 TFLOP/s"
    assert "H200 datasheet dense bf16 989 TFLOP/s" in peak.rate_text()


@pytest.mark.parametrize("draft", DRAFTS)
def test_muon_flops_match_torch_counting_a_real_muon_step(draft):
    """The plan's and the MFU's count of Muon's Newton-Schulz products, from the config's
    shapes alone, against the optimizer the trainer builds, stepped under FlopCounterMode."""
    from eagle3flow.config import section_settings
    from eagle3flow.model.optimizer_flops import NEWTON_SCHULZ_STEPS, optimizer_flops_per_step
    from eagle3flow.train.optim import build_optimizers

    cfg = tiny_config(**DRAFTS[draft])
    model = Eagle3Draft(cfg).train()
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    optimizers = build_optimizers(named, section_settings("train", {"optimizer": "muon"}), torch.device("cpu"))
    muon = optimizers.optimizers["muon"]
    stepped = [tuple(p.shape) for group in muon.param_groups for p in group["params"]]
    assert sorted(stepped) == sorted(cfg.hidden_matrix_shapes())
    assert sum(r * c for r, c in stepped) == cfg.trainable_param_counts()["matrices"]
    assert all(group["ns_steps"] == NEWTON_SCHULZ_STEPS for group in muon.param_groups)
    for p in model.parameters():
        if p.requires_grad:
            p.grad = torch.randn_like(p)
    with FlopCounterMode(display=False) as counter:
        muon.step()
    assert optimizer_flops_per_step(cfg, "muon") == counter.get_total_flops()
    assert optimizer_flops_per_step(cfg, "adamw") == 0
