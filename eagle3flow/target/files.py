"""Whether a target directory holds a whole checkpoint: every weight file there and complete.

Read from the safetensors headers only (a few MiB of a 540 GB checkpoint), so the
preflight can ask before any drain: a shard missing, or cut short by an interrupted copy,
would otherwise show only when the target loads, minutes into the drain. The workflow
reads safetensors only (eagle3flow/target/weights.py): ``model.safetensors.index.json``
and the shards it lists, or the ``*.safetensors`` files of the directory.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

INDEX = "model.safetensors.index.json"
# Where a shard's first problems are named, a long list is cut.
SHOWN = 5


def _header_problem(path: Path, expected_tensors: set[str]) -> str | None:
    """What is wrong with one safetensors file, or None: its header must parse and its
    size must hold every tensor the header places (and the index's tensors be there)."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        length = int.from_bytes(head, "little") if len(head) == 8 else 0
        if not 0 < length <= size - 8:
            return f"{path}: not a safetensors file ({size} bytes, header length {length})"
        try:
            header = json.loads(f.read(length))
        except ValueError as error:
            return f"{path}: unreadable safetensors header ({error})"
    tensors = {name: spec for name, spec in header.items() if name != "__metadata__"}
    end = max((int(spec["data_offsets"][1]) for spec in tensors.values()), default=0)
    if size < 8 + length + end:
        return (f"{path}: {size:,} bytes, but its header places tensors up to byte {8 + length + end:,}: "
                "the file is cut short (copy it again)")
    missing = sorted(expected_tensors - set(tensors))
    if missing:
        return (f"{path}: lacks {len(missing)} tensor(s) that {INDEX} places there, e.g. "
                f"{', '.join(missing[:SHOWN])}")
    return None


def weight_problems(target_dir: str | os.PathLike) -> list[str]:
    """Every problem of the target's weights, one line each naming the file; [] when whole."""
    target = Path(target_dir)
    index = target / INDEX
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (ValueError, KeyError, TypeError) as error:
            return [f"{index}: unreadable ({error!r}); expected a 'weight_map' of tensor -> file"]
        if not weight_map:
            return [f"{index}: its weight_map lists no tensors"]
        by_file: dict[str, set[str]] = {}
        for tensor, file in weight_map.items():
            by_file.setdefault(file, set()).add(tensor)
        absent = sorted(file for file in by_file if not (target / file).is_file())
        problems = ([f"{index} lists {len(absent)} shard(s) that are missing: {', '.join(absent[:SHOWN])}"
                     + (", ..." if len(absent) > SHOWN else "")] if absent else [])
        checked = (_header_problem(target / file, tensors) for file, tensors in sorted(by_file.items())
                   if file not in absent)
        return problems + [p for p in checked if p]
    files = sorted(target.glob("*.safetensors"))
    if not files:
        return [f"{target}: no weights (neither {INDEX} nor any *.safetensors file)"]
    return [p for p in (_header_problem(file, set()) for file in files) if p]


# Safetensors dtypes of floating-point tensors (a loader may widen them); the rest are
# quantized or integer payloads a loader keeps as stored.
FLOAT_DTYPES = {"F64", "F32", "F16", "BF16", "F8_E4M3", "F8_E5M2"}


def _header(path: Path) -> dict:
    with open(path, "rb") as f:
        length = int.from_bytes(f.read(8), "little")
        return {name: spec for name, spec in json.loads(f.read(length)).items() if name != "__metadata__"}


def loaded_weight_bytes(target_dir: str | os.PathLike, bytes_per_float: int) -> int:
    """At least what the target's weights take once loaded with floating-point tensors in a
    dtype of ``bytes_per_float`` bytes: float tensors at that width, the others (quantized
    payloads) as stored; never less than the files themselves. From the headers only."""
    target = Path(target_dir)
    index = target / INDEX
    files = (sorted({target / f for f in json.loads(index.read_text())["weight_map"].values()})
             if index.is_file() else sorted(target.glob("*.safetensors")))
    loaded = stored = 0
    for file in files:
        stored += file.stat().st_size
        for spec in _header(file).values():
            start, end = spec["data_offsets"]
            if spec["dtype"] in FLOAT_DTYPES:
                numel = 1
                for dim in spec["shape"]:
                    numel *= int(dim)
                loaded += numel * bytes_per_float
            else:
                loaded += int(end) - int(start)
    return max(loaded, stored)
