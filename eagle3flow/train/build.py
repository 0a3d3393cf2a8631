"""The draft to train, built from the target (vocab map, frozen embeddings, teacher head,
optional midlayer init), and a trained one loaded back from ``results/train``."""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file

from eagle3flow.model.config import DraftConfig
from eagle3flow.model.draft import Eagle3Draft
from eagle3flow.target.config import load_target_config
from eagle3flow.target.weights import load_target_head


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
    return model, teacher_head


def load_unreachable_head(target_path: str | Path, t2d: torch.Tensor) -> torch.Tensor:
    """The target lm_head's rows of the tokens outside the draft vocab ``[Vt - Vd, H]``, as
    stored: the acceptance losses need the target's whole normaliser (a second read of the
    lm_head, paid only by them)."""
    head = load_target_head(target_path, parts=("lm_head",))["lm_head"]
    if head.shape[0] < t2d.numel():
        raise ValueError(f"{target_path}: lm_head has {head.shape[0]} rows, the vocab map {t2d.numel()}")
    return head[:t2d.numel()][~t2d].contiguous()


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

