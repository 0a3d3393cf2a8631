"""The matrix products the optimizer runs per step: Muon's Newton-Schulz iteration over the
draft's hidden matrices (train/optim.py), once per optimizer step whatever the batch, shared
by the ranks of a data-parallel job (each matrix on its owner, :func:`muon_owners`); none for
AdamW. Torch-free, so the plan projects training time with it; the trainer's MFU adds it to
eagle3flow/model/flops.py's count of the model's products.
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
    """The matrix products ``train.optimizer`` runs per optimizer step, all ranks together:
    Muon's Newton-Schulz over the draft's hidden matrices (``cfg``: a DraftConfig), none for
    AdamW."""
    return newton_schulz_flops(cfg.hidden_matrix_shapes(), steps) if optimizer == "muon" else 0.0


def newton_schulz_shares(shapes, world_size: int) -> tuple[list[int], list[float]]:
    """Each matrix of ``shapes``'s owner under data parallelism and each rank's Newton-Schulz
    FLOPs: the largest matrix first, each to the least-loaded rank (ties: the lowest rank),
    so every rank derives the same owners from the shapes alone."""
    load = [0.0] * world_size
    owners = [0] * len(shapes)
    cost = [newton_schulz_flops([tuple(shape[:2])]) for shape in shapes]
    for i in sorted(range(len(shapes)), key=lambda i: (-cost[i], i)):
        rank = min(range(world_size), key=lambda r: (load[r], r))
        owners[i] = rank
        load[rank] += cost[i]
    return owners, load


def muon_owners(shapes, world_size: int) -> list[int]:
    """The rank that orthogonalises each matrix of ``shapes`` (:func:`newton_schulz_shares`)."""
    return newton_schulz_shares(shapes, world_size)[0]


def busiest_rank_flops_per_step(cfg, optimizer: str, world_size: int) -> float:
    """The optimizer products of the rank that runs the most of them (:func:`muon_owners`):
    a data-parallel step waits for it. A draft has few matrices, one MLP projection the
    largest, so on 8 ranks the busiest runs ~20% of them, not 1/8."""
    if optimizer != "muon":
        return 0.0
    return max(newton_schulz_shares(cfg.hidden_matrix_shapes(), max(world_size, 1))[1])
