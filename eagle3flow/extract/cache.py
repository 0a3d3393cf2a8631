"""The hidden-state cache: its key, and the finished shards it can reuse.

Shards live under ``cache_root/<fingerprint>/``, the fingerprint being a hash of
everything that changes their bytes (:func:`fingerprint`; the target's weights through
its identity, eagle3flow/target/identity.py). A shard on disk is reused only when
:func:`cached_entry` verifies it against the plan and its recorded sha256, and
:func:`shard_sample_ids` lets a run check it holds the planned samples.
"""
from __future__ import annotations

import hashlib
import json
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from safetensors import safe_open

from eagle3flow.atomic import write_json
from eagle3flow.extract import shards
from eagle3flow.extract.shard_plan import ShardPlan

WEIGHT_SUFFIXES = (".safetensors", ".bin")
# Threads hashing shards (sha256 is ~1 GB/s per core; one file per thread).
HASH_THREADS = max(1, min(4, (os.cpu_count() or 1) - 1))


def fingerprint(inputs: dict) -> str:
    """The cache key of an extraction's inputs (a JSON-able dict)."""
    return hashlib.sha256(json.dumps(inputs, sort_keys=True).encode()).hexdigest()[:20]


def weight_files(target_path: Path) -> list[Path]:
    return sorted(p for p in Path(target_path).iterdir()
                  if p.is_file() and p.name.endswith(WEIGHT_SUFFIXES))


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



def cached_entry(shard_path: Path, plan: ShardPlan) -> dict | None:
    """The manifest entry of a finished shard, or None when it must be (re)computed.

    Checked: structure (:func:`shards.verify_shard`), the planned sample/token counts,
    and the sha256 recorded beside it when it was written (catches bit rot, truncation).
    """
    if not shard_path.is_file():
        return None
    try:
        with open(shards.entry_file(shard_path)) as f:
            recorded = json.load(f)
    except (OSError, ValueError):
        recorded = None
    if not shards.verify_shard(shard_path, recorded["sha256"] if recorded else None):
        return None
    entry = recorded or shards.shard_entry(shard_path)
    if entry["num_samples"] != plan.num_samples or entry["num_tokens"] != plan.num_tokens:
        return None
    if not recorded:
        write_json(shards.entry_file(shard_path), entry)
    return entry


def cached_entries(shard_dir: Path, plan: list[ShardPlan]) -> dict[int, dict]:
    """Shard index -> manifest entry of every planned shard already finished in ``shard_dir``.

    Checksums several at once: a rerun re-reads every finished shard.
    """
    with ThreadPoolExecutor(max_workers=HASH_THREADS) as pool:
        found = pool.map(lambda p: cached_entry(shard_dir / shards.shard_name(p.index), p), plan)
        return {p.index: e for p, e in zip(plan, found) if e}


def shard_sample_ids(path: Path) -> list[str]:
    """The sample ids a shard on disk holds, from its header."""
    with safe_open(str(path), "pt") as f:
        return json.loads((f.metadata() or {}).get("sample_ids", "[]"))
