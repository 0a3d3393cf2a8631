"""The embedded default target: a tiny Llama chat model built offline in minutes.

Pipeline (all deterministic for a given Python/torch, no download anywhere):
  1. ``conversations.jsonl`` from stdlib docstrings (eagle3flow/embedded/corpus.py),
  2. a Llama-3-style byte-level BPE tokenizer with a chat template (eagle3flow/embedded/tokenizer.py),
  3. a small ``LlamaForCausalLM`` (8 layers, ~4.7M params, untied lm_head) trained on
     the chat-rendered conversations packed into fixed-length blocks.

Outputs under ``--out-dir``: ``target/`` (HF dir: float32 safetensors, tokenizer,
generation config), ``conversations.jsonl``, ``build_stats.json``. The target is
built in ``.build-<fingerprint>/`` and renamed into place at the end, so an
interrupted build never leaves a half target; training checkpoints there let a
rerun with the same options resume instead of starting over.

CLI::

    python -m eagle3flow.embedded.build --out-dir results/embedded \
        [--config-json '{"train_steps": 300, "seed": 0, "max_conversations": 4000}'] [--threads N]

(the config's ``embedded`` section; the schema gives what is left out)
"""
from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import platform
import shutil
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

from eagle3flow.atomic import replacing, write_text
from eagle3flow.config import cli_settings
from eagle3flow.procfs import usable_cores
from eagle3flow.embedded.corpus import build_corpus, read_conversations
from eagle3flow.embedded.tokenizer import EOS_TEXT, EOT, save_tokenizer, train_tokenizer
from eagle3flow.progress import Progress
from eagle3flow.target.shapes import TargetShape


@dataclass(frozen=True)
class TrainOptions:
    # The three the config sets (schemas/config.schema.yaml: embedded) come from there.
    steps: int
    seed: int
    max_conversations: int
    block_size: int = 256       # packed tokens per row
    batch_size: int = 4         # rows per step: more, smaller steps learn faster per token here
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 20
    weight_decay: float = 0.1
    checkpoint_every: int = 50


def build_config(shape: TargetShape, tokenizer):
    return LlamaConfig(
        vocab_size=shape.vocab_size, hidden_size=shape.hidden_size,
        intermediate_size=shape.intermediate_size, num_hidden_layers=shape.num_hidden_layers,
        num_attention_heads=shape.num_attention_heads,
        num_key_value_heads=shape.num_key_value_heads,
        max_position_embeddings=shape.max_position_embeddings, rope_theta=10000.0,
        rms_norm_eps=1e-5, tie_word_embeddings=False, torch_dtype="float32",
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.convert_tokens_to_ids(EOT),
        pad_token_id=tokenizer.pad_token_id)


def pack_blocks(tokenizer, conversations: list[dict], block_size: int, seed: int):
    """Chat-rendered conversations in a seeded order, concatenated, cut into blocks.

    Returns int64 ``[num_blocks, block_size]``; the ragged tail is dropped. Each
    conversation starts with ``<|begin_of_text|>``, which marks the boundaries.
    """
    order = torch.randperm(len(conversations), generator=torch.Generator().manual_seed(seed))
    stream: list[int] = []
    for index in order.tolist():
        stream += tokenizer.apply_chat_template(
            conversations[index]["messages"], tokenize=True, return_dict=True)["input_ids"]
    num_blocks = len(stream) // block_size
    if num_blocks == 0:
        raise ValueError(f"corpus has {len(stream)} tokens, fewer than one block of {block_size}")
    return torch.tensor(stream[:num_blocks * block_size], dtype=torch.int64).view(num_blocks, block_size)


def batch_indices(step: int, num_blocks: int, batch_size: int, seed: int):
    """Block rows for ``step``: epochs of seeded permutations, a pure function of ``step``
    (so a resumed run sees exactly the batches an uninterrupted one would)."""
    start = step * batch_size
    rows = []
    while len(rows) < batch_size:
        epoch, offset = divmod(start + len(rows), num_blocks)
        perm = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed * 100003 + epoch))
        take = min(batch_size - len(rows), num_blocks - offset)
        rows += perm[offset:offset + take].tolist()
    return torch.tensor(rows)


def lr_at(step: int, options: TrainOptions) -> float:
    """Linear warmup, then cosine down to ``min_lr_ratio * lr``."""
    if step < options.warmup_steps:
        return options.lr * (step + 1) / options.warmup_steps
    progress = (step - options.warmup_steps) / max(1, options.steps - options.warmup_steps)
    cosine = 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
    return options.lr * (options.min_lr_ratio + (1 - options.min_lr_ratio) * cosine)


def _save_atomic(obj, path: Path) -> None:
    with replacing(path) as tmp:
        torch.save(obj, tmp)


def train_model(config, blocks, options: TrainOptions, work_dir: Path):
    """Train from scratch (or resume from ``work_dir/checkpoint.pt``); return (model, losses).

    ``blocks``: int64 ``[num_blocks, block_size]``. Loss is next-token cross-entropy
    over every token (the model must learn the chat format as well as the answers).
    """
    torch.manual_seed(options.seed)
    model = LlamaForCausalLM(config).to(torch.float32)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": options.weight_decay},
         {"params": no_decay, "weight_decay": 0.0}], lr=options.lr, betas=(0.9, 0.95))
    checkpoint_path = work_dir / "checkpoint.pt"
    start_step, losses = 0, []
    if checkpoint_path.exists():
        state = torch.load(checkpoint_path, map_location="cpu", weights_only=False)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        start_step, losses = state["step"], state["losses"]
        print(f"embedded: resuming training at step {start_step}", file=sys.stderr, flush=True)

    model.train()
    num_blocks = blocks.shape[0]
    tokens_per_step = options.batch_size * blocks.shape[1]
    # Counted in tokens: a step takes seconds, so a steps/s rate would print as 0.
    progress = Progress("embedded train", options.steps * tokens_per_step, unit="tokens",
                        done=start_step * tokens_per_step)
    for step in range(start_step, options.steps):
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, options)
        batch = blocks[batch_indices(step, num_blocks, options.batch_size, options.seed)]
        loss = model(input_ids=batch, labels=batch).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        losses.append(loss.item())
        recent = losses[-20:]
        done = step + 1
        progress.update(tokens_per_step, extra=f"step {done}/{options.steps} "
                                               f"loss {sum(recent) / len(recent):.3f}")
        if done % options.checkpoint_every == 0 and done < options.steps:
            _save_atomic({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                          "step": done, "losses": losses}, checkpoint_path)
    progress.close()
    model.eval()
    return model, losses


def _fingerprint(shape: TargetShape, options: TrainOptions, corpus_sha: str) -> str:
    text = json.dumps({"shape": asdict(shape), "options": asdict(options), "corpus": corpus_sha,
                       "torch": torch.__version__}, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _replace_dir(new: Path, final: Path) -> None:
    """Put ``new`` at ``final``; an old ``final`` is moved aside first, then deleted."""
    if final.exists():
        old = final.with_name(final.name + f".old{os.getpid()}")
        os.replace(final, old)
        os.replace(new, final)
        shutil.rmtree(old)
    else:
        os.replace(new, final)


def build_embedded(out_dir: Path, options: TrainOptions,
                   shape: TargetShape = TargetShape(), threads: int | None = None) -> dict:
    """Build ``out_dir/{conversations.jsonl, target/, build_stats.json}``; return the stats."""
    t0, cpu0 = time.monotonic(), time.process_time()
    torch.set_num_threads(threads or usable_cores())
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)

    corpus_path = out_dir / "conversations.jsonl"
    corpus_stats = build_corpus(corpus_path, options.max_conversations)
    conversations = read_conversations(corpus_path)
    corpus_sha = hashlib.sha256(corpus_path.read_bytes()).hexdigest()
    print(f"embedded: {len(conversations)} conversations ({corpus_stats['multi_turn']} "
          f"multi-turn) -> {corpus_path}", file=sys.stderr, flush=True)

    work_dir = out_dir / f".build-{_fingerprint(shape, options, corpus_sha)}"
    build_dir = work_dir / "target"
    if build_dir.exists():
        shutil.rmtree(build_dir)  # a half-saved target from an interrupted run
    build_dir.mkdir(parents=True)

    tokenizer = train_tokenizer(conversations, shape.vocab_size)
    if len(tokenizer) > shape.vocab_size:
        raise RuntimeError(f"tokenizer has {len(tokenizer)} tokens, more than the model's "
                           f"vocab_size {shape.vocab_size}")
    # A small corpus (--max-conversations) may learn fewer merges; the model keeps
    # vocab_size rows anyway (unused rows are harmless, as in many real checkpoints).
    save_tokenizer(tokenizer, build_dir)
    config = build_config(shape, tokenizer)
    blocks = pack_blocks(tokenizer, conversations, options.block_size, options.seed)
    print(f"embedded: {blocks.numel():,} training tokens in {blocks.shape[0]} blocks of "
          f"{options.block_size}; {options.steps} steps x {options.batch_size} blocks = "
          f"{options.steps * options.batch_size / blocks.shape[0]:.2f} epochs",
          file=sys.stderr, flush=True)

    t_train = time.monotonic()
    model, losses = train_model(config, blocks, options, work_dir)
    train_seconds = time.monotonic() - t_train
    model.save_pretrained(build_dir, safe_serialization=True)
    eot, end_of_text = tokenizer.convert_tokens_to_ids(EOT), tokenizer.convert_tokens_to_ids(EOS_TEXT)
    GenerationConfig(bos_token_id=tokenizer.bos_token_id, eos_token_id=[eot, end_of_text],
                     pad_token_id=tokenizer.pad_token_id, do_sample=False,
                     max_new_tokens=256).save_pretrained(build_dir)

    tail = losses[-20:]
    stats = {
        "params": sum(p.numel() for p in model.parameters()),
        "final_loss": round(sum(tail) / len(tail), 4) if tail else None,
        "first_loss": round(losses[0], 4) if losses else None,
        "wall_seconds": round(time.monotonic() - t0, 1),
        # CPU seconds show the work apart from how busy the machine was.
        "cpu_seconds": round(time.process_time() - cpu0, 1),
        "train_seconds": round(train_seconds, 1),
        "threads": torch.get_num_threads(),
        "tokenizer_size": len(tokenizer),
        "train_tokens": int(blocks.numel()),
        "epochs": round(options.steps * options.batch_size / blocks.shape[0], 3),
        "corpus": corpus_stats,
        "corpus_sha256": corpus_sha,
        "options": asdict(options),
        "shape": asdict(shape),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "loss_curve": [round(x, 4) for x in losses[::max(1, len(losses) // 50)]],
    }
    _replace_dir(build_dir, out_dir / "target")
    # This build's work dir, and any left by interrupted builds with other options.
    for stale in out_dir.glob(".build-*"):
        shutil.rmtree(stale, ignore_errors=True)
    write_text(out_dir / "build_stats.json", json.dumps(stats, indent=2) + "\n")
    print(f"embedded: target ({stats['params']:,} params, final loss {stats['final_loss']}) -> "
          f"{out_dir / 'target'} in {stats['wall_seconds']:.0f}s", file=sys.stderr, flush=True)
    return stats


def embedded_options(settings: dict) -> TrainOptions:
    """The build's options from the config's ``embedded`` section (section_settings)."""
    steps = int(settings["train_steps"])
    return TrainOptions(steps=steps, seed=int(settings["seed"]),
                        max_conversations=int(settings["max_conversations"]),
                        warmup_steps=min(TrainOptions.warmup_steps, max(1, steps // 10)))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m eagle3flow.embedded.build", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out-dir", type=Path, required=True)
    parser.add_argument("--config-json", default="{}", help="the config's embedded section")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads (default: the cores this process may run on)")
    args = parser.parse_args(argv)
    options = embedded_options(cli_settings(parser, "embedded", args.config_json))
    build_embedded(args.out_dir, options, threads=args.threads)
    return 0


if __name__ == "__main__":
    sys.exit(main())
