"""One split's extraction, backend-neutral: checked and planned before any model loads.

:func:`prepare` checks everything and plans (bad rows, layer ids, missing weights,
the length policy: eagle3flow/extract/dataset_scan.py; which rows go in which shard:
eagle3flow/extract/shard_plan.py; which shards are cached: eagle3flow/extract/cache.py)
and returns an :class:`Extraction`; :func:`check_disk_room` checks the disk for all
splits at once. A backend (eagle3flow/extract/hf.py, eagle3flow/extract/vllm.py) then
computes what :func:`shards_to_compute` yields, appends to the throughput log, and
writes the manifest with :meth:`Extraction.write_manifest`.
"""
from __future__ import annotations

import os
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from eagle3flow.device import resolve_device
from eagle3flow.atomic import sweep_stale_temporaries, write_json
from eagle3flow.extract import shards
from eagle3flow.extract.cache import (WEIGHT_SUFFIXES, cached_entries, cached_sha256, fingerprint,
                                      shard_sample_ids, weight_files)
from eagle3flow.extract.dataset_scan import DatasetScan, iter_dataset, row_ids, scan_dataset
from eagle3flow.extract.shard_plan import ShardPlan, plan_partitions, plan_shards
from eagle3flow.layers import resolve_aux_layer_ids
from eagle3flow.progress import Progress
from eagle3flow.target.config import load_target_config
from eagle3flow.target.identity import target_digest
from eagle3flow.target.remote_code import check_remote_code

# Bump when the way shards are computed changes, so old caches are not reused.
EXTRACTOR_VERSION = 1
DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
          "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}
# Seconds to sleep after each written shard; lets tests kill a run between shards.
SHARD_DELAY_ENV = "EAGLE3FLOW_TEST_SHARD_DELAY"
LOADING_LINE = "loading target"
# Header bytes of a shard besides ~64 per sample id, for the disk projection.
SHARD_HEADER_BYTES = 4096


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)  # sys.stderr looked up now: tests capture it


def read_target_config(target_path: str | os.PathLike) -> dict:
    """The target's config.json (its ``text_config`` when nested); checks that weights are there."""
    target = Path(target_path)
    config_file = target / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(f"{config_file}: missing; --target must be an HF model directory")
    if not weight_files(target):
        raise FileNotFoundError(
            f"{target}: no weight files (*{', *'.join(WEIGHT_SUFFIXES)}); is the download complete?")
    text = load_target_config(target)
    for key in ("num_hidden_layers", "hidden_size", "vocab_size"):
        if key not in text:
            raise ValueError(f"{config_file}: no '{key}' (nor text_config.{key})")
    return text


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r}: expected auto or one of {sorted(DTYPES)}")
    return DTYPES[dtype]


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
    # target.trust_remote_code: how the target loads, not what it computes (not in the key)
    trust_remote_code: bool = False

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
            fingerprint_extra: dict | None = None, trust_remote_code: bool = False,
            draft_method: str = "eagle3", dflash_layers: int = 1) -> Extraction:
    """Everything before the model: check the inputs, plan the shards, find the cached ones.

    ``aux_layer_ids`` None: the default layers of a ``draft_method`` draft
    (eagle3flow/layers.py default_layer_ids; ``dflash_layers``: the DFlash draft's depth).

    Fails early, naming the file/row/field, on a missing dataset or target, a target
    without weights, layer ids out of range, a bad row or an empty dataset. Samples
    longer than ``max_length`` or the target's context (``max_position_embeddings``)
    follow ``length_policy``. ``partition = (k, N)``: only the k-th of N runs of shards
    (:func:`plan_partitions`). ``fingerprint_extra`` (e.g. another backend's name) goes
    into the cache key. ``trust_remote_code`` (``target.trust_remote_code``): a target that
    declares its own code is refused here without it, before it loads.
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
    check_remote_code(target_path, trust_remote_code)
    text_config = read_target_config(target_path)
    num_layers, hidden_size = int(text_config["num_hidden_layers"]), int(text_config["hidden_size"])
    aux_layer_ids = resolve_aux_layer_ids(aux_layer_ids, num_layers, draft_method, dflash_layers)
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
    plan = plan_partitions(plan_shards(scan.lengths.tolist(), shard_tokens), n)[k]
    cache_root.mkdir(parents=True, exist_ok=True)
    inputs = {
        "format": shards.FORMAT, "extractor_version": EXTRACTOR_VERSION,
        "dataset_sha256": cached_sha256(dataset_parquet, cache_root),
        "target_config_sha256": shards.sha256_file(target_path / "config.json"),
        # Every weight file's size, mtime and header (eagle3flow/target/identity.py): the
        # identity the workflow reruns this stage by, so a rerun for a new target never
        # finds the old target's shards.
        "target_identity": target_digest(target_path),
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
    # A shard whose writer was killed (SIGTERM mid-write: the default action runs no
    # cleanup) left its temporary file: gone before anything is counted or written.
    swept = sweep_stale_temporaries(shard_dir)
    if swept:
        log(f"removed {len(swept)} unfinished shard file(s) of killed writers "
            f"({sum(size for _, size in swept) / 1e6:,.1f} MB): {', '.join(p.name for p, _ in swept)}")
    write_json(shard_dir / "fingerprint.json", {"fingerprint": key, **inputs})
    entries = cached_entries(shard_dir, plan)
    extraction = Extraction(
        split_name=split_name, dataset=dataset_parquet, target_path=target_path,
        manifest_out=Path(manifest_out), shard_dir=shard_dir, key=key, num_layers=num_layers,
        hidden_size=hidden_size, aux_layer_ids=aux_layer_ids, device=torch_device, dtype=torch_dtype,
        storage_dtype=storage, batch_tokens=batch_tokens, max_length=limit,
        length_policy=length_policy, scan=scan, plan=plan, partition=(k, n), entries=entries,
        trust_remote_code=bool(trust_remote_code))
    totals = scan.totals(*extraction.rows())
    tokens, samples = sum(p.num_tokens for p in plan), sum(p.num_samples for p in plan)
    log(f"{extraction.tag}: {samples:,} samples, {tokens:,} tokens "
        f"in {len(plan)} shards ({len(entries)} cached), {extraction.bytes_per_token:,} bytes/token "
        f"({storage}) -> {shard_dir}")
    if totals["truncated_samples"] or totals["dropped_samples"]:
        rows = slice(*extraction.rows())
        ids = row_ids(dataset_parquet, np.flatnonzero(scan.lengths[rows] == 0)[:5] + rows.start)
        log(f"{extraction.tag}: over {limit} tokens (max_length / the target's context "
            f"{context}): {totals['truncated_samples']} truncated, {totals['dropped_samples']} "
            f"dropped{' (e.g. ' + ', '.join(ids) + ')' if ids else ''}")
    return extraction



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



def _iter_shard_rows(x: Extraction):
    """``(plan, kept rows)`` per shard of the extraction, reading the dataset once, in order."""
    if not x.plan:
        return
    start, stop = x.rows()
    plans = iter(x.plan)
    current = next(plans)
    rows: list[dict] = []
    for first, batch in iter_dataset(x.dataset, ("id", "input_ids", "loss_mask"), start=start, stop=stop):
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
        if plan.index in x.entries and shard_sample_ids(path) != [r["id"] for r in rows]:
            log(f"{x.tag}: {path.name} holds other samples than planned; recomputing")
            progress.done -= x.entries.pop(plan.index)["num_tokens"]
        if plan.index in x.entries:
            continue
        progress.extra = f"shard {plan.index + 1 - x.plan[0].index}/{len(x.plan)}"
        yield plan, rows, path

