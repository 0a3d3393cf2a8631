"""prepare_dataset: loss masks on real chat templates, formats, bad rows, lengths, split, CLI.

Tokenizers are tiny byte-level BPEs trained here, with each family's special tokens
and its official chat template (tests/fixtures/chat_templates), so nothing downloads.
"""
from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from conftest import REPO, SHARED
from support.builders import TOOL_ROW, TOOLS
from support.targets import CONVERSATION, FAMILIES, make_chat_tokenizer
from eagle3flow.data.chat_masks import ChatMasker, MaskError
from eagle3flow.data.dataset import DatasetConfig, prepare_dataset
from eagle3flow.data.order import make_unique
from eagle3flow.data.records import BadRow, conversation_from_record
from eagle3flow.data.sources import DatasetError
from eagle3flow.target.tokenizer import load_tokenizer

FIXTURES = Path(__file__).parent / "fixtures"
DATA = FIXTURES / "datasets"
SHAREGPT = SHARED / "data" / "sharegpt" / "dummy_conversation.json"

@pytest.fixture(scope="module")
def tokenizer_dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("chat_tokenizers")
    return {family: make_chat_tokenizer(root / family, family) for family in FAMILIES}


def masked_runs(tokenizer, input_ids: np.ndarray, loss_mask: np.ndarray) -> list[str]:
    """The decoded text of each maximal run of mask-1 tokens."""
    runs, current = [], []
    for token, bit in zip(input_ids.tolist(), loss_mask.tolist()):
        if bit:
            current.append(token)
        elif current:
            runs.append(current)
            current = []
    if current:
        runs.append(current)
    return [tokenizer.decode(run, skip_special_tokens=False) for run in runs]


def unmasked_text(tokenizer, input_ids, loss_mask) -> str:
    return tokenizer.decode(input_ids[loss_mask == 0].tolist(), skip_special_tokens=False)


# ---------------------------------------------------------------- masks on real templates

@pytest.mark.parametrize("family", list(FAMILIES))
def test_mask_is_exactly_the_assistant_turns(tokenizer_dirs, family):
    tokenizer = load_tokenizer(tokenizer_dirs[family])
    input_ids, loss_mask = ChatMasker(tokenizer).tokenize(CONVERSATION, "conv")
    eot = FAMILIES[family][4]
    answers = [m["content"] for m in CONVERSATION if m["role"] == "assistant"]
    expected = [answer + eot for answer in answers]
    if family == "qwen3":  # Qwen3 renders the last turn with an (empty) think block the model generates
        expected[-1] = "<think>\n\n</think>\n\n" + expected[-1]
    assert masked_runs(tokenizer, input_ids, loss_mask) == expected
    # Nothing from system/user turns or the headers is masked, and the whole text round-trips.
    full = tokenizer.decode(input_ids.tolist(), skip_special_tokens=False)
    assert full == ChatMasker(tokenizer).render(CONVERSATION)
    rest = unmasked_text(tokenizer, input_ids, loss_mask)
    for message in CONVERSATION:
        if message["role"] != "assistant":
            assert message["content"] in rest
    assert input_ids.dtype == np.int32 and loss_mask.dtype == np.int8
    assert set(np.unique(loss_mask).tolist()) == {0, 1}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_mask_without_offsets_equals_the_mask_from_offsets(tokenizer_dirs, family):
    """A slow tokenizer's path (span edges from prefix tokenizations) gives, on every
    template, the mask the fast tokenizer's offsets give."""
    masker = ChatMasker(load_tokenizer(tokenizer_dirs[family]))
    full, spans = masker.assistant_spans(CONVERSATION, "conv")
    input_ids, loss_mask = masker.tokenize(CONVERSATION, "conv")
    ids, mask = masker.tokenize_without_offsets(full, spans)
    assert ids.tolist() == input_ids.tolist() and mask.tolist() == loss_mask.tolist()


def test_qwen3_without_thinking_masks_only_the_answer(tokenizer_dirs):
    tokenizer = load_tokenizer(tokenizer_dirs["qwen3"])
    masker = ChatMasker(tokenizer, {"enable_thinking": False})
    input_ids, loss_mask = masker.tokenize(CONVERSATION, "conv")
    answers = [m["content"] + "<|im_end|>" for m in CONVERSATION if m["role"] == "assistant"]
    assert masked_runs(tokenizer, input_ids, loss_mask) == answers
    assert "<think>\n\n</think>\n\n" in unmasked_text(tokenizer, input_ids, loss_mask)


def test_qwen3_earlier_reasoning_dropped_by_template(tokenizer_dirs):
    """Qwen3 drops an earlier turn's <think> block; the mask follows what is rendered."""
    tokenizer = load_tokenizer(tokenizer_dirs["qwen3"])
    messages = [
        {"role": "user", "content": "What is the capital of France?"},
        {"role": "assistant", "content": "<think>\nThe user asks about France.\n</think>\n\nParis."},
        {"role": "user", "content": "And of Italy?"},
        {"role": "assistant", "content": "<think>\nItaly now.\n</think>\n\nRome."},
    ]
    input_ids, loss_mask = ChatMasker(tokenizer).tokenize(messages, "think")
    assert masked_runs(tokenizer, input_ids, loss_mask) == [
        "Paris.<|im_end|>", "<think>\nItaly now.\n</think>\n\nRome.<|im_end|>"]


def test_all_zero_and_all_one_masks_are_refused(tmp_path):
    users_only = "{% for m in messages %}{% if m.role == 'user' %}U: {{ m.content }}\n{% endif %}{% endfor %}"
    assistant_only = "{% for m in messages %}{% if m.role == 'assistant' %}{{ m.content }}{% endif %}{% endfor %}"
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello there"}]
    for name, template, words in (("zero", users_only, "all 0"), ("one", assistant_only, "all 1")):
        tokenizer = load_tokenizer(make_chat_tokenizer(tmp_path / name, "llama3", template))
        with pytest.raises(MaskError, match=f"sample 'sample-{name}'.*{words}"):
            ChatMasker(tokenizer).tokenize(messages, f"sample-{name}")


def test_broken_template_fails_the_run_naming_ids(tmp_path):
    template = "{% for m in messages %}{% if m.role == 'user' %}U: {{ m.content }}\n{% endif %}{% endfor %}"
    tok_dir = make_chat_tokenizer(tmp_path / "tok", "llama3", template)
    with pytest.raises(DatasetError, match=r"1 of 1 processed rows are bad.*loss mask.*sample .m-.*all 0"):
        prepare_dataset(str(DATA / "messages.jsonl"), tok_dir, tmp_path / "out")
    assert not (tmp_path / "out" / "stats.json").exists()


# ---------------------------------------------------------------- records and formats

def test_records_of_each_format_normalize():
    assert conversation_from_record({"conversations": [
        {"from": "system", "value": "Be nice."}, {"from": "human", "value": "Hi"},
        {"from": "gpt", "value": "Hello"}, {"from": "human", "value": "Bye"}]}, "sharegpt") == [
        {"role": "system", "content": "Be nice."}, {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello"}]  # the trailing user turn carries no loss
    assert conversation_from_record(
        {"instruction": "Translate.", "input": "Hi", "output": "Salut"}, "instruction") == [
        {"role": "user", "content": "Translate.\n\nHi"}, {"role": "assistant", "content": "Salut"}]
    assert conversation_from_record({"prompt": "Q", "response": "A", "system": "S"}, "instruction") == [
        {"role": "system", "content": "S"}, {"role": "user", "content": "Q"},
        {"role": "assistant", "content": "A"}]
    assert make_unique(["a", "b", "a", "a#1", "a"]) == (
        ["a", "b", "a#2", "a#1", "a#3"],
        [{"id": "a", "new_id": "a#2"}, {"id": "a", "new_id": "a#3"}])


def read_split(out_dir: Path, split: str):
    table = pq.read_table(out_dir / f"{split}.parquet")
    return table, table.to_pylist()


def check_outputs(out_dir: Path, tokenizer_dir: Path) -> dict:
    """Schema, types, mask sanity and stats consistency of one prepare_dataset output."""
    stats = json.loads((out_dir / "stats.json").read_text())
    tokenizer = load_tokenizer(tokenizer_dir)
    all_ids = []
    for split in ("train", "eval"):
        table, rows = read_split(out_dir, split)
        assert str(table.schema.field("input_ids").type) == "list<element: int32>"
        assert str(table.schema.field("loss_mask").type) == "list<element: int8>"
        assert str(table.schema.field("num_tokens").type) == "int32"
        assert str(table.schema.field("id").type) == "string"
        for row in rows:
            assert row["num_tokens"] == len(row["input_ids"]) == len(row["loss_mask"])
            assert 0 < sum(row["loss_mask"]) < row["num_tokens"]
        split_stats = stats["splits"][split]
        assert split_stats["samples"] == len(rows)
        assert split_stats["tokens"] == sum(r["num_tokens"] for r in rows)
        assert split_stats["assistant_tokens"] == sum(sum(r["loss_mask"]) for r in rows)
        all_ids += [r["id"] for r in rows]
    assert len(all_ids) == len(set(all_ids)) == stats["rows"]["kept"]
    prompts = [json.loads(line) for line in (out_dir / "eval_prompts.jsonl").read_text().splitlines()]
    assert [p["id"] for p in prompts] == [r["id"] for r in read_split(out_dir, "eval")[1]]
    for prompt in prompts:
        assert prompt["messages"] and prompt["messages"][-1]["role"] == "user"
        assert all(m["role"] != "assistant" for m in prompt["messages"])
    assert not list(out_dir.glob(".*tmp"))
    assert tokenizer.decode(read_split(out_dir, "train")[1][0]["input_ids"][:1]) != ""
    return stats


def test_messages_file_end_to_end(tokenizer_dirs, tmp_path):
    out = tmp_path / "out"
    stats = prepare_dataset(str(DATA / "messages.jsonl"), tokenizer_dirs["llama3"], out,
                            DatasetConfig(eval_fraction=0.2, max_bad_fraction=0.0))
    assert check_outputs(out, tokenizer_dirs["llama3"]) == json.loads((out / "stats.json").read_text())
    assert stats["sources"][0]["format"] == "messages"
    assert stats["rows"] == {"total": 6, "processed": 6, "kept": 6}
    assert stats["splits"]["eval"]["samples"] == 1 and stats["bad"]["count"] == 0
    tokenizer = load_tokenizer(tokenizer_dirs["llama3"])
    rows = {r["id"]: r for split in ("train", "eval") for r in read_split(out, split)[1]}
    paris = rows["m-paris"]
    assert masked_runs(tokenizer, np.array(paris["input_ids"]), np.array(paris["loss_mask"])) == [
        "Paris.<|eot_id|>", "Rome is the capital of Italy.<|eot_id|>"]
    trailing = rows["m-trailing-user"]  # the closing user turn is cut, so the sample ends on <|eot_id|>
    assert tokenizer.decode(trailing["input_ids"]).endswith("Seven is prime.<|eot_id|>")
    assert trailing["loss_mask"][-1] == 1


def test_instruction_and_sharegpt_formats_from_a_directory(tokenizer_dirs, tmp_path):
    data_dir = tmp_path / "data"
    data_dir.mkdir()
    for name in ("alpaca.json", "prompt_response.jsonl"):
        (data_dir / name).write_bytes((DATA / name).read_bytes())
    import pandas as pd
    (data_dir / "sub").mkdir()
    pd.DataFrame([{"id": "pq-1", "conversations": [{"from": "human", "value": "Ping?"},
                                                   {"from": "gpt", "value": "Pong!"}]}]
                 ).to_parquet(data_dir / "sub" / "sharegpt.parquet")
    out = tmp_path / "out"
    stats = prepare_dataset(str(data_dir), tokenizer_dirs["qwen3"], out, DatasetConfig(eval_fraction=0.25))
    check_outputs(out, tokenizer_dirs["qwen3"])
    formats = {Path(s["name"]).name: s["format"] for s in stats["sources"]}
    assert formats == {"alpaca.json": "instruction", "prompt_response.jsonl": "instruction",
                       "sharegpt.parquet": "sharegpt"}
    ids = {r["id"] for split in ("train", "eval") for r in read_split(out, split)[1]}
    assert ids == {"row-0", "row-1", "row-2", "row-3", "81", "82", "83", "pq-1"}
    tokenizer = load_tokenizer(tokenizer_dirs["qwen3"])
    rows = {r["id"]: r for split in ("train", "eval") for r in read_split(out, split)[1]}
    text = tokenizer.decode(rows["row-1"]["input_ids"])
    assert "Translate to French.\n\nGood morning<|im_end|>" in text
    assert masked_runs(tokenizer, np.array(rows["pq-1"]["input_ids"]), np.array(rows["pq-1"]["loss_mask"])) \
        == ["<think>\n\n</think>\n\nPong!<|im_end|>"]


@pytest.mark.skipif(not SHAREGPT.exists(), reason=f"{SHAREGPT} not present")
def test_sharegpt_dummy_conversations(tokenizer_dirs, tmp_path):
    out = tmp_path / "out"
    start = time.perf_counter()
    stats = prepare_dataset(str(SHAREGPT), tokenizer_dirs["llama3"], out, DatasetConfig(max_samples=120, eval_fraction=0.02))
    elapsed = time.perf_counter() - start
    check_outputs(out, tokenizer_dirs["llama3"])
    assert stats["sources"][0]["format"] == "sharegpt" and stats["rows"]["total"] == 500
    assert stats["rows"]["kept"] == 120 and stats["bad"]["count"] == 0
    assert stats["splits"]["eval"]["samples"] == round(0.02 * 120)
    source = {r["id"]: r for r in json.loads(SHAREGPT.read_text())}
    tokenizer = load_tokenizer(tokenizer_dirs["llama3"])
    for row in read_split(out, "train")[1][:20]:
        answers = [t["value"].strip() + "<|eot_id|>" for t in source[row["id"]]["conversations"]
                   if t["from"] == "gpt"]
        assert masked_runs(tokenizer, np.array(row["input_ids"]), np.array(row["loss_mask"])) == answers
    print(f"sharegpt: 120 samples in {elapsed:.2f}s")


# ---------------------------------------------------------------- bad rows, lengths, split

def test_bad_rows_are_reported_by_id_and_reason(tokenizer_dirs, tmp_path):
    with pytest.raises(DatasetError, match=r"processed rows are bad .*first: (row-1|no-messages|"
                       r"unknown-role|empty-content|no-assistant|assistant-first|row-9) \("):
        prepare_dataset(str(DATA / "bad_rows.jsonl"), tokenizer_dirs["llama3"], tmp_path / "strict")
    out = tmp_path / "out"
    stats = prepare_dataset(str(DATA / "bad_rows.jsonl"), tokenizer_dirs["llama3"], out,
                            DatasetConfig(max_bad_fraction=0.7, eval_fraction=0.0))
    check_outputs(out, tokenizer_dirs["llama3"])
    reasons = {r["id"]: r["reason"] for r in stats["bad"]["rows"]}
    assert reasons == {"row-1": "not a record", "no-messages": "missing messages",
                       "unknown-role": "unknown role", "empty-content": "empty content",
                       "no-assistant": "no assistant turn",
                       "assistant-first": "assistant turn before any user turn",
                       "row-9": "invalid JSON"}
    assert stats["bad"]["count"] == 7 and stats["rows"]["kept"] == 4
    assert stats["duplicate_ids"]["renamed"] == [{"id": "good-2", "new_id": "good-2#1"}]
    assert sorted(r["id"] for r in read_split(out, "train")[1]) == ["good-1", "good-2", "good-2#1", "good-3"]
    assert stats["splits"]["eval"]["samples"] == 0 and (out / "eval_prompts.jsonl").read_text() == ""


def test_length_policies(tokenizer_dirs, tmp_path):
    tok = tokenizer_dirs["llama3"]
    full_rows = read_split(_run(tok, tmp_path / "full", DatasetConfig(eval_fraction=0.0)), "train")[1]
    lengths = {r["id"]: r["num_tokens"] for r in full_rows}
    first_assistant = {r["id"]: r["loss_mask"].index(1) for r in full_rows}
    limit = sorted(lengths.values())[-2]  # only the longest sample is over it
    longest = max(lengths, key=lengths.get)

    out = _run(tok, tmp_path / "drop", DatasetConfig(max_length=limit, length_policy="drop", eval_fraction=0))
    stats = json.loads((out / "stats.json").read_text())
    assert stats["dropped"]["rows"] == [{"id": longest, "reason": "longer than max_length",
                                         "detail": f"{lengths[longest]} > {limit}"}]
    assert longest not in {r["id"] for r in read_split(out, "train")[1]}

    out = _run(tok, tmp_path / "truncate", DatasetConfig(max_length=limit, eval_fraction=0))
    stats = json.loads((out / "stats.json").read_text())
    assert stats["truncated"] == {"count": 1, "ids": [longest]} and stats["dropped"]["count"] == 0
    row = next(r for r in read_split(out, "train")[1] if r["id"] == longest)
    assert row["num_tokens"] == limit and row["loss_mask"][-1] == 1

    # A cut before the first assistant token leaves nothing to learn: dropped, not kept.
    tiny = min(first_assistant.values()) + 1
    out = _run(tok, tmp_path / "tiny", DatasetConfig(max_length=tiny, eval_fraction=0, max_bad_fraction=0))
    stats = json.loads((out / "stats.json").read_text())
    cut_early = sorted(i for i, first in first_assistant.items() if first >= tiny)
    assert cut_early and sorted(r["id"] for r in stats["dropped"]["rows"]) == cut_early
    assert stats["dropped"]["by_reason"] == {"no assistant token within max_length": len(cut_early)}
    kept = read_split(out, "train")[1]
    assert len(kept) == 6 - len(cut_early) and all(r["num_tokens"] == tiny for r in kept)


def _run(tokenizer_dir, out_dir, config, data=DATA / "messages.jsonl"):
    prepare_dataset(str(data), tokenizer_dir, out_dir, config)
    return out_dir


def test_split_and_cap_ignore_row_order(tokenizer_dirs, tmp_path):
    tok = tokenizer_dirs["llama3"]
    rows = [{"id": f"s{i}", "messages": [{"role": "user", "content": f"Question {i}?"},
                                         {"role": "assistant", "content": f"Answer {i}."}]} for i in range(40)]
    split_ids = []
    for name, seed, shuffle in (("a", 0, False), ("b", 0, True), ("c", 1, False)):
        ordered = list(rows)
        if shuffle:
            random.Random(7).shuffle(ordered)
        data = tmp_path / f"{name}.jsonl"
        data.write_text("".join(json.dumps(r) + "\n" for r in ordered))
        out = _run(tok, tmp_path / name, DatasetConfig(eval_fraction=0.1, seed=seed), data)
        split_ids.append({split: sorted(r["id"] for r in read_split(out, split)[1]) for split in ("train", "eval")})
    assert split_ids[0] == split_ids[1]
    assert len(split_ids[0]["eval"]) == 4 and len(split_ids[0]["train"]) == 36
    assert split_ids[0]["eval"] != split_ids[2]["eval"]  # the seed matters

    capped = [_run(tok, tmp_path / f"cap{n}", DatasetConfig(eval_fraction=0.1, max_samples=n),
                   tmp_path / "b.jsonl") for n in (10, 20)]
    ids = [{r["id"] for s in ("train", "eval") for r in read_split(out, s)[1]} for out in capped]
    assert len(ids[0]) == 10 and len(ids[1]) == 20 and ids[0] < ids[1]  # nested, order-free
    assert len(read_split(capped[0], "eval")[1]) == 1

    # Worker processes change the speed, not the result (same rows, same order).
    parallel = _run(tok, tmp_path / "cap10-workers", DatasetConfig(eval_fraction=0.1, max_samples=10,
                                                                  num_workers=2), tmp_path / "b.jsonl")
    for split in ("train", "eval"):
        assert read_split(parallel, split)[1] == read_split(capped[0], split)[1]


# ---------------------------------------------------------------- CLI

def _cli(*args, env_extra=None, timeout=120):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", **(env_extra or {})}
    return subprocess.run([sys.executable, "-m", "eagle3flow.data.dataset", *map(str, args)],
                          capture_output=True, text=True, env=env, timeout=timeout, cwd=REPO)


def test_cli_end_to_end(tokenizer_dirs, tmp_path):
    out = tmp_path / "results" / "dataset"
    result = _cli("--input", DATA / "alpaca.json", "--tokenizer", tokenizer_dirs["deepseek_v3"],
                  "--out-dir", out, "--config-json", json.dumps(
                      {"format": "instruction", "max_length": 64, "length_policy": "drop", "eval_fraction": 0.25,
                       "seed": 3, "max_bad_fraction": 0, "max_samples": None}))
    assert result.returncode == 0, result.stderr
    assert "prepare_dataset: train 3 samples" in result.stderr
    stats = check_outputs(out, tokenizer_dirs["deepseek_v3"])
    assert stats["config"]["seed"] == 3 and stats["config"]["max_length"] == 64


def test_cli_hub_id_fails_fast_offline(tokenizer_dirs, tmp_path):
    # timeout: a CLI that tried the network would hang on it (subprocess.TimeoutExpired)
    result = _cli("--input", "no-such-org/no-such-dataset", "--tokenizer", tokenizer_dirs["llama3"],
                  "--out-dir", tmp_path / "out", timeout=120)
    assert result.returncode == 1
    assert "'no-such-org/no-such-dataset'" in result.stderr and "HF_HUB_OFFLINE" in result.stderr
    missing = _cli("--input", tmp_path / "missing.jsonl", "--tokenizer", tokenizer_dirs["llama3"],
                   "--out-dir", tmp_path / "out")
    assert missing.returncode == 1 and "missing.jsonl' does not exist" in missing.stderr


@pytest.mark.parametrize("family", ["llama3", "qwen3", "kimi_k2"])
def test_tool_calls_are_trained_on_and_tool_outputs_are_not(tokenizer_dirs, family):
    """An OpenAI agent row (assistant tool_calls with null content, a tool turn, a tools list)
    renders with the target's template: the loss covers the assistant's call and its answer,
    not the tool's output."""
    from transformers import AutoTokenizer

    messages = conversation_from_record(TOOL_ROW, "messages")
    assert messages.tools == TOOLS and messages[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}
    assert messages[2] == {"role": "tool", "content": "temperature=18C; sky=clear", "tool_call_id": "call_1"}
    tok = AutoTokenizer.from_pretrained(tokenizer_dirs[family])
    input_ids, loss_mask = ChatMasker(tok).tokenize(messages, "agent-1")
    runs = masked_runs(tok, input_ids, loss_mask)
    full = tok.decode(input_ids.tolist(), skip_special_tokens=False)
    assert "get_weather" in full.split("Paris?")[0] or "get_weather" in full, "the tools reached the template"
    assert len(runs) == 2, runs
    assert "get_weather" in runs[0] and "Paris" in runs[0], runs      # the call the target makes
    assert "Sunny and mild today." in runs[1]
    assert not any("temperature=18C" in run for run in runs), runs    # what the tool said


def test_bad_tool_calls_are_named():
    row = json.loads(json.dumps(TOOL_ROW))
    row["messages"][1]["tool_calls"][0]["function"]["arguments"] = "{not json"
    with pytest.raises(BadRow, match="turn 1: call 0 arguments are not JSON"):
        conversation_from_record(row, "messages")
    row["tools"] = "get_weather"
    row["messages"][1]["tool_calls"][0]["function"]["arguments"] = "{}"
    with pytest.raises(BadRow, match="invalid tools"):
        conversation_from_record(row, "messages")
