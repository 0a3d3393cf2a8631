"""The export against SGLang's EAGLE-3 loader contract (eagle3flow/export/sglang_contract.py, read
from sglang 0.5.23's source): SGLang's CPU build does not install here, so this is the check
instead of a real load (README, "Serving the draft")."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from eagle3flow.export.checkpoint import export_draft
from eagle3flow.export.sglang_contract import sglang_problems
from eagle3flow.target.weights import load_target_config
from eagle3flow.train.build import build_draft, load_vocab_map
from test_export import make_vocab, save_train_dir


def exported(target, tmp_path, ids=(2, 4, 5), overrides=None, name="draft"):
    vmap = make_vocab(json.loads((target / "config.json").read_text())["vocab_size"], 100,
                      tmp_path / f"{name}-vocab.safetensors")
    d2t, t2d = load_vocab_map(vmap)
    model, _ = build_draft(target, list(ids), d2t, t2d, overrides or {}, seed=0)
    out = export_draft(save_train_dir(model, tmp_path / f"{name}-train"), vmap, target, tmp_path / name)
    config = json.loads((out / "config.json").read_text())
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    return config, names


def test_default_export_meets_the_contract(random_llama_target, tmp_path):
    config, names = exported(random_llama_target, tmp_path)
    assert sglang_problems(config, names, load_target_config(random_llama_target)) == []
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 3, 4]
    assert "input_norm.weight" in names and not any(n.startswith("embed_tokens") for n in names)


def test_embeddings_as_aux_state_are_layer_minus_one(random_llama_target, tmp_path):
    """Id 0 (the input of layer 0) is SGLang's -1: before, no eagle_config was written for
    it and SGLang captured its own default layers."""
    config, names = exported(random_llama_target, tmp_path, ids=(0, 4, 7))
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [-1, 3, 6]
    assert sglang_problems(config, names) == []
    del config["eagle_config"]
    assert any("would capture other layers" in p for p in sglang_problems(config, names))


def test_what_sglang_would_serve_wrongly_is_named(random_llama_target, tmp_path, capsys):
    config, names = exported(random_llama_target, tmp_path, overrides={"norm_before_residual": True}, name="nbr")
    assert capsys.readouterr().err.count("SGLang would not serve") == 1
    assert sglang_problems(config, names) == ["norm_before_residual: SGLang does not implement it (vLLM does)"]
    bad = {**config, "architectures": ["Eagle3LlamaForCausalLM"], "tie_word_embeddings": True}
    bad.pop("draft_vocab_size")
    problems = " | ".join(sglang_problems(bad, names | {"model.extra.weight"}))
    for expected in ("architectures ['Eagle3LlamaForCausalLM']", "no draft_vocab_size", "norm_before_residual",
                     "tie_word_embeddings", "drops without a word: ['model.extra.weight']"):
        assert expected in problems, problems


def test_mla_export_meets_the_contract(tmp_path):
    from eagle3flow.tiny_targets import make_tiny_deepseek_v3

    target = make_tiny_deepseek_v3(tmp_path / "target")
    config, names = exported(target, tmp_path, ids=(1, 4, 7))
    assert config["architectures"] == ["Eagle3DeepseekV2ForCausalLM"]
    assert sglang_problems(config, names, load_target_config(target)) == []
