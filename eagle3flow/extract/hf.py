"""Target hidden states for EAGLE-3 training: capture them with HF transformers, cache them as shards.

:func:`capture` runs the target once and returns, per token, the aux hidden states
(the inputs of decoder layers ``aux_layer_ids``, see eagle3flow/layers.py) and the
final-norm output (the teacher's logits are ``lm_head(last)``).

:func:`extract` does that for a whole tokenized dataset and writes shards (format in
docs/formats.md) under ``cache_root/<fingerprint>/``, then the manifest, in two steps
that other backends reuse: :func:`prepare` checks everything and plans before any
model loads (bad rows, layer ids, missing weights, the length policy, and with
:func:`check_disk_room` the disk), then :func:`run` computes the missing shards
(:class:`HFPipeline`: forward, device-to-host copies and disk writes overlap).

The plan is deterministic (samples in dataset order, a new shard once ``shard_tokens``
is reached), so an interrupted run resumes: a shard already on disk that verifies is
kept as is, and the model is only loaded if some shard is missing. Partitions
(``partition=(k, N)``) are runs of consecutive shards of that one plan, balanced by
tokens: N jobs (one per node) share one cache directory and their manifests merge
into the one a single job writes (``python -m eagle3flow.extract.shards merge``).
"""
from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import queue
import shutil
import sys
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import torch
from safetensors import safe_open

from eagle3flow.extract import shards
from eagle3flow.atomic import write_json
from eagle3flow.device import resolve_device
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
# Shard-sized host buffers in rotation. A buffer is held for compute + write of its
# shard, so with compute ~= write, 2 leave no slack (measured 0.82 of the bound on an
# H200), 3 absorb the jitter. Costs 3 x shard bytes of pinned memory.
STAGING_BUFFERS = 3
# Threads hashing shards (sha256 is ~1 GB/s per core; one file per thread).
HASH_THREADS = max(1, min(4, (os.cpu_count() or 1) - 1))
# Header bytes of a shard besides ~64 per sample id, for the disk projection.
SHARD_HEADER_BYTES = 4096



def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)  # sys.stderr looked up now: tests capture it


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


# The target's weights enter the cache key through a cheap fingerprint, not a hash of
# their content (minutes on a 540 GB checkpoint, single-threaded, inside the drain):
# per file its size, the sha256 of its safetensors header (tensor names, dtypes, shapes,
# offsets) and of FINGERPRINT_SAMPLES blocks of FINGERPRINT_BLOCK bytes spread over its
# data (any retraining changes them), read by a thread pool and remembered by (path,
# size, mtime, inode). No mtime in the key itself: a copy of the same weights (cp -r, a
# restore from backup) keeps its fingerprint, so finished shards are never recomputed
# for it.
FINGERPRINT_SAMPLES = 16
FINGERPRINT_BLOCK = 1 << 16
FINGERPRINT_THREADS = 8


def weight_file_fingerprint(path: Path) -> dict:
    """``{"bytes", "header_sha256", "sampled_sha256"}`` of one weight file (a few MiB read)."""
    size = path.stat().st_size
    header, data_start = b"", 0
    with open(path, "rb") as f:
        if path.name.endswith(".safetensors") and size >= 8:
            length = int.from_bytes(f.read(8), "little")
            if 0 < length <= min(size - 8, 1 << 30):
                header, data_start = f.read(length), 8 + length
        sampled = hashlib.sha256()
        span = max(0, size - data_start - FINGERPRINT_BLOCK)
        for k in range(FINGERPRINT_SAMPLES):
            f.seek(data_start + (span * k // max(1, FINGERPRINT_SAMPLES - 1) if span else 0))
            sampled.update(f.read(FINGERPRINT_BLOCK))
    return {"bytes": size, "header_sha256": hashlib.sha256(header).hexdigest() if header else None,
            "sampled_sha256": sampled.hexdigest()}


def _file_stamp(path: Path) -> list[int]:
    """What says a file is unchanged without reading it: (size, mtime, inode)."""
    st = path.stat()
    return [st.st_size, st.st_mtime_ns, st.st_ino]


def _read_memo(memo_file: Path) -> dict:
    """A memo of per-file results keyed by path; empty when missing or unreadable."""
    try:
        with open(memo_file) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


def target_weights_fingerprint(target_path: Path, cache_root: Path) -> list[list]:
    """``[[file name, bytes, header sha256, sampled sha256], ...]`` of every weight file,
    in parallel, remembered in ``cache_root/weights_fingerprint.json`` by (path, size,
    mtime, inode): a rerun only stats the files."""
    files = weight_files(target_path)
    memo_file = cache_root / "weights_fingerprint.json"
    memo = _read_memo(memo_file)
    stamps = {p: _file_stamp(p) for p in files}
    todo = [p for p in files if (memo.get(str(p.resolve())) or {}).get("stamp") != stamps[p]]
    if todo:
        with ThreadPoolExecutor(max_workers=min(FINGERPRINT_THREADS, len(todo))) as pool:
            for p, fp in zip(todo, pool.map(weight_file_fingerprint, todo)):
                memo[str(p.resolve())] = {"stamp": stamps[p], **fp}
        write_json(memo_file, memo)
    out = []
    for p in files:
        m = memo[str(p.resolve())]
        out.append([p.name, m["bytes"], m["header_sha256"], m["sampled_sha256"]])
    return out


def cached_sha256(path: Path, cache_root: Path) -> str:
    """sha256 of a file, remembered by (path, size, mtime, inode) like git's index.

    The target's weights are hashed once (seconds to minutes); later runs only stat
    them, so a fully cached rerun reads neither the weights nor the model.
    """
    key = str(path.resolve())
    stamp = _file_stamp(path)
    memo_file = cache_root / "file_sha256.json"
    memo = _read_memo(memo_file)
    hit = memo.get(key)
    if hit and hit.get("stamp") == stamp:
        return hit["sha256"]
    digest = shards.sha256_file(path)
    memo[key] = {"stamp": stamp, "sha256": digest}
    write_json(memo_file, memo)
    return digest


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
LENGTH_POLICIES = ("truncate", "drop")


@dataclass
class ShardPlan:
    index: int
    start: int        # first dataset row
    stop: int         # one past the last row
    num_tokens: int   # after the length policy
    num_samples: int  # rows of [start, stop) kept by the length policy


@dataclass
class DatasetScan:
    """Per dataset row: tokens used (0 = dropped by the length policy), assistant tokens
    used, and whether it was truncated. Arrays ``[rows]``."""
    lengths: np.ndarray
    loss_tokens: np.ndarray
    truncated: np.ndarray

    def totals(self, start: int = 0, stop: int | None = None) -> dict:
        rows = slice(start, stop)
        return {"num_loss_tokens": int(self.loss_tokens[rows].sum()),
                "truncated_samples": int(self.truncated[rows].sum()),
                "dropped_samples": int((self.lengths[rows] == 0).sum())}


def _iter_dataset(path: Path, columns=REQUIRED_COLUMNS, batch_rows: int = 1024,
                  start: int = 0, stop: int | None = None):
    """``(first_row, record batch)`` of the dataset, read incrementally (one batch in memory);
    row groups wholly outside ``[start, stop)`` are not read."""
    parquet = pq.ParquetFile(str(path))
    missing = [c for c in REQUIRED_COLUMNS if c not in parquet.schema_arrow.names]
    if missing:
        raise ValueError(f"{path}: missing columns {missing} (docs/formats.md, tokenized dataset)")
    stop = parquet.metadata.num_rows if stop is None else stop
    groups, first_row, row = [], None, 0
    for g in range(parquet.metadata.num_row_groups):
        n = parquet.metadata.row_group(g).num_rows
        if row < stop and row + n > start:
            groups.append(g)
            first_row = row if first_row is None else first_row
        row += n
    if not groups:
        return
    row = first_row
    for batch in parquet.iter_batches(batch_size=batch_rows, row_groups=groups, columns=list(columns)):
        yield row, batch
        row += batch.num_rows


def scan_dataset(path: Path, vocab_size: int, max_length: int | None,
                 length_policy: str = "truncate") -> DatasetScan:
    """Check every row; return per-row token counts after the length policy.

    Rows longer than ``max_length`` are cut to it (``truncate``) or left out (``drop``,
    length 0). Fails naming the row (id) on lists of unequal length, a wrong
    ``num_tokens``, an empty sample or a token id outside the target's vocab: cheaper
    here than mid-run.
    """
    if length_policy not in LENGTH_POLICIES:
        raise ValueError(f"length_policy {length_policy!r}: expected one of {LENGTH_POLICIES}")
    lengths, loss_tokens, truncated, rows = [], [], [], 0
    for row, batch in _iter_dataset(path):
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
        n_ids = n_ids.astype(np.int64)
        too_long = n_ids > max_length if max_length is not None else np.zeros(len(n_ids), bool)
        if max_length is not None:
            mask_col = pc.list_slice(mask_col, 0, max_length)
            n_ids = np.minimum(n_ids, max_length)
        loss = np.array([sum(m) for m in mask_col.to_pylist()], np.int64) if len(n_ids) else n_ids
        if length_policy == "drop":
            n_ids = np.where(too_long, 0, n_ids)
            loss = np.where(too_long, 0, loss)
        lengths.append(n_ids)
        loss_tokens.append(loss)
        truncated.append(too_long & (length_policy == "truncate"))
        rows += batch.num_rows
    if rows == 0:
        raise ValueError(f"{path}: the dataset is empty")
    scan = DatasetScan(np.concatenate(lengths), np.concatenate(loss_tokens), np.concatenate(truncated))
    if not scan.lengths.any():
        raise ValueError(f"{path}: all {rows} samples are longer than {max_length} tokens and "
                         f"length_policy is drop; nothing to extract")
    return scan


def plan_shards(lengths: np.ndarray, shard_tokens: int) -> list[ShardPlan]:
    """Consecutive rows per shard; a shard closes once it holds >= ``shard_tokens``.

    Rows of length 0 (dropped) belong to a shard's row range but hold no sample.
    """
    plan, start, tokens, samples = [], 0, 0, 0
    for row, n in enumerate(lengths.tolist()):
        tokens += n
        samples += n > 0
        if tokens >= shard_tokens:
            plan.append(ShardPlan(len(plan), start, row + 1, tokens, samples))
            start, tokens, samples = row + 1, 0, 0
    if tokens:
        plan.append(ShardPlan(len(plan), start, len(lengths), tokens, samples))
    return plan


def plan_partitions(plan: list[ShardPlan], count: int) -> list[list[ShardPlan]]:
    """Split the shards into ``count`` runs of consecutive shards with about equal tokens.

    A shard goes to the partition its token midpoint falls in, so the split depends
    only on the plan (deterministic, no communication between nodes); with fewer
    shards than partitions some partitions are empty.
    """
    if count < 1:
        raise ValueError(f"partitions must be >= 1, got {count}")
    total = sum(p.num_tokens for p in plan)
    parts: list[list[ShardPlan]] = [[] for _ in range(count)]
    done = 0
    for shard in plan:
        midpoint = done + shard.num_tokens / 2
        parts[min(count - 1, int(midpoint * count / total))].append(shard)
        done += shard.num_tokens
    return parts


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


# ----------------------------------------------------------------------------- extraction plan

def fingerprint(inputs: dict) -> str:
    return hashlib.sha256(json.dumps(inputs, sort_keys=True).encode()).hexdigest()[:20]


def throughput_path(manifest_path: Path) -> Path:
    """The throughput log beside a manifest: ``throughput.jsonl`` for ``manifest.json``,
    ``<stem>.throughput.jsonl`` for a partition's (merged by ``python -m eagle3flow.extract.shards merge``)."""
    manifest_path = Path(manifest_path)
    if manifest_path.name == "manifest.json":
        return manifest_path.parent / THROUGHPUT_FILE
    return manifest_path.with_name(f"{manifest_path.stem}.{THROUGHPUT_FILE}")


def partition_manifest_name(index: int, count: int) -> str:
    return f"part-{index}-of-{count}.json"


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
    if entry["num_samples"] != plan.num_samples or entry["num_tokens"] != plan.num_tokens:
        return None
    if not recorded:
        write_json(_entry_file(shard_path), entry)
    return entry


@dataclass
class Extraction:
    """One split's extraction (one partition of it), decided and checked before any model loads."""
    split_name: str
    dataset: Path
    target_path: Path
    manifest_out: Path
    shard_dir: Path
    key: str                        # the cache fingerprint
    num_layers: int
    hidden_size: int
    aux_layer_ids: list[int]
    device: torch.device
    dtype: torch.dtype              # compute dtype
    storage_dtype: str              # the compute dtype's name, or "float8_e4m3fn"
    batch_tokens: int
    max_length: int | None          # min(configured max_length, target context)
    length_policy: str
    scan: DatasetScan
    plan: list[ShardPlan]           # this partition's shards
    partition: tuple[int, int]      # (index, count)
    entries: dict[int, dict]        # shard index -> manifest entry, for shards already on disk

    @property
    def dtype_name(self) -> str:
        return str(self.dtype).removeprefix("torch.")

    @property
    def tag(self) -> str:
        k, n = self.partition
        return f"extract[{self.split_name}]" + (f"[part-{k}-of-{n}]" if n > 1 else "")

    @property
    def missing(self) -> list[ShardPlan]:
        return [p for p in self.plan if p.index not in self.entries]

    @property
    def bytes_per_token(self) -> int:
        return shards.bytes_per_token(len(self.aux_layer_ids), self.hidden_size, self.storage_dtype)

    def projected_bytes(self) -> int:
        """Disk the missing shards will take: tokens x bytes/token + a header per shard."""
        missing = self.missing
        return (sum(p.num_tokens for p in missing) * self.bytes_per_token
                + sum(SHARD_HEADER_BYTES + 64 * p.num_samples for p in missing))

    def rows(self) -> tuple[int, int]:
        return (self.plan[0].start, self.plan[-1].stop) if self.plan else (0, 0)

    def manifest(self) -> dict:
        start, stop = self.rows()
        return {
            "format": shards.FORMAT, "split": self.split_name, "target_path": str(self.target_path),
            "num_layers": self.num_layers, "hidden_size": self.hidden_size,
            "aux_layer_ids": self.aux_layer_ids, "dtype": self.dtype_name,
            "storage_dtype": self.storage_dtype, "bytes_per_token": self.bytes_per_token,
            "shard_dir": str(self.shard_dir), "shards": [self.entries[p.index] for p in self.plan],
            "num_samples": sum(p.num_samples for p in self.plan),
            "num_tokens": sum(p.num_tokens for p in self.plan),
            **self.scan.totals(start, stop),
            "max_length": self.max_length, "length_policy": self.length_policy,
            "fingerprint": self.key,
            "partition": {"index": self.partition[0], "count": self.partition[1]},
        }

    def write_manifest(self) -> dict:
        """Write the manifest (last: it is the rule's declared output) and return it."""
        manifest = self.manifest()
        write_json(self.manifest_out, manifest)
        log(f"{self.tag}: wrote {self.manifest_out}")
        return manifest


def prepare(dataset_parquet, target_path, manifest_out, cache_root, aux_layer_ids=None,
            dtype: str = "auto", device: str = "auto", batch_tokens: int = 8192,
            shard_tokens: int = 32768, max_length: int | None = None,
            length_policy: str = "truncate", storage_dtype: str = "auto",
            split_name: str = "train", partition: tuple[int, int] = (0, 1),
            fingerprint_extra: dict | None = None) -> Extraction:
    """Everything before the model: check the inputs, plan the shards, find the cached ones.

    Fails early, naming the file/row/field, on a missing dataset or target, a target
    without weights, layer ids out of range, a bad row or an empty dataset. Samples
    longer than ``max_length`` or the target's context (``max_position_embeddings``)
    follow ``length_policy``. ``partition = (k, N)``: only the k-th of N runs of shards
    (:func:`plan_partitions`). ``fingerprint_extra`` (e.g. another backend's name) goes
    into the cache key.
    """
    dataset_parquet, target_path = Path(dataset_parquet).resolve(), Path(target_path).resolve()
    cache_root = Path(cache_root).resolve()
    if batch_tokens < 1 or shard_tokens < 1 or (max_length is not None and max_length < 1):
        raise ValueError("batch_tokens, shard_tokens and max_length must be >= 1")
    k, n = partition
    if not 0 <= k < n:
        raise ValueError(f"partition {k} of {n}: expected 0 <= index < count")
    if not dataset_parquet.is_file():
        raise FileNotFoundError(f"{dataset_parquet}: dataset not found")
    text_config = read_target_config(target_path)
    num_layers, hidden_size = int(text_config["num_hidden_layers"]), int(text_config["hidden_size"])
    aux_layer_ids = resolve_aux_layer_ids(aux_layer_ids, num_layers)
    torch_device = resolve_device(device)
    torch_dtype = resolve_dtype(dtype, torch_device)
    dtype_name = str(torch_dtype).removeprefix("torch.")
    if storage_dtype in ("auto", None, dtype_name):
        storage = dtype_name
    elif shards.is_fp8(storage_dtype):
        storage = "float8_e4m3fn"
    else:
        raise ValueError(f"storage_dtype {storage_dtype!r}: expected auto (= the compute dtype) or fp8")
    context = text_config.get("max_position_embeddings")
    limit = min(x for x in (max_length, context) if x is not None) if (max_length or context) else None

    scan = scan_dataset(dataset_parquet, int(text_config["vocab_size"]), limit, length_policy)
    plan = plan_partitions(plan_shards(scan.lengths, shard_tokens), n)[k]
    cache_root.mkdir(parents=True, exist_ok=True)
    inputs = {
        "format": shards.FORMAT, "extractor_version": EXTRACTOR_VERSION,
        "dataset_sha256": cached_sha256(dataset_parquet, cache_root),
        "target_config_sha256": shards.sha256_file(target_path / "config.json"),
        "target_weights_fingerprint": target_weights_fingerprint(target_path, cache_root),
        "aux_layer_ids": aux_layer_ids, "dtype": dtype_name, "device_type": torch_device.type,
        # Batch composition changes padding and so the last bits of the results. The
        # partition count does not enter: partitions share one plan and one cache.
        "batch_tokens": batch_tokens, "shard_tokens": shard_tokens, "max_length": limit,
        **({"length_policy": length_policy} if length_policy != "truncate" else {}),
        **({"storage_dtype": storage} if storage != dtype_name else {}),
        **(fingerprint_extra or {}),
    }
    key = fingerprint(inputs)
    shard_dir = cache_root / key
    shard_dir.mkdir(parents=True, exist_ok=True)
    write_json(shard_dir / "fingerprint.json", {"fingerprint": key, **inputs})
    # Checksums of finished shards, several at once (a rerun re-reads every finished shard).
    with ThreadPoolExecutor(max_workers=HASH_THREADS) as pool:
        found = pool.map(lambda p: cached_entry(shard_dir / shards.shard_name(p.index), p), plan)
        entries = {p.index: e for p, e in zip(plan, found) if e}
    extraction = Extraction(
        split_name=split_name, dataset=dataset_parquet, target_path=target_path,
        manifest_out=Path(manifest_out), shard_dir=shard_dir, key=key, num_layers=num_layers,
        hidden_size=hidden_size, aux_layer_ids=aux_layer_ids, device=torch_device, dtype=torch_dtype,
        storage_dtype=storage, batch_tokens=batch_tokens, max_length=limit,
        length_policy=length_policy, scan=scan, plan=plan, partition=(k, n), entries=entries)
    totals = scan.totals(*extraction.rows())
    tokens, samples = sum(p.num_tokens for p in plan), sum(p.num_samples for p in plan)
    log(f"{extraction.tag}: {samples:,} samples, {tokens:,} tokens "
        f"in {len(plan)} shards ({len(entries)} cached), {extraction.bytes_per_token:,} bytes/token "
        f"({storage}) -> {shard_dir}")
    if totals["truncated_samples"] or totals["dropped_samples"]:
        rows = slice(*extraction.rows())
        ids = _row_ids(dataset_parquet, np.flatnonzero(scan.lengths[rows] == 0)[:5] + rows.start)
        log(f"{extraction.tag}: over {limit} tokens (max_length / the target's context "
            f"{context}): {totals['truncated_samples']} truncated, {totals['dropped_samples']} "
            f"dropped{' (e.g. ' + ', '.join(ids) + ')' if ids else ''}")
    return extraction


def _row_ids(path: Path, rows) -> list[str]:
    if not len(rows):
        return []
    table = pq.read_table(str(path), columns=["id"])
    return [str(table.column("id")[int(r)]) for r in rows]


def check_disk_room(extractions: list[Extraction]) -> None:
    """Fail before any model loads when the cache's disk cannot hold the missing shards.

    Projected from the dataset's token counts x bytes/token (docs/formats.md) against
    ``shutil.disk_usage`` of each cache root (splits sharing a disk are summed).
    """
    need: dict[Path, list[Extraction]] = {}
    for e in extractions:
        need.setdefault(e.shard_dir.parent, []).append(e)
    for root, group in need.items():
        projected = sum(e.projected_bytes() for e in group)
        free = shutil.disk_usage(root).free
        if projected > free:
            detail = "; ".join(f"{e.tag}: {sum(p.num_tokens for p in e.missing):,} tokens x "
                               f"{e.bytes_per_token:,} bytes" for e in group)
            raise OSError(
                f"{root}: {free / 2**30:,.1f} GiB free, but the shards still to extract need about "
                f"{projected / 2**30:,.1f} GiB ({detail}). Free space, move paths.cache, or set "
                f"extract.storage_dtype: fp8 (half the bytes).")


# ----------------------------------------------------------------------------- pipeline

@dataclass
class _Staging:
    """Host memory one shard's hidden states are copied into (pinned on CUDA).

    ``aux [cap, A*H]``, ``last [cap, H]`` in the storage dtype; in fp8 also
    ``aux_scale [cap, A]``, ``last_scale [cap, 1]`` float32.
    """
    aux: torch.Tensor
    last: torch.Tensor
    aux_scale: torch.Tensor | None
    last_scale: torch.Tensor | None

    @classmethod
    def allocate(cls, rows: int, num_aux: int, hidden: int, dtype: torch.dtype, fp8: bool, pin: bool):
        store = shards.FP8 if fp8 else dtype
        empty = partial(torch.empty, pin_memory=pin)
        return cls(empty(rows, num_aux * hidden, dtype=store), empty(rows, hidden, dtype=store),
                   empty(rows, num_aux, dtype=torch.float32) if fp8 else None,
                   empty(rows, 1, dtype=torch.float32) if fp8 else None)


class BackgroundWriter:
    """Writes finished shards on one thread, fed through a bounded queue.

    Jobs are callables; the first exception stops the writer and is raised again by
    the next :meth:`submit` or by :meth:`close`, so a full disk fails the run.
    """

    def __init__(self, depth: int = 1):
        self.jobs: queue.Queue = queue.Queue(maxsize=depth)
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name="shard-writer", daemon=True)
        self.thread.start()

    def _run(self):
        while (job := self.jobs.get()) is not None:
            if self.error is None:
                try:
                    job()
                except BaseException as error:  # re-raised in the main thread
                    self.error = error

    def check(self):
        if self.error is not None:
            raise RuntimeError(f"writing a shard failed: {self.error}") from self.error

    def submit(self, job) -> None:
        self.check()
        self.jobs.put(job)

    def close(self) -> None:
        self.jobs.put(None)
        self.thread.join()
        self.check()


class HFPipeline:
    """Computes shards with an HF model and hands them to a background writer.

    Per batch: forward on the compute stream; the real tokens (padding dropped) are
    quantized there when storing fp8, then copied on a second CUDA stream, once the
    compute stream's event says they are ready, straight into a pinned staging buffer
    at their place in the shard (dataset order). When a shard's last copy is queued,
    the writer gets the buffer and an event; it waits on that event only. Buffers
    rotate (:data:`STAGING_BUFFERS`), so the GPU computes shard k+1 while the disk takes
    shard k: throughput is about min(compute, disk), and the pool is the bounded queue
    (backpressure). Checksums are computed by other threads from the written files.
    """

    def __init__(self, model, extraction: Extraction, progress: Progress,
                 buffers: int = STAGING_BUFFERS):
        self.model, self.x, self.progress = model, extraction, progress
        self.cuda = extraction.device.type == "cuda"
        self.fp8 = shards.is_fp8(extraction.storage_dtype)
        self.copy_stream = torch.cuda.Stream(extraction.device) if self.cuda else None
        # Any planned shard may turn out to need computing (other samples than planned).
        self.capacity = max(p.num_tokens for p in extraction.plan)
        # Pinning GBs takes ~1 s/GB: the first buffer now, the others on a thread while
        # the GPU works on the first shards.
        self.free: queue.Queue = queue.Queue()
        self.free.put(self._allocate())
        self.allocator = threading.Thread(
            target=lambda: [self.free.put(self._allocate()) for _ in range(buffers - 1)],
            name="staging-allocator", daemon=True)
        self.allocator.start()
        self.writer = BackgroundWriter(depth=buffers)
        # sha256 (~1 GB/s a core) would cap a fast disk: finished files are hashed here,
        # several at once, from the page cache, while the writer goes on.
        self.hasher = ThreadPoolExecutor(max_workers=HASH_THREADS, thread_name_prefix="shard-sha256")
        self.hashing: list[Future] = []
        self.delay = float(os.environ.get(SHARD_DELAY_ENV, "0") or 0)
        # (event, shard, perf_counter) per step of each shard, for benchmarks/extract_throughput.py.
        self.timeline: list[tuple[str, int, float]] = []

    def _allocate(self) -> _Staging:
        return _Staging.allocate(self.capacity, len(self.x.aux_layer_ids), self.x.hidden_size,
                                 self.x.dtype, self.fp8, pin=self.cuda)

    def _take_buffer(self) -> _Staging:
        while True:  # wait for the writer to hand a buffer back, unless it died
            self.writer.check()
            try:
                return self.free.get(timeout=1.0)
            except queue.Empty:
                continue

    def _mark(self, what: str, shard: int) -> None:
        self.timeline.append((what, shard, time.perf_counter()))

    def compute(self, plan: ShardPlan, rows: list[dict], path: Path) -> None:
        """Queue one shard: ``rows`` are its kept samples in dataset order."""
        self._mark("wait_buffer", plan.index)
        buf = self._take_buffer()
        self._mark("queue_compute", plan.index)
        lengths = [len(r["input_ids"]) for r in rows]
        offsets = np.concatenate([[0], np.cumsum(lengths)]).tolist()
        hidden, num_aux = self.x.hidden_size, len(self.x.aux_layer_ids)
        for batch in length_batches(lengths, self.x.batch_tokens):
            width = lengths[batch[0]]
            ids = torch.zeros(len(batch), width, dtype=torch.long)
            mask = torch.zeros(len(batch), width, dtype=torch.long)
            for b, i in enumerate(batch):
                ids[b, :lengths[i]] = torch.as_tensor(rows[i]["input_ids"], dtype=torch.long)
                mask[b, :lengths[i]] = 1
            device = self.x.device
            aux, last = capture(self.model, ids.to(device, non_blocking=True),
                                mask.to(device, non_blocking=True), self.x.aux_layer_ids)
            outputs = {"aux": aux, "last": last}
            if self.fp8:
                outputs["aux"], outputs["aux_scale"] = shards.quantize_fp8(aux, num_aux)
                outputs["last"], outputs["last_scale"] = shards.quantize_fp8(last, 1)
            self._copy_out(outputs, buf, batch, lengths, offsets)
            self.progress.update(sum(lengths[i] for i in batch))
        done = None
        if self.cuda:
            done = torch.cuda.Event()
            done.record(self.copy_stream)
        self._mark("queued", plan.index)
        self.writer.submit(partial(self._write, plan, rows, buf, done, path, offsets[-1]))

    def _copy_out(self, outputs: dict, buf: _Staging, batch, lengths, offsets) -> None:
        """Real tokens of each sample -> its rows of the staging buffer (async on CUDA)."""
        if self.cuda:
            ready = torch.cuda.Event()
            ready.record()  # on the compute stream, after the forward (and quantization)
            self.copy_stream.wait_event(ready)
            context = torch.cuda.stream(self.copy_stream)
        else:
            context = contextlib.nullcontext()
        with context:
            for name, source in outputs.items():
                target = getattr(buf, name)
                for b, i in enumerate(batch):
                    target[offsets[i]:offsets[i] + lengths[i]].copy_(source[b, :lengths[i]],
                                                                      non_blocking=self.cuda)
        if self.cuda:
            for source in outputs.values():
                source.record_stream(self.copy_stream)  # not reused before the copy ran

    def _write(self, plan: ShardPlan, rows, buf: _Staging, done, path: Path, tokens: int) -> None:
        """Writer thread: wait for the shard's copies, write it, hand the buffer back, queue its hash."""
        try:
            if done is not None:
                done.synchronize()
            self._mark("copied", plan.index)
            lengths = [len(r["input_ids"]) for r in rows]
            cu = torch.zeros(len(rows) + 1, dtype=torch.int64)
            cu[1:] = torch.cumsum(torch.tensor(lengths, dtype=torch.int64), 0)
            input_ids = torch.tensor([t for r in rows for t in r["input_ids"]], dtype=torch.int32)
            loss_mask = torch.tensor([t for r in rows for t in r["loss_mask"]], dtype=torch.uint8)
            entry = shards.write_packed_shard(
                path, [r["id"] for r in rows], input_ids, loss_mask, cu,
                buf.aux[:tokens], buf.last[:tokens],
                aux_scale=buf.aux_scale[:tokens] if self.fp8 else None,
                last_scale=buf.last_scale[:tokens] if self.fp8 else None,
                compute_dtype=self.x.dtype_name, checksum=False)
        finally:
            self.free.put(buf)
        self._mark("written", plan.index)
        self.hashing.append(self.hasher.submit(self._record_entry, plan, path, entry))
        if self.delay:
            time.sleep(self.delay)

    def _record_entry(self, plan: ShardPlan, path: Path, entry: dict) -> None:
        entry["sha256"] = shards.sha256_file(path)
        # Recorded beside the shard so a resumed run can check the file's bytes, not just its
        # shape (a shard killed before this line gets its entry from the file on resume).
        write_json(_entry_file(path), entry)
        self.x.entries[plan.index] = entry
        self._mark("hashed", plan.index)

    def close(self) -> None:
        try:
            self.allocator.join()
            self.writer.close()
        finally:
            for job in self.hashing:
                job.result()
            self.hasher.shutdown()


def _record_throughput(path: Path, x: Extraction, plan: ShardPlan, compute_s: float) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        f.write(json.dumps({"split": x.split_name, "fingerprint": x.key, "shard": plan.index,
                            "num_tokens": plan.num_tokens, "compute_s": compute_s,
                            "finished_at": time.time()}) + "\n")


def _iter_shard_rows(x: Extraction):
    """``(plan, kept rows)`` per shard of the extraction, reading the dataset once, in order."""
    if not x.plan:
        return
    start, stop = x.rows()
    plans = iter(x.plan)
    current = next(plans)
    rows: list[dict] = []
    for first, batch in _iter_dataset(x.dataset, ("id", "input_ids", "loss_mask"), start=start, stop=stop):
        for offset, record in enumerate(batch.to_pylist()):
            row = first + offset
            if row < start or current is None:
                continue
            n = int(x.scan.lengths[row])
            if n:
                rows.append({"id": str(record["id"]), "input_ids": record["input_ids"][:n],
                             "loss_mask": record["loss_mask"][:n]})
            if row + 1 == current.stop:
                yield current, rows
                rows = []
                current = next(plans, None)


def shards_to_compute(x: Extraction, progress: Progress):
    """``(plan, rows, path)`` of every planned shard of ``x`` that is not cached, in order.

    The rows of a cached shard are still read (sequentially) to check its sample ids: a
    cached shard holding other samples than planned is dropped from ``x.entries`` (and
    from ``progress``) and yielded to be recomputed.
    """
    for plan, rows in _iter_shard_rows(x):
        path = x.shard_dir / shards.shard_name(plan.index)
        if plan.index in x.entries and _shard_sample_ids(path) != [r["id"] for r in rows]:
            log(f"{x.tag}: {path.name} holds other samples than planned; recomputing")
            progress.done -= x.entries.pop(plan.index)["num_tokens"]
        if plan.index in x.entries:
            continue
        progress.extra = f"shard {plan.index + 1 - x.plan[0].index}/{len(x.plan)}"
        yield plan, rows, path


def run(x: Extraction, loaded_models: dict | None = None, timeline: list | None = None) -> dict:
    """Compute the extraction's missing shards with the HF backend; write its manifest."""
    models = {} if loaded_models is None else loaded_models
    model_key = model_cache_key(x.target_path, x.dtype, x.device)
    cached_tokens = sum(e["num_tokens"] for e in x.entries.values())
    total = sum(p.num_tokens for p in x.plan)

    def loaded_model():
        if model_key not in models:
            log(f"{x.tag}: {LOADING_LINE} {x.target_path} ({x.dtype_name} on {x.device})")
            models[model_key] = load_target(x.target_path, x.dtype, x.device)
        return models[model_key]

    if x.missing:
        loaded_model()  # before the clock starts, so the rate is the extraction's own
    progress = Progress(x.tag, total, "tokens", done=cached_tokens)
    # Per computed shard, for the report's throughput plot; survives kills and resumes.
    throughput_log = throughput_path(x.manifest_out)
    pipeline = None
    try:
        for plan, rows, path in shards_to_compute(x, progress):
            if pipeline is None:
                pipeline = HFPipeline(loaded_model(), x, progress)
                if timeline is not None:
                    pipeline.timeline = timeline
            t0 = time.monotonic()
            pipeline.compute(plan, rows, path)
            _record_throughput(throughput_log, x, plan, time.monotonic() - t0)
    finally:
        if pipeline is not None:
            pipeline.close()
    progress.close()
    return x.write_manifest()


def model_cache_key(target_path, dtype: torch.dtype, device: torch.device) -> tuple:
    """Key of a loaded target in ``loaded_models`` (a caller may put an already built model there)."""
    return str(Path(target_path).resolve()), str(dtype).removeprefix("torch."), str(device)


def _shard_sample_ids(path: Path) -> list[str]:
    with safe_open(str(path), "pt") as f:
        return json.loads((f.metadata() or {}).get("sample_ids", "[]"))


def extract(dataset_parquet, target_path, manifest_out, cache_root, aux_layer_ids=None,
            dtype: str = "auto", device: str = "auto", batch_tokens: int = 8192,
            shard_tokens: int = 32768, max_length: int | None = None,
            length_policy: str = "truncate", storage_dtype: str = "auto",
            split_name: str = "train", partition: tuple[int, int] = (0, 1),
            loaded_models: dict | None = None) -> dict:
    """Extract hidden states of every dataset sample into cached shards; write the manifest.

    :func:`prepare` (all checks, the plan, the disk check) then :func:`run`. Returns
    the manifest dict. ``loaded_models`` (a dict the caller keeps) lets several calls
    share one loaded target: loading a 1T-parameter target takes far longer than a
    small split's work.
    """
    x = prepare(dataset_parquet, target_path, manifest_out, cache_root, aux_layer_ids, dtype,
                device, batch_tokens, shard_tokens, max_length, length_policy, storage_dtype,
                split_name, partition)
    check_disk_room([x])
    return run(x, loaded_models)


def resolve_backend(device: str) -> str:
    """extract.backend auto: the vLLM engine (tensor parallel over the node) where this job
    sees several CUDA devices, else transformers on the one device (or the CPU)."""
    visible = torch.cuda.device_count() if device != "cpu" and torch.cuda.is_available() else 0
    backend = "vllm" if visible > 1 else "hf"
    log(f"backend auto: {backend} ({visible} CUDA device(s) visible)")
    return backend


def parse_layer_ids(text: str | None) -> list[int] | None:
    if text is None or text.strip().lower() in ("", "auto", "none"):
        return None
    return [int(x) for x in text.split(",") if x.strip()]


def main(argv=None) -> None:
    """CLI; every option is an individual flag (no --config-json).

    python -m eagle3flow.extract.hf --dataset results/dataset/train.parquet \\
        --target DIR --manifest results/hidden_states/train/manifest.json \\
        --cache-root cache/hidden_states [--aux-layer-ids 2,4,5] [--dtype auto] \\
        [--storage-dtype auto|fp8] [--device auto] [--batch-tokens N] [--shard-tokens N] \\
        [--max-length N] [--length-policy truncate|drop] [--partition K --partitions N] \\
        [--split-name train]

    With --partitions N, this job extracts only the K-th of N runs of shards (0-based)
    and its manifest lists only those; `python -m eagle3flow.extract.shards merge` joins them.
    """
    parser = argparse.ArgumentParser(prog="python -m eagle3flow.extract.hf",
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
    parser.add_argument("--storage-dtype", default="auto",
                        help="auto (= --dtype) or fp8 (float8_e4m3fn, per-token scales: half the disk)")
    parser.add_argument("--device", default="auto", help="auto (cuda if available), cpu, cuda, cuda:N")
    parser.add_argument("--batch-tokens", type=int, default=8192, help="padded tokens per forward")
    parser.add_argument("--shard-tokens", type=int, default=32768, help="tokens per shard file")
    parser.add_argument("--max-length", type=int, default=None,
                        help="longest sample (the target's context caps it too)")
    parser.add_argument("--length-policy", choices=LENGTH_POLICIES, default="truncate",
                        help="samples over the longest: cut them or leave them out")
    parser.add_argument("--partition", type=int, default=0, help="this job's partition (0-based)")
    parser.add_argument("--partitions", type=int, default=1, help="number of partitions")
    parser.add_argument("--split-name", action="append", default=None)
    parser.add_argument("--backend", choices=("auto", "hf", "vllm"), default="hf",
                        help="hf: transformers in this process (one device); vllm: a vLLM engine "
                             "(eagle3flow/extract/vllm.py), tensor parallel; auto: vllm when this job "
                             "sees several CUDA devices, else hf")
    parser.add_argument("--tensor-parallel-size", type=int, default=None,
                        help="vllm backend: GPUs the target is split over (default: all visible; 1 on CPU)")
    args = parser.parse_args(argv)
    split_names = args.split_name or ["train"] * len(args.dataset)
    if not len(args.dataset) == len(args.manifest) == len(split_names):
        parser.error("give as many --manifest (and --split-name) as --dataset")
    if args.backend == "auto":
        args.backend = resolve_backend(args.device)
    vllm_extract = None
    if args.backend == "vllm":  # vLLM itself is imported only when the engine starts
        from eagle3flow.extract import vllm as vllm_extract
    # Every split is checked and planned, and the disk checked for all of them,
    # before the target loads (minutes for a large one).
    extractions = [
        prepare(dataset, args.target, manifest, args.cache_root,
                aux_layer_ids=parse_layer_ids(args.aux_layer_ids), dtype=args.dtype,
                device=args.device, batch_tokens=args.batch_tokens,
                shard_tokens=args.shard_tokens, max_length=args.max_length,
                length_policy=args.length_policy, storage_dtype=args.storage_dtype,
                split_name=split_name, partition=(args.partition, args.partitions),
                fingerprint_extra=vllm_extract.FINGERPRINT if vllm_extract else None)
        for dataset, manifest, split_name in zip(args.dataset, args.manifest, split_names)]
    check_disk_room(extractions)
    if vllm_extract:
        vllm_extract.run_all(extractions, args.tensor_parallel_size)
        return
    loaded_models: dict = {}
    for x in extractions:
        run(x, loaded_models)


if __name__ == "__main__":
    main()
