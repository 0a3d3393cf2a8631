"""The model card and the publish step's checks, on an exported draft and a recorded evaluation."""
from __future__ import annotations

import json

import pytest
import yaml

from eagle3flow.report.model_card import render
from eagle3flow.export.publish import PublishError, plan
from support.builders import export_untrained_draft


def summary(k=3) -> dict:
    result = lambda al: {"vllm": {"acceptance_length": al, "acceptance_rate_per_position": [0.6, 0.4, 0.2]},  # noqa: E731
                         "simulated": {"acceptance_length": al + 0.01}, "lossless": {"passed": True},
                         "acceptance_length_vs_k": {"1": 1.6, "2": 2.0, "3": al}}
    return {"main_draft": "draft", "settings": {"num_speculative_tokens": k, "max_tokens": 64, "vllm_version": "0.32.0",
                                                 "device": "cpu", "dtype": "float32", "replay_max_k": 3},
            "prompt_sets": {"eval": {"num_prompts": 48}, "mt_bench": {"num_prompts": 80}},
            "results": {"eval": {"draft": result(2.2)}, "mt_bench": {"draft": result(1.9)}}}


def test_card_has_hub_metadata_serving_lines_and_the_evaluation(random_llama_target, tmp_path):
    config, _ = export_untrained_draft(random_llama_target, tmp_path)
    vocab = {"coverage": 0.987}
    dataset = {"splits": {"train": {"samples": 900, "tokens": 120000}, "eval": {"samples": 48}},
               "regenerated": {"samples": 948}}
    card = render(tmp_path / "draft", summary(), vocab, dataset, {"steps": 30, "train_config": {"epochs": 2}},
                  "HuggingFaceTB/SmolLM2-135M-Instruct")
    meta = yaml.safe_load(card.split("---\n")[1])
    assert meta["base_model"] == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert {"speculative-decoding", "eagle3"} <= set(meta["tags"]) and meta["library_name"] == "vllm"
    assert "| eval | 48 | 2.200 | 0.60 / 0.40 / 0.20 | 2.210 | identical |" in card
    assert "| mt_bench | 1.600 | 2.000 | 1.900 |" in card
    assert '"num_speculative_tokens": 3' in card and "--speculative-draft-model-path" in card
    assert "98.70%" in card and "[2, 4, 5]" in card and "[1, 3, 4]" in card
    assert "answers written by the target itself (948 regenerated)" in card
    dataset["regenerated"]["more_answers"] = {"samples": 1800}
    card = render(tmp_path / "draft", summary(), vocab, dataset, None, "t")
    assert "(948 regenerated, and 1,800 further answers to training prompts)" in card
    assert "per sampling temperature" not in card          # greedy alone: no such table


def test_card_shows_acceptance_per_temperature_beside_greedy(random_llama_target, tmp_path):
    export_untrained_draft(random_llama_target, tmp_path)
    hot = {"vllm": {"acceptance_length": 1.8, "ci_low": 1.7, "ci_high": 1.9, "ci_method": "bootstrap"},
           "offline": {"acceptance_length": 1.85, "within_ci": True},
           "lossless": {"passed": True, "p_value": 0.42, "test": "permutation"}}
    recorded = summary()
    recorded["settings"].update(samples_per_prompt=8, confidence=0.95, lossless_positions=4,
                                lossless_false_alarm_rate=0.01, draft_sample_method="probabilistic",
                                draft_sample_note="vLLM's")
    recorded["by_temperature"] = {"0.6": {"temperature": 0.6, "vllm": hot["vllm"], "lossless": hot["lossless"],
                                          "results": {"eval": {"draft": hot}, "mt_bench": {"draft": hot}}}}
    card = render(tmp_path / "draft", recorded, {"coverage": 0.9}, None, None, "t")
    assert "| eval | greedy | 2.200 |  | 2.210 | pass |" in card
    assert "| eval | 0.6 | 1.800 | 1.700 - 1.900 | 1.850 (in interval) | pass (p = 0.420) |" in card
    assert "sampled 8 times with and without the draft" in card


def test_a_draft_sglang_cannot_serve_gets_no_sglang_command(random_llama_target, tmp_path):
    export_untrained_draft(random_llama_target, tmp_path, overrides={"norm_before_residual": True})
    card = render(tmp_path / "draft", None, {"coverage": 1.0}, None, None, "t")
    assert "SGLang would not serve this draft as trained: norm_before_residual" in card
    assert "--speculative-draft-model-path" not in card


def test_publish_refuses_before_any_network(random_llama_target, tmp_path, monkeypatch):
    export_untrained_draft(random_llama_target, tmp_path)
    draft = tmp_path / "draft"
    with pytest.raises(PublishError, match="hub.repo_id"):
        plan(draft, "no-slash", "HF_TOKEN")
    with pytest.raises(PublishError, match=r"missing \['README.md'\]"):
        plan(draft, "me/x", "HF_TOKEN")
    (draft / "README.md").write_text("card")
    monkeypatch.delenv("MY_HUB_TOKEN", raising=False)
    with pytest.raises(PublishError, match=r"no token in \$MY_HUB_TOKEN"):
        plan(draft, "me/x", "MY_HUB_TOKEN")
    monkeypatch.setenv("MY_HUB_TOKEN", "secret")
    assert set(plan(draft, "me/x", "MY_HUB_TOKEN")["files"]) == {"config.json", "model.safetensors", "README.md"}
    assert "secret" not in json.dumps(plan(draft, "me/x", "MY_HUB_TOKEN"))


def test_card_of_a_target_with_its_own_code_says_so_and_serves_it_so(random_llama_target, tmp_path):
    export_untrained_draft(random_llama_target, tmp_path)
    card = render(tmp_path / "draft", summary(), {"coverage": 1.0}, None, None, "moonshotai/Kimi-K2.5",
                  trust_remote_code=True)
    assert "`target.trust_remote_code: true`" in card
    assert "vllm serve moonshotai/Kimi-K2.5 --trust-remote-code --speculative-config" in card
    assert "--model-path moonshotai/Kimi-K2.5 --trust-remote-code --speculative-algorithm EAGLE3" in card
    assert "trust-remote-code" not in render(tmp_path / "draft", summary(), {"coverage": 1.0}, None, None, "t")
