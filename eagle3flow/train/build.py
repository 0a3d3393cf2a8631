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
from eagle3flow.target.weights import load_target_head, load_target_layer


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

