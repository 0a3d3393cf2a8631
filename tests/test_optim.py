"""The draft's optimizers (Muon on the hidden matrices, AdamW on the rest) and LR schedules,
and the training options that shape the draft (frozen lm_head, target-layer init, sharper
teacher, noise), each checked on a real training step."""
from __future__ import annotations

import io
import math

import pytest
import torch

from eagle3flow.train.optim import Muon, Optimizers, Schedule, build_optimizers, lr_factor
from eagle3flow.config import section_settings


def named_draft_params():
    torch.manual_seed(0)
    return [("fc.weight", torch.nn.Parameter(torch.randn(8, 24))),
            ("midlayer.self_attn.q_proj.weight", torch.nn.Parameter(torch.randn(8, 16))),
            ("midlayer.hidden_norm.weight", torch.nn.Parameter(torch.ones(8))),
            ("lm_head.weight", torch.nn.Parameter(torch.randn(30, 8)))]


def test_muon_takes_the_hidden_matrices_and_adamw_the_rest():
    named = named_draft_params()
    cfg = section_settings("train", {"optimizer": "muon"})
    opts = build_optimizers(named, cfg, torch.device("cpu"))
    assert sorted(opts.optimizers) == ["adamw", "muon"]
    by_opt = {name: {id(p) for g in opt.param_groups for p in g["params"]}
              for name, opt in opts.optimizers.items()}
    params = dict(named)
    assert by_opt["muon"] == {id(params["fc.weight"]), id(params["midlayer.self_attn.q_proj.weight"])}
    assert by_opt["adamw"] == {id(params["midlayer.hidden_norm.weight"]), id(params["lm_head.weight"])}
    before = {n: p.detach().clone() for n, p in named}
    for _, p in named:
        p.grad = torch.randn_like(p)
    opts.step()
    assert all(not torch.equal(before[n], p) for n, p in named), "every group moved"
    # state round trip through a file (as a checkpoint): the reloaded optimizer takes the same next step
    buffer = io.BytesIO()
    torch.save(opts.state_dict(), buffer)
    buffer.seek(0)
    state = torch.load(buffer, weights_only=False)
    twin_named = [(n, torch.nn.Parameter(p.detach().clone())) for n, p in named]
    twin = build_optimizers(twin_named, cfg, torch.device("cpu"))
    twin.load_state_dict(state)
    grads = {n: torch.randn_like(p) for n, p in named}
    for (n, p), (_, q) in zip(named, twin_named):
        p.grad, q.grad = grads[n].clone(), grads[n].clone()
    opts.step()
    twin.step()
    for (n, p), (_, q) in zip(named, twin_named):
        assert torch.equal(p, q), n
    with pytest.raises(ValueError, match="checkpoint optimizers"):
        build_optimizers(named, section_settings("train", {"optimizer": "adamw"}), torch.device("cpu")).load_state_dict(state)


def muon_steps(optimizer_class, steps: int = 4, **kwargs) -> tuple[list[torch.Tensor], torch.optim.Optimizer]:
    """A tall and a wide matrix after ``steps`` Muon steps on the same gradients, and the optimizer."""
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(48, 16)), torch.nn.Parameter(torch.randn(16, 40))]
    grads = [[torch.randn_like(p) for p in params] for _ in range(steps)]
    optimizer = optimizer_class(params, lr=0.02, weight_decay=0.1, momentum=0.95,
                                adjust_lr_fn="match_rms_adamw", **kwargs)
    for step_grads in grads:
        for p, g in zip(params, step_grads):
            p.grad = g
        optimizer.step()
    return [p.detach() for p in params], optimizer


def test_muon_is_torchs_with_the_newton_schulz_dtype_of_the_device():
    """In bfloat16 it takes torch.optim.Muon's steps exactly and loads its checkpoints; on
    the CPU by default it iterates in float32, nearer a float64 iteration than bfloat16 is."""
    theirs, torch_muon = muon_steps(torch.optim.Muon)
    same, _ = muon_steps(Muon, ns_dtype=torch.bfloat16)
    for a, b in zip(theirs, same):
        assert torch.equal(a, b)
    ours, _ = muon_steps(Muon)
    exact, _ = muon_steps(Muon, ns_dtype=torch.float64)
    for a, b, c in zip(ours, exact, theirs):
        assert (a - b).abs().max() < 0.1 * (c - b).abs().max(), "float32 iterations on the CPU"
    twin = Muon([torch.nn.Parameter(p.clone()) for p in theirs], lr=0.02, adjust_lr_fn="match_rms_adamw")
    twin.load_state_dict(torch_muon.state_dict())
    assert torch.equal(twin.state[twin.param_groups[0]["params"][0]]["momentum_buffer"],
                       torch_muon.state[torch_muon.param_groups[0]["params"][0]]["momentum_buffer"])


@pytest.mark.parametrize("schedule", ["cosine", "linear"])
def test_schedule_warms_up_then_decays_to_the_floor(schedule):
    f = lr_factor(schedule, total_steps=100, warmup_steps=10, min_ratio=0.1)
    assert f(0) == pytest.approx(0.1) and f(9) == pytest.approx(1.0)
    values = [f(s) for s in range(10, 101)]
    assert all(a >= b for a, b in zip(values, values[1:])) and values[-1] == pytest.approx(0.1)
    middle = f(55)
    assert middle == pytest.approx(0.1 + 0.9 * (0.5 if schedule == "linear" else 0.5 * (1 + math.cos(math.pi / 2))))
    opts = Optimizers({"a": torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=2.0)})
    sched = Schedule(opts, f)
    assert sched.get_last_lr() == [pytest.approx(2.0 * f(0))]
    for _ in range(55):
        sched.step()
    assert sched.get_last_lr() == [pytest.approx(2.0 * middle)]
    again = Schedule(opts, f)
    again.load_state_dict(sched.state_dict())
    assert again.get_last_lr() == sched.get_last_lr()


def test_unknown_choices_are_refused():
    for bad in ({"optimizer": "sgd"}, {"lr_schedule": "step"}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            section_settings("train", bad)
