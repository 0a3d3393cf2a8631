"""Which dataset rows go in which shard, and which shards in which partition, by tokens.

Plain Python (no torch, numpy or I/O): the plan depends only on the per-row token
counts, so the workflow's planner can project an extraction's shards and partitions
with these very functions before anything is extracted.

The plan is deterministic (rows in dataset order, a new shard once ``shard_tokens``
is reached), so an interrupted run resumes into the same shards. Partitions
(``partition=(k, N)``) are runs of consecutive shards of that one plan, balanced by
tokens: N jobs (one per node) share one cache directory and their manifests merge
into the one a single job writes (``python -m eagle3flow.extract.shards merge``).
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass


@dataclass
class ShardPlan:
    index: int
    start: int        # first dataset row
    stop: int         # one past the last row
    num_tokens: int   # after the length policy
    num_samples: int  # rows of [start, stop) kept by the length policy


def plan_shards(lengths: Iterable[int], shard_tokens: int) -> list[ShardPlan]:
    """Consecutive rows per shard; a shard closes once it holds >= ``shard_tokens``.

    ``lengths [rows]``: tokens of each row after the length policy. Rows of length 0
    (dropped) belong to a shard's row range but hold no sample.
    """
    plan, start, tokens, samples, rows = [], 0, 0, 0, 0
    for row, n in enumerate(lengths):
        n = int(n)  # numpy integers too: the plan goes into JSON manifests
        tokens += n
        samples += n > 0
        rows = row + 1
        if tokens >= shard_tokens:
            plan.append(ShardPlan(len(plan), start, row + 1, tokens, samples))
            start, tokens, samples = row + 1, 0, 0
    if tokens:
        plan.append(ShardPlan(len(plan), start, rows, tokens, samples))
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


def partition_manifest_name(index: int, count: int) -> str:
    return f"part-{index}-of-{count}.json"
