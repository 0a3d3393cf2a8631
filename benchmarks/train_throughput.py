"""Training throughput of the EAGLE-3 draft: tokens/s, MFU and peak memory of one full step.

One step = ``eagle3flow.train.loss.ttt_loss`` (teacher lm_head forward, TTT forward over all
steps, soft cross-entropy on the scored rows) + backward + grad-norm clipping + fused
AdamW, exactly what eagle3flow/train/trainer.py runs per batch on one GPU, on a batch laid out as
its loader hands it over (scored rows from the host). Weights and data are random and built
on the GPU (nothing is downloaded). Steps run back to back without host syncs, as in
training: tokens/s = tokens / mean step time; per-step times from CUDA events.
``--shapes varying`` (default) compiles as a run over batches of varying size does (one
batch of another row count first); ``fixed`` for the one shape only.

Settings:

* ``llama8b``: a Llama-3.1-8B-shaped target (H 4096, 32/8 heads, head_dim 128,
  intermediate 14336, vocab 128256, draft vocab 32000, 3 aux layers), batches of
  ``--samples`` x ``--sample-tokens`` (default 4 x 2048 = 8192 tokens), 7 TTT steps;
* ``kimi``: the Kimi-K2.5-shaped draft (DeepSeek-V3 text config nested under
  ``text_config``, H 7168, 64 heads, vocab 163840, draft vocab 32000) as
  ``DraftConfig.from_target_config`` derives it, at 4096 tokens, for its peak memory.

Loss masks: ``ones`` (every predicted token scored: the headline, where no row is
skipped) and ``chat`` (alternating user/assistant runs, ~60% assistant tokens: the
lm_head and the loss run only on scored rows, and the FLOP count follows them).

FLOPs per token: :func:`eagle3flow.model.flops.train_flops_per_token` (the trainer's own
count, of the architecture built: Llama or MLA): the products the step runs, forward and
backward (no input gradient where the input needs none), the draft lm_head on the rows
the loss scores, the teacher head's forward. MFU = that / the step time / the bf16 matmul
rate measured in the same run (``--matmul-size``^3 square product, best of several,
eagle3flow.model.flops.PeakFlops, the trainer's), and, on an H200, / its datasheet dense
bf16 peak (989 TFLOP/s) beside it.

    PYTHONPATH=$PWD python3 benchmarks/train_throughput.py --out results.json
    PYTHONPATH=$PWD python3 benchmarks/train_throughput.py --quick     # CPU smoke run

Data parallel (scaling): under ``torchrun --nproc-per-node G`` every rank runs its own
batch of the same shape and the gradients are summed with the trainer's own
``eagle3flow.train.distributed.sum_gradients`` before clipping and the optimizer step;
``tokens_per_s`` is then the total over the G GPUs (rank 0 reports).

    PYTHONPATH=$PWD torchrun --standalone --nproc-per-node 2 benchmarks/train_throughput.py --masks ones
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

from eagle3flow.train.distributed import DistContext, init_distributed, sum_gradients
from eagle3flow.model.config import DraftConfig
from eagle3flow.model.draft import Eagle3Draft
from eagle3flow.model.kernels import ttt_attention
from eagle3flow.model.flops import OVER_PEAK, PeakFlops, mean_causal_context, train_flops_per_token
from eagle3flow.model.optimizer_flops import optimizer_flops_per_step
from eagle3flow.train.loss import scored_rows, ttt_loss
from eagle3flow.train.data import to_device
from step_profile import profile_step, profile_text      # benchmarks/, beside this script

LLAMA_8B = {
    "model_type": "llama", "hidden_size": 4096, "num_attention_heads": 32, "num_key_value_heads": 8,
    "head_dim": 128, "intermediate_size": 14336, "vocab_size": 128256, "rms_norm_eps": 1e-5,
    "max_position_embeddings": 131072, "num_hidden_layers": 32, "torch_dtype": "bfloat16",
    "rope_theta": 500000.0,
    "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                     "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
}
KIMI_K25 = {"model_type": "kimi_k25", "text_config": {
    "model_type": "kimi_k2", "hidden_size": 7168, "num_attention_heads": 64, "num_key_value_heads": 64,
    "intermediate_size": 18432, "moe_intermediate_size": 2048, "kv_lora_rank": 512,
    "q_lora_rank": 1536, "qk_rope_head_dim": 64, "qk_nope_head_dim": 128, "v_head_dim": 128,
    "vocab_size": 163840, "rms_norm_eps": 1e-5, "max_position_embeddings": 262144,
    "num_hidden_layers": 61, "rope_theta": 50000.0, "torch_dtype": "bfloat16",
    "rope_scaling": {"type": "yarn", "factor": 64.0, "original_max_position_embeddings": 4096,
                     "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}}}
# vLLM's default EAGLE-3 aux layers for L layers: (2, L // 2, L - 3)
SETTINGS = {"llama8b": (LLAMA_8B, [2, 16, 29]), "kimi": (KIMI_K25, [2, 30, 58]),
            "kimi_llama": (KIMI_K25, [2, 30, 58])}
# kimi: the draft train.draft.architecture auto derives (MLA, as the target); kimi_llama: the
# Llama-layer draft of the same width beside it (architecture: llama).
DRAFT_OVERRIDES = {"kimi_llama": {"architecture": "llama"}}
TINY = {"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
        "intermediate_size": 128, "vocab_size": 512, "max_position_embeddings": 1024,
        "rope_theta": 10000.0}


def chat_mask(length: int, generator: torch.Generator, assistant_share: float = 0.6) -> torch.Tensor:
    """Bool ``[length]``: alternating user (False) / assistant (True) runs, ~60% assistant."""
    mask = torch.zeros(length, dtype=torch.bool)
    pos, assistant = 0, False
    turn = max(4, min(200, length // 8))       # mean run of a turn pair's half, in tokens
    while pos < length:
        mean = turn * (assistant_share if assistant else 1 - assistant_share) / 0.5
        run = max(1, int(torch.randint(int(mean * 0.5), int(mean * 1.5) + 1, (1,), generator=generator)))
        mask[pos:pos + run] = assistant
        pos, assistant = pos + run, not assistant
    return mask


def build(setting: str, draft_vocab: int, device: torch.device, quick: bool):
    """Model (fp32 master weights, frozen random embeddings, random vocab map) and the
    teacher head ``[Vd, H]`` bf16, as eagle3flow/train/trainer.py builds them."""
    target, aux_ids = (TINY, [1, 2, 3]) if quick else SETTINGS[setting]
    cfg = DraftConfig.from_target_config(target, aux_ids, draft_vocab, DRAFT_OVERRIDES.get(setting))
    torch.manual_seed(0)
    with torch.device(device):
        model = Eagle3Draft(cfg).to(device)       # rope buffers may be built on the CPU
    with torch.no_grad():
        model.embed_tokens.weight.normal_()
        kept = torch.randperm(cfg.vocab_size, device=device)[:cfg.draft_vocab_size].sort().values
        model.t2d.zero_()
        model.t2d[kept] = True
        model.d2t.copy_(kept - torch.arange(cfg.draft_vocab_size, device=device))
    teacher_dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    teacher_head = (torch.randn(cfg.draft_vocab_size, cfg.hidden_size, device=device) * 0.02).to(teacher_dtype)
    return model.train(), teacher_head


def make_batch(cfg: DraftConfig, samples: int, sample_tokens: int, mask: str, device: torch.device,
               num_steps: int, trim: int = 0) -> dict:
    """A packed batch as the training loader hands it over (eagle3flow/train/data.py): the
    scored rows computed on the host, ``cu_seqlens`` / ``step_rows`` kept there. ``trim``
    shortens the last sample (a batch of another row count)."""
    g = torch.Generator().manual_seed(1)
    lengths = [sample_tokens] * samples
    lengths[-1] -= trim
    n = sum(lengths)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    if mask == "ones":
        loss_mask = torch.ones(n, dtype=torch.bool)
    else:
        loss_mask = torch.cat([chat_mask(length, g) for length in lengths])
    cu = torch.tensor([0] + lengths, dtype=torch.int64).cumsum(0)
    rows, counts = scored_rows(cu, loss_mask, num_steps)
    host = {"input_ids": torch.randint(0, cfg.vocab_size, (n,), generator=g), "loss_mask": loss_mask,
            "cu_seqlens": cu, "scored_rows": rows, "step_rows": torch.tensor(counts)}
    return {**to_device(host, device),
            "aux": torch.randn(n, cfg.num_aux * cfg.target_hidden_size, device=device).to(dtype),
            "last": torch.randn(n, cfg.hidden_size, device=device).to(dtype)}


def time_steps(step, warmup: int, iters: int, device: torch.device) -> tuple[dict, object]:
    """Run ``step()`` ``warmup`` times, then time ``iters`` runs back to back with no host
    sync between them (per-step times from CUDA events on a GPU); returns the times (and
    peak memory on a GPU) and the last step's return value."""
    cuda = device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    t0 = time.perf_counter()
    out = None
    for _ in range(warmup):
        out = step()
    sync()
    warmup_s = time.perf_counter() - t0
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
        marks = [torch.cuda.Event(enable_timing=True) for _ in range(iters + 1)]
    stamps = []
    t0 = time.perf_counter()
    for i in range(iters):
        if cuda:
            marks[i].record()
        stamps.append(time.perf_counter())
        out = step()
    if cuda:
        marks[iters].record()
    sync()
    total = time.perf_counter() - t0
    stamps.append(time.perf_counter())
    times = [marks[i].elapsed_time(marks[i + 1]) / 1e3 for i in range(iters)] if cuda else \
        [b - a for a, b in zip(stamps, stamps[1:])]
    result = {"step_s_mean": total / iters, "step_s_median": statistics.median(times),
              "step_s_min": min(times), "step_s_max": max(times), "warmup_s": warmup_s}
    if cuda:
        result["peak_memory_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
    return result, out


def run_case(model, teacher_head, batch, num_steps: int, warmup: int, iters: int, device,
             profile: bool = False, ctx: DistContext | None = None, warm_batch: dict | None = None,
             optimizer: str = "adamw") -> dict:
    """Time ``iters`` steps run back to back as the trainer runs them (no host sync between
    steps); per-step times from CUDA events on the GPU's timeline. ``warm_batch`` (another
    row count) runs first, so torch.compile's graphs are the dynamic-shape ones a run over
    batches of varying size settles on. ``optimizer``: fused AdamW (the established
    trainer's comparison), or ``muon`` as the trainer builds it (train.optimizer's default:
    Muon's Newton-Schulz products on the hidden matrices, AdamW on the rest)."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    params = [p for _, p in named]
    if optimizer == "adamw":
        optimizer = torch.optim.AdamW(params, lr=1e-5, fused=device.type == "cuda")
    else:
        from eagle3flow.config import section_settings
        from eagle3flow.train.optim import build_optimizers
        optimizer = build_optimizers(named, section_settings("train", {"optimizer": optimizer, "lr": 1e-5}), device)
    autocast = device.type == "cuda"
    cuda = device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)

    def step(b=batch):
        optimizer.zero_grad(set_to_none=True)
        loss, stats = ttt_loss(model, b, teacher_head, num_steps, 0.8, autocast)
        loss.backward()
        if ctx is not None and ctx.enabled:
            sum_gradients(params, ctx, torch.bfloat16 if cuda else None)   # the trainer's default
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        return loss, stats

    if warm_batch is not None:
        step(warm_batch)
    result, (loss, stats) = time_steps(step, warmup, iters, device)
    result.update({"loss": float(loss), "step_rows": [s[2] for s in stats], "step_acc0": stats[0][1]})
    if profile and cuda:
        result["profile"] = profile_step(step, sync)
    del optimizer
    return result


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--settings", default="llama8b", help="comma list of: llama8b, kimi (MLA draft), kimi_llama")
    ap.add_argument("--masks", default="ones,chat", help="comma list of: ones, chat")
    ap.add_argument("--compile", default="off", help="comma list of: off, on (torch.compile of the step pieces)")
    ap.add_argument("--shapes", default="varying",
                    help="comma list of: varying (compiled for batches of varying row counts, as a "
                         "training run settles), fixed (compiled for the one batch shape)")
    ap.add_argument("--samples", type=int, default=4)
    ap.add_argument("--sample-tokens", type=int, default=2048)
    ap.add_argument("--kimi-samples", type=int, default=1, help="samples of --kimi-sample-tokens for kimi")
    ap.add_argument("--kimi-sample-tokens", type=int, default=4096)
    ap.add_argument("--ttt-steps", type=int, default=7)
    ap.add_argument("--draft-vocab", type=int, default=32000)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--matmul-size", type=int, help="side of the measured square matmul (8192 on a GPU)")
    ap.add_argument("--profile", action="store_true", help="print a kernel profile of the first case")
    ap.add_argument("--against", default="", choices=["", "speculators"],
                    help="also time the established trainer's step on the same shape (benchmarks/"
                         "established_trainer.py) and print the project's tokens/s over it")
    ap.add_argument("--matmuls", default="bf16",
                    help="comma list of: bf16, fp8 (train.fp8_matmuls: the layer's GEMMs in fp8)")
    ap.add_argument("--optimizer", default="adamw",
                    help="comma list of: adamw (fused; as the established trainer is timed), muon (the "
                         "trainer's default train.optimizer: Newton-Schulz on the hidden matrices)")
    ap.add_argument("--quick", action="store_true", help="tiny shapes (CPU smoke run)")
    ap.add_argument("--out", type=Path, help="write all results as JSON here")
    args = ap.parse_args(argv)
    ctx = init_distributed("auto")
    device = ctx.device
    if not ctx.is_main:                 # only rank 0 reports
        args.out, args.profile = None, False
        sys.stdout = sys.stderr = open(os.devnull, "w")
    if args.quick:
        args.samples, args.sample_tokens, args.kimi_sample_tokens, args.draft_vocab = 2, 64, 64, 100
        args.warmup, args.iters = 1, 2
    peak = PeakFlops(device, size=args.matmul_size)
    report = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
              "torch": torch.__version__, "matmul_size": peak.size,
              "matmul_tflops": peak.value / 1e12, "ttt_steps": args.ttt_steps,
              "datasheet_peak_tflops": peak.datasheet[1] / 1e12 if peak.datasheet else None,
              "world_size": ctx.world_size, "cases": []}
    print(f"device {report['device']}, torch {torch.__version__}, {peak.size}^3 matmul: MFU against "
          f"{peak.rate_text()}", file=sys.stderr)
    first = True
    for setting in args.settings.split(","):
        model, teacher_head = build(setting, args.draft_vocab, device, args.quick)
        cfg = model.config
        samples, tokens = (args.kimi_samples, args.kimi_sample_tokens) if setting.startswith("kimi") \
            else (args.samples, args.sample_tokens)
        context = mean_causal_context([tokens] * samples)
        for compiled, optimizer, matmuls in [(c, o, m) for c in args.compile.split(",")
                                             for o in args.optimizer.split(",") for m in args.matmuls.split(",")]:
            model.compile_steps = compiled == "on"
            model.fp8_matmuls = matmuls == "fp8"
            for mask, shapes in [(m, sh) for sh in args.shapes.split(",") for m in args.masks.split(",")]:
                if compiled == "on":
                    torch._dynamo.reset()       # each case compiles as a fresh run would
                batch = make_batch(cfg, samples, tokens, mask, device, args.ttt_steps)
                warm = make_batch(cfg, samples, tokens, mask, device, args.ttt_steps, trim=8) \
                    if shapes == "varying" else None
                n = batch["input_ids"].numel()
                scored_share = float(batch["step_rows"].sum()) / (n * args.ttt_steps)
                flops = train_flops_per_token(cfg, args.ttt_steps, context, scored_share=scored_share)
                case = {"setting": setting, "mask": mask, "compile": compiled, "shapes": shapes, "tokens": n,
                        "optimizer": optimizer, "matmuls": matmuls,
                        "samples": samples, "sample_tokens": tokens,
                        "scored_fraction": float(batch["loss_mask"].float().mean()),
                        "draft_config": cfg.to_dict(), "flops_per_token": flops}
                try:
                    case.update(run_case(model, teacher_head, batch, args.ttt_steps, args.warmup,
                                         args.iters, device, profile=args.profile and first, ctx=ctx,
                                         warm_batch=warm, optimizer=optimizer))
                    case["tokens_per_s"] = ctx.world_size * n / case["step_s_mean"]
                    if cfg.architecture == "mla" and device.type == "cuda":   # the kernel of MLA's cache attention
                        case["mla_cache_kernel"] = "cudnn" if ttt_attention._CUDNN_RUNS else "flash (padded)"
                    # Muon's Newton-Schulz products count once per step (model/optimizer_flops.py)
                    case["optimizer_flops_per_step"] = optimizer_flops_per_step(cfg, optimizer)
                    case.update(peak.mfu((n * flops["total"] + case["optimizer_flops_per_step"])
                                         / case["step_s_mean"]))
                    case["mfu_text"] = peak.describe(case)
                except Exception as exc:     # keep the other cases' numbers
                    case["error"] = f"{type(exc).__name__}: {exc}"
                    if device.type == "cuda":
                        torch.cuda.empty_cache()
                first = False
                if "profile" in case:
                    print(profile_text(case["profile"]), file=sys.stderr)
                report["cases"].append(case)
                print(json.dumps({k: v for k, v in case.items() if k not in ("draft_config", "profile")}),
                      file=sys.stderr, flush=True)
                if args.out:
                    args.out.write_text(json.dumps(report, indent=1))
        del model, teacher_head
        if device.type == "cuda":
            torch.cuda.empty_cache()
        if args.against and setting == "llama8b":
            established_case(report, setting, args, samples, tokens, device)
            if args.out:
                args.out.write_text(json.dumps(report, indent=1))
    print(markdown_table(report))
    ctx.close()
    return 0


def established_case(report: dict, setting: str, args, samples: int, tokens: int, device) -> None:
    """speculators' step on ``setting``'s shape after the project's cases of this run, and
    each of those cases' tokens/s over it (``ratio_to_established``)."""
    from established_trainer import build_speculators, run_speculators, speculators_batch

    target, aux_ids = (TINY, [1, 2, 3]) if args.quick else SETTINGS[setting]
    case = {"setting": setting, "trainer": "speculators 0.9", "mask": "ones", "tokens": samples * tokens,
            "samples": samples, "sample_tokens": tokens}
    try:
        model = build_speculators(target, args.draft_vocab, device)
        batch = speculators_batch(samples, tokens, int(target["hidden_size"]), len(aux_ids),
                                  int(target["vocab_size"]), device)
        case.update(run_speculators(model, batch, args.ttt_steps, args.warmup, args.iters, device))
        case["tokens_per_s"] = case["tokens"] / case["step_s_mean"]
        del model, batch
    except Exception as exc:     # keep the project's numbers
        case["error"] = f"{type(exc).__name__}: {exc}"
    if device.type == "cuda":
        torch.cuda.empty_cache()
    report.setdefault("established", []).append(case)
    print(json.dumps(case), file=sys.stderr, flush=True)
    if "tokens_per_s" in case:
        for ours in report["cases"]:
            if ours["setting"] == setting and ours.get("tokens_per_s"):
                ours["ratio_to_established"] = ours["tokens_per_s"] / case["tokens_per_s"]


def percent(fraction: float | None) -> str:
    """A utilisation, or the guard's word that the FLOP count is wrong (PeakFlops: never above 100%)."""
    return OVER_PEAK if fraction is None else f"{fraction:.1%}"


def optimizer_label(case: dict) -> str:
    """The table's optimizer cell, with the GEMMs' precision where it is not bf16."""
    return case.get("optimizer", "adamw") + (", fp8 GEMMs" if case.get("matmuls") == "fp8" else "")


def markdown_table(report: dict) -> str:
    datasheet = report.get("datasheet_peak_tflops")
    lines = [f"{report['device']}, torch {report['torch']}, {report['matmul_size']}^3 matmul "
             f"{report['matmul_tflops']:.4g} TFLOP/s measured in the run"
             + (f" (datasheet dense bf16 peak {datasheet:.0f} TFLOP/s)" if datasheet else "")
             + f", {report['ttt_steps']} TTT steps, "
             f"{report.get('world_size', 1)} GPU(s) data parallel (tokens/s is their total, MFU per GPU)", "",
             "| setting | loss mask (scored) | compile | shapes | optimizer | tokens/step | GFLOP/token | step (ms) | tokens/s "
             f"| MFU of the measured matmul ({report['matmul_tflops']:.4g} TFLOP/s) "
             + (f"| MFU of the datasheet peak ({datasheet:.0f} TFLOP/s) " if datasheet else "")
             + "| peak GPU memory (GiB) |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | " + ("--- | " if datasheet else "") + "--- |"]
    for c in report["cases"]:
        shape = f"{c['setting']} ({c['samples']} x {c['sample_tokens']})"
        if "error" in c:
            empty = "| " * (5 if datasheet else 4)
            lines.append(f"| {shape} | {c['mask']} | {c['compile']} | {c.get('shapes', '')} | "
                         f"{optimizer_label(c)} | {c['tokens']} "
                         f"{empty}| {c['error'][:80]} |")
            continue
        lines.append(f"| {shape} | {c['mask']} ({c['scored_fraction']:.0%}) | {c['compile']} | {c.get('shapes', '')} | "
                     f"{optimizer_label(c)} | "
                     f"{c['tokens']} | {c['flops_per_token']['total'] / 1e9:.2f} | {c['step_s_mean'] * 1e3:.1f} | "
                     f"{c['tokens_per_s']:,.0f} | {percent(c['mfu'])} | "
                     + (f"{percent(c['mfu_datasheet'])} | " if datasheet else "")
                     + f"{c.get('peak_memory_gib', float('nan')):.1f} |")
    if any(c.get("matmuls") == "fp8" for c in report["cases"]):
        lines.append("\nfp8 rows: their FLOP count over the bf16 matmul rate measured in the run (fp8 tensor "
                     "cores run up to twice that), so their MFU says how much faster than bf16, not utilisation")
    for e in report.get("established", []):
        if "error" in e:
            lines.append(f"\n{e['trainer']} on {e['setting']}: {e['error'][:200]}")
            continue
        ratios = ", ".join(f"{c['mask']}/{c['compile']}/{c.get('shapes', '')}/{optimizer_label(c)} "
                           f"{c['ratio_to_established']:.3f}x"
                           for c in report["cases"] if "ratio_to_established" in c)
        lines.append(f"\n{e['trainer']} (same run, {e['setting']} {e['samples']} x {e['sample_tokens']}, every "
                     f"token scored): {e['tokens_per_s']:,.0f} tokens/s, step {e['step_s_mean'] * 1e3:.1f} ms, peak "
                     f"{e.get('peak_memory_gib', float('nan')):.1f} GiB; the project over it: {ratios}")
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
