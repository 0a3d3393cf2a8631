"""A first DFlash trainer: the draft built from the target, trained on hidden-state shards
in memory, on the CPU in float32, reproducibly (seeded anchors, batches and init), and
saved as a train dir (``draft.safetensors`` + ``dflash_config.json``) that
eagle3flow/export/dflash.py exports.

Small by design (the workflow's trainer, with its cache, resume, streaming and CUDA fast
paths, takes DFlash later): it is what the tests and first measurements train with.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from eagle3flow.atomic import replacing, write_json
from eagle3flow.extract import shards
from eagle3flow.model.dflash import DFlashDraft
from eagle3flow.model.dflash_config import DFlashConfig, default_loss_gamma
from eagle3flow.target.config import load_target_config
from eagle3flow.target.weights import load_target_head
from eagle3flow.train.dflash_loss import dflash_loss, sample_anchors


def build_dflash_draft(target_path: str | Path, cfg: DFlashConfig, seed: int) -> DFlashDraft:
    """A fresh draft: the target's embeddings, final norm (the draft's ``norm`` starts as
    it) and lm_head (frozen), the rest random (seeded)."""
    head = load_target_head(target_path)
    for part in ("embed_tokens", "lm_head"):
        if head[part].shape[0] < cfg.vocab_size or head[part].shape[1] != cfg.target_hidden_size:
            raise ValueError(f"{target_path}: {part} has shape {list(head[part].shape)}, the config says "
                             f"[{cfg.vocab_size}, {cfg.target_hidden_size}]")
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


def train_dflash(model: DFlashDraft, samples: list[dict], steps: int, lr: float = 3e-3,
                 samples_per_step: int = 8, anchors_per_sample: int = 16, gamma: float | None = None,
                 target: str = "hard", seed: int = 0, log_every: int = 0) -> list[dict]:
    """AdamW (cosine decay to 10%) for ``steps`` steps over ``samples``, in a seeded
    order; returns each step's ``{"step", "loss", ...stats}``."""
    cfg = model.config
    gamma = default_loss_gamma(cfg.block_size) if gamma is None else gamma
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=0.0, betas=(0.9, 0.95))
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: 0.1 + 0.9 * 0.5 * (1 + torch.cos(torch.tensor(torch.pi * s / max(steps, 1))).item()))
    generator = torch.Generator().manual_seed(seed)
    order: list[int] = []
    history = []
    model.train()
    for step in range(steps):
        if len(order) < samples_per_step:
            order += torch.randperm(len(samples), generator=generator).tolist()
        chosen, order = order[:samples_per_step], order[samples_per_step:]
        batch = pack([samples[i] for i in chosen])
        anchors = sample_anchors(batch["cu_seqlens"], batch["loss_mask"], anchors_per_sample, generator)
        loss, stats = dflash_loss(model, batch, anchors, gamma, target)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        schedule.step()
        history.append({"step": step, "loss": float(loss.detach()), **stats})
        if log_every and step % log_every == 0:
            print(f"dflash step {step}: loss {history[-1]['loss']:.4f} slot accuracy "
                  f"{[round(a, 3) for a in stats['slot_accuracy']]}", flush=True)
    model.eval()
    return history


def save_train_dir(model: DFlashDraft, out_dir: str | Path) -> Path:
    """``draft.safetensors`` (the exported tensors, float32) + ``dflash_config.json``."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    with replacing(out_dir / "draft.safetensors") as tmp:
        save_file({k: v.float().contiguous() for k, v in model.trainable_state_dict().items()}, str(tmp))
    write_json(out_dir / "dflash_config.json", model.config.to_dict())
    return out_dir


def load_train_dir(train_dir: str | Path, target_path: str | Path) -> DFlashDraft:
    """A saved train dir back as a draft, its frozen parts from the target."""
    train_dir = Path(train_dir)
    cfg = DFlashConfig.from_dict(json.loads((train_dir / "dflash_config.json").read_text()))
    model = build_dflash_draft(target_path, cfg, seed=0)
    missing, unexpected = model.load_state_dict(load_file(str(train_dir / "draft.safetensors")), strict=False)
    missing = [m for m in missing if m not in DFlashDraft.FROZEN]
    if missing or unexpected:
        raise ValueError(f"{train_dir}/draft.safetensors: missing {missing}, unexpected {unexpected}")
    return model.eval()


def default_mask_token_id(target_path: str | Path, trust_remote_code: bool = False) -> int:
    """The embedding row the masked slots read when none is configured: the first row past
    the tokenizer's vocabulary (a padded embedding's spare row, what the published Qwen3
    DFlash drafts use), else the tokenizer's pad token when it is not its end of sequence."""
    from eagle3flow.target.tokenizer import load_tokenizer

    vocab_size = int(load_target_config(target_path)["vocab_size"])
    tokenizer = load_tokenizer(target_path, trust_remote_code)
    if len(tokenizer) < vocab_size:
        return len(tokenizer)
    if tokenizer.pad_token_id is not None and tokenizer.pad_token_id != tokenizer.eos_token_id:
        return int(tokenizer.pad_token_id)
    raise ValueError(f"{target_path}: no spare embedding row and no pad token distinct from EOS for the "
                     "DFlash mask; set mask_token_id to a token the data never holds")


SETTINGS = {"block_size": 16, "mask_token_id": None, "num_hidden_layers": 1, "target_layer_ids": None,
            "steps": 1000, "lr": 3e-3, "samples_per_step": 8, "anchors_per_sample": 16, "gamma": None,
            "target": "hard", "seed": 0, "draft": {}}


def main(argv=None) -> None:
    """CLI: ``python -m eagle3flow.train.dflash_train --manifest M --target DIR --out-dir DIR
    [--config-json '{"block_size": 8, ...}']`` (keys: :data:`SETTINGS`; ``draft``: config
    overrides). Trains on the CPU in float32 and writes the train dir."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--manifest", required=True, help="hidden states of the draft's target layers")
    parser.add_argument("--target", required=True)
    parser.add_argument("--out-dir", required=True)
    parser.add_argument("--config-json", default="{}")
    args = parser.parse_args(argv)
    given = json.loads(args.config_json)
    unknown = sorted(set(given) - set(SETTINGS))
    if unknown:
        parser.error(f"unknown DFlash settings {unknown} (known: {sorted(SETTINGS)})")
    settings = {**SETTINGS, **given}
    mask = settings["mask_token_id"]
    cfg = DFlashConfig.from_target_config(
        load_target_config(args.target), settings["block_size"],
        default_mask_token_id(args.target) if mask is None else mask, settings["num_hidden_layers"],
        settings["target_layer_ids"], settings["draft"])
    model = build_dflash_draft(args.target, cfg, settings["seed"])
    if not model.embed_tokens.weight[cfg.mask_token_id].any():
        print(f"dflash: the mask row {cfg.mask_token_id} of the target's embeddings is zero: every masked "
              "slot enters the first layer alike (only the later layers tell them apart)", file=sys.stderr)
    train_dflash(model, load_samples(args.manifest, cfg), settings["steps"], settings["lr"],
                 settings["samples_per_step"], settings["anchors_per_sample"], settings["gamma"],
                 settings["target"], settings["seed"], log_every=max(settings["steps"] // 20, 1))
    save_train_dir(model, args.out_dir)


if __name__ == "__main__":
    main()
