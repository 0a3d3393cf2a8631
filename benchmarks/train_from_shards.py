"""The EAGLE-3 trainer as a run trains: ``eagle3flow.train.trainer.train`` over hidden-state
shards on local disk, beside the compute-only step of the same shape in the same run.

benchmarks/train_throughput.py times the step on batches built on the GPU. A real run also
reads the shards (32 KiB a token at the Llama-3.1-8B shape in bf16, ~57 KiB at Kimi's width),
decodes them (fp8 storage dequantizes), packs, pins and copies them: this runs the trainer
itself, its loader and all, over shards the extraction code's writer
(``eagle3flow.extract.shards.write_shard``) put on ``--dir``, and reports per storage dtype:

* ``tokens_per_s``: the trainer's own metric (eagle3flow/train/metrics.py) over its metrics
  windows (``train.log_every`` steps each, the default 10: each line reads the GPU once),
  leaving out the first ``--skip`` windows (compile and loader start-up): their tokens over
  their time;
* ``data_wait_ms_per_step``: how long the loop waited for a batch, the trainer's metric;
* ``disk_read_gb_s``: bytes the device under ``--dir`` read during training (``/proc/diskstats``)
  / the training wall time; meaningful only when the page cache was dropped first
  (``--drop-caches``, root) or the shards are larger than the RAM (both are recorded);
* ``ratio_to_compute``: ``tokens_per_s`` / the compute-only tokens/s of the same shape,
  same run (train_throughput.run_case: the same step with the same optimizer, ``--optimizer``,
  default the trainer's Muon; batches already on the GPU): what the data path costs.

    PYTHONPATH=$PWD python3 benchmarks/train_from_shards.py --dir /local/nvme/bench \\
        --storage bf16,fp8 --drop-caches --out from_shards.json
    PYTHONPATH=$PWD python3 benchmarks/train_from_shards.py --quick --dir /tmp/from_shards   # CPU smoke
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parent))
from train_throughput import SETTINGS, TINY, build, make_batch, run_case  # noqa: E402

from eagle3flow.atomic import write_json  # noqa: E402
from eagle3flow.extract import shards  # noqa: E402
from eagle3flow.model.config import DraftConfig  # noqa: E402
from eagle3flow.ops.plan.read_rate import evict_from_page_cache, measure_read_rate  # noqa: E402
from eagle3flow.target.config import text_config  # noqa: E402
from eagle3flow.train.trainer import train  # noqa: E402


def write_target(out: Path, target: dict) -> Path:
    """A target directory holding what training reads of a target: its config and the
    embeddings, final norm and lm_head (random, bf16)."""
    cfg = text_config(target)
    vocab, hidden = int(cfg["vocab_size"]), int(cfg["hidden_size"])
    out.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(0)
    save_file({"model.embed_tokens.weight": (torch.randn(vocab, hidden, generator=g) * 0.02).bfloat16(),
               "model.norm.weight": torch.ones(hidden, dtype=torch.bfloat16),
               "lm_head.weight": (torch.randn(vocab, hidden, generator=g) * 0.02).bfloat16()},
              str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps({**target, "architectures": ["LlamaForCausalLM"]}))
    return out


def write_vocab_map(path: Path, vocab: int, draft_vocab: int) -> Path:
    """Every ``vocab // draft_vocab``-th target id (a spread, no data needed)."""
    kept = torch.arange(0, vocab, max(1, vocab // draft_vocab))[:draft_vocab]
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[kept] = True
    save_file({"d2t": kept - torch.arange(draft_vocab), "t2d": t2d}, str(path))
    return path


def write_shards(out: Path, cfg: DraftConfig, aux_ids: list[int], total_tokens: int, sample_tokens: int,
                 shard_tokens: int, storage: str, device: torch.device) -> Path:
    """Random samples of ``sample_tokens`` (every token scored) in shards of about
    ``shard_tokens``, written by the extraction code's writer in ``storage``, and their manifest."""
    shard_dir = out / "shards"
    shard_dir.mkdir(parents=True, exist_ok=True)
    per_shard = max(1, shard_tokens // sample_tokens)
    num_samples = max(1, total_tokens // sample_tokens)
    g = torch.Generator(device=device).manual_seed(1)
    entries = []
    for first in range(0, num_samples, per_shard):
        count = min(per_shard, num_samples - first)
        ids = [f"s{first + i}" for i in range(count)]
        shape = (count, sample_tokens)
        input_ids = torch.randint(0, cfg.vocab_size, shape, generator=g, device=device).cpu()
        aux = torch.randn(*shape, len(aux_ids) * cfg.target_hidden_size, generator=g, device=device)
        last = torch.randn(*shape, cfg.target_hidden_size, generator=g, device=device)
        entries.append(shards.write_shard(
            shard_dir / shards.shard_name(len(entries)), ids, list(input_ids),
            [torch.ones(sample_tokens, dtype=torch.uint8)] * count, list(aux.bfloat16().cpu()),
            list(last.bfloat16().cpu()), storage_dtype="fp8" if storage == "fp8" else "bfloat16"))
        print(f"from_shards: {storage} shard {len(entries)}: {first + count}/{num_samples} samples",
              file=sys.stderr, flush=True)
    manifest = {"format": shards.FORMAT, "shards": entries, "shard_dir": str(shard_dir),
                "aux_layer_ids": list(aux_ids), "hidden_size": cfg.target_hidden_size,
                "dtype": "bfloat16", "num_layers": None, "target_path": None,
                "num_samples": num_samples, "num_tokens": sum(e["num_tokens"] for e in entries)}
    write_json(out / "manifest.json", manifest)
    return out / "manifest.json"


def drop_page_cache(folder: Path) -> str | None:
    """Flush and drop the page cache: the whole cache where this host lets root do so, else
    the pages of every file under ``folder`` (``posix_fadvise(DONTNEED)`` after an fsync, the
    plan's probe's way, no root needed); how, or None where neither worked."""
    try:
        subprocess.run(["sync"], check=True)
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return "drop_caches"
    except (OSError, subprocess.CalledProcessError):
        pass
    try:
        for path in folder.rglob("*"):
            if path.is_file():
                fd = os.open(path, os.O_RDONLY)
                try:
                    evict_from_page_cache(fd)
                finally:
                    os.close(fd)
        return "fadvise"
    except OSError:
        return None


def sectors_read(path: Path) -> int | None:
    """Sectors read so far by the block device holding ``path`` (None where unknown)."""
    dev = os.stat(path).st_dev
    major, minor = os.major(dev), os.minor(dev)
    try:
        for line in Path("/proc/diskstats").read_text().splitlines():
            fields = line.split()
            if int(fields[0]) == major and int(fields[1]) == minor:
                return int(fields[5])
    except OSError:
        return None
    return None


def ram_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--setting", default="llama8b", choices=sorted(SETTINGS))
    ap.add_argument("--storage", default="bf16,fp8", help="comma list of: bf16, fp8")
    ap.add_argument("--dir", type=Path, required=True, help="a folder on the local disk to measure")
    ap.add_argument("--tokens", type=int, default=8192 * 64, help="tokens in the shards (one epoch)")
    ap.add_argument("--samples", type=int, default=4, help="samples per batch")
    ap.add_argument("--sample-tokens", type=int, default=2048)
    ap.add_argument("--shard-tokens", type=int, default=65536)
    ap.add_argument("--draft-vocab", type=int, default=32000)
    ap.add_argument("--workers", type=int, default=None, help="train.data_workers (default: the trainer's)")
    ap.add_argument("--skip", type=int, default=1, help="metrics windows left out (start-up)")
    ap.add_argument("--log-every", type=int, default=10, help="train.log_every (the trainer's default)")
    ap.add_argument("--optimizer", default="muon", choices=["muon", "adamw"],
                    help="train.optimizer of both the trainer and the compute-only step (default: the trainer's)")
    ap.add_argument("--drop-caches", action="store_true", help="drop the page cache before each run (root)")
    ap.add_argument("--keep", action="store_true", help="keep the shards (default: removed at the end)")
    ap.add_argument("--quick", action="store_true", help="a tiny shape on the CPU (smoke run)")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() and not args.quick else "cpu")
    if args.quick:
        args.tokens, args.sample_tokens, args.samples, args.shard_tokens = 2048, 128, 4, 1024
        args.draft_vocab, args.skip = 128, 1
    target_cfg, aux_ids = (TINY, [1, 2, 3]) if args.quick else SETTINGS[args.setting]
    cfg = DraftConfig.from_target_config(target_cfg, aux_ids, args.draft_vocab)
    batch_tokens = args.samples * args.sample_tokens
    work = args.dir
    work.mkdir(parents=True, exist_ok=True)
    report = {"setting": "tiny" if args.quick else args.setting, "device": str(device),
              "gpu": torch.cuda.get_device_name(0) if device.type == "cuda" else None,
              "torch": torch.__version__, "batch_tokens": batch_tokens, "ttt_steps": 7,
              "tokens": args.tokens, "ram_bytes": ram_bytes(), "optimizer": args.optimizer}

    # The compute-only figure of the same step and shape, this run.
    model, teacher_head = build(args.setting, args.draft_vocab, device, args.quick)
    batch = make_batch(model.config, args.samples, args.sample_tokens, "ones", device, 7)
    warm = make_batch(model.config, args.samples, args.sample_tokens, "ones", device, 7, trim=args.sample_tokens // 4)
    compute = run_case(model, teacher_head, batch, 7, warmup=2, iters=5 if args.quick else 10, device=device,
                       warm_batch=warm, optimizer=args.optimizer)
    compute["tokens_per_s"] = batch_tokens / compute["step_s_mean"]
    report["compute_only"] = compute
    print(f"from_shards: compute only {compute['tokens_per_s']:,.0f} tokens/s", file=sys.stderr, flush=True)
    del model, teacher_head, batch, warm
    if device.type == "cuda":
        torch.cuda.empty_cache()

    target = write_target(work / "target", target_cfg)
    vocab = write_vocab_map(work / "vocab_map.safetensors", cfg.vocab_size, args.draft_vocab)
    # What the plan would measure of this disk before a run (its probe), to set beside the
    # rate training reached: where the disk is the limit, the plan must predict it.
    probe = measure_read_rate(work)
    report["plan_probe_read_gb_s"] = probe / 1e9 if probe else None
    report["from_shards"] = {}
    for storage in args.storage.split(","):
        hs = work / f"hs-{storage}"
        manifest = hs / "manifest.json"
        if not manifest.is_file():
            write_shards(hs, cfg, aux_ids, args.tokens, args.sample_tokens, args.shard_tokens, storage, device)
        on_disk = sum(p.stat().st_size for p in (hs / "shards").iterdir())
        dropped = drop_page_cache(hs) if args.drop_caches else None
        before = sectors_read(hs)
        out_dir = work / f"train-{storage}"
        shutil.rmtree(out_dir, ignore_errors=True)
        shutil.rmtree(work / "cache", ignore_errors=True)
        config = {"epochs": 1, "batch_tokens": batch_tokens, "ttt_steps": 7, "log_every": args.log_every,
                  "optimizer": args.optimizer,
                  "checkpoint_every": 10**9, "device": device.type}
        if args.workers is not None:
            config["data_workers"] = args.workers
        t0 = time.perf_counter()
        train(manifest, None, vocab, target, out_dir, work / "cache", config)
        wall = time.perf_counter() - t0
        after = sectors_read(hs)
        rows = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
        lines = [r for r in rows if "tokens_per_s" in r and "data_wait_s" in r]
        windows = [(r, r["step"] - (prev["step"] if prev else 0))
                   for prev, r in zip([None] + lines, lines)][args.skip:]
        if not windows:
            raise SystemExit(f"{out_dir}/metrics.jsonl: no metrics window past the first {args.skip}: more --tokens")
        # tokens over time across the windows (each window's tokens / its rate is its time)
        window_tokens = [n * batch_tokens for _, n in windows]
        tokens_per_s = sum(window_tokens) / sum(t / r["tokens_per_s"] for t, (r, _) in zip(window_tokens, windows))
        steps_measured = sum(n for _, n in windows)
        result = {"tokens_per_s": tokens_per_s,
                  "data_wait_ms_per_step": 1e3 * sum(r["data_wait_s"] * n for r, n in windows) / steps_measured,
                  "steps_measured": steps_measured, "log_every": args.log_every,
                  "train_wall_s": wall, "bytes_on_disk": on_disk,
                  "bytes_per_token": on_disk / args.tokens, "page_cache_dropped": dropped,
                  "larger_than_ram": on_disk > report["ram_bytes"],
                  "disk_read_gb_s": (after - before) * 512 / wall / 1e9
                  if before is not None and after is not None else None,
                  "ratio_to_compute": tokens_per_s / compute["tokens_per_s"],
                  # the tokens/s the plan's probe says this disk can feed at these bytes per token
                  "plan_disk_tokens_per_s": probe * args.tokens / on_disk if probe else None}
        report["from_shards"][storage] = result
        print(f"from_shards: {storage}: {tokens_per_s:,.0f} tokens/s ({result['ratio_to_compute']:.3f}x compute "
              f"only), data wait {result['data_wait_ms_per_step']:.1f} ms/step, read "
              f"{result['disk_read_gb_s'] or 0:.2f} GB/s (page cache dropped: {dropped})", file=sys.stderr, flush=True)
        if not args.keep:
            shutil.rmtree(hs)
    if args.out:
        args.out.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
