"""Samples -> parquet: the batched writer and the train/eval split of its file.

Columns (docs/formats.md): id, input_ids list<int32>, loss_mask list<int8>, num_tokens
int32; the intermediate file also keeps each sample's prompt (JSON) for eval_prompts.jsonl.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

WRITE_BATCH = 1024


def _arrow_schema(with_prompt: bool):
    import pyarrow as pa

    fields = [("id", pa.string()), ("input_ids", pa.list_(pa.int32())),
              ("loss_mask", pa.list_(pa.int8())), ("num_tokens", pa.int32())]
    if with_prompt:
        fields.append(("prompt_json", pa.string()))
    return pa.schema(fields)


class SampleWriter:
    """Appends samples to a parquet file in batches (bounded memory)."""

    def __init__(self, path: Path, with_prompt: bool):
        import pyarrow.parquet as pq

        self.schema = _arrow_schema(with_prompt)
        self.writer = pq.ParquetWriter(str(path), self.schema)
        self.pending: list[tuple] = []
        self.rows = 0   # samples added so far: the next one's row in the file

    def add(self, sample_id: str, input_ids: np.ndarray, loss_mask: np.ndarray,
            prompt_json: str | None = None) -> None:
        self.pending.append((sample_id, input_ids, loss_mask, prompt_json))
        self.rows += 1
        if len(self.pending) >= WRITE_BATCH:
            self.flush()

    def flush(self) -> None:
        import pyarrow as pa

        if not self.pending:
            return
        ids, input_ids, masks, prompts = zip(*self.pending)
        offsets = np.zeros(len(ids) + 1, dtype=np.int32)
        np.cumsum([len(x) for x in input_ids], out=offsets[1:])
        columns = [pa.array(ids, pa.string()),
                   pa.ListArray.from_arrays(pa.array(offsets), pa.array(np.concatenate(input_ids))),
                   pa.ListArray.from_arrays(pa.array(offsets), pa.array(np.concatenate(masks))),
                   pa.array(np.diff(offsets).astype(np.int32))]
        if "prompt_json" in self.schema.names:
            columns.append(pa.array(prompts, pa.string()))
        self.writer.write_table(pa.Table.from_arrays(columns, schema=self.schema))
        self.pending = []

    def close(self) -> None:
        self.flush()
        self.writer.close()


def split_outputs(all_path: Path, out_dir: Path, n_eval: int, drop: set[int] = frozenset()) -> dict:
    """Rows [0, n_eval) of ``all_path`` -> eval (less the rows in ``drop``), the rest ->
    train; returns per-split stats."""
    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    writers = {name: SampleWriter(out_dir / f".{name}.parquet.tmp", with_prompt=False)
               for name in ("train", "eval")}
    split_stats = {name: {"samples": 0, "tokens": 0, "assistant_tokens": 0} for name in writers}
    position = 0
    with open(out_dir / ".eval_prompts.jsonl.tmp", "w", encoding="utf-8") as prompts:
        for batch in pq.ParquetFile(str(all_path)).iter_batches(batch_size=WRITE_BATCH):
            cut = min(max(n_eval - position, 0), batch.num_rows)
            held_out = batch.slice(0, cut)
            if drop and cut:
                held_out = held_out.filter(pa.array([position + i not in drop for i in range(cut)]))
            for name, part in (("eval", held_out), ("train", batch.slice(cut))):
                if part.num_rows == 0:
                    continue
                stats = split_stats[name]
                stats["samples"] += part.num_rows
                stats["tokens"] += int(pc.sum(part.column("num_tokens")).as_py() or 0)
                stats["assistant_tokens"] += int(
                    pc.sum(pc.list_flatten(part.column("loss_mask")).cast("int64")).as_py() or 0)
                writers[name].writer.write_batch(part.drop_columns(["prompt_json"]))
                if name == "eval":
                    for sample_id, prompt in zip(part.column("id").to_pylist(),
                                                 part.column("prompt_json").to_pylist()):
                        prompts.write(json.dumps({"id": sample_id, "messages": json.loads(prompt)},
                                                 ensure_ascii=False) + "\n")
            position += batch.num_rows
    for writer in writers.values():
        writer.close()
    return split_stats

