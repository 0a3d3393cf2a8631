"""prepare_dataset's side of regenerate: its responses.jsonl read, the target's answers swapped in."""
from __future__ import annotations

from pathlib import Path

from eagle3flow.data.records import BadRow, Conversation
from eagle3flow.data.sources import DatasetError
from eagle3flow.jsonl import iter_jsonl


class Skipped(BadRow):
    """A usable row left out on purpose (no regenerated answer): listed, not counted as bad."""


def more_answer_id(sample_id: str, k: int) -> str:
    """The sample id of a conversation's ``k``-th answer (``k >= 2``; regenerate's
    ``answers_per_prompt``): its cache entry, its seed and its training sample."""
    return f"{sample_id}~answer{k}"


def load_regenerated(path: str | Path) -> dict[str, dict]:
    """regenerate_responses' ``responses.jsonl``: sample id -> ``{"messages", "finish_reasons"}``
    or ``{"failed": reason}``."""
    answers = {}
    for where, row in iter_jsonl(path):
        if not isinstance(row, dict) or "id" not in row or not (
                isinstance(row.get("messages"), list) or "failed" in row):
            raise DatasetError(f"{where}: expected {{'id', 'messages'}} or {{'id', 'failed'}}")
        answers[str(row["id"])] = row
    return answers


def with_regenerated_answers(sample_id: str, messages: list[dict], regenerated: dict[str, dict]):
    """The conversation with the target's own answers, or the BadRow/Skipped saying why not."""
    entry = regenerated.get(sample_id)
    if entry is None:
        return Skipped("not regenerated", "beyond the regenerated samples")
    if "failed" in entry:
        return Skipped("regeneration failed", str(entry["failed"])[:300])
    answered = entry["messages"]
    prompts = [(m["role"], m["content"]) for m in messages if m["role"] != "assistant"]
    if [(m.get("role"), m.get("content")) for m in answered if m.get("role") != "assistant"] != prompts \
            or len(answered) != len(messages):
        return BadRow("regenerated answers do not match", "its prompt turns differ from the dataset's")
    return Conversation(answered, getattr(messages, "tools", None))


