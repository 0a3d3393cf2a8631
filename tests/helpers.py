"""Builders for tests: random targets small enough to run anywhere; process checks."""
from __future__ import annotations

import json
import os
import statistics
from pathlib import Path


def _stat_fields(pid: int) -> list[str]:
    """/proc/PID/stat after the command name: state, ppid, pgrp, session, ..."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()


def alive(pid: int) -> bool:
    try:
        return _stat_fields(pid)[0] not in "ZX"
    except OSError:
        return False


def session_of(pid: int) -> int | None:
    try:
        return int(_stat_fields(pid)[3])
    except OSError:
        return None


def live_session_members(sid: int) -> list[int]:
    """Pids of session ``sid`` that are still running (zombies excluded): a process
    started with ``start_new_session`` and everything it started that stayed in it."""
    return [int(p) for p in os.listdir("/proc") if p.isdigit() and alive(int(p))
            and session_of(int(p)) == sid]


def make_random_llama(out_dir: Path, num_layers: int = 8, hidden_size: int = 64,
                      vocab_size: int = 512, heads: int = 2, kv_heads: int = 1,
                      intermediate_size: int = 128, tie_word_embeddings: bool = False,
                      seed: int = 0) -> Path:
    # head_dim = hidden_size // heads = 32: vLLM's CPU attention needs 32, 64, 80, ...
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=intermediate_size,
        num_hidden_layers=num_layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
        max_position_embeddings=512, tie_word_embeddings=tie_word_embeddings,
        bos_token_id=1, eos_token_id=2, pad_token_id=0)
    model = LlamaForCausalLM(config).to(torch.float32)
    out_dir = Path(out_dir)
    model.save_pretrained(out_dir)
    return out_dir


def greedy_answers(results: Path, prompt_set: str = "eval") -> list[list[int]]:
    """The target's greedy answers to a prompt set in an evaluation (its vLLM baseline run)."""
    baseline = json.loads((results / "eval" / "vllm_baseline.json").read_text())
    outputs = next(s for s in baseline["sets"] if s["name"] == prompt_set)["outputs"]
    return [list(o["output_token_ids"]) for o in outputs]


def answer_diversity(answers: list[list[int]]) -> tuple[float, float]:
    """(fraction of answers that no other answer equals, median answer length in tokens)."""
    counts: dict[tuple, int] = {}
    for a in answers:
        counts[tuple(a)] = counts.get(tuple(a), 0) + 1
    unique = sum(1 for a in answers if counts[tuple(a)] == 1)
    return unique / len(answers), statistics.median(len(a) for a in answers)


WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu".split()


def write_word_conversations(path: Path, n: int) -> Path:
    """``n`` one-turn conversations of a dozen words, as OpenAI messages (JSONL)."""
    with open(path, "w") as f:
        for i in range(n):
            question = " ".join(WORDS[(i + j) % len(WORDS)] for j in range(5 + i % 7))
            answer = " ".join(WORDS[(i * 3 + j) % len(WORDS)] for j in range(10 + i % 13))
            f.write(json.dumps({"id": f"c{i}", "messages": [
                {"role": "user", "content": question}, {"role": "assistant", "content": answer}]}) + "\n")
    return path
