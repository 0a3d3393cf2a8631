"""speculators' offline hidden states written on a GPU machine that has no vLLM.

speculators 0.9 reads its training data as ``<prepared>/hidden_states/hs_<i>.safetensors``
beside the dataset its ``prepare-data`` wrote: ``hidden_states [T, L, H]`` (the aux layers
in order, then the last layer *before* the final norm: its model applies the verifier's
norm itself) and ``token_ids [T]`` for row ``i``. On the CPU (run.py) a vLLM server running
``extract_hidden_states`` writes them; here the target runs in transformers, with the aux
layers taken as the project's extraction takes them (each aux id's layer input, vLLM's
``hidden_states + residual``), so both trainers learn from the same states of the same
target in the same dtype.

    python benchmarks/quality/speculators_gpu_data.py --target W/target --prepared W/prepared \\
        --layer-ids 2 15 27 --dtype bfloat16
"""
from __future__ import annotations

import argparse
import sys
import time
from functools import partial
from pathlib import Path

import torch
from datasets import load_from_disk
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM


def _keep_input(store: dict, key, module, args, kwargs):
    store[key] = (args[0] if args else kwargs["hidden_states"]).detach()


@torch.no_grad()
def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", type=Path, required=True)
    parser.add_argument("--prepared", type=Path, required=True, help="speculators prepare-data's output")
    parser.add_argument("--layer-ids", type=int, nargs="+", required=True, help="the aux layer ids")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    args = parser.parse_args(argv)
    dtype = getattr(torch, args.dtype)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = AutoModelForCausalLM.from_pretrained(args.target, dtype=dtype).to(device).eval()
    base = model.model
    store: dict = {}
    for k in args.layer_ids:
        base.layers[k].register_forward_pre_hook(partial(_keep_input, store, k), with_kwargs=True)
    base.norm.register_forward_pre_hook(partial(_keep_input, store, "last"), with_kwargs=True)
    rows = load_from_disk(str(args.prepared)).with_format("torch")
    out = args.prepared / "hidden_states"
    out.mkdir(exist_ok=True)
    t0, tokens = time.monotonic(), 0
    for i in range(len(rows)):
        ids = rows[i]["input_ids"].long()
        store.clear()
        base(input_ids=ids[None].to(device))
        states = torch.stack([store[k][0] for k in args.layer_ids] + [store["last"][0]], dim=1)
        save_file({"hidden_states": states.to("cpu", dtype).contiguous(), "token_ids": ids.contiguous()},
                  str(out / f"hs_{i}.safetensors"))
        tokens += ids.numel()
        if (i + 1) % 200 == 0 or i + 1 == len(rows):
            print(f"speculators data: {i + 1}/{len(rows)} rows, {tokens:,} tokens, "
                  f"{tokens / (time.monotonic() - t0):,.0f} tokens/s", file=sys.stderr, flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
