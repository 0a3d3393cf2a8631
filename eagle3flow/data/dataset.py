"""prepare_dataset: chat records -> tokenized train/eval parquet with assistant loss masks.

Input (``--input``): a local .json / .jsonl / .parquet file, a directory of them
(searched recursively, sorted), or a Hugging Face Hub dataset id (``org/name``,
``--split``). Everything is read through ``datasets``; a JSON file whose rows Arrow
cannot type (mixed types, non-dict rows) is re-read with ``json`` so its bad rows
are reported one by one instead of failing the file. Hub ids are only tried when
the path does not exist locally and does not look like a path; the CLI sets
``HF_HUB_OFFLINE=1`` unless the environment says otherwise, so an uncached id
fails at once (set ``HF_HUB_OFFLINE=0`` to allow a download).

Record formats, detected per file from its first rows (or forced by ``--format``):

- ``messages``: OpenAI ``{"messages": [{"role", "content"}, ...]}``
- ``sharegpt``: ``{"conversations": [{"from": "human"|"gpt"|"system", "value"}, ...]}``
- ``instruction``: ``{"instruction", "input"?, "output"}`` (Alpaca) or
  ``{"prompt", "response"|"completion"}``, with an optional ``system``.

Turns may use either key style (role/content or from/value). Content may be a
string or a list of OpenAI text parts. Empty system turns are skipped; turns after
the last assistant turn are dropped (they carry no loss).

Sample id: the record's ``id`` (else ``conversation_id``, ``question_id``), else
``row-<index>`` (index over all input files in order). Duplicate ids are made
unique, not refused: the k-th repeat of ``x`` becomes ``x#k`` and is listed in
stats.json (merged datasets often reuse ids; dropping them would lose data).

Order, split and cap are independent of row order: rows are processed in order of
``sha256(seed, id)``; ``max_samples`` keeps the first N usable samples of that order
and the eval split is the first ``eval_fraction`` of the kept ones (at least 1 when
there are >= 2), so a larger cap or eval fraction only adds samples.

Bad rows (not a dict, missing turns, unknown role, empty content, no assistant
turn, template error, all-0/all-1 loss mask, ...) are counted with id and reason;
the run fails once they exceed ``max_bad_fraction`` of the processed rows.

With ``--regenerated`` (regenerate_responses' responses.jsonl) every sample's
assistant turns are the target's own answers; samples it has none for (failed, or
beyond its ``max_samples``) are left out and listed in stats.json under
``regenerated.skipped``, which also counts the samples regenerated.

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
import hashlib
import json
import os
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from eagle3flow.data.chat_masks import ChatMasker, MaskError, load_tokenizer
from eagle3flow.progress import Progress

FORMATS = ("auto", "messages", "sharegpt", "instruction")
LENGTH_POLICIES = ("truncate", "drop")
DATA_SUFFIXES = {".json": "json", ".jsonl": "json", ".parquet": "parquet"}
ID_KEYS = ("id", "conversation_id", "question_id")
ROLES = {"system": "system", "user": "user", "human": "user", "assistant": "assistant",
         "gpt": "assistant", "chatgpt": "assistant", "bard": "assistant", "bing": "assistant",
         "model": "assistant", "tool": "tool", "function": "tool", "ipython": "tool",
         "observation": "tool"}


class Conversation(list):
    """The messages of one sample (a list, as everywhere) and the ``tools`` its row declares
    (OpenAI function schemas, handed to the chat template; None when it has none)."""

    def __init__(self, messages=(), tools: list | None = None):
        super().__init__(messages)
        self.tools = tools


def tool_calls_for_templates(value, where: str) -> list[dict]:
    """OpenAI ``tool_calls`` as chat templates take them: ``arguments`` parsed into a mapping
    (the API sends a JSON string; HF templates print a dict with tojson)."""
    if not isinstance(value, list) or not value:
        raise BadRow("invalid tool_calls", f"{where}: expected a non-empty list")
    calls = []
    for n, call in enumerate(value):
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise BadRow("invalid tool_calls", f"{where}: call {n} has no function name")
        arguments = function.get("arguments", {})
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments) if arguments.strip() else {}
            except ValueError:
                raise BadRow("invalid tool_calls", f"{where}: call {n} arguments are not JSON") from None
        entry = {"type": "function", "function": {"name": function["name"], "arguments": arguments}}
        if call.get("id") is not None:
            entry["id"] = str(call["id"])
        calls.append(entry)
    return calls
FORMAT_KEYS = {"messages": ("messages",), "sharegpt": ("conversations",),
               "instruction": ("instruction", "prompt")}
OUTPUT_FILES = ("train.parquet", "eval.parquet", "eval_prompts.jsonl", "stats.json")
LIST_LIMIT = 1000  # ids listed per category in stats.json; counts are always complete
WRITE_BATCH = 1024


class DatasetError(ValueError):
    """The input cannot become a dataset (unreadable, unknown format, too many bad rows)."""


class BadRow(ValueError):
    def __init__(self, reason: str, detail: str = ""):
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason, self.detail = reason, detail


@dataclass
class DatasetConfig:
    format: str = "auto"
    max_length: int | None = 2048
    length_policy: str = "truncate"
    eval_fraction: float = 0.02
    seed: int = 0
    max_bad_fraction: float = 0.01
    max_samples: int | None = None
    split: str = "train"
    chat_template_kwargs: dict = field(default_factory=dict)
    num_workers: int = 1

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


# ---------------------------------------------------------------- loading

@dataclass
class Source:
    """One input file (or Hub split): rows indexable by position."""
    name: str
    rows: object  # datasets.Dataset or list
    format: str


class _InvalidJsonLine:
    def __init__(self, line_number: int, error: str):
        self.line_number, self.error = line_number, error


def _looks_like_path(spec: str) -> bool:
    return (spec.startswith(("/", ".", "~")) or "\\" in spec or spec.count("/") > 1
            or Path(spec).suffix in DATA_SUFFIXES)


def resolve_input(spec: str) -> list[Path] | None:
    """The data files ``spec`` names, or None when it is a Hub dataset id."""
    path = Path(spec).expanduser()
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in DATA_SUFFIXES
                       and not any(part.startswith(".") for part in p.relative_to(path).parts))
        if not files:
            raise DatasetError(f"input directory {spec!r} holds no {'/'.join(DATA_SUFFIXES)} files")
        return files
    if path.is_file():
        if path.suffix not in DATA_SUFFIXES:
            raise DatasetError(f"input file {spec!r}: unsupported type {path.suffix!r} "
                               f"(expected {', '.join(DATA_SUFFIXES)})")
        return [path]
    if _looks_like_path(spec):
        raise DatasetError(f"input {spec!r} does not exist")
    return None


def _read_json_rows(path: Path) -> list:
    """Rows of a JSON list / JSON Lines file, kept as Python objects whatever their type."""
    text = path.read_text(encoding="utf-8")
    if path.suffix == ".json":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as error:
            if "\n{" not in text:
                raise DatasetError(f"{path}: invalid JSON: {error}") from error
            data = None  # a .json file holding JSON Lines
        if data is not None:
            if not isinstance(data, list):
                raise DatasetError(f"{path}: expected a JSON list of records, got {type(data).__name__}")
            return data
    rows: list = []
    for line_number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError as error:
            rows.append(_InvalidJsonLine(line_number, str(error)))
    return rows


def _load_file(path: Path):
    import datasets

    builder = DATA_SUFFIXES[path.suffix]
    verbosity = datasets.logging.get_verbosity()
    if builder == "json":  # its failure is handled below; keep datasets' error log out of ours
        datasets.logging.set_verbosity(datasets.logging.CRITICAL)
    try:
        return datasets.load_dataset(builder, data_files=str(path), split="train")
    except Exception as error:
        if builder != "json":
            raise DatasetError(f"{path}: cannot read parquet: {type(error).__name__}: {error}") from error
        # Arrow needs one type per column; plain JSON keeps odd rows so they are reported one by one.
        return _read_json_rows(path)
    finally:
        datasets.logging.set_verbosity(verbosity)


def _load_hub(repo_id: str, split: str):
    import datasets

    try:
        return datasets.load_dataset(repo_id, split=split)
    except Exception as error:
        offline = os.environ.get("HF_HUB_OFFLINE", "0").lower() not in ("0", "false", "no", "")
        hint = (" (HF_HUB_OFFLINE=1 and it is not in the local cache: download it first, or run "
                "with HF_HUB_OFFLINE=0)" if offline else "")
        raise DatasetError(f"dataset {repo_id!r} is not a local file or directory and could not be "
                           f"loaded from the Hugging Face Hub{hint}: {type(error).__name__}: "
                           f"{str(error)[:300]}") from error


def detect_format(rows, name: str, probe: int = 100) -> str:
    """The record format of ``rows`` from the first record that has a known key."""
    seen_keys: set[str] = set()
    for i in range(min(len(rows), probe)):
        row = rows[i]
        if not isinstance(row, dict):
            continue
        seen_keys.update(row)
        for fmt, keys in FORMAT_KEYS.items():
            if any(row.get(key) is not None for key in keys):
                return fmt
    raise DatasetError(
        f"{name}: cannot detect the record format from its first {min(len(rows), probe)} rows "
        f"(keys seen: {sorted(seen_keys)}); expected 'messages' (OpenAI), 'conversations' "
        "(ShareGPT) or 'instruction'/'prompt' (instruction/response); or pass --format")


def load_sources(spec: str, fmt: str = "auto", split: str = "train") -> list[Source]:
    import datasets

    datasets.disable_progress_bars()
    files = resolve_input(spec)
    loaded = ([(spec, _load_hub(spec, split))] if files is None
              else [(str(path), _load_file(path)) for path in files])
    return [Source(name, rows, detect_format(rows, name) if fmt == "auto" else fmt)
            for name, rows in loaded]


# ---------------------------------------------------------------- records

def _id_of(record, index: int) -> str:
    if isinstance(record, dict):
        for key in ID_KEYS:
            value = record.get(key)
            if value is not None and str(value) != "":
                return str(value)
    return f"row-{index}"


def _source_ids(source: Source, offset: int) -> list[str]:
    rows = source.rows
    if isinstance(rows, list):
        return [_id_of(row, offset + i) for i, row in enumerate(rows)]
    # datasets.Dataset: read the id columns, not every row.
    columns = [list(rows[key]) for key in ID_KEYS if key in rows.column_names]
    ids = []
    for i in range(len(rows)):
        value = next((c[i] for c in columns if c[i] is not None and str(c[i]) != ""), None)
        ids.append(str(value) if value is not None else f"row-{offset + i}")
    return ids


def make_unique(ids: list[str]) -> tuple[list[str], list[dict]]:
    """Repeats of an id get ``#1``, ``#2``, ... (skipping ids already taken)."""
    taken = set(ids)
    seen: dict[str, int] = {}
    unique, renamed = [], []
    for sample_id in ids:
        if sample_id not in seen:
            seen[sample_id] = 0
            unique.append(sample_id)
            continue
        k = seen[sample_id]
        while True:
            k += 1
            candidate = f"{sample_id}#{k}"
            if candidate not in taken:
                break
        seen[sample_id] = k
        taken.add(candidate)
        unique.append(candidate)
        renamed.append({"id": sample_id, "new_id": candidate})
    return unique, renamed


def order_key(seed: int, sample_id: str) -> bytes:
    return hashlib.sha256(f"{seed}\x00{sample_id}".encode()).digest()[:16]


def _text(value, where: str) -> str:
    if isinstance(value, str):
        return value
    if value is None:
        raise BadRow("missing content", where)
    if isinstance(value, list):
        parts = []
        for part in value:
            if isinstance(part, str):
                parts.append(part)
            elif isinstance(part, dict) and part.get("type", "text") == "text" \
                    and isinstance(part.get("text"), str):
                parts.append(part["text"])
            else:
                raise BadRow("non-text content", where)
        return "".join(parts)
    raise BadRow("invalid content", f"{where}: {type(value).__name__}")


def _instruction_turns(record: dict) -> list[dict]:
    instruction = next((record[k] for k in ("instruction", "prompt") if record.get(k) is not None), None)
    output = next((record[k] for k in ("output", "response", "completion")
                   if record.get(k) is not None), None)
    if instruction is None:
        raise BadRow("missing instruction", "no 'instruction' or 'prompt'")
    if output is None:
        raise BadRow("no assistant turn", "no 'output', 'response' or 'completion'")
    user = _text(instruction, "instruction")
    extra = record.get("input")
    if extra is not None and _text(extra, "input").strip():
        user = f"{user}\n\n{extra}"
    turns = [{"role": "user", "content": user}, {"role": "assistant", "content": output}]
    if record.get("system") is not None:
        turns.insert(0, {"role": "system", "content": record["system"]})
    return turns


def conversation_from_record(record, fmt: str, answer_prompts: bool = False) -> list[dict]:
    """``[{"role": "system"|"user"|"assistant", "content": str}, ...]`` or BadRow.

    ``answer_prompts`` (the target writes the answers, ``regenerate``): a prompt-only row
    is usable, its assistant turns with ``content: null`` and a final user turn get an
    assistant turn with empty content, to be answered.
    """
    if isinstance(record, _InvalidJsonLine):
        raise BadRow("invalid JSON", f"line {record.line_number}: {record.error}")
    if not isinstance(record, dict):
        raise BadRow("not a record", f"row is a {type(record).__name__}")
    if fmt == "instruction":
        turns = _instruction_turns(record)
    else:
        key = "messages" if fmt == "messages" else "conversations"
        turns = record.get(key)
        if turns is None:
            raise BadRow(f"missing {key}", f"keys: {sorted(record)}")
        if not isinstance(turns, list) or not turns:
            raise BadRow(f"invalid {key}", f"expected a non-empty list, got {turns!r}"[:200])
    messages = []
    for k, turn in enumerate(turns):
        if not isinstance(turn, dict):
            raise BadRow("invalid turn", f"turn {k} is a {type(turn).__name__}")
        raw_role = turn.get("role") if turn.get("role") is not None else turn.get("from")
        role = ROLES.get(str(raw_role).strip().lower()) if raw_role is not None else None
        if role is None:
            raise BadRow("unknown role", f"turn {k}: {raw_role!r}")
        raw = turn.get("content") if turn.get("content") is not None else turn.get("value")
        tool_calls = turn.get("tool_calls") if role == "assistant" else None
        if raw is None and role == "assistant" and answer_prompts and not tool_calls:
            messages.append({"role": "assistant", "content": ""})
            continue
        if tool_calls:
            message = {"role": "assistant", "content": "" if raw is None else _text(raw, f"turn {k} (assistant)"),
                       "tool_calls": tool_calls_for_templates(tool_calls, f"turn {k}")}
            messages.append(message)
            continue
        content = _text(raw, f"turn {k} ({role})")
        if role == "tool":
            message = {"role": "tool", "content": content}
            for key in ("tool_call_id", "name"):
                if turn.get(key) is not None:
                    message[key] = str(turn[key])
            messages.append(message)
            continue
        # A reasoning model's thinking, in the field its chat template reads (regenerated
        # answers keep it there when the template expects it).
        reasoning = turn.get("reasoning_content") if role == "assistant" else None
        if not content.strip() and not (isinstance(reasoning, str) and reasoning.strip()):
            if role == "system":
                continue
            raise BadRow("empty content", f"turn {k} ({role})")
        message = {"role": role, "content": content}
        if isinstance(reasoning, str) and reasoning.strip():
            message["reasoning_content"] = reasoning
        messages.append(message)
    first = next((m["role"] for m in messages if m["role"] != "system"), None)
    if first == "assistant":
        raise BadRow("assistant turn before any user turn")
    if answer_prompts and messages and messages[-1]["role"] in ("user", "tool"):
        messages.append({"role": "assistant", "content": ""})
    last_assistant = max((i for i, m in enumerate(messages) if m["role"] == "assistant"), default=None)
    if last_assistant is None:
        raise BadRow("no assistant turn", "a prompt-only row needs regenerate.enabled (the target answers it)")
    tools = record.get("tools") if isinstance(record, dict) else None
    if tools is not None and (not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools)):
        raise BadRow("invalid tools", "expected a list of function schemas")
    return Conversation(messages[:last_assistant + 1], tools or None)


def processing_order(sources, seed: int):
    """Every row's place, its unique id, and the order rows are processed in.

    Returns ``locations`` (``(source index, row index)`` per global row ``g``), ``ids``
    (unique ids, duplicates renamed), ``renamed`` (what was renamed) and ``order`` (the
    global rows sorted by the hash of ``(seed, id)``). prepare_dataset and
    regenerate_responses both go through it, so they agree on ids and order.
    """
    locations: list[tuple[int, int]] = []
    raw_ids: list[str] = []
    for s, source in enumerate(sources):
        raw_ids += _source_ids(source, len(locations))
        locations += [(s, i) for i in range(len(source.rows))]
    ids, renamed = make_unique(raw_ids)
    order = sorted(range(len(ids)), key=lambda g: order_key(seed, ids[g]))
    return locations, ids, renamed, order


def iter_conversations(spec: str, fmt: str = "auto", split: str = "train", seed: int = 0,
                       max_samples: int | None = None):
    """``(sample_id, messages | BadRow)`` in prepare_dataset's order (same ids, same order),
    up to the first ``max_samples`` usable conversations: what regenerate_responses answers
    (prompt-only rows included, their turns to answer as empty assistant turns)."""
    sources = load_sources(spec, fmt, split)
    locations, ids, _, order = processing_order(sources, seed)
    usable = 0
    for g in order:
        if max_samples is not None and usable >= max_samples:
            return
        s, i = locations[g]
        try:
            messages = conversation_from_record(sources[s].rows[i], sources[s].format, answer_prompts=True)
        except BadRow as error:
            yield ids[g], error
            continue
        usable += 1
        yield ids[g], messages


def prompt_messages(messages: list[dict]) -> list[dict]:
    """The messages before the first assistant turn (what vLLM is prompted with)."""
    first = next(i for i, m in enumerate(messages) if m["role"] == "assistant")
    return messages[:first]


# ---------------------------------------------------------------- bookkeeping

class Tally:
    """Counts rows by reason and lists the first LIST_LIMIT of them."""

    def __init__(self):
        self.count = 0
        self.by_reason: dict[str, int] = {}
        self.rows: list[dict] = []

    def add(self, sample_id: str, reason: str, detail: str = "") -> None:
        self.count += 1
        self.by_reason[reason] = self.by_reason.get(reason, 0) + 1
        if len(self.rows) < LIST_LIMIT:
            self.rows.append({"id": sample_id, "reason": reason, **({"detail": detail} if detail else {})})

    def to_json(self) -> dict:
        return {"count": self.count, "by_reason": self.by_reason, "rows": self.rows,
                "rows_listed_all": len(self.rows) == self.count}

    def first(self, n: int = 5) -> str:
        return "; ".join(f"{r['id']} ({r['reason']}{': ' + r['detail'] if 'detail' in r else ''})"
                         for r in self.rows[:n])


def _bad_error(bad: Tally, processed: int, max_bad_fraction: float) -> DatasetError:
    return DatasetError(
        f"{bad.count} of {processed} processed rows are bad "
        f"({100.0 * bad.count / max(processed, 1):.2f}% > max_bad_fraction "
        f"{100.0 * max_bad_fraction:.2f}%); by reason: {bad.by_reason}; first: {bad.first()}")


# ---------------------------------------------------------------- writing

def _arrow_schema(with_prompt: bool):
    import pyarrow as pa

    fields = [("id", pa.string()), ("input_ids", pa.list_(pa.int32())),
              ("loss_mask", pa.list_(pa.int8())), ("num_tokens", pa.int32())]
    if with_prompt:
        fields.append(("prompt_json", pa.string()))
    return pa.schema(fields)


class _SampleWriter:
    """Appends samples to a parquet file in batches (bounded memory)."""

    def __init__(self, path: Path, with_prompt: bool):
        import pyarrow.parquet as pq

        self.schema = _arrow_schema(with_prompt)
        self.writer = pq.ParquetWriter(str(path), self.schema)
        self.pending: list[tuple] = []

    def add(self, sample_id: str, input_ids: np.ndarray, loss_mask: np.ndarray,
            prompt_json: str | None = None) -> None:
        self.pending.append((sample_id, input_ids, loss_mask, prompt_json))
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


def _split_outputs(all_path: Path, out_dir: Path, n_eval: int) -> dict:
    """Rows [0, n_eval) of ``all_path`` -> eval, the rest -> train; returns per-split stats."""
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    writers = {name: _SampleWriter(out_dir / f".{name}.parquet.tmp", with_prompt=False)
               for name in ("train", "eval")}
    split_stats = {name: {"samples": 0, "tokens": 0, "assistant_tokens": 0} for name in writers}
    position = 0
    with open(out_dir / ".eval_prompts.jsonl.tmp", "w", encoding="utf-8") as prompts:
        for batch in pq.ParquetFile(str(all_path)).iter_batches(batch_size=WRITE_BATCH):
            cut = min(max(n_eval - position, 0), batch.num_rows)
            for name, part in (("eval", batch.slice(0, cut)), ("train", batch.slice(cut))):
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


# ---------------------------------------------------------------- the stage

def load_regenerated(path: str | Path) -> dict[str, dict]:
    """regenerate_responses' ``responses.jsonl``: sample id -> ``{"messages", "finish_reasons"}``
    or ``{"failed": reason}``."""
    from eagle3flow.jsonl import iter_jsonl

    answers = {}
    for where, row in iter_jsonl(path):
        if not isinstance(row, dict) or "id" not in row or not (
                isinstance(row.get("messages"), list) or "failed" in row):
            raise DatasetError(f"{where}: expected {{'id', 'messages'}} or {{'id', 'failed'}}")
        answers[str(row["id"])] = row
    return answers


def with_regenerated_answers(sample_id: str, messages: list[dict], regenerated: dict[str, dict]):
    """The conversation with the target's own answers, or the BadRow/_Skipped saying why not."""
    entry = regenerated.get(sample_id)
    if entry is None:
        return _Skipped("not regenerated", "beyond the regenerated samples")
    if "failed" in entry:
        return _Skipped("regeneration failed", str(entry["failed"])[:300])
    answered = entry["messages"]
    prompts = [(m["role"], m["content"]) for m in messages if m["role"] != "assistant"]
    if [(m.get("role"), m.get("content")) for m in answered if m.get("role") != "assistant"] != prompts \
            or len(answered) != len(messages):
        return BadRow("regenerated answers do not match", "its prompt turns differ from the dataset's")
    return Conversation(answered, getattr(messages, "tools", None))


class _Skipped(BadRow):
    """A usable row left out on purpose (no regenerated answer): listed, not counted as bad."""


def prepare_dataset(input: str, tokenizer_dir: str | Path, out_dir: str | Path,
                    config: DatasetConfig | None = None, progress_interval: float = 5.0,
                    regenerated: str | Path | None = None) -> dict:
    """Tokenize ``input`` with the chat template of ``tokenizer_dir`` into ``out_dir``.

    Writes train.parquet, eval.parquet, eval_prompts.jsonl and stats.json (see
    docs/formats.md); returns the stats. Raises DatasetError on unusable input.
    ``regenerated``: regenerate_responses' responses.jsonl; each sample's assistant
    turns are then the target's own answers, and samples without one are left out
    (listed under ``regenerated.skipped``).
    """
    config = config or DatasetConfig()
    config.validate()
    out_dir = Path(out_dir)
    if not Path(tokenizer_dir).is_dir():
        raise DatasetError(f"tokenizer directory {str(tokenizer_dir)!r} does not exist")
    sources = load_sources(input, config.format, config.split)  # before the slow transformers import
    masker = ChatMasker(load_tokenizer(tokenizer_dir), config.chat_template_kwargs)

    locations, ids, renamed, order = processing_order(sources, config.seed)
    total_rows = len(ids)

    out_dir.mkdir(parents=True, exist_ok=True)
    all_path = out_dir / ".all.parquet.tmp"
    writer = _SampleWriter(all_path, with_prompt=True)
    bad, dropped, truncated = Tally(), Tally(), Tally()
    processed = kept = 0
    cap = config.max_samples
    progress = (Progress("prepare_dataset", min(cap, total_rows), "samples", interval=progress_interval)
                if cap else Progress("prepare_dataset", total_rows, "rows", interval=progress_interval))
    answers = load_regenerated(regenerated) if regenerated else None
    skipped = Tally()
    regenerated_kept = truncated_answers = 0
    results = _row_results(order, sources, ids, locations, masker, config.num_workers, answers)
    try:
        for g, outcome in results:
            if cap is not None and kept >= cap:
                break
            processed += 1
            sample_id = ids[g]
            sample = None
            if isinstance(outcome, _Skipped):
                skipped.add(sample_id, outcome.reason, outcome.detail)
            elif isinstance(outcome, BadRow):
                bad.add(sample_id, outcome.reason, outcome.detail)
            else:
                prompt_json, input_ids, loss_mask = outcome
                sample = _apply_length_policy(sample_id, input_ids, loss_mask, config, dropped, truncated)
            if sample is not None:
                writer.add(sample_id, *sample, prompt_json)
                kept += 1
                if answers is not None:
                    regenerated_kept += 1
                    truncated_answers += "length" in answers[sample_id].get("finish_reasons", [])
            # The final fraction is at least bad / total_rows: fail as soon as that is too high.
            if bad.count > config.max_bad_fraction * total_rows:
                raise _bad_error(bad, processed, config.max_bad_fraction)
            progress.update(1 if cap is None or sample is not None else 0,
                            extra=f"bad {bad.count} dropped {dropped.count}")
        writer.close()
        progress.close()
        if bad.count > config.max_bad_fraction * processed:
            raise _bad_error(bad, processed, config.max_bad_fraction)
        if kept == 0:
            raise DatasetError(f"{input}: no usable samples out of {processed} rows "
                               f"(bad: {bad.by_reason}; dropped: {dropped.by_reason})")
        n_eval = 0
        if config.eval_fraction > 0 and kept >= 2:
            n_eval = min(kept - 1, max(1, round(config.eval_fraction * kept)))
        split_stats = _split_outputs(all_path, out_dir, n_eval)
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
                         "truncated_answers": truncated_answers, "skipped": skipped.to_json()}
                        if answers is not None else {"source": None, "samples": 0, "fraction": 0.0}),
    }
    with open(out_dir / ".stats.json.tmp", "w", encoding="utf-8") as f:
        json.dump(stats, f, indent=2, ensure_ascii=False)
    for name in OUTPUT_FILES:  # stats.json last: its presence means the rest is complete
        os.replace(out_dir / f".{name}.tmp", out_dir / name)
    return stats


def _tokenize_row(source: Source, index: int, sample_id: str, masker: ChatMasker,
                  regenerated: dict | None = None):
    """(prompt_json, input_ids, loss_mask) of one row, or the BadRow saying why not."""
    try:
        messages = conversation_from_record(source.rows[index], source.format,
                                            answer_prompts=regenerated is not None)
    except BadRow as error:
        return error
    if regenerated is not None:
        messages = with_regenerated_answers(sample_id, messages, regenerated)
        if isinstance(messages, BadRow):
            return messages
    try:
        input_ids, loss_mask = masker.tokenize(messages, sample_id)
    except MaskError as error:
        return BadRow("loss mask", str(error))
    except Exception as error:  # the chat template is code from the model repo; any failure is its
        return BadRow("template error", f"{type(error).__name__}: {error}"[:300])
    return json.dumps(prompt_messages(messages), ensure_ascii=False), input_ids, loss_mask


_WORKER_STATE: tuple = ()  # (sources, ids, locations, masker, regenerated), inherited by forked workers
CHUNK_ROWS = 64


def _tokenize_chunk(rows: list[int]) -> list[tuple[int, object]]:
    sources, ids, locations, masker, regenerated = _WORKER_STATE
    return [(g, _tokenize_row(sources[locations[g][0]], locations[g][1], ids[g], masker, regenerated))
            for g in rows]


def _row_results(order: list[int], sources, ids, locations, masker, num_workers: int,
                 regenerated: dict | None = None):
    """(row, outcome) in ``order``, computed by ``num_workers`` forked processes when > 1."""
    global _WORKER_STATE
    if num_workers <= 1:
        for g in order:
            s, i = locations[g]
            yield g, _tokenize_row(sources[s], i, ids[g], masker, regenerated)
        return
    import multiprocessing

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # one thread per worker
    _WORKER_STATE = (sources, ids, locations, masker, regenerated)
    chunks = [order[k:k + CHUNK_ROWS] for k in range(0, len(order), CHUNK_ROWS)]
    # fork: workers share the loaded rows and tokenizer instead of pickling them.
    with multiprocessing.get_context("fork").Pool(num_workers) as pool:
        try:
            for chunk in pool.imap(_tokenize_chunk, chunks):  # imap keeps the order
                yield from chunk
        finally:
            _WORKER_STATE = ()


def _apply_length_policy(sample_id: str, input_ids: np.ndarray, loss_mask: np.ndarray,
                         config: DatasetConfig, dropped: Tally, truncated: Tally):
    """(input_ids, loss_mask) within max_length, or None after recording the drop."""
    n = len(input_ids)
    if config.max_length is None or n <= config.max_length:
        return input_ids, loss_mask
    if config.length_policy == "drop":
        dropped.add(sample_id, "longer than max_length", f"{n} > {config.max_length}")
        return None
    input_ids, loss_mask = input_ids[:config.max_length], loss_mask[:config.max_length]
    if not loss_mask.any():
        dropped.add(sample_id, "no assistant token within max_length", f"{n} > {config.max_length}")
        return None
    truncated.add(sample_id, "truncated", f"{n} -> {config.max_length}")
    return input_ids, loss_mask


def main(argv: list[str] | None = None) -> int:
    """CLI: individual flags (no --config-json); ``--chat-template-kwargs`` takes JSON.

    python -m eagle3flow.data.dataset --input PATH_OR_HUB_ID --tokenizer TARGET_DIR \\
        --out-dir results/dataset [--format auto] [--max-length 2048] \\
        [--length-policy truncate] [--eval-fraction 0.02] [--seed 0] \\
        [--max-bad-fraction 0.01] [--max-samples N] [--split train] \\
        [--chat-template-kwargs '{"enable_thinking": false}'] [--num-workers 1]
    """
    defaults = DatasetConfig()
    parser = argparse.ArgumentParser(prog="python -m eagle3flow.data.dataset", description=__doc__.split("\n")[0])
    parser.add_argument("--input", required=True, help="data file, directory of files, or Hub dataset id")
    parser.add_argument("--tokenizer", required=True, help="target model directory (tokenizer + chat template)")
    parser.add_argument("--out-dir", required=True)
    parser.add_argument("--format", choices=FORMATS, default=defaults.format)
    parser.add_argument("--max-length", type=int, default=defaults.max_length,
                        help="tokens per sample; 0 = no limit")
    parser.add_argument("--length-policy", choices=LENGTH_POLICIES, default=defaults.length_policy)
    parser.add_argument("--eval-fraction", type=float, default=defaults.eval_fraction)
    parser.add_argument("--seed", type=int, default=defaults.seed)
    parser.add_argument("--max-bad-fraction", type=float, default=defaults.max_bad_fraction)
    parser.add_argument("--max-samples", type=int, default=None, help="cap on kept samples; 0 = all")
    parser.add_argument("--split", default=defaults.split, help="split of a Hub dataset")
    parser.add_argument("--chat-template-kwargs", type=json.loads, default={},
                        help="JSON object passed to the chat template")
    parser.add_argument("--regenerated", default=None,
                        help="regenerate_responses' responses.jsonl: train on the target's own answers")
    parser.add_argument("--num-workers", type=int, default=defaults.num_workers,
                        help="processes rendering and tokenizing (results do not depend on it)")
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never hang on a network that is not there
    config = DatasetConfig(
        format=args.format, max_length=args.max_length or None, length_policy=args.length_policy,
        eval_fraction=args.eval_fraction, seed=args.seed, max_bad_fraction=args.max_bad_fraction,
        max_samples=args.max_samples or None, split=args.split,
        chat_template_kwargs=args.chat_template_kwargs, num_workers=args.num_workers)
    try:
        stats = prepare_dataset(args.input, args.tokenizer, args.out_dir, config,
                                regenerated=args.regenerated)
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
