"""Train the EAGLE-3 draft with training-time test (TTT) on extracted hidden states.

Loss: eagle3flow/train/loss.py. The teacher head is the target lm_head's ``t2d`` rows
``[Vd, H]``, so the full target vocab (e.g. 163840) is never materialised.

Resumable: checkpoints go to ``cache_root/<fingerprint>/step-XXXXXXXX/state.pt``
(trainable params, optimizer, scheduler, data position, RNG states), written
atomically; a killed run continues from the latest one and, on CPU, reproduces the
uninterrupted run's losses bitwise. The fingerprint covers the data manifests'
checksums, the vocab map, the target and the training config. ``done.json`` in the
run directory, written after the final checkpoint and the outputs, marks a finished
run: a rerun returns at once (without reading a shard).

Chained runs (streaming partitions, eagle3flow/ops/streaming.py): ``--init-from`` starts
from another run's checkpoint (weights, optimizer, scheduler, RNG, global step and the
metrics so far), ``--schedule-tokens`` spreads the LR schedule over every link's
tokens instead of this manifest's, and ``--data-epoch`` numbers the epoch (the
shuffle's seed). All three enter the fingerprint, so each link has its own run
directory and resumes there after a kill.

Data order and batches: eagle3flow/train/data.py. ``batch_tokens`` is the GLOBAL
batch: under torchrun (``python -m eagle3flow.train.launch``, eagle3flow/train/distributed.py)
each of the N ranks trains on its share of every batch and the gradients are summed,
so the samples of a step, their order and the loss normalisation are those of one
process; checkpoints hold no per-rank state and resume under any world size. Only
rank 0 writes checkpoints, metrics and outputs.

Precision: bf16 autocast on CUDA (the frozen embeddings and the teacher head stored
in bf16), fp32 on CPU.

Observability: one metrics line per ``log_every`` steps (loss, per-step loss and
accuracy, tokens/s over all ranks, MFU per eagle3flow/model/flops.py, the time the loop
waited for data); the progress line prints the same with an ETA. At every checkpoint
the eval split's simulated acceptance length is computed (capped by
``eval_max_tokens``); the best checkpoint is kept besides the last ``keep_checkpoints``.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import re
import shutil
import sys
import time
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from eagle3flow.atomic import write_json
from eagle3flow.config import schema_defaults
from eagle3flow.train.distributed import DistContext, init_distributed, sum_gradients
from eagle3flow.model.config import DraftConfig
from eagle3flow.model.draft import Eagle3Draft, PackedLayout
from eagle3flow.model.flops import mean_causal_context, measure_matmul_flops, train_flops_per_token
from eagle3flow.train.loss import scored_mask, teacher_targets, ttt_loss
from eagle3flow.train.optim import LR_SCHEDULES, OPTIMIZERS, Schedule, build_optimizers, lr_factor
from eagle3flow.progress import Progress
from eagle3flow.extract.shards import Manifest, load_manifest, sha256_file
from eagle3flow.target.config import load_target_config
from eagle3flow.target.weights import load_target_head, tensor_locations
from eagle3flow.train.trackers import Trackers, flatten
from eagle3flow.train.data import (BatchLoader, ShardData, collate, epoch_order,  # noqa: F401
                                   plan_batches, rank_share)

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
    if merged["init_midlayer"] not in ("random", "target"):
        raise ValueError(f"train config: init_midlayer must be random|target, got {merged['init_midlayer']!r}")
    if not float(merged["teacher_temperature"]) > 0:
        raise ValueError(f"train config: teacher_temperature must be > 0, got {merged['teacher_temperature']}")
    from eagle3flow.train.trackers import TRACKERS

    if not isinstance(merged["report_to"], list) or set(merged["report_to"]) - set(TRACKERS):
        raise ValueError(f"train config: report_to must be a list of {list(TRACKERS)}, got {merged['report_to']!r}")
    if float(merged["hidden_noise"]) < 0:
        raise ValueError(f"train config: hidden_noise must be >= 0, got {merged['hidden_noise']}")
    if merged["device"] not in ("auto", "cpu", "cuda"):
        raise ValueError(f"train config: device must be auto|cpu|cuda, got {merged['device']!r}")
    return merged


# ---------------------------------------------------------------------------- vocab map / model init

def load_vocab_map(path: str | Path) -> tuple[torch.Tensor, torch.Tensor]:
    """``d2t`` int64 ``[Vd]`` and ``t2d`` bool ``[Vt]``, checked against each other."""
    tensors = load_file(str(path))
    for name in ("d2t", "t2d"):
        if name not in tensors:
            raise ValueError(f"{path}: missing tensor {name!r}")
    d2t, t2d = tensors["d2t"].to(torch.int64), tensors["t2d"].to(torch.bool)
    target_ids = torch.arange(d2t.numel()) + d2t
    if int(t2d.sum()) != d2t.numel() or not torch.equal(target_ids, t2d.nonzero().flatten()):
        raise ValueError(f"{path}: d2t and t2d disagree (draft ids must map, in order, onto the "
                         f"{int(t2d.sum())} target ids marked in t2d; d2t has {d2t.numel()})")
    return d2t, t2d


def build_draft(target_path: str | Path, aux_layer_ids: list[int], d2t: torch.Tensor,
                t2d: torch.Tensor, overrides: dict, seed: int,
                init_midlayer: str = "random") -> tuple[Eagle3Draft, torch.Tensor]:
    """A fresh draft initialised from the target, and the teacher head ``[Vd, H]``.

    Embeddings are the target's (frozen), ``norm`` the target's final norm and
    ``lm_head`` the target lm_head's ``t2d`` rows; the rest is random (seeded), or with
    ``init_midlayer="target"`` the midlayer starts as the target's last decoder layer
    (its q/k/v read the hidden half of the midlayer's 2H input; the embedding half
    stays random).
    """
    target_config = load_target_config(target_path)
    cfg = DraftConfig.from_target_config(target_config, aux_layer_ids, d2t.numel(), overrides)
    if t2d.numel() != cfg.vocab_size:
        raise ValueError(f"vocab map t2d has {t2d.numel()} entries but the target {target_path} "
                         f"has vocab_size {cfg.vocab_size}")
    # As stored (bf16 for large targets): a [163840, 7168] matrix is 2.3 GB, 4.7 in fp32.
    head = load_target_head(target_path)
    for part in ("embed_tokens", "lm_head"):
        if head[part].shape[0] < cfg.vocab_size or head[part].shape[1] != cfg.target_hidden_size:
            raise ValueError(f"{target_path}: {part} has shape {list(head[part].shape)}, the config says "
                             f"[{cfg.vocab_size}, {cfg.target_hidden_size}] (vocab_size, hidden_size)")
    torch.manual_seed(seed)
    model = Eagle3Draft(cfg)
    teacher_head = head["lm_head"][:cfg.vocab_size][t2d].float().contiguous()
    with torch.no_grad():
        model.embed_tokens.weight.copy_(head["embed_tokens"][:cfg.vocab_size])
        model.norm.weight.copy_(head["norm"])
        model.lm_head.weight.copy_(teacher_head)
        model.d2t.copy_(d2t)
        model.t2d.copy_(t2d)
        if init_midlayer == "target":
            copy_target_layer(model, target_path, int(target_config.get("num_hidden_layers")) - 1)
    return model, teacher_head


def copy_target_layer(model: Eagle3Draft, target_path: str | Path, layer: int) -> None:
    """The midlayer's weights from the target's decoder layer ``layer`` (same shapes but the
    2H-wide q/k/v inputs, whose hidden half gets the target's q/k/v)."""
    from eagle3flow.target.weights import load_target_layer

    weights = load_target_layer(target_path, layer)
    mid, hidden = model.midlayer, model.config.hidden_size
    pairs = {"self_attn.o_proj.weight": mid.self_attn.o_proj.weight,
             "mlp.gate_proj.weight": mid.mlp.gate_proj.weight, "mlp.up_proj.weight": mid.mlp.up_proj.weight,
             "mlp.down_proj.weight": mid.mlp.down_proj.weight,
             "post_attention_layernorm.weight": mid.post_attention_layernorm.weight,
             "input_layernorm.weight": mid.hidden_norm.weight}
    for name, param in pairs.items():
        if name not in weights or weights[name].shape != param.shape:
            raise ValueError(f"{target_path}: layer {layer} has no {name} of shape {list(param.shape)}; "
                             f"train.init_midlayer: target needs a Llama-style target of the draft's shape")
        param.copy_(weights[name])
    for proj in ("q_proj", "k_proj", "v_proj"):
        param, source = getattr(mid.self_attn, proj).weight, weights.get(f"self_attn.{proj}.weight")
        if source is None or source.shape != param[:, hidden:].shape:
            raise ValueError(f"{target_path}: layer {layer} self_attn.{proj} does not match the draft's")
        param[:, hidden:].copy_(source)
    mid.input_layernorm.weight.copy_(weights["input_layernorm.weight"])


# ---------------------------------------------------------------------------- loss / metrics

@torch.no_grad()
def evaluate_split(model: Eagle3Draft, manifest, num_steps: int, max_tokens: int | None = None,
                   teacher_head: torch.Tensor | None = None, batch_tokens: int = 8192) -> dict:
    """Teacher-forced per-step accuracy and simulated acceptance length on a manifest.

    ``step_accuracy[j]``: draft argmax == teacher argmax at index ``t+j+2`` over rows
    where that index exists and is masked in. ``simulated_acceptance_length[K]``:
    ``1 + E[leading correct steps among the first K]`` over rows whose indices
    ``t+2..t+K+1`` all exist and are masked in (greedy verification; exact for data
    generated by the target's own greedy decoding, where x is the teacher argmax).
    ``teacher_head [Vd, H]`` defaults to the t2d rows of the lm_head of the manifest's target.
    """
    manifest = load_manifest(manifest) if not isinstance(manifest, Manifest) else manifest
    device = model.fc.weight.device
    if teacher_head is None:
        head = load_target_head(manifest.data["target_path"], parts=("lm_head",), dtype=torch.float32)
        teacher_head = head["lm_head"][:model.config.vocab_size][model.t2d.cpu()]
    teacher_head = teacher_head.to(device, model.fc.weight.dtype)
    was_training = model.training
    model.eval()
    data = ShardData(manifest)
    order = epoch_order(data, 0, 0, shuffle=False)
    correct = torch.zeros(num_steps, dtype=torch.float64)
    counted = torch.zeros(num_steps, dtype=torch.float64)
    accepted = torch.zeros(num_steps, dtype=torch.float64)
    chains = torch.zeros(num_steps, dtype=torch.float64)
    tokens = 0
    for batch_ids in plan_batches(data, order, batch_tokens):
        if max_tokens is not None and tokens >= max_tokens:
            break
        batch = collate(data, batch_ids, device)
        n = batch["input_ids"].numel()
        tokens += n
        layout = PackedLayout.from_cu_seqlens(batch["cu_seqlens"], device)
        _, argmax = teacher_targets(batch["last"], teacher_head)
        logits, _ = model.forward_ttt(batch["aux"], batch["input_ids"], batch["cu_seqlens"], num_steps, layout)
        rows = torch.arange(n, device=device)
        hit = torch.zeros(n, num_steps, dtype=torch.bool, device=device)
        ok = scored_mask(layout, batch["loss_mask"], num_steps).T          # [n, K]
        for j in range(num_steps):
            target = (rows + j + 1).clamp(max=n - 1)
            hit[:, j] = logits[j].argmax(-1) == argmax[target]
            correct[j] += float((hit[:, j] & ok[:, j]).sum())
            counted[j] += float(ok[:, j].sum())
        leading = torch.cumprod(hit.long(), dim=1)          # [n, K] 1 while all so far correct
        all_ok = torch.cumprod(ok.long(), dim=1).bool()     # rows usable for chains of length K
        for k in range(num_steps):
            use = all_ok[:, k]
            accepted[k] += float(leading[use, :k + 1].sum())
            chains[k] += float(use.sum())
    model.train(was_training)
    return {
        "step_accuracy": [float(c / m) if m else None for c, m in zip(correct, counted)],
        "step_rows": [int(m) for m in counted],
        "simulated_acceptance_length": {
            str(k + 1): (1.0 + float(accepted[k] / chains[k])) if chains[k] else None
            for k in range(num_steps)},
        "num_tokens": tokens,
    }


# ---------------------------------------------------------------------------- checkpoints

# Bumped whenever the batch plan or the loss changes, so no run resumes from a
# checkpoint whose data position means something else.
TRAINER_VERSION = 3


def fingerprint(train_manifest: Manifest, vocab_map: str | Path, target_path: str | Path, config: dict,
                chain: dict | None = None) -> str:
    """``chain``: the chained-run settings (init checkpoint identity, schedule tokens, data
    epoch); left out of the key when None so an unchained run keeps its fingerprint."""
    target_path = Path(target_path)
    files = sorted({p.name for p in tensor_locations(target_path).values()})
    key = {
        "trainer_version": TRAINER_VERSION,
        "train_shards": [s["sha256"] for s in train_manifest.data["shards"]],
        "aux_layer_ids": train_manifest.aux_layer_ids,
        "vocab_map": sha256_file(vocab_map),
        "target_config": load_target_config(target_path),
        "target_files": [(f, (target_path / f).stat().st_size) for f in files],
        "config": {k: v for k, v in config.items() if k not in NOT_FINGERPRINTED},
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
    tmp = run_dir / f".step-{step:08d}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    with open(tmp / "state.pt", "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    for old_step, old in list_checkpoints(run_dir)[:-keep]:
        if old_step != keep_step:
            shutil.rmtree(old, ignore_errors=True)
    return final


def read_metrics(path: Path, up_to_step: int) -> list[str]:
    """Metrics lines with ``step <= up_to_step`` (a resumed run drops what it will redo)."""
    if not path.is_file():
        return []
    lines = []
    with open(path) as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue            # a line cut short by a kill
            if row.get("step", 0) <= up_to_step:
                lines.append(line)
    return lines


# ---------------------------------------------------------------------------- training

def train(train_manifest: str | Path, eval_manifest: str | Path | None, vocab_map: str | Path,
          target_path: str | Path, out_dir: str | Path, cache_root: str | Path,
          config: dict | None = None, init_from: str | Path | None = None,
          schedule_tokens: int | None = None, data_epoch: int = 0) -> dict:
    """Train (or resume) and write the declared outputs into ``out_dir``; returns eval.json's dict.

    Under torchrun every rank calls this; rank 0 writes and returns the result, the
    others return ``{}``. ``init_from``: a checkpoint (``.../step-XXXXXXXX[/state.pt]``)
    to start from when this run has none of its own; ``schedule_tokens``: the tokens the
    LR schedule spans (default: this manifest's x epochs, counted in steps); ``data_epoch``:
    the number of this run's first epoch (seeds the shuffle).
    """
    cfg = resolve_train_config(config)
    if schedule_tokens is not None and int(schedule_tokens) < 1:
        raise ValueError(f"schedule_tokens must be >= 1, got {schedule_tokens}")
    if int(data_epoch) < 0:
        raise ValueError(f"data_epoch must be >= 0, got {data_epoch}")
    ctx = init_distributed(cfg["device"])
    try:
        return _train(ctx, cfg, train_manifest, eval_manifest, vocab_map, target_path,
                      Path(out_dir), Path(cache_root), init_from, schedule_tokens, int(data_epoch))
    finally:
        ctx.close()


class PeakFlops:
    """The FLOP/s one device's MFU is relative to: ``train.peak_flops`` when configured,
    else a matmul measured at start. A measurement taken while the machine was busy comes
    out low, so an MFU above 100% is never reported: the peak is measured again, and if
    the achieved rate still exceeds it, the MFU is reported as unknown (None)."""

    def __init__(self, device: torch.device, configured: float | None):
        self.device, self.configured = device, configured
        self.value = float(configured) if configured else measure_matmul_flops(device)
        self.basis = "configured" if configured else "measured matmul"
        self.remeasured = False

    def mfu(self, achieved_per_device: float) -> dict:
        """``{"mfu", "mfu_peak_flops", "mfu_basis"}`` for a training rate (FLOP/s per device)."""
        if achieved_per_device > self.value and not self.configured and not self.remeasured:
            self.value = max(self.value, measure_matmul_flops(self.device, repeats=20))
            self.remeasured = True
        mfu = achieved_per_device / self.value if achieved_per_device <= self.value else None
        return {"mfu": mfu, "mfu_peak_flops": self.value, "mfu_basis": self.basis}


def with_noise(aux: torch.Tensor, relative_std: float, num_aux: int) -> torch.Tensor:
    """``aux [N, A*H]`` plus Gaussian noise of ``relative_std`` times each aux layer's RMS
    per token (the draft must not rely on the target's states being exact)."""
    layers = aux.view(aux.shape[0], num_aux, -1)
    rms = layers.float().pow(2).mean(-1, keepdim=True).sqrt()
    noise = torch.randn(layers.shape, device=aux.device, dtype=torch.float32) * rms * relative_std
    return (layers.float() + noise).to(aux.dtype).view_as(aux)


def _autocast(device: torch.device):
    return torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.type == "cuda")


def _train(ctx: DistContext, cfg: dict, train_manifest, eval_manifest, vocab_map, target_path,
           out_dir: Path, cache_root: Path, init_from=None, schedule_tokens: int | None = None,
           data_epoch: int = 0) -> dict:
    manifest = load_manifest(train_manifest)
    log = (lambda msg: print(msg, file=sys.stderr, flush=True)) if ctx.is_main else (lambda msg: None)
    chain = None
    if init_from is not None or schedule_tokens is not None or data_epoch:
        chain = {"init_from": checkpoint_identity(init_from) if init_from is not None else None,
                 "schedule_tokens": schedule_tokens, "data_epoch": data_epoch}
    fp = fingerprint(manifest, vocab_map, target_path, cfg, chain)
    run_dir = cache_root / fp
    finished = _finished_result(run_dir, out_dir, fp)
    if finished is not None:
        # A rerun of a finished run (e.g. killed after it, while its shards were deleted).
        log(f"train: already finished in {run_dir} (step {finished['steps']}); nothing to do")
        return finished if ctx.is_main else {}
    d2t, t2d = load_vocab_map(vocab_map)
    device = ctx.device
    autocast = device.type == "cuda"
    # The gradients come out of bf16 autocast on CUDA: a bf16 all-reduce halves the bytes.
    reduce_dtype = {"auto": torch.bfloat16 if autocast else None, "float32": None,
                    "bfloat16": torch.bfloat16}[cfg["grad_reduce_dtype"]]
    model, teacher_head = build_draft(target_path, manifest.aux_layer_ids, d2t, t2d, cfg["draft"], cfg["seed"],
                                      cfg["init_midlayer"])
    if cfg["freeze_lm_head"]:
        model.lm_head.weight.requires_grad_(False)
    if manifest.hidden_size != model.config.target_hidden_size:
        raise ValueError(f"{manifest.path}: hidden_size {manifest.hidden_size} != target hidden size "
                         f"{model.config.target_hidden_size}")
    if autocast:
        # Frozen and only looked up: bf16 is what autocast computes with anyway, at half the memory.
        model.embed_tokens.to(torch.bfloat16)
    model.to(device).train()
    # Sharpening the teacher is scaling its logits: fold 1/T into its head once.
    teacher_head = (teacher_head / float(cfg["teacher_temperature"])).to(
        device, torch.bfloat16 if autocast else torch.float32)
    named_params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    params = [p for _, p in named_params]
    ctx.broadcast_(params)
    optimizer = build_optimizers(named_params, cfg, device)

    data = ShardData(manifest)
    epoch_plans = {}

    def plan(epoch: int):
        if epoch not in epoch_plans:
            epoch_plans.clear()
            seed_epoch = data_epoch + epoch
            epoch_plans[epoch] = plan_batches(data, epoch_order(data, cfg["seed"], seed_epoch),
                                              cfg["batch_tokens"], seed=f"{cfg['seed']}-epoch-{seed_epoch}")
        return epoch_plans[epoch]

    steps_per_epoch = [len(plan(e)) for e in range(cfg["epochs"])]
    # Tokens trained so far over the whole chain: the LR of a chained run follows them.
    tokens_done = [0]
    if schedule_tokens is None:
        schedule_steps = sum(steps_per_epoch)
        warmup = max(1, int(round(cfg["warmup_ratio"] * schedule_steps)))
        scheduler = Schedule(optimizer, lr_factor(cfg["lr_schedule"], schedule_steps, warmup, cfg["min_lr_ratio"]))
    else:
        # The chain's step count is not known before every partition is extracted; its
        # tokens are. The schedule runs on "virtual steps" of batch_tokens tokens each.
        virtual_steps = schedule_tokens / cfg["batch_tokens"]
        warmup = max(1, int(round(cfg["warmup_ratio"] * virtual_steps)))
        by_tokens = lr_factor(cfg["lr_schedule"], virtual_steps, warmup, cfg["min_lr_ratio"])
        scheduler = Schedule(optimizer, lambda _step: by_tokens(tokens_done[0] / cfg["batch_tokens"]))

    if ctx.is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
        write_json(run_dir / "config.json", {"train_config": cfg, "draft_config": model.config.to_dict(),
                                                    "train_manifest": str(train_manifest), "chain": chain})
    step, epoch, batch_index, best, base_step = 0, 0, 0, None, 0
    history_from = None            # another run's metrics.jsonl this run's history starts with
    checkpoints = list_checkpoints(run_dir)
    state = None
    if checkpoints:
        state = torch.load(checkpoints[-1][1] / "state.pt", map_location="cpu", weights_only=False)
        step, epoch, batch_index = state["step"], state["data"]["epoch"], state["data"]["batch_index"]
        best, base_step = state.get("best"), state.get("base_step", 0)
        log(f"train: resuming from {checkpoints[-1][1]} (step {step}/{base_step + sum(steps_per_epoch)}, "
            f"saved by {state.get('world_size', 1)} process(es), now {ctx.world_size})")
    elif init_from is not None:
        init_path = Path(init_from)
        init_path = init_path if init_path.name == "state.pt" else init_path / "state.pt"
        if not init_path.is_file():
            raise FileNotFoundError(f"--init-from {init_from}: no checkpoint there")
        state = torch.load(init_path, map_location="cpu", weights_only=False)
        step = base_step = state["step"]
        history_from = init_path.parent.parent / "metrics.jsonl"
        log(f"train: starting from {init_path.parent} (step {step}, "
            f"{state.get('tokens_done', 0):,} tokens of the chain trained)")
    if state is not None:
        model.load_state_dict(state["model"], strict=False)
        optimizer.load_state_dict(state["optimizer"])
        tokens_done[0] = int(state.get("tokens_done", 0))   # before the schedule: a chain's lr reads it
        scheduler.load_state_dict(state["scheduler"])
        set_rng_state(state["rng"])
        del state
    total_steps = base_step + sum(steps_per_epoch)

    metrics_paths = (run_dir / "metrics.jsonl", out_dir / "metrics.jsonl")
    if ctx.is_main:
        history = read_metrics(history_from or metrics_paths[0], step)
        for path in metrics_paths:
            path.parent.mkdir(parents=True, exist_ok=True)
            with open(path, "w") as f:
                f.write("".join(line + "\n" for line in history))

    num_steps, decay = cfg["ttt_steps"], cfg["step_loss_decay"]
    eval_split = None if eval_manifest is None else load_manifest(eval_manifest)

    def evaluate() -> dict:
        with _autocast(device):
            return evaluate_split(model, eval_split, num_steps, cfg["eval_max_tokens"],
                                  teacher_head=teacher_head.float(), batch_tokens=cfg["batch_tokens"])

    def checkpoint(next_epoch: int, next_batch: int):
        nonlocal best
        if eval_split is not None:
            evaluated = evaluate()
            acceptance = evaluated["simulated_acceptance_length"][str(num_steps)]
            if acceptance is not None and (best is None or acceptance > best["acceptance_length"]):
                best = {"step": step, "acceptance_length": acceptance, "num_speculative_tokens": num_steps}
            log(f"train: step {step} eval simulated acceptance length (K={num_steps}) {acceptance}; "
                f"best {best}")
            trackers.log(step, flatten("eval", {"simulated_acceptance_length": evaluated["simulated_acceptance_length"],
                                                "step_accuracy": evaluated["step_accuracy"]}))
        batches = plan(next_epoch) if next_epoch < cfg["epochs"] else []
        position = batches[next_batch][0] if next_batch < len(batches) else None
        state = {
            "model": {n: p.detach().cpu() for n, p in model.named_parameters() if p.requires_grad},
            "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(), "step": step,
            "data": {"epoch": next_epoch, "batch_index": next_batch,
                     "next_sample": None if position is None else {"shard": position[0], "offset": position[1]}},
            "rng": rng_state(), "fingerprint": fp, "best": best, "world_size": ctx.world_size,
            "tokens_done": tokens_done[0], "base_step": base_step,
        }
        save_checkpoint(run_dir, step, state, cfg["keep_checkpoints"], best["step"] if best else None)
        if best is not None:
            write_json(run_dir / "best.json", {**best, "checkpoint": str(run_dir / f"step-{best['step']:08d}")})

    # The remaining global batches, in order, and this rank's share of each.
    positions = [(e, b) for e in range(epoch, cfg["epochs"])
                 for b in range(batch_index if e == epoch else 0, steps_per_epoch[e])]
    shares, global_tokens = [], []
    for e, b in positions:
        batch = plan(e)[b]
        shares.append(rank_share(batch, data.lengths, ctx.rank, ctx.world_size))
        global_tokens.append(sum(data.lengths[s][i] for s, i in batch))
    workers = cfg["data_workers"] if cfg["data_workers"] is not None else (4 if device.type == "cuda" else 0)
    loader = BatchLoader(data, shares, num_steps, device, workers, cfg["prefetch_batches"])

    all_lengths = [n for shard in data.lengths for n in shard]
    flops_per_token = train_flops_per_token(model.config, num_steps, mean_causal_context(all_lengths))["total"]
    peak = PeakFlops(device, cfg["peak_flops"])
    peak_flops = peak.value
    log(f"train: {ctx.world_size} process(es) on {device.type}, {total_steps} steps of <= "
        f"{cfg['batch_tokens']} tokens, {flops_per_token / 1e9:.3f} GFLOP/token, "
        f"peak {peak_flops / 1e12:.2f} TFLOP/s per device ({'configured' if cfg['peak_flops'] else 'measured'})")

    trackers = Trackers(cfg["report_to"] if ctx.is_main else [], out_dir, fp, cfg)
    progress = Progress("train", data.num_tokens * cfg["epochs"], unit="tokens",
                        done=data.num_tokens * cfg["epochs"] - sum(global_tokens),
                        stream=sys.stderr if ctx.is_main else open(os.devnull, "w"))
    delay = float(os.environ.get("EAGLE3FLOW_TEST_STEP_DELAY", "0") or 0)
    window = {"tokens": 0, "wait": 0.0, "steps": 0, "t0": time.perf_counter()}
    last = ""
    for k, (epoch, batch_index) in enumerate(positions):
        batch = loader.next()
        window["wait"] += loader.wait_s
        # Divide each step's loss by the scored rows of the whole global batch.
        counts = ctx.all_reduce_sum(batch["step_rows"].clone()).tolist()
        denominators = [max(1, int(c)) for c in counts]
        loss, stats = None, [(0.0, 0.0, 0)] * num_steps
        if batch["input_ids"].numel():
            if cfg["hidden_noise"]:
                batch["aux"] = with_noise(batch["aux"], float(cfg["hidden_noise"]), model.config.num_aux)
            loss, stats = ttt_loss(model, batch, teacher_head, num_steps, decay, autocast,
                                   denominators=denominators)
        optimizer.zero_grad(set_to_none=True)
        if loss is not None and loss.requires_grad:
            loss.backward()
        sum_gradients(params, ctx, reduce_dtype)
        grad_norm = torch.nn.utils.clip_grad_norm_(params, cfg["max_grad_norm"])
        lr = scheduler.get_last_lr()[0]
        optimizer.step()
        tokens_done[0] += global_tokens[k]
        scheduler.step()
        step += 1
        window["tokens"] += global_tokens[k]
        window["steps"] += 1
        at_end = batch_index + 1 == steps_per_epoch[epoch]
        if step % cfg["log_every"] == 0 or step == total_steps:
            local = torch.tensor([0.0 if loss is None else float(loss.detach()), window["wait"]]
                                 + [s[0] for s in stats] + [round(s[1] * s[2]) for s in stats],
                                 dtype=torch.float64)
            summed = ctx.all_reduce_sum(local).tolist()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            now = time.perf_counter()
            tokens_per_s = window["tokens"] / max(now - window["t0"], 1e-9)
            row = {"step": step, "epoch": data_epoch + epoch, "loss": summed[0],
                   "step_loss": summed[2:2 + num_steps],
                   "step_acc": [h / c if c else 0.0 for h, c in zip(summed[2 + num_steps:], counts)],
                   "step_rows": [int(c) for c in counts], "grad_norm": float(grad_norm), "lr": lr,
                   "tokens": global_tokens[k], "tokens_per_s": tokens_per_s,
                   **peak.mfu(tokens_per_s * flops_per_token / ctx.world_size),
                   "data_wait_s": summed[1] / ctx.world_size / window["steps"],
                   "world_size": ctx.world_size}
            window = {"tokens": 0, "wait": 0.0, "steps": 0, "t0": now}
            mfu_text = "n/a" if row["mfu"] is None else f"{row['mfu']:.1%} of {row['mfu_peak_flops'] / 1e12:.2f} TFLOP/s"
            last = (f"loss {row['loss']:.4f} acc0 {row['step_acc'][0]:.3f} mfu {mfu_text} "
                    f"data-wait {row['data_wait_s'] * 1e3:.1f} ms/step")
            if ctx.is_main:
                line = json.dumps(row)
                for path in metrics_paths:
                    with open(path, "a") as f:
                        f.write(line + "\n")
                trackers.log(step, flatten("train", {k: v for k, v in row.items() if k not in ("step", "epoch")}))
        progress.update(global_tokens[k], extra=f"step {step}/{total_steps} {last}")
        if step % cfg["checkpoint_every"] == 0 or step == total_steps:
            if ctx.is_main:
                checkpoint(epoch + 1 if at_end else epoch, 0 if at_end else batch_index + 1)
        if delay:
            time.sleep(delay)
    progress.close()
    trackers.close()

    if not ctx.is_main:
        return {}
    model.eval()
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file({k: v.detach().cpu().float().contiguous() if v.is_floating_point() else v.detach().cpu().contiguous()
               for k, v in model.trainable_state_dict().items()},
              str(out_dir / "draft.safetensors"), metadata={"fingerprint": fp})
    write_json(out_dir / "draft_config.json", model.config.to_dict())
    result = {"train_config": cfg, "fingerprint": fp, "steps": step, "world_size": ctx.world_size,
              "flops_per_token": flops_per_token, "best_checkpoint": best,
              "tokens_done": tokens_done[0], "chain": chain,
              "final_checkpoint": str(run_dir / f"step-{step:08d}")}
    if eval_split is not None:
        result.update(evaluate())
        log(f"train: eval step accuracy {result['step_accuracy']}, simulated acceptance length "
            f"{result['simulated_acceptance_length']}")
    write_json(out_dir / "eval.json", result)
    # Last: the final checkpoint and the outputs are on disk.
    write_json(run_dir / DONE_FILE, {"fingerprint": fp, "step": step, "tokens_done": tokens_done[0],
                                            "checkpoint": result["final_checkpoint"],
                                            "out_dir": str(out_dir), "finished_at": time.time()})
    return result


def _finished_result(run_dir: Path, out_dir: Path, fp: str) -> dict | None:
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


def load_trained(train_dir: str | Path, target_path: str | Path, device="cpu") -> Eagle3Draft:
    """The draft from ``results/train`` (draft.safetensors + draft_config.json), embeddings from the target."""
    train_dir = Path(train_dir)
    with open(train_dir / "draft_config.json") as f:
        cfg = DraftConfig.from_dict(json.load(f))
    model = Eagle3Draft(cfg)
    state = load_file(str(train_dir / "draft.safetensors"))
    state["embed_tokens.weight"] = load_target_head(target_path, parts=("embed_tokens",),
                                                    dtype=torch.float32)["embed_tokens"][:cfg.vocab_size]
    missing, unexpected = model.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise ValueError(f"{train_dir}/draft.safetensors: missing {missing}, unexpected {unexpected}")
    return model.to(device).eval()


def main(argv=None) -> None:
    """CLI. ``--config-json`` is the workflow's ``train`` config section (keys: TRAIN_DEFAULTS)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--train-manifest", required=True)
    parser.add_argument("--eval-manifest", default=None)
    parser.add_argument("--vocab-map", required=True)
    parser.add_argument("--target", required=True, help="target model dir (embeddings, norm, lm_head)")
    parser.add_argument("--out-dir", required=True)
    parser.add_argument("--cache-root", required=True)
    parser.add_argument("--config-json", default="{}", help=f"JSON with keys of {sorted(TRAIN_DEFAULTS)}")
    parser.add_argument("--init-from", default=None,
                        help="chained run: start from this checkpoint (.../step-XXXXXXXX) when "
                             "this run has none of its own")
    parser.add_argument("--schedule-tokens", type=int, default=None,
                        help="chained run: tokens the LR schedule spans (every link's)")
    parser.add_argument("--data-epoch", type=int, default=0,
                        help="chained run: the number of this run's first epoch (seeds the shuffle)")
    args = parser.parse_args(argv)
    try:
        config = json.loads(args.config_json)
    except json.JSONDecodeError as e:
        parser.error(f"--config-json is not valid JSON: {e}")
    train(args.train_manifest, args.eval_manifest, args.vocab_map, args.target, args.out_dir,
          args.cache_root, config, init_from=args.init_from, schedule_tokens=args.schedule_tokens,
          data_epoch=args.data_epoch)


if __name__ == "__main__":
    main()
