"""Chat records -> conversations: the three record formats, normalised to one message list.

Record formats, detected per file from its first rows (or forced by ``--format``):

- ``messages``: OpenAI ``{"messages": [{"role", "content"}, ...]}``
- ``sharegpt``: ``{"conversations": [{"from": "human"|"gpt"|"system", "value"}, ...]}``
- ``instruction``: ``{"instruction", "input"?, "output"}`` (Alpaca) or
  ``{"prompt", "response"|"completion"}``, with an optional ``system``.

Turns may use either key style (role/content or from/value). Content may be a
string or a list of OpenAI text parts. Empty system turns are skipped; turns after
the last assistant turn are dropped (they carry no loss). A row that cannot become a
conversation raises :class:`BadRow` with its reason (counted, not fatal).
"""
from __future__ import annotations

import json

FORMATS = ("auto", "messages", "sharegpt", "instruction")
FORMAT_KEYS = {"messages": ("messages",), "sharegpt": ("conversations",),
               "instruction": ("instruction", "prompt")}
ROLES = {"system": "system", "user": "user", "human": "user", "assistant": "assistant",
         "gpt": "assistant", "chatgpt": "assistant", "bard": "assistant", "bing": "assistant",
         "model": "assistant", "tool": "tool", "function": "tool", "ipython": "tool",
         "observation": "tool"}


class BadRow(ValueError):
    """One row that cannot become a sample; ``reason`` is what stats.json counts it under."""

    def __init__(self, reason: str, detail: str = ""):
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason, self.detail = reason, detail


class InvalidJsonLine:
    """A JSON Lines row that did not parse, kept in its place so it is reported as a bad row."""

    def __init__(self, line_number: int, error: str):
        self.line_number, self.error = line_number, error


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
    if isinstance(record, InvalidJsonLine):
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



def prompt_messages(messages: list[dict]) -> list[dict]:
    """The messages before the first assistant turn (what vLLM is prompted with)."""
    first = next(i for i, m in enumerate(messages) if m["role"] == "assistant")
    return messages[:first]

