"""Input -> sources: local files, directories of them, or a Hugging Face Hub dataset.

Input (``--input``): a local .json / .jsonl / .parquet file, a directory of them
(searched recursively, sorted), or a Hugging Face Hub dataset id (``org/name``,
``--split``). Everything is read through ``datasets``; a JSON file whose rows Arrow
cannot type (mixed types, non-dict rows) is re-read with ``json`` so its bad rows
are reported one by one instead of failing the file. Hub ids are only tried when
the path does not exist locally and does not look like a path.

``datasets`` is imported inside the loaders: it is slow to import, and the record
and ordering modules that import this one are also used where no file is read.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from eagle3flow.data.records import FORMAT_KEYS, InvalidJsonLine

DATA_SUFFIXES = {".json": "json", ".jsonl": "json", ".parquet": "parquet"}


class DatasetError(ValueError):
    """The input cannot become a dataset (unreadable, unknown format, too many bad rows)."""


@dataclass
class Source:
    """One input file (or Hub split): rows indexable by position."""
    name: str
    rows: object  # datasets.Dataset or list
    format: str



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
            rows.append(InvalidJsonLine(line_number, str(error)))
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

