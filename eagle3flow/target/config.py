"""The target's ``config.json``, as every stage reads it: one reader, one precedence.

A multimodal wrapper (Kimi-K2.5: ``KimiK25ForConditionalGeneration``) nests its
language model's config under ``text_config``; the draft, the extraction, the vocab
map and the plan all describe that language model. So its ``text_config`` keys win,
and the outer config fills only what the text config lacks (dtype, tied embeddings),
never with the keys that name the wrapper itself (its class, its model type, its
other towers). A plain causal LM's config is its own text config. No torch: the
planner (eagle3flow/ops/plan.py) reads it too.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

# Outer keys that describe the wrapper, not its language model.
WRAPPER_KEYS = ("architectures", "model_type", "auto_map", "text_config", "vision_config")


def read_config_file(target_path: str | os.PathLike) -> dict:
    """The target directory's ``config.json`` as written (the outer config of a wrapper)."""
    path = Path(target_path) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path}: the target has no config.json")
    with open(path) as f:
        return json.load(f)


def text_config(config: dict) -> dict:
    """The language model's config of a ``config.json`` dict: ``text_config`` when nested,
    with the outer keys it lacks (except :data:`WRAPPER_KEYS`); else ``config`` itself."""
    text = config.get("text_config")
    if not isinstance(text, dict):
        return dict(config)
    outer = {k: v for k, v in config.items() if k not in WRAPPER_KEYS and k not in text}
    return {**text, **outer}


def load_target_config(target_path: str | os.PathLike) -> dict:
    """The target's language-model config (:func:`text_config` of its ``config.json``)."""
    return text_config(read_config_file(target_path))
