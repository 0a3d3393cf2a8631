"""The decode walk of the teacher-forced evaluation: the acceptance length greedy
speculative decoding measures, from per-row leading hits."""
from __future__ import annotations

import random

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
