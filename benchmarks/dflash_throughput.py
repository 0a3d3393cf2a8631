"""Training throughput of the DFlash draft: tokens/s, MFU by its counted FLOPs, peak memory.

One step = ``eagle3flow.train.dflash_loss.dflash_loss`` (context projection of every row,
one block of ``block_size`` slots per sampled anchor through the draft layers, the frozen
target lm_head on the masked slots, position-weighted cross-entropy) + backward +
grad-norm clipping + AdamW, as eagle3flow/train/dflash_train.py runs it, on one GPU under
bf16 autocast (fp32 master weights). Weights and data are random and built on the device.

Two rates, each with its denominator:

* ``context_tokens_per_s``: packed rows of hidden states consumed per second (what the
  extraction writes and a run reads: comparable with the EAGLE-3 benchmark's tokens/s);
* ``block_slots_per_s``: anchors x block_size slots trained per second (the DFlash
  analogue of EAGLE-3's rows x TTT steps).

FLOPs: counted, not modelled: ``torch.utils.flop_counter.FlopCounterMode`` over one whole
step (forward and backward; matmuls and the attention's einsums), so MFU needs no
per-architecture formula. MFU = counted FLOPs / mean step time / the bf16 matmul rate
measured in the same run (eagle3flow.model.flops.PeakFlops), and the H200's datasheet
dense bf16 peak beside it.

Settings (the DFlash paper's default for Qwen3-8B: 5 draft layers, blocks of 16):

* ``llama8b``: a Llama-3.1-8B target, 4 x 2048 packed tokens, ``--anchors`` per sample;
* ``kimi``: the Kimi-K2.5 shape (H 7168, 64 heads, v_head_dim 128: an MLA target gets a
  GQA draft, see eagle3flow/model/dflash_config.py), 1 x 4096 tokens.

    PYTHONPATH=$PWD python3 benchmarks/dflash_throughput.py --out results.json
    PYTHONPATH=$PWD python3 benchmarks/dflash_throughput.py --quick   # CPU smoke run
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from torch.utils.flop_counter import FlopCounterMode

sys.path.insert(0, str(Path(__file__).resolve().parent))
from train_throughput import KIMI_K25, LLAMA_8B, TINY, chat_mask  # noqa: E402

from eagle3flow.model.dflash import DFlashDraft  # noqa: E402
from eagle3flow.model.dflash_config import DFlashConfig, default_loss_gamma  # noqa: E402
from eagle3flow.model.flops import OVER_PEAK, PeakFlops  # noqa: E402
from eagle3flow.train.dflash_loss import dflash_loss, sample_anchors  # noqa: E402

SETTINGS = {"llama8b": LLAMA_8B, "kimi": KIMI_K25}     # Kimi's YaRN rope as the draft serves it


def build(target: dict, draft_layers: int, block_size: int, device: torch.device) -> DFlashDraft:
    cfg = DFlashConfig.from_target_config(target, block_size, mask_token_id=1, num_hidden_layers=draft_layers)
    torch.manual_seed(0)
    with torch.device(device):
        model = DFlashDraft(cfg).to(device)       # the llama3 rope's inverse frequencies are built on the CPU
    with torch.no_grad():
        model.embed_tokens.weight.normal_(std=0.02)
        model.lm_head.weight.normal_(std=0.02)
    return model.train()


def make_batch(cfg: DFlashConfig, samples: int, sample_tokens: int, anchors_per_sample: int,
               device: torch.device) -> tuple[dict, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    lengths = [sample_tokens] * samples
    n = sum(lengths)
    cu = torch.tensor([0] + lengths, dtype=torch.int64).cumsum(0)
    loss_mask = torch.cat([chat_mask(length, g) for length in lengths])
    anchors = sample_anchors(cu, loss_mask, anchors_per_sample, g)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    batch = {"input_ids": torch.randint(0, cfg.vocab_size, (n,), generator=g).to(device),
             "loss_mask": loss_mask.to(device), "cu_seqlens": cu.to(device),
             "aux": torch.randn(n, cfg.num_aux * cfg.target_hidden_size, device=device).to(dtype)}
    return batch, anchors.to(device)


def run_case(model: DFlashDraft, batch: dict, anchors: torch.Tensor, warmup: int, iters: int,
             device: torch.device) -> dict:
    cfg = model.config
    cuda = device.type == "cuda"
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-5, fused=cuda)
    gamma = default_loss_gamma(cfg.block_size)

    def step():
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=cuda):
            loss, _ = dflash_loss(model, batch, anchors, gamma)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        return loss

    with FlopCounterMode(display=False) as counter:
        step()
    flops = counter.get_total_flops()
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    for _ in range(warmup):
        step()
    sync()
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        loss = step()
        sync()        # dflash_loss syncs on its stats anyway (a host read per step)
        times.append(time.perf_counter() - t0)
    mean = sum(times) / len(times)
    result = {"step_s_mean": mean, "step_s_median": statistics.median(times), "step_s_min": min(times),
              "loss": float(loss), "flops_per_step": flops}
    if cuda:
        result["peak_memory_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
    del optimizer
    return result


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--settings", default="llama8b,kimi", help="comma list of: llama8b, kimi")
    ap.add_argument("--draft-layers", type=int, default=5)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--samples", type=int, default=4)
    ap.add_argument("--sample-tokens", type=int, default=2048)
    ap.add_argument("--kimi-samples", type=int, default=1)
    ap.add_argument("--kimi-sample-tokens", type=int, default=4096)
    ap.add_argument("--anchors", type=int, default=128, help="anchors per sample (blocks trained per sample)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--iters", type=int, default=8)
    ap.add_argument("--quick", action="store_true", help="tiny shapes (CPU smoke run)")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if args.quick:
        args.samples, args.sample_tokens, args.kimi_samples, args.kimi_sample_tokens = 2, 64, 1, 64
        args.draft_layers, args.block_size, args.anchors, args.warmup, args.iters = 1, 4, 8, 1, 2
    peak = PeakFlops(device)
    report = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
              "torch": torch.__version__, "matmul_tflops": peak.value / 1e12,
              "datasheet_peak_tflops": peak.datasheet[1] / 1e12 if peak.datasheet else None,
              "draft_layers": args.draft_layers, "block_size": args.block_size, "cases": []}
    print(f"device {report['device']}: MFU against {peak.rate_text()}", file=sys.stderr)
    for setting in args.settings.split(","):
        target = {**TINY, "num_hidden_layers": 8} if args.quick else SETTINGS[setting]
        samples, tokens = (args.kimi_samples, args.kimi_sample_tokens) if setting == "kimi" \
            else (args.samples, args.sample_tokens)
        case = {"setting": setting}
        try:
            model = build(target, args.draft_layers, args.block_size, device)
            batch, anchors = make_batch(model.config, samples, tokens, args.anchors, device)
            n, slots = batch["input_ids"].numel(), anchors.numel() * args.block_size
            case.update({"tokens": n, "anchors": anchors.numel(), "block_slots": slots,
                         "trainable_params": sum(p.numel() for p in model.parameters() if p.requires_grad)})
            case.update(run_case(model, batch, anchors, args.warmup, args.iters, device))
            case["context_tokens_per_s"] = n / case["step_s_mean"]
            case["block_slots_per_s"] = slots / case["step_s_mean"]
            case.update(peak.mfu(case["flops_per_step"] / case["step_s_mean"]))
            case["mfu_text"] = peak.describe(case)
        except Exception as exc:     # keep the other setting's numbers
            case["error"] = f"{type(exc).__name__}: {exc}"
        print(json.dumps(case), file=sys.stderr, flush=True)
        report["cases"].append(case)
        if args.out:
            args.out.write_text(json.dumps(report, indent=1))
        model = batch = None
        if device.type == "cuda":
            torch.cuda.empty_cache()
    for case in report["cases"]:
        if "error" in case:
            print(f"{case['setting']}: {case['error']}")
            continue
        mfu = OVER_PEAK if case["mfu"] is None else case["mfu_text"]
        print(f"{case['setting']}: {case['context_tokens_per_s']:,.0f} context tokens/s, "
              f"{case['block_slots_per_s']:,.0f} block slots/s, {case['flops_per_step'] / 1e12:.2f} TFLOP/step "
              f"counted, MFU {mfu}, peak {case.get('peak_memory_gib', 0):.1f} GiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
