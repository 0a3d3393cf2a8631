"""MLA's training attention (qk 192 / v 128) on one GPU: the kernels that could run it, timed and
checked, to choose the next step of issue 32 (the MLA draft at 55% of the measured matmul rate).

The trainer runs it through PyTorch's flash kernel on values padded to the query width
(eagle3flow/model/kernels/ttt_attention.py) and merges each row's TTT tail through the
kernel's logsumexp, feeding the flash backward the merged output and logsumexp. This measures,
for the causal cache part of one TTT step (fwd + bwd, ``B x T`` tokens, ``h`` heads):

* flash on values padded to 192 (today's path), cuDNN and memory-efficient attention on the
  unpadded values: milliseconds per call, median of ``--iters``;
* whether each unpadded kernel can take the merged output and logsumexp in its backward, as the
  flash one does: the gradients of the joint softmax over ``[causal cache | j tail keys]``
  against float32 autograd of the same function (max abs error, with flash's beside it).

    PYTHONPATH=$PWD python3 benchmarks/mla_attention.py --out mla_attention.json
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

aten = torch.ops.aten


def flash(q, k, v, scale):
    """Padded values; returns (forward, backward(do, out, lse)) on [B, h, T, *] tensors."""
    d, dv = q.shape[-1], v.shape[-1]
    vp = F.pad(v, (0, d - dv))
    res = aten._scaled_dot_product_flash_attention(q, k, vp, 0.0, True, False, scale=scale)
    out, lse, cu_q, cu_k, max_q, max_k, seed, offset = res[:8]

    def backward(do, out_m, lse_m):
        dq, dk, dvp = aten._scaled_dot_product_flash_attention_backward(
            F.pad(do, (0, d - dv)), q, k, vp, F.pad(out_m, (0, d - dv)), lse_m, cu_q, cu_k, max_q, max_k,
            0.0, True, seed, offset, scale=scale)
        return dq, dk, dvp[..., :dv]
    return out[..., :dv], lse, backward


def cudnn(q, k, v, scale):
    res = aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, True, False, scale=scale)
    out, lse, cu_q, cu_k, max_q, max_k, seed, offset = res[:8]

    def backward(do, out_m, lse_m):
        return aten._scaled_dot_product_cudnn_attention_backward(
            do, q, k, v, out_m, lse_m.reshape(lse.shape), seed, offset, None, cu_q, cu_k, max_q, max_k,
            0.0, True, scale=scale)
    return out, lse.reshape(lse.shape[:3]), backward


def efficient(q, k, v, scale):
    out, lse, seed, offset = aten._scaled_dot_product_efficient_attention(q, k, v, None, True, 0.0, True,
                                                                          scale=scale)
    t = q.shape[2]

    def backward(do, out_m, lse_m):
        grads = aten._scaled_dot_product_efficient_attention_backward(
            do, q, k, v, None, out_m, lse_m, seed, offset, 0.0, [True, True, True, False], True, scale=scale)
        return grads[:3]
    return out, lse[..., :t], backward


KERNELS = {"flash_padded": flash, "cudnn": cudnn, "efficient": efficient}


def joint_reference(q, k, v, kt, vt, scale):
    """float32 joint softmax over [causal cache | j tail keys]; q,k,v [B,h,T,*], kt,vt [j,B,h,T,*]."""
    t = q.shape[2]
    s = (q @ k.transpose(-1, -2)) * scale
    s = s.masked_fill(~torch.ones(t, t, dtype=torch.bool, device=q.device).tril(), float("-inf"))
    tail = (q.unsqueeze(0) * kt).sum(-1).permute(1, 2, 3, 0) * scale            # [B, h, T, j]
    p = torch.softmax(torch.cat([s, tail], -1), -1)
    return p[..., :t] @ v + (p[..., t:].permute(3, 0, 1, 2).unsqueeze(-1) * vt).sum(0)


def merged(kernel, q, k, v, kt, vt, scale, do):
    """The trainer's scheme with ``kernel`` for the cache part; returns out, dq, dk, dv, dkt, dvt."""
    out_c, lse_c, backward = kernel(q, k, v, scale)
    tail = (q.float().unsqueeze(0) * kt.float()).sum(-1) * scale                  # [j, B, h, T]
    lse = torch.logsumexp(torch.cat([lse_c.float().unsqueeze(0), tail]), 0)       # [B, h, T]
    w_c = torch.exp(lse_c.float() - lse).unsqueeze(-1)
    p_t = torch.exp(tail - lse).unsqueeze(-1)                                     # [j, B, h, T, 1]
    out = (w_c * out_c.float() + (p_t * vt.float()).sum(0)).to(q.dtype)
    dq, dk, dv = backward(do, out, lse.contiguous())
    # the tail's share: dS_i = P_i (dO.v_i - D), D = rowsum(dO * O)
    dof = do.float()
    big_d = (dof * out.float()).sum(-1)
    ds = p_t.squeeze(-1) * ((dof.unsqueeze(0) * vt.float()).sum(-1) - big_d)     # [j, B, h, T]
    dq = dq.float() + (ds.unsqueeze(-1) * kt.float()).sum(0) * scale
    dkt = ds.unsqueeze(-1) * q.float().unsqueeze(0) * scale
    dvt = p_t * dof.unsqueeze(0)
    return out, dq, dk, dv, dkt, dvt


def check(kernel, b, h, t, d, dv, j, device):
    torch.manual_seed(0)
    mk = lambda *s: torch.randn(*s, device=device, dtype=torch.bfloat16)         # noqa: E731
    q, k, v, do = mk(b, h, t, d), mk(b, h, t, d), mk(b, h, t, dv), mk(b, h, t, dv)
    kt, vt = mk(j, b, h, t, d), mk(j, b, h, t, dv)
    scale = d ** -0.5
    got = merged(kernel, q, k, v, kt, vt, scale, do)
    ref_in = [x.float().requires_grad_() for x in (q, k, v, kt, vt)]
    ref = joint_reference(*ref_in, scale)
    ref.backward(do.float())
    want = [ref.detach()] + [x.grad for x in ref_in]
    names = ["out", "dq", "dk", "dv", "dk_tail", "dv_tail"]
    return {n: float((g.float() - w).abs().max()) for n, g, w in zip(names, got, want)}


def time_ms(fn, iters):
    times = []
    for _ in range(iters + 2):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times[2:])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--heads", type=int, default=64)
    ap.add_argument("--qk-dim", type=int, default=192)
    ap.add_argument("--v-dim", type=int, default=128)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("mla_attention: needs a CUDA GPU")
    dev = "cuda"
    b, h, t, d, dv = args.batch, args.heads, args.tokens, args.qk_dim, args.v_dim
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "shape": {"batch": b, "tokens": t, "heads": h, "qk_dim": d, "v_dim": dv}, "kernels": {}}
    mk = lambda *s: torch.randn(*s, device=dev, dtype=torch.bfloat16)            # noqa: E731
    q, k, v, do = mk(b, h, t, d), mk(b, h, t, d), mk(b, h, t, dv), mk(b, h, t, dv)
    scale = d ** -0.5
    for name, kernel in KERNELS.items():
        row = result["kernels"][name] = {}
        try:
            row["check_vs_float32"] = check(kernel, 1, 4, 256, d, dv, 2, dev)
            out, lse, backward = kernel(q, k, v, scale)
            row["lse_shape"] = list(lse.shape)
            row["forward_ms"] = time_ms(lambda: kernel(q, k, v, scale), args.iters)
            row["forward_backward_ms"] = time_ms(lambda: kernel(q, k, v, scale)[2](do, out, lse), args.iters)
        except Exception as e:                   # one kernel failing keeps the others' numbers
            row["error"] = f"{type(e).__name__}: {e}"[:500]
        print(f"mla_attention: {name}: {row}", flush=True)
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
