"""The target's ``config.json``, as every stage reads it: one reader, one precedence.

A multimodal wrapper (Kimi-K2.5: ``KimiK25ForConditionalGeneration``) nests its
language model's config under ``text_config``; the draft, the extraction, the vocab
map and the plan all describe that language model. So its ``text_config`` keys win,
and the outer config fills only what the text config lacks of its dtype and tied
embeddings, never the keys that name the wrapper itself (its class, its model type,
its other towers). A plain causal LM's config is its own text config. No torch: the
planner (eagle3flow/ops/plan/) reads it too.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

# What a wrapper's outer config may give its language model: how its weights are stored
# and whether its head is tied. Nothing else, so that the view (and the training cache
# key built from it) stays what it was before this reader was the only one.
OUTER_FILL_KEYS = ("torch_dtype", "dtype", "tie_word_embeddings")


def read_config_file(target_path: str | os.PathLike) -> dict:
    """The target directory's ``config.json`` as written (the outer config of a wrapper)."""
    path = Path(target_path) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path}: the target has no config.json")
    with open(path) as f:
        return json.load(f)


def is_wrapper(config: dict) -> bool:
    """Whether a ``config.json`` dict is a wrapper's: its language model nested under ``text_config``."""
    return isinstance(config.get("text_config"), dict)


def text_config(config: dict) -> dict:
    """The language model's config of a ``config.json`` dict: ``text_config`` when nested,
    with the :data:`OUTER_FILL_KEYS` it lacks taken from the outer config; else ``config``."""
    text = config.get("text_config")
    if not isinstance(text, dict):
        return dict(config)
    outer = {k: config[k] for k in OUTER_FILL_KEYS if k in config and k not in text}
    return {**text, **outer}


def load_target_config(target_path: str | os.PathLike) -> dict:
    """The target's language-model config (:func:`text_config` of its ``config.json``)."""
    return text_config(read_config_file(target_path))
