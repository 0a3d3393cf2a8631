"""The throughput log beside a manifest: one JSON line per computed shard (docs/formats.md).

Written by every extraction backend as each shard finishes, so it survives kills and
resumes; the report plots it. A partition's log sits beside its partition manifest
and the merge joins them. No torch: the workflow's planner reads these names too.
"""
from __future__ import annotations

import json
import time
from pathlib import Path

from eagle3flow.atomic import write_text
from eagle3flow.extract.shard_plan import ShardPlan

THROUGHPUT_FILE = "throughput.jsonl"


def throughput_path(manifest_path: Path) -> Path:
    """The throughput log beside a manifest: ``throughput.jsonl`` for ``manifest.json``,
    ``<stem>.throughput.jsonl`` for a partition's (merged by ``python -m eagle3flow.extract.shards merge``)."""
    manifest_path = Path(manifest_path)
    if manifest_path.name == "manifest.json":
        return manifest_path.parent / THROUGHPUT_FILE
    return manifest_path.with_name(f"{manifest_path.stem}.{THROUGHPUT_FILE}")


def record_throughput(path: Path, split_name: str, fingerprint: str, plan: ShardPlan,
                      compute_s: float) -> None:
    """Append one line: split, fingerprint, shard, num_tokens, compute_s, finished_at (unix time)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        f.write(json.dumps({"split": split_name, "fingerprint": fingerprint, "shard": plan.index,
                            "num_tokens": plan.num_tokens, "compute_s": compute_s,
                            "finished_at": time.time()}) + "\n")


def merge_throughput_logs(sources: list[Path], out: Path) -> None:
    """Concatenate partitions' throughput logs (docs/formats.md) into one, atomically."""
    lines = []
    for src in sources:
        if Path(src).is_file():
            lines.extend(line for line in Path(src).read_text().splitlines() if line.strip())
    write_text(out, "".join(line + "\n" for line in lines))
