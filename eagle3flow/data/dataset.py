"""prepare_dataset: chat records -> tokenized train/eval parquet with assistant loss masks.

Input: a local .json / .jsonl / .parquet file, a directory of them, or a Hugging Face
Hub dataset id (data/sources.py); the CLI sets ``HF_HUB_OFFLINE=1`` unless the
environment says otherwise, so an uncached id fails at once (set ``HF_HUB_OFFLINE=0``
to allow a download). Records in the OpenAI, ShareGPT or instruction format
(data/records.py). Sample ids, duplicate ids made unique (listed in stats.json:
merged datasets often reuse ids; dropping them would lose data) and the processing
order by ``sha256(seed, id)`` come from data/order.py, which regenerate shares.

Split and cap are independent of row order: ``max_samples`` keeps the first N usable
samples of the processing order and the eval split is the first ``eval_fraction`` of
the kept ones (at least 1 when there are >= 2), so a larger cap or eval fraction only
adds samples.

Bad rows (not a dict, missing turns, unknown role, empty content, no assistant
turn, template error, all-0/all-1 loss mask, ...) are counted with id and reason;
the run fails once they exceed ``max_bad_fraction`` of the processed rows.

With ``--regenerated`` (regenerate_responses' responses.jsonl) every sample's
assistant turns are the target's own answers; samples it has none for (failed, or
beyond its ``max_samples``) are left out and listed in stats.json under
``regenerated.skipped``, which also counts the samples regenerated. Further answers of
a prompt (regenerate's ``answers_per_prompt``) are training samples of their own (id
``<id>~answer<k>``) when the prompt is in the train split; an eval prompt keeps its first.

Outputs (docs/formats.md, each written to a temporary name then renamed; stats.json
last): train.parquet, eval.parquet (id, input_ids list<int32>, loss_mask list<int8>,
num_tokens int32), eval_prompts.jsonl, stats.json.

The whole stage is one pass (Snakemake reruns it when it fails); samples are
streamed to a temporary parquet file, so memory holds the row ids (plus the rows of
a JSON file Arrow could not read). ``--num-workers`` forks processes that render and
tokenize; the output does not depend on it.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

from eagle3flow.config import DATASET_BORROWED, cli_settings, schema_defaults
from eagle3flow.data.chat_masks import ChatMasker
from eagle3flow.data.order import processing_order
from eagle3flow.data.records import FORMATS, BadRow
from eagle3flow.data.regenerated import Skipped, load_regenerated
from eagle3flow.data.samples import (LENGTH_POLICIES, LIST_LIMIT, Tally, apply_length_policy, row_results,
                                     tokenize_more_answers)
from eagle3flow.data.sources import DatasetError, load_sources
from eagle3flow.data.writer import SampleWriter, split_outputs
from eagle3flow.progress import Progress
from eagle3flow.target.tokenizer import load_tokenizer

OUTPUT_FILES = ("train.parquet", "eval.parquet", "eval_prompts.jsonl", "stats.json")


DATASET_DEFAULTS = schema_defaults("dataset")


@dataclass
class DatasetConfig:
    """The ``dataset`` section's keys this stage takes; defaults from the schema."""
    format: str = DATASET_DEFAULTS["format"]
    max_length: int | None = DATASET_DEFAULTS["max_length"]
    length_policy: str = DATASET_DEFAULTS["length_policy"]
    eval_fraction: float = DATASET_DEFAULTS["eval_fraction"]
    seed: int = DATASET_DEFAULTS["seed"]
    max_bad_fraction: float = DATASET_DEFAULTS["max_bad_fraction"]
    max_samples: int | None = DATASET_DEFAULTS["max_samples"]
    split: str = "train"  # of a Hub dataset; not a workflow key
    chat_template_kwargs: dict = field(default_factory=lambda: dict(DATASET_DEFAULTS["chat_template_kwargs"]))
    num_workers: int = DATASET_DEFAULTS["num_workers"]

    def validate(self) -> None:
        if self.format not in FORMATS:
            raise ValueError(f"format {self.format!r} is not one of {FORMATS}")
        if self.length_policy not in LENGTH_POLICIES:
            raise ValueError(f"length_policy {self.length_policy!r} is not one of {LENGTH_POLICIES}")
        if self.max_length is not None and self.max_length < 1:
            raise ValueError(f"max_length must be >= 1 or null, got {self.max_length}")
        if not 0.0 <= self.eval_fraction < 1.0:
            raise ValueError(f"eval_fraction must be in [0, 1), got {self.eval_fraction}")
        if not 0.0 <= self.max_bad_fraction <= 1.0:
            raise ValueError(f"max_bad_fraction must be in [0, 1], got {self.max_bad_fraction}")
        if self.num_workers < 1:
            raise ValueError(f"num_workers must be >= 1, got {self.num_workers}")
        if self.max_samples is not None and self.max_samples < 1:
            raise ValueError(f"max_samples must be >= 1 or null, got {self.max_samples}")



def _bad_error(bad: Tally, processed: int, max_bad_fraction: float) -> DatasetError:
    return DatasetError(
        f"{bad.count} of {processed} processed rows are bad "
        f"({100.0 * bad.count / max(processed, 1):.2f}% > max_bad_fraction "
        f"{100.0 * max_bad_fraction:.2f}%); by reason: {bad.by_reason}; first: {bad.first()}")



def prepare_dataset(input: str, tokenizer_dir: str | Path, out_dir: str | Path,
                    config: DatasetConfig | None = None, progress_interval: float = 5.0,
                    regenerated: str | Path | None = None, trust_remote_code: bool = False) -> dict:
    """Tokenize ``input`` with the chat template of ``tokenizer_dir`` into ``out_dir``.

    Writes train.parquet, eval.parquet, eval_prompts.jsonl and stats.json (see
    docs/formats.md); returns the stats. Raises DatasetError on unusable input.
    ``regenerated``: regenerate_responses' responses.jsonl; each sample's assistant
    turns are then the target's own answers, and samples without one are left out
    (listed under ``regenerated.skipped``). A training sample's further answers
    (regenerate's ``answers_per_prompt``) become training samples of their own, id
    ``<id>~answer<k>``, right after their first answer (``regenerated.more_answers``).
    ``trust_remote_code``: ``target.trust_remote_code``, for a tokenizer with its own code.
    """
    config = config or DatasetConfig()
    config.validate()
    out_dir = Path(out_dir)
    if not Path(tokenizer_dir).is_dir():
        raise DatasetError(f"tokenizer directory {str(tokenizer_dir)!r} does not exist")
    sources = load_sources(input, config.format, config.split)  # before the slow transformers import
    masker = ChatMasker(load_tokenizer(tokenizer_dir, trust_remote_code), config.chat_template_kwargs)

    locations, ids, renamed, order = processing_order(sources, config.seed)
    total_rows = len(ids)

    out_dir.mkdir(parents=True, exist_ok=True)
    all_path = out_dir / ".all.parquet.tmp"
    writer = SampleWriter(all_path, with_prompt=True)
    bad, dropped, truncated = Tally(), Tally(), Tally()
    processed = kept = 0
    cap = config.max_samples
    progress = (Progress("prepare_dataset", min(cap, total_rows), "samples", interval=progress_interval)
                if cap else Progress("prepare_dataset", total_rows, "rows", interval=progress_interval))
    answers = load_regenerated(regenerated) if regenerated else None
    skipped = Tally()
    regenerated_kept = truncated_answers = 0
    # Further regenerated answers follow their first answer in the file (the train split
    # keeps the processing order's randomness for streaming partitions); the split drops
    # those of eval prompts. Positions in the file: each kept first answer's, the further ones'.
    first_rows, more_rows = [], []
    more_skipped = Tally()

    def fitted(sample_id: str, outcome, bad_rows: Tally):
        """``(sample fitted to max_length or None, prompt_json)``; what is left out is counted."""
        if isinstance(outcome, BadRow):
            (skipped if isinstance(outcome, Skipped) else bad_rows).add(sample_id, outcome.reason, outcome.detail)
            return None, None
        prompt_json, input_ids, loss_mask = outcome
        return apply_length_policy(sample_id, input_ids, loss_mask, config.max_length, config.length_policy,
                                   dropped, truncated), prompt_json

    results = row_results(order, sources, ids, locations, masker, config.num_workers, answers)
    try:
        for g, outcome in results:
            if cap is not None and kept >= cap:
                break
            processed += 1
            sample_id = ids[g]
            sample, prompt_json = fitted(sample_id, outcome, bad)
            if sample is not None:
                first_rows.append(writer.rows)
                writer.add(sample_id, *sample, prompt_json)
                kept += 1
                if answers is not None:
                    regenerated_kept += 1
                    truncated_answers += "length" in answers[sample_id].get("finish_reasons", [])
                    source, index = sources[locations[g][0]], locations[g][1]
                    for answer_id, more in tokenize_more_answers(source, index, sample_id, masker, answers):
                        more_sample, more_prompt = fitted(answer_id, more, more_skipped)
                        if more_sample is not None:
                            more_rows.append(writer.rows)
                            writer.add(answer_id, *more_sample, more_prompt)
            # The final fraction is at least bad / total_rows: fail as soon as that is too high.
            if bad.count > config.max_bad_fraction * total_rows:
                raise _bad_error(bad, processed, config.max_bad_fraction)
            progress.update(1 if cap is None or sample is not None else 0,
                            extra=f"bad {bad.count} dropped {dropped.count}")
        progress.close()
        if bad.count > config.max_bad_fraction * processed:
            raise _bad_error(bad, processed, config.max_bad_fraction)
        if kept == 0:
            raise DatasetError(f"{input}: no usable samples out of {processed} rows "
                               f"(bad: {bad.by_reason}; dropped: {dropped.by_reason})")
        n_eval = 0
        if config.eval_fraction > 0 and kept >= 2:
            n_eval = min(kept - 1, max(1, round(config.eval_fraction * kept)))
        writer.close()
        # The eval split is the first n_eval first answers; an eval prompt's further answers
        # are left out (a prompt seen in training would not be held out).
        cut = first_rows[n_eval] if n_eval < len(first_rows) else writer.rows
        held_out_more = {row for row in more_rows if row < cut}
        more_kept = len(more_rows) - len(held_out_more)
        split_stats = split_outputs(all_path, out_dir, cut, drop=held_out_more)
    finally:
        results.close()  # stops the worker pool, if any
        writer.writer.close()  # idempotent; releases the file before it is removed
        all_path.unlink(missing_ok=True)

    stats = {
        "input": input,
        "tokenizer": str(tokenizer_dir),
        "config": asdict(config),
        "sources": [{"name": s.name, "format": s.format, "rows": len(s.rows)} for s in sources],
        "rows": {"total": total_rows, "processed": processed, "kept": kept},
        "splits": split_stats,
        "truncated": {"count": truncated.count, "ids": [r["id"] for r in truncated.rows]},
        "dropped": dropped.to_json(),
        "bad": {**bad.to_json(), "fraction": bad.count / max(processed, 1)},
        "duplicate_ids": {"count": len(renamed), "renamed": renamed[:LIST_LIMIT]},
        # Which answers the draft learns from: the dataset's own, or the target's.
        "regenerated": ({"source": str(regenerated), "samples": regenerated_kept,
                         "fraction": regenerated_kept / max(kept, 1),
                         "truncated_answers": truncated_answers, "skipped": skipped.to_json(),
                         "more_answers": {"samples": more_kept, "skipped": more_skipped.to_json()}}
                        if answers is not None else {"source": None, "samples": 0, "fraction": 0.0}),
    }
    with open(out_dir / ".stats.json.tmp", "w", encoding="utf-8") as f:
        json.dump(stats, f, indent=2, ensure_ascii=False)
    for name in OUTPUT_FILES:  # stats.json last: its presence means the rest is complete
        os.replace(out_dir / f".{name}.tmp", out_dir / name)
    return stats



def main(argv: list[str] | None = None) -> int:
    """CLI: artifact paths as flags, the settings as one --config-json (the dataset section;
    its path and builtin_prompts are the workflow's: --input is the data; and
    trust_remote_code, target.trust_remote_code: run the tokenizer's own code).

    python -m eagle3flow.data.dataset --input PATH_OR_HUB_ID --tokenizer TARGET_DIR \\
        --out-dir results/dataset [--regenerated results/regenerate/responses.jsonl] \\
        [--split train] --config-json '{"max_length": 2048, "chat_template_kwargs": {...}, ...}'
    """
    parser = argparse.ArgumentParser(prog="python -m eagle3flow.data.dataset", description=main.__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--input", required=True, help="data file, directory of files, or Hub dataset id")
    parser.add_argument("--tokenizer", required=True, help="target model directory (tokenizer + chat template)")
    parser.add_argument("--out-dir", required=True)
    parser.add_argument("--regenerated", default=None,
                        help="regenerate_responses' responses.jsonl: train on the target's own answers")
    parser.add_argument("--split", default=DatasetConfig.split, help="split of a Hub dataset")
    parser.add_argument("--config-json", default="{}", help="the dataset section and trust_remote_code (above)")
    args = parser.parse_args(argv)
    settings = cli_settings(parser, "dataset", args.config_json, borrowed=DATASET_BORROWED)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never hang on a network that is not there
    config = DatasetConfig(split=args.split, **{f.name: settings[f.name] for f in fields(DatasetConfig)
                                                if f.name in settings})
    try:
        stats = prepare_dataset(args.input, args.tokenizer, args.out_dir, config,
                                regenerated=args.regenerated, trust_remote_code=settings["trust_remote_code"])
    except (ValueError, OSError) as error:  # DatasetError, MaskError, missing files
        print(f"prepare_dataset: error: {error}", file=sys.stderr)
        return 1
    train, eval_ = stats["splits"]["train"], stats["splits"]["eval"]
    print(f"prepare_dataset: train {train['samples']} samples / {train['tokens']} tokens, "
          f"eval {eval_['samples']} / {eval_['tokens']}; bad {stats['bad']['count']}, "
          f"dropped {stats['dropped']['count']}, truncated {stats['truncated']['count']}, "
          f"with the target's own answers {stats['regenerated']['samples']} "
          f"-> {args.out_dir}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
