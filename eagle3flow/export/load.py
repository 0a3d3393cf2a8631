"""Loading an exported draft directory (eagle3 or speculators format) back into an
:class:`~eagle3flow.model.draft.Eagle3Draft`, its frozen embeddings from the target
(vLLM shares the target's with the draft)."""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file

from eagle3flow.model.config import DraftConfig
from eagle3flow.model.draft import Eagle3Draft
from eagle3flow.target.weights import load_target_head


def load_exported_draft(draft_dir: str | Path, target_path: str | Path,
                        dtype: torch.dtype = torch.float32, device="cpu") -> Eagle3Draft:
    """Load an exported draft dir; embeddings come from the target (vLLM shares them)."""
    draft_dir = Path(draft_dir)
    with open(draft_dir / "config.json") as f:
        hf = json.load(f)
    weights = load_file(str(draft_dir / "model.safetensors"))
    if "speculators_model_type" in hf:
        cfg = DraftConfig.from_speculators_config(hf)
        # speculators' names: layers.0.* for the midlayer, its copy of the target's embeddings
        weights = {name.replace("layers.0.", "midlayer.", 1): w for name, w in weights.items()
                   if name != "embed_tokens.weight"}
    else:
        cfg = DraftConfig.from_hf_config(hf)
    model = Eagle3Draft(cfg)
    if "d2t" not in weights:   # same vocab: identity map
        weights["d2t"] = torch.zeros(cfg.draft_vocab_size, dtype=torch.int64)
        weights["t2d"] = torch.ones(cfg.vocab_size, dtype=torch.bool)
    weights["embed_tokens.weight"] = load_target_head(target_path, parts=("embed_tokens",))["embed_tokens"]
    missing, unexpected = model.load_state_dict(
        {k: v.to(torch.float32) if v.is_floating_point() else v for k, v in weights.items()},
        strict=False)
    if missing or unexpected:
        raise ValueError(f"{draft_dir}/model.safetensors: missing {missing}, unexpected {unexpected}")
    return model.to(device=device, dtype=dtype)
