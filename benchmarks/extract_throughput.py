"""Extraction throughput of the project's path against the forward alone and the disk alone.

Builds a Llama-3.1-8B-shaped target with random weights directly on the GPU in bf16
(no download), then, in one run and on the same batches of ``--batch-seqs`` x
``--seq-len`` tokens:

* (a) ``forward``: the target's base model on each batch (what extraction runs: no
  LM head), nothing copied out;
* (b) ``write``: the bytes the project's shards hold, written alone (same file sizes,
  one fsync per file, no checksum) into the same scratch directory;
* ``project``: :func:`eagle3flow.extract.hf.extract` end to end (dataset scan,
  forward with hooks, device-to-host copies, background writer with sha256, entry
  files, manifest), with the model handed over through ``loaded_models``;
* ``project_fp8``: the same with ``storage_dtype="fp8"`` (half the bytes).

``overlap_ratio = project tokens/s / min(forward, write)`` (goal >= 0.85: compute
and disk overlap instead of adding up). Also bytes per token on disk against
``(A+1) * H * itemsize + 5`` (+ ``(A+1) * 4`` of scales in fp8). Prints a markdown
table and writes the numbers as JSON to ``--out``.

    python benchmarks/extract_throughput.py --out extract.json        # H200, ~2 min
    python benchmarks/extract_throughput.py --tiny --out tiny.json    # CPU check, seconds
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from eagle3flow.extract import shards  # noqa: E402
from eagle3flow.extract.extraction import check_disk_room, prepare  # noqa: E402
from eagle3flow.extract.hf import capture, model_cache_key, run  # noqa: E402
from eagle3flow.layers import default_aux_layer_ids  # noqa: E402

# Llama-3.1-8B's shape (config.json of meta-llama/Llama-3.1-8B, rope scaling aside).
LLAMA_8B = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=131072,
                rms_norm_eps=1e-5, bos_token_id=128000, eos_token_id=128001)
TINY = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=8,
            num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=4096)
GOAL = 0.85


def log(message: str) -> None:
    print(f"[bench] {message}", file=sys.stderr, flush=True)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def build_target(shape: dict, dtype: torch.dtype, device: torch.device, target_dir: Path):
    """A random LlamaForCausalLM made on ``device``; ``target_dir`` gets its config.json and
    a placeholder weight file, enough for the project's checks (the model is handed over)."""
    from transformers import LlamaConfig, LlamaForCausalLM
    from safetensors.torch import save_file

    torch.manual_seed(0)
    config = LlamaConfig(**shape)
    before = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(before)
    model = model.to(device=device, dtype=dtype).eval()
    target_dir.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(target_dir)
    save_file({"placeholder": torch.zeros(1)}, str(target_dir / "model.safetensors"))
    return model


def write_dataset(path: Path, num_samples: int, seq_len: int, vocab_size: int, seed: int = 0) -> None:
    rng = np.random.default_rng(seed)
    ids = rng.integers(3, vocab_size, (num_samples, seq_len), dtype=np.int32)
    table = pa.table({
        "id": [f"bench-{i}" for i in range(num_samples)],
        "input_ids": pa.array(list(ids), type=pa.list_(pa.int32())),
        "loss_mask": pa.array([np.ones(seq_len, np.int8)] * num_samples, type=pa.list_(pa.int8())),
        "num_tokens": pa.array([seq_len] * num_samples, type=pa.int32()),
    })
    pq.write_table(table, str(path))


def time_forward(model, batches: list[torch.Tensor], aux_ids: list[int], device) -> float:
    """Seconds for the base model's forward over every batch (inputs already on the device)."""
    base = model.get_decoder()
    synchronize(device)
    t0 = time.perf_counter()
    with torch.no_grad():
        for ids in batches:
            out = base(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False)
    synchronize(device)
    seconds = time.perf_counter() - t0
    if not torch.isfinite(out.last_hidden_state).all():
        raise RuntimeError("the random target's hidden states are not finite")
    return seconds


def time_writes(directory: Path, sizes: list[int]) -> float:
    """Seconds to write files of ``sizes`` bytes (random bytes, one fsync each), nothing else."""
    directory.mkdir(parents=True, exist_ok=True)
    block = np.random.default_rng(1).integers(0, 256, max(sizes), dtype=np.uint8)
    view = memoryview(block)
    t0 = time.perf_counter()
    for i, size in enumerate(sizes):
        with open(directory / f"file-{i:05d}.bin", "wb") as f:
            for a in range(0, size, shards.WRITE_CHUNK):
                f.write(view[a:min(size, a + shards.WRITE_CHUNK)])
            f.flush()
            os.fsync(f.fileno())
    seconds = time.perf_counter() - t0
    shutil.rmtree(directory)
    return seconds


def sha256_gb_per_s(size: int = 256 << 20) -> float:
    """One core's sha256 speed (the shards' checksum; hashed off the writer's path)."""
    import hashlib
    data = memoryview(np.random.default_rng(2).integers(0, 256, size, dtype=np.uint8))
    t0 = time.perf_counter()
    hashlib.sha256(data).hexdigest()
    return size / (time.perf_counter() - t0) / 1e9


def time_project(dataset: Path, target_dir: Path, model, dtype, device, scratch: Path, name: str,
                 batch_tokens: int, storage_dtype: str) -> tuple[float, dict, list]:
    """Seconds of ``extract`` (= prepare + check_disk_room + run), its manifest, and the
    pipeline's timeline (per shard: buffer wait, queued, copied, written, hashed)."""
    loaded = {model_cache_key(target_dir, dtype, device): model}
    out = scratch / name
    timeline: list = []
    synchronize(device)
    t0 = time.perf_counter()
    x = prepare(dataset, target_dir, out / "manifest.json", out / "cache",
                dtype=str(dtype).removeprefix("torch."), device=str(device),
                batch_tokens=batch_tokens, shard_tokens=batch_tokens,
                storage_dtype=storage_dtype, split_name="bench")
    check_disk_room([x])
    manifest = run(x, loaded, timeline)
    synchronize(device)
    seconds = time.perf_counter() - t0
    return seconds, manifest, [(what, shard, round(t - t0, 4)) for what, shard, t in timeline]


def check_shard(manifest: dict, model, aux_ids: list[int], device, dtype) -> float:
    """Max abs difference of the first stored sample's last hidden state from a direct forward
    (fails loudly if the pipeline wrote the wrong rows)."""
    tensors, _ = shards.read_shard(Path(manifest["shard_dir"]) / manifest["shards"][0]["file"])
    n = int(tensors["cu_seqlens"][1])
    ids = tensors["input_ids"][:n].long().to(device)[None]
    aux, last = capture(model, ids, torch.ones_like(ids), aux_ids)
    stored = tensors["last_hidden_state"][:n].float()
    diff = (stored - last[0].float().cpu()).abs().max().item()
    scale = last.float().abs().max().item()
    tolerance = 0.1 * scale if manifest["storage_dtype"] == "float8_e4m3fn" else 0.02 * scale
    if not diff <= tolerance:
        raise RuntimeError(f"stored hidden states differ from a direct forward by {diff} "
                           f"(scale {scale}): the pipeline wrote wrong rows")
    return diff


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="results JSON")
    parser.add_argument("--tiny", action="store_true", help="a tiny target on the CPU (a check, not a benchmark)")
    parser.add_argument("--device", default=None, help="default: cuda (cpu with --tiny)")
    parser.add_argument("--seq-len", type=int, default=None, help="tokens per sequence (2048; 64 tiny)")
    parser.add_argument("--batch-seqs", type=int, default=None, help="sequences per batch (8; 2 tiny)")
    parser.add_argument("--batches", type=int, default=None,
                        help="batches timed per measurement (48; 6 tiny); one shard each. The project's "
                             "time includes its start, the first shard's compute and the last one's "
                             "write, which overlap nothing: more batches amortize them as production does")
    parser.add_argument("--scratch", default=None,
                        help="directory on the disk to measure (default: a new dir under ./cache)")
    parser.add_argument("--no-fp8", action="store_true", help="skip the fp8 storage run")
    parser.add_argument("--diagnose", action="store_true",
                        help="also run the project path with its disk writes skipped (compute + copies only)")
    args = parser.parse_args(argv)

    device = torch.device(args.device or ("cpu" if args.tiny else "cuda"))
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: run on the GPU machine, or pass --tiny for a CPU check")
    shape = TINY if args.tiny else LLAMA_8B
    seq_len = args.seq_len or (64 if args.tiny else 2048)
    batch_seqs = args.batch_seqs or (2 if args.tiny else 8)
    num_batches = args.batches or (6 if args.tiny else 48)
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    batch_tokens = seq_len * batch_seqs
    tokens = batch_tokens * num_batches
    aux_ids = default_aux_layer_ids(shape["num_hidden_layers"])
    hidden = shape["hidden_size"]

    root = Path(args.scratch) if args.scratch else Path("cache")
    root.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix="bench_extract_", dir=root))
    free = shutil.disk_usage(scratch).free
    need = tokens * shards.bytes_per_token(len(aux_ids), hidden, dtype) * 1.1
    if free < need:
        raise SystemExit(f"{scratch}: {free / 2**30:.1f} GiB free, the benchmark needs {need / 2**30:.1f}")
    results: dict = {
        "command": " ".join([Path(sys.argv[0]).name] + (argv if argv is not None else sys.argv[1:])),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
        "torch": torch.__version__, "target_shape": shape, "dtype": str(dtype).removeprefix("torch."),
        "aux_layer_ids": aux_ids, "seq_len": seq_len, "batch_seqs": batch_seqs,
        "batches": num_batches, "tokens": tokens, "scratch": str(scratch.resolve()),
    }
    try:
        import transformers
        results["transformers"] = transformers.__version__
        t0 = time.perf_counter()
        model = build_target(shape, dtype, device, scratch / "target")
        results["build_s"] = time.perf_counter() - t0
        log(f"built the {'tiny' if args.tiny else 'Llama-3.1-8B-shaped'} target on {device} "
            f"in {results['build_s']:.1f} s")
        dataset = scratch / "dataset.parquet"
        write_dataset(dataset, batch_seqs * num_batches, seq_len, shape["vocab_size"])
        table = pq.read_table(str(dataset))
        all_ids = torch.tensor(np.stack(table.column("input_ids").to_numpy(zero_copy_only=False)),
                               dtype=torch.long)
        batches = [all_ids[i * batch_seqs:(i + 1) * batch_seqs].to(device) for i in range(num_batches)]

        time_forward(model, batches[:1], aux_ids, device)  # warm-up: kernels, cuBLAS handles
        forward_s = time_forward(model, batches, aux_ids, device)
        log(f"(a) forward alone: {tokens / forward_s:,.0f} tokens/s")

        project_s, manifest, timeline = time_project(dataset, scratch / "target", model, dtype, device, scratch,
                                           "project", batch_tokens, "auto")
        sizes = [s["bytes"] for s in manifest["shards"]]
        if manifest["num_tokens"] != tokens or len(sizes) != num_batches:
            raise RuntimeError(f"the project wrote {manifest['num_tokens']} tokens in {len(sizes)} "
                               f"shards, expected {tokens} in {num_batches}")
        max_diff = check_shard(manifest, model, aux_ids, device, dtype)
        shutil.rmtree(scratch / "project")
        log(f"project: {tokens / project_s:,.0f} tokens/s")

        write_s = time_writes(scratch / "write", sizes)
        log(f"(b) write alone: {tokens / write_s:,.0f} tokens/s ({sum(sizes) / write_s / 1e9:.2f} GB/s)")

        rows = {
            "forward": {"seconds": forward_s, "tokens_per_s": tokens / forward_s},
            "write": {"seconds": write_s, "tokens_per_s": tokens / write_s,
                      "gb_per_s": sum(sizes) / write_s / 1e9, "bytes": sum(sizes)},
            "project": {"seconds": project_s, "tokens_per_s": tokens / project_s,
                        "bytes": sum(sizes), "bytes_per_token": sum(sizes) / tokens,
                        "formula_bytes_per_token": shards.bytes_per_token(len(aux_ids), hidden, dtype),
                        "max_abs_diff_vs_forward": max_diff},
        }
        bound = min(rows["forward"]["tokens_per_s"], rows["write"]["tokens_per_s"])
        rows["project"]["overlap_ratio"] = rows["project"]["tokens_per_s"] / bound
        if not args.no_fp8:
            fp8_s, fp8, _ = time_project(dataset, scratch / "target", model, dtype, device, scratch,
                                      "project_fp8", batch_tokens, "fp8")
            fp8_bytes = sum(s["bytes"] for s in fp8["shards"])
            check_shard(fp8, model, aux_ids, device, dtype)
            shutil.rmtree(scratch / "project_fp8")
            # The disk alone for fp8's bytes, at the bandwidth measured in (b).
            fp8_write_tps = tokens / (fp8_bytes / (sum(sizes) / write_s))
            rows["project_fp8"] = {
                "seconds": fp8_s, "tokens_per_s": tokens / fp8_s, "bytes": fp8_bytes,
                "bytes_per_token": fp8_bytes / tokens,
                "formula_bytes_per_token": shards.bytes_per_token(len(aux_ids), hidden, "fp8"),
                "overlap_ratio": tokens / fp8_s / min(rows["forward"]["tokens_per_s"], fp8_write_tps)}
            log(f"project fp8: {tokens / fp8_s:,.0f} tokens/s")
        if args.diagnose:
            real_write, real_sha = shards.write_packed_shard, shards.sha256_file
            shards.write_packed_shard = lambda path, ids, *a, **k: {
                "file": Path(path).name, "sha256": None, "num_samples": len(ids),
                "num_tokens": int(a[0].numel()), "bytes": 0}
            shards.sha256_file = lambda path: "skipped"
            try:
                nodisk_s, _, nodisk_timeline = time_project(dataset, scratch / "target", model, dtype,
                                                            device, scratch, "nodisk", batch_tokens, "auto")
            finally:
                shards.write_packed_shard, shards.sha256_file = real_write, real_sha
            rows["project_no_disk"] = {"seconds": nodisk_s, "tokens_per_s": tokens / nodisk_s}
            results["project_no_disk_timeline"] = nodisk_timeline
            log(f"project without disk writes: {tokens / nodisk_s:,.0f} tokens/s")
        results["sha256_gb_per_s_one_core"] = sha256_gb_per_s()
        results["rows"] = rows
        results["project_timeline"] = timeline
        results["overlap_ratio"] = rows["project"]["overlap_ratio"]
        results["goal"] = GOAL
        results["goal_met"] = results["overlap_ratio"] >= GOAL
    finally:
        shutil.rmtree(scratch, ignore_errors=True)

    print(render(results))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2) + "\n")
    log(f"wrote {out}")
    return results


def render(results: dict) -> str:
    rows = results["rows"]
    lines = [f"Extraction, {results['device']}, {results['batches']} batches of "
             f"{results['batch_seqs']} x {results['seq_len']} tokens ({results['tokens']:,} tokens), "
             f"{results['dtype']}, aux layers {results['aux_layer_ids']}", "",
             "| measurement | seconds | tokens/s | bytes/token on disk (formula) | overlap_ratio |",
             "| --- | ---: | ---: | --- | ---: |"]
    names = {"forward": "(a) forward alone", "write": "(b) write alone",
             "project": "project (extract)", "project_fp8": "project, fp8 storage",
             "project_no_disk": "project, disk writes skipped (diagnosis)"}
    for key, row in rows.items():
        per_token = (f"{row['bytes_per_token']:,.1f} ({row['formula_bytes_per_token']:,})"
                     if "bytes_per_token" in row else "")
        ratio = f"{row['overlap_ratio']:.3f}" if "overlap_ratio" in row else ""
        lines.append(f"| {names[key]} | {row['seconds']:.2f} | {row['tokens_per_s']:,.0f} | "
                     f"{per_token} | {ratio} |")
    lines += ["", f"overlap_ratio = project / min(a, b) = {results['overlap_ratio']:.3f} "
                  f"(goal >= {results['goal']}: {'met' if results['goal_met'] else 'NOT met'})"]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
