"""Rows -> tokenized samples: render, mask, fit to max_length, optionally in forked workers.

Each row's outcome is ``(prompt_json, input_ids, loss_mask)`` or the :class:`BadRow`
saying why not; :class:`Tally` counts the rows left out, by reason, for stats.json.
"""
from __future__ import annotations

import json
import multiprocessing
import os

import numpy as np

from eagle3flow.data.chat_masks import ChatMasker, MaskError
from eagle3flow.data.records import BadRow, conversation_from_record, prompt_messages
from eagle3flow.data.regenerated import more_answer_id, with_regenerated_answers
from eagle3flow.data.sources import Source

# What a sample longer than max_length becomes: cut to it, or left out. The extraction
# applies the same policies against the target's context.
LENGTH_POLICIES = ("truncate", "drop")
LIST_LIMIT = 1000  # ids listed per category in stats.json; counts are always complete


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


def tokenize_row(source: Source, index: int, sample_id: str, masker: ChatMasker,
                 regenerated: dict | None = None):
    """(prompt_json, input_ids, loss_mask) of one row, or the BadRow saying why not."""
    try:
        messages = conversation_from_record(source.rows[index], source.format,
                                            answer_prompts=regenerated is not None)
    except BadRow as error:
        return error
    if regenerated is not None:
        messages = with_regenerated_answers(sample_id, messages, regenerated)
    return tokenize_conversation(messages, sample_id, masker)


def tokenize_conversation(messages, sample_id: str, masker: ChatMasker):
    """(prompt_json, input_ids, loss_mask) of one conversation, or the BadRow saying why not
    (``messages`` may already be one)."""
    if isinstance(messages, BadRow):
        return messages
    try:
        input_ids, loss_mask = masker.tokenize(messages, sample_id)
    except MaskError as error:
        return BadRow("loss mask", str(error))
    except Exception as error:  # the chat template is code from the model repo; any failure is its
        return BadRow("template error", f"{type(error).__name__}: {error}"[:300])
    return json.dumps(prompt_messages(messages), ensure_ascii=False), input_ids, loss_mask


def tokenize_more_answers(source: Source, index: int, sample_id: str, masker: ChatMasker, regenerated: dict):
    """``(id, outcome)`` for each further answer of one regenerated row (regenerate's
    ``answers_per_prompt``): id ``<sample_id>~answer<k>``, outcome as :func:`tokenize_row`'s."""
    entry = regenerated.get(sample_id) or {}
    more = entry.get("more_answers") or []
    if not more:
        return []
    messages = conversation_from_record(source.rows[index], source.format, answer_prompts=True)
    ids = [answer.get("id") or more_answer_id(sample_id, k) for k, answer in enumerate(more, start=2)]
    return [(answer_id, tokenize_conversation(with_regenerated_answers(sample_id, messages, {sample_id: answer}),
                                              answer_id, masker))
            for answer_id, answer in zip(ids, more)]


_WORKER_STATE: tuple = ()  # (sources, ids, locations, masker, regenerated), inherited by forked workers
CHUNK_ROWS = 64


def _tokenize_chunk(rows: list[int]) -> list[tuple[int, object]]:
    sources, ids, locations, masker, regenerated = _WORKER_STATE
    return [(g, tokenize_row(sources[locations[g][0]], locations[g][1], ids[g], masker, regenerated))
            for g in rows]


def row_results(order: list[int], sources, ids, locations, masker, num_workers: int,
                regenerated: dict | None = None):
    """(row, outcome) in ``order``, computed by ``num_workers`` forked processes when > 1."""
    global _WORKER_STATE
    if num_workers <= 1:
        for g in order:
            s, i = locations[g]
            yield g, tokenize_row(sources[s], i, ids[g], masker, regenerated)
        return
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


def apply_length_policy(sample_id: str, input_ids: np.ndarray, loss_mask: np.ndarray,
                        max_length: int | None, length_policy: str, dropped: Tally, truncated: Tally):
    """(input_ids, loss_mask) within ``max_length`` (None: no limit), or None after recording the drop."""
    n = len(input_ids)
    if max_length is None or n <= max_length:
        return input_ids, loss_mask
    if length_policy == "drop":
        dropped.add(sample_id, "longer than max_length", f"{n} > {max_length}")
        return None
    input_ids, loss_mask = input_ids[:max_length], loss_mask[:max_length]
    if not loss_mask.any():
        dropped.add(sample_id, "no assistant token within max_length", f"{n} > {max_length}")
        return None
    truncated.add(sample_id, "truncated", f"{n} -> {max_length}")
    return input_ids, loss_mask
