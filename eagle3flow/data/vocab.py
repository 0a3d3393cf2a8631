"""The draft's vocabulary: the target tokens the draft most often has to predict.

EAGLE-3 drafts predict over a smaller vocab than the target's. We count target ids
on loss-masked (assistant) tokens, keep the ``draft_vocab_size`` most frequent, and
write the two maps vLLM and SGLang read (docs/formats.md)::

    d2t  int64 [Vd]   target_id = draft_id + d2t[draft_id]   (draft ids ordered by target id)
    t2d  bool  [Vt]   True where the target id has a draft id
"""
from __future__ import annotations

import argparse
import os
from pathlib import Path

import numpy as np
import pyarrow.compute as pc
import pyarrow.parquet as pq
import torch
from safetensors.torch import save_file

from eagle3flow.progress import Progress
from eagle3flow.atomic import replacing, write_json
from eagle3flow.config import cli_settings
from eagle3flow.target.config import load_target_config


def target_vocab_size(target_path: str | os.PathLike) -> int:
    """``vocab_size`` from the target's config.json (``text_config.vocab_size`` when nested)."""
    size = load_target_config(target_path).get("vocab_size")
    if not size:
        raise ValueError(f"{Path(target_path) / 'config.json'}: no vocab_size (nor text_config.vocab_size)")
    return int(size)


def count_loss_tokens(dataset_parquets: list, vocab_size: int) -> np.ndarray:
    """Occurrences of each target id on ``loss_mask == 1`` tokens, read batch by batch: ``[Vt]`` int64."""
    counts = np.zeros(vocab_size, dtype=np.int64)
    files = [pq.ParquetFile(str(p)) for p in dataset_parquets]
    progress = Progress("vocab", sum(f.metadata.num_rows for f in files), "rows")
    for path, parquet in zip(dataset_parquets, files):
        missing = {"id", "input_ids", "loss_mask"} - set(parquet.schema_arrow.names)
        if missing:
            raise ValueError(f"{path}: missing columns {sorted(missing)}")
        row = 0
        for batch in parquet.iter_batches(batch_size=4096, columns=["id", "input_ids", "loss_mask"]):
            ids_col, mask_col = batch.column("input_ids"), batch.column("loss_mask")
            unequal = np.asarray(pc.not_equal(pc.list_value_length(ids_col),
                                              pc.list_value_length(mask_col)))
            if unequal.any():
                i = int(np.flatnonzero(unequal)[0])
                raise ValueError(f"{path}: row {row + i} (id {batch.column('id')[i]}): "
                                 f"len(input_ids) != len(loss_mask)")
            ids = pc.list_flatten(ids_col).to_numpy(zero_copy_only=False).astype(np.int64)
            mask = pc.list_flatten(mask_col).to_numpy(zero_copy_only=False) == 1
            bad = (ids < 0) | (ids >= vocab_size)
            if bad.any():
                # Which row: the first whose offset range holds the first bad token.
                offsets = np.asarray(ids_col.offsets) - ids_col.offsets[0].as_py()
                i = int(np.searchsorted(offsets, np.flatnonzero(bad)[0], side="right") - 1)
                raise ValueError(f"{path}: row {row + i} (id {batch.column('id')[i]}): token id "
                                 f"outside the target's vocab [0, {vocab_size})")
            counts += np.bincount(ids[mask], minlength=vocab_size)
            row += batch.num_rows
            progress.update(batch.num_rows)
    return counts


def select_draft_vocab(counts: np.ndarray, draft_vocab_size: int) -> np.ndarray:
    """Target ids of the draft vocab, ascending: the most frequent (ties: lower id first),
    then unseen ids in ascending order if too few were seen. ``[min(Vd, Vt)]`` int64."""
    size = min(draft_vocab_size, len(counts))
    by_frequency = np.lexsort((np.arange(len(counts)), -counts))  # stable: count desc, id asc
    # Unseen ids (count 0) come last in ascending id order, so this also does the fill.
    return np.sort(by_frequency[:size]).astype(np.int64)


def vocab_maps(selected: np.ndarray, target_vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``d2t [Vd]`` int64 offsets and ``t2d [Vt]`` bool mask for ascending ``selected`` target ids."""
    d2t = torch.from_numpy(selected - np.arange(len(selected), dtype=np.int64))
    t2d = torch.zeros(target_vocab_size, dtype=torch.bool)
    t2d[torch.from_numpy(selected)] = True
    return d2t, t2d


def coverage_curve(counts: np.ndarray, sizes: list[int]) -> dict[str, float]:
    """Fraction of counted tokens covered by the ``s`` most frequent ids, per size ``s``."""
    cumulative = np.cumsum(np.sort(counts)[::-1])
    total = cumulative[-1]
    return {str(s): float(cumulative[min(s, len(counts)) - 1] / total) for s in sizes}


def build_vocab_map(dataset_parquets: list, target_vocab_size: int, draft_vocab_size: int,
                    out_path, stats_path) -> dict:
    """Count, select, write ``vocab_map.safetensors`` and ``stats.json``; returns the stats."""
    if draft_vocab_size < 1:
        raise ValueError(f"draft_vocab_size must be >= 1, got {draft_vocab_size}")
    if isinstance(dataset_parquets, (str, os.PathLike)):
        dataset_parquets = [dataset_parquets]
    counts = count_loss_tokens(dataset_parquets, target_vocab_size)
    total = int(counts.sum())
    if total == 0:
        raise ValueError(f"{[str(p) for p in dataset_parquets]}: no token has loss_mask == 1; "
                         "nothing tells which tokens the draft must predict")
    selected = select_draft_vocab(counts, draft_vocab_size)
    d2t, t2d = vocab_maps(selected, target_vocab_size)
    out_path = Path(out_path)
    with replacing(out_path) as tmp:
        save_file({"d2t": d2t, "t2d": t2d}, str(tmp))

    size = len(selected)
    curve_sizes = sorted({s for s in (2 ** np.arange(8, 20)).tolist() if s < target_vocab_size}
                         | {size // 8, size // 4, size // 2, size, target_vocab_size} - {0})
    stats = {
        "target_vocab_size": target_vocab_size,
        "draft_vocab_size": size,
        "requested_draft_vocab_size": draft_vocab_size,
        "assistant_tokens": total,
        "distinct_assistant_tokens": int((counts > 0).sum()),
        "filled_unseen_ids": int((counts[selected] == 0).sum()),
        "coverage": float(counts[selected].sum() / total),
        "coverage_at_size": coverage_curve(counts, curve_sizes),
        "datasets": [str(p) for p in dataset_parquets],
    }
    write_json(stats_path, stats)
    return stats


def main(argv=None) -> None:
    """CLI: paths as flags, the config's vocab section as --config-json.

    python -m eagle3flow.data.vocab --dataset results/dataset/train.parquet [more.parquet ...] \\
        --target DIR --config-json '{"draft_vocab_size": 32000}' \\
        --out results/vocab/vocab_map.safetensors --stats results/vocab/stats.json
    """
    parser = argparse.ArgumentParser(prog="python -m eagle3flow.data.vocab", description=main.__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dataset", nargs="+", required=True, help="tokenized dataset parquet(s)")
    parser.add_argument("--target", required=True, help="HF target dir (its config.json gives Vt)")
    parser.add_argument("--config-json", default="{}", help="the config's vocab section")
    parser.add_argument("--out", required=True, help="vocab_map.safetensors to write")
    parser.add_argument("--stats", required=True, help="stats.json to write")
    args = parser.parse_args(argv)
    settings = cli_settings(parser, "vocab", args.config_json)
    stats = build_vocab_map(args.dataset, target_vocab_size(args.target), settings["draft_vocab_size"],
                            args.out, args.stats)
    print(f"vocab: draft {stats['draft_vocab_size']:,} of {stats['target_vocab_size']:,} ids, "
          f"coverage {stats['coverage']:.4f} of {stats['assistant_tokens']:,} assistant tokens")


if __name__ == "__main__":
    main()
