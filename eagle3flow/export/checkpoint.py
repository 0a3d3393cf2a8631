"""Export the trained draft as the EAGLE-3 checkpoint vLLM and SGLang load as-is
(``export.formats``: also in the speculators format, which vLLM loads natively).

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
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from eagle3flow.atomic import replacing, write_json
from eagle3flow.config import EXPORT_BORROWED, cli_settings
from eagle3flow.model.config import DraftConfig, exported_param_names
from eagle3flow.export.sglang_contract import sglang_problems
from eagle3flow.target.config import load_target_config, read_config_file
from eagle3flow.target.weights import target_dtype
from eagle3flow.train.build import load_vocab_map


FORMATS = ("eagle3", "speculators")


def export_draft(train_dir: str | Path, vocab_map: str | Path, target_path: str | Path,
                 out_dir: str | Path, fmt: str = "eagle3", speculative_tokens: int = 3) -> Path:
    """Write ``config.json`` + ``model.safetensors`` into ``out_dir`` in format ``fmt``
    (``eagle3``: the EAGLE-3 layout vLLM and SGLang load; ``speculators``: the speculators
    format, with the verifier's path and ``speculative_tokens`` for ``vllm serve <draft>``);
    returns ``out_dir``."""
    if fmt not in FORMATS:
        raise ValueError(f"export format {fmt!r} is not one of {FORMATS}")
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
    if fmt == "speculators":
        # the verifier vLLM loads is the whole target: the wrapper's architectures, not its text model's
        verifier_architectures = read_config_file(target_path).get("architectures") or []
        config = cfg.to_speculators_config(str(Path(target_path).resolve()), verifier_architectures,
                                           speculative_tokens)
        tensors = {name.replace("midlayer.", "layers.0.", 1): t for name, t in tensors.items()}
    else:
        config = cfg.to_hf_config()
    out_dir.mkdir(parents=True, exist_ok=True)
    with replacing(out_dir / "model.safetensors") as tmp:
        save_file(tensors, str(tmp), metadata={"format": "pt"})
    write_json(out_dir / "config.json", config)
    if fmt == "eagle3":
        for problem in sglang_problems(config, set(tensors), load_target_config(target_path)):
            print(f"export: SGLang would not serve {out_dir} as trained: {problem}", file=sys.stderr)
    return out_dir


def main(argv=None) -> None:
    """CLI: ``python -m eagle3flow.export.checkpoint --train-dir results/train --vocab-map ... --target DIR
    --out-dir results/draft [--config-json '{"speculative_tokens": 3}']`` (the export section, and
    evaluate.num_speculative_tokens as speculative_tokens)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--train-dir", required=True, help="holds draft.safetensors + draft_config.json")
    parser.add_argument("--vocab-map", required=True)
    parser.add_argument("--target", required=True, help="target model dir (its dtype decides the export dtype)")
    parser.add_argument("--out-dir", action="extend", nargs="+", required=True, metavar="[FORMAT=]DIR",
                        help=f"where each format goes ({', '.join(FORMATS)}; eagle3 when no FORMAT=)")
    parser.add_argument("--config-json", default="{}",
                        help="the export section; speculative_tokens: the K `vllm serve <draft>` uses (speculators format)")
    args = parser.parse_args(argv)
    settings = cli_settings(parser, "export", args.config_json, borrowed=EXPORT_BORROWED)
    for item in args.out_dir:
        fmt, _, path = item.rpartition("=")
        export_draft(args.train_dir, args.vocab_map, args.target, path, fmt or "eagle3",
                     settings["speculative_tokens"])


if __name__ == "__main__":
    main()
