"""Data parallelism for training: one process per GPU (or N CPU processes), started by torchrun.

Every rank holds the whole draft and optimizer (a one-layer draft plus AdamW state
fits one GPU even at Kimi-K2.5 size), trains on its share of each global batch, and
the gradients are summed over ranks before the optimizer step, so every rank takes
the same step. The sum is done explicitly, bucket by bucket in a fixed parameter
order, rather than by ``DistributedDataParallel``: a rank may have an empty share or
a TTT step without scored rows, which DDP's autograd hooks cannot handle without
``find_unused_parameters`` (and a fixed order keeps runs bitwise reproducible).

Backends: NCCL on CUDA, gloo on CPU. Without torchrun's environment (``WORLD_SIZE``
unset or 1) everything here is a no-op on one process.
"""
from __future__ import annotations

import os
import signal
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from eagle3flow.device import resolve_device
from eagle3flow.procfs import signal_on_parent_death

# Rank 0 evaluates the eval split at checkpoints while the others wait at the next
# collective: the default 10-minute NCCL timeout would be too short for a large split.
COLLECTIVE_TIMEOUT = timedelta(hours=2)
BUCKET_BYTES = 256 << 20


@dataclass
class DistContext:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum over ranks, returned on the tensor's own device (NCCL needs CUDA tensors)."""
        if not self.enabled:
            return tensor
        work = tensor.to(self.device) if self.device.type == "cuda" else tensor
        dist.all_reduce(work, op=dist.ReduceOp.SUM)
        return work.to(tensor.device)

    def broadcast_(self, tensors: list[torch.Tensor]) -> None:
        for t in tensors if self.enabled else ():
            dist.broadcast(t.data, src=0)

    def close(self) -> None:
        if self.enabled and dist.is_initialized():
            dist.destroy_process_group()


def init_distributed(device_name: str) -> DistContext:
    """The rank's context; joins torchrun's process group when there is one.

    ``device_name`` auto|cpu|cuda: on CUDA rank ``r`` of a node uses ``cuda:LOCAL_RANK``.
    """
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank, local_rank = int(os.environ.get("RANK", "0")), int(os.environ.get("LOCAL_RANK", "0"))
    device = resolve_device(device_name, local_rank)
    use_cuda = device.type == "cuda"
    if world_size > 1 and "TORCHELASTIC_RUN_ID" in os.environ:
        die_with_parent()
    if world_size > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if use_cuda else "gloo", timeout=COLLECTIVE_TIMEOUT,
                                **({"device_id": device} if use_cuda else {}))
    return DistContext(rank, world_size, local_rank, device)


def die_with_parent() -> None:
    """Have the kernel SIGKILL this rank when torchrun dies.

    torchrun starts its workers in sessions of their own, so a SIGKILL of torchrun (a
    kill of the rule's process group, the OOM killer) would leave them training, and
    writing checkpoints, next to the rerun that resumes. Linux only; elsewhere a no-op.
    """
    if not signal_on_parent_death(signal.SIGKILL):
        return
    if os.getppid() == 1:        # the parent died before prctl took effect
        os._exit(1)


def sum_gradients(params: list[torch.nn.Parameter], ctx: DistContext,
                  dtype: torch.dtype | None = None) -> None:
    """``p.grad`` <- the sum of ``p.grad`` over ranks (missing grads count as zeros).

    Buckets of ~256 MB, flattened in parameter order, one all-reduce each. ``dtype``
    (e.g. bfloat16) is what the sums travel and add up in, half the bytes of float32 on
    a link-bound all-reduce; None keeps the gradients' own dtype.
    """
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    if not ctx.enabled:
        return
    bucket, size = [], 0
    for p in params:
        bucket.append(p.grad)
        size += p.grad.numel() * p.grad.element_size()
        if size >= BUCKET_BYTES:
            _all_reduce_bucket(bucket, dtype)
            bucket, size = [], 0
    if bucket:
        _all_reduce_bucket(bucket, dtype)


def _all_reduce_bucket(grads: list[torch.Tensor], dtype: torch.dtype | None) -> None:
    flat = torch.cat([g.reshape(-1).to(dtype or g.dtype) for g in grads])
    dist.all_reduce(flat, op=dist.ReduceOp.SUM)
    offset = 0
    for g in grads:
        g.copy_(flat[offset:offset + g.numel()].view_as(g))
        offset += g.numel()
