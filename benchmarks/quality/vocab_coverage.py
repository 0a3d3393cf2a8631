"""How much of the target's answers falls outside the draft vocabulary, by its size.

A token outside the draft vocabulary is never proposed, so never accepted: the share of
such tokens in the target's answers caps the acceptance at every draft position. The draft
vocabulary is the project's (eagle3flow/data/vocab.py: the most frequent answer tokens of
the training split, then unseen ids in ascending order, as speculators 0.9 fills it too), at
the benchmark's shared 8,192, 16,384 and the project's default 32,000. The answers: the
training split's (what the vocabulary was counted on), the held-out split's (the target's
regenerated answers) and MT-bench's first turns, answered greedily here by the target
through transformers in float32 (128 new tokens, as the evaluation).

    python benchmarks/quality/vocab_coverage.py --work /tmp/quality [--out vocab_coverage.json]

Needs run.py's ``workflow-data`` step (the target and the dataset split) and MT-bench
beside the checkout (../shared/data/mt_bench/question.jsonl).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import torch

import run as quality     # the quality benchmark's run.py, beside this file: its paths and settings
from eagle3flow.data.vocab import count_loss_tokens, select_draft_vocab, target_vocab_size

SIZES = (8192, 16384, 32000)


def answers(parquet: Path) -> list[list[int]]:
    """Each row's loss-masked (answer) token ids."""
    return [[i for i, m in zip(r["input_ids"], r["loss_mask"]) if m == 1]
            for r in pq.read_table(parquet, columns=["input_ids", "loss_mask"]).to_pylist()]


def greedy_answers(target: Path, questions: list[str], max_new_tokens: int, batch: int = 16) -> list[list[int]]:
    from transformers import AutoModelForCausalLM, AutoTokenizer
    tok = AutoTokenizer.from_pretrained(target)
    tok.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    out, t0 = [], time.monotonic()
    for i in range(0, len(questions), batch):
        texts = [tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False)
                 for q in questions[i:i + batch]]
        enc = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)
        with torch.no_grad():
            gen = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False)
        for row in gen[:, enc["input_ids"].shape[1]:].tolist():
            ids = [x for x in row if x != tok.pad_token_id]
            if tok.eos_token_id in ids:
                ids = ids[:ids.index(tok.eos_token_id) + 1]
            out.append(ids)
        done = len(out)
        eta = (time.monotonic() - t0) / done * (len(questions) - done)
        print(f"vocab_coverage: MT-bench answers {done}/{len(questions)}, ETA {eta:.0f} s", file=sys.stderr, flush=True)
    return out


def outside_share(ids: list[list[int]], selected: np.ndarray) -> float:
    flat = np.fromiter((x for a in ids for x in a), dtype=np.int64)
    inside = np.zeros(int(max(flat.max(), selected.max())) + 1, dtype=bool)
    inside[selected] = True
    return float(1.0 - inside[flat].mean())


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", type=Path, required=True, help="run.py's --work (after its workflow-data step)")
    ap.add_argument("--mt-bench-prompts", type=int, default=quality.EVAL["mt_bench_prompts"])
    ap.add_argument("--max-new-tokens", type=int, default=quality.EVAL["max_tokens"])
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    results = args.work / "workflow" / "results"
    target, dataset = results / "pretrained" / "target", results / "dataset"
    for path in (target / "config.json", dataset / "train.parquet", dataset / "eval.parquet", quality.MT_BENCH):
        if not path.is_file():
            raise SystemExit(f"vocab_coverage: {path} is missing (run.py workflow-data; MT-bench beside the checkout)")
    counts = count_loss_tokens([dataset / "train.parquet"], target_vocab_size(target))
    questions = [json.loads(line)["turns"][0] for line in quality.MT_BENCH.read_text().splitlines() if line.strip()]
    sets = {"train": answers(dataset / "train.parquet"), "held_out": answers(dataset / "eval.parquet"),
            "mt_bench_turn1": greedy_answers(target, questions[:args.mt_bench_prompts], args.max_new_tokens)}
    report = {"distinct_train_answer_tokens": int((counts > 0).sum()), "target_vocab_size": len(counts),
              "answer_tokens": {name: sum(map(len, ids)) for name, ids in sets.items()},
              "outside_share": {str(size): {name: outside_share(ids, select_draft_vocab(counts, size))
                                            for name, ids in sets.items()} for size in SIZES}}
    print("| draft vocabulary | " + " | ".join(sets) + " |")
    print("| --- |" + " ---: |" * len(sets))
    for size, row in report["outside_share"].items():
        print(f"| {int(size):,} | " + " | ".join(f"{100 * v:.2f}%" for v in row.values()) + " |")
    if args.out:
        args.out.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
