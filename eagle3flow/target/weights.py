"""The few target tensors the draft needs, read by name: embeddings, final norm, lm_head.

Never loads the whole target: with a sharded checkpoint (Kimi-K2.5: 64+ files) only
the shards named for these tensors in ``model.safetensors.index.json`` are opened,
and only those tensors are read. Handles tied embeddings (no lm_head -> the
embeddings), the name prefixes of plain (``model.embed_tokens.weight``) and
multimodal (``model.language_model.*``, ``language_model.model.*``) checkpoints, and
quantized ones (INT4 compressed-tensors, as Kimi-K2.5 ships): their experts are
stored as ``*.weight_packed`` + scales, but embeddings, norms and lm_head stay bf16
under their plain names, which is what is read here. A quantized head is refused
with a message naming it.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from eagle3flow.target.config import load_target_config

PREFIXES = ("model.", "model.language_model.", "language_model.model.", "language_model.", "")
CANDIDATES = {
    "embed_tokens": [p + "embed_tokens.weight" for p in PREFIXES],
    "norm": [p + "norm.weight" for p in PREFIXES],
    "lm_head": ["lm_head.weight", "language_model.lm_head.weight", "model.lm_head.weight",
                "model.language_model.lm_head.weight"],
}


def tensor_locations(path: str | Path) -> dict[str, Path]:
    """Tensor name -> the safetensors file holding it (reads headers only)."""
    path = Path(path)
    index = path / "model.safetensors.index.json"
    if index.is_file():
        with open(index) as f:
            weight_map = json.load(f)["weight_map"]
        return {name: path / file for name, file in weight_map.items()}
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{path}: no model.safetensors.index.json and no *.safetensors files")
    locations = {}
    for file in files:
        with safe_open(str(file), "pt") as f:
            locations.update({name: file for name in f.keys()})
    return locations


def _find(locations: dict[str, Path], part: str) -> str | None:
    for name in CANDIDATES[part]:
        if name in locations:
            return name
    return None


def load_target_head(path: str | Path, parts=("embed_tokens", "norm", "lm_head"),
                     dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """``{"embed_tokens": [Vt, H], "norm": [H], "lm_head": [Vt, H]}`` (the requested parts).

    ``lm_head`` falls back to the embeddings when the checkpoint has none (tied).
    """
    path = Path(path)
    locations = tensor_locations(path)
    config = load_target_config(path)
    names = {}
    for part in parts:
        name = _find(locations, part)
        if name is None:
            packed = [c.removesuffix(".weight") + ".weight_packed" for c in CANDIDATES[part]]
            found = [c for c in packed if c in locations]
            if found:
                raise ValueError(f"{path}: {found[0]} is quantized (compressed-tensors); the draft needs "
                                 f"{part} in a float dtype (keep it in the quantization's ignore list)")
        if name is None and part == "lm_head":
            name = _find(locations, "embed_tokens")
            if name is not None and config.get("tie_word_embeddings") is False:
                raise ValueError(f"{path}: config says tie_word_embeddings=false but no lm_head "
                                 f"tensor found (looked for {CANDIDATES['lm_head']})")
        if name is None:
            raise KeyError(f"{path}: no tensor for {part} (looked for {CANDIDATES[part]})")
        names[part] = name
    out = {}
    by_file: dict[Path, list[str]] = {}
    for part, name in names.items():
        by_file.setdefault(locations[name], []).append(part)
    for file, parts_here in by_file.items():     # each needed file opened once, no other file
        with safe_open(str(file), "pt") as f:
            for part in parts_here:
                tensor = f.get_tensor(names[part])
                if not tensor.is_floating_point():
                    raise ValueError(f"{file}: {names[part]} has dtype {tensor.dtype}; {part} must be "
                                     f"a float tensor (bf16/fp16/fp32)")
                out[part] = tensor.to(dtype) if dtype is not None else tensor
    return out


def target_dtype(path: str | Path) -> str:
    """The target's stored floating dtype name, from its config (``float32``, ``bfloat16``...)."""
    config = load_target_config(path)
    name = config.get("torch_dtype") or config.get("dtype") or "bfloat16"
    return str(name).replace("torch.", "")
