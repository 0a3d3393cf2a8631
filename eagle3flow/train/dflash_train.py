"""The DFlash trainer: the draft built from the target, trained on hidden-state shards,
reproducibly (seeded anchors, batches and init), checkpointed into the cache and resumed
from the last checkpoint (bitwise on the CPU), and saved as the workflow's train dir
(``draft.safetensors`` + ``draft_config.json`` + ``metrics.jsonl`` + ``eval.json``) that
eagle3flow/export/dflash.py exports.

The samples are held in memory (the DFlash draft is small and the first targets are);
on CUDA the step runs under bf16 autocast with fp32 master weights. Under torchrun
(eagle3flow/train/launch.py, train.nproc / one process per GPU) each rank takes a contiguous
share of every step's samples with the anchors a one-process run draws for them, the loss
is rescaled to the whole batch's denominator and the gradients summed, so every rank
applies the one-process update; rank 0 checkpoints, evaluates and writes.

Streaming partitions (eagle3flow/ops/streaming.py): each link is one run over its
partition, started from the previous link's final checkpoint (``--init-from``: weights,
optimizer, schedule, history). ``dflash.steps`` stay the steps of the whole chain, one
cosine schedule over all of them; a link trains up to its share by tokens,
``steps x tokens through this link / --schedule-tokens``, and the last (``--last-link``)
to ``steps``. A run that finished (``done.json`` of its fingerprint, its outputs in place)
returns at once: a link's job rerun after its partition was consumed reads no shard.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from eagle3flow.atomic import replacing, sweep_stale_temporaries, write_json, write_jsonl
from eagle3flow.config import TARGET_BORROWED, cli_settings, without_unused_dpace_keys
from eagle3flow.device import limit_cpu_threads
from eagle3flow.extract import shards
from eagle3flow.progress import Progress
from eagle3flow.model.dflash import DFlashDraft
from eagle3flow.model.dflash_config import DFLASH_KEEP_CHECKPOINTS, DFlashConfig, default_loss_gamma
from eagle3flow.target.config import load_target_config
from eagle3flow.target.identity import target_digest
from eagle3flow.target.tokenizer import load_tokenizer
from eagle3flow.train.build import checked_target_head
from eagle3flow.train.checkpoint import (chain_settings, finished_result, init_state_path, list_checkpoints,
                                         save_checkpoint, write_done)
from eagle3flow.train.data import to_device
from eagle3flow.train.distributed import DistContext, init_distributed, sum_gradients
from eagle3flow.train.dflash_loss import dflash_loss, sample_anchors


def build_dflash_draft(target_path: str | Path, cfg: DFlashConfig, seed: int) -> DFlashDraft:
    """A fresh draft: the target's embeddings, final norm (the draft's ``norm`` starts as
    it) and lm_head (frozen), the rest random (seeded)."""
    head = checked_target_head(target_path, cfg.vocab_size, cfg.target_hidden_size)
    torch.manual_seed(seed)
    model = DFlashDraft(cfg)
    with torch.no_grad():
        model.embed_tokens.weight.copy_(head["embed_tokens"][:cfg.vocab_size])
        model.lm_head.weight.copy_(head["lm_head"][:cfg.vocab_size])
        model.norm.weight.copy_(head["norm"])
    return model


def load_samples(manifest_path: str | Path, cfg: DFlashConfig) -> list[dict]:
    manifest = shards.load_manifest(manifest_path)
    if manifest.aux_layer_ids != cfg.target_layer_ids:
        raise ValueError(f"{manifest_path}: hidden states of layers {manifest.aux_layer_ids}, the DFlash draft "
                         f"reads {cfg.target_layer_ids} (id k = input of layer k)")
    return list(manifest.iter_samples())


def pack(samples: list[dict]) -> dict:
    lengths = [s["input_ids"].numel() for s in samples]
    return {"aux": torch.cat([s["aux_hidden_states"].float() for s in samples]),
            "input_ids": torch.cat([s["input_ids"].long() for s in samples]),
            "loss_mask": torch.cat([s["loss_mask"] for s in samples]),
            "last": torch.cat([s["last_hidden_state"].float() for s in samples]),
            "cu_seqlens": torch.tensor([0] + lengths).cumsum(0)}


def block_loss(model: DFlashDraft, batch: dict, anchors: torch.Tensor, gamma: float, target: str,
               weighting: str = "decay", dpace_alpha: float = 0.5):
    """:func:`dflash_loss` of a packed host batch on the model's device (bf16 autocast on CUDA)."""
    device = model.fc.weight.device
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
        return dflash_loss(model, to_device(batch, device), anchors.to(device), gamma, target, weighting,
                           dpace_alpha)


def train_dflash(model: DFlashDraft, samples: list[dict], steps: int, lr: float = 3e-3,
                 samples_per_step: int = 8, anchors_per_sample: int = 16, gamma: float | None = None,
                 target: str = "hard", seed: int = 0, log_every: int = 0, checkpoint=None,
                 checkpoint_every: int = 0, resume: dict | None = None, weighting: str = "decay",
                 dpace_alpha: float = 0.5, ctx: DistContext | None = None, stop: int | None = None,
                 init: dict | None = None) -> list[dict]:
    """AdamW (cosine decay to 10% over ``steps``) up to step ``stop`` (default ``steps``)
    over ``samples``, in a seeded order; returns each step's ``{"step", "loss", ...stats}``.
    On CUDA (the model's device) under bf16 autocast. ``checkpoint(step, state)`` is called
    every ``checkpoint_every`` steps and at ``stop`` with everything a resumed run needs;
    ``resume`` (such a state of this run) continues from it, bitwise on the CPU; ``init``
    (another run's, a streaming chain's previous link) starts from its weights, optimizer,
    schedule and history, with this run's samples in a fresh order. ``ctx`` (torchrun):
    this rank trains its share of each step (module docstring); the checkpoints are rank 0's."""
    stop = steps if stop is None else min(int(stop), steps)
    cfg = model.config
    gamma = default_loss_gamma(cfg.block_size) if gamma is None else gamma
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=0.0, betas=(0.9, 0.95))
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: 0.1 + 0.9 * 0.5 * (1 + torch.cos(torch.tensor(torch.pi * s / max(steps, 1))).item()))
    generator = torch.Generator().manual_seed(seed)
    order: list[int] = []
    history: list[dict] = []
    start = 0
    if resume is not None or init is not None:
        state = resume if resume is not None else init
        model.load_state_dict(state["model"], strict=False)
        optimizer.load_state_dict(state["optimizer"])
        schedule.load_state_dict(state["schedule"])
        history, start = list(state["history"]), int(state["step"])
    if resume is not None:
        generator.set_state(resume["generator"])
        order = list(resume["order"])
    shared = ctx is not None and ctx.enabled
    main = ctx is None or ctx.is_main

    def training_state(at: int) -> dict:
        return {"step": at, "model": model.trainable_state_dict(), "optimizer": optimizer.state_dict(),
                "schedule": schedule.state_dict(), "generator": generator.get_state(), "order": order,
                "history": history}
    progress = Progress("train[dflash]", total=stop, unit="steps", done=min(start, stop),
                        stream=None if main else open(os.devnull, "w"))
    model.train()
    for step in range(start, stop):
        if len(order) < samples_per_step:
            order += torch.randperm(len(samples), generator=generator).tolist()
        chosen, order = order[:samples_per_step], order[samples_per_step:]
        step_start = time.perf_counter()
        picked = [samples[i] for i in chosen]
        cu = torch.tensor([0] + [s["input_ids"].numel() for s in picked]).cumsum(0)
        anchors = sample_anchors(cu, torch.cat([s["loss_mask"] for s in picked]), anchors_per_sample, generator)
        first, last = rank_samples(len(picked), ctx) if shared else (0, len(picked))
        batch = pack(picked[first:last])
        anchors = anchors[(anchors >= cu[first]) & (anchors < cu[last])] - cu[first]
        optimizer.zero_grad(set_to_none=True)
        if anchors.numel() or not shared:
            loss, stats = block_loss(model, batch, anchors, gamma, target, weighting, dpace_alpha)
            if shared:      # this rank's share of the whole batch's weighted mean
                whole = float(ctx.all_reduce_sum(torch.tensor([stats["loss_denominator"]], dtype=torch.float64))[0])
                loss = loss * (stats["loss_denominator"] / whole) if whole > 0 else loss * 0.0
            loss.backward()
        else:               # no anchor in this rank's samples: it adds nothing but takes part
            ctx.all_reduce_sum(torch.zeros(1, dtype=torch.float64))
            loss, stats = None, empty_stats(model.config.num_speculative_tokens)
        if shared:
            sum_gradients(params, ctx)
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        schedule.step()
        loss_value = float(loss.detach()) if loss is not None else 0.0   # waits for the step
        if shared:
            loss_value, stats = whole_batch_stats(loss_value, stats, ctx)
        # step_acc / tokens_per_s: the keys the report reads of any trainer's metrics.jsonl (per
        # block slot here; context rows of hidden states a second, the whole batch's)
        history.append({"step": step, "loss": loss_value, "lr": schedule.get_last_lr()[0],
                        "step_acc": stats["slot_accuracy"],
                        "tokens_per_s": int(cu[-1]) / (time.perf_counter() - step_start),
                        **stats})
        progress.update(1, extra=f"loss {history[-1]['loss']:.4f}")
        if main and log_every and step % log_every == 0:
            print(f"dflash step {step}: loss {history[-1]['loss']:.4f} slot accuracy "
                  f"{[round(a, 3) for a in stats['slot_accuracy']]}", flush=True)
        # The last step's checkpoint too: a chain's next link starts from it, a rerun ends at it.
        if checkpoint is not None and main and (step + 1 == stop or
                                                checkpoint_every and (step + 1) % checkpoint_every == 0):
            checkpoint(step + 1, training_state(step + 1))
    if checkpoint is not None and main and resume is None and start >= stop:
        checkpoint(stop, training_state(stop))    # a link with no step of its own still hands on
    progress.close()
    model.eval()
    return history


def rank_samples(count: int, ctx: DistContext) -> tuple[int, int]:
    """``[first, last)`` of a step's ``count`` samples this rank trains: contiguous, sizes
    differing by at most one."""
    return count * ctx.rank // ctx.world_size, count * (ctx.rank + 1) // ctx.world_size


def empty_stats(slots: int) -> dict:
    return {"slot_loss": [0.0] * slots, "slot_accuracy": [0.0] * slots, "slot_rows": [0] * slots,
            "anchors": 0, "loss_denominator": 0.0}


def whole_batch_stats(loss_share: float, stats: dict, ctx: DistContext) -> tuple[float, dict]:
    """The step's loss and per-slot stats over every rank's share (one all-reduce)."""
    rows = torch.tensor(stats["slot_rows"], dtype=torch.float64)
    local = torch.cat([torch.tensor([loss_share, stats["anchors"], stats["loss_denominator"]], dtype=torch.float64),
                       rows, rows * torch.tensor(stats["slot_loss"], dtype=torch.float64),
                       rows * torch.tensor(stats["slot_accuracy"], dtype=torch.float64)])
    total = ctx.all_reduce_sum(local)
    k = rows.numel()
    counts, losses, hits = total[3:3 + k], total[3 + k:3 + 2 * k], total[3 + 2 * k:]
    return float(total[0]), {"slot_loss": (losses / counts.clamp(min=1)).tolist(),
                             "slot_accuracy": (hits / counts.clamp(min=1)).tolist(),
                             "slot_rows": [int(c) for c in counts.tolist()], "anchors": int(total[1]),
                             "loss_denominator": float(total[2])}


@torch.no_grad()
def evaluate_dflash(model: DFlashDraft, samples: list[dict], anchors_per_sample: int, gamma: float | None,
                    target: str = "hard", seed: int = 0, samples_per_batch: int = 8, weighting: str = "decay",
                    dpace_alpha: float = 0.5) -> dict:
    """The block loss and per-slot accuracy (the draft's argmax = the data's token) on
    ``samples`` (the eval split), at seeded anchors: ``{"loss", "slot_accuracy",
    "slot_rows", "num_samples", "anchors"}``."""
    cfg = model.config
    gamma = default_loss_gamma(cfg.block_size) if gamma is None else gamma
    generator = torch.Generator().manual_seed(seed)
    hits = [0.0] * cfg.num_speculative_tokens
    rows = [0] * cfg.num_speculative_tokens
    loss_sum = weight_sum = 0.0
    anchors_total = 0
    for i in range(0, len(samples), samples_per_batch):
        batch = pack(samples[i:i + samples_per_batch])
        anchors = sample_anchors(batch["cu_seqlens"], batch["loss_mask"], anchors_per_sample, generator)
        if not anchors.numel():
            continue
        loss, stats = block_loss(model, batch, anchors, gamma, target, weighting, dpace_alpha)
        scored = sum(stats["slot_rows"])
        loss_sum += float(loss) * scored
        weight_sum += scored
        anchors_total += stats["anchors"]
        for k, (acc, n) in enumerate(zip(stats["slot_accuracy"], stats["slot_rows"])):
            hits[k] += acc * n
            rows[k] += n
    return {"loss": loss_sum / weight_sum if weight_sum else None,
            "slot_accuracy": [h / n if n else None for h, n in zip(hits, rows)], "slot_rows": rows,
            "num_samples": len(samples), "anchors": anchors_total}


# The train dir's config file: the name the EAGLE-3 trainer's train dir uses, so the
# workflow's train_draft outputs are the same files whichever draft it trains.
TRAIN_CONFIG = "draft_config.json"


def read_train_config(train_dir: str | Path) -> DFlashConfig:
    path = Path(train_dir) / TRAIN_CONFIG
    data = json.loads(path.read_text())
    if "block_size" not in data or "mask_token_id" not in data:
        raise ValueError(f"{path}: not a DFlash draft's config (no block_size / mask_token_id): "
                         "an EAGLE-3 train dir? (train.method)")
    return DFlashConfig.from_dict(data)


def save_train_dir(model: DFlashDraft, out_dir: str | Path) -> Path:
    """``draft.safetensors`` (the exported tensors, float32) + ``draft_config.json`` (the
    :class:`DFlashConfig`)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    with replacing(out_dir / "draft.safetensors") as tmp:
        save_file({k: v.float().contiguous() for k, v in model.trainable_state_dict().items()}, str(tmp))
    write_json(out_dir / TRAIN_CONFIG, model.config.to_dict())
    return out_dir


def load_train_dir(train_dir: str | Path, target_path: str | Path) -> DFlashDraft:
    """A saved train dir back as a draft, its frozen parts from the target."""
    train_dir = Path(train_dir)
    model = build_dflash_draft(target_path, read_train_config(train_dir), seed=0)
    missing, unexpected = model.load_state_dict(load_file(str(train_dir / "draft.safetensors")), strict=False)
    missing = [m for m in missing if m not in DFlashDraft.FROZEN]
    if missing or unexpected:
        raise ValueError(f"{train_dir}/draft.safetensors: missing {missing}, unexpected {unexpected}")
    return model.eval()


def default_mask_token_id(target_path: str | Path, trust_remote_code: bool = False) -> int:
    """The embedding row the masked slots read when none is configured: the first row past
    the tokenizer's vocabulary (a padded embedding's spare row, what the published Qwen3
    DFlash drafts use); else the last special token the tokenizer defines that is none of
    its bos/eos/pad/unk and that its chat template never writes (SmolLM2's ``<empty_output>``,
    Llama 3's last reserved token: rows text never produces, trained or not); else the pad
    token when it is not the end of sequence."""
    vocab_size = int(load_target_config(target_path)["vocab_size"])
    tokenizer = load_tokenizer(target_path, trust_remote_code)
    if len(tokenizer) < vocab_size:
        return len(tokenizer)
    unused = unused_special_tokens(tokenizer, vocab_size)
    if unused:
        return unused[-1]
    if tokenizer.pad_token_id is not None and tokenizer.pad_token_id != tokenizer.eos_token_id:
        return int(tokenizer.pad_token_id)
    raise ValueError(f"{target_path}: no spare embedding row, no special token the chat template leaves "
                     "unused and no pad token distinct from EOS for the DFlash mask; set dflash.mask_token_id "
                     "to a token the data never holds")


def unused_special_tokens(tokenizer, vocab_size: int) -> list[int]:
    """Ids of the tokenizer's special tokens, below ``vocab_size``, that are not its
    bos/eos/pad/unk and do not occur in its chat template's rendering of a two-turn
    conversation (with a generation prompt), ascending."""
    taken = {tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id, tokenizer.unk_token_id}
    if getattr(tokenizer, "chat_template", None):
        conversation = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"},
                        {"role": "assistant", "content": "a"}, {"role": "user", "content": "v"}]
        try:
            rendered = tokenizer.apply_chat_template(conversation, add_generation_prompt=True, tokenize=True)
        except Exception:   # a template that refuses a system turn, say: then no token is known unused
            return []
        rendered = rendered["input_ids"] if hasattr(rendered, "keys") else rendered
        taken |= set(int(t) for t in rendered)
    special = {int(i) for i, token in tokenizer.added_tokens_decoder.items() if token.special}
    return sorted(i for i in special if i not in taken and i < vocab_size)


def run_fingerprint(settings: dict, train_manifest: Path, target: Path, device: torch.device,
                    chain: dict | None = None) -> str:
    """What determines the trained weights: the settings (less where the checkpoints go and
    how often), the train split's manifest, the target's identity, the device type and, for
    a streaming link, where the chain stands (``chain_settings``)."""
    given = {k: v for k, v in without_unused_dpace_keys(settings).items()
             if k not in ("checkpoint_every", "device", "trust_remote_code")}
    key = {"version": 1, "settings": given, "manifest": shards.sha256_file(train_manifest),
           "target": target_digest(target), "device": device.type, **({"chain": chain} if chain else {})}
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]


def link_stop(steps: int, start: int, tokens_before: int, link_tokens: int, schedule_tokens: int | None,
              last_link: bool = False) -> int:
    """The step a run ends at: ``steps``, or for a streaming link its share by tokens of the
    chain's (never before where it starts); the chain's last link ends at ``steps`` whatever
    extraction's length policy took off the tokens ``schedule_tokens`` counted."""
    if schedule_tokens is None or last_link:
        return max(start, steps)
    through = min(tokens_before + link_tokens, schedule_tokens)
    return max(start, min(steps, steps * through // schedule_tokens))


def main(argv=None) -> None:
    """CLI: ``python -m eagle3flow.train.dflash_train --train-manifest M --eval-manifest M
    --target DIR --out-dir DIR --cache-root DIR [--config-json '{"block_size": 8, ...}']``
    (the config's dflash section and target.trust_remote_code). The draft reads the layers
    the manifests hold; checkpoints go to CACHE_ROOT/<fingerprint>/ and a rerun resumes
    from the last. Writes the train dir: draft.safetensors, draft_config.json,
    metrics.jsonl, eval.json (evaluated where --eval-manifest is given). A streaming link
    adds ``--init-from CHECKPOINT --schedule-tokens N --data-epoch E`` (module docstring)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--train-manifest", required=True, help="hidden states of the draft's target layers")
    parser.add_argument("--eval-manifest", default=None, help="evaluated at the end (a streaming chain's last link)")
    parser.add_argument("--target", required=True)
    parser.add_argument("--out-dir", required=True)
    parser.add_argument("--cache-root", required=True)
    parser.add_argument("--config-json", default="{}")
    parser.add_argument("--init-from", default=None, help="a streaming link: the previous link's final checkpoint")
    parser.add_argument("--schedule-tokens", type=int, default=None,
                        help="a streaming link: the tokens of the whole chain (partitions x epochs)")
    parser.add_argument("--data-epoch", type=int, default=0, help="a streaming link: its epoch (seeds its order)")
    parser.add_argument("--last-link", action="store_true", help="a streaming link: the chain's last (ends at steps)")
    args = parser.parse_args(argv)
    if args.schedule_tokens is not None and args.schedule_tokens < 1:
        parser.error(f"--schedule-tokens must be >= 1, got {args.schedule_tokens}")
    settings = cli_settings(parser, "dflash", args.config_json, borrowed=TARGET_BORROWED)
    limit_cpu_threads()
    target, train_manifest = Path(args.target), Path(args.train_manifest)
    manifests = {name: shards.load_manifest(path) for name, path in
                 (("train", train_manifest), ("eval", args.eval_manifest)) if path is not None}
    layers = manifests["train"].aux_layer_ids
    if "eval" in manifests and manifests["eval"].aux_layer_ids != layers:
        raise ValueError(f"{args.eval_manifest}: layers {manifests['eval'].aux_layer_ids}, the train split's "
                         f"{layers}: extract both with the same extract.aux_layer_ids")
    mask = settings["mask_token_id"]
    if mask is None:
        mask = default_mask_token_id(target, settings["trust_remote_code"])
    cfg = DFlashConfig.from_target_config(load_target_config(target), settings["block_size"], mask,
                                          settings["num_hidden_layers"], layers, settings["draft"])
    ctx = init_distributed(settings["device"])
    try:
        train_rank(ctx, args, settings, cfg, manifests, target, train_manifest, layers)
    finally:
        ctx.close()


def train_rank(ctx: DistContext, args, settings: dict, cfg: DFlashConfig, manifests: dict, target: Path,
               train_manifest: Path, layers: list[int]) -> None:
    """One process's training (all of it, or its rank's share under torchrun); rank 0
    evaluates (where there is an eval split) and writes the train dir."""
    device = ctx.device
    chain = chain_settings(args.init_from, args.schedule_tokens, args.data_epoch)
    if chain is not None and args.last_link:
        chain["last_link"] = True
    fp = run_fingerprint(settings, train_manifest, target, device, chain)
    run_dir, out_dir = Path(args.cache_root) / fp, Path(args.out_dir)
    finished = finished_result(run_dir, out_dir, fp)
    if finished is not None:
        # A rerun of a finished run (e.g. a link killed after its marker: its shards and the
        # previous link's checkpoint may be gone): nothing to read, nothing to do.
        if ctx.is_main:
            print(f"dflash: already finished in {run_dir} (step {finished['steps']}); nothing to do",
                  file=sys.stderr, flush=True)
        return
    model = build_dflash_draft(target, cfg, settings["seed"]).to(device)
    if not model.embed_tokens.weight[cfg.mask_token_id].any() and ctx.is_main:
        print(f"dflash: the mask row {cfg.mask_token_id} of the target's embeddings is zero: every masked "
              "slot enters the first layer alike (only the later layers tell them apart)", file=sys.stderr)
    if ctx.is_main:
        # A checkpoint whose writer was killed: never resumed from; gone before this run saves.
        for path, size in sweep_stale_temporaries(run_dir) if run_dir.is_dir() else []:
            print(f"dflash: removed the unfinished checkpoint {path.name} of a killed run ({size / 1e6:,.1f} MB)",
                  file=sys.stderr)
    init = (torch.load(init_state_path(args.init_from), map_location=device, weights_only=False)
            if args.init_from else None)
    tokens_before = int(init.get("tokens_done", 0)) if init else 0
    tokens_done = tokens_before + manifests["train"].num_tokens
    checkpoints = list_checkpoints(run_dir)
    last = checkpoints[-1][1] if checkpoints else None
    resume = torch.load(last / "state.pt", map_location=device, weights_only=False) if last else None
    start = int((resume or init or {"step": 0})["step"])
    stop = link_stop(settings["steps"], start, tokens_before, manifests["train"].num_tokens, args.schedule_tokens,
                     args.last_link)
    if ctx.is_main:
        print(f"dflash: {cfg.num_hidden_layers} layer(s), blocks of {cfg.block_size}, target layers {layers}, "
              f"mask {cfg.mask_token_id}, on {device} x {ctx.world_size} process(es); checkpoints in {run_dir}"
              + (f"; resuming from {last.name} (step {resume['step']}/{stop})" if resume else "")
              + (f"; starting from {Path(args.init_from)} (step {init['step']}, {tokens_before:,} tokens of "
                 f"the chain trained), this link to step {stop} of {settings['steps']}" if init and not resume else ""),
              file=sys.stderr, flush=True)
    t0 = time.monotonic()

    def checkpoint(step: int, state: dict) -> None:
        save_checkpoint(run_dir, step, {**state, "tokens_done": tokens_done}, DFLASH_KEEP_CHECKPOINTS)

    # A streaming link's order is its own (seeded by the epoch): its partition's samples only.
    seed = settings["seed"] + 1_000_003 * args.data_epoch
    history = train_dflash(model, list(manifests["train"].iter_samples()), settings["steps"], settings["lr"],
                           settings["samples_per_step"], settings["anchors_per_sample"], settings["gamma"],
                           settings["loss_target"], seed, log_every=max(settings["steps"] // 20, 1),
                           checkpoint=checkpoint, checkpoint_every=settings["checkpoint_every"], resume=resume,
                           weighting=settings["position_weighting"], dpace_alpha=settings["dpace_alpha"],
                           ctx=ctx, stop=stop, init=init)
    if not ctx.is_main:
        return
    save_train_dir(model, out_dir)
    write_jsonl(out_dir / "metrics.jsonl", history)
    result = {"method": "dflash", "fingerprint": fp, "steps": stop, "tokens_done": tokens_done, "chain": chain,
              "final_checkpoint": str(run_dir / f"step-{stop:08d}"), "train_s_this_run": time.monotonic() - t0}
    if "eval" in manifests:
        evaluation = evaluate_dflash(model, list(manifests["eval"].iter_samples()), settings["anchors_per_sample"],
                                     settings["gamma"], settings["loss_target"], settings["seed"],
                                     weighting=settings["position_weighting"], dpace_alpha=settings["dpace_alpha"])
        result = {"method": "dflash", **evaluation, **{k: v for k, v in result.items() if k != "method"}}
        print(f"dflash: eval loss {evaluation['loss']}, slot accuracy "
              f"{[round(a, 3) for a in evaluation['slot_accuracy'] if a is not None]}", file=sys.stderr)
    write_json(out_dir / "eval.json", result)
    # Last: the final checkpoint and the outputs are on disk.
    write_done(run_dir, out_dir, fp, stop, tokens_done, result["final_checkpoint"])


if __name__ == "__main__":
    main()
