"""The TTT loss's bookkeeping: which rows each step scores, and the loader's host-side copy of it."""
from __future__ import annotations

import torch

from eagle3flow.model.config import DraftConfig
from eagle3flow.model.draft import Eagle3Draft
from eagle3flow.train.loss import _GatherRows, scored_rows, ttt_loss
from eagle3flow.train.data import to_device


def random_batch(lengths: list[int], seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    cu = torch.tensor([0] + lengths).cumsum(0)
    return cu, torch.rand(sum(lengths), generator=g) < 0.6


def test_scored_rows_are_the_rows_whose_target_is_in_the_sample_and_masked_in():
    cu, mask = random_batch([5, 1, 2, 9, 3])
    rows, counts = scored_rows(cu, mask, 4)
    want = []
    for j in range(4):
        for b in range(len(cu) - 1):
            for t in range(int(cu[b]), int(cu[b + 1])):
                if t + j + 2 < cu[b + 1] and mask[t + j + 2]:
                    want.append(t)
    assert rows.tolist() == want
    assert sum(counts) == len(want) and len(counts) == 4
    assert counts[0] > counts[3]


def test_gather_rows_backward_matches_index_select():
    xs = [torch.randn(6, 3, requires_grad=True) for _ in range(3)]
    rows = [torch.tensor([0, 2, 5]), torch.tensor([], dtype=torch.int64), torch.tensor([4, 1])]
    weight = torch.randn(5, 3)
    (_GatherRows.apply(rows, *xs) * weight).sum().backward()
    fast = [x.grad.clone() for x in xs]
    for x in xs:
        x.grad = None
    (torch.cat([x.index_select(0, r) for x, r in zip(xs, rows)]) * weight).sum().backward()
    for a, x in zip(fast, xs):
        assert torch.equal(a, x.grad)


def test_loss_with_the_loaders_host_rows_equals_the_loss_computing_them():
    cfg = DraftConfig.from_target_config(
        {"model_type": "llama", "hidden_size": 32, "num_attention_heads": 4, "num_key_value_heads": 2,
         "intermediate_size": 64, "vocab_size": 97, "max_position_embeddings": 256}, [1, 2, 3], 50)
    torch.manual_seed(0)
    model = Eagle3Draft(cfg)
    model.t2d[:50] = True
    head = torch.randn(50, 32)
    cu, mask = random_batch([7, 12, 3], seed=1)
    n = int(cu[-1])
    rows, counts = scored_rows(cu, mask, 3)
    batch = {"aux": torch.randn(n, 96), "last": torch.randn(n, 32), "input_ids": torch.randint(0, 97, (n,)),
             "loss_mask": mask, "cu_seqlens": cu}
    results = []
    for extra in ({}, {"scored_rows": rows, "step_rows": torch.tensor(counts)}):
        model.zero_grad()
        loss, stats = ttt_loss(model, to_device({**batch, **extra}, torch.device("cpu")), head, 3, 0.8, False)
        loss.backward()
        results.append((loss.detach(), stats.tensor, model.fc.weight.grad.clone()))
    for a, b in zip(*results):
        assert torch.equal(a, b)
    assert results[0][1][:, 2].tolist() == counts
