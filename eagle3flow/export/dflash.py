"""Export a trained DFlash draft in the layout vLLM loads (``speculative_config``
``{"method": "dflash", "model": out_dir, "num_speculative_tokens": block_size - 1}``).

``out_dir/config.json``: :meth:`DFlashConfig.to_hf_config` (``DFlashDraftModel``, a Qwen3
layer shape, ``block_size``, ``dflash_config`` with ``mask_token_id`` and the target layer
ids as vLLM names them). ``out_dir/model.safetensors``: ``fc``, ``hidden_norm``,
``layers.<i>.*`` and ``norm`` by the names ``qwen3_dflash.py`` maps, in the target's
dtype (float32 stays float32, anything else becomes bfloat16). No ``embed_tokens`` and
no ``lm_head``: vLLM then shares the target's, which the draft was trained on.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from eagle3flow.atomic import replacing, write_json
from eagle3flow.model.dflash import DFlashDraft
from eagle3flow.model.dflash_config import DFlashConfig
from eagle3flow.target.weights import target_dtype
from eagle3flow.train.dflash_train import build_dflash_draft, read_train_config


def export_dflash(train_dir: str | Path, target_path: str | Path, out_dir: str | Path) -> Path:
    """Write ``config.json`` + ``model.safetensors`` of the draft in ``train_dir``; returns ``out_dir``."""
    train_dir, out_dir = Path(train_dir), Path(out_dir)
    cfg = read_train_config(train_dir)
    weights = load_file(str(train_dir / "draft.safetensors"))
    names = cfg.exported_param_names()
    missing = [n for n in names if n not in weights]
    if missing:
        raise ValueError(f"{train_dir}/draft.safetensors: missing tensors {missing}")
    dtype_name = "float32" if target_dtype(target_path) == "float32" else "bfloat16"
    cfg.torch_dtype = dtype_name
    tensors = {name: weights[name].to(getattr(torch, dtype_name)).contiguous() for name in names}
    out_dir.mkdir(parents=True, exist_ok=True)
    with replacing(out_dir / "model.safetensors") as tmp:
        save_file(tensors, str(tmp), metadata={"format": "pt"})
    write_json(out_dir / "config.json", cfg.to_hf_config())
    return out_dir


def load_exported_dflash(draft_dir: str | Path, target_path: str | Path,
                         dtype: torch.dtype = torch.float32) -> DFlashDraft:
    """An exported draft dir back as a :class:`DFlashDraft`, its embeddings and lm_head
    from the target (as vLLM shares them)."""
    draft_dir = Path(draft_dir)
    cfg = DFlashConfig.from_hf_config(json.loads((draft_dir / "config.json").read_text()))
    model = build_dflash_draft(target_path, cfg, seed=0)
    weights = {k: v.float() for k, v in load_file(str(draft_dir / "model.safetensors")).items()}
    missing, unexpected = model.load_state_dict(weights, strict=False)
    missing = [m for m in missing if m not in DFlashDraft.FROZEN]
    if missing or unexpected:
        raise ValueError(f"{draft_dir}/model.safetensors: missing {missing}, unexpected {unexpected}")
    return model.to(dtype).eval()


def main(argv=None) -> None:
    """CLI: ``python -m eagle3flow.export.dflash --train-dir DIR --target DIR --out-dir DIR``."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--train-dir", required=True, help="holds draft.safetensors + draft_config.json (the DFlash trainer's)")
    parser.add_argument("--target", required=True, help="target model dir (its dtype decides the export dtype)")
    parser.add_argument("--out-dir", required=True)
    args = parser.parse_args(argv)
    export_dflash(args.train_dir, args.target, args.out_dir)


if __name__ == "__main__":
    main()
