"""The matrix products the optimizer runs per step: Muon's Newton-Schulz iteration over the
draft's hidden matrices (train/optim.py), once per optimizer step on every process, whatever
the batch; none for AdamW. Torch-free, so the plan projects training time with it; the
trainer's MFU adds it to eagle3flow/model/flops.py's count of the model's products.
tests/test_flops.py checks it against torch's count of a real Muon step."""
from __future__ import annotations

# torch.optim.Muon's default, which train/optim.py's Muon keeps
NEWTON_SCHULZ_STEPS = 5


def newton_schulz_flops(shapes, steps: int = NEWTON_SCHULZ_STEPS) -> float:
    """FLOPs of Muon's Newton-Schulz iteration (train/optim.py ``orthogonalize``) over
    matrices of ``shapes`` ``(rows, cols)``, one optimizer step: per matrix and iteration,
    on the wide orientation ``x [s, b]`` (``s <= b``), ``x x^T`` and ``(..) x`` (``2 s^2 b``
    each) and the Gram matrix squared (``2 s^3``)."""
    total = 0
    for rows, cols in shapes:
        small, big = min(rows, cols), max(rows, cols)
        total += steps * (4 * small * small * big + 2 * small ** 3)
    return float(total)


def optimizer_flops_per_step(cfg, optimizer: str, steps: int = NEWTON_SCHULZ_STEPS) -> float:
    """The matrix products ``train.optimizer`` runs per optimizer step on every rank: Muon's
    Newton-Schulz over the draft's hidden matrices (``cfg``: a DraftConfig), none for AdamW."""
    return newton_schulz_flops(cfg.hidden_matrix_shapes(), steps) if optimizer == "muon" else 0.0
