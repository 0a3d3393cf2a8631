"""A training run's identity and checkpoints: the fingerprint that names its run directory,
``step-XXXXXXXX/state.pt`` (written atomically, the last ``keep_checkpoints`` and the best
kept), what a checkpoint holds and how a run resumes from one, and ``done.json``.

A checkpoint holds the trainable parameters, the optimizer and schedule, the data
position (the NEXT batch), every RNG state and the run's counters (:class:`RunState`);
no per-rank state, so a run resumes under any world size.
"""
from __future__ import annotations

import hashlib
import json
import os
import random
import re
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from eagle3flow.atomic import sync_directory, temporary_sibling, write_json
from eagle3flow.config import omit_train_defaults
from eagle3flow.extract.shards import Manifest, sha256_file
from eagle3flow.target.config import load_target_config
from eagle3flow.target.identity import target_digest
from eagle3flow.train.config import NOT_FINGERPRINTED

# Bumped whenever the batch plan or the loss changes, so no run resumes from a
# checkpoint whose data position means something else.
TRAINER_VERSION = 3


def fingerprint(train_manifest: Manifest, vocab_map: str | Path, target_path: str | Path, config: dict,
                chain: dict | None = None) -> str:
    """``chain``: the chained-run settings (init checkpoint identity, schedule tokens, data
    epoch); left out of the key when None so an unchained run keeps its fingerprint."""
    target_path = Path(target_path)
    key = {
        "trainer_version": TRAINER_VERSION,
        "train_shards": [s["sha256"] for s in train_manifest.data["shards"]],
        "aux_layer_ids": train_manifest.aux_layer_ids,
        "vocab_map": sha256_file(vocab_map),
        "target_config": load_target_config(target_path),
        # The teacher's lm_head comes from the target: every weight file's size, mtime and
        # header (eagle3flow/target/identity.py), so a new target never resumes an old run.
        "target_identity": target_digest(target_path),
        "config": {k: v for k, v in omit_train_defaults(config).items() if k not in NOT_FINGERPRINTED},
    }
    if chain:
        key["chain"] = chain
    return hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:16]


STEP_DIR = re.compile(r"^step-(\d{8})$")
DONE_FILE = "done.json"


def checkpoint_identity(path: str | Path) -> dict:
    """``{"run", "step"}`` of ``.../<fingerprint>/step-XXXXXXXX[/state.pt]``: run directories are
    named by fingerprint, so the path names the checkpoint's content (no need to read it)."""
    path = Path(path)
    step_dir = path.parent if path.name == "state.pt" else path
    m = STEP_DIR.match(step_dir.name)
    if not m:
        raise ValueError(f"--init-from {path}: expected a checkpoint .../<run>/step-XXXXXXXX[/state.pt]")
    return {"run": step_dir.parent.name, "step": int(m.group(1))}


def list_checkpoints(run_dir: Path) -> list[tuple[int, Path]]:
    if not run_dir.is_dir():
        return []
    found = []
    for p in run_dir.iterdir():
        m = STEP_DIR.match(p.name)
        if m and (p / "state.pt").is_file():
            found.append((int(m.group(1)), p))
    return sorted(found)


def rng_state() -> dict:
    state = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        # this rank's device only: the _all variants would open a context on every GPU
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])
    cuda = state.get("cuda")
    if isinstance(cuda, torch.Tensor) and torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.set_rng_state(cuda)


def save_checkpoint(run_dir: Path, step: int, state: dict, keep: int, keep_step: int | None = None) -> Path:
    """Write ``step-XXXXXXXX/state.pt`` via a temporary dir renamed when complete; keep the
    last ``keep`` checkpoints and the one of step ``keep_step`` (the best), delete the rest."""
    final = run_dir / f"step-{step:08d}"
    # Named like every temporary of this host's writers (atomic.temporary_sibling): one a
    # killed trainer left is swept when the next one starts (sweep_stale_temporaries).
    tmp = temporary_sibling(final)
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    with open(tmp / "state.pt", "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    sync_directory(run_dir)   # the checkpoint's name is on disk before older ones go
    for old_step, old in list_checkpoints(run_dir)[:-keep]:
        if old_step != keep_step:
            shutil.rmtree(old, ignore_errors=True)
    return final



def chain_settings(init_from: str | Path | None, schedule_tokens: int | None, data_epoch: int) -> dict | None:
    """What makes a chained run (streaming partitions) differ from a plain one; None for a plain one."""
    if init_from is None and schedule_tokens is None and not data_epoch:
        return None
    return {"init_from": checkpoint_identity(init_from) if init_from is not None else None,
            "schedule_tokens": schedule_tokens, "data_epoch": data_epoch}


@dataclass
class RunState:
    """Where a run stands: the counters a checkpoint holds besides weights, optimizer and RNG.

    ``epoch``/``batch_index``: the next batch to train; ``base_step``: the step a chained
    run started at (the previous link's last); ``tokens_done``: tokens trained over the
    whole chain (a chained run's LR follows them); ``best``: the best eval so far.
    """
    step: int = 0
    epoch: int = 0
    batch_index: int = 0
    best: dict | None = None
    base_step: int = 0
    tokens_done: int = 0

    @classmethod
    def resumed(cls, state: dict) -> "RunState":
        """This run's own checkpoint: continue where it stopped."""
        return cls(step=state["step"], epoch=state["data"]["epoch"], batch_index=state["data"]["batch_index"],
                   best=state.get("best"), base_step=state.get("base_step", 0),
                   tokens_done=int(state.get("tokens_done", 0)))

    @classmethod
    def chained(cls, state: dict) -> "RunState":
        """Another run's checkpoint (``--init-from``): its step and tokens, this run's data from the start."""
        return cls(step=state["step"], base_step=state["step"], tokens_done=int(state.get("tokens_done", 0)))


def read_state(path: Path) -> dict:
    """``state.pt`` of a checkpoint, on the CPU."""
    return torch.load(path, map_location="cpu", weights_only=False)


def init_state_path(init_from: str | Path) -> Path:
    """The ``state.pt`` a chained run starts from (``init_from``: the step dir or the file)."""
    path = Path(init_from)
    path = path if path.name == "state.pt" else path / "state.pt"
    if not path.is_file():
        raise FileNotFoundError(f"--init-from {init_from}: no checkpoint there")
    return path


def training_state(model: torch.nn.Module, optimizer, scheduler, run: RunState, next_epoch: int,
                   next_batch: int, next_sample: tuple[int, int] | None, fp: str, world_size: int) -> dict:
    """What ``state.pt`` holds; ``next_sample``: (shard, offset) of the next batch's first sample."""
    return {
        "model": {n: p.detach().cpu() for n, p in model.named_parameters() if p.requires_grad},
        "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(), "step": run.step,
        "data": {"epoch": next_epoch, "batch_index": next_batch,
                 "next_sample": None if next_sample is None else {"shard": next_sample[0],
                                                                   "offset": next_sample[1]}},
        "rng": rng_state(), "fingerprint": fp, "best": run.best, "world_size": world_size,
        "tokens_done": run.tokens_done, "base_step": run.base_step,
    }


def restore_training_state(state: dict, model: torch.nn.Module, optimizer, scheduler) -> None:
    """Weights, optimizer, schedule and RNG from ``state``. The run's :class:`RunState` must be
    in place first: a chained run's schedule reads its ``tokens_done``."""
    model.load_state_dict(state["model"], strict=False)
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    set_rng_state(state["rng"])


def write_done(run_dir: Path, out_dir: Path, fp: str, step: int, tokens_done: int, checkpoint: str) -> None:
    """``done.json``: this run finished, its final checkpoint and outputs on disk (written last;
    :func:`finished_result` reads it)."""
    write_json(run_dir / DONE_FILE, {"fingerprint": fp, "step": step, "tokens_done": tokens_done,
                                     "checkpoint": checkpoint, "out_dir": str(out_dir), "finished_at": time.time()})


def finished_result(run_dir: Path, out_dir: Path, fp: str) -> dict | None:
    """eval.json of this very run when it finished (done.json) and its outputs are in ``out_dir``."""
    try:
        with open(run_dir / DONE_FILE) as f:
            done = json.load(f)
        with open(out_dir / "eval.json") as f:
            result = json.load(f)
    except (OSError, ValueError):
        return None
    finished = (done.get("fingerprint") == fp and result.get("fingerprint") == fp
                and all((out_dir / name).is_file() for name in ("draft.safetensors", "draft_config.json")))
    return result if finished else None
