"""The training step's Triton kernels (soft cross-entropy, TTT tail attention), run by
Triton's CPU interpreter (no GPU needed) against the plain torch math they replace."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

CHECK = r"""
import torch
from eagle3flow.model.kernels.soft_cross_entropy import _TritonSoftCE, soft_cross_entropy_reference

torch.manual_seed(0)
for vocab in (1000, 4096, 5000):          # under, at and over one 4096-column block
    teacher = (torch.randn(12, vocab) * 3).to(torch.bfloat16)
    lse = torch.logsumexp(teacher.float(), -1)
    argmax = teacher.float().argmax(-1)
    target = torch.randint(0, 12, (7,))
    logits = (torch.randn(7, vocab) * 3).to(torch.bfloat16)
    logits[:2] = teacher[target[:2]]
    fast = logits.clone().requires_grad_()
    ref = logits.double().requires_grad_()
    loss, correct = _TritonSoftCE.apply(fast, teacher, lse, target, argmax, 0.3)
    ref_loss, ref_correct = soft_cross_entropy_reference(ref, teacher.double(), lse.double(), target, argmax, 0.3)
    (loss * 2).backward()
    (ref_loss * 2).backward()
    err = float((fast.grad.double() - ref.grad).norm() / ref.grad.norm())
    assert int(correct) == int(ref_correct) >= 2, (vocab, int(correct), int(ref_correct))
    assert abs(float(loss) - float(ref_loss)) < 1e-4 * abs(float(ref_loss)), (vocab, float(loss), float(ref_loss))
    assert err < 1e-2, (vocab, err)

# the teacher's per-row logsumexp and argmax (one block, several blocks, a tie)
from eagle3flow.model.kernels.soft_cross_entropy import row_logsumexp_argmax
import eagle3flow.model.kernels.soft_cross_entropy as sce
for vocab in (1000, 9000):
    x = (torch.randn(5, vocab) * 3).to(torch.bfloat16)
    x[1, 10] = x[1, 4100 % vocab] = x[1].max() + 1
    lse, idx = torch.empty(5), torch.empty(5, dtype=torch.int64)
    sce._row_lse_argmax_kernel[(5,)](x, x.stride(0), lse, idx, vocab, BLOCK=4096)
    assert torch.allclose(lse, torch.logsumexp(x.float(), -1), atol=1e-4), vocab
    assert torch.equal(idx, x.float().argmax(-1)) and int(idx[1]) == 10, (vocab, idx.tolist())

# the fused lm_head + soft cross-entropy, in two chunks of rows
from eagle3flow.model.kernels.soft_cross_entropy import _TritonLinearSoftCE, linear_soft_cross_entropy
x = torch.randn(9, 16)
w = torch.randn(5000, 16) * 0.5
teacher = (torch.randn(12, 5000) * 3).to(torch.bfloat16)
lse = torch.logsumexp(teacher.float(), -1)
argmax = teacher.float().argmax(-1)
target = torch.randint(0, 12, (9,))
scale = torch.rand(9)
xf, wf, xr, wr = (t.clone().requires_grad_() for t in (x, w, x, w))
loss, ce, hits = _TritonLinearSoftCE.apply(xf, wf, teacher, lse, target, argmax, scale, 5 * 5000)
ref_loss, ref_ce, ref_hits = linear_soft_cross_entropy(xr, wr, teacher, lse, target, argmax, scale)
(loss * 2).backward()
(ref_loss * 2).backward()
assert torch.allclose(ce, ref_ce, rtol=1e-4, atol=1e-4) and torch.equal(hits, ref_hits)
for a, b in ((xf.grad, xr.grad), (wf.grad, wr.grad)):
    assert float((a - b).norm() / b.norm()) < 1e-4

# the TTT tail merge and its backward: GQA groups of 3 with head_dim not a power of two,
# one query head per kv head, kv heads split over several programs (small tiles), and values
# narrower than queries and keys (MLA: qk 192 / v 128 in the draft)
from eagle3flow.model.kernels import ttt_attention as ta
for (b, t, h, g, d, dv, j, tile) in ((2, 5, 6, 2, 12, 12, 3, 4096), (1, 4, 4, 4, 8, 8, 2, 4096),
                                     (1, 3, 9, 3, 8, 8, 2, 16), (1, 4, 4, 4, 12, 8, 3, 4096)):
    ta.TAIL_TILE_ELEMENTS = tile
    q, out_c = torch.randn(b, t, h, d), torch.randn(b, t, h, dv)
    lse_c = torch.randn(b, t, h)
    k_tail, v_tail = torch.randn(j, b, t, g, d), torch.randn(j, b, t, g, dv)
    out, lse = ta.tail_merge_triton(q, out_c, lse_c, k_tail, v_tail, 0.3)
    ref_out, ref_lse = ta.tail_merge_torch(q, out_c, lse_c, k_tail, v_tail, 0.3)
    assert torch.allclose(out, ref_out, atol=1e-5) and torch.allclose(lse, ref_lse, atol=1e-5), (h, g)
    do, dq = torch.randn(b, t, h, dv), torch.randn(b, t, h, d)
    want = ta.tail_backward_torch(q, do, out, lse, k_tail, v_tail, dq, 0.3)
    for got, ref in zip(ta.tail_backward_triton(q, do, out, lse, k_tail, v_tail, dq.clone(), 0.3), want):
        assert torch.allclose(got, ref, atol=1e-5), (h, g, float((got - ref).abs().max()))
print("ok")
"""


def test_triton_kernel_matches_reference_in_interpreter():
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(root)}
    result = subprocess.run([sys.executable, "-c", CHECK], env=env, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0 and result.stdout.strip().endswith("ok"), result.stderr[-3000:]
