"""The workflow's ``train`` section: its defaults, the checks on it, and which keys the
run's fingerprint leaves out (eagle3flow/train/checkpoint.py)."""
from __future__ import annotations

from eagle3flow.config import schema_defaults
from eagle3flow.train.optim import LR_SCHEDULES, OPTIMIZERS
from eagle3flow.train.trackers import TRACKERS

# Every key of the workflow's `train` section, with its default (schemas/config.schema.yaml).
TRAIN_DEFAULTS = schema_defaults("train")
# Keys that change neither the trained weights nor the loss history (the world size
# changes the float summation order only, so a run may resume under another one).
NOT_FINGERPRINTED = ("log_every", "checkpoint_every", "keep_checkpoints", "eval_max_tokens", "nproc",
                     "nodes", "data_workers", "prefetch_batches", "peak_flops", "device", "grad_reduce_dtype",
                     "report_to")


def resolve_train_config(config: dict | None) -> dict:
    config = dict(config or {})
    unknown = sorted(set(config) - set(TRAIN_DEFAULTS))
    if unknown:
        raise ValueError(f"train config: unknown keys {unknown} (known: {sorted(TRAIN_DEFAULTS)})")
    merged = {**TRAIN_DEFAULTS, **config}
    for key in ("ttt_steps", "epochs", "batch_tokens", "log_every", "checkpoint_every", "keep_checkpoints",
                "nodes", "prefetch_batches"):
        if int(merged[key]) < 1:
            raise ValueError(f"train config: {key} must be >= 1, got {merged[key]}")
    if merged["nproc"] is not None and int(merged["nproc"]) < 1:
        raise ValueError(f"train config: nproc must be >= 1 or null, got {merged['nproc']}")
    if merged["data_workers"] is not None and int(merged["data_workers"]) < 0:
        raise ValueError(f"train config: data_workers must be >= 0 or null, got {merged['data_workers']}")
    if merged["grad_reduce_dtype"] not in ("auto", "float32", "bfloat16"):
        raise ValueError(f"train config: grad_reduce_dtype must be auto|float32|bfloat16, "
                         f"got {merged['grad_reduce_dtype']!r}")
    if merged["optimizer"] not in OPTIMIZERS:
        raise ValueError(f"train config: optimizer must be one of {OPTIMIZERS}, got {merged['optimizer']!r}")
    if merged["lr_schedule"] not in LR_SCHEDULES:
        raise ValueError(f"train config: lr_schedule must be one of {LR_SCHEDULES}, got {merged['lr_schedule']!r}")
    if not isinstance(merged["report_to"], list) or set(merged["report_to"]) - set(TRACKERS):
        raise ValueError(f"train config: report_to must be a list of {list(TRACKERS)}, got {merged['report_to']!r}")
    if merged["device"] not in ("auto", "cpu", "cuda"):
        raise ValueError(f"train config: device must be auto|cpu|cuda, got {merged['device']!r}")
    return merged

