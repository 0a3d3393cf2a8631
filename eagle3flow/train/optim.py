"""The draft's optimizer and learning-rate schedule.

``train.optimizer``:

* ``adamw``: AdamW on every trainable tensor.
* ``muon``: Muon (:class:`Muon`, ``torch.optim.Muon`` with its Newton-Schulz iteration
  in float32 off CUDA: momentum orthogonalised by Newton-Schulz, its step scaled to
  AdamW's RMS so the same ``lr`` applies) on the hidden matrices (fc, attention and MLP
  projections), AdamW on the rest (norms, and the lm_head, an output layer, where
  Muon's whitening is not what one wants). Under data parallelism each matrix's
  Newton-Schulz runs on one rank only (:func:`muon_owners`) and its update is broadcast:
  every rank holds the same summed gradients, so the update it receives is the one it
  would have computed, bit for bit, each rank running its owners' share of the products
  (27 TFLOP a step in all for an 8B-shaped draft, 107 for Kimi-K2.5's MLA draft; the
  busiest of 8 ranks ~20% of them, one MLP projection being the largest matrix).

``train.lr_schedule``: linear warmup over ``warmup_ratio`` of the steps, then a
``cosine`` or ``linear`` decay to ``lr * min_lr_ratio``. A chained run (streaming
partitions) drives the schedule by tokens trained instead of by steps
(:func:`lr_factor` on fractional "virtual steps").

Both are kept in checkpoints as ``{name: state_dict}`` per optimizer.
"""
from __future__ import annotations

import math
from collections import deque

import torch
import torch.distributed as dist

from eagle3flow.model.optimizer_flops import muon_owners

# Sharded Muon: bytes of received updates in flight before the oldest is waited for and
# applied, so a rank never holds every other rank's updates at once (~1.3 GB in bf16 for
# Kimi-K2.5's MLA draft) while the broadcasts still overlap the owners' Newton-Schulz.
BROADCAST_WINDOW_BYTES = 256 * 2**20

OPTIMIZERS = ("adamw", "muon")
LR_SCHEDULES = ("cosine", "linear")


def lr_factor(schedule: str, total_steps: float, warmup_steps: int, min_ratio: float):
    """``f(step)``: the learning rate of ``step`` as a fraction of the peak."""
    if schedule not in LR_SCHEDULES:
        raise ValueError(f"lr_schedule {schedule!r} is not one of {LR_SCHEDULES}")

    def f(step: float) -> float:
        if step < warmup_steps:   # (a chained run's steps are fractional: never above 1)
            return min(1.0, (step + 1) / warmup_steps)
        progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
        decay = 0.5 * (1 + math.cos(math.pi * progress)) if schedule == "cosine" else 1.0 - progress
        return min_ratio + (1 - min_ratio) * decay
    return f


def uses_muon(name: str, param: torch.Tensor) -> bool:
    """The hidden matrices: 2-D, and not the lm_head (the output layer)."""
    return param.dim() == 2 and not name.startswith("lm_head")


def orthogonalize(matrix: torch.Tensor, coefficients: tuple[float, float, float], steps: int, eps: float,
                  dtype: torch.dtype) -> torch.Tensor:
    """Newton-Schulz's approximation of ``U V^T`` for ``matrix [m, n] = U S V^T``, computed
    in ``dtype`` on the wide orientation (the Gram matrix is the smaller side squared)."""
    tall = matrix.size(0) > matrix.size(1)
    x = matrix.to(dtype)
    x = x.T if tall else x
    x = x / x.norm().clamp(min=eps)         # spectral norm <= 1
    a, b, c = coefficients
    for _ in range(steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.T if tall else x


def update_scale(adjust_lr_fn: str | None, shape: torch.Size) -> float:
    """The factor on ``lr`` for an orthogonalised update of a ``shape`` matrix (torch's
    ``adjust_lr_fn``): ``match_rms_adamw`` gives it AdamW's RMS, ``original`` (None) is
    Keller Jordan's ``sqrt(max(1, rows / cols))``."""
    rows, cols = shape[:2]
    if adjust_lr_fn == "match_rms_adamw":
        return 0.2 * math.sqrt(max(rows, cols))
    return math.sqrt(max(1.0, rows / cols))


class Muon(torch.optim.Muon):
    """``torch.optim.Muon`` (its settings, state and checkpoints) with the Newton-Schulz
    iteration in ``ns_dtype``: by default bfloat16 on CUDA, as torch's, and float32
    elsewhere. torch's casts to bfloat16 on every device; a CPU without bf16 instructions
    runs those products ~27x slower than in float32 (a 576 x 1728 matrix's five
    iterations: 5.1 s against 0.19 s on an AVX2 core), which made them 79% of a CPU
    training step."""

    def __init__(self, params, *args, ns_dtype: torch.dtype | None = None,
                 shard: tuple[int, int] | None = None, **kwargs):
        super().__init__(params, *args, **kwargs)
        self.ns_dtype = ns_dtype       # not a param-group setting: checkpoints stay torch's
        # (rank, world_size) of an initialised process group: each matrix's Newton-Schulz on
        # its owner only, the update broadcast (module doc); None: every matrix here.
        self.shard = shard if shard and shard[1] > 1 else None
        matrices = [p for g in self.param_groups for p in g["params"]]
        self.owners = dict(zip(map(id, matrices), muon_owners([p.shape for p in matrices], self.shard[1])
                               if self.shard else [0] * len(matrices)))

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        in_flight, in_flight_bytes = deque(), 0
        for group in self.param_groups:
            momentum = group["momentum"]
            for param in group["params"]:
                if param.grad is None:
                    continue
                grad, state = param.grad, self.state[param]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(grad)
                buffer = state["momentum_buffer"]
                buffer.lerp_(grad, 1 - momentum)
                dtype = self.ns_dtype or (torch.bfloat16 if param.is_cuda else torch.float32)
                if self.shard and self.owners[id(param)] != self.shard[0]:
                    update = torch.empty(param.shape, dtype=dtype, device=param.device)
                else:
                    update = grad.lerp(buffer, momentum) if group["nesterov"] else buffer
                    update = orthogonalize(update, group["ns_coefficients"], group["ns_steps"], group["eps"], dtype)
                if not self.shard:
                    apply_update(group, param, update)
                    continue
                # every rank issues the broadcasts in the same order (the param groups');
                # a tall matrix's update is a transposed view: send it in row order
                update = update.contiguous()
                work = dist.broadcast(update, src=self.owners[id(param)], async_op=True)
                in_flight.append((work, group, param, update))
                in_flight_bytes += update.numel() * update.element_size()
                while in_flight_bytes > BROADCAST_WINDOW_BYTES:
                    in_flight_bytes -= finish_broadcast(*in_flight.popleft())
        while in_flight:
            finish_broadcast(*in_flight.popleft())
        return loss


def apply_update(group: dict, param: torch.Tensor, update: torch.Tensor) -> None:
    lr = float(group["lr"])
    param.mul_(1 - lr * group["weight_decay"])
    param.add_(update, alpha=-lr * update_scale(group["adjust_lr_fn"], param.shape))


def finish_broadcast(work, group: dict, param: torch.Tensor, update: torch.Tensor) -> int:
    """Wait for one update's broadcast and apply it; returns its bytes."""
    work.wait()
    apply_update(group, param, update)
    return update.numel() * update.element_size()


class Optimizers:
    """One or two torch optimizers stepped together, with one state dict."""

    def __init__(self, optimizers: dict[str, torch.optim.Optimizer]):
        self.optimizers = optimizers

    @property
    def param_groups(self) -> list[dict]:
        return [g for opt in self.optimizers.values() for g in opt.param_groups]

    def zero_grad(self, set_to_none: bool = True) -> None:
        for opt in self.optimizers.values():
            opt.zero_grad(set_to_none=set_to_none)

    def step(self) -> None:
        for opt in self.optimizers.values():
            opt.step()

    def state_dict(self) -> dict:
        return {name: opt.state_dict() for name, opt in self.optimizers.items()}

    def load_state_dict(self, state: dict) -> None:
        if sorted(state) != sorted(self.optimizers):
            raise ValueError(f"checkpoint optimizers {sorted(state)} != this run's {sorted(self.optimizers)}")
        for name, opt in self.optimizers.items():
            opt.load_state_dict(state[name])


def build_optimizers(named_params: list[tuple[str, torch.Tensor]], cfg: dict, device: torch.device,
                     shard: tuple[int, int] | None = None) -> Optimizers:
    """The optimizer(s) ``cfg["optimizer"]`` names over the trainable ``named_params``;
    ``shard``: (rank, world_size) of the data-parallel group Muon shares its work over."""
    name = cfg["optimizer"]
    if name not in OPTIMIZERS:
        raise ValueError(f"optimizer {name!r} is not one of {OPTIMIZERS}")
    fused = device.type == "cuda"
    adamw_kwargs = dict(lr=cfg["lr"], betas=tuple(cfg["adam_betas"]), weight_decay=cfg["weight_decay"],
                        fused=fused)
    if name == "adamw":
        return Optimizers({"adamw": torch.optim.AdamW([p for _, p in named_params], **adamw_kwargs)})
    matrices = [p for n, p in named_params if uses_muon(n, p)]
    rest = [p for n, p in named_params if not uses_muon(n, p)]
    optimizers = {"muon": Muon(matrices, lr=cfg["lr"], weight_decay=cfg["muon_weight_decay"],
                               momentum=cfg["muon_momentum"], adjust_lr_fn="match_rms_adamw", shard=shard)}
    if rest:
        optimizers["adamw"] = torch.optim.AdamW(rest, **adamw_kwargs)
    return Optimizers(optimizers)


class Schedule:
    """Sets every param group's lr to its peak times ``factor(n)`` at step ``n``."""

    def __init__(self, optimizers: Optimizers, factor):
        self.optimizers, self.factor = optimizers, factor
        self.peaks = [g["lr"] for g in optimizers.param_groups]
        self.last_step = 0
        self._apply()

    def _apply(self) -> None:
        f = self.factor(self.last_step)
        for group, peak in zip(self.optimizers.param_groups, self.peaks):
            group["lr"] = peak * f

    def step(self) -> None:
        self.last_step += 1
        self._apply()

    def get_last_lr(self) -> list[float]:
        return [g["lr"] for g in self.optimizers.param_groups]

    def state_dict(self) -> dict:
        return {"last_step": self.last_step, "peaks": list(self.peaks)}

    def load_state_dict(self, state: dict) -> None:
        self.last_step, self.peaks = int(state["last_step"]), list(state["peaks"])
        self._apply()


def build_schedule(optimizers: Optimizers, cfg: dict, total_steps: int, schedule_tokens: int | None,
                   tokens_done) -> Schedule:
    """The run's LR schedule over ``total_steps``, or, for a chained run, over
    ``schedule_tokens`` (every link's) driven by ``tokens_done()``, the tokens the chain has
    trained so far."""
    if schedule_tokens is None:
        warmup = max(1, int(round(cfg["warmup_ratio"] * total_steps)))
        return Schedule(optimizers, lr_factor(cfg["lr_schedule"], total_steps, warmup, cfg["min_lr_ratio"]))
    # The chain's step count is not known before every partition is extracted; its
    # tokens are. The schedule runs on "virtual steps" of batch_tokens tokens each.
    virtual_steps = schedule_tokens / cfg["batch_tokens"]
    warmup = max(1, int(round(cfg["warmup_ratio"] * virtual_steps)))
    by_tokens = lr_factor(cfg["lr_schedule"], virtual_steps, warmup, cfg["min_lr_ratio"])
    return Schedule(optimizers, lambda _step: by_tokens(tokens_done() / cfg["batch_tokens"]))
