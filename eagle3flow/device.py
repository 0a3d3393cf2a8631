"""The one place a device setting (``auto | cpu | cuda[:N]``) becomes a ``torch.device``.

Used by extraction, training (one device per torchrun rank, picked by ``LOCAL_RANK``)
and evaluation, so ``auto`` means the same everywhere: CUDA when torch sees a device,
else the CPU.
"""
from __future__ import annotations

import os

import torch

from eagle3flow.procfs import usable_cores


def resolve_device(name: str = "auto", local_rank: int | None = None) -> torch.device:
    """``auto`` -> ``cuda`` if available else ``cpu``; any other name as torch spells it.

    ``local_rank`` (a torchrun rank's index on its node, e.g. ``LOCAL_RANK``): a CUDA
    device without an index becomes ``cuda:local_rank``, checked to exist, and is made
    the current device (so NCCL and the CUDA RNG use that GPU).
    """
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(name)
    if local_rank is None or device.type != "cuda":
        return device
    if not torch.cuda.is_available():
        raise RuntimeError(f"device {name} but torch sees no CUDA device")
    if device.index is None:
        if local_rank >= torch.cuda.device_count():
            raise RuntimeError(f"local rank {local_rank} but only {torch.cuda.device_count()} CUDA "
                               f"devices visible (CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')})")
        device = torch.device("cuda", local_rank)
    torch.cuda.set_device(device)
    return device


def limit_cpu_threads() -> int:
    """torch's CPU threads for a stage: the job's (OMP_NUM_THREADS, which Snakemake sets
    from the rule's ``threads``), never more than the cores this process may run on (two
    threads sharing one core wait on each other's descheduled turns). Returns the count."""
    threads = min(torch.get_num_threads(), usable_cores())
    torch.set_num_threads(threads)
    return threads

