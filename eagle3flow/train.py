"""Train the EAGLE-3 draft with training-time test (TTT) on extracted hidden states.

Loss: eagle3flow/loss.py. The teacher head is the target lm_head's ``t2d`` rows
``[Vd, H]``, so the full target vocab (e.g. 163840) is never materialised.

Resumable: checkpoints go to ``cache_root/<fingerprint>/step-XXXXXXXX/state.pt``
(trainable params, optimizer, scheduler, data position, RNG states), written
atomically; a killed run continues from the latest one and, on CPU, reproduces the
uninterrupted run's losses bitwise. The fingerprint covers the data manifests'
checksums, the vocab map, the target and the training config.

Data order: each epoch shuffles the shard order and the samples inside each shard
with seeds derived from ``(seed, epoch)``; samples are packed into batches of at
most ``batch_tokens`` tokens (a longer sample is a batch alone). The whole epoch's
batch plan is computed from the shards' ``cu_seqlens`` alone, so the data position
is just ``(epoch, batch index)``.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import random
import re
import shutil
import sys
import time
from collections import OrderedDict
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from eagle3flow.draft_model import DraftConfig, Eagle3Draft, PackedLayout
from eagle3flow.loss import teacher_targets, ttt_loss
from eagle3flow.progress import Progress
from eagle3flow.shards import Manifest, atomic_write_json, load_manifest, read_shard, sha256_file
from eagle3flow.target_weights import load_target_config, load_target_head, tensor_locations

TRAIN_DEFAULTS = {
    "ttt_steps": 7,            # chain steps trained (and evaluated)
    "epochs": 1,
    "batch_tokens": 8192,      # packed tokens per optimizer step
    "lr": 1e-4,
    "min_lr_ratio": 0.1,       # cosine decays to lr * min_lr_ratio
    "warmup_ratio": 0.03,      # fraction of total steps of linear warmup
    "weight_decay": 0.0,
    "adam_betas": [0.9, 0.95],
    "max_grad_norm": 0.5,
    "step_loss_decay": 0.8,    # weight of step j is decay**j
    "seed": 0,
    "log_every": 10,           # optimizer steps between metrics lines
    "checkpoint_every": 200,   # optimizer steps between checkpoints (and one at the end)
    "keep_checkpoints": 2,
    "device": "auto",          # auto | cpu | cuda
    "draft": {},               # DraftConfig overrides, e.g. {"intermediate_size": 1024}
    "eval_max_tokens": None,   # cap on eval tokens (None: the whole eval split)
}
# Keys that change neither the trained weights nor the loss history.
NOT_FINGERPRINTED = ("log_every", "checkpoint_every", "keep_checkpoints", "eval_max_tokens")


def resolve_train_config(config: dict | None) -> dict:
    config = dict(config or {})
    unknown = sorted(set(config) - set(TRAIN_DEFAULTS))
    if unknown:
        raise ValueError(f"train config: unknown keys {unknown} (known: {sorted(TRAIN_DEFAULTS)})")
    merged = {**TRAIN_DEFAULTS, **config}
    for key in ("ttt_steps", "epochs", "batch_tokens", "log_every", "checkpoint_every", "keep_checkpoints"):
        if int(merged[key]) < 1:
            raise ValueError(f"train config: {key} must be >= 1, got {merged[key]}")
    if merged["device"] not in ("auto", "cpu", "cuda"):
        raise ValueError(f"train config: device must be auto|cpu|cuda, got {merged['device']!r}")
    return merged


def pick_device(name: str) -> torch.device:
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(name)


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
                t2d: torch.Tensor, overrides: dict, seed: int) -> tuple[Eagle3Draft, torch.Tensor]:
    """A fresh draft initialised from the target, and the teacher head ``[Vd, H]``.

    Embeddings are the target's (frozen), ``norm`` the target's final norm and
    ``lm_head`` the target lm_head's ``t2d`` rows; the rest is random (seeded).
    """
    target_config = load_target_config(target_path)
    cfg = DraftConfig.from_target_config(target_config, aux_layer_ids, d2t.numel(), overrides)
    if t2d.numel() != cfg.vocab_size:
        raise ValueError(f"vocab map t2d has {t2d.numel()} entries but the target {target_path} "
                         f"has vocab_size {cfg.vocab_size}")
    head = load_target_head(target_path, dtype=torch.float32)
    if head["embed_tokens"].shape[0] < cfg.vocab_size:
        raise ValueError(f"{target_path}: embed_tokens has {head['embed_tokens'].shape[0]} rows, "
                         f"config vocab_size is {cfg.vocab_size}")
    torch.manual_seed(seed)
    model = Eagle3Draft(cfg)
    teacher_head = head["lm_head"][:cfg.vocab_size][t2d].contiguous()
    with torch.no_grad():
        model.embed_tokens.weight.copy_(head["embed_tokens"][:cfg.vocab_size])
        model.norm.weight.copy_(head["norm"])
        model.lm_head.weight.copy_(teacher_head)
        model.d2t.copy_(d2t)
        model.t2d.copy_(t2d)
    return model, teacher_head


# ---------------------------------------------------------------------------- data

class ShardData:
    """A manifest's shards: lengths for planning, and an LRU of loaded shards."""

    def __init__(self, manifest: Manifest, cache_size: int = 2):
        self.manifest = manifest
        self.lengths = []
        for path in manifest.shard_paths:
            if not path.is_file():
                raise FileNotFoundError(f"{manifest.path}: shard {path} is missing")
            with safe_open(str(path), "pt") as f:
                cu = f.get_tensor("cu_seqlens")
            self.lengths.append((cu[1:] - cu[:-1]).tolist())
        self._cache: OrderedDict[int, dict] = OrderedDict()
        self.cache_size = cache_size

    @property
    def num_tokens(self) -> int:
        return sum(sum(x) for x in self.lengths)

    def shard(self, index: int) -> dict:
        if index not in self._cache:
            tensors, _ = read_shard(self.manifest.shard_paths[index])
            self._cache[index] = tensors
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        self._cache.move_to_end(index)
        return self._cache[index]

    def sample(self, shard: int, index: int) -> dict:
        t = self.shard(shard)
        a, b = int(t["cu_seqlens"][index]), int(t["cu_seqlens"][index + 1])
        return {name: t[name][a:b] for name in
                ("input_ids", "loss_mask", "aux_hidden_states", "last_hidden_state")}


def epoch_order(data: ShardData, seed: int, epoch: int, shuffle: bool = True) -> list[tuple[int, int]]:
    """``(shard, sample)`` pairs of one epoch, shard order and in-shard order shuffled."""
    shards = list(range(len(data.lengths)))
    if shuffle:
        random.Random(f"{seed}-epoch-{epoch}").shuffle(shards)
    order = []
    for s in shards:
        samples = list(range(len(data.lengths[s])))
        if shuffle:
            random.Random(f"{seed}-epoch-{epoch}-shard-{s}").shuffle(samples)
        order.extend((s, i) for i in samples)
    return order


def plan_batches(data: ShardData, order: list[tuple[int, int]], batch_tokens: int,
                 seed: str | None = None, window_batches: int = 32) -> list[list[tuple[int, int]]]:
    """Length-grouped packing: a batch holds at most ``batch_tokens`` (or one longer sample).

    Attention runs on a padded ``[B, Tmax]`` view, so mixing a 500-token sample with
    thirty 40-token ones costs 8x the work. Consecutive windows of about
    ``window_batches`` batches of the (shuffled) order are sorted by length before
    packing, and the batches of a window are shuffled again with ``seed``. Windows
    follow the order, so batches still read shards one after another.
    """
    batches: list[list[tuple[int, int]]] = []
    window, window_tokens = [], 0

    def flush():
        current, size = [], 0
        planned = []
        for s, i in sorted(window, key=lambda si: data.lengths[si[0]][si[1]]):
            n = data.lengths[s][i]
            if current and size + n > batch_tokens:
                planned.append(current)
                current, size = [], 0
            current.append((s, i))
            size += n
        if current:
            planned.append(current)
        if seed is not None:
            random.Random(f"{seed}-window-{len(batches)}").shuffle(planned)
        batches.extend(planned)

    for s, i in order:
        window.append((s, i))
        window_tokens += data.lengths[s][i]
        if window_tokens >= window_batches * batch_tokens:
            flush()
            window, window_tokens = [], 0
    if window:
        flush()
    return batches


def collate(data: ShardData, batch: list[tuple[int, int]], device: torch.device) -> dict:
    """Packed batch: ``input_ids [N]`` int64, ``loss_mask [N]`` bool, ``aux [N, A*H]``,
    ``last [N, H]``, ``cu_seqlens [B+1]`` int64."""
    samples = [data.sample(s, i) for s, i in batch]
    lengths = torch.tensor([x["input_ids"].numel() for x in samples])
    cu = torch.zeros(len(samples) + 1, dtype=torch.int64)
    cu[1:] = lengths.cumsum(0)
    float_dtype = torch.float32
    return {
        "input_ids": torch.cat([x["input_ids"] for x in samples]).long().to(device),
        "loss_mask": torch.cat([x["loss_mask"] for x in samples]).bool().to(device),
        "aux": torch.cat([x["aux_hidden_states"] for x in samples]).to(device, float_dtype),
        "last": torch.cat([x["last_hidden_state"] for x in samples]).to(device, float_dtype),
        "cu_seqlens": cu.to(device),
    }


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
        ok = torch.zeros(n, num_steps, dtype=torch.bool, device=device)
        for j in range(num_steps):
            target = (rows + j + 1).clamp(max=n - 1)
            ok[:, j] = layout.valid(j) & batch["loss_mask"][(rows + j + 2).clamp(max=n - 1)]
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
TRAINER_VERSION = 2


def fingerprint(train_manifest: Manifest, vocab_map: str | Path, target_path: str | Path, config: dict) -> str:
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
    return hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:16]


STEP_DIR = re.compile(r"^step-(\d{8})$")


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
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_checkpoint(run_dir: Path, step: int, state: dict, keep: int) -> Path:
    """Write ``step-XXXXXXXX/state.pt`` via a temporary dir renamed when complete."""
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
    for _, old in list_checkpoints(run_dir)[:-keep]:
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


def lr_lambda(total_steps: int, warmup_steps: int, min_ratio: float):
    def f(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
    return f


# ---------------------------------------------------------------------------- training

def train(train_manifest: str | Path, eval_manifest: str | Path | None, vocab_map: str | Path,
          target_path: str | Path, out_dir: str | Path, cache_root: str | Path,
          config: dict | None = None) -> dict:
    """Train (or resume) and write the declared outputs into ``out_dir``; returns eval.json's dict."""
    cfg = resolve_train_config(config)
    out_dir, cache_root = Path(out_dir), Path(cache_root)
    manifest = load_manifest(train_manifest)
    d2t, t2d = load_vocab_map(vocab_map)
    device = pick_device(cfg["device"])
    autocast = device.type == "cuda"
    model, teacher_head = build_draft(target_path, manifest.aux_layer_ids, d2t, t2d, cfg["draft"], cfg["seed"])
    if manifest.hidden_size != model.config.target_hidden_size:
        raise ValueError(f"{manifest.path}: hidden_size {manifest.hidden_size} != target hidden size "
                         f"{model.config.target_hidden_size}")
    model.to(device).train()
    teacher_head = teacher_head.to(device, torch.bfloat16 if autocast else torch.float32)
    params = [p for n, p in model.named_parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=cfg["lr"], betas=tuple(cfg["adam_betas"]),
                                  weight_decay=cfg["weight_decay"], fused=device.type == "cuda")

    data = ShardData(manifest)
    epoch_plans = {}

    def plan(epoch: int):
        if epoch not in epoch_plans:
            epoch_plans.clear()
            epoch_plans[epoch] = plan_batches(data, epoch_order(data, cfg["seed"], epoch),
                                              cfg["batch_tokens"], seed=f"{cfg['seed']}-epoch-{epoch}")
        return epoch_plans[epoch]

    steps_per_epoch = [len(plan(e)) for e in range(cfg["epochs"])]
    total_steps = sum(steps_per_epoch)
    warmup = max(1, int(round(cfg["warmup_ratio"] * total_steps)))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(total_steps, warmup, cfg["min_lr_ratio"]))

    fp = fingerprint(manifest, vocab_map, target_path, cfg)
    run_dir = cache_root / fp
    run_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_json(run_dir / "config.json", {"train_config": cfg, "draft_config": model.config.to_dict(),
                                                "train_manifest": str(train_manifest)})
    step, epoch, batch_index = 0, 0, 0
    checkpoints = list_checkpoints(run_dir)
    if checkpoints:
        state = torch.load(checkpoints[-1][1] / "state.pt", map_location="cpu", weights_only=False)
        model.load_state_dict(state["model"], strict=False)
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        step, epoch, batch_index = state["step"], state["data"]["epoch"], state["data"]["batch_index"]
        set_rng_state(state["rng"])
        print(f"train: resuming from {checkpoints[-1][1]} (step {step}/{total_steps})", file=sys.stderr)

    metrics_cache = run_dir / "metrics.jsonl"
    history = read_metrics(metrics_cache, step)
    for path in (metrics_cache, out_dir / "metrics.jsonl"):
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "w") as f:
            f.write("".join(line + "\n" for line in history))

    def checkpoint(next_epoch: int, next_batch: int):
        batches = plan(next_epoch) if next_epoch < cfg["epochs"] else []
        position = batches[next_batch][0] if next_batch < len(batches) else None
        state = {
            "model": {n: p.detach().cpu() for n, p in model.named_parameters() if p.requires_grad},
            "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(), "step": step,
            "data": {"epoch": next_epoch, "batch_index": next_batch,
                     "next_sample": None if position is None else {"shard": position[0], "offset": position[1]}},
            "rng": rng_state(), "fingerprint": fp,
        }
        save_checkpoint(run_dir, step, state, cfg["keep_checkpoints"])

    done_tokens = data.num_tokens * epoch
    if epoch < cfg["epochs"]:
        done_tokens += sum(data.lengths[s][i] for b in plan(epoch)[:batch_index] for s, i in b)
    progress = Progress("train", data.num_tokens * cfg["epochs"], unit="tokens", done=done_tokens)
    delay = float(os.environ.get("EAGLE3FLOW_TEST_STEP_DELAY", "0") or 0)
    num_steps, decay = cfg["ttt_steps"], cfg["step_loss_decay"]
    window_tokens, window_t0 = 0, time.monotonic()
    while epoch < cfg["epochs"]:
        batches = plan(epoch)
        while batch_index < len(batches):
            batch = collate(data, batches[batch_index], device)
            n = batch["input_ids"].numel()
            loss, stats = ttt_loss(model, batch, teacher_head, num_steps, decay, autocast)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            grad_norm = torch.nn.utils.clip_grad_norm_(params, cfg["max_grad_norm"])
            lr = scheduler.get_last_lr()[0]
            optimizer.step()
            scheduler.step()
            step += 1
            batch_index += 1
            window_tokens += n
            if step % cfg["log_every"] == 0 or step == total_steps:
                now = time.monotonic()
                row = {"step": step, "epoch": epoch, "loss": float(loss.detach()),
                       "step_loss": [s[0] for s in stats], "step_acc": [s[1] for s in stats],
                       "step_rows": [s[2] for s in stats], "grad_norm": float(grad_norm), "lr": lr,
                       "tokens": n, "tokens_per_s": window_tokens / max(now - window_t0, 1e-9)}
                window_tokens, window_t0 = 0, now
                line = json.dumps(row)
                for path in (metrics_cache, out_dir / "metrics.jsonl"):
                    with open(path, "a") as f:
                        f.write(line + "\n")
            progress.update(n, extra=f"step {step}/{total_steps} loss {float(loss.detach()):.4f} "
                                     f"acc0 {stats[0][1]:.3f}")
            if step % cfg["checkpoint_every"] == 0 or step == total_steps:
                at_end = batch_index == len(batches)
                checkpoint(epoch + 1 if at_end else epoch, 0 if at_end else batch_index)
            if delay:
                time.sleep(delay)
        epoch, batch_index = epoch + 1, 0
    progress.close()

    model.eval()
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file({k: v.detach().cpu().contiguous() for k, v in model.trainable_state_dict().items()},
              str(out_dir / "draft.safetensors"), metadata={"fingerprint": fp})
    atomic_write_json(out_dir / "draft_config.json", model.config.to_dict())
    result = {"train_config": cfg, "fingerprint": fp, "steps": step}
    if eval_manifest is not None:
        result.update(evaluate_split(model, eval_manifest, num_steps, cfg["eval_max_tokens"],
                                     teacher_head=teacher_head.float(), batch_tokens=cfg["batch_tokens"]))
        print(f"train: eval step accuracy {result['step_accuracy']}, simulated acceptance length "
              f"{result['simulated_acceptance_length']}", file=sys.stderr)
    atomic_write_json(out_dir / "eval.json", result)
    return result


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
    args = parser.parse_args(argv)
    try:
        config = json.loads(args.config_json)
    except json.JSONDecodeError as e:
        parser.error(f"--config-json is not valid JSON: {e}")
    train(args.train_manifest, args.eval_manifest, args.vocab_map, args.target, args.out_dir,
          args.cache_root, config)


if __name__ == "__main__":
    main()
