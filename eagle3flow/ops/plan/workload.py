"""The workload the plan is for: the target's config (or a built-in target's shape
before it is built), samples and tokens per split, and with regeneration the answers
still to make and the server's rate. Measured where this directory has run the
stages, else estimated (each number says its basis). No torch."""
from __future__ import annotations

import json
from pathlib import Path

from eagle3flow.config import regenerate_url
from eagle3flow.layout import Layout
from eagle3flow.ops.plan.sizes import format_bytes, tree_bytes
from eagle3flow.ops.streaming import read_json
from eagle3flow.target.config import load_target_config
from eagle3flow.target.shapes import SHAPES

# Measured on `make demo` (the embedded default, 2 AVX2 cores, 2026-12-03): 4,000
# conversations render to 647,045 tokens with the chat template (161.8 each, what
# extraction and training count), their JSONL 4.3 bytes per token, the tokenized parquet
# 1.2; the target build at ~1,400 tokens/s per core (1,600 steps of 1,024 tokens in 706 s,
# 544 s and 501 s on 2 AMD EPYC cores without AVX-512, 2026-12-04 and 2026-12-05 twice;
# scaled by the host's one-core matmul rate).
EMBEDDED_TOKENS_PER_CONVERSATION = 161.8
EMBEDDED_JSONL_BYTES_PER_TOKEN = 4.3
RAW_BYTES_PER_TOKEN = 4.0          # a raw chat JSON/JSONL file, roughly, when nothing is measured
PARQUET_BYTES_PER_TOKEN = 1.2
EMBEDDED_BUILD_TOKENS_PER_S_PER_CORE = 1400
EMBEDDED_BUILD_STEP_TOKENS = 4 * 256     # eagle3flow/embedded/build.py TrainOptions: batch_size x block_size
ASSUMED_SERVER_TOKENS_PER_S = 2000
# The target's own answers (regenerate.enabled), before any answer exists: an answer
# fills this fraction of regenerate.max_tokens (measured: SmolLM2-135M, max_tokens 128,
# ~0.76); then the mean of the answers already in the cache, then the stage's stats.
ASSUMED_ANSWER_FILL = 0.75
# Chat template tokens around one prompt + answer (role headers, end-of-turn markers).
TEMPLATE_TOKENS_PER_TURN = 10
# The built-in prompts (eagle3flow/data/builtin_prompts.py): ~1.2 answers per prompt (a fifth
# have a follow-up turn), ~40 tokens of prompt per answer; the embedded corpus' prompts ~20.
BUILTIN_ANSWERS_PER_PROMPT = 1.2
BUILTIN_PROMPT_TOKENS = 40
EMBEDDED_PROMPT_TOKENS = 20
# A server the regenerate job starts for a built-in target (no URL): its start-up, and
# its rate on the CPU build (SmolLM2-135M on 2 cores: ~150 completion tokens/s).
ASSUMED_SELF_SERVED_STARTUP_S = 60.0
ASSUMED_SELF_SERVED_CPU_TOKENS_PER_S = 150
# Rows of a local JSONL dataset read to estimate its prompts and answers per row.
SAMPLED_ROWS = 2000


def target_config(config: dict, root: Path) -> tuple[dict, str]:
    """The target's text config and where it came from (a built-in target's shape before
    it is built: eagle3flow/target/shapes.py)."""
    path = config["target"]["path"]
    builtin = (config["target"].get("builtin") or "embedded") if not path else None
    layout = Layout.of(config)
    built = {"embedded": layout.embedded_target, "smollm2-135m": layout.pretrained_target}
    target_dir = Path(path) if path else root / built.get(builtin, layout.embedded_target)
    if not target_dir.is_absolute():
        target_dir = root / target_dir
    cfg_file = target_dir / "config.json"
    if cfg_file.is_file():
        return load_target_config(target_dir), str(cfg_file)
    if path:
        raise FileNotFoundError(f"{cfg_file}: target.path has no config.json; the plan needs the "
                                "target's hidden size and layer count")
    return dict(SHAPES[builtin]), f"{builtin} shape"


def _sample_jsonl(path: Path) -> dict | None:
    """Rows, answers per row and prompt characters per answer of a local JSONL dataset,
    from its first SAMPLED_ROWS rows (scaled to the file by bytes); None when it is not
    JSONL of messages/conversations/instruction rows."""
    if not path.is_file() or not path.name.endswith((".jsonl", ".json")):
        return None
    rows = answers = prompt_chars = read = 0
    try:
        with open(path, "rb") as f:
            for line in f:
                read += len(line)
                if not line.strip():
                    continue
                row = json.loads(line)
                turns = row.get("messages") or row.get("conversations")
                if isinstance(turns, list):
                    roles = [m.get("role") or {"gpt": "assistant", "human": "user"}.get(m.get("from"), m.get("from"))
                             for m in turns if isinstance(m, dict)]
                    n = sum(r == "assistant" for r in roles) + (1 if roles and roles[-1] == "user" else 0)
                    prompt_chars += sum(len(str(m.get("content") or m.get("value") or ""))
                                        for m, r in zip(turns, roles) if r != "assistant")
                elif row.get("instruction") is not None or row.get("prompt") is not None:
                    n = 1
                    prompt_chars += len(str(row.get("instruction") or row.get("prompt") or "")) + len(
                        str(row.get("input") or ""))
                else:
                    return None
                rows += 1
                answers += n
                if rows >= SAMPLED_ROWS:
                    break
    except (OSError, ValueError, AttributeError):
        return None
    if not rows or not answers:
        return None
    total = rows * path.stat().st_size / max(read, 1)
    return {"rows": max(rows, int(total)), "answers_per_row": answers / rows,
            "prompt_tokens_per_answer": prompt_chars / answers / RAW_BYTES_PER_TOKEN,
            "exact": read >= path.stat().st_size}


def newest_regenerate_cache(config: dict, root: Path) -> Path | None:
    """This config's regeneration cache directory (the newest fingerprint), if any."""
    top = root / Layout.of(config).regenerate_cache
    try:
        dirs = sorted((p for p in top.iterdir() if p.is_dir()), key=lambda p: p.stat().st_mtime)
    except OSError:
        return None
    return dirs[-1] if dirs else None


def answer_tokens(config: dict, root: Path) -> tuple[float, int, str]:
    """(tokens per regenerated answer, answers already made, basis): the stage's stats
    when it finished, else the mean of the answers in its cache, else regenerate.max_tokens
    x ASSUMED_ANSWER_FILL."""
    stats = read_json(root / Layout.of(config).regenerate_stats)
    if stats and stats.get("turns"):
        return stats["completion_tokens"] / stats["turns"], int(stats["turns"]), "regenerate's stats"
    cache = newest_regenerate_cache(config, root)
    tokens = turns = 0
    if cache is not None:
        try:
            with open(cache / "responses.jsonl") as f:
                for line in f:
                    try:
                        entry = json.loads(line)
                        tokens += int(entry["completion_tokens"])
                        turns += len(entry["finish_reasons"])
                    except (ValueError, KeyError, TypeError):
                        continue
        except OSError:
            pass
    if turns:
        return tokens / turns, turns, f"mean of the {turns:,} answers in {cache.name}'s cache"
    max_tokens = int(config["regenerate"]["max_tokens"])
    return (max_tokens * ASSUMED_ANSWER_FILL, 0,
            f"assumed {ASSUMED_ANSWER_FILL:.0%} of regenerate.max_tokens {max_tokens}")


def serving_rate(config: dict, root: Path) -> tuple[float, float, str]:
    """(completion tokens/s of the target's server, its start-up s, basis): measured by the
    last regeneration (its stats, or its cache's rate.json while it ran), else assumed."""
    self_served = not regenerate_url(config) and not config["target"]["path"]
    startup = ASSUMED_SELF_SERVED_STARTUP_S if self_served else 0.0
    stats = read_json(root / Layout.of(config).regenerate_stats) or {}
    sent = stats.get("sent") or {}
    if sent.get("completion_tokens") and sent.get("tokens_per_s"):
        return float(sent["tokens_per_s"]), startup, "measured by the last regeneration"
    cache = newest_regenerate_cache(config, root)
    rate = read_json(cache / "rate.json") if cache is not None else None
    if rate and rate.get("completion_tokens") and rate.get("seconds"):
        return rate["completion_tokens"] / rate["seconds"], startup, "measured while answering (cache)"
    if self_served and config["resources"]["gpus"] == 0:
        return float(ASSUMED_SELF_SERVED_CPU_TOKENS_PER_S), startup, "assumed (the CPU build serving the target)"
    return float(ASSUMED_SERVER_TOKENS_PER_S), startup, "assumed from the server"


def workload(config: dict, root: Path) -> dict:
    """Samples and tokens per split (after max_length), and where the numbers came from.

    With regeneration (regenerate.enabled) the dataset is the prompts with the target's
    answers, not the file's: prompts x answers per prompt x (prompt + answer tokens),
    the answer length from :func:`answer_tokens`; with ``regenerate.answers_per_prompt`` N
    the train split holds N answers of each prompt, the eval split one. ``regenerate`` then
    says how many answers are still to be generated and how many tokens they are."""
    stats_file = root / Layout.of(config).dataset("stats.json")
    regen = bool((config.get("regenerate") or {}).get("enabled"))
    per_prompt = int(config["regenerate"].get("answers_per_prompt", 1)) if regen else 1
    if stats_file.is_file():
        with open(stats_file) as f:
            splits = json.load(f)["splits"]
        out = {"train_tokens": int(splits["train"]["tokens"]), "eval_tokens": int(splits["eval"]["tokens"]),
               "train_samples": int(splits["train"]["samples"]),
               "eval_samples": int(splits["eval"]["samples"]), "basis": str(stats_file),
               "answers_per_prompt": per_prompt}
        if regen:
            out["regenerate"] = {"answers_to_make": 0, "answer_tokens_to_make": 0}
        return out
    ds = config["dataset"]
    max_samples = ds.get("max_samples")
    builtin_target = config["target"]["path"] is None and (config["target"].get("builtin") or "embedded")
    shape = None      # (rows, answers per row, prompt tokens per answer) when regenerating
    if ds["path"] is None and builtin_target not in (None, "embedded"):
        samples = int(ds["builtin_prompts"])
        shape = (samples, BUILTIN_ANSWERS_PER_PROMPT, BUILTIN_PROMPT_TOKENS)
        basis = f"estimate: {samples} built-in prompts"
        tokens = samples * BUILTIN_ANSWERS_PER_PROMPT * BUILTIN_PROMPT_TOKENS
    elif ds["path"] is None:
        conversations = config["embedded"]["max_conversations"]
        tokens = conversations * EMBEDDED_TOKENS_PER_CONVERSATION
        samples = conversations
        shape = (samples, 1.0, EMBEDDED_PROMPT_TOKENS)
        basis = f"estimate: {conversations} embedded conversations x {EMBEDDED_TOKENS_PER_CONVERSATION} tokens"
    else:
        src = Path(ds["path"]) if Path(ds["path"]).is_absolute() else root / ds["path"]
        if not src.exists():
            raise FileNotFoundError(
                f"{src}: dataset.path not found locally; run prepare_dataset first "
                "(`snakemake --profile P prepare_dataset`) so the plan can use its stats")
        raw = tree_bytes(src)
        tokens = raw / RAW_BYTES_PER_TOKEN
        samples = max(1, int(tokens / 500))
        basis = f"estimate: {format_bytes(raw)} of raw data / {RAW_BYTES_PER_TOKEN} bytes per token"
        sampled = _sample_jsonl(src) if regen else None
        if sampled:
            samples = sampled["rows"]
            shape = (samples, sampled["answers_per_row"], sampled["prompt_tokens_per_answer"])
            basis = (f"estimate: {samples:,} rows of {src.name}" + ("" if sampled["exact"] else " (sampled)"))
    regen_info = None
    if regen and shape is not None:
        rows, per_row, prompt_tokens = shape
        if max_samples and max_samples < rows:
            rows = samples = max_samples
        answer, made, answer_basis = answer_tokens(config, root)
        answers = rows * per_row
        tokens = answers * (prompt_tokens + answer + TEMPLATE_TOKENS_PER_TURN)
        basis += (f" x {per_row:.2f} answers x ({prompt_tokens:.0f} prompt + {answer:.0f} answer + "
                  f"{TEMPLATE_TOKENS_PER_TURN} template tokens; answers: {answer_basis})")
        if per_prompt > 1:
            basis += f"; train: {per_prompt} answers per prompt"
        all_answers = answers * per_prompt
        regen_info = {"answers": all_answers, "answers_to_make": max(0.0, all_answers - made),
                      "answer_tokens": answer, "answer_tokens_to_make": max(0.0, all_answers - made) * answer,
                      "answer_basis": answer_basis}
    elif max_samples and max_samples < samples:
        tokens, samples = tokens * max_samples / samples, max_samples
    tokens = min(tokens, samples * ds["max_length"])
    eval_tokens = tokens * ds["eval_fraction"]
    eval_samples = int(samples * ds["eval_fraction"])
    out = {"train_tokens": int((tokens - eval_tokens) * per_prompt), "eval_tokens": int(eval_tokens),
           "train_samples": (samples - eval_samples) * per_prompt, "eval_samples": eval_samples, "basis": basis,
           "answers_per_prompt": per_prompt}
    if regen_info:
        out["regenerate"] = regen_info
    return out


