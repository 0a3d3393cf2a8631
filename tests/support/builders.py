"""Inputs of the stages, built small for tests: datasets, hidden-state manifests, vocab
maps, trained-draft dirs and their exports.

Shapes follow the stages' formats: a dataset is a parquet of ``id``, ``input_ids``
(int32 [n]), ``loss_mask`` (int8 [n]), ``num_tokens``; a hidden-state manifest points at
shards of ``aux`` [n, len(aux_layer_ids) * H] and ``last`` [n, H] per sample; a vocab map
holds ``d2t`` (int64 [draft_vocab], target id - draft id) and ``t2d`` (bool [vocab]).
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from eagle3flow.atomic import write_json
from eagle3flow.export.checkpoint import export_draft
from eagle3flow.extract import shards
from eagle3flow.model.draft import Eagle3Draft
from eagle3flow.train.trainer import build_draft, load_vocab_map


# ----------------------------------------------------------------------------- datasets

def write_dataset(path: Path, num_samples: int, seed: int = 0, min_len: int = 2, max_len: int = 40,
                  vocab: int = 512) -> Path:
    """``num_samples`` rows of random ids below ``vocab``, lengths in [min_len, max_len), a
    random loss mask; written in several row groups (the stages read it streamed)."""
    rng = np.random.default_rng(seed)
    rows = []
    for i in range(num_samples):
        n = int(rng.integers(min_len, max_len))
        rows.append({"id": f"sample-{i}", "input_ids": rng.integers(0, vocab, n).astype(np.int32),
                     "loss_mask": (rng.random(n) < 0.5).astype(np.int8), "num_tokens": np.int32(n)})
    pd.DataFrame(rows).to_parquet(path, row_group_size=7)
    return path


WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu".split()


def write_word_conversations(path: Path, n: int) -> Path:
    """``n`` one-turn conversations of a dozen words, as OpenAI messages (JSONL)."""
    with open(path, "w") as f:
        for i in range(n):
            question = " ".join(WORDS[(i + j) % len(WORDS)] for j in range(5 + i % 7))
            answer = " ".join(WORDS[(i * 3 + j) % len(WORDS)] for j in range(10 + i % 13))
            f.write(json.dumps({"id": f"c{i}", "messages": [
                {"role": "user", "content": question}, {"role": "assistant", "content": answer}]}) + "\n")
    return path


TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
TOOL_ROW = {"id": "agent-1", "tools": TOOLS, "messages": [
    {"role": "user", "content": "What is the weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "temperature=18C; sky=clear"},
    {"role": "assistant", "content": "Sunny and mild today."}]}


# ----------------------------------------------------------------------------- hidden states, vocab maps

def make_hidden_states(target: Path, out: Path, num_samples: int = 24, seed: int = 0,
                       aux_layer_ids=(2, 4, 5), samples_per_shard: int = 8) -> Path:
    """Greedy continuations of random prompts by the target, captured like extraction does.

    Loss mask is 0 on the 4-token prompt, 1 on the continuation.
    """
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(seed)
    vocab = model.config.vocab_size
    entries, buf = [], {k: [] for k in ("ids", "input_ids", "loss_mask", "aux", "last")}
    prompts = torch.randint(3, vocab, (num_samples, 4), generator=g)
    lengths = torch.randint(16, 48, (num_samples,), generator=g).tolist()
    with torch.no_grad():      # one batched greedy generation, cut to each sample's length
        full = model.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=44,
                              min_new_tokens=44, do_sample=False, pad_token_id=0)
    for i in range(num_samples):
        ids = full[i, :lengths[i]]
        with torch.no_grad():
            outs = model(ids[None], output_hidden_states=True)
        hs = outs.hidden_states
        buf["ids"].append(f"s{i}")
        buf["input_ids"].append(ids)
        buf["loss_mask"].append((torch.arange(ids.numel()) >= 4).to(torch.uint8))
        buf["aux"].append(torch.cat([hs[k][0] for k in aux_layer_ids], -1))
        buf["last"].append(hs[-1][0])
        if len(buf["ids"]) == samples_per_shard or i == num_samples - 1:
            entries.append(shards.write_shard(out / "shards" / shards.shard_name(len(entries)), buf["ids"],
                                              buf["input_ids"], buf["loss_mask"], buf["aux"], buf["last"]))
            buf = {k: [] for k in buf}
    # hidden_states[-1] must be the final-norm output (teacher logits = lm_head(last))
    torch.testing.assert_close(model.lm_head(hs[-1]), outs.logits, rtol=1e-4, atol=1e-4)
    manifest = {"format": shards.FORMAT, "shards": entries, "shard_dir": str(out / "shards"),
                "aux_layer_ids": list(aux_layer_ids), "hidden_size": model.config.hidden_size,
                "dtype": "float32", "num_layers": model.config.num_hidden_layers,
                "target_path": str(target), "num_samples": num_samples,
                "num_tokens": sum(e["num_tokens"] for e in entries)}
    write_json(out / "manifest.json", manifest)
    return out / "manifest.json"


def make_vocab_map(manifest: Path, vocab_size: int, draft_vocab: int, out: Path) -> Path:
    """The most frequent tokens of the data, then the lowest ids, sorted by target id."""
    counts = torch.zeros(vocab_size)
    for s in shards.load_manifest(manifest).iter_samples():
        counts += torch.bincount(s["input_ids"].long(), minlength=vocab_size)
    order = torch.argsort(counts + torch.linspace(1e-3, 0, vocab_size), descending=True)
    kept = order[:draft_vocab].sort().values
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[kept] = True
    save_file({"d2t": kept - torch.arange(draft_vocab), "t2d": t2d}, str(out))
    return out


def make_random_vocab_map(vocab: int, draft_vocab: int, path: Path, seed: int = 0) -> Path:
    """``draft_vocab`` target ids drawn at random (no data needed), sorted by target id."""
    g = torch.Generator().manual_seed(seed)
    kept = torch.randperm(vocab, generator=g)[:draft_vocab].sort().values
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[kept] = True
    save_file({"d2t": kept - torch.arange(draft_vocab), "t2d": t2d}, str(path))
    return path


# ----------------------------------------------------------------------------- training and export

# A few dozen steps on the random Llama's hidden states, on the CPU.
TRAIN_CONFIG = {"ttt_steps": 3, "epochs": 8, "batch_tokens": 256, "lr": 5e-3, "warmup_ratio": 0.1,
                "log_every": 1, "checkpoint_every": 3, "keep_checkpoints": 2, "device": "cpu"}


def losses(out: Path) -> list[tuple]:
    """(step, loss, step_loss, step_acc) of every row of a training run's metrics.jsonl."""
    return [(r["step"], r["loss"], r["step_loss"], r["step_acc"])
            for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())]


def save_train_dir(model: Eagle3Draft, out: Path) -> Path:
    """``out`` as training leaves it for export: draft.safetensors and draft_config.json."""
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in model.trainable_state_dict().items()}, str(out / "draft.safetensors"))
    (out / "draft_config.json").write_text(json.dumps(model.config.to_dict()))
    return out


def export_untrained_draft(target: Path, tmp_path: Path, ids=(2, 4, 5), overrides=None,
                        name: str = "draft") -> tuple[dict, set[str]]:
    """An untrained draft of ``target`` (aux layer ``ids``, 100 draft tokens) exported to
    ``tmp_path / name``: its config.json and the names in its model.safetensors."""
    vmap = make_random_vocab_map(json.loads((target / "config.json").read_text())["vocab_size"], 100,
                                 tmp_path / f"{name}-vocab.safetensors")
    d2t, t2d = load_vocab_map(vmap)
    model, _ = build_draft(target, list(ids), d2t, t2d, overrides or {}, seed=0)
    out = export_draft(save_train_dir(model, tmp_path / f"{name}-train"), vmap, target, tmp_path / name)
    config = json.loads((out / "config.json").read_text())
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    return config, names


def make_random_shards(out: Path, lengths: list[int], hidden: int, num_aux: int = 3,
                       storage_dtype: str | None = "fp8", samples_per_shard: int = 4, seed: int = 0) -> Path:
    """Random hidden states of samples of ``lengths`` (every token scored after the first
    two), written by the extraction's writer in ``storage_dtype``, and their manifest."""
    g = torch.Generator().manual_seed(seed)
    entries = []
    for first in range(0, len(lengths), samples_per_shard):
        part = lengths[first:first + samples_per_shard]
        entries.append(shards.write_shard(
            out / "shards" / shards.shard_name(len(entries)), [f"s{first + i}" for i in range(len(part))],
            [torch.randint(0, 100, (n,), generator=g, dtype=torch.int32) for n in part],
            [(torch.arange(n) >= 2).to(torch.uint8) for n in part],
            [torch.randn(n, num_aux * hidden, generator=g) * 3 for n in part],
            [torch.randn(n, hidden, generator=g) for n in part], storage_dtype=storage_dtype))
    manifest = {"format": shards.FORMAT, "shards": entries, "shard_dir": str(out / "shards"),
                "aux_layer_ids": list(range(1, num_aux + 1)), "hidden_size": hidden, "dtype": "float32",
                "num_layers": None, "target_path": None, "num_samples": len(lengths),
                "num_tokens": sum(lengths)}
    write_json(out / "manifest.json", manifest)
    return out / "manifest.json"
