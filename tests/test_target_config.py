"""Every stage reads a multimodal wrapper's config.json the same way (eagle3flow/target/config.py).

Kimi-K2.5 nests its language model under ``text_config``; an outer ``vocab_size`` (the
wrapper's, here deliberately different) must not leak into the vocab map while the
extraction, the planner and the draft read the text model's.
"""
from __future__ import annotations

import json

from eagle3flow.data.vocab import target_vocab_size
from eagle3flow.extract.extraction import read_target_config
from eagle3flow.layers import resolve_aux_layer_ids
from eagle3flow.model.config import DraftConfig
from eagle3flow.ops import plan as plan_lib
from eagle3flow.target.config import load_target_config, read_config_file, text_config

TEXT = {"model_type": "deepseek_v3", "architectures": ["DeepseekV3ForCausalLM"], "hidden_size": 64,
        "num_attention_heads": 4, "num_key_value_heads": 4, "intermediate_size": 128,
        "num_hidden_layers": 12, "vocab_size": 4096, "max_position_embeddings": 2048,
        "kv_lora_rank": 32, "q_lora_rank": None, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8,
        "v_head_dim": 16, "rms_norm_eps": 1e-6}
KIMI_STYLE = {"architectures": ["KimiK25ForConditionalGeneration"], "model_type": "kimi_k25",
              "vocab_size": 163840, "torch_dtype": "bfloat16", "tie_word_embeddings": False,
              "vision_config": {"hidden_size": 32}, "text_config": TEXT}


def nested_target(tmp_path):
    target = tmp_path / "kimi"
    target.mkdir()
    (target / "config.json").write_text(json.dumps(KIMI_STYLE))
    (target / "model.safetensors").write_bytes(b"")    # the extraction checks weights are there
    return target


def test_text_config_wins_and_the_outer_config_fills_only_what_it_lacks(tmp_path):
    view = load_target_config(nested_target(tmp_path))
    assert view["vocab_size"] == 4096 and view["num_hidden_layers"] == 12
    assert view["model_type"] == "deepseek_v3" and view["architectures"] == ["DeepseekV3ForCausalLM"]
    assert view["torch_dtype"] == "bfloat16" and view["tie_word_embeddings"] is False
    assert "text_config" not in view and "vision_config" not in view
    assert read_config_file(tmp_path / "kimi")["architectures"] == ["KimiK25ForConditionalGeneration"]
    flat = {"vocab_size": 512, "num_hidden_layers": 8}
    assert text_config(flat) == flat


def test_other_outer_keys_stay_out_so_cache_keys_do_not_move():
    """The training fingerprint holds this view: an outer key beyond dtype and tied
    embeddings (a wrapper's transformers_version, token ids, media settings) would change
    it and make a killed run of such a target start over instead of resuming."""
    wrapper = {**KIMI_STYLE, "transformers_version": "4.57.1", "bos_token_id": 1, "media_placeholder_token_id": 9,
               "max_position_embeddings": 999}
    assert text_config(wrapper) == {**TEXT, "torch_dtype": "bfloat16", "tie_word_embeddings": False}


def test_every_stage_sees_the_same_text_model(tmp_path):
    target = nested_target(tmp_path)
    view = load_target_config(target)
    extraction = read_target_config(target)
    planned, _ = plan_lib.target_config({"target": {"path": str(target)}}, tmp_path)
    aux = resolve_aux_layer_ids(None, int(planned["num_hidden_layers"]))
    from_file = DraftConfig.from_target_config(view, aux, 1024)
    from_raw = DraftConfig.from_target_config(KIMI_STYLE, aux, 1024)

    assert target_vocab_size(target) == extraction["vocab_size"] == planned["vocab_size"] == 4096
    assert from_file.vocab_size == from_raw.vocab_size == 4096
    assert extraction == planned == view
    assert aux == resolve_aux_layer_ids(None, int(extraction["num_hidden_layers"])) == [2, 6, 9]
    assert from_file == from_raw and from_file.architecture == "mla"
    assert from_file.torch_dtype == "bfloat16"
