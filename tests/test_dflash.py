"""The DFlash draft: its forward against a one-block-at-a-time reference of vLLM's serving
loop, its loss (anchors, position weights, targets), its config and export, and vLLM (CPU)
serving an exported, briefly trained draft losslessly with the replay's acceptance."""
from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from eagle3flow.model.dflash import DFlashDraft
from eagle3flow.layers import default_dflash_layer_ids
from eagle3flow.model.dflash_config import DFlashConfig
from eagle3flow.model.draft import PackedLayout, apply_rope


@pytest.fixture
def one_thread():
    """Small matrices on a shared 2-core box: a second torch thread only waits on the
    first (training runs 10x slower with two threads on a loaded machine)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def tiny_config(**overrides) -> DFlashConfig:
    values = dict(hidden_size=64, target_hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, intermediate_size=96, rms_norm_eps=1e-6,
                  rope_theta=10000.0, max_position_embeddings=512, vocab_size=100,
                  target_layer_ids=[1, 3, 5], block_size=4, mask_token_id=99, torch_dtype="float32")
    return DFlashConfig(**{**values, **overrides})


def random_draft(cfg: DFlashConfig, seed: int = 0) -> DFlashDraft:
    torch.manual_seed(seed)
    model = DFlashDraft(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.3 * torch.randn_like(p))     # norms away from 1: every weight matters
    return model.eval()


def serve_one_block(model: DFlashDraft, aux: torch.Tensor, ids: torch.Tensor, anchor: int) -> torch.Tensor:
    """One block as vLLM drafts it, written independently of the packed forward: the
    context K/V of rows ``0..anchor-1`` (hidden_norm(fc(aux)) through each layer's k/v
    projections, no input norm), the block ``[x[anchor], M...]`` attending to that
    context and to itself without a causal mask. Returns ``norm(h)`` ``[B, H]``."""
    cfg = model.config
    ctx = model.hidden_norm(model.fc(aux[:anchor]))
    tokens = torch.tensor([int(ids[anchor])] + [cfg.mask_token_id] * (cfg.block_size - 1))
    h = model.embed_tokens(tokens)
    pos_ctx, pos_blk = torch.arange(anchor), anchor + torch.arange(cfg.block_size)
    for layer in model.layers:
        attn = layer.self_attn

        def heads(x, n):
            return x.view(x.shape[0], n, cfg.head_dim)

        cos_c, sin_c = model.rope(pos_ctx, torch.float32)
        cos_b, sin_b = model.rope(pos_blk, torch.float32)
        x = layer.input_layernorm(h)
        q = apply_rope(attn.q_norm(heads(attn.q_proj(x), cfg.num_attention_heads)), cos_b, sin_b)
        k = torch.cat([apply_rope(attn.k_norm(heads(attn.k_proj(ctx), cfg.num_key_value_heads)), cos_c, sin_c),
                       apply_rope(attn.k_norm(heads(attn.k_proj(x), cfg.num_key_value_heads)), cos_b, sin_b)])
        v = torch.cat([heads(attn.v_proj(ctx), cfg.num_key_value_heads), heads(attn.v_proj(x), cfg.num_key_value_heads)])
        out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                             enable_gqa=True).transpose(0, 1)
        h = h + attn.o_proj(out.reshape(cfg.block_size, -1))
        h = h + layer.mlp(layer.post_attention_layernorm(h))
    return model.norm(h)


def test_packed_blocks_equal_served_blocks(one_thread):
    """Every anchor of two packed samples gets the block vLLM's loop would compute for it:
    only its own sample's rows before it as context."""
    cfg = tiny_config()
    model = random_draft(cfg)
    g = torch.Generator().manual_seed(1)
    lengths = [9, 13]
    aux = torch.randn(sum(lengths), cfg.num_aux * 64, generator=g)
    ids = torch.randint(0, 99, (sum(lengths),), generator=g)
    cu = torch.tensor([0, 9, 22])
    anchors = torch.tensor([1, 4, 8, 10, 15, 21])
    with torch.no_grad():
        packed = model.block_hidden(aux, ids, cu, anchors, anchor_chunk=4)
        for m, g_row in enumerate(anchors.tolist()):
            start = 0 if g_row < 9 else 9
            ref = serve_one_block(model, aux[start:], ids[start:], g_row - start)
            torch.testing.assert_close(packed[m], ref, rtol=1e-5, atol=1e-5)
        # predict_blocks: one sample, every anchor, the masked slots' argmax
        blocks = model.predict_blocks(aux[9:], ids[9:])
        ref = model.lm_head(serve_one_block(model, aux[9:], ids[9:], 5)[1:]).argmax(-1)
        assert blocks.shape == (13, 3) and torch.equal(blocks[5], ref)


def test_default_target_layers_and_config_roundtrip():
    # The paper's Qwen3-8B draft (36 target layers, 5 draft layers) reads the outputs of
    # layers 1, 9, 17, 25, 33: this project's ids are one more.
    assert default_dflash_layer_ids(36, 5) == [2, 10, 18, 26, 34]
    assert default_dflash_layer_ids(8, 1) == [5]
    target = {"hidden_size": 64, "num_attention_heads": 2, "num_key_value_heads": 1, "intermediate_size": 128,
              "num_hidden_layers": 8, "vocab_size": 512, "rms_norm_eps": 1e-6, "max_position_embeddings": 512,
              "rope_theta": 10000.0, "torch_dtype": "float32"}
    cfg = DFlashConfig.from_target_config(target, block_size=8, mask_token_id=0, num_hidden_layers=3)
    assert cfg.head_dim == 32 and cfg.target_layer_ids == [2, 4, 6] and cfg.num_speculative_tokens == 7
    hf = cfg.to_hf_config()
    assert hf["architectures"] == ["DFlashDraftModel"] and hf["block_size"] == 8
    assert hf["dflash_config"] == {"mask_token_id": 0, "target_layer_ids": [1, 3, 5]}
    assert DFlashConfig.from_hf_config(hf) == cfg
    with pytest.raises(ValueError, match="out of range"):
        DFlashConfig.from_target_config(target, 8, 0, target_layer_ids=[2, 8])
    with pytest.raises(ValueError, match="mask_token_id"):
        tiny_config(mask_token_id=100)



def test_replay_counts_a_last_rounds_drafts_past_the_end_as_vllm_does():
    from eagle3flow.eval.replay import replay_greedy_speculation

    # prompt of 2, output of 4 (ids 2..5), the target's continuation 6, 7 known beyond it
    ids = list(range(8))
    chains = [[t + 2, t + 3] for t in range(8)]          # K = 2, right everywhere but
    chains[1] = [3, 99]                                   # the first round's second guess
    capped = replay_greedy_speculation(chains[:6], ids[:6], 2)
    exact = replay_greedy_speculation(chains, ids, 2, end=6)
    # round 2 starts with one token (5) left to generate and drafts 5, 6: vLLM counts both
    assert capped["per_round"] == [1, 1] and exact["per_round"] == [1, 2]
    assert exact["accepted_per_pos"] == [2, 1]
    with pytest.raises(ValueError, match="end"):
        replay_greedy_speculation(chains, ids, 2, end=9)


def packed_batch(cfg: DFlashConfig, lengths: list[int], seed: int = 2) -> dict:
    g = torch.Generator().manual_seed(seed)
    n = sum(lengths)
    loss_mask = torch.ones(n, dtype=torch.uint8)
    start = 0
    for length in lengths:
        loss_mask[start:start + 3] = 0                     # a 3-token prompt per sample
        start += length
    return {"aux": torch.randn(n, cfg.num_aux * 64, generator=g), "input_ids": torch.randint(0, 99, (n,), generator=g),
            "cu_seqlens": torch.tensor([0] + lengths).cumsum(0), "loss_mask": loss_mask,
            "last": torch.randn(n, 64, generator=g)}


def test_anchors_are_assistant_tokens_with_context_and_a_next_token():
    from eagle3flow.train.dflash_loss import sample_anchors

    cfg = tiny_config()
    batch = packed_batch(cfg, [10, 5, 12])
    anchors = sample_anchors(batch["cu_seqlens"], batch["loss_mask"], 4, torch.Generator().manual_seed(0))
    again = sample_anchors(batch["cu_seqlens"], batch["loss_mask"], 4, torch.Generator().manual_seed(0))
    assert torch.equal(anchors, again) and torch.equal(anchors, anchors.sort().values)
    per_sample = [[a - s for a in anchors.tolist() if s <= a < e] for s, e in ((0, 10), (10, 15), (15, 27))]
    # assistant rows 3..len-2 (the last row has nothing after it to predict)
    assert [len(p) for p in per_sample] == [4, 1, 4]
    assert all(3 <= p <= length - 2 for rows, length in zip(per_sample, (10, 5, 12)) for p in rows)
    everything = sample_anchors(batch["cu_seqlens"], batch["loss_mask"], 100, torch.Generator().manual_seed(0))
    assert everything.tolist() == list(range(3, 9)) + [13] + list(range(18, 26))


@pytest.mark.parametrize("target", ["hard", "soft"])
def test_loss_is_the_position_weighted_block_cross_entropy(target, one_thread):
    from eagle3flow.train.dflash_loss import dflash_loss, position_weights

    cfg = tiny_config(block_size=5)
    model = random_draft(cfg)
    batch = packed_batch(cfg, [10, 12])
    batch["loss_mask"][7] = 0          # an unscored row inside a block
    anchors = torch.tensor([3, 6, 8, 13, 20])
    loss, stats = dflash_loss(model, batch, anchors, gamma=2.0, target=target)
    assert torch.allclose(position_weights(5, 2.0), torch.exp(-torch.arange(4.0) / 2.0))
    # by hand: each anchor's block, slot k predicting row anchor+k, weight exp(-(k-1)/2)
    num = den = 0.0
    with torch.no_grad():
        for a in anchors.tolist():
            end = 10 if a < 10 else 22
            hidden = model.block_hidden(batch["aux"], batch["input_ids"], batch["cu_seqlens"], torch.tensor([a]))[0]
            log_probs = torch.log_softmax(model.lm_head(hidden), -1)
            for k in range(1, 5):
                row = a + k
                if row >= end or not batch["loss_mask"][row]:
                    continue
                if target == "hard":
                    ce = -log_probs[k, batch["input_ids"][row]]
                else:
                    ce = -(torch.softmax(model.lm_head(batch["last"][row - 1]), -1) * log_probs[k]).sum()
                w = torch.exp(torch.tensor(-(k - 1) / 2.0))
                num, den = num + w * ce, den + w
    torch.testing.assert_close(loss.detach(), num / den)
    # per slot: anchors 8 and 20 reach past their samples after slot 1, row 7 (unscored) is
    # slot 4 of anchor 3 and slot 1 of anchor 6, only anchor 13's block fits whole
    assert stats["slot_rows"] == [4, 3, 3, 1] and stats["anchors"] == 5
    loss.backward()
    assert model.embed_tokens.weight.grad is None and model.lm_head.weight.grad is None
    assert model.fc.weight.grad.abs().sum() > 0 and model.layers[1].mlp.down_proj.weight.grad.abs().sum() > 0


def test_dpace_weighs_each_slot_by_the_accepted_tokens_an_error_there_costs(one_thread):
    """D-PACE by hand: q = the draft's probability of the label, smoothed (1-a)q + a, the
    chance the run reaches slot m is the product up to m, slot j weighs the sum of those
    chances from j on (scored slots only); loss = sum w CE / scored slots; the weights carry
    no gradient, so the gradient is that of CE scaled by them."""
    from eagle3flow.train.dflash_loss import dflash_loss

    cfg = tiny_config(block_size=5)
    model = random_draft(cfg)
    batch = packed_batch(cfg, [10, 12])
    batch["loss_mask"][7] = 0
    anchors = torch.tensor([3, 6, 8, 13, 20])
    alpha = 0.3
    loss, stats = dflash_loss(model, batch, anchors, gamma=2.0, weighting="dpace", dpace_alpha=alpha)
    terms, weights_by_hand, scored_slots = [], [], 0
    for a in anchors.tolist():
        end = 10 if a < 10 else 22
        hidden = model.block_hidden(batch["aux"], batch["input_ids"], batch["cu_seqlens"], torch.tensor([a]))[0]
        log_probs = torch.log_softmax(model.lm_head(hidden), -1)
        ce, ok = [], []
        for k in range(1, 5):
            row = min(a + k, 21)
            ce.append(-log_probs[k, batch["input_ids"][row]])
            ok.append(a + k < end and bool(batch["loss_mask"][a + k]))
        reach, prefix = [], 1.0
        for c, scored in zip(ce, ok):
            prefix *= ((1 - alpha) * float(torch.exp(-c.detach())) + alpha) if scored else 1.0
            reach.append(prefix if scored else 0.0)
        for j in range(4):
            if ok[j]:
                w = sum(reach[j:])
                weights_by_hand.append(w)
                terms.append(w * ce[j])
                scored_slots += 1
    expected = torch.stack(terms).sum() / scored_slots
    torch.testing.assert_close(loss, expected)
    model.zero_grad()
    loss.backward()
    grad = model.fc.weight.grad.clone()
    model.zero_grad()
    # the same weights as constants: the same gradient
    (sum(float(w) * t / w for w, t in zip(weights_by_hand, terms)) / scored_slots).backward()
    torch.testing.assert_close(model.fc.weight.grad, grad)
    assert stats["slot_rows"] == [4, 3, 3, 1]
    with pytest.raises(ValueError, match="position weighting"):
        dflash_loss(model, batch, anchors, gamma=2.0, weighting="linear")


def test_dpace_is_a_setting_that_leaves_decay_runs_keys_alone(tmp_path):
    """dflash.position_weighting: dpace trains through the CLI; at its default (decay) the
    new keys stay out of the stage's settings and of the run's cache key, so a run from
    before D-PACE keeps its checkpoints."""
    from eagle3flow.config import dflash_stage_settings, schema_defaults
    from eagle3flow.train import dflash_train
    from support.builders import make_hidden_states
    from support.targets import make_chat_target

    target = make_chat_target(tmp_path / "target", family="qwen3")
    manifest = make_hidden_states(target, tmp_path / "hs", 6, seed=0, aux_layer_ids=(2, 6))
    dflash_train.main(["--train-manifest", str(manifest), "--eval-manifest", str(manifest), "--target", str(target),
                       "--cache-root", str(tmp_path / "cache"), "--out-dir", str(tmp_path / "train"),
                       "--config-json", json.dumps({"block_size": 3, "steps": 2, "position_weighting": "dpace"})])
    assert json.loads((tmp_path / "train" / "eval.json").read_text())["loss"] > 0

    config = {"dflash": schema_defaults("dflash"), "target": schema_defaults("target")}
    assert "position_weighting" not in dflash_stage_settings(config)
    config["dflash"] = {**config["dflash"], "position_weighting": "dpace"}
    assert dflash_stage_settings(config)["position_weighting"] == "dpace"
    settings = {**schema_defaults("dflash"), "trust_remote_code": False}
    before = {k: v for k, v in settings.items() if k not in ("position_weighting", "dpace_alpha")}
    key = dflash_train.run_fingerprint(settings, manifest, target, torch.device("cpu"))
    assert key == dflash_train.run_fingerprint(before, manifest, target, torch.device("cpu"))
    assert key != dflash_train.run_fingerprint({**settings, "position_weighting": "dpace"}, manifest, target,
                                               torch.device("cpu"))


def shard_samples(cfg: DFlashConfig, n: int) -> list[dict]:
    """``n`` samples of 11 rows as a manifest hands them over."""
    samples = []
    for i in range(n):
        b = packed_batch(cfg, [11], seed=10 + i)
        samples.append({"input_ids": b["input_ids"], "loss_mask": b["loss_mask"],
                        "aux_hidden_states": b["aux"], "last_hidden_state": b["last"]})
    return samples


def test_training_is_reproducible_on_the_cpu(one_thread):
    from eagle3flow.train.dflash_train import train_dflash

    cfg = tiny_config()
    samples = shard_samples(cfg, 6)
    runs = []
    for _ in range(2):
        model = random_draft(cfg)
        history = train_dflash(model, samples, steps=6, samples_per_step=4, anchors_per_sample=3, seed=5)
        runs.append((model.trainable_state_dict(), [h["loss"] for h in history]))
    assert runs[0][1] == runs[1][1] and runs[0][1][-1] < runs[0][1][0]
    assert all(torch.equal(runs[0][0][k], runs[1][0][k]) for k in runs[0][0])


def test_a_run_resumed_from_its_checkpoint_equals_an_uninterrupted_one_bitwise(tmp_path, one_thread):
    """Checkpoints every 2 steps; a draft with other trained weights resumed from the step-4
    checkpoint, as written to and read from disk, ends bitwise where the uninterrupted run
    ended: weights and every step's loss."""
    from eagle3flow.train.checkpoint import list_checkpoints, save_checkpoint
    from eagle3flow.model.dflash_config import DFLASH_KEEP_CHECKPOINTS
    from eagle3flow.train.dflash_train import train_dflash

    cfg = tiny_config()
    samples = shard_samples(cfg, 6)
    run_dir = tmp_path / "run"
    model = random_draft(cfg)
    history = train_dflash(model, samples, steps=6, samples_per_step=4, anchors_per_sample=3, seed=5,
                           checkpoint=lambda step, state: save_checkpoint(run_dir, step, state,
                                                                          DFLASH_KEEP_CHECKPOINTS),
                           checkpoint_every=2)
    # The last two (DFLASH_KEEP_CHECKPOINTS), the final step's among them: a rerun ends there
    assert [step for step, _ in list_checkpoints(run_dir)] == [4, 6]
    resumed = random_draft(cfg)          # the frozen embeddings and lm_head are the target's: the same
    with torch.no_grad():                # the trained weights elsewhere: the checkpoint must bring them
        for name, p in resumed.named_parameters():
            if name not in resumed.FROZEN:
                p.normal_()
    state = torch.load(list_checkpoints(run_dir)[0][1] / "state.pt", weights_only=False)
    resumed_history = train_dflash(resumed, samples, steps=6, samples_per_step=4, anchors_per_sample=3, seed=5,
                                   resume=state)
    assert [h["loss"] for h in resumed_history] == [h["loss"] for h in history]
    final, again = model.trainable_state_dict(), resumed.trainable_state_dict()
    assert all(torch.equal(final[k], again[k]) for k in final)


def test_export_has_the_names_and_config_vllm_reads(random_llama_target, tmp_path, one_thread):
    """config.json and model.safetensors as qwen3_dflash.py loads them; no embed_tokens or
    lm_head (vLLM shares the target's); loading the export back gives the same blocks."""
    from safetensors import safe_open

    from eagle3flow.export.dflash import export_dflash, load_exported_dflash
    from eagle3flow.target.config import load_target_config
    from eagle3flow.train.dflash_train import build_dflash_draft, save_train_dir

    cfg = DFlashConfig.from_target_config(load_target_config(random_llama_target), block_size=4,
                                          mask_token_id=0, num_hidden_layers=2)
    model = build_dflash_draft(random_llama_target, cfg, seed=0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.requires_grad:
                p.add_(0.05 * torch.randn_like(p))
    out = export_dflash(save_train_dir(model, tmp_path / "train"), random_llama_target, tmp_path / "draft")
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["DFlashDraftModel"] and config["model_type"] == "qwen3"
    assert config["num_hidden_layers"] == 2 and config["block_size"] == 4 and config["torch_dtype"] == "float32"
    # the paper's layers for 2 draft layers of an 8-layer target: outputs of layers 1 and 5
    assert config["dflash_config"] == {"mask_token_id": 0, "target_layer_ids": [1, 5]}
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert names == set(cfg.exported_param_names())
    assert {"fc.weight", "hidden_norm.weight", "norm.weight", "layers.1.self_attn.k_norm.weight"} <= names
    assert not any("embed_tokens" in n or "lm_head" in n for n in names)
    loaded = load_exported_dflash(out, random_llama_target)
    aux, ids = torch.randn(15, 128), torch.randint(0, 512, (15,))
    torch.testing.assert_close(loaded.predict_blocks(aux, ids), model.eval().predict_blocks(aux, ids), rtol=0, atol=0)


VLLM_SCRIPT = r"""
import json, os, sys
os.environ["VLLM_CPU_KVCACHE_SPACE"] = "1"
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
import torch
from vllm import LLM, SamplingParams
from vllm import _custom_ops as ops
req = json.loads(sys.argv[1])
# qwen3_dflash.py norms every layer's context keys in one rms_norm call with the layers'
# k_norm weights stacked [L, head_dim]; report whether this build's kernel honours the rows
x, w = torch.randn(2, 3, 1, 8), torch.stack([torch.ones(8), 2 * torch.ones(8)])
out = torch.empty_like(x)
ops.rms_norm(out, x, w, 1e-6)
grouped_ok = bool(torch.allclose(out[1], 2 * x[1] * torch.rsqrt(x[1].pow(2).mean(-1, keepdim=True) + 1e-6)))
llm = LLM(model=req["target"], dtype="float32", max_model_len=512, enforce_eager=True, seed=0,
          disable_log_stats=False, distributed_executor_backend="uni",
          speculative_config={"method": "dflash", "model": req["draft"], "num_speculative_tokens": req["k"]})
outs = llm.generate([{"prompt_token_ids": p} for p in req["prompts"]],
                    SamplingParams(temperature=0.0, max_tokens=req["max_tokens"], ignore_eos=True), use_tqdm=False)
metrics = {m.name: (list(m.values) if hasattr(m, "values") else m.value)
           for m in llm.get_metrics() if m.name.startswith("vllm:spec_decode")}
print("RESULT " + json.dumps({"outputs": [list(o.outputs[0].token_ids) for o in outs], "metrics": metrics,
                              "grouped_rms_norm_ok": grouped_ok}))
"""


def add_word_tokenizer(target: Path, vocab_size: int) -> None:
    """A word-level tokenizer (``t0``..``tN``) so vLLM loads the tokenizer-less random target."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab_size)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0", pad_token="t0", bos_token="t1",
                            eos_token="t2").save_pretrained(target)


@pytest.mark.slow
def test_vllm_serves_a_trained_dflash_draft_losslessly_as_the_replay_predicts(random_llama_target, tmp_path,
                                                                            one_thread):
    """A two-layer DFlash draft (two target layers) briefly trained on the tiny target's
    own hidden states, exported and served by vLLM (CPU, method dflash): greedy outputs
    equal the target's alone, vLLM's counters are consistent and equal the offline
    replay's exactly, and the trained draft accepts more than a random one."""
    from transformers import AutoModelForCausalLM

    from eagle3flow.eval.dflash_replay import replay_dflash
    from eagle3flow.export.dflash import export_dflash, load_exported_dflash
    from eagle3flow.target.config import load_target_config
    from eagle3flow.train.dflash_train import build_dflash_draft, load_samples, save_train_dir, train_dflash
    from support.builders import make_hidden_states

    target = tmp_path / "target"
    shutil.copytree(random_llama_target, target)
    add_word_tokenizer(target, 512)
    # The mask is the last vocab row: row 0 is the pad row, zero in HF's init, and a zero
    # mask embedding gives every masked slot a zero first-layer query (all slots alike).
    cfg = DFlashConfig.from_target_config(load_target_config(target), block_size=4, mask_token_id=511,
                                          num_hidden_layers=2)
    assert cfg.target_layer_ids == [2, 6]
    manifest = make_hidden_states(target, tmp_path / "hs", 400, seed=0, aux_layer_ids=tuple(cfg.target_layer_ids))
    model = build_dflash_draft(target, cfg, seed=0)
    history = train_dflash(model, load_samples(manifest, cfg), steps=1000, lr=1e-2, seed=0)
    # vLLM 0.32's CPU rms_norm reads a stacked [L, head_dim] weight as its row 0, so on the
    # CPU every layer's context keys get layer 0's k_norm (the XPU kernel had the same
    # defect, vllm PR 56431). Tied k_norm weights make the served draft the replayed one.
    with torch.no_grad():
        for layer in model.layers[1:]:
            layer.self_attn.k_norm.weight.copy_(model.layers[0].self_attn.k_norm.weight)
    draft = export_dflash(save_train_dir(model, tmp_path / "train"), target, tmp_path / "draft")

    k, max_tokens = cfg.num_speculative_tokens, 32
    prompts = torch.randint(3, 512, (8, 4), generator=torch.Generator().manual_seed(3))
    hf = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    with torch.no_grad():
        # K tokens past max_tokens: vLLM counts a last round's drafts before it cuts the output
        greedy = hf.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=max_tokens + k,
                             min_new_tokens=max_tokens + k, do_sample=False, pad_token_id=0)
    request = {"target": str(target), "draft": str(draft), "k": k, "prompts": prompts.tolist(),
               "max_tokens": max_tokens}
    started = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", VLLM_SCRIPT, json.dumps(request)], capture_output=True, text=True,
                          env={**os.environ, "HF_HUB_OFFLINE": "1"}, cwd=tmp_path, timeout=600)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stdout[-3000:] + proc.stderr[-6000:]
    served = json.loads(lines[-1][len("RESULT "):])
    print(f"vLLM with the DFlash draft: {time.monotonic() - started:.1f} s; grouped rms_norm honours "
          f"per-layer weights: {served['grouped_rms_norm_ok']}")
    assert served["outputs"] == greedy[:, 4:4 + max_tokens].tolist()    # lossless

    m = served["metrics"]
    per_pos = m["vllm:spec_decode_num_accepted_tokens_per_pos"]
    assert m["vllm:spec_decode_num_draft_tokens"] == k * m["vllm:spec_decode_num_drafts"]
    assert sum(per_pos) == m["vllm:spec_decode_num_accepted_tokens"]
    assert all(a >= b for a, b in zip(per_pos, per_pos[1:]))

    def replay(draft_model) -> dict:
        totals = {"rounds": 0, "accepted": 0, "accepted_per_pos": [0] * k}
        for ids in greedy:
            with torch.no_grad():
                states = hf(ids[None], output_hidden_states=True).hidden_states
            aux = torch.cat([states[layer][0] for layer in cfg.target_layer_ids], -1)
            one = replay_dflash(draft_model, aux, ids, 4, end=4 + max_tokens)
            totals["rounds"] += one["rounds"]
            totals["accepted"] += one["accepted"]
            totals["accepted_per_pos"] = [a + b for a, b in zip(totals["accepted_per_pos"], one["accepted_per_pos"])]
        return totals

    trained = replay(load_exported_dflash(draft, target))
    untrained = replay(build_dflash_draft(target, cfg, seed=1))
    print(f"DFlash K={k}: vLLM {m}; replay trained {trained}, random {untrained}; "
          f"loss {history[0]['loss']:.3f} -> {history[-1]['loss']:.3f}")
    assert m["vllm:spec_decode_num_drafts"] == trained["rounds"]
    assert m["vllm:spec_decode_num_accepted_tokens"] == trained["accepted"]
    assert per_pos == trained["accepted_per_pos"]
    length = 1 + trained["accepted"] / trained["rounds"]
    random_length = 1 + untrained["accepted"] / untrained["rounds"]
    assert length > random_length + 0.15, (length, random_length)


@pytest.mark.slow
def test_an_mla_targets_dflash_draft_is_served_losslessly_by_the_evaluation(tmp_path, one_thread):
    """The tiny DeepSeek-V3 target (MLA + MoE) and a DFlash draft (GQA attention: its own
    attention need not follow the target's) trained on the target's own hidden states,
    exported and evaluated by the workflow's evaluation on the CPU. vLLM's CPU MLA cache
    and the draft's attention cache share no block size, so every engine runs the target's
    attention dense; the greedy outputs with the draft equal the baseline's, and the exact
    replay sees vLLM's rounds."""
    from eagle3flow.eval.evaluate import EvalOptions, evaluate
    from eagle3flow.export.dflash import export_dflash
    from eagle3flow.target.config import load_target_config
    from eagle3flow.train.dflash_train import (build_dflash_draft, default_mask_token_id, load_samples,
                                               save_train_dir, train_dflash)
    from support.builders import make_hidden_states
    from support.tiny_targets import make_tiny_deepseek_v3

    target = make_tiny_deepseek_v3(tmp_path / "target")
    cfg = DFlashConfig.from_target_config(load_target_config(target), block_size=4, num_hidden_layers=1,
                                          mask_token_id=default_mask_token_id(target))
    manifest = make_hidden_states(target, tmp_path / "hs", 200, seed=0, aux_layer_ids=tuple(cfg.target_layer_ids))
    model = build_dflash_draft(target, cfg, seed=0)
    history = train_dflash(model, load_samples(manifest, cfg), steps=600, lr=3e-3, seed=0)
    assert history[-1]["loss"] < history[0]["loss"]
    draft = export_dflash(save_train_dir(model, tmp_path / "train"), target, tmp_path / "draft")

    prompts = tmp_path / "eval_prompts.jsonl"
    words = ["the", "model", "answers", "a", "question", "about", "cats", "today"]
    prompts.write_text("".join(json.dumps({"id": f"p{i}", "messages": [
        {"role": "user", "content": " ".join(words[(i + j) % 8] for j in range(3 + i))}]}) + "\n"
        for i in range(4)))
    out = tmp_path / "eval" / "summary.json"
    t0 = time.monotonic()
    summary = evaluate(draft, target, prompts, None, out, EvalOptions(
        max_tokens=24, num_prompts=4, device="cpu", temperatures=[0]))
    print(f"evaluate, DFlash on the MLA target: {time.monotonic() - t0:.1f} s; vLLM {summary['vllm']}")
    settings = summary["settings"]
    assert settings["method"] == "dflash" and settings["num_speculative_tokens"] == 3
    assert settings["mla_attention"] == "dense"
    for run in ("vllm_baseline", "vllm_eagle3"):
        assert json.loads((out.parent / f"{run}.json").read_text())["dense_mla"] is True
    assert summary["lossless"]["passed"] is True, summary["lossless"]
    vllm = summary["vllm"]
    assert vllm["num_draft_tokens"] == 3 * vllm["num_drafts"] > 0
    assert vllm["acceptance_length"] > 1.1, vllm      # 1.23 offline; a random draft accepts nothing here
    assert summary["simulated"]["acceptance_length"] == pytest.approx(vllm["acceptance_length"], abs=1e-9)
    rounds = summary["round_agreement"]
    assert rounds["prompts_rounds_equal_but_last"] == rounds["prompts_compared"] == 4, rounds


def test_without_a_spare_row_the_mask_is_a_special_token_the_chat_template_never_writes(tmp_path):
    """SmolLM2's case: the tokenizer fills the embedding and its pad token is its EOS. The
    mask is then the last special token that is none of bos/eos/pad/unk and that a rendered
    conversation never holds; with none left, a pad token that is not EOS."""
    from eagle3flow.target.tokenizer import load_tokenizer
    from eagle3flow.train import dflash_train
    from support.targets import CONVERSATION, make_chat_target

    target = make_chat_target(tmp_path / "target", family="llama3")
    tokenizer = load_tokenizer(target)
    config = json.loads((target / "config.json").read_text())
    (target / "config.json").write_text(json.dumps({**config, "vocab_size": len(tokenizer)}))
    mask = dflash_train.default_mask_token_id(target)
    assert tokenizer.convert_ids_to_tokens(mask) == "<|python_tag|>"
    rendered = tokenizer.apply_chat_template(CONVERSATION, add_generation_prompt=True, tokenize=True)
    rendered = rendered["input_ids"] if hasattr(rendered, "keys") else rendered
    assert mask not in rendered and mask not in (tokenizer.bos_token_id, tokenizer.eos_token_id)

    bare = make_chat_target(tmp_path / "bare")   # its template writes every special token but <pad>
    tokenizer = load_tokenizer(bare)
    config = json.loads((bare / "config.json").read_text())
    (bare / "config.json").write_text(json.dumps({**config, "vocab_size": len(tokenizer)}))
    assert dflash_train.unused_special_tokens(tokenizer, len(tokenizer)) == []
    assert tokenizer.pad_token_id != tokenizer.eos_token_id
    assert dflash_train.default_mask_token_id(bare) == tokenizer.pad_token_id


def test_command_lines_train_and_export_with_the_spare_embedding_row_as_mask(tmp_path, one_thread):
    from safetensors import safe_open

    from eagle3flow.export import dflash as export_cli
    from eagle3flow.target.tokenizer import load_tokenizer
    from eagle3flow.train import dflash_train
    from support.builders import make_hidden_states
    from support.targets import make_chat_target

    target = make_chat_target(tmp_path / "target", family="qwen3")       # a tokenizer of ~400 < 512 rows
    spare = len(load_tokenizer(target))
    assert spare < 512 and dflash_train.default_mask_token_id(target) == spare
    manifest = make_hidden_states(target, tmp_path / "hs", 8, seed=0, aux_layer_ids=(2, 6))
    paths = ["--train-manifest", str(manifest), "--eval-manifest", str(manifest), "--target", str(target),
             "--cache-root", str(tmp_path / "cache")]
    dflash_train.main(paths + ["--out-dir", str(tmp_path / "train"),
                               "--config-json", json.dumps({"block_size": 3, "num_hidden_layers": 2, "steps": 3})])
    assert {p.name for p in (tmp_path / "train").iterdir()} == {
        "draft.safetensors", "draft_config.json", "metrics.jsonl", "eval.json"}
    assert len((tmp_path / "train" / "metrics.jsonl").read_text().splitlines()) == 3
    assert len(json.loads((tmp_path / "train" / "eval.json").read_text())["slot_accuracy"]) == 2
    export_cli.main(["--train-dir", str(tmp_path / "train"), "--target", str(target), "--out-dir", str(tmp_path / "draft")])
    config = json.loads((tmp_path / "draft" / "config.json").read_text())
    # the draft reads the layers the manifest holds (two draft layers, two target layers here)
    assert config["dflash_config"] == {"mask_token_id": spare, "target_layer_ids": [1, 5]} and config["block_size"] == 3
    with safe_open(str(tmp_path / "draft" / "model.safetensors"), "pt") as f:
        assert "layers.1.mlp.down_proj.weight" in set(f.keys())
    with pytest.raises(SystemExit):      # a key the dflash section does not have, refused by name
        dflash_train.main(paths + ["--out-dir", str(tmp_path / "x"), "--config-json", json.dumps({"blocksize": 3})])


def test_a_yarn_target_gets_a_dflash_draft_placing_positions_as_its_eagle3_draft(tmp_path):
    """Kimi-K2.5's text config scales rope by YaRN (factor 64): the DFlash draft takes it as
    the EAGLE-3 Llama-style draft of the same target does (the magnitude scale explicit), and
    its frequencies are YaRN's, not plain rope's."""
    from eagle3flow.model.config import DraftConfig
    from eagle3flow.model.dflash import DFlashDraft, dflash_inv_freq
    from eagle3flow.model.dflash_config import DFlashConfig
    from eagle3flow.model.draft import rope_inv_freq
    from eagle3flow.target.config import load_target_config
    from support.kimi_target import make_kimi_k25_target

    config = load_target_config(make_kimi_k25_target(tmp_path / "kimi"))
    dflash = DFlashConfig.from_target_config(config, block_size=4, mask_token_id=0, num_hidden_layers=1)
    eagle = DraftConfig.from_target_config(config, [1, 3, 5], 64, overrides={"architecture": "llama"})
    assert dflash.rope_scaling["rope_type"] == "yarn" and dflash.rope_scaling == eagle.rope_scaling
    assert dflash.head_dim == eagle.head_dim
    inv, scale = dflash_inv_freq(dflash)
    eagle_inv, eagle_scale = rope_inv_freq(eagle)
    assert torch.allclose(inv, eagle_inv) and scale == pytest.approx(eagle_scale)
    plain, _ = dflash_inv_freq(dataclasses.replace(dflash, rope_scaling=None))
    assert not torch.allclose(inv, plain)
    model = DFlashDraft(dflash).eval()
    ids = torch.randint(0, 64, (12,))
    aux = torch.randn(12, len(dflash.target_layer_ids) * dflash.target_hidden_size)
    with torch.no_grad():
        assert model.predict_blocks(aux, ids).shape == (12, dflash.num_speculative_tokens)


def test_two_processes_apply_the_one_process_update(tmp_path):
    """The DFlash trainer under torchrun (the train rule's launch, train.nproc 2, gloo on the
    CPU): each rank trains a contiguous share of every step's samples (5 a step: 2 and 3)
    with the anchors one process draws, the loss rescaled to the whole batch's, gradients
    summed: the losses, per-slot stats and trained weights are one process's up to
    summation order; rank 0 alone writes."""
    from safetensors.torch import load_file

    from eagle3flow.train.launch import DFLASH_TRAINER, trainer_command
    from support.builders import make_hidden_states
    from support.targets import make_chat_target

    target = make_chat_target(tmp_path / "target", family="qwen3")
    manifest = make_hidden_states(target, tmp_path / "hs", 12, seed=3, aux_layer_ids=(2, 6))
    settings = {"block_size": 4, "steps": 5, "samples_per_step": 5, "anchors_per_sample": 3, "device": "cpu",
                "checkpoint_every": 2}

    def run(nproc: int, out: Path) -> str:
        cmd = [*trainer_command({"nproc": nproc, "nodes": 1, "device": "cpu"}, sys.executable, DFLASH_TRAINER),
               "--train-manifest", str(manifest), "--eval-manifest", str(manifest), "--target", str(target),
               "--out-dir", str(out), "--cache-root", str(tmp_path / f"cache{nproc}"),
               "--config-json", json.dumps(settings)]
        done = subprocess.run(cmd, env={**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"},
                              capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stdout + done.stderr
        return done.stderr

    assert "x 2 process(es)" in run(2, tmp_path / "two")
    run(1, tmp_path / "one")
    two, one = ([json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
                for name in ("two", "one"))
    assert [r["step"] for r in two] == [r["step"] for r in one] == list(range(5))
    for a, b in zip(two, one):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5)
        assert a["slot_rows"] == b["slot_rows"] and a["anchors"] == b["anchors"]
        assert a["slot_accuracy"] == pytest.approx(b["slot_accuracy"], abs=1e-6)
    weights = [load_file(str(tmp_path / name / "draft.safetensors")) for name in ("two", "one")]
    assert weights[0].keys() == weights[1].keys()
    for name in weights[0]:
        torch.testing.assert_close(weights[0][name], weights[1][name], rtol=1e-4, atol=1e-5)
    assert len(list((tmp_path / "cache2").glob("*/step-*"))) >= 1      # rank 0's checkpoints
