"""The workflow's ``train`` section: its defaults, and which keys the run's fingerprint
leaves out (eagle3flow/train/checkpoint.py; also eagle3flow.config.TRAIN_ONLY_WHEN_SET,
left out while at their defaults). The trainer checks it with
eagle3flow.config.section_settings."""
from __future__ import annotations

from eagle3flow.config import schema_defaults

# Every key of the workflow's `train` section, with its default (schemas/config.schema.yaml).
TRAIN_DEFAULTS = schema_defaults("train")
# Keys that change neither the trained weights nor the loss history (the world size
# changes the float summation order only, so a run may resume under another one).
NOT_FINGERPRINTED = ("log_every", "checkpoint_every", "keep_checkpoints", "eval_max_tokens", "nproc",
                     "nodes", "data_workers", "prefetch_batches", "peak_flops", "device", "grad_reduce_dtype",
                     "report_to", "checkpoint_metric", "checkpoint_temperature")
