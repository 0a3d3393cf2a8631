"""The export against SGLang's EAGLE-3 loader contract (eagle3flow/export/sglang_contract.py, read
from sglang 0.5.23's source): SGLang's CPU build does not install here, so this is the check
instead of a real load (README, "Serving the draft")."""
from __future__ import annotations


from eagle3flow.export.sglang_contract import sglang_problems
from eagle3flow.target.config import load_target_config
from support.builders import export_untrained_draft
from support.tiny_targets import make_tiny_deepseek_v3


def test_default_export_meets_the_contract(random_llama_target, tmp_path):
    config, names = export_untrained_draft(random_llama_target, tmp_path)
    assert sglang_problems(config, names, load_target_config(random_llama_target)) == []
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 3, 4]
    assert "input_norm.weight" in names and not any(n.startswith("embed_tokens") for n in names)


def test_embeddings_as_aux_state_are_layer_minus_one(random_llama_target, tmp_path):
    """Id 0 (the input of layer 0) is SGLang's -1: before, no eagle_config was written for
    it and SGLang captured its own default layers."""
    config, names = export_untrained_draft(random_llama_target, tmp_path, ids=(0, 4, 7))
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [-1, 3, 6]
    assert sglang_problems(config, names) == []
    del config["eagle_config"]
    assert any("would capture other layers" in p for p in sglang_problems(config, names))


def test_what_sglang_would_serve_wrongly_is_named(random_llama_target, tmp_path, capsys):
    config, names = export_untrained_draft(random_llama_target, tmp_path, overrides={"norm_before_residual": True}, name="nbr")
    assert capsys.readouterr().err.count("SGLang would not serve") == 1
    assert sglang_problems(config, names) == ["norm_before_residual: SGLang does not implement it (vLLM does)"]
    bad = {**config, "architectures": ["Eagle3LlamaForCausalLM"], "tie_word_embeddings": True}
    bad.pop("draft_vocab_size")
    problems = " | ".join(sglang_problems(bad, names | {"model.extra.weight"}))
    for expected in ("architectures ['Eagle3LlamaForCausalLM']", "no draft_vocab_size", "norm_before_residual",
                     "tie_word_embeddings", "drops without a word: ['model.extra.weight']"):
        assert expected in problems, problems


def test_mla_export_meets_the_contract(tmp_path):
    target = make_tiny_deepseek_v3(tmp_path / "target")
    config, names = export_untrained_draft(target, tmp_path, ids=(1, 4, 7))
    assert config["architectures"] == ["Eagle3DeepseekV2ForCausalLM"]
    assert sglang_problems(config, names, load_target_config(target)) == []
