"""What the draft is trained to minimise: ``train.loss``, ``train.loss_temperature`` and
``train.lk_hybrid_eta`` read into one :class:`Objective`.

The losses (per scored row, draft ``p`` over the draft vocabulary, at the temperature):

* ``forward_kl``: soft cross-entropy to the teacher, the target renormalised over the draft
  vocabulary (today's loss; it differs from KL by the teacher's entropy, a constant).
* ``tv``: ``1 - alpha``, ``alpha = sum_x min(p(x), q(x))`` with ``q`` the target's own
  probability of each draft token. ``alpha`` is the chance that vLLM's rejection sampling
  accepts a token drafted from ``p``; a target token outside the draft vocabulary can never
  be drafted, so its mass only lowers the ceiling ``sum_x q(x)`` (``1 - alpha`` is the
  total variation between the draft and the full target distribution).
* ``nla``: ``-log alpha`` (the same optimum, with the gradient scaled by ``1/alpha`` so a
  draft far from the target still learns).
* ``lk_hybrid``: ``lambda * forward_kl + (1 - lambda) * tv``, ``lambda = exp(-eta * a)`` with
  ``a`` the mean acceptance of the TTT step over the global batch, held constant in the
  backward (arXiv 2602.23881, the LK losses): KL while the draft is poor, acceptance once
  it is good.

A mix is their weighted sum. The names and weights are checked by eagle3flow.config.loss_mix,
when the workflow is read.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from eagle3flow.config import LOSSES, loss_mix

# The losses that need the target's probability of each draft token, so its full-vocabulary
# normaliser (the lm_head rows outside the draft vocabulary).
ACCEPTANCE_LOSSES = ("tv", "nla", "lk_hybrid")
DEFAULT_MIX = {"forward_kl": 1.0}


@dataclass(frozen=True)
class Objective:
    """``weights``: :func:`loss_mix`; ``temperature``: the logits of both sides are divided by
    it; ``hybrid_eta``: lk_hybrid's decay rate."""
    weights: Mapping[str, float]
    temperature: float = 1.0
    hybrid_eta: float = 3.0

    @classmethod
    def of(cls, train: Mapping) -> "Objective":
        """From the (schema-checked) train section; ValueError naming the key."""
        temperature, eta = train["loss_temperature"], train["lk_hybrid_eta"]
        if not temperature > 0:
            raise ValueError(f"train.loss_temperature: must be > 0, got {temperature!r}")
        if not eta >= 0:
            raise ValueError(f"train.lk_hybrid_eta: must be >= 0, got {eta!r}")
        return cls(loss_mix(train["loss"]), float(temperature), float(eta))

    @property
    def is_forward_kl(self) -> bool:
        """Today's loss exactly: the trainer keeps its original path, bit for bit."""
        return dict(self.weights) == DEFAULT_MIX and self.temperature == 1.0

    @property
    def needs_target_mass(self) -> bool:
        return any(name in self.weights for name in ACCEPTANCE_LOSSES)

    @property
    def needs_step_acceptance(self) -> bool:
        """lk_hybrid's blend needs each step's mean acceptance before any gradient."""
        return "lk_hybrid" in self.weights

    def weight(self, name: str) -> float:
        return self.weights.get(name, 0.0)
