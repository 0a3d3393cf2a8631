"""The decode walk of the teacher-forced evaluation: the acceptance length greedy
speculative decoding measures, from per-row leading hits."""
from __future__ import annotations

import random

import pytest
import torch

from eagle3flow.eval.replay import replay_greedy_speculation
from eagle3flow.train.eval_split import decode_walk, masked_spans


def leading_hits(chains: list[list[int]], ids: list[int]) -> list[int]:
    """Per row, how many of its K guesses in a row equal the sequence (cut at its end)."""
    run = []
    for t, row in enumerate(chains):
        n = 0
        while n < len(row) and t + 2 + n < len(ids) and row[n] == ids[t + 2 + n]:
            n += 1
        run.append(n)
    return run


def test_decode_walk_equals_the_exact_replay_on_random_sequences():
    rng = random.Random(0)
    for trial in range(200):
        total, k = rng.randint(3, 40), rng.randint(1, 7)
        prompt_len = rng.randint(1, total - 1)
        ids = [rng.randint(0, 3) for _ in range(total)]          # small vocab: many hits
        chains = [[rng.randint(0, 3) for _ in range(k)] for _ in range(total)]
        replay = replay_greedy_speculation(chains, ids, prompt_len)
        mask = torch.tensor([0] * prompt_len + [1] * (total - prompt_len))
        spans = masked_spans(torch.tensor([0, total]), mask)
        assert spans == [(prompt_len - 1, total)]
        assert decode_walk(leading_hits(chains, ids), spans) == (replay["accepted"], replay["rounds"]), trial


def test_spans_stay_inside_their_sample_and_start_one_row_early():
    cu = torch.tensor([0, 5, 9, 12])
    mask = torch.tensor([0, 0, 1, 1, 0,   1, 1, 0, 1,   0, 1, 1])
    # sample 2's first span opens the sample: its first draft row is the row itself
    assert masked_spans(cu, mask) == [(1, 4), (5, 7), (7, 9), (9, 12)]


def test_walk_counts_each_step_once_not_each_row():
    # 8 answer tokens the draft always gets right with K=3: rows 0, 4 -> 2 drafts, and
    # the last step at row 4 can only accept indices 6..7 (the span ends at 8).
    run = [3, 3, 3, 3, 2, 1, 0, 0]
    assert decode_walk(run, [(0, 8)]) == (5, 2)


def test_spans_match_a_row_by_row_scan_on_random_batches():
    rng = random.Random(1)
    for _ in range(100):
        lengths = [rng.randint(0, 12) for _ in range(rng.randint(1, 6))]
        cu = torch.tensor([0] + lengths).cumsum(0)
        mask = torch.tensor([rng.random() < 0.6 for _ in range(int(cu[-1]))], dtype=torch.bool)
        want = []
        for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):
            t = a
            while t < b:
                if mask[t]:
                    e = t
                    while e < b and mask[e]:
                        e += 1
                    want.append((max(t - 1, a), e))
                    t = e
                else:
                    t += 1
        assert masked_spans(cu, mask) == want, (lengths, mask.tolist())


def test_rejection_walk_is_the_decode_walk_where_alpha_is_0_or_1():
    """train.checkpoint_metric rejection_estimate walks speculative sampling in expectation
    over the same spans; with every step's acceptance 0 or 1 it is greedy's walk exactly."""
    from eagle3flow.train.eval_split import rejection_walk

    rng = random.Random(1)
    for trial in range(100):
        total, k = rng.randint(4, 40), rng.randint(1, 5)
        ids = [rng.randint(0, 3) for _ in range(total)]
        chains = [[rng.randint(0, 3) for _ in range(k)] for _ in range(total)]
        mask = torch.tensor([rng.random() < 0.8 for _ in range(total)], dtype=torch.long)
        spans = masked_spans(torch.tensor([0, total // 2, total]), mask)
        run = [0] * total
        alpha = [[0.0] * k for _ in range(total)]
        for s, e in spans:     # hits inside each span only, as the scored mask makes them
            for t in range(s, e):
                for j in range(k):
                    alpha[t][j] = float(t + 2 + j < e and chains[t][j] == ids[t + 2 + j])
                run[t] = next((j for j in range(k) if not alpha[t][j]), k)
        assert rejection_walk(alpha, spans) == pytest.approx(decode_walk(run, spans)), trial


def test_rejection_estimate_on_the_split_tends_to_the_decode_walk_as_t_goes_to_0(random_llama_target, tmp_path):
    from safetensors.torch import load_file

    from eagle3flow.extract.shards import load_manifest
    from eagle3flow.train.build import build_draft
    from eagle3flow.train.eval_split import evaluate_split
    from support.builders import make_hidden_states, make_vocab_map

    manifest = make_hidden_states(random_llama_target, tmp_path / "hs", 4, seed=1)
    maps = load_file(str(make_vocab_map(manifest, 512, 200, tmp_path / "vocab_map.safetensors")))
    model, head = build_draft(random_llama_target, load_manifest(manifest).aux_layer_ids, maps["d2t"],
                              maps["t2d"], {}, 0)
    cold = evaluate_split(model, manifest, 3, teacher_head=head.float(), temperature=1e-4)
    # An untrained draft: both walks find nothing to accept (the exact agreement where
    # something is accepted is the test above, on known hits).
    assert cold["rejection_temperature"] == 1e-4
    assert cold["rejection_acceptance_length"]["3"] == pytest.approx(cold["decode_acceptance_length"]["3"], abs=1e-3)
    hot = evaluate_split(model, manifest, 3, teacher_head=head.float(), temperature=1.0)
    assert 1.0 <= hot["rejection_acceptance_length"]["3"] <= 4.0
    assert "rejection_acceptance_length" not in evaluate_split(model, manifest, 3, teacher_head=head.float())
