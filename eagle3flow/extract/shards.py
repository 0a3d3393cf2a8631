"""Hidden-state shards and their manifest: the one place that reads and writes them.

A shard packs several samples back to back (see docs/formats.md)::

    input_ids                 int32    [T]
    loss_mask                 uint8    [T]
    cu_seqlens                int64    [n+1]   sample i = rows cu_seqlens[i]:cu_seqlens[i+1]
    aux_hidden_states         dtype    [T, A*H]
    last_hidden_state         dtype    [T, H]
    (fp8 storage only)
    aux_hidden_states_scale   float32  [T, A]   one scale per token and aux layer
    last_hidden_state_scale   float32  [T, 1]
    metadata: format, sample_ids (JSON list), storage_dtype, dtype (the compute dtype)

So a kept token costs exactly ``(A+1) * H * itemsize`` bytes of hidden states plus
5 bytes of index (``input_ids``, ``loss_mask``), plus ``(A+1) * 4`` bytes of scales
in fp8; the header (sample ids) is the rest. fp8 is ``float8_e4m3fn`` with a scale
per token and layer (amax / 448): :func:`read_shard` dequantizes it to the compute
dtype, so readers never see the difference.

Shards are written under a temporary name and renamed, so a shard file that exists
is complete. The file is written by :func:`write_packed_shard` straight from the
tensors' memory (no serialized copy), hashing each chunk while the next is written;
the sha256 goes to the manifest and :func:`verify_shard` checks it before a shard is
trusted again. The bytes are valid safetensors (``safe_open`` reads them).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import struct
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from eagle3flow.atomic import replacing, write_json
from eagle3flow.extract.throughput import merge_throughput_logs, throughput_path
from eagle3flow.extract.manifest_totals import SUMMED_KEYS

# The shard format's name predates the package layout; renaming it would invalidate every cache.
FORMAT = "eagle3flow.hidden_states.v1"
TENSOR_NAMES = ("input_ids", "loss_mask", "cu_seqlens", "aux_hidden_states", "last_hidden_state")
SCALE_NAMES = ("aux_hidden_states_scale", "last_hidden_state_scale")
FP8 = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8).max)  # 448
# Storage names accepted by the config (extract.storage_dtype) besides the compute dtype.
FP8_NAMES = ("fp8", "float8_e4m3fn")
SAFETENSORS_DTYPES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
                      FP8: "F8_E4M3", torch.int64: "I64", torch.int32: "I32", torch.uint8: "U8"}
TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
WRITE_CHUNK = 64 << 20
INDEX_BYTES_PER_TOKEN = 4 + 1  # input_ids int32 + loss_mask uint8


def shard_name(index: int) -> str:
    return f"shard-{index:05d}.safetensors"


def entry_file(shard_path: Path) -> Path:
    """Beside a shard, its manifest entry (with its sha256), written once the shard is complete."""
    return Path(shard_path).with_suffix(".json")


def sha256_file(path: str | os.PathLike, chunk: int = 1 << 24) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            digest.update(block)
    return digest.hexdigest()


# ----------------------------------------------------------------------------- storage

def is_fp8(storage_dtype: str | torch.dtype | None) -> bool:
    return storage_dtype == FP8 or storage_dtype in FP8_NAMES


def bytes_per_token(num_aux: int, hidden_size: int, storage_dtype: str | torch.dtype) -> int:
    """Bytes a kept token costs on disk, headers aside: ``(A+1)*H*itemsize + 5`` (+ scales in fp8)."""
    if is_fp8(storage_dtype):
        return (num_aux + 1) * (hidden_size + 4) + INDEX_BYTES_PER_TOKEN
    dtype = TORCH_DTYPES.get(storage_dtype, storage_dtype)
    return (num_aux + 1) * hidden_size * dtype.itemsize + INDEX_BYTES_PER_TOKEN


def quantize_fp8(x: torch.Tensor, groups: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [..., G*H]`` -> ``(q [..., G*H] float8_e4m3fn, scale [..., G] float32)``.

    One scale per token and group (= aux layer): the embeddings and a deep layer's
    residual stream differ by orders of magnitude, one scale for both would flush
    the small one to zero. ``x ~= q * scale``; runs on x's device (the GPU).
    """
    shape = x.shape
    grouped = x.reshape(*shape[:-1], groups, shape[-1] // groups).float()
    amax = grouped.abs().amax(dim=-1, keepdim=True)
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    q = (grouped / scale).clamp_(-FP8_MAX, FP8_MAX).to(FP8)
    return q.reshape(shape), scale.squeeze(-1)


def dequantize_fp8(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype,
                   chunk_rows: int = 8192) -> torch.Tensor:
    """``q [T, G*H]`` fp8, ``scale [T, G]`` -> ``[T, G*H]`` in ``dtype`` on ``q``'s device,
    chunked (no [T, G*H] fp32 temp). The same arithmetic on the host and on a GPU (an fp32
    product rounded once to ``dtype``), so both give the same bits."""
    rows, width = q.shape
    groups = scale.shape[-1]
    out = torch.empty(rows, width, dtype=dtype, device=q.device)
    for a in range(0, rows, chunk_rows):
        b = min(rows, a + chunk_rows)
        block = q[a:b].reshape(b - a, groups, width // groups).float() * scale[a:b, :, None]
        out[a:b] = block.reshape(b - a, width).to(dtype)
    return out


# ----------------------------------------------------------------------------- writing

def _tensor_bytes(t: torch.Tensor) -> memoryview:
    """The tensor's memory as bytes, without a copy (pinned host memory included)."""
    flat = t.detach().contiguous().reshape(-1)
    return memoryview(flat.view(torch.uint8).numpy()) if flat.numel() else memoryview(b"")


def _safetensors_header(tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> bytes:
    """Header for ``tensors`` laid out in dict order; padded to 8 bytes like safetensors'."""
    header, offset = {}, 0
    for name, t in tensors.items():
        size = t.numel() * t.element_size()
        header[name] = {"dtype": SAFETENSORS_DTYPES[t.dtype], "shape": list(t.shape),
                        "data_offsets": [offset, offset + size]}
        offset += size
    header["__metadata__"] = dict(sorted(metadata.items()))
    text = json.dumps(header, separators=(",", ":"), sort_keys=True).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text


def write_packed_shard(path: str | os.PathLike, sample_ids: list[str], input_ids: torch.Tensor,
                       loss_mask: torch.Tensor, cu_seqlens: torch.Tensor,
                       aux_hidden_states: torch.Tensor, last_hidden_state: torch.Tensor,
                       aux_scale: torch.Tensor | None = None,
                       last_scale: torch.Tensor | None = None,
                       compute_dtype: str | None = None, checksum: bool = True) -> dict:
    """Write one shard atomically from packed CPU tensors; returns its manifest entry.

    ``input_ids [T]``, ``loss_mask [T]``, ``cu_seqlens [n+1]``, ``aux_hidden_states
    [T, A*H]``, ``last_hidden_state [T, H]``; when these two are float8_e4m3fn,
    ``aux_scale [T, A]`` and ``last_scale [T, 1]`` (float32) are required.
    ``compute_dtype`` names what fp8 dequantizes to (default: bfloat16).

    The bytes are written straight from the tensors' memory (pinned buffers too) while
    a second thread hashes them, so writing costs max(disk, sha256). ``checksum=False``
    leaves ``sha256`` None: sha256 runs at ~1 GB/s on one core, slower than a fast disk,
    so a pipeline hashes finished files on other threads (:func:`sha256_file`).
    """
    path = Path(path)
    fp8 = aux_hidden_states.dtype == FP8
    if fp8 != (last_hidden_state.dtype == FP8) or fp8 != (aux_scale is not None):
        raise ValueError("fp8 shards need both hidden-state tensors in float8_e4m3fn and their scales")
    # Widest items first so each tensor starts aligned to its item size.
    tensors = {"cu_seqlens": cu_seqlens.to(torch.int64)}
    if fp8:
        tensors["aux_hidden_states_scale"] = aux_scale.to(torch.float32)
        tensors["last_hidden_state_scale"] = last_scale.to(torch.float32).reshape(-1, 1)
    tensors["aux_hidden_states"] = aux_hidden_states
    tensors["last_hidden_state"] = last_hidden_state
    tensors["input_ids"] = input_ids.to(torch.int32)
    tensors["loss_mask"] = loss_mask.to(torch.uint8)
    storage = str(aux_hidden_states.dtype).removeprefix("torch.")
    metadata = {"format": FORMAT, "sample_ids": json.dumps(sample_ids), "storage_dtype": storage,
                "dtype": compute_dtype or (storage if not fp8 else "bfloat16")}

    digest = hashlib.sha256() if checksum else None
    size = 0
    with replacing(path) as tmp, ThreadPoolExecutor(max_workers=1) as hasher, open(tmp, "wb") as f:
        pending = None
        # Without hashing, a tensor is one write (the GIL is taken back once, not per chunk).
        step = WRITE_CHUNK if digest is not None else 1 << 62
        for data in [memoryview(_safetensors_header(tensors, metadata))] + [
                _tensor_bytes(t) for t in tensors.values()]:
            for a in range(0, len(data), step):
                chunk = data[a:a + step]
                if digest is not None:
                    if pending is not None:
                        pending.result()  # sha256 needs the chunks in order
                    pending = hasher.submit(digest.update, chunk)  # releases the GIL
                f.write(chunk)
                size += len(chunk)
        if pending is not None:
            pending.result()
    return {"file": path.name, "sha256": digest.hexdigest() if digest else None,
            "num_samples": len(sample_ids), "num_tokens": int(tensors["input_ids"].numel()),
            "bytes": size}


def write_shard(path: str | os.PathLike, sample_ids: list[str], input_ids: list[torch.Tensor],
                loss_mask: list[torch.Tensor], aux_hidden_states: list[torch.Tensor],
                last_hidden_state: list[torch.Tensor], storage_dtype: str | None = None) -> dict:
    """Write one shard atomically from per-sample tensors; returns its manifest entry.

    Per sample: ``input_ids [t]``, ``loss_mask [t]``, ``aux_hidden_states [t, A*H]``,
    ``last_hidden_state [t, H]``. ``storage_dtype="fp8"`` quantizes (per-token scales).
    """
    lengths = [int(x.numel()) for x in input_ids]
    cu = torch.zeros(len(lengths) + 1, dtype=torch.int64)
    cu[1:] = torch.cumsum(torch.tensor(lengths, dtype=torch.int64), 0)
    aux, last = torch.cat(aux_hidden_states), torch.cat(last_hidden_state)
    scales = {}
    compute_dtype = str(aux.dtype).removeprefix("torch.")
    if is_fp8(storage_dtype):
        hidden = last.shape[-1]
        aux, scales["aux_scale"] = quantize_fp8(aux, aux.shape[-1] // hidden)
        last, scales["last_scale"] = quantize_fp8(last, 1)
    return write_packed_shard(path, sample_ids, torch.cat(input_ids), torch.cat(loss_mask), cu,
                              aux, last, compute_dtype=compute_dtype, **scales)


def shard_entry(path: str | os.PathLike) -> dict:
    """Manifest entry of a complete shard on disk: file name, checksum, counts, size."""
    path = Path(path)
    with safe_open(str(path), "pt") as f:
        meta = f.metadata() or {}
        num_tokens = f.get_slice("input_ids").get_shape()[0]
    return {
        "file": path.name,
        "sha256": sha256_file(path),
        "num_samples": len(json.loads(meta.get("sample_ids", "[]"))),
        "num_tokens": int(num_tokens),
        "bytes": path.stat().st_size,
    }


# ----------------------------------------------------------------------------- reading

def compute_dtype(meta: dict) -> torch.dtype:
    """The dtype a shard's fp8 hidden states dequantize to (its metadata's ``dtype``)."""
    return TORCH_DTYPES[meta.get("dtype", "bfloat16")]


def read_shard(path: str | os.PathLike, dequantize: bool = True
               ) -> tuple[dict[str, torch.Tensor], list[str]]:
    """All tensors of a shard and its sample ids; fp8 hidden states come back in the
    compute dtype (``dequantize=False``: as stored, with the ``*_scale`` tensors)."""
    with safe_open(str(path), "pt") as f:
        meta = f.metadata() or {}
        if meta.get("format") != FORMAT:
            raise ValueError(f"{path}: not a hidden-state shard of format {FORMAT} "
                             f"(metadata format={meta.get('format')!r})")
        names = TENSOR_NAMES + tuple(n for n in SCALE_NAMES if n in f.keys())
        tensors = {name: f.get_tensor(name) for name in names}
    if dequantize and tensors["aux_hidden_states"].dtype == FP8:
        dtype = compute_dtype(meta)
        for name in ("aux_hidden_states", "last_hidden_state"):
            tensors[name] = dequantize_fp8(tensors[name], tensors.pop(f"{name}_scale"), dtype)
    return tensors, json.loads(meta["sample_ids"])


def split_samples(tensors: dict[str, torch.Tensor], sample_ids: list[str]):
    """Yield one dict per sample (views into the shard's tensors)."""
    cu = tensors["cu_seqlens"].tolist()
    for i, sid in enumerate(sample_ids):
        a, b = cu[i], cu[i + 1]
        yield {
            "id": sid,
            "input_ids": tensors["input_ids"][a:b],
            "loss_mask": tensors["loss_mask"][a:b],
            "aux_hidden_states": tensors["aux_hidden_states"][a:b],
            "last_hidden_state": tensors["last_hidden_state"][a:b],
        }


def verify_shard(path: str | os.PathLike, expected_sha256: str | None = None) -> bool:
    """True when the shard opens, has every tensor with consistent shapes, and (if given) the checksum."""
    path = Path(path)
    if not path.is_file():
        return False
    try:
        with safe_open(str(path), "pt") as f:
            meta = f.metadata() or {}
            names = set(f.keys())
            if meta.get("format") != FORMAT or set(TENSOR_NAMES) - names:
                return False
            fp8 = meta.get("storage_dtype") == "float8_e4m3fn"
            if fp8 and set(SCALE_NAMES) - names:
                return False
            t = f.get_slice("input_ids").get_shape()[0]
            cu_last = int(f.get_tensor("cu_seqlens")[-1])
            rows = [f.get_slice(n).get_shape()[0] for n in names if n != "cu_seqlens"]
        if cu_last != t or any(r != t for r in rows):
            return False
    except Exception:
        return False
    return expected_sha256 is None or sha256_file(path) == expected_sha256


# ----------------------------------------------------------------------------- manifests

@dataclass
class Manifest:
    """The declared output of extraction: where the shards are and what they hold."""
    path: Path
    data: dict

    @property
    def shard_dir(self) -> Path:
        return Path(self.data["shard_dir"])

    @property
    def shard_paths(self) -> list[Path]:
        return [self.shard_dir / s["file"] for s in self.data["shards"]]

    @property
    def aux_layer_ids(self) -> list[int]:
        return list(self.data["aux_layer_ids"])

    @property
    def hidden_size(self) -> int:
        return int(self.data["hidden_size"])

    @property
    def num_tokens(self) -> int:
        return int(self.data["num_tokens"])

    def iter_samples(self, shard_order: list[int] | None = None):
        """Yield samples shard by shard (one shard in memory at a time)."""
        order = range(len(self.data["shards"])) if shard_order is None else shard_order
        for i in order:
            tensors, ids = read_shard(self.shard_paths[i])
            yield from split_samples(tensors, ids)


def load_manifest(path: str | os.PathLike) -> Manifest:
    path = Path(path)
    with open(path) as f:
        data = json.load(f)
    if data.get("format") != FORMAT:
        raise ValueError(f"{path}: not a hidden-state manifest of format {FORMAT}")
    return Manifest(path, data)


def merge_manifests(parts: list[dict], where: list[str] | None = None) -> dict:
    """One manifest from the manifests of partitions 0..N-1 of one split (any order).

    Shards are listed in plan order (= dataset order), so the result is the manifest
    a single-partition run writes. Fails naming the file when partitions are missing,
    repeated, or come from different extractions (fingerprint, split).
    """
    where = where or [f"partition manifest #{i}" for i in range(len(parts))]
    if not parts:
        raise ValueError("no partition manifests to merge")
    by_index = {}
    for data, name in zip(parts, where):
        part = data.get("partition") or {"index": 0, "count": 1}
        if data.get("format") != FORMAT:
            raise ValueError(f"{name}: not a hidden-state manifest of format {FORMAT}")
        if part["count"] != len(parts):
            raise ValueError(f"{name}: partition {part['index']} of {part['count']}, "
                             f"but {len(parts)} partition manifests were given")
        if part["index"] in by_index:
            raise ValueError(f"{name}: partition {part['index']} given twice")
        by_index[part["index"]] = (data, name)
    first, first_name = by_index[min(by_index)]
    for data, name in by_index.values():
        for key in ("fingerprint", "split", "shard_dir"):
            if data.get(key) != first.get(key):
                raise ValueError(f"{name}: {key} {data.get(key)!r} differs from {first_name}'s "
                                 f"{first.get(key)!r}; were they made by the same extraction?")
    ordered = [by_index[i][0] for i in range(len(parts))]
    merged = {k: v for k, v in first.items() if k != "partition"}
    merged["shards"] = [entry for data in ordered for entry in data["shards"]]
    files = [entry["file"] for entry in merged["shards"]]
    if files != sorted(set(files)):
        raise ValueError(f"{', '.join(where)}: the partitions hold overlapping or unordered shards")
    for key in SUMMED_KEYS:
        if key in first:
            merged[key] = sum(int(data.get(key, 0)) for data in ordered)
    merged["partitions"] = len(parts)
    shard_dir = Path(merged["shard_dir"])
    for entry in merged["shards"]:
        shard = shard_dir / entry["file"]
        if not shard.is_file() or shard.stat().st_size != entry["bytes"]:
            raise ValueError(f"{shard}: missing or not {entry['bytes']} bytes as its partition "
                             f"manifest says; rerun that partition's extraction")
    return merged


def main(argv=None) -> None:
    """python -m eagle3flow.extract.shards merge --part P0.json [--part P1.json ...] --manifest OUT.json

    Merges the partition manifests of one split (rule merge_hidden_states) into the
    manifest training reads, and their throughput logs into OUT's throughput.jsonl.
    Repeat the group (--part ... --manifest OUT) after --split for several splits.
    """
    parser = argparse.ArgumentParser(prog="python -m eagle3flow.extract.shards", description=main.__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    merge = sub.add_parser("merge", help="merge partition manifests")
    merge.add_argument("--part", action="append", required=True, nargs="+",
                       help="the partition manifests of one split (repeat per --manifest)")
    merge.add_argument("--manifest", action="append", required=True, help="merged manifest to write")
    args = parser.parse_args(argv)
    if len(args.part) != len(args.manifest):
        parser.error("give one --part group per --manifest")
    for parts, out in zip(args.part, args.manifest):
        datas = []
        for p in parts:
            with open(p) as f:
                datas.append(json.load(f))
        merged = merge_manifests(datas, where=parts)
        out = Path(out)
        merge_throughput_logs([throughput_path(Path(p)) for p in parts], throughput_path(out))
        write_json(out, merged)
        print(f"merged {len(parts)} partition(s): {len(merged['shards'])} shards, "
              f"{merged['num_tokens']:,} tokens -> {out}", file=sys.stderr)


if __name__ == "__main__":
    main()
