"""Sample ids and the processing order, shared by prepare_dataset and regenerate.

Sample id: the record's ``id`` (else ``conversation_id``, ``question_id``), else
``row-<index>`` (index over all input files in order). Duplicate ids are made
unique, not refused: the k-th repeat of ``x`` becomes ``x#k``.

Order is independent of row order: rows are processed in order of
``sha256(seed, id)``, so a cap keeps the same samples whatever the file order.
"""
from __future__ import annotations

import hashlib

from eagle3flow.data.records import BadRow, conversation_from_record
from eagle3flow.data.sources import Source, load_sources

ID_KEYS = ("id", "conversation_id", "question_id")


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
