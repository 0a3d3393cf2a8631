"""The TTT tail-attention Triton kernels (eagle3flow/model/kernels/ttt_attention.py): time per training step
for each tile size and warp count, checked against the torch math on the same GPU.

One training step of the 8B-shaped setting calls the tail merge and its backward once per
TTT step ``j = 1..6`` (``j`` tail keys); the times are their sum. ``--baseline FILE`` also
times another version of the module (e.g. an older commit's ``ttt_attention.py``) on the
same tensors.

    PYTHONPATH=$PWD python3 benchmarks/tail_kernels.py --out tail.json
    git show 4b33139:eagle3flow/model/kernels/ttt_attention.py > /tmp/old.py
    PYTHONPATH=$PWD python3 benchmarks/tail_kernels.py --baseline /tmp/old.py --out tail.json
"""
from __future__ import annotations

import argparse
import importlib.util
import json
from pathlib import Path

import torch

from eagle3flow.model.kernels import ttt_attention as ta

# name: (B, T, heads, kv heads, head_dim, tail lengths j)
SHAPES = {"llama8b": (4, 2048, 32, 8, 128, range(1, 7)), "kimi": (1, 4096, 64, 64, 128, [6])}


def cuda_ms(fn, reps: int = 20) -> float:
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / reps


def tensors(b, t, h, g, d, js):
    torch.manual_seed(0)
    bf = dict(device="cuda", dtype=torch.bfloat16)
    x = {name: torch.randn(b, t, h, d, **bf) for name in ("q", "out_c", "do", "dq")}
    x["lse_c"] = torch.randn(b, t, h, device="cuda") + 5
    x["tails"] = {j: (torch.randn(j, b, t, g, d, **bf), torch.randn(j, b, t, g, d, **bf)) for j in js}
    return x


def step_fns(module, x, scale: float = 0.088):
    """Forward and backward of one training step's tail calls (the backward gets a fresh
    ``dq`` each call, as after the flash backward)."""
    def forward():
        for k, v in x["tails"].values():
            module.tail_merge_triton(x["q"], x["out_c"], x["lse_c"], k, v, scale)

    def backward():
        for k, v in x["tails"].values():
            module.tail_backward_triton(x["q"], x["do"], x["out_c"], x["lse_c"], k, v, x["dq"].clone(), scale)
    return forward, backward


def max_error(x, scale: float = 0.088) -> float:
    errors = []
    for k, v in x["tails"].values():
        out, lse = ta.tail_merge_triton(x["q"], x["out_c"], x["lse_c"], k, v, scale)
        ref_out, ref_lse = ta.tail_merge_torch(x["q"], x["out_c"], x["lse_c"], k, v, scale)
        errors += [float((out.float() - ref_out.float()).abs().max()), float((lse - ref_lse).abs().max())]
        got = ta.tail_backward_triton(x["q"], x["do"], ref_out, ref_lse, k, v, x["dq"].clone(), scale)
        want = ta.tail_backward_torch(x["q"], x["do"], ref_out, ref_lse, k, v, x["dq"].clone(), scale)
        errors += [float((a.float() - b.float()).abs().max()) for a, b in zip(got, want)]
    return max(errors)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--baseline", type=Path, help="another ttt_attention.py to time on the same tensors")
    ap.add_argument("--tiles", default="1024,2048,4096,8192")
    ap.add_argument("--warps", default="1,2,4,8")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    baseline = None
    if args.baseline:
        spec = importlib.util.spec_from_file_location("ttt_attention_baseline", args.baseline)
        baseline = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(baseline)
    chosen = (ta.TAIL_TILE_ELEMENTS, ta.TAIL_NUM_WARPS)
    report = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "chosen": {"tile_elements": chosen[0], "num_warps": chosen[1]}, "cases": {}}
    for name, shape in SHAPES.items():
        x = tensors(*shape)
        case = {"max_abs_error_vs_torch": max_error(x)}
        if baseline is not None:
            case["baseline_ms"] = dict(zip(("forward", "backward"), map(cuda_ms, step_fns(baseline, x))))
        for tile in map(int, args.tiles.split(",")):
            for warps in map(int, args.warps.split(",")):
                ta.TAIL_TILE_ELEMENTS, ta.TAIL_NUM_WARPS = tile, warps
                case[f"tile{tile}_warps{warps}_ms"] = dict(zip(("forward", "backward"),
                                                               map(cuda_ms, step_fns(ta, x))))
        ta.TAIL_TILE_ELEMENTS, ta.TAIL_NUM_WARPS = chosen
        report["cases"][name] = case
        print(name, json.dumps(case), flush=True)
    if args.out:
        args.out.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
