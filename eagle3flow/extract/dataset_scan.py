"""The tokenized dataset as extraction reads it: checked row by row, cut to the length policy.

:func:`scan_dataset` reads the parquet once, incrementally, and returns per-row token
counts after the length policy (the input of eagle3flow/extract/shard_plan.py);
:func:`iter_dataset` streams the rows again when shards are computed.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from eagle3flow.data.samples import LENGTH_POLICIES

REQUIRED_COLUMNS = ("id", "input_ids", "loss_mask", "num_tokens")


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


def iter_dataset(path: Path, columns=REQUIRED_COLUMNS, batch_rows: int = 1024,
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
    for row, batch in iter_dataset(path):
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


def row_ids(path: Path, rows) -> list[str]:
    """The ``id`` column at dataset rows ``rows``."""
    if not len(rows):
        return []
    table = pq.read_table(str(path), columns=["id"])
    return [str(table.column("id")[int(r)]) for r in rows]

