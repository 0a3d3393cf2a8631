"""The plan: per stage, what will run, the disk it will take, the time and GPU-hours it
will cost, and after the run the same table with what it actually took.

Everything here is cheap (no torch, no model): it runs at the top of every workflow
run, before any job, from ``rules/plan.smk``.

Disk, per stage, from the dataset stats when ``results/dataset/stats.json`` exists,
else from an estimate of the raw dataset, and from the target's config.json:

* hidden states: ``tokens x ((A+1) x H x dtype_bytes + 5)`` (A aux layers + the last
  layer, plus int32 input_ids and uint8 loss_mask) for both splits;
* training cache: ``(keep_checkpoints + 1)`` checkpoints of fp32 weights and the
  optimizer state (12 B/param under AdamW, 8 B/param for the matrices Muon steps; one
  more checkpoint exists for a moment before the oldest is deleted), plus
  ``draft_params x 4`` for ``results/train``;
* export: ``draft_params x dtype_bytes`` plus the vocab map.

A stage whose files already exist counts with their measured size. The projected peak
is the sum over stages (every artifact stays until the end of the run) plus whatever
else already lies in ``results/`` and ``cache/`` (old fingerprints count: they take
the same disk).

Time, per stage, from measured throughputs, best first: this results directory's last
run (extraction's ``throughput.jsonl``, training's ``metrics.jsonl``, the rules'
``results/benchmarks/*.tsv``) recorded per profile in ``results/plan/throughput.json``;
the repo's ``benchmarks/*.json`` figures (``{"stage", "tokens_per_s", "gpus"}``); else
a FLOP count at an assumed rate (said so in the table).

The budget (config ``storage``): ``max_bytes`` caps the projected peak of
``results/`` + ``cache/``; ``min_free_bytes`` is the free space that must be left on
their filesystem after the bytes still to be written. A plan that does not fit is
refused before any job runs, with the settings that would fit.

CLI::

    python -m eagle3flow.ops.plan [--profile embedded] [--config KEY=VALUE ...]   # the plan, dry
    python -m eagle3flow.ops.plan sample-disk --path results --path cache --out F --pid PID
"""
from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from eagle3flow.atomic import write_json
from eagle3flow.ops.procfs import is_zombie
from eagle3flow.target.config import load_target_config
from eagle3flow.target.shapes import SHAPES

# `python -m eagle3flow.ops.plan` gets the workflow's resolved config through this file.
PLAN_CONFIG_ENV = "EAGLE3FLOW_PLAN_CONFIG"

# ----------------------------------------------------------------------------- stages

# Stages in workflow order: rules (prefixes of rule names), GPU or not, the paths
# (relative to results/ or cache/) whose bytes belong to it.
STAGES = (
    ("embedded target", ("build_embedded_target", "build_pretrained_target", "write_builtin_prompts"), False,
     ("results/embedded", "results/pretrained", "results/prompts")),
    ("prepare dataset", ("prepare_dataset",), False, ("results/dataset",)),
    # Answers come from the live server, before any drain: not a GPU stage of this run.
    ("regenerate", ("regenerate_responses",), False, ("results/regenerate", "cache/regenerate")),
    ("extract", ("extract_hidden_states", "extract_partition", "merge_hidden_states"), True,
     ("results/hidden_states", "cache/hidden_states")),
    ("vocab", ("build_vocab_map",), False, ("results/vocab",)),
    ("train", ("train_draft", "train_partition"), True, ("results/train", "cache/train", "cache/streaming")),
    ("export", ("export_draft",), False, ("results/draft",)),
    ("evaluate", ("evaluate_draft",), True, ("results/eval",)),
    ("report", ("build_report",), False, ("results/report",)),
)
# Cache directories holding one subdirectory per fingerprint, and how many of the newest
# are this run's (extraction keeps one per split): a rerun resumes those, the rest is stale.
FINGERPRINTED = {"cache/hidden_states": 2, "cache/train": 1, "cache/regenerate": 1}
DTYPE_BYTES = {"float32": 4, "fp32": 4, "bfloat16": 2, "bf16": 2, "float16": 2, "fp16": 2,
               "float8_e4m3fn": 1, "fp8": 1}
# fp8 shards keep one float32 scale per token and layer (eagle3flow/extract/shards.py).
FP8_SCALE_BYTES = 4
# Per token besides the hidden states: int32 input_ids + uint8 loss_mask.
TOKEN_OVERHEAD_BYTES = 5
# Checkpoint bytes per trainable parameter: the fp32 weight plus AdamW's exp_avg and
# exp_avg_sq, or plus Muon's one momentum buffer.
CHECKPOINT_BYTES_PER_PARAM = 12
MUON_CHECKPOINT_BYTES_PER_PARAM = 8

# Measured on the embedded default (2 cores): the stdlib-docstring corpus gives about
# 59.4 tokens per requested conversation (237,744 for 4,000), its JSONL ~5.3 bytes per
# token; the tokenized parquet ~1.7 bytes per token; the target build takes ~1.76 s
# per pre-training step.
EMBEDDED_TOKENS_PER_CONVERSATION = 59.4
EMBEDDED_JSONL_BYTES_PER_TOKEN = 5.26
RAW_BYTES_PER_TOKEN = 4.0          # a raw chat JSON/JSONL file, roughly, when nothing is measured
PARQUET_BYTES_PER_TOKEN = 1.7
EMBEDDED_BUILD_S_PER_STEP = 1.76
# Effective FLOP/s when nothing is measured: CPU from the embedded default's extraction
# (2 x 4.7M params x 2,900 tokens/s) and training (6 x 0.76M x 7 x 1,500 tokens/s);
# GPU an assumed 40% of a dense bf16 H100/H200 per GPU.
ASSUMED_FLOPS = {("cpu", "extract"): 2.7e10, ("cpu", "train"): 4.8e10,
                 ("gpu", "extract"): 4.0e14, ("gpu", "train"): 4.0e14}
# Seconds of the small stages when this directory has never run them.
ASSUMED_SECONDS = {"prepare dataset": 20.0, "vocab": 5.0, "export": 5.0, "report": 15.0}
ASSUMED_EVALUATE_S = {"cpu": 60.0, "gpu": 900.0}
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
ASSUMED_PRETRAINED_BUILD_S = 60.0


@dataclass
class StageRow:
    """One line of the plan."""
    name: str
    gpu: bool
    status: str                 # "run", "cached", "skip" (not needed by the targets)
    bytes: int                  # projected bytes this stage's paths hold at the end
    bytes_basis: str
    seconds: float
    time_basis: str
    jobs: int = 0               # jobs Snakemake will run for it
    actual_bytes: int | None = None
    actual_seconds: float | None = None


@dataclass
class Plan:
    stages: list[StageRow]
    other_bytes: int            # results/ and cache/ bytes no stage accounts for
    peak_bytes: int             # projected peak of results/ + cache/
    to_write_bytes: int         # bytes still to be written by stages that run
    gpus: int
    drain: bool
    workload: dict
    profile_key: str
    refusal: str | None = None
    actual_peak_bytes: int | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def gpu_seconds(self) -> float:
        return sum(s.seconds for s in self.stages if s.gpu and s.status == "run")

    @property
    def downtime_seconds(self) -> float:
        """With a drain: from the first GPU stage that runs to the last one (CPU stages in
        between, like export, keep the unit down too); else nothing is drained."""
        if not self.drain:
            return 0.0
        running = [i for i, s in enumerate(self.stages) if s.status == "run"]
        gpu_running = [i for i in running if self.stages[i].gpu]
        if not gpu_running:
            return 0.0
        lo, hi = gpu_running[0], gpu_running[-1]
        return sum(self.stages[i].seconds for i in running if lo <= i <= hi)

    def to_json(self) -> dict:
        data = asdict(self)
        data.update(gpu_hours=self.gpu_seconds * max(self.gpus, 1) / 3600 if self.gpus else 0.0,
                    downtime_s=self.downtime_seconds)
        return data


# ----------------------------------------------------------------------------- sizes

def tree_bytes(path: str | os.PathLike) -> int:
    """Apparent size of every regular file under ``path`` (``du -sb``), 0 if missing.

    Files vanishing while walked (a shard renamed, a checkpoint deleted) are skipped.
    """
    total, stack = 0, [str(path)]
    while stack:
        top = stack.pop()
        try:
            entries = list(os.scandir(top))
        except (FileNotFoundError, NotADirectoryError, PermissionError):
            try:
                st = os.stat(top)
                total += st.st_size if os.path.isfile(top) else 0
            except OSError:
                pass
            continue
        for entry in entries:
            try:
                if entry.is_dir(follow_symlinks=False):
                    stack.append(entry.path)
                elif entry.is_file(follow_symlinks=False):
                    total += entry.stat(follow_symlinks=False).st_size
            except OSError:
                pass
    return total


def newest_subdirs_bytes(path: Path, count: int) -> int:
    """Bytes of the ``count`` most recently modified subdirectories (this run's
    fingerprints, when it resumes or reruns unchanged)."""
    try:
        subdirs = sorted((p for p in path.iterdir() if p.is_dir()), key=lambda p: p.stat().st_mtime)
    except OSError:
        return 0
    return sum(tree_bytes(p) for p in subdirs[-count:])


def layout(config: dict) -> dict:
    """Stage path prefixes ("results/...", "cache/...") -> real paths under the config's dirs."""
    paths = config.get("paths", {})
    return {"results": paths.get("results", "results"), "cache": paths.get("cache", "cache")}


def real_path(rel: str, config: dict, root: Path) -> Path:
    top, _, rest = rel.partition("/")
    return root / layout(config)[top] / rest


def measure(config: dict, root: Path) -> tuple[dict[str, int], int]:
    """Bytes now held per stage, and the results/ + cache/ total."""
    per_stage = {name: sum(tree_bytes(real_path(p, config, root)) for p in paths)
                 for name, _, _, paths in STAGES}
    total = sum(tree_bytes(root / d) for d in set(layout(config).values()))
    return per_stage, total


def format_bytes(n: float | None) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KB", "MB", "GB", "TB", "PB"):
        if abs(n) < 1000 or unit == "PB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} PB"


def format_seconds(s: float | None) -> str:
    if s is None:
        return "-"
    s = int(round(s))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{(s % 3600) // 60:02d}m"


def parse_bytes(value) -> int | None:
    """``123``, ``"500GB"``, ``"1.5 TiB"`` -> bytes; None stays None."""
    if value is None or isinstance(value, int):
        return value
    m = re.fullmatch(r"\s*([0-9.]+)\s*([kmgtpKMGTP]?)(i?)[bB]?\s*", str(value))
    if not m:
        raise ValueError(f"storage: cannot read {value!r} as a size (e.g. 500GB, 1.5TiB, 1000000)")
    base = 1024 if m.group(3) else 1000
    return int(float(m.group(1)) * base ** " KMGTP".index(m.group(2).upper() or " "))


# ----------------------------------------------------------------------------- inputs

def target_config(config: dict, root: Path) -> tuple[dict, str]:
    """The target's text config and where it came from (a built-in target's shape before
    it is built: eagle3flow/target/shapes.py)."""
    path = config["target"]["path"]
    builtin = (config["target"].get("builtin") or "embedded") if not path else None
    default_dir = {"embedded": "embedded/target", "smollm2-135m": "pretrained/target"}.get(builtin, "embedded/target")
    target_dir = Path(path) if path else root / layout(config)["results"] / default_dir
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
    top = root / layout(config)["cache"] / "regenerate"
    try:
        dirs = sorted((p for p in top.iterdir() if p.is_dir()), key=lambda p: p.stat().st_mtime)
    except OSError:
        return None
    return dirs[-1] if dirs else None


def answer_tokens(config: dict, root: Path) -> tuple[float, int, str]:
    """(tokens per regenerated answer, answers already made, basis): the stage's stats
    when it finished, else the mean of the answers in its cache, else regenerate.max_tokens
    x ASSUMED_ANSWER_FILL."""
    stats = _read_json(root / layout(config)["results"] / "regenerate" / "stats.json")
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
    self_served = (not config["regenerate"].get("base_url") and not os.environ.get("EAGLE3FLOW_REGENERATE_URL")
                   and not config["target"]["path"])
    startup = ASSUMED_SELF_SERVED_STARTUP_S if self_served else 0.0
    stats = _read_json(root / layout(config)["results"] / "regenerate" / "stats.json") or {}
    sent = stats.get("sent") or {}
    if sent.get("completion_tokens") and sent.get("tokens_per_s"):
        return float(sent["tokens_per_s"]), startup, "measured by the last regeneration"
    cache = newest_regenerate_cache(config, root)
    rate = _read_json(cache / "rate.json") if cache is not None else None
    if rate and rate.get("completion_tokens") and rate.get("seconds"):
        return rate["completion_tokens"] / rate["seconds"], startup, "measured while answering (cache)"
    if self_served and config["resources"]["gpus"] == 0:
        return float(ASSUMED_SELF_SERVED_CPU_TOKENS_PER_S), startup, "assumed (the CPU build serving the target)"
    return float(ASSUMED_SERVER_TOKENS_PER_S), startup, "assumed from the server"


def _read_json(path: Path):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def workload(config: dict, root: Path) -> dict:
    """Samples and tokens per split (after max_length), and where the numbers came from.

    With regeneration (regenerate.enabled) the dataset is the prompts with the target's
    answers, not the file's: prompts x answers per prompt x (prompt + answer tokens),
    the answer length from :func:`answer_tokens`. ``regenerate`` then says how many
    answers are still to be generated and how many tokens they are."""
    results = root / layout(config)["results"]
    stats_file = results / "dataset" / "stats.json"
    regen = bool((config.get("regenerate") or {}).get("enabled"))
    if stats_file.is_file():
        with open(stats_file) as f:
            splits = json.load(f)["splits"]
        out = {"train_tokens": int(splits["train"]["tokens"]), "eval_tokens": int(splits["eval"]["tokens"]),
               "train_samples": int(splits["train"]["samples"]),
               "eval_samples": int(splits["eval"]["samples"]), "basis": str(stats_file)}
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
        regen_info = {"answers": answers, "answers_to_make": max(0.0, answers - made),
                      "answer_tokens": answer, "answer_tokens_to_make": max(0.0, answers - made) * answer,
                      "answer_basis": answer_basis}
    elif max_samples and max_samples < samples:
        tokens, samples = tokens * max_samples / samples, max_samples
    tokens = min(tokens, samples * ds["max_length"])
    eval_tokens = tokens * ds["eval_fraction"]
    eval_samples = int(samples * ds["eval_fraction"])
    out = {"train_tokens": int(tokens - eval_tokens), "eval_tokens": int(eval_tokens),
           "train_samples": samples - eval_samples, "eval_samples": eval_samples, "basis": basis}
    if regen_info:
        out["regenerate"] = regen_info
    return out


def aux_layer_count(config: dict, target: dict) -> int:
    ids = config["extract"].get("aux_layer_ids")
    return len(ids) if ids else 3


def storage_dtype(config: dict) -> str:
    """The dtype shards are written in: extract.storage_dtype (fp8) when set, else
    extract.dtype (auto = float32 on CPU, bfloat16 on GPU)."""
    ext = config["extract"]
    chosen = ext.get("storage_dtype") or "auto"
    if chosen in ("fp8", "float8_e4m3fn"):
        return "float8_e4m3fn"
    chosen = ext.get("dtype", "auto")
    if chosen == "auto":
        return "bfloat16" if uses_gpu(config, ext.get("device", "auto")) else "float32"
    return chosen


def uses_gpu(config: dict, device: str) -> bool:
    if device == "auto":
        return config["resources"]["gpus"] > 0
    return device.startswith("cuda")


def hidden_state_bytes_per_token(aux: int, hidden: int, dtype: str) -> int:
    """Bytes one token takes in a shard: ``(A+1) x H`` hidden values (+ a scale per layer in
    fp8) + input_ids + loss_mask; the same as eagle3flow.extract.shards.bytes_per_token, without torch."""
    scales = FP8_SCALE_BYTES if DTYPE_BYTES[dtype] == 1 else 0
    return (aux + 1) * (hidden * DTYPE_BYTES[dtype] + scales) + TOKEN_OVERHEAD_BYTES


def draft_shape(target: dict, overrides: dict) -> dict:
    """The draft's dimensions as DraftConfig.from_target_config derives them (eagle3flow/model/draft.py)."""
    hidden = int(target["hidden_size"])
    heads = int(target["num_attention_heads"])
    is_mla = "kv_lora_rank" in target or str(target.get("model_type", "")).startswith("deepseek")
    shape = {"hidden_size": hidden, "num_attention_heads": heads,
             "num_key_value_heads": int(target.get("num_key_value_heads") or heads),
             "head_dim": hidden // heads if is_mla else int(target.get("head_dim") or hidden // heads),
             "intermediate_size": int(target["intermediate_size"])}
    shape.update({k: v for k, v in (overrides or {}).items() if k in shape})
    return shape


def draft_trainable_params(target: dict, aux: int, draft_vocab: int, overrides: dict) -> int:
    """Trainable parameters of the EAGLE-3 draft (Eagle3Draft minus the frozen embeddings)."""
    return sum(draft_param_counts(target, aux, draft_vocab, overrides).values())


def draft_param_counts(target: dict, aux: int, draft_vocab: int, overrides: dict) -> dict:
    """The draft's trainable parameters as the optimizers split them (optim.uses_muon):
    ``matrices``: fc ``[H, A*Ht]`` and the decoder layer's projections (its attention reads
    ``2H``); ``rest``: lm_head ``[Vd, H]``, four RMSNorms ``[H]`` and the aux states'
    RMSNorm ``[A*Ht]`` where the draft has one."""
    d = draft_shape(target, overrides)
    h, hd = d["hidden_size"], d["head_dim"]
    q, kv = d["num_attention_heads"] * hd, d["num_key_value_heads"] * hd
    attention = 2 * h * q + 2 * (2 * h * kv) + q * h
    mlp = 3 * h * d["intermediate_size"]
    aux_width = aux * int(target["hidden_size"])
    overrides = overrides or {}
    architecture = overrides.get("architecture", "auto")
    is_mla_draft = architecture == "mla" or (architecture == "auto" and "kv_lora_rank" in target)
    # draft_model.DEFAULT_FLAGS: a Llama draft has norm_before_fc, an MLA draft has not
    aux_norms = aux_width * (int(bool(overrides.get("norm_before_fc", not is_mla_draft)))
                             + int(bool(overrides.get("fc_norm", False))))
    return {"matrices": aux_width * h + attention + mlp, "rest": aux_norms + 4 * h + h * draft_vocab}


def draft_checkpoint_bytes(counts: dict, optimizer: str) -> int:
    """A training checkpoint: fp32 weights and the optimizer state, i.e. two AdamW
    moments, or Muon's one momentum for the matrices it steps (optim.build_optimizers)."""
    if optimizer == "muon":
        return counts["matrices"] * MUON_CHECKPOINT_BYTES_PER_PARAM + counts["rest"] * CHECKPOINT_BYTES_PER_PARAM
    return sum(counts.values()) * CHECKPOINT_BYTES_PER_PARAM


def target_params(target: dict) -> tuple[int, int]:
    """(total, active per token) parameters of a Llama/Qwen/DeepSeek-style target, roughly."""
    h, layers, vocab = int(target["hidden_size"]), int(target["num_hidden_layers"]), int(target["vocab_size"])
    heads = int(target["num_attention_heads"])
    hd = int(target.get("head_dim") or h // heads)
    kv = int(target.get("num_key_value_heads") or heads)
    attention = h * heads * hd * 2 + 2 * h * kv * hd
    dense_mlp = 3 * h * int(target["intermediate_size"])
    experts = int(target.get("n_routed_experts") or target.get("num_experts") or 0)
    if experts:
        moe_i = int(target.get("moe_intermediate_size") or target["intermediate_size"])
        shared = int(target.get("n_shared_experts") or 0)
        per_tok = int(target.get("num_experts_per_tok") or 1)
        mlp_total, mlp_active = 3 * h * moe_i * (experts + shared), 3 * h * moe_i * (per_tok + shared)
    else:
        mlp_total = mlp_active = dense_mlp
    embed = vocab * h * (1 if target.get("tie_word_embeddings") else 2)
    return embed + layers * (attention + mlp_total), embed + layers * (attention + mlp_active)


# ----------------------------------------------------------------------------- throughputs

def extract_backend(config: dict) -> str:
    """The extraction backend that will run: extract.backend, with auto resolved as the job
    does (eagle3flow/extract/hf.py resolve_backend): vllm where the node has several GPUs."""
    ext = config["extract"]
    backend = ext.get("backend") or "auto"
    if backend == "auto":
        backend = "vllm" if config["resources"]["gpus"] > 1 and uses_gpu(config, ext.get("device", "auto")) else "hf"
    return backend


def extract_devices(config: dict) -> int:
    """Devices the extraction runs on: the node's GPUs with vLLM (tensor parallel), one with
    transformers (the HF backend loads the target on one device)."""
    gpus = int(config["resources"]["gpus"])
    return gpus if extract_backend(config) == "vllm" else min(gpus, 1)


def profile_key(config: dict) -> str:
    """What throughputs are comparable across: the GPU count, the stages' devices, the
    extraction backend."""
    return (f"gpus={config['resources']['gpus']},extract={config['extract'].get('device', 'auto')},"
            f"train={config['train'].get('device', 'auto')},backend={extract_backend(config)}")


def _benchmark_seconds(path: Path) -> float | None:
    try:
        with open(path) as f:
            lines = f.read().strip().splitlines()
        return float(lines[-1].split("\t")[0])
    except (OSError, ValueError, IndexError):
        return None


def measured_throughputs(config: dict, root: Path) -> dict:
    """From this directory's last run: extraction and training tokens/s, each rule's seconds."""
    results = root / layout(config)["results"]
    found: dict = {"seconds": {}}
    tokens = seconds = 0.0
    for path in (results / "hidden_states").rglob("*throughput.jsonl"):
        with open(path) as f:
            for line in f:
                try:
                    row = json.loads(line)
                    tokens += row["num_tokens"]
                    seconds += row["compute_s"]
                except (ValueError, KeyError):
                    continue
    if tokens and seconds:
        found["extract_tokens_per_s"] = tokens / seconds
    rates = []
    metrics = results / "train" / "metrics.jsonl"
    if metrics.is_file():
        with open(metrics) as f:
            for line in f:
                try:
                    rates.append(float(json.loads(line)["tokens_per_s"]))
                except (ValueError, KeyError):
                    continue
    if rates:
        found["train_tokens_per_s"] = sorted(rates)[len(rates) // 2]
    for tsv in (results / "benchmarks").glob("*.tsv"):
        s = _benchmark_seconds(tsv)
        if s is not None:
            found["seconds"][tsv.stem] = s
    return found


def recorded_throughputs(config: dict, root: Path) -> dict:
    """Throughputs of earlier runs of this profile (results/plan/throughput.json)."""
    path = root / layout(config)["results"] / "plan" / "throughput.json"
    try:
        with open(path) as f:
            return json.load(f).get(profile_key(config), {})
    except (OSError, ValueError):
        return {}


def benchmark_figures(root: Path, gpus: int) -> dict:
    """tokens/s per stage from the repo's benchmarks/*.json: objects (or lists of them)
    with ``stage`` ("extract"/"train"), ``tokens_per_s`` and ``gpus``; the closest GPU count wins."""
    best: dict = {}
    for path in sorted((root / "benchmarks").glob("*.json")):
        try:
            with open(path) as f:
                data = json.load(f)
        except (OSError, ValueError):
            continue
        for row in data if isinstance(data, list) else [data]:
            if not isinstance(row, dict) or "stage" not in row or "tokens_per_s" not in row:
                continue
            stage, row_gpus = row["stage"], int(row.get("gpus", 0))
            if (row_gpus > 0) != (gpus > 0):
                continue
            # Scale linearly with the GPU count (data parallel).
            rate = float(row["tokens_per_s"]) * (gpus / row_gpus if row_gpus and gpus else 1)
            distance = abs(row_gpus - gpus)
            if stage not in best or distance < best[stage][1]:
                best[stage] = (rate, distance, path.name)
    return {stage: (rate, name) for stage, (rate, _, name) in best.items()}


def record_throughputs(config: dict, root: Path) -> None:
    """After a run: keep its throughputs (and the tokens they were measured on) for this
    profile, so the next plan uses them."""
    measured = measured_throughputs(config, root)
    work = workload(config, root)
    if work["basis"].endswith("stats.json"):
        measured["tokens"] = work["train_tokens"] + work["eval_tokens"]
    path = root / layout(config)["results"] / "plan" / "throughput.json"
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, ValueError):
        data = {}
    previous = data.get(profile_key(config), {})
    merged = {**previous, **{k: v for k, v in measured.items() if k != "seconds"},
              "seconds": {**previous.get("seconds", {}), **measured["seconds"]},
              "recorded_at": time.time()}
    data[profile_key(config)] = merged
    write_json(path, data)


# ----------------------------------------------------------------------------- projection

def project(config: dict, root: str | os.PathLike = ".", will_run: dict[str, int] | None = None) -> Plan:
    """The plan for ``config`` (validated, defaults filled) in workflow directory ``root``.

    ``will_run``: jobs per rule Snakemake will run (its DAG); None = judge each stage by
    whether its files exist.
    """
    root = Path(root)
    target, target_basis = target_config(config, root)
    work = workload(config, root)
    gpus = int(config["resources"]["gpus"])
    device_class = "gpu" if gpus > 0 else "cpu"
    aux = aux_layer_count(config, target)
    hidden = int(target["hidden_size"])
    dtype = storage_dtype(config)
    per_token = hidden_state_bytes_per_token(aux, hidden, dtype)
    tokens = work["train_tokens"] + work["eval_tokens"]
    samples = work["train_samples"] + work["eval_samples"]
    draft_vocab = min(int(config["vocab"]["draft_vocab_size"]), int(target["vocab_size"]))
    train_cfg = config["train"]
    draft_counts = draft_param_counts(target, aux, draft_vocab, train_cfg.get("draft", {}))
    draft_params = sum(draft_counts.values())
    checkpoint = draft_checkpoint_bytes(draft_counts, train_cfg["optimizer"])
    total_params, active_params = target_params(target)
    target_dtype = str(target.get("torch_dtype") or target.get("dtype") or "bfloat16").replace("torch.", "")
    export_bytes_per_param = 4 if target_dtype == "float32" else 2
    vocab_map_bytes = draft_vocab * 8 + int(target["vocab_size"])

    measured = measured_throughputs(config, root)
    recorded = recorded_throughputs(config, root)
    # Per stage, the devices it runs on: extraction with the HF backend loads the target on one.
    devices = {"extract": extract_devices(config), "train": gpus}
    figures = {stage: benchmark_figures(root, n).get(stage) for stage, n in devices.items()}
    seconds_of = {**measured["seconds"], **recorded.get("seconds", {})}
    backend = extract_backend(config)

    def rate(stage: str, flops_per_token: float) -> tuple[float, str]:
        key = f"{stage}_tokens_per_s"
        if recorded.get(key):
            return recorded[key], f"last run ({profile_key(config)})"
        if key in measured:
            return measured[key], "last run in results/"
        on = (f" on {devices[stage]} GPU(s)" + (f", {backend} backend" if stage == "extract" else "")
              if gpus else "")
        if figures.get(stage):
            return figures[stage][0], f"benchmarks/{figures[stage][1]}{on}"
        flops = ASSUMED_FLOPS[(device_class, stage)] * max(devices[stage], 1)
        return flops / flops_per_token, f"assumed {flops:.1e} FLOP/s{on}"

    def scaled_seconds(rule: str, now_tokens: float, fallback: float, fallback_basis: str):
        """A small stage's seconds from its last benchmark, scaled by tokens when known."""
        if rule in seconds_of:
            then = recorded.get("tokens")
            factor = now_tokens / then if then and now_tokens else 1.0
            return seconds_of[rule] * factor, "last run"
        return fallback, fallback_basis

    # --- projected bytes and seconds per stage
    proj: dict[str, tuple[int, str, float, str]] = {}
    emb = config["embedded"]
    using_embedded = config["target"]["path"] is None or config["dataset"]["path"] is None
    builtin = config["target"].get("builtin") or "embedded"
    if config["target"]["path"] is None and builtin != "embedded":
        s, sb = scaled_seconds("build_pretrained_target", 0, ASSUMED_PRETRAINED_BUILD_S, "assumed")
        proj["embedded target"] = (total_params * 4 + samples * 300, f"{builtin}: {total_params / 1e6:.0f}M "
                                   "fp32 params + the built-in prompts", s, sb)
    elif using_embedded:
        emb_tokens = emb["max_conversations"] * EMBEDDED_TOKENS_PER_CONVERSATION
        b = total_params * 4 + int(emb_tokens * EMBEDDED_JSONL_BYTES_PER_TOKEN) + 300_000
        s, sb = scaled_seconds("build_embedded_target", 0, emb["train_steps"] * EMBEDDED_BUILD_S_PER_STEP,
                               f"assumed {EMBEDDED_BUILD_S_PER_STEP}s/step")
        proj["embedded target"] = (b, f"{total_params / 1e6:.1f}M fp32 params + conversations", s, sb)
    if (config.get("regenerate") or {}).get("enabled"):
        regen = work.get("regenerate") or {}
        serve_rate, startup, rate_basis = serving_rate(config, root)
        to_make = float(regen.get("answer_tokens_to_make", tokens))
        seconds = (to_make / serve_rate + startup) if to_make else 0.0
        proj["regenerate"] = (int(tokens * EMBEDDED_JSONL_BYTES_PER_TOKEN * 2), "new answers (JSONL)", seconds,
                              f"{to_make:,.0f} answer tokens still to generate at {serve_rate:,.0f} tokens/s "
                              f"({rate_basis})" + (f" + {startup:.0f}s start-up" if startup and to_make else ""))
    s, sb = scaled_seconds("prepare_dataset", tokens, ASSUMED_SECONDS["prepare dataset"], "assumed")
    proj["prepare dataset"] = (int(tokens * PARQUET_BYTES_PER_TOKEN) + samples * 300,
                               f"{tokens:,} tokens x {PARQUET_BYTES_PER_TOKEN} B + prompts", s, sb)
    # Hidden states: both splits; shard headers hold the sample ids.
    hs_bytes = tokens * per_token + samples * 40
    r, rb = rate("extract", 2 * active_params)
    proj["extract"] = (hs_bytes, f"{tokens:,} tokens x {per_token:,} B ({aux}+1 x {hidden} x {dtype})",
                       tokens / r, f"{r:,.0f} tokens/s, {rb}")
    proj["vocab"] = (vocab_map_bytes + 1000, f"d2t/t2d for {draft_vocab} of {target['vocab_size']}",
                     *scaled_seconds("build_vocab_map", tokens, ASSUMED_SECONDS["vocab"], "assumed"))
    keep = int(train_cfg.get("keep_checkpoints", 2))
    train_tokens = work["train_tokens"] * int(train_cfg["epochs"])
    steps = max(1, math.ceil(train_tokens / int(train_cfg["batch_tokens"])))
    metrics_bytes = (steps // int(train_cfg.get("log_every", 10)) + 1) * 600 * 2
    r, rb = rate("train", 6 * draft_params * int(train_cfg["ttt_steps"]))
    proj["train"] = ((keep + 1) * checkpoint + draft_params * 4 + metrics_bytes,
                     f"{draft_params / 1e6:.2f}M draft params, {checkpoint / draft_params:.1f} B/param "
                     f"({train_cfg['optimizer']}) x ({keep}+1) checkpoints + weights",
                     train_tokens / r, f"{r:,.0f} tokens/s, {rb}")
    proj["export"] = (draft_params * export_bytes_per_param + vocab_map_bytes + 2000,
                      f"draft in {'float32' if export_bytes_per_param == 4 else 'bfloat16'}",
                      *scaled_seconds("export_draft", 0, ASSUMED_SECONDS["export"], "assumed"))
    ev = config["evaluate"]
    n_prompts = ev.get("num_prompts") or work["eval_samples"]
    proj["evaluate"] = (n_prompts * (ev["max_tokens"] * 12 + 2000) + 20_000, "outputs and requests",
                        *scaled_seconds("evaluate_draft", 0, ASSUMED_EVALUATE_S[device_class], "assumed"))
    proj["report"] = (600_000, "plots and tables",
                      *scaled_seconds("build_report", 0, ASSUMED_SECONDS["report"], "assumed"))

    # --- status per stage, measured bytes, the peak
    now_per_stage, now_total = measure(config, root)
    results = root / layout(config)["results"]

    def assemble(proj: dict, fingerprinted: dict = FINGERPRINTED) -> Plan:
        rows, accounted, to_write = [], 0, 0
        for name, prefixes, gpu, paths in STAGES:
            if name not in proj:
                if now_per_stage[name]:
                    accounted += now_per_stage[name]
                continue
            b, bb, s, sb = proj[name]
            existing = now_per_stage[name]
            done = stage_outputs_exist(name, results)
            if will_run is not None:
                jobs = sum(n for rule, n in will_run.items() if rule.startswith(prefixes))
                # Not in the DAG and never made: the targets asked for do not need it.
                status = "run" if jobs else "cached" if done else "skip"
            else:
                jobs = 0 if done else 1
                status = "cached" if done else "run"
            if status == "skip":
                final, s = existing, 0.0
            elif status == "cached":
                final = existing or b
            else:
                # What a stage rewrites in results/ is replaced; its cache keeps old fingerprints
                # and resumes the newest (taken as this run's partial work).
                stale = sum(tree_bytes(real_path(p, config, root)) for p in paths if p.startswith("cache/"))
                current = sum(newest_subdirs_bytes(real_path(p, config, root), fingerprinted[p])
                              for p in paths if p in fingerprinted)
                final = stale + max(0, b - current)
                to_write += max(0, final - existing)
            accounted += existing
            rows.append(StageRow(name, gpu, status, int(final), bb, float(s), sb, jobs))
        other = max(0, now_total - accounted)
        peak = other + sum(r.bytes for r in rows)
        plan = Plan(rows, other, int(peak), int(to_write), gpus, bool(config["drain"]["enabled"]),
                    {**work, "target": target_basis, "draft_params": draft_params,
                     "checkpoint_bytes": int(checkpoint), "hidden_state_bytes_per_token": per_token, "storage_dtype": dtype,
                     "aux_layers": aux, "hidden_size": hidden,
                     "hidden_state_bytes": int(hs_bytes)}, profile_key(config))
        plan.refusal = budget_refusal(plan, config, root)
        return plan

    plan = assemble(proj)
    return _with_streaming(plan, assemble, proj, config, root, target)


def _with_streaming(plan: Plan, assemble, proj: dict, config: dict, root: Path, target: dict) -> Plan:
    """The plan with streaming partitions (eagle3flow/ops/streaming.py) when the budget cannot
    hold the full hidden states, or when a chain is already in progress here.

    Streamed, the hidden states on disk at once are the eval split's plus F train
    partitions ("in flight"): F = what the room left by every other stage holds, and the
    extraction of the last epochs is repeated per epoch."""
    from eagle3flow.ops import streaming

    pinned = streaming.pinned_chain(config, root)
    if plan.refusal is None and pinned is None:
        return plan
    extract = next((s for s in plan.stages if s.name == "extract"), None)
    if extract is None:
        return plan
    w = plan.workload
    per_token = w["hidden_state_bytes_per_token"]
    n, epochs = int(config["extract"]["partitions"]), int(config["train"]["epochs"])
    exact = streaming.train_partition_tokens(config, root, target) if n > 1 else None
    shard_tokens = int(config["extract"]["shard_tokens"])
    if exact:
        part_tokens = max(exact)
    else:   # partitions are runs of whole shards
        shards = max(1, math.ceil(w["train_tokens"] / shard_tokens))
        part_tokens = min(w["train_tokens"], math.ceil(shards / n) * shard_tokens)
    if n > 1 and (exact and min(exact) == 0 or w["train_tokens"] < n * shard_tokens):
        plan.refusal = (plan.refusal or "storage budget: the plan does not fit.") + (
            f"\n  - streaming needs at least one shard per partition: extract.shard_tokens "
            f"{shard_tokens:,} with {w['train_tokens']:,} train tokens makes fewer than "
            f"extract.partitions = {n} shards; set extract.shard_tokens <= {w['train_tokens'] // n:,}")
        return plan
    # Shard headers hold ~40 bytes of sample id per sample (as in the full projection).
    part_bytes = part_tokens * per_token + math.ceil(w["train_samples"] / n) * 40
    eval_bytes = w["eval_tokens"] * per_token + w["eval_samples"] * 40
    full_bytes = proj["extract"][0]
    # The previous link's final checkpoint and outputs (fp32 weights) stay until the next
    # link is consumed.
    previous_link = w["checkpoint_bytes"] + 4 * w["draft_params"]
    if pinned is not None:
        chain = streaming.Chain(pinned.partitions, pinned.epochs, pinned.in_flight, part_bytes)
    else:
        allowed = allowed_peak(plan, config, root)
        # What the extract row holds besides this run's hidden states (old fingerprints).
        others = extract.bytes - max(0, full_bytes) if extract.status == "run" else 0
        room = allowed - (plan.peak_bytes - extract.bytes) - max(0, others) - eval_bytes - previous_link
        chain, why = streaming.chain_from_budget(n, epochs, room, part_bytes)
        if chain is None:
            if why:
                plan.refusal = (plan.refusal or "storage budget: the plan does not fit.") + f"\n  - {why}"
            return plan
    b, _, s, sb = proj["extract"]
    streamed = dict(proj)
    streamed["extract"] = (eval_bytes + chain.in_flight * part_bytes,
                           f"streamed: eval + {chain.in_flight} of {n} partitions x {part_tokens:,} tokens x "
                           f"{per_token:,} B", s * epochs, sb + (f", x {epochs} epochs" if epochs > 1 else ""))
    tb, tbb, ts, tsb = proj["train"]
    streamed["train"] = (tb + previous_link, tbb + " + the previous link's", ts, tsb)
    # The previous link's run and outputs are this run's too (counted in the train row).
    plan = assemble(streamed, {**FINGERPRINTED, "cache/train": 2, "cache/streaming": 2})
    plan.workload["streaming"] = {**chain.to_json(), "part_tokens": part_tokens, "pinned": pinned is not None}
    plan.notes.append(chain.describe() + (" (pinned by results/streaming/chain.json)" if pinned else ""))
    return plan


def streaming_chain(config: dict, root: str | os.PathLike, plan: "Plan | None" = None):
    """The chain the workflow streams (eagle3flow.ops.streaming.Chain), or None, from the plan
    made when the workflow is read (made here when not given)."""
    if plan is None:
        plan, _ = try_project(config, root, quiet=True)
    if plan is None or "streaming" not in plan.workload:
        return None
    from eagle3flow.ops.streaming import Chain
    s = plan.workload["streaming"]
    return Chain(s["partitions"], s["epochs"], s["in_flight"], s["part_bytes"])


def plan_when_read(config: dict, root: str | os.PathLike, quiet: bool = False):
    """When the workflow is read: (the plan of the whole run or None, its budget refusal or
    None), projected once for everything the Snakefile needs (the refusal, the streaming
    chain). Reads files only.

    Under ``python -m eagle3flow.ops.plan`` ($PLAN_CONFIG_ENV set) the resolved config
    (profile, --config, schema defaults) is also handed back through that file.
    """
    if os.environ.get(PLAN_CONFIG_ENV):
        write_json(Path(os.environ[PLAN_CONFIG_ENV]), config)
    return try_project(config, root, quiet=quiet)


def check_when_read(config: dict, root: str | os.PathLike) -> str | None:
    """When the workflow is read: the budget refusal of the whole run, or None."""
    return plan_when_read(config, root)[1]


def try_project(config: dict, root: str | os.PathLike, will_run: dict[str, int] | None = None,
                quiet: bool = False):
    """(plan, refusal). A plan that cannot be made (the target's config.json or the dataset
    not here yet) is a refusal only when a budget is set; else a warning and (None, None)."""
    try:
        plan = project(config, root, will_run)
    except (OSError, KeyError, ValueError) as error:
        storage = config.get("storage") or {}
        if storage.get("max_bytes") is not None or parse_bytes(storage.get("min_free_bytes")):
            return None, f"storage budget: cannot project the disk this run needs: {error}"
        if not quiet:
            print(f"eagle3flow.ops.plan: no plan ({error})", file=sys.stderr)
        return None, None
    return plan, plan.refusal


def stage_outputs_exist(name: str, results: Path) -> bool:
    """Without Snakemake's DAG: a stage counts as done when its last declared output exists."""
    if name == "embedded target":
        return (results / "embedded/build_stats.json").is_file() or (results / "pretrained/target/config.json").is_file()
    marker = {"regenerate": "regenerate/stats.json", "prepare dataset": "dataset/stats.json",
              "extract": "hidden_states/eval/manifest.json", "vocab": "vocab/stats.json",
              "train": "train/eval.json", "export": "draft/model.safetensors",
              "evaluate": "eval/summary.json", "report": "report/report.json"}.get(name)
    return marker is not None and (results / marker).is_file()


# ----------------------------------------------------------------------------- budget

def free_bytes(path: Path) -> int:
    """Free bytes on the filesystem that holds ``path`` (or its nearest existing parent)."""
    path = path.resolve()
    while not path.exists():
        path = path.parent
    return shutil.disk_usage(path).free


def budget_refusal(plan: Plan, config: dict, root: Path) -> str | None:
    """Why the plan does not fit the storage budget, with what would; None when it fits."""
    storage = config.get("storage") or {}
    max_bytes = parse_bytes(storage.get("max_bytes"))
    min_free = parse_bytes(storage.get("min_free_bytes")) or 0
    problems = []
    if not plan.to_write_bytes:
        return None                     # nothing left to write: nothing to refuse
    if max_bytes is not None and plan.peak_bytes > max_bytes:
        problems.append(f"the projected peak of results/ + cache/ is {format_bytes(plan.peak_bytes)}, "
                        f"over storage.max_bytes = {format_bytes(max_bytes)}")
    cache_dir = root / layout(config)["cache"]
    free = free_bytes(cache_dir)
    if free - plan.to_write_bytes < min_free:
        problems.append(f"{format_bytes(plan.to_write_bytes)} are still to be written but "
                        f"{cache_dir} has {format_bytes(free)} free and storage.min_free_bytes "
                        f"= {format_bytes(min_free)} must stay free")
    if not problems:
        return None
    allowed = allowed_peak(plan, config, root)
    return "storage budget: " + "; ".join(problems) + ".\n" + "\n".join(
        "  - " + s for s in what_would_fit(plan, config, allowed))


def allowed_peak(plan: Plan, config: dict, root: Path) -> int:
    """The largest peak of results/ + cache/ that passes both checks of the budget."""
    storage = config.get("storage") or {}
    max_bytes = parse_bytes(storage.get("max_bytes"))
    min_free = parse_bytes(storage.get("min_free_bytes")) or 0
    free = free_bytes(root / layout(config)["cache"])
    return min(x for x in (max_bytes, free - min_free + plan.peak_bytes - plan.to_write_bytes)
               if x is not None)


def what_would_fit(plan: Plan, config: dict, allowed: int) -> list[str]:
    """Settings under which the plan's peak would be at most ``allowed`` bytes."""
    hs = plan.workload["hidden_state_bytes"]
    fixed = plan.peak_bytes - next(s.bytes for s in plan.stages if s.name == "extract")
    per_token = plan.workload["hidden_state_bytes_per_token"]
    samples = plan.workload["train_samples"] + plan.workload["eval_samples"]
    out = []
    room = allowed - fixed
    if room <= 0:
        out.append(f"even without hidden states the run takes {format_bytes(fixed)}: raise the budget "
                   "or free space (old fingerprints in cache/ can be deleted by hand)")
        return out
    fraction = room / hs
    if fraction < 1:
        fit = int(samples * fraction)
        out.append(f"fewer samples: dataset.max_samples: {fit} (of {samples}) would need "
                   f"{format_bytes(fixed + hs * fit / samples)}")
    w = plan.workload
    if "storage_dtype" in config["extract"] and DTYPE_BYTES[w["storage_dtype"]] > 1:
        fp8 = hs * hidden_state_bytes_per_token(w["aux_layers"], w["hidden_size"], "fp8") / per_token
        verdict = "fits" if fixed + fp8 <= allowed else "still does not fit"
        out.append(f"fp8 shards: extract.storage_dtype: fp8 would need "
                   f"{format_bytes(fixed + fp8)} ({verdict})")
    partitions = max(2, math.ceil(hs / max(room / 2, 1)))
    out.append(f"streaming: extract.partitions: {partitions} (at most 2 on disk at a time) would need "
               f"~{format_bytes(fixed + 2 * hs / partitions)}")
    out.append(f"or raise storage.max_bytes to {format_bytes(plan.peak_bytes * 1.05)}")
    return out


# ----------------------------------------------------------------------------- table

def render(plan: Plan, actual: bool = False) -> str:
    """The plan as a text table; with ``actual`` the measured columns beside the projected."""
    head = ["stage", "status", "disk", "time", "GPU-h"]
    if actual:
        head[3:3] = ["disk (actual)"]
        head[5:5] = ["time (actual)"]
    lines = []
    gpu_factor = max(plan.gpus, 1) if plan.gpus else 0
    for s in plan.stages:
        status = s.status if s.status != "run" or not s.jobs or s.jobs == 1 else f"run ({s.jobs} jobs)"
        cells = [s.name + (" [GPU]" if s.gpu else ""), status, format_bytes(s.bytes),
                 format_seconds(s.seconds),
                 f"{s.seconds * gpu_factor / 3600:.2f}" if s.gpu and gpu_factor else "-"]
        if actual:
            cells[3:3] = [format_bytes(s.actual_bytes)]
            cells[5:5] = [format_seconds(s.actual_seconds)]
        lines.append(cells)
    widths = [max(len(r[i]) for r in [head] + lines) for i in range(len(head))]
    fmt = lambda cells: "  ".join(c.ljust(w) for c, w in zip(cells, widths)).rstrip()
    out = ["=== plan (eagle3flow.ops.plan) ===", fmt(head), fmt(["-" * w for w in widths])]
    out += [fmt(r) for r in lines]
    run_s = sum(s.seconds for s in plan.stages if s.status == "run")
    out.append(f"peak disk (results/ + cache/): {format_bytes(plan.peak_bytes)} projected"
               + (f", {format_bytes(plan.actual_peak_bytes)} measured" if plan.actual_peak_bytes else "")
               + f"; still to write {format_bytes(plan.to_write_bytes)}"
               + (f"; already there, outside the stages: {format_bytes(plan.other_bytes)}" if plan.other_bytes else ""))
    out.append(f"time of the stages that run: {format_seconds(run_s)} (one after another); "
               f"GPU-hours: {plan.gpu_seconds * gpu_factor / 3600:.2f} on {plan.gpus} GPU(s); "
               + (f"production downtime: {format_seconds(plan.downtime_seconds)} (GPU stages behind the drain)"
                  if plan.drain else "no production service drained"))
    w = plan.workload
    out.append(f"from: {w['train_tokens']:,} train + {w['eval_tokens']:,} eval tokens ({w['basis']}); "
               f"target {w['target']}; {w['hidden_state_bytes_per_token']:,} B/token of hidden states "
               f"({w['storage_dtype']}); draft {w['draft_params']:,} trainable params")
    for s in plan.stages:
        out.append(f"  {s.name}: disk = {s.bytes_basis}; time = {s.time_basis}")
    out += plan.notes
    return "\n".join(out)


# ----------------------------------------------------------------------------- after the run

def attach_actuals(plan: Plan, config: dict, root: Path, peak: int | None) -> Plan:
    """Measured bytes per stage and the rules' seconds (results/benchmarks) beside the projection."""
    per_stage, total = measure(config, root)
    seconds = measured_throughputs(config, root)["seconds"]
    for s in plan.stages:
        s.actual_bytes = per_stage[s.name]
        prefixes = next(p for n, p, _, _ in STAGES if n == s.name)
        ran = [v for rule, v in seconds.items() if rule.startswith(prefixes)]
        s.actual_seconds = sum(ran) if ran else None
    plan.actual_peak_bytes = max(peak or 0, total)
    return plan


# ----------------------------------------------------------------------------- disk sampler

def sample_disk(paths: list[str], out: Path, pid: int, interval: float = 1.0) -> int:
    """Sum the bytes under ``paths`` every ``interval`` s while process ``pid`` lives;
    keep the peak in ``out`` (JSON: peak_bytes, at, samples). Returns the peak."""
    peak, samples, start = 0, 0, time.time()
    while True:
        alive = pid_alive(pid)
        total = sum(tree_bytes(p) for p in paths)
        samples += 1
        if total > peak or samples == 1:
            peak = max(peak, total)
            write_json(out, {"peak_bytes": peak, "at": time.time(), "started": start,
                              "samples": samples, "paths": paths})
        if not alive:
            write_json(out, {"peak_bytes": peak, "at": time.time(), "started": start,
                              "samples": samples, "paths": paths, "finished": True})
            return peak
        time.sleep(interval)


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie (our parent exited but was not reaped) is dead too.
    return not is_zombie(pid)


def start_sampler(paths: list[str], out: Path, pid: int, interval: float, log: Path) -> subprocess.Popen:
    """The sampler as a detached process (it outlives nothing: it stops when ``pid`` ends)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    log.parent.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "eagle3flow.ops.plan", "sample-disk", "--out", str(out),
           "--pid", str(pid), "--interval", str(interval)]
    for p in paths:
        cmd += ["--path", p]
    with open(log, "a") as log_file:
        return subprocess.Popen(cmd, stdout=log_file, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)


def read_peak(path: Path) -> int | None:
    try:
        with open(path) as f:
            return int(json.load(f)["peak_bytes"])
    except (OSError, ValueError, KeyError):
        return None


# ----------------------------------------------------------------------------- CLI

JOB_STATS_ROW = re.compile(r"^(\S+)\s+(\d+)\s*$")


def parse_job_stats(text: str) -> dict[str, int]:
    """Jobs per rule from Snakemake's dry-run "Job stats" table."""
    counts, in_table = {}, False
    for line in text.splitlines():
        if line.startswith("Job stats"):
            in_table = True
            continue
        if in_table:
            m = JOB_STATS_ROW.match(line.strip())
            if m and m.group(1) != "total":
                counts[m.group(1)] = int(m.group(2))
            elif line.strip().startswith("total"):
                break
    return counts


def plan_via_snakemake(snakemake_args: list[str], workdir: Path) -> tuple[Plan | None, str, int]:
    """Ask Snakemake (dry run) what will run; the workflow hands its resolved config back
    through $EAGLE3FLOW_PLAN_CONFIG (rules/plan.smk). Returns the plan, output, return code."""
    with tempfile.TemporaryDirectory() as tmp:
        config_out = Path(tmp) / "config.json"
        env = {**os.environ, PLAN_CONFIG_ENV: str(config_out)}
        exe = Path(sys.executable).parent / "snakemake"
        cmd = [str(exe) if exe.exists() else "snakemake", "-n",
               *snakemake_args]
        result = subprocess.run(cmd, cwd=workdir, env=env, capture_output=True, text=True)
        output = result.stdout + result.stderr
        if not config_out.is_file():
            return None, output, result.returncode or 1
        with open(config_out) as f:
            config = json.load(f)
    will_run = parse_job_stats(output) if result.returncode == 0 else None
    return try_project(config, workdir, will_run)[0], output, result.returncode


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["sample-disk"]:
        parser = argparse.ArgumentParser(prog="python -m eagle3flow.ops.plan sample-disk")
        parser.add_argument("--path", action="append", required=True)
        parser.add_argument("--out", type=Path, required=True)
        parser.add_argument("--pid", type=int, required=True)
        parser.add_argument("--interval", type=float, default=1.0)
        args = parser.parse_args(argv[1:])
        sample_disk(args.path, args.out, args.pid, args.interval)
        return 0
    parser = argparse.ArgumentParser(
        prog="python -m eagle3flow.ops.plan",
        description="Print the plan (per stage: runs or cached, disk, time, GPU-hours, downtime) "
                    "without running anything. Other arguments go to `snakemake -n`, e.g. "
                    "--profile embedded --config storage='{max_bytes: 500GB}'.")
    parser.add_argument("--workdir", type=Path, default=Path.cwd())
    parser.add_argument("--json", type=Path, default=None, help="also write the plan as JSON here")
    args, snakemake_args = parser.parse_known_args(argv)
    plan, output, rc = plan_via_snakemake(snakemake_args, args.workdir)
    if plan is None:
        print(output, file=sys.stderr)
        return rc or 1
    print(render(plan))
    if args.json:
        write_json(args.json, plan.to_json())
    if plan.refusal:
        print("\n" + plan.refusal, file=sys.stderr)
        return 1
    if rc:
        print(output, file=sys.stderr)
    return rc


if __name__ == "__main__":
    sys.exit(main())
