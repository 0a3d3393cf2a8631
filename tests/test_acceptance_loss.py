"""train.loss: the LK acceptance losses against closed forms and autograd, forward KL bit for
bit as before, mixes, temperature, and bad settings refused by key."""
from __future__ import annotations

import math

import pytest
import torch

from eagle3flow.config import section_settings
from eagle3flow.model.config import DraftConfig
from eagle3flow.model.draft import Eagle3Draft
from eagle3flow.model.kernels.acceptance import (_ChunkedLinearAcceptance, linear_acceptance_loss,
                                                 row_acceptance)
from eagle3flow.train.loss import scored_rows, ttt_loss
from eagle3flow.train.objective import Objective
from eagle3flow.train.trainer import train
from support.builders import TRAIN_CONFIG

TRAIN_DEFAULTS = section_settings("train", {})


def objective(**train) -> Objective:
    return Objective.of({**TRAIN_DEFAULTS, **train})


def chunked(*args, max_chunk_elements=2 ** 26):
    """The CUDA path's chunked computation, run on the CPU in float32."""
    return _ChunkedLinearAcceptance.apply(*args, max_chunk_elements)


def test_tv_and_nla_equal_their_closed_forms_with_mass_outside_the_draft_vocab():
    # The target over 4 tokens, the last outside the 3-token draft vocab.
    q_full = torch.tensor([0.5, 0.2, 0.1, 0.2])
    draft = torch.tensor([[0.3, 0.3, 0.4]])
    teacher = q_full[:3].log().unsqueeze(0)
    teacher_lse = torch.logsumexp(teacher, -1)         # over the draft vocab: mass 0.8
    target_lse = torch.zeros(1)                        # over the target's: mass 1
    alpha = 0.3 + 0.2 + 0.1                            # sum min(draft, target) per draft token
    # 1 - alpha is the total variation to the full target: the outside token counts at |0 - 0.2|
    assert 0.5 * (draft.squeeze(0) - q_full[:3]).abs().sum() + 0.5 * 0.2 == pytest.approx(1 - alpha)
    p = q_full[:3] / 0.8
    ce = -(p * draft.squeeze(0).log()).sum().item()
    args = (draft.log(), torch.eye(3), teacher, teacher_lse, target_lse, torch.tensor([0]), torch.tensor([0]))
    mixed = 0.5 * ce + 2 * (1 - alpha) - 0.25 * math.log(alpha)
    for weights, want in (((0.0, 1.0, 0.0), 1 - alpha), ((0.0, 0.0, 1.0), -math.log(alpha)),
                          ((1.0, 0.0, 0.0), ce), ((0.5, 2.0, 0.25), mixed)):
        w = [torch.tensor([v]) for v in weights]
        for fn in (linear_acceptance_loss, chunked):
            total, row_ce, row_alpha, hits = fn(*args, *w)
            assert total.item() == pytest.approx(want, rel=1e-6), (fn, weights)
            assert row_alpha.item() == pytest.approx(alpha, rel=1e-6) and row_ce.item() == pytest.approx(ce, rel=1e-6)
            assert hits.tolist() == [False]                # the draft's argmax 2, the target's 0
    assert row_acceptance(*args[:6]).item() == pytest.approx(alpha, rel=1e-6)
    # A draft equal to the target on the draft vocab accepts all it can: 1 - the outside mass.
    equal = linear_acceptance_loss((q_full[:3] / 0.8).log().unsqueeze(0), *args[1:],
                                   *[torch.tensor([v]) for v in (0.0, 1.0, 0.0)])
    assert equal[2].item() == pytest.approx(0.8, rel=1e-6)


def straightforward_loss(x, weight, full_teacher, t2d, target, ce_w, tv_w, nla_w):
    """The losses as the paper writes them, from the target's full distribution."""
    d = torch.softmax(x @ weight.T, -1)
    q = torch.softmax(full_teacher[target], -1)[:, t2d]
    p = torch.softmax(full_teacher[target][:, t2d], -1)
    alpha = torch.minimum(d, q).sum(-1)
    return (ce_w * -(p * d.log()).sum(-1) + tv_w * (1 - alpha) - nla_w * alpha.log()).sum()


def test_gradients_match_autograd_of_a_straightforward_reference():
    g = torch.Generator().manual_seed(0)
    n, hidden, vocab, full_vocab, teachers = 37, 16, 50, 80, 45
    t2d = torch.zeros(full_vocab, dtype=torch.bool)
    t2d[torch.randperm(full_vocab, generator=g)[:vocab]] = True
    full_teacher = torch.randn(teachers, full_vocab, generator=g) * 2
    teacher = full_teacher[:, t2d]
    teacher_lse, target_lse = torch.logsumexp(teacher, -1), torch.logsumexp(full_teacher, -1)
    target = torch.randint(0, teachers, (n,), generator=g)
    weights = [torch.rand(n, generator=g) for _ in range(3)]
    x0, w0 = torch.randn(n, hidden, generator=g), torch.randn(vocab, hidden, generator=g) * 0.5

    def grads(fn, *args):
        x, w = x0.clone().requires_grad_(), w0.clone().requires_grad_()
        total = fn(x, w, *args)
        total = total[0] if isinstance(total, tuple) else total
        total.backward()
        return total.detach(), x.grad, w.grad

    want = grads(straightforward_loss, full_teacher, t2d, target, *weights)
    common = (teacher, teacher_lse, target_lse, target, teacher.argmax(-1), *weights)
    # the CPU path, and the CUDA path's chunks (several here) run in float32 on the CPU
    for got in (grads(linear_acceptance_loss, *common),
                grads(lambda *a: chunked(*a, max_chunk_elements=10 * vocab), *common)):
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def tiny_step():
    """A random draft, its teacher heads and one packed batch, as ttt_loss takes them."""
    cfg = DraftConfig.from_target_config(
        {"model_type": "llama", "hidden_size": 32, "num_attention_heads": 4, "num_key_value_heads": 2,
         "intermediate_size": 64, "vocab_size": 97, "max_position_embeddings": 256}, [1, 2, 3], 50)
    torch.manual_seed(0)
    model = Eagle3Draft(cfg)
    model.t2d[:50] = True
    head, unreachable = torch.randn(50, 32) * 0.3, torch.randn(47, 32) * 0.3
    g = torch.Generator().manual_seed(1)
    cu = torch.tensor([0, 7, 19, 22])
    n = int(cu[-1])
    batch = {"aux": torch.randn(n, 96, generator=g), "last": torch.randn(n, 32, generator=g),
             "input_ids": torch.randint(0, 97, (n,), generator=g), "loss_mask": torch.rand(n, generator=g) < 0.7,
             "cu_seqlens": cu}
    return model, head, unreachable, batch


def step(model, head, unreachable, batch, **kwargs):
    """``(loss, per-step stats, gradients)`` of one ttt_loss call with 3 TTT steps."""
    model.zero_grad()
    loss, stats = ttt_loss(model, batch, head, 3, 0.8, autocast=False, unreachable_head=unreachable, **kwargs)
    loss.backward()
    return loss.detach(), list(stats), [p.grad.clone() for p in model.parameters() if p.grad is not None]


def test_forward_kl_is_todays_loss_bit_for_bit():
    model, head, unreachable, batch = tiny_step()
    today = step(model, head, None, batch)
    for spelled in ("forward_kl", {"forward_kl": 1}, {"forward_kl": 1.0, "nla": 0}):
        loss, stats, grads = step(model, head, None, batch, objective=objective(loss=spelled))
        assert torch.equal(loss, today[0]) and stats == today[1]
        assert all(torch.equal(a, b) for a, b in zip(grads, today[2]))


def test_a_mix_is_the_weighted_sum_and_lk_hybrid_blends_by_acceptance():
    model, head, unreachable, batch = tiny_step()
    parts = {name: step(model, head, unreachable, batch, objective=objective(loss=name))
             for name in ("forward_kl", "tv", "nla", "lk_hybrid")}
    mix = {"forward_kl": 0.5, "nla": 0.25, "tv": 2.0}
    loss, stats, grads = step(model, head, unreachable, batch, objective=objective(loss=mix))
    torch.testing.assert_close(loss, sum(w * parts[k][0] for k, w in mix.items()))
    for j in range(3):
        assert stats[j][0] == pytest.approx(sum(w * parts[k][1][j][0] for k, w in mix.items()), rel=1e-5)
    for i, grad in enumerate(grads):
        torch.testing.assert_close(grad, sum(w * parts[k][2][i] for k, w in mix.items()), rtol=1e-4, atol=1e-7)
    # lk_hybrid: lambda_j * KL_j + (1 - lambda_j) * TV_j, lambda_j = exp(-3 * mean acceptance of step j)
    decays = [0.8 ** j for j in range(3)]
    hybrid = 0.0
    for j in range(3):
        kl, tv = parts["forward_kl"][1][j][0], parts["tv"][1][j][0]
        blend = math.exp(-3 * (1 - tv))
        assert parts["lk_hybrid"][1][j][0] == pytest.approx(blend * kl + (1 - blend) * tv, rel=1e-5)
        hybrid += decays[j] * (blend * kl + (1 - blend) * tv)
    assert parts["lk_hybrid"][0].item() == pytest.approx(hybrid, rel=1e-5)
    # eta 0 is forward KL alone
    eta0 = step(model, head, unreachable, batch, objective=objective(loss="lk_hybrid", lk_hybrid_eta=0))
    torch.testing.assert_close(eta0[0], parts["forward_kl"][0])


def test_the_temperature_divides_both_sides_logits():
    model, head, unreachable, batch = tiny_step()
    warm = step(model, head, unreachable, batch, objective=objective(loss={"forward_kl": 1, "nla": 1},
                                                                     loss_temperature=2.0))
    with torch.no_grad():
        model.lm_head.weight /= 2
    cooled = step(model, head / 2, unreachable / 2, batch, objective=objective(loss={"forward_kl": 1, "nla": 1}))
    torch.testing.assert_close(warm[0], cooled[0])
    assert [s[1] for s in warm[1]] == [s[1] for s in cooled[1]]


def test_lk_hybrid_takes_the_global_batchs_acceptance():
    """Under data parallelism the blend is the global batch's: the sum comes through reduce_sum."""
    model, head, unreachable, batch = tiny_step()
    summed = []
    step(model, head, unreachable, batch, objective=objective(loss="lk_hybrid"),
         reduce_sum=lambda t: summed.append(t.clone()) or t)
    rows, counts = scored_rows(batch["cu_seqlens"], batch["loss_mask"], 3)
    assert len(summed) == 1 and summed[0].shape == (3,) and bool((summed[0] <= torch.tensor(counts)).all())


@pytest.mark.parametrize("given, key", [
    ({"loss": "kl_div"}, "train.loss"),
    ({"loss": {"nla": -1}}, "train.loss.nla"),
    ({"loss": {"forward_kl": 0.5, "reverse_kl": 0.5}}, "train.loss"),
    ({"loss": {"nla": 0, "tv": 0}}, "train.loss"),
    ({"loss": {}}, "train.loss"),
    ({"loss_temperature": 0}, "train.loss_temperature"),
    ({"lk_hybrid_eta": -1}, "train.lk_hybrid_eta"),
])
def test_a_bad_loss_is_refused_naming_its_key_before_any_model_loads(tmp_path, given, key):
    with pytest.raises(ValueError, match=key.replace(".", "\\.")):
        train(tmp_path / "no-manifest.json", None, tmp_path / "no-vocab", tmp_path / "no-target", tmp_path / "o",
              tmp_path / "c", {**TRAIN_CONFIG, **given})
