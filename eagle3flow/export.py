"""Export the trained draft as the EAGLE-3 checkpoint vLLM and SGLang load as-is.

``out_dir/config.json``: a one-layer ``LlamaForCausalLMEagle3`` config (see
:meth:`DraftConfig.to_hf_config`). ``out_dir/model.safetensors``: ``midlayer.*``,
``fc.weight``, ``norm.weight``, ``lm_head.weight`` in the target's dtype (float32
stays float32, anything else becomes bfloat16), plus ``d2t`` int64 ``[Vd]`` and
``t2d`` bool ``[Vt]``. ``embed_tokens`` is not exported: vLLM shares the target's.
When the draft vocab is the full target vocab, ``d2t``/``t2d`` are left out (vLLM
has no mapping parameter then and would reject them).
"""
from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from eagle3flow.draft_model import DraftConfig, exported_param_names
from eagle3flow.shards import atomic_write_json
from eagle3flow.target_weights import target_dtype
from eagle3flow.train import load_vocab_map


def export_draft(train_dir: str | Path, vocab_map: str | Path, target_path: str | Path,
                 out_dir: str | Path) -> Path:
    """Write ``config.json`` + ``model.safetensors`` into ``out_dir``; returns ``out_dir``."""
    train_dir, out_dir = Path(train_dir), Path(out_dir)
    with open(train_dir / "draft_config.json") as f:
        cfg = DraftConfig.from_dict(json.load(f))
    weights = load_file(str(train_dir / "draft.safetensors"))
    names = exported_param_names(cfg)
    missing = [n for n in names + ("d2t", "t2d") if n not in weights]
    if missing:
        raise ValueError(f"{train_dir}/draft.safetensors: missing tensors {missing}")
    d2t, t2d = load_vocab_map(vocab_map)
    if not (torch.equal(d2t, weights["d2t"]) and torch.equal(t2d, weights["t2d"])):
        raise ValueError(f"{vocab_map} is not the vocab map {train_dir} was trained with")
    dtype_name = "float32" if target_dtype(target_path) == "float32" else "bfloat16"
    dtype = getattr(torch, dtype_name)
    cfg.torch_dtype = dtype_name
    tensors = {name: weights[name].to(dtype).contiguous() for name in names}
    if cfg.draft_vocab_size != cfg.vocab_size:
        tensors["d2t"] = d2t.contiguous()
        tensors["t2d"] = t2d.contiguous()
    out_dir.mkdir(parents=True, exist_ok=True)
    tmp = out_dir / f".model.safetensors.tmp-{os.getpid()}"
    save_file(tensors, str(tmp), metadata={"format": "pt"})
    os.replace(tmp, out_dir / "model.safetensors")
    atomic_write_json(out_dir / "config.json", cfg.to_hf_config())
    return out_dir


def main(argv=None) -> None:
    """CLI: ``python -m eagle3flow.export --train-dir results/train --vocab-map ... --target DIR --out-dir results/draft``."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--train-dir", required=True, help="holds draft.safetensors + draft_config.json")
    parser.add_argument("--vocab-map", required=True)
    parser.add_argument("--target", required=True, help="target model dir (its dtype decides the export dtype)")
    parser.add_argument("--out-dir", required=True)
    args = parser.parse_args(argv)
    export_draft(args.train_dir, args.vocab_map, args.target, args.out_dir)


if __name__ == "__main__":
    main()
