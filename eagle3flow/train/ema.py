"""An exponential moving average of the trained weights (``train.ema_decay``).

The average follows the weights after every optimizer step; evaluations, the best
checkpoint and the written draft use it (:meth:`WeightAverage.swapped_in`), training
goes on from the raw weights. Early on the decay is ``min(decay, (1 + n) / (10 + n))``
at step ``n`` so the average does not keep the random initialization for long.
"""
from __future__ import annotations

from contextlib import contextmanager

import torch


class WeightAverage:
    """The average of ``params`` (a list of tensors), kept beside them on their device."""

    def __init__(self, params: list[torch.Tensor], decay: float):
        self.params, self.decay = params, float(decay)
        self.average = [p.detach().clone() for p in params]

    @torch.no_grad()
    def update(self, step: int) -> None:
        """After optimizer step ``step`` (1-based)."""
        decay = min(self.decay, (1 + step) / (10 + step))
        torch._foreach_lerp_(self.average, [p.detach() for p in self.params], 1.0 - decay)

    @contextmanager
    def swapped_in(self):
        """The average in the params' place, the raw weights back afterwards."""
        raw = [p.detach().clone() for p in self.params]
        with torch.no_grad():
            for p, a in zip(self.params, self.average):
                p.copy_(a)
        try:
            yield
        finally:
            with torch.no_grad():
                for p, r in zip(self.params, raw):
                    p.copy_(r)

    def state_dict(self) -> list[torch.Tensor]:
        return [a.cpu() for a in self.average]

    def load_state_dict(self, state: list[torch.Tensor]) -> None:
        if len(state) != len(self.average):
            raise ValueError(f"checkpoint weight average has {len(state)} tensors, this draft {len(self.average)}")
        with torch.no_grad():
            for a, s in zip(self.average, state):
                a.copy_(s)
