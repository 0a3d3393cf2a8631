"""Hidden-state shards and their manifest: the one place that reads and writes them.

A shard packs several samples back to back (see docs/formats.md)::

    input_ids          int32   [T]
    loss_mask          uint8   [T]
    cu_seqlens         int64   [n+1]   sample i = rows cu_seqlens[i]:cu_seqlens[i+1]
    aux_hidden_states  dtype   [T, A*H]
    last_hidden_state  dtype   [T, H]
    metadata: sample_ids (JSON list)

Shards are written under a temporary name and renamed, so a shard file that exists
is complete. The manifest is written last and lists every shard's sha256, which
:func:`verify_shard` checks before a shard is trusted again.
"""
from __future__ import annotations

import hashlib
import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

FORMAT = "eagle3flow.hidden_states.v1"
TENSOR_NAMES = ("input_ids", "loss_mask", "cu_seqlens", "aux_hidden_states", "last_hidden_state")


def shard_name(index: int) -> str:
    return f"shard-{index:05d}.safetensors"


def sha256_file(path: str | os.PathLike, chunk: int = 1 << 22) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def atomic_write_json(path: str | os.PathLike, obj) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=2)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def write_shard(path: str | os.PathLike, sample_ids: list[str], input_ids: list[torch.Tensor],
                loss_mask: list[torch.Tensor], aux_hidden_states: list[torch.Tensor],
                last_hidden_state: list[torch.Tensor]) -> dict:
    """Write one shard atomically from per-sample tensors; returns its manifest entry.

    Per sample: ``input_ids [t]``, ``loss_mask [t]``, ``aux_hidden_states [t, A*H]``,
    ``last_hidden_state [t, H]``.
    """
    path = Path(path)
    lengths = [int(x.numel()) for x in input_ids]
    cu = torch.zeros(len(lengths) + 1, dtype=torch.int64)
    cu[1:] = torch.cumsum(torch.tensor(lengths, dtype=torch.int64), 0)
    tensors = {
        "input_ids": torch.cat(input_ids).to(torch.int32).contiguous(),
        "loss_mask": torch.cat(loss_mask).to(torch.uint8).contiguous(),
        "cu_seqlens": cu,
        "aux_hidden_states": torch.cat(aux_hidden_states).contiguous(),
        "last_hidden_state": torch.cat(last_hidden_state).contiguous(),
    }
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(tmp), metadata={"format": FORMAT, "sample_ids": json.dumps(sample_ids)})
    _sort_metadata(tmp)
    with open(tmp, "rb+") as f:
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return shard_entry(path)


def _sort_metadata(path: Path) -> None:
    """Rewrite the header with metadata keys sorted, in place, same header length.

    safetensors serializes metadata from a Rust HashMap, in a random order per process;
    sorted, the same shard is the same bytes, so a resumed extraction can be checked
    bitwise against an uninterrupted one.
    """
    with open(path, "r+b") as f:
        size = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(size))
        header["__metadata__"] = dict(sorted(header["__metadata__"].items()))
        text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
        if len(text) <= size:  # safetensors pads its header with spaces too
            f.seek(8)
            f.write(text.ljust(size, b" "))


def shard_entry(path: str | os.PathLike) -> dict:
    """Manifest entry of a complete shard: file name, checksum, counts, size."""
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


def read_shard(path: str | os.PathLike) -> tuple[dict[str, torch.Tensor], list[str]]:
    """All tensors of a shard and its sample ids."""
    with safe_open(str(path), "pt") as f:
        meta = f.metadata() or {}
        if meta.get("format") != FORMAT:
            raise ValueError(f"{path}: not a hidden-state shard of format {FORMAT} "
                             f"(metadata format={meta.get('format')!r})")
        tensors = {name: f.get_tensor(name) for name in TENSOR_NAMES}
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
            if meta.get("format") != FORMAT or set(TENSOR_NAMES) - set(f.keys()):
                return False
            t = f.get_slice("input_ids").get_shape()[0]
            cu_last = int(f.get_tensor("cu_seqlens")[-1])
            rows = [f.get_slice(n).get_shape()[0] for n in TENSOR_NAMES if n != "cu_seqlens"]
        if cu_last != t or any(r != t for r in rows):
            return False
    except Exception:
        return False
    return expected_sha256 is None or sha256_file(path) == expected_sha256


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
