"""The quality benchmark's data made on one GPU, for the ablations (ablate.py): no vLLM.

The CPU benchmark (run.py) regenerates the answers through a vLLM server; the GPU machine
has no vLLM, so here the target answers through transformers' ``generate`` (greedy, the
same chat template, the same turn-by-turn order as the regenerate stage), and the
workflow's own dataset stage tokenizes them. This is a stand-in for choosing training
settings, not the benchmark's data: its numbers are labelled as such.

Writes into ``--out``:
  ``responses.jsonl``    the regenerate stage's format (one row per prompt)
  ``dataset/``           prepare_dataset's train.parquet / eval.parquet (``--eval-fraction``)
  ``eval128.parquet``    held-out prompts + the target's greedy 128-token answer (decode-walk split)
  ``mt_bench128.parquet`` MT-bench first turns + the same (when ``--mt-bench`` is given)
  ``train_sampled.parquet`` (``--samples N``) the train split plus N answers per train
                         prompt sampled at ``--temperature`` (more answers per prompt)

    python benchmarks/quality/gpu_data.py --target W/target --out W/data --prompts 1500 \\
        --mt-bench question.jsonl [--samples 2 --temperature 0.7]
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from eagle3flow.data.builtin_prompts import make_prompts
from eagle3flow.data.dataset import DatasetConfig, prepare_dataset


def generate(model, tokenizer, conversations: list[list[dict]], max_tokens: int, sample: bool,
             temperature: float, batch: int = 192) -> list[tuple[list[int], list[int], str]]:
    """``(prompt ids, answer ids, answer text)`` for each conversation (its last turn a user's)."""
    out = []
    for a in range(0, len(conversations), batch):
        chunk = conversations[a:a + batch]
        prompts = [tokenizer.apply_chat_template(c, add_generation_prompt=True, tokenize=True) for c in chunk]
        prompts = [p["input_ids"] if isinstance(p, dict) or hasattr(p, "keys") else p for p in prompts]
        width = max(map(len, prompts))
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        ids = torch.tensor([[pad] * (width - len(p)) + list(p) for p in prompts], device=model.device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=model.device)
        with torch.no_grad():
            gen = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_tokens,
                                 do_sample=sample, temperature=temperature if sample else None,
                                 top_p=None, top_k=None, pad_token_id=pad)
        eos = set(model.generation_config.eos_token_id if isinstance(model.generation_config.eos_token_id, list)
                  else [model.generation_config.eos_token_id])
        for p, row in zip(prompts, gen[:, width:].tolist()):
            answer = []
            for t in row:
                if t in eos:
                    break
                answer.append(t)
            out.append((list(p), answer, tokenizer.decode(answer, skip_special_tokens=True)))
        print(f"gpu_data: {min(a + batch, len(conversations))}/{len(conversations)} answered", file=sys.stderr,
              flush=True)
    return out


def answer_all(model, tokenizer, prompts: list[dict], max_tokens: int, sample=False, temperature=1.0,
               batch: int = 192):
    """Each prompt's conversation with every assistant turn answered by the target, turn by turn."""
    convs = [[dict(m) for m in p["messages"]] for p in prompts]
    done = [[] for _ in convs]   # answered messages so far
    pending = list(range(len(convs)))
    cursor = [0] * len(convs)
    while pending:
        asks = []
        for i in pending:
            msgs = convs[i]
            j = cursor[i]
            while j < len(msgs) and msgs[j]["role"] != "assistant":
                done[i].append(msgs[j])
                j += 1
            cursor[i] = j
            asks.append(i)
        # the conversation so far must end with a user turn; answer it
        results = generate(model, tokenizer, [done[i] for i in asks], max_tokens, sample, temperature, batch)
        pending = []
        for i, (_, _, text) in zip(asks, results):
            done[i].append({"role": "assistant", "content": text})
            cursor[i] += 1   # past the placeholder assistant turn (or past the end)
            if cursor[i] < len(convs[i]):
                pending.append(i)
    return done


def split_rows(model, tokenizer, items: list[tuple[str, list[dict]]], max_tokens: int,
               temperature: float = 0.0) -> pa.Table:
    """The target's answer to each item: greedy, or sampled at ``temperature`` (seeded)."""
    if temperature:
        torch.manual_seed(2000)
    results = generate(model, tokenizer, [m for _, m in items], max_tokens, temperature > 0,
                       temperature or 1.0)
    ids = [p + a for p, a, _ in results]
    masks = [[0] * len(p) + [1] * len(a) for p, a, _ in results]
    return pa.table({"id": [i for i, _ in items], "input_ids": ids, "loss_mask": masks,
                     "num_tokens": [len(x) for x in ids]})


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--target", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--prompts", type=int, default=1500)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--eval-fraction", type=float, default=0.06)
    parser.add_argument("--max-length", type=int, default=1024)
    parser.add_argument("--mt-bench", type=Path, default=None)
    parser.add_argument("--samples", type=int, default=0)
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--eval-temperature", type=float, action="append", default=[],
                        help="also eval128_t<T> / mt_bench128_t<T>: the answers sampled at T (offline "
                             "acceptance at temperature, ablate.py)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--batch", type=int, default=192, help="conversations per generate call")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    tokenizer = AutoTokenizer.from_pretrained(args.target)
    model = AutoModelForCausalLM.from_pretrained(args.target, dtype=torch.bfloat16 if args.device == "cuda" else torch.float32).to(args.device).eval()

    prompts = make_prompts(args.prompts)
    prompts_path = args.out / "prompts.jsonl"
    prompts_path.write_text("".join(json.dumps(p) + "\n" for p in prompts))
    responses = args.out / "responses.jsonl"
    if not responses.is_file():
        answered = answer_all(model, tokenizer, prompts, args.max_tokens, batch=args.batch)
        responses.write_text("".join(json.dumps({"id": p["id"], "messages": m, "finish_reasons": []}) + "\n"
                                     for p, m in zip(prompts, answered)))
    dataset = args.out / "dataset"
    if not (dataset / "stats.json").is_file():
        prepare_dataset(str(prompts_path), args.target, dataset,
                        DatasetConfig(eval_fraction=args.eval_fraction, max_length=args.max_length),
                        regenerated=responses)
    eval_ids = set(pq.read_table(dataset / "eval.parquet", columns=["id"]).column("id").to_pylist())
    by_id = {p["id"]: p for p in prompts}
    first_turn = lambda p: [m for m in p["messages"][:next(i for i, m in enumerate(p["messages"])  # noqa: E731
                                                           if m["role"] == "user") + 1]]
    held = [(i, first_turn(by_id[i])) for i in sorted(eval_ids) if i in by_id]
    items = []
    if args.mt_bench:
        questions = [json.loads(line) for line in args.mt_bench.read_text().splitlines() if line.strip()]
        items = [(f"mt{q['question_id']}", [{"role": "user", "content": q["turns"][0]}]) for q in questions]
    for temperature in [0.0, *args.eval_temperature]:
        suffix = f"_t{temperature:g}" if temperature else ""
        pq.write_table(split_rows(model, tokenizer, held, 128, temperature), args.out / f"eval128{suffix}.parquet")
        if items:
            pq.write_table(split_rows(model, tokenizer, items, 128, temperature),
                           args.out / f"mt_bench128{suffix}.parquet")
    if args.samples:
        train_ids = set(pq.read_table(dataset / "train.parquet", columns=["id"]).column("id").to_pylist())
        extra = []
        for s in range(args.samples):
            torch.manual_seed(1000 + s)
            chosen = [p for p in prompts if p["id"] in train_ids]
            for p, m in zip(chosen, answer_all(model, tokenizer, chosen, args.max_tokens, True, args.temperature,
                                                   args.batch)):
                extra.append({"id": f"{p['id']}~s{s + 1}", "messages": m})
        extra_path = args.out / "sampled.jsonl"
        extra_path.write_text("".join(json.dumps(r) + "\n" for r in extra))
        prepare_dataset(str(extra_path), args.target, args.out / "sampled",
                        DatasetConfig(eval_fraction=0.0, max_length=args.max_length))
        base = pq.read_table(dataset / "train.parquet")
        more = pq.read_table(args.out / "sampled" / "train.parquet").select(base.column_names).cast(base.schema)
        pq.write_table(pa.concat_tables([base, more]), args.out / "train_sampled.parquet")
    print(f"gpu_data: done in {time.monotonic() - t0:.0f}s", file=sys.stderr, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
