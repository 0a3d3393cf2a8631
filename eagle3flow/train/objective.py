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

A mix is their weighted sum. Pure Python: the workflow checks a config with it before any job.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

LOSSES = ("forward_kl", "tv", "nla", "lk_hybrid")
# The losses that need the target's probability of each draft token, so its full-vocabulary
# normaliser (the lm_head rows outside the draft vocabulary).
ACCEPTANCE_LOSSES = ("tv", "nla", "lk_hybrid")
DEFAULT_MIX = {"forward_kl": 1.0}


def loss_mix(value) -> dict[str, float]:
    """``train.loss`` as ``{name: weight}`` (weights > 0, in LOSSES order); ValueError naming the key."""
    if isinstance(value, str):
        value = {value: 1.0}
    if not isinstance(value, Mapping) or not value:
        raise ValueError(f"train.loss: {value!r} is neither one of {list(LOSSES)} nor a mapping of them to weights")
    unknown = sorted(set(value) - set(LOSSES))
    if unknown:
        raise ValueError(f"train.loss: unknown losses {unknown} (known: {list(LOSSES)})")
    for name, weight in value.items():
        if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not weight >= 0:
            raise ValueError(f"train.loss.{name}: the weight must be a number >= 0, got {weight!r}")
    mix = {name: float(value[name]) for name in LOSSES if value.get(name, 0) > 0}
    if not mix:
        raise ValueError(f"train.loss: every weight is 0 ({dict(value)}): give at least one loss a weight > 0")
    return mix


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
