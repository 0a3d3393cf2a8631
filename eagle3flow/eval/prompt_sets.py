"""Prompt sets: the held-out prompts, MT-bench question files and ``{"id", "messages"}``
files, rendered with the target's chat template for the vLLM runner."""
from __future__ import annotations

from pathlib import Path

from eagle3flow.jsonl import iter_jsonl


def render_messages(tokenizer, messages: list[dict]) -> list[int]:
    encoded = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                            return_dict=True)
    return [int(t) for t in encoded["input_ids"]]


def load_prompt_set(name: str, path, tokenizer, max_prompts: int | None = None) -> dict:
    """Read a prompt file into a set the vLLM runner generates.

    JSONL rows of either kind, mixed freely:

    * ``{"id", "messages": [...], "category"?}``: one generation; the messages (before
      the answer) are rendered here with the target's chat template.
    * MT-bench questions ``{"question_id" | "id", "category"?, "turns": [str, ...],
      "messages"?: [leading system messages]}``: answered turn by turn in vLLM; turn 2's
      prompt holds turn 1's greedy answer.

    A row's category defaults to the set's name. Returns ``{"name", "source", "prompts",
    "conversations", "category_of": {prompt or conversation id: category}}``.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"prompt set {name!r}: {path} not found")
    prompts, conversations, category_of = [], [], {}
    for where, row in iter_jsonl(path):
        if max_prompts is not None and len(category_of) >= max_prompts:
            break
        if not isinstance(row, dict):
            raise ValueError(f"{where}: not a JSON object")
        row_id = row.get("question_id", row.get("id"))
        if row_id is None:
            raise ValueError(f"{where}: need an 'id' (or MT-bench 'question_id')")
        row_id = str(row_id)
        if row_id in category_of:
            raise ValueError(f"{where}: id {row_id} appears twice")
        turns, messages = row.get("turns"), row.get("messages")
        if turns is not None:
            if (not isinstance(turns, list) or not turns
                    or not all(isinstance(t, str) and t for t in turns)):
                raise ValueError(f"{where} (id {row_id}): 'turns' must be a non-empty list "
                                 f"of non-empty strings")
            conversations.append({"id": row_id, "turns": turns,
                                  "messages": list(messages or [])})
        elif isinstance(messages, list) and messages:
            prompts.append({"id": row_id, "prompt_token_ids":
                            render_messages(tokenizer, messages)})
        else:
            raise ValueError(f"{where} (id {row_id}): need 'turns' (MT-bench) or a "
                             f"non-empty 'messages' list")
        category_of[row_id] = str(row.get("category") or name)
    if not category_of:
        raise ValueError(f"prompt set {name!r}: {path} has no prompts")
    return {"name": name, "source": str(path), "prompts": prompts,
            "conversations": conversations, "category_of": category_of}


def longest_context(prompt_set: dict, tokenizer, max_tokens: int) -> int:
    """Tokens the longest generation of a set can need (prompt + answer): for a
    conversation, its rendered user turns plus ``max_tokens`` per answer and some
    slack for re-tokenizing the answers."""
    longest = max((len(p["prompt_token_ids"]) + max_tokens for p in prompt_set["prompts"]),
                  default=0)
    for c in prompt_set["conversations"]:
        messages = list(c["messages"])
        for turn in c["turns"]:
            messages += [{"role": "user", "content": turn}, {"role": "assistant", "content": ""}]
        longest = max(longest, len(render_messages(tokenizer, messages[:-1]))
                      + len(c["turns"]) * (max_tokens + 16))
    return longest
