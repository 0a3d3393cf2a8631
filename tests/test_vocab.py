"""Draft vocab map: frequency selection on assistant tokens, cap, fill, maps, coverage."""
from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest
import torch
from safetensors.torch import load_file

from eagle3flow.data.vocab import build_vocab_map, main, target_vocab_size

VT = 20
# Assistant (loss_mask 1) counts: 5 x5, 3 x4, 7 x4, 2 x2, 9 x2, 1 x1 -> 18 tokens.
# Id 11 appears 100 times but only in prompts (loss_mask 0): it must not be chosen.
ASSISTANT = [5] * 5 + [3] * 4 + [7] * 4 + [2] * 2 + [9] * 2 + [1]
PROMPT = [11] * 100


def write_dataset(path, rows):
    frame = pd.DataFrame([{
        "id": f"r{i}", "input_ids": np.asarray(ids, np.int32), "loss_mask": np.asarray(mask, np.int8),
        "num_tokens": np.int32(len(ids))} for i, (ids, mask) in enumerate(rows)])
    frame.to_parquet(path)
    return path


@pytest.fixture
def datasets(tmp_path):
    """The counts above split over two parquet files, prompt and answer tokens interleaved."""
    rng = np.random.default_rng(0)
    tokens = [(t, 1) for t in ASSISTANT] + [(t, 0) for t in PROMPT]
    tokens = [tokens[i] for i in rng.permutation(len(tokens))]
    rows = [list(zip(*tokens[i:i + 7])) for i in range(0, len(tokens), 7)]
    half = len(rows) // 2
    return [write_dataset(tmp_path / "a.parquet", rows[:half]),
            write_dataset(tmp_path / "b.parquet", rows[half:])]


def build(tmp_path, datasets, draft_size):
    out, stats_path = tmp_path / "vocab" / "vocab_map.safetensors", tmp_path / "vocab" / "stats.json"
    stats = build_vocab_map(datasets, VT, draft_size, out, stats_path)
    maps = load_file(str(out))
    assert json.loads(stats_path.read_text()) == stats
    d2t, t2d = maps["d2t"], maps["t2d"]
    assert d2t.dtype == torch.int64 and t2d.dtype == torch.bool and t2d.shape == (VT,)
    draft_to_target = torch.arange(len(d2t)) + d2t
    assert int(t2d.sum()) == len(d2t)
    assert bool(t2d[draft_to_target].all())
    assert bool((draft_to_target[1:] > draft_to_target[:-1]).all()), "draft ids ordered by target id"
    return draft_to_target.tolist(), stats


def test_most_frequent_assistant_tokens_ties_by_lower_id(tmp_path, datasets):
    # Size 4: 5, 3, 7, then the 2-vs-9 tie goes to the lower id 2; prompt-only 11 is out.
    selected, stats = build(tmp_path, datasets, 4)
    assert selected == [2, 3, 5, 7]
    assert stats["draft_vocab_size"] == 4 and stats["target_vocab_size"] == VT
    assert stats["assistant_tokens"] == 18 and stats["distinct_assistant_tokens"] == 6
    assert stats["coverage"] == pytest.approx(15 / 18)
    assert stats["coverage_at_size"]["1"] == pytest.approx(5 / 18)
    assert stats["coverage_at_size"]["2"] == pytest.approx(9 / 18)
    assert stats["coverage_at_size"][str(VT)] == pytest.approx(1.0)


def test_fill_with_unseen_ids_in_ascending_order(tmp_path, datasets):
    selected, stats = build(tmp_path, datasets, 8)
    assert selected == [0, 1, 2, 3, 4, 5, 7, 9]  # 6 seen + unseen 0 and 4
    assert stats["filled_unseen_ids"] == 2 and stats["coverage"] == pytest.approx(1.0)


def test_capped_at_target_vocab(tmp_path, datasets):
    selected, stats = build(tmp_path, datasets, 1000)
    assert selected == list(range(VT))
    assert stats["draft_vocab_size"] == VT and stats["requested_draft_vocab_size"] == 1000


def test_cli_reads_target_vocab_from_config(tmp_path, datasets):
    target = tmp_path / "target"
    target.mkdir()
    (target / "config.json").write_text(json.dumps({"vocab_size": 512}))
    out = tmp_path / "cli" / "vocab_map.safetensors"
    main(["--dataset", *map(str, datasets), "--target", str(target),
          "--config-json", json.dumps({"draft_vocab_size": 4}), "--out", str(out), "--stats", str(tmp_path / "cli" / "s.json")])
    maps = load_file(str(out))
    assert maps["t2d"].shape == (512,)
    assert (torch.arange(4) + maps["d2t"]).tolist() == [2, 3, 5, 7]


def test_target_vocab_size_flat_and_nested(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": 512, "hidden_size": 64}))
    assert target_vocab_size(tmp_path) == 512
    (tmp_path / "config.json").write_text(json.dumps({"text_config": {"vocab_size": 151936}}))
    assert target_vocab_size(tmp_path) == 151936


def test_bad_input_is_named(tmp_path):
    bad = write_dataset(tmp_path / "bad.parquet", [([1, 2], [1, 1]), ([3, VT], [0, 1])])
    with pytest.raises(ValueError, match=r"bad.parquet: row 1 \(id r1\).*outside"):
        build_vocab_map([bad], VT, 4, tmp_path / "v.safetensors", tmp_path / "s.json")
    no_answers = write_dataset(tmp_path / "prompts.parquet", [([1, 2], [0, 0])])
    with pytest.raises(ValueError, match="no token has loss_mask == 1"):
        build_vocab_map([no_answers], VT, 4, tmp_path / "v.safetensors", tmp_path / "s.json")
