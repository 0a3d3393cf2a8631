"""Target hidden states for EAGLE-3 training: capture them with HF transformers, cache them as shards.

:func:`capture` runs the target once and returns, per token, the aux hidden states
(the inputs of decoder layers ``aux_layer_ids``, see eagle3flow/layers.py) and the
final-norm output (the teacher's logits are ``lm_head(last)``).

:func:`extract` does that for a whole tokenized dataset and writes shards (format in
docs/formats.md) under ``cache_root/<fingerprint>/``, then the manifest. The plan is
deterministic (samples in dataset order, a new shard once ``shard_tokens`` is reached),
so an interrupted run resumes: a shard already on disk that verifies is kept as is,
and the model is only loaded if some shard is missing.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time
from dataclasses import dataclass
from concurrent.futures import Future, ThreadPoolExecutor
from functools import partial
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import torch
from safetensors import safe_open

from eagle3flow import shards
from eagle3flow.layers import resolve_aux_layer_ids
from eagle3flow.progress import Progress

# Bump when the way shards are computed changes, so old caches are not reused.
EXTRACTOR_VERSION = 1
WEIGHT_SUFFIXES = (".safetensors", ".bin")
DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
          "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}
# Seconds to sleep after each written shard; lets tests kill a run between shards.
SHARD_DELAY_ENV = "EAGLE3FLOW_TEST_SHARD_DELAY"
LOADING_LINE = "loading target"
# Written beside the manifest: one line per computed shard (split, fingerprint, shard,
# num_tokens, compute_s, finished_at unix time).
THROUGHPUT_FILE = "throughput.jsonl"


# ----------------------------------------------------------------------------- capture

def decoder_layers(base_model: torch.nn.Module) -> torch.nn.ModuleList:
    """The decoder layers of an HF base model (``model.layers`` or a nested language model's)."""
    for owner in (base_model, getattr(base_model, "language_model", None)):
        layers = getattr(owner, "layers", None)
        if isinstance(layers, torch.nn.ModuleList):
            return layers
    raise TypeError(f"cannot find the decoder layers of {type(base_model).__name__}")


def _record_layer_input(store: dict, layer_id: int, module, args, kwargs):
    store[layer_id] = args[0] if args else kwargs["hidden_states"]


def capture(model, input_ids: torch.Tensor, attention_mask: torch.Tensor,
            aux_layer_ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Aux and last hidden states of an HF CausalLM for a right-padded batch.

    ``input_ids [B, T]``, ``attention_mask [B, T]`` (1 = token, 0 = padding) ->
    ``aux [B, T, A*H]`` = the inputs of decoder layers ``aux_layer_ids`` (= HF
    ``hidden_states[k]``) concatenated in that order, and ``last [B, T, H]`` = the
    final-norm output, so ``model.lm_head(last)`` are the model's logits.

    Pre-hooks on the A chosen layers keep only what is needed (``output_hidden_states``
    would hold all N+1 states), and only the base model runs: no ``[B, T, V]`` logits.
    """
    base = model.get_decoder() if hasattr(model, "get_decoder") else model.base_model
    layers = decoder_layers(base)
    captured: dict[int, torch.Tensor] = {}
    handles = [layers[k].register_forward_pre_hook(partial(_record_layer_input, captured, k),
                                                   with_kwargs=True)
               for k in aux_layer_ids]
    try:
        # no_grad, not inference_mode: callers may still use the outputs under autograd.
        with torch.no_grad():
            out = base(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
    finally:
        for handle in handles:
            handle.remove()
    aux = torch.cat([captured[k] for k in aux_layer_ids], dim=-1)
    return aux, out.last_hidden_state


# ----------------------------------------------------------------------------- target

def _text_config(config: dict) -> dict:
    return config.get("text_config") or config


def read_target_config(target_path: str | os.PathLike) -> dict:
    """The target's config.json (its text part when nested); checks that weights are there."""
    target = Path(target_path)
    config_file = target / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(f"{config_file}: missing; --target must be an HF model directory")
    if not weight_files(target):
        raise FileNotFoundError(
            f"{target}: no weight files (*{', *'.join(WEIGHT_SUFFIXES)}); is the download complete?")
    with open(config_file) as f:
        text = _text_config(json.load(f))
    for key in ("num_hidden_layers", "hidden_size", "vocab_size"):
        if key not in text:
            raise ValueError(f"{config_file}: no '{key}' (nor text_config.{key})")
    return text


def weight_files(target_path: Path) -> list[Path]:
    return sorted(p for p in Path(target_path).iterdir()
                  if p.is_file() and p.name.endswith(WEIGHT_SUFFIXES))


def cached_sha256(path: Path, cache_root: Path) -> str:
    """sha256 of a file, remembered by (path, size, mtime, inode) like git's index.

    The target's weights are hashed once (seconds to minutes); later runs only stat
    them, so a fully cached rerun reads neither the weights nor the model.
    """
    st = path.stat()
    key = str(path.resolve())
    stamp = [st.st_size, st.st_mtime_ns, st.st_ino]
    memo_file = cache_root / "file_sha256.json"
    try:
        with open(memo_file) as f:
            memo = json.load(f)
    except (OSError, ValueError):
        memo = {}
    hit = memo.get(key)
    if hit and hit.get("stamp") == stamp:
        return hit["sha256"]
    digest = shards.sha256_file(path)
    memo[key] = {"stamp": stamp, "sha256": digest}
    shards.atomic_write_json(memo_file, memo)
    return digest


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r}: expected auto or one of {sorted(DTYPES)}")
    return DTYPES[dtype]


def load_target(target_path, dtype: torch.dtype, device: torch.device):
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(str(target_path), dtype=dtype)
    return model.to(device).eval()


# ----------------------------------------------------------------------------- dataset plan

REQUIRED_COLUMNS = ("id", "input_ids", "loss_mask", "num_tokens")


@dataclass
class ShardPlan:
    index: int
    start: int        # first dataset row
    stop: int         # one past the last row
    num_tokens: int   # after max_length truncation


def _iter_dataset(path: Path, columns=REQUIRED_COLUMNS, batch_rows: int = 1024):
    """Record batches of the dataset, read incrementally (one batch in memory)."""
    parquet = pq.ParquetFile(str(path))
    missing = [c for c in REQUIRED_COLUMNS if c not in parquet.schema_arrow.names]
    if missing:
        raise ValueError(f"{path}: missing columns {missing} (docs/formats.md, tokenized dataset)")
    yield from parquet.iter_batches(batch_size=batch_rows, columns=list(columns))


def scan_dataset(path: Path, vocab_size: int, max_length: int | None) -> tuple[np.ndarray, dict]:
    """Check every row; return the per-sample token counts used ``[n]`` and totals.

    Fails naming the row (id) on lists of unequal length, a wrong ``num_tokens``, an
    empty sample or a token id outside the target's vocab: cheaper here than mid-run.
    """
    lengths, loss_tokens, truncated, row = [], 0, 0, 0
    for batch in _iter_dataset(path):
        ids_col, mask_col = batch.column("input_ids"), batch.column("loss_mask")
        n_ids = pc.list_value_length(ids_col).to_numpy(zero_copy_only=False)
        n_mask = pc.list_value_length(mask_col).to_numpy(zero_copy_only=False)
        n_declared = batch.column("num_tokens").to_numpy(zero_copy_only=False)
        flat = pc.list_flatten(ids_col)
        lo, hi = pc.min_max(flat).values() if len(flat) else (pa.scalar(0), pa.scalar(0))
        ids_ok = np.ones(len(n_ids), bool)
        if lo.as_py() < 0 or hi.as_py() >= vocab_size:
            ids_ok = np.array([0 <= min(x) and max(x) < vocab_size if x else True
                               for x in ids_col.to_pylist()])
        for bad, what in ((n_ids != n_mask, "len(input_ids) != len(loss_mask)"),
                          (n_ids != n_declared, "num_tokens != len(input_ids)"),
                          (n_ids == 0, "no tokens"),
                          (~ids_ok, f"token id outside the target's vocab [0, {vocab_size})")):
            if bad.any():
                i = int(np.flatnonzero(bad)[0])
                raise ValueError(f"{path}: row {row + i} (id {batch.column('id')[i]}): {what}")
        if max_length is not None:
            mask_col = pc.list_slice(mask_col, 0, max_length)
            truncated += int((n_ids > max_length).sum())
            n_ids = np.minimum(n_ids, max_length)
        loss_tokens += int(pc.sum(pc.list_flatten(mask_col)).as_py() or 0)
        lengths.append(n_ids.astype(np.int64))
        row += batch.num_rows
    if row == 0:
        raise ValueError(f"{path}: the dataset is empty")
    return np.concatenate(lengths), {"num_loss_tokens": loss_tokens, "truncated_samples": truncated}


def plan_shards(lengths: np.ndarray, shard_tokens: int) -> list[ShardPlan]:
    """Consecutive samples per shard; a shard closes once it holds >= ``shard_tokens``."""
    plan, start, tokens = [], 0, 0
    for row, n in enumerate(lengths.tolist()):
        tokens += n
        if tokens >= shard_tokens:
            plan.append(ShardPlan(len(plan), start, row + 1, tokens))
            start, tokens = row + 1, 0
    if start < len(lengths):
        plan.append(ShardPlan(len(plan), start, len(lengths), tokens))
    return plan


def length_batches(lengths: list[int], batch_tokens: int) -> list[list[int]]:
    """Sample indices grouped longest first, each batch padding to <= ``batch_tokens`` tokens.

    Sorting by length keeps padding small; a sample longer than ``batch_tokens`` runs alone.
    """
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    batches: list[list[int]] = []
    for i in order:
        if batches and (len(batches[-1]) + 1) * lengths[batches[-1][0]] <= batch_tokens:
            batches[-1].append(i)
        else:
            batches.append([i])
    return batches


# ----------------------------------------------------------------------------- extraction

def fingerprint(inputs: dict) -> str:
    return hashlib.sha256(json.dumps(inputs, sort_keys=True).encode()).hexdigest()[:20]


def _entry_file(shard_path: Path) -> Path:
    return shard_path.with_suffix(".json")


def cached_entry(shard_path: Path, plan: ShardPlan) -> dict | None:
    """The manifest entry of a finished shard, or None when it must be (re)computed.

    Checked: structure (:func:`shards.verify_shard`), the planned sample/token counts,
    and the sha256 recorded beside it when it was written (catches bit rot, truncation).
    """
    if not shard_path.is_file():
        return None
    try:
        with open(_entry_file(shard_path)) as f:
            recorded = json.load(f)
    except (OSError, ValueError):
        recorded = None
    if not shards.verify_shard(shard_path, recorded["sha256"] if recorded else None):
        return None
    entry = recorded or shards.shard_entry(shard_path)
    if entry["num_samples"] != plan.stop - plan.start or entry["num_tokens"] != plan.num_tokens:
        return None
    if not recorded:
        shards.atomic_write_json(_entry_file(shard_path), entry)
    return entry


def _shard_sample_ids(path: Path) -> list[str]:
    with safe_open(str(path), "pt") as f:
        return json.loads((f.metadata() or {}).get("sample_ids", "[]"))


def _compute_shard(model, rows: list[dict], aux_layer_ids, device, batch_tokens, progress):
    """Hidden states of one shard's samples, batched by length, returned in dataset order."""
    lengths = [len(r["input_ids"]) for r in rows]
    aux_out, last_out = [None] * len(rows), [None] * len(rows)
    for batch in length_batches(lengths, batch_tokens):
        width = lengths[batch[0]]
        ids = torch.zeros(len(batch), width, dtype=torch.long)
        mask = torch.zeros(len(batch), width, dtype=torch.long)
        for b, i in enumerate(batch):
            ids[b, :lengths[i]] = torch.as_tensor(rows[i]["input_ids"], dtype=torch.long)
            mask[b, :lengths[i]] = 1
        aux, last = capture(model, ids.to(device), mask.to(device), aux_layer_ids)
        # Pack the real tokens on the device and copy once per batch: no padding kept,
        # one host sync instead of one per sample.
        sizes = [lengths[i] for i in batch]
        aux = torch.cat([aux[b, :n] for b, n in enumerate(sizes)]).to("cpu", copy=True)
        last = torch.cat([last[b, :n] for b, n in enumerate(sizes)]).to("cpu", copy=True)
        for i, a, h in zip(batch, aux.split(sizes), last.split(sizes)):
            aux_out[i], last_out[i] = a, h
        progress.update(sum(sizes))
    return aux_out, last_out


def _record_throughput(path: Path, split_name: str, key: str, plan: ShardPlan,
                       compute_s: float) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        f.write(json.dumps({"split": split_name, "fingerprint": key, "shard": plan.index,
                            "num_tokens": plan.num_tokens, "compute_s": compute_s,
                            "finished_at": time.time()}) + "\n")


def _write_shard(path: Path, rows: list[dict], aux, last) -> dict:
    entry = shards.write_shard(
        path, [r["id"] for r in rows],
        [torch.tensor(r["input_ids"], dtype=torch.int32) for r in rows],
        [torch.tensor(r["loss_mask"], dtype=torch.uint8) for r in rows], aux, last)
    # Recorded beside the shard so a resumed run can check the file's bytes, not just its shape.
    shards.atomic_write_json(_entry_file(path), entry)
    return entry


def extract(dataset_parquet, target_path, manifest_out, cache_root, aux_layer_ids=None,
            dtype: str = "auto", device: str = "auto", batch_tokens: int = 8192,
            shard_tokens: int = 32768, max_length: int | None = None,
            split_name: str = "train", loaded_models: dict | None = None) -> dict:
    """Extract hidden states of every dataset sample into cached shards; write the manifest.

    Returns the manifest dict. Samples longer than ``max_length`` are cut to it.
    ``loaded_models`` (a dict the caller keeps) lets several calls share one loaded
    target: loading a 1T-parameter target takes far longer than a small split's work.
    """
    dataset_parquet, target_path = Path(dataset_parquet).resolve(), Path(target_path).resolve()
    cache_root = Path(cache_root).resolve()
    if batch_tokens < 1 or shard_tokens < 1 or (max_length is not None and max_length < 1):
        raise ValueError("batch_tokens, shard_tokens and max_length must be >= 1")
    if not dataset_parquet.is_file():
        raise FileNotFoundError(f"{dataset_parquet}: dataset not found")
    text_config = read_target_config(target_path)
    num_layers, hidden_size = int(text_config["num_hidden_layers"]), int(text_config["hidden_size"])
    aux_layer_ids = resolve_aux_layer_ids(aux_layer_ids, num_layers)
    torch_device = resolve_device(device)
    torch_dtype = resolve_dtype(dtype, torch_device)
    dtype_name = str(torch_dtype).removeprefix("torch.")
    log = partial(print, file=sys.stderr, flush=True)
    tag = f"extract[{split_name}]"

    lengths, totals = scan_dataset(dataset_parquet, int(text_config["vocab_size"]), max_length)
    plan = plan_shards(lengths, shard_tokens)
    cache_root.mkdir(parents=True, exist_ok=True)
    inputs = {
        "format": shards.FORMAT, "extractor_version": EXTRACTOR_VERSION,
        "dataset_sha256": cached_sha256(dataset_parquet, cache_root),
        "target_config_sha256": shards.sha256_file(target_path / "config.json"),
        "target_weights": [[p.name, p.stat().st_size, cached_sha256(p, cache_root)]
                           for p in weight_files(target_path)],
        "aux_layer_ids": aux_layer_ids, "dtype": dtype_name, "device_type": torch_device.type,
        # Batch composition changes padding and so the last bits of the results.
        "batch_tokens": batch_tokens, "shard_tokens": shard_tokens, "max_length": max_length,
    }
    key = fingerprint(inputs)
    shard_dir = cache_root / key
    shard_dir.mkdir(parents=True, exist_ok=True)
    shards.atomic_write_json(shard_dir / "fingerprint.json", {"fingerprint": key, **inputs})

    entries = {p.index: e for p in plan if (e := cached_entry(shard_dir / shards.shard_name(p.index), p))}
    total = int(lengths.sum())
    cached_tokens = sum(e["num_tokens"] for e in entries.values())
    log(f"{tag}: {len(lengths):,} samples, {total:,} tokens in {len(plan)} shards "
        f"({len(entries)} cached) -> {shard_dir}")

    models = {} if loaded_models is None else loaded_models
    model_key = (str(target_path), dtype_name, str(torch_device))

    def loaded_model():
        if model_key not in models:
            log(f"{tag}: {LOADING_LINE} {target_path} ({dtype_name} on {torch_device})")
            models[model_key] = load_target(target_path, torch_dtype, torch_device)
        return models[model_key]

    if len(entries) < len(plan):
        loaded_model()  # before the clock starts, so the rate is the extraction's own
    progress = Progress(tag, total, "tokens", done=cached_tokens)
    delay = float(os.environ.get(SHARD_DELAY_ENV, "0") or 0)

    # One shard is written (serialize, fsync, sha256) in the background while the next is
    # computed: at a few GB/s of hidden states, writing costs about as much as the forward.
    writer = ThreadPoolExecutor(max_workers=1)
    pending: tuple[int, Future] | None = None

    def finish_pending():
        nonlocal pending
        if pending is not None:
            index, future = pending
            entries[index] = future.result()
            pending = None
            if delay:
                time.sleep(delay)

    # Per computed shard, for the report's throughput plot; survives kills and resumes.
    throughput_file = Path(manifest_out).parent / THROUGHPUT_FILE
    plan_iter = iter(plan)
    current = next(plan_iter)
    rows: list[dict] = []
    row = 0
    for batch in _iter_dataset(dataset_parquet, columns=("id", "input_ids", "loss_mask")):
        # Rows of a cached shard are still read (sequentially) to check its sample ids.
        for record in batch.to_pylist():
            rows.append({"id": str(record["id"]),
                         "input_ids": record["input_ids"][:max_length],
                         "loss_mask": record["loss_mask"][:max_length]})
            row += 1
            if row < current.stop:
                continue
            path = shard_dir / shards.shard_name(current.index)
            if current.index in entries and _shard_sample_ids(path) != [r["id"] for r in rows]:
                log(f"{tag}: {path.name} holds other samples than planned; recomputing")
                progress.done -= entries.pop(current.index)["num_tokens"]
            if current.index not in entries:
                progress.extra = f"shard {current.index + 1}/{len(plan)}"
                t0 = time.monotonic()
                aux, last = _compute_shard(loaded_model(), rows, aux_layer_ids, torch_device,
                                           batch_tokens, progress)
                _record_throughput(throughput_file, split_name, key, current,
                                   time.monotonic() - t0)
                finish_pending()
                pending = current.index, writer.submit(_write_shard, path, rows, aux, last)
            rows = []
            current = next(plan_iter, None)
    finish_pending()
    writer.shutdown()
    progress.close()

    manifest = {
        "format": shards.FORMAT, "split": split_name, "target_path": str(target_path),
        "num_layers": num_layers, "hidden_size": hidden_size, "aux_layer_ids": aux_layer_ids,
        "dtype": dtype_name, "shard_dir": str(shard_dir),
        "shards": [entries[p.index] for p in plan],
        "num_samples": int(len(lengths)), "num_tokens": total, **totals,
        "max_length": max_length, "fingerprint": key,
    }
    shards.atomic_write_json(manifest_out, manifest)
    log(f"{tag}: wrote {manifest_out}")
    return manifest


def parse_layer_ids(text: str | None) -> list[int] | None:
    if text is None or text.strip().lower() in ("", "auto", "none"):
        return None
    return [int(x) for x in text.split(",") if x.strip()]


def main(argv=None) -> None:
    """CLI; every option is an individual flag (no --config-json).

    python -m eagle3flow.hidden_states --dataset results/dataset/train.parquet \\
        --target DIR --manifest results/hidden_states/train/manifest.json \\
        --cache-root cache/hidden_states [--aux-layer-ids 2,4,5] [--dtype auto] \\
        [--device auto] [--batch-tokens N] [--shard-tokens N] [--max-length N] [--split-name train]
    """
    parser = argparse.ArgumentParser(prog="python -m eagle3flow.hidden_states",
                                     description=main.__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dataset", required=True, action="append",
                        help="tokenized dataset parquet (repeat with --manifest and --split-name "
                             "to extract several splits with one loaded target)")
    parser.add_argument("--target", required=True, help="HF target model directory")
    parser.add_argument("--manifest", required=True, action="append", help="manifest.json to write")
    parser.add_argument("--cache-root", required=True, help="shards go to CACHE_ROOT/<fingerprint>/")
    parser.add_argument("--aux-layer-ids", default=None,
                        help="comma-separated; id k = input of decoder layer k (default: [2, N//2, N-3])")
    parser.add_argument("--dtype", default="auto", help="auto (float32 on CPU, bfloat16 on CUDA), "
                                                        "float32, bfloat16, float16")
    parser.add_argument("--device", default="auto", help="auto (cuda if available), cpu, cuda, cuda:N")
    parser.add_argument("--batch-tokens", type=int, default=8192, help="padded tokens per forward")
    parser.add_argument("--shard-tokens", type=int, default=32768, help="tokens per shard file")
    parser.add_argument("--max-length", type=int, default=None, help="cut longer samples")
    parser.add_argument("--split-name", action="append", default=None)
    args = parser.parse_args(argv)
    split_names = args.split_name or ["train"] * len(args.dataset)
    if not len(args.dataset) == len(args.manifest) == len(split_names):
        parser.error("give as many --manifest (and --split-name) as --dataset")
    loaded_models: dict = {}
    for dataset, manifest, split_name in zip(args.dataset, args.manifest, split_names):
        extract(dataset, args.target, manifest, args.cache_root,
                aux_layer_ids=parse_layer_ids(args.aux_layer_ids), dtype=args.dtype,
                device=args.device, batch_tokens=args.batch_tokens,
                shard_tokens=args.shard_tokens, max_length=args.max_length,
                split_name=split_name, loaded_models=loaded_models)


if __name__ == "__main__":
    main()
