"""The embedded default target and demo corpus: determinism, chat format, build, vLLM."""
from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from eagle3flow.embedded.corpus import (MAX_ANSWER_CHARS, cap_answer, collect_conversations,
                                        first_paragraph, read_conversations)
from eagle3flow.embedded.tokenizer import (BOS, EOT, SPECIAL_TOKENS, save_tokenizer,
                                           special_token_ids, train_tokenizer)

REPO = Path(__file__).resolve().parent.parent
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}


def _run(args: list[str], timeout: float, env: dict | None = None) -> subprocess.CompletedProcess:
    result = subprocess.run([sys.executable, *args], cwd=REPO, env=env or ENV, capture_output=True,
                            text=True, timeout=timeout)
    assert result.returncode == 0, f"{args} failed:\n{result.stdout}\n{result.stderr[-4000:]}"
    return result


@pytest.fixture(scope="module")
def corpus() -> list[dict]:
    return collect_conversations(4000)[0]


@pytest.fixture(scope="module")
def small_tokenizer(corpus, tmp_path_factory):
    """A tokenizer fit on a slice of the corpus, saved and loaded back like a target's."""
    from transformers import AutoTokenizer

    out = tmp_path_factory.mktemp("tok")
    save_tokenizer(train_tokenizer(corpus[::8], vocab_size=1024), out)
    return AutoTokenizer.from_pretrained(out)


def test_corpus_identical_across_processes(tmp_path):
    # Different hash seeds: any set/dict-order dependence would change the bytes.
    script = ("import sys; from eagle3flow.embedded.corpus import build_corpus; "
              "build_corpus(sys.argv[1], 4000)")
    for name, seed in (("a.jsonl", "1"), ("b.jsonl", "2")):
        _run(["-c", script, str(tmp_path / name)], 120, {**ENV, "PYTHONHASHSEED": seed})
    first, second = (tmp_path / "a.jsonl").read_bytes(), (tmp_path / "b.jsonl").read_bytes()
    assert first == second
    assert len(first.splitlines()) >= 3000


def test_corpus_shape(corpus):
    ids = [conv["id"] for conv in corpus]
    assert 3000 <= len(corpus) <= 4000
    assert ids == sorted(ids) and len(set(ids)) == len(ids)
    by_id = {conv["id"]: conv for conv in corpus}
    assert "square root" in by_id["stdlib-math.sqrt"]["messages"][-1]["content"]
    turns = [[m["role"] for m in conv["messages"]] for conv in corpus]
    for roles in turns:
        dialogue = roles[1:] if roles[0] == "system" else roles
        assert dialogue[0::2] == ["user"] * len(dialogue[0::2])
        assert dialogue[1::2] == ["assistant"] * len(dialogue[1::2])
        assert len(dialogue) % 2 == 0
    assert sum(len(r) > 3 for r in turns) > len(corpus) // 5, "multi-turn conversations exist"
    assert sum(r[0] == "system" for r in turns) > len(corpus) // 20
    answers = [m["content"] for conv in corpus for m in conv["messages"] if m["role"] == "assistant"]
    assert all(answer.strip() for answer in answers)
    assert not any(" at 0x" in answer for answer in answers), "memory addresses are not stable"
    # nor is where this checkout's interpreter lives (platform.architecture's default)
    texts = [m["content"] for conv in corpus for m in conv["messages"]]
    assert not any(sys.prefix in text or sys.executable in text for text in texts)
    # Grounded: the first answer restates the documentation the question quotes (capped), so
    # a model trained for minutes answers held-out questions from what they say.
    for conv in corpus[::50]:
        dialogue = [m for m in conv["messages"] if m["role"] != "system"]
        question, answer = dialogue[0]["content"], dialogue[1]["content"]
        documentation = question.split(":\n", 1)[1]
        assert "Documentation of " in question and len(documentation) <= MAX_ANSWER_CHARS + 4
        assert documentation in answer, (question, answer)


def test_max_conversations_is_a_stable_spread_subset():
    small, stats = collect_conversations(300)
    full, _ = collect_conversations(None)
    assert len(small) == 300 and stats["available"] == len(full)
    assert {c["id"] for c in small} <= {c["id"] for c in full}
    assert len({c["id"].split(".")[0] for c in small}) > 50, "subset spans many modules"


def test_docstring_cleaning():
    assert first_paragraph("dumps(obj, protocol=None) -> bytes\n\nReturn the\n  pickled obj.\n\nMore.") \
        == "Return the pickled obj."
    assert first_paragraph("f(x)\n") == ""
    long = "Word. " * 400
    capped = cap_answer(long, 100)
    assert len(capped) <= 100 and capped.endswith(".")


def test_read_conversations_names_bad_line(tmp_path):
    path = tmp_path / "c.jsonl"
    path.write_text('{"id": "a", "messages": []}\n{"id": "b"}\n')
    with pytest.raises(ValueError, match=r"c\.jsonl:2: needs fields"):
        read_conversations(path)


def test_chat_template_renders_llama3_format(small_tokenizer):
    tok = small_tokenizer
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": "What does `len` do?"},
                {"role": "assistant", "content": "Return the number of items."},
                {"role": "user", "content": "What is its signature?"}]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == (
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nWhat does `len` do?<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\nReturn the number of items.<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nWhat is its signature?<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n")
    no_prompt = tok.apply_chat_template(messages[:3], tokenize=False)
    assert no_prompt.endswith("items.<|eot_id|>")

    ids = special_token_ids(tok)
    assert list(ids) == list(SPECIAL_TOKENS) and sorted(ids.values()) == list(range(6))
    encoded = tok.apply_chat_template(messages[:3], tokenize=True, return_dict=True,
                                      return_assistant_tokens_mask=True)
    input_ids, mask = encoded["input_ids"], encoded["assistant_masks"]
    assert input_ids.count(ids[BOS]) == 1 and input_ids[0] == ids[BOS], "exactly one BOS"
    assert input_ids.count(ids["<|start_header_id|>"]) == 3
    # The mask covers the assistant content and its <|eot_id|>, nothing else.
    assert tok.decode([t for t, m in zip(input_ids, mask) if m]) == "Return the number of items.<|eot_id|>"
    assert tok.eos_token == EOT and tok.pad_token == "<|pad|>" and tok.bos_token == BOS
    with pytest.raises(Exception, match="roles"):
        tok.apply_chat_template([{"role": "tool", "content": "x"}], tokenize=False)


def test_tokenizer_round_trip(small_tokenizer, corpus):
    tok = small_tokenizer
    texts = [m["content"] for conv in corpus[:200] for m in conv["messages"]]
    texts += ["Ünïcode ✓ 日本語 🙂\ttabs  two spaces\n\nnew lines", "  leading and trailing  "]
    for text in texts:
        ids = tok(text, add_special_tokens=False)["input_ids"]
        assert tok.decode(ids) == text
    with_bos = tok("hello world")["input_ids"]
    assert with_bos[0] == tok.bos_token_id
    assert tok.decode(with_bos, skip_special_tokens=True) == "hello world"
    rendered = tok.apply_chat_template(corpus[0]["messages"], tokenize=False)
    ids = tok.apply_chat_template(corpus[0]["messages"], tokenize=True, return_dict=True)["input_ids"]
    assert tok.decode(ids) == rendered


def test_tokenizer_training_is_deterministic(corpus):
    first = train_tokenizer(corpus[::4], vocab_size=2048)
    second = train_tokenizer(corpus[::4], vocab_size=2048)
    assert first.get_vocab() == second.get_vocab() and len(first) == 2048


def test_training_resumes_to_identical_result(tmp_path):
    """A run resumed from its mid-way checkpoint ends exactly where the uninterrupted one does."""
    import shutil

    import torch
    from transformers import LlamaConfig

    from eagle3flow.embedded.build import TrainOptions, train_model

    config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=False)
    blocks = torch.randint(0, 256, (12, 32), generator=torch.Generator().manual_seed(0))
    options = TrainOptions(steps=6, seed=0, max_conversations=10, batch_size=4, warmup_steps=2, checkpoint_every=3)
    whole_dir, resumed_dir = tmp_path / "whole", tmp_path / "resumed"
    whole_dir.mkdir(), resumed_dir.mkdir()
    model, losses = train_model(config, blocks, options, whole_dir)
    # The step-3 checkpoint the whole run left is what an interrupted run leaves.
    shutil.copy(whole_dir / "checkpoint.pt", resumed_dir / "checkpoint.pt")
    resumed_model, resumed_losses = train_model(config, blocks, options, resumed_dir)
    assert resumed_losses == losses and losses[-1] < losses[0]
    for (name, a), (_, b) in zip(model.state_dict().items(), resumed_model.state_dict().items()):
        assert torch.equal(a, b), name


def _check_target_dir(target: Path) -> dict:
    from safetensors import safe_open

    config = json.loads((target / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["num_hidden_layers"] >= 8 and config["tie_word_embeddings"] is False
    assert config["max_position_embeddings"] >= 1024
    assert config["hidden_size"] // config["num_attention_heads"] in (32, 64), "vLLM CPU head size"
    tok_config = json.loads((target / "tokenizer_config.json").read_text())
    assert "<|start_header_id|>" in tok_config["chat_template"]
    assert tok_config["eos_token"] == EOT
    generation = json.loads((target / "generation_config.json").read_text())
    assert generation["eos_token_id"] == [4, 1]  # <|eot_id|>, <|end_of_text|>
    with safe_open(target / "model.safetensors", "pt") as f:
        names = set(f.keys())
        assert "lm_head.weight" in names and "model.embed_tokens.weight" in names
        assert all(str(f.get_tensor(n).dtype) == "torch.float32" for n in names)
    return config


def test_cli_tiny_build(tmp_path):
    out = tmp_path / "embedded"
    result = _run(["-m", "eagle3flow.embedded.build", "--out-dir", str(out),
                   "--config-json", json.dumps({"train_steps": 1, "max_conversations": 200})], 300)
    assert "embedded train" in result.stderr and "ETA" in result.stderr
    assert sorted(p.name for p in out.iterdir()) == ["build_stats.json", "conversations.jsonl", "target"]
    stats = json.loads((out / "build_stats.json").read_text())
    assert stats["corpus"]["conversations"] == 200 and stats["options"]["steps"] == 1
    assert 3_000_000 <= stats["params"] <= 6_000_000
    _check_target_dir(out / "target")

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(out / "target")
    model = AutoModelForCausalLM.from_pretrained(out / "target")
    assert sum(p.numel() for p in model.parameters()) == stats["params"]
    prompt = tok.apply_chat_template([{"role": "user", "content": "Hi"}], add_generation_prompt=True,
                                     return_tensors="pt", return_dict=True)
    with torch.no_grad():
        generated = model.generate(**prompt, max_new_tokens=3, do_sample=False)
        # Greedy by hand: the argmax of the target's own logits, ended early only by one of
        # generation_config's eos ids (<|eot_id|> 4, <|end_of_text|> 1).
        ids, expected = prompt["input_ids"], []
        while len(expected) < 3 and (not expected or expected[-1] not in (1, 4)):
            expected.append(int(model(ids).logits[0, -1].argmax()))
            ids = torch.cat([ids, torch.tensor([[expected[-1]]])], dim=1)
    prompt_len = prompt["input_ids"].shape[1]
    assert generated[0, :prompt_len].tolist() == prompt["input_ids"][0].tolist()
    assert generated[0, prompt_len:].tolist() == expected


def test_cli_refuses_bad_settings_naming_the_key(tmp_path):
    for settings, key in (({"train_steps": 0}, "embedded.train_steps"), ({"steps": 5}, "['steps']")):
        result = subprocess.run([sys.executable, "-m", "eagle3flow.embedded.build", "--out-dir", str(tmp_path),
                                 "--config-json", json.dumps(settings)], cwd=REPO, env=ENV,
                                capture_output=True, text=True)
        assert result.returncode != 0 and key in result.stderr, result.stderr
        assert not list(tmp_path.iterdir())


# --- slow: the real default build, served by vLLM -------------------------------------------

VLLM_SCRIPT = r"""
import json, sys
from vllm import LLM, SamplingParams
target, questions = sys.argv[1], json.loads(sys.argv[2])
llm = LLM(model=target, dtype="float32", enforce_eager=True, max_model_len=1024, seed=0)
params = SamplingParams(temperature=0.0, max_tokens=96)
outputs = llm.chat([[{"role": "user", "content": q}] for q in questions], params)
# A second turn on the first conversation: multi-turn through the chat template.
follow_up = [{"role": "user", "content": questions[0]},
             {"role": "assistant", "content": outputs[0].outputs[0].text},
             {"role": "user", "content": "What is its signature?"}]
outputs += llm.chat([follow_up], params)
print("RESULT " + json.dumps([{"text": o.outputs[0].text, "token_ids": list(o.outputs[0].token_ids),
                               "finish_reason": o.outputs[0].finish_reason,
                               "prompt_token_ids": list(o.prompt_token_ids)} for o in outputs]))
"""


@pytest.fixture(scope="module")
def default_target(embedded_default_build) -> Path:
    """The full default build (minutes), made once per session (conftest.py)."""
    return embedded_default_build


@pytest.mark.slow
def test_default_build_trains(default_target):
    """The default target learned its corpus and did not collapse into a formulaic answer:
    greedy answers to 48 of its questions are distinct for >= 90% and have a median of
    >= 32 tokens (a 300-step target answered 34 of 48 eval prompts with one 10-token reply)."""
    import statistics

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    stats = json.loads((default_target / "build_stats.json").read_text())
    assert stats["final_loss"] < stats["first_loss"] / 2, stats
    assert stats["tokenizer_size"] == 4096
    _check_target_dir(default_target / "target")

    tok = AutoTokenizer.from_pretrained(default_target / "target")
    model = AutoModelForCausalLM.from_pretrained(default_target / "target", dtype=torch.float32).eval()
    conversations = [json.loads(line) for line in (default_target / "conversations.jsonl").open()]
    conversations.sort(key=lambda c: hashlib.sha256(c["id"].encode()).hexdigest())
    answers = []
    for conversation in conversations[:48]:
        messages = conversation["messages"]
        first_user = next(i for i, m in enumerate(messages) if m["role"] == "user")
        prompt = tok.apply_chat_template(messages[:first_user + 1], add_generation_prompt=True,
                                         return_tensors="pt", return_dict=True)
        with torch.no_grad():
            out = model.generate(**prompt, max_new_tokens=64, do_sample=False)
        answers.append(tuple(out[0, prompt["input_ids"].shape[1]:].tolist()))
    distinct = len(set(answers)) / len(answers)
    median_tokens = statistics.median(len(a) for a in answers)
    assert distinct >= 0.9 and median_tokens >= 32, (distinct, median_tokens)


@pytest.mark.slow
def test_vllm_serves_default_target(default_target):
    """vLLM CPU loads the target, uses the chat template, stops at <|eot_id|> where
    transformers does, and its greedy answer matches transformers' token for token: on a
    question of the corpus, on one phrased as the corpus never does, and on a second turn."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target = default_target / "target"
    tok = AutoTokenizer.from_pretrained(target)
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    eos = model.generation_config.eos_token_id
    stops = set(eos if isinstance(eos, list) else [eos])

    def prompt_ids(messages: list[dict]) -> list[int]:
        return tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                       return_dict=True)["input_ids"]

    def greedy(ids: list[int]) -> list[int]:
        with torch.no_grad():
            out = model.generate(torch.tensor([ids]), max_new_tokens=96, do_sample=False)
        return out[0, len(ids):].tolist()

    # A question the target learned, picked where its own greedy answer ends before the
    # token cap: the float rounding of the CPU that trained it decides which ones do.
    conversations = [json.loads(line) for line in (default_target / "conversations.jsonl").open()]
    conversations.sort(key=lambda c: hashlib.sha256(c["id"].encode()).hexdigest())
    learned = next((q for q in (next(m["content"] for m in c["messages"] if m["role"] == "user")
                                for c in conversations[:16])
                    if greedy(prompt_ids([{"role": "user", "content": q}]))[-1] in stops), None)
    assert learned is not None, "no greedy answer of 16 corpus questions ends within 96 tokens"
    # Phrased as the corpus never does, with documentation as its questions quote it.
    unseen = ("In one sentence, what is `os.path.join` used for?\n\nDocumentation of "
              "`os.path.join(a, *p)`:\nJoin two or more pathname components, inserting '/' as needed.")
    env = {**ENV, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    result = _run(["-c", VLLM_SCRIPT, str(target), json.dumps([learned, unseen])], 900, env)
    outputs = json.loads(result.stdout.split("RESULT ", 1)[1].splitlines()[0])
    print(json.dumps([o["text"] for o in outputs], indent=1))

    chats = [[{"role": "user", "content": learned}], [{"role": "user", "content": unseen}],
             [{"role": "user", "content": learned}, {"role": "assistant", "content": outputs[0]["text"]},
              {"role": "user", "content": "What is its signature?"}]]
    for messages, output in zip(chats, outputs):
        expected_prompt = prompt_ids(messages)
        assert output["prompt_token_ids"] == expected_prompt, "vLLM rendered the chat template"
        assert "<|" not in output["text"], output["text"]
        hf_ids, vllm_ids = greedy(expected_prompt), output["token_ids"]
        # fp32 on both sides: allow a late divergence on a near-tie, not an early one.
        same = next((i for i, (a, b) in enumerate(zip(hf_ids, vllm_ids)) if a != b), min(len(hf_ids), len(vllm_ids)))
        assert same >= min(16, len(vllm_ids)), (hf_ids, vllm_ids)
        if hf_ids == vllm_ids:     # the same answer ends the same way: at <|eot_id|> or at the cap
            assert output["finish_reason"] == ("stop" if hf_ids[-1] in stops else "length"), output
    assert outputs[0]["finish_reason"] == "stop", outputs[0]
    # A ~5M model trained for minutes learns the corpus' form (an answer opens with the
    # backticked name it explains and ends a sentence), answers different questions
    # differently, and gives a follow-up the signature-turn phrasing; copying the exact
    # name asked about, or ending an answer to an unseen phrasing, is beyond it.
    for output in outputs[:2]:
        assert re.match(r"(In short, )?`[\w.]+`", output["text"]), output["text"]
    assert outputs[0]["text"].rstrip().endswith("."), outputs[0]["text"]
    assert outputs[0]["text"] != outputs[1]["text"]
    assert outputs[2]["text"].startswith("Its signature is `"), outputs[2]["text"]
