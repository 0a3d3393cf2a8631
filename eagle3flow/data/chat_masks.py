"""Render a conversation with the target's chat template and mark what the assistant says.

The loss mask is 1 exactly on the tokens the target generates in an assistant turn
(its content, plus the end-of-turn token that closes it) and 0 on everything the
template adds around it (system prompt, user turns, role headers, the generation
prompt). Works for any chat template, no per-model rules:

1. For assistant turn ``i``, render ``messages[:i]`` with the generation prompt and
   ``messages[:i+1]`` without. When both are prefixes of the full rendering, the
   assistant span is the text between them (Llama-3, DeepSeek-V3, Kimi-K2, and the
   last turn of Qwen3, whose empty ``<think>`` block then counts as generated).
2. Otherwise (Qwen3 drops earlier turns' reasoning, so an earlier turn renders
   differently once later turns follow) locate the assistant content itself in the
   full rendering, after the previous turns and after the assistant header.
3. The span ends at the content's end plus the end-of-turn marker (the added token
   that follows it); template text after the marker (Qwen's ``\\n``) is not generated.
4. Character spans become token positions: through a fast tokenizer's offsets, or, for a
   slow one (Kimi's tiktoken tokenizer is remote Python code with no tokenizer.json), by
   tokenizing the text up to each span's edge and matching it against the whole text's ids.
"""
from __future__ import annotations

import numpy as np


class MaskError(ValueError):
    """The template and the conversation do not give a usable loss mask."""


class ChatMasker:
    """Tokenizes conversations with a chat template and computes their loss masks.

    ``template_kwargs`` go to the template (e.g. ``{"enable_thinking": False}``).
    """

    def __init__(self, tokenizer, template_kwargs: dict | None = None):
        if not tokenizer.chat_template:
            raise ValueError(f"tokenizer {tokenizer.name_or_path!r} has no chat_template")
        self.tokenizer = tokenizer
        self.template_kwargs = dict(template_kwargs or {})
        # Longest first, so '<|im_end|>' wins over a shorter token that prefixes it.
        self.added_tokens = sorted(tokenizer.get_added_vocab(), key=len, reverse=True)
        self.assistant_header = self._probe_assistant_header()

    def render(self, messages: list[dict], add_generation_prompt: bool = False, tools: list | None = None) -> str:
        return self.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt,
            **({"tools": tools} if tools else {}), **self.template_kwargs)

    def _probe_assistant_header(self) -> str | None:
        """The text the generation prompt adds, e.g. '<|im_start|>assistant\\n'."""
        probe = [{"role": "user", "content": "ping"}]
        try:
            without, with_prompt = self.render(probe), self.render(probe, True)
        except Exception:
            return None
        if with_prompt.startswith(without) and len(with_prompt) > len(without):
            return with_prompt[len(without):]
        return None

    def _end_of_turn_length(self, text: str, pos: int, limit: int, run: bool) -> int:
        """Characters of the end-of-turn marker at ``text[pos:limit]``: optional
        whitespace then one added token (``run``: every consecutive added token), or 0."""
        k = pos
        while k < limit and text[k].isspace():
            k += 1
        end = pos
        while True:
            token = next((t for t in self.added_tokens
                          if text.startswith(t, k) and k + len(t) <= limit), None)
            if token is None:
                break
            k += len(token)
            end = k
            if not run:
                break
        return end - pos

    def _span_by_prefix(self, messages: list[dict], i: int, full: str, tools=None) -> tuple[int, int] | None:
        try:
            prompt = self.render(messages[:i], add_generation_prompt=True, tools=tools)
            done = self.render(messages[:i + 1], tools=tools)
        except Exception:
            return None
        if not (done.startswith(prompt) and full.startswith(done)) or len(done) == len(prompt):
            return None
        start, end = len(prompt), len(done)
        content = messages[i]["content"].strip()
        pos = full.rfind(content, start, end) if content else -1
        if pos >= 0:
            content_end = pos + len(content)
            end = content_end + self._end_of_turn_length(full, content_end, end, run=True)
        else:
            # The template rewrote the content: end after the last added token of the turn.
            last = max((full.rfind(t, start, end) + len(t) for t in self.added_tokens
                        if full.rfind(t, start, end) >= 0), default=-1)
            if last > start:
                end = last
        return start, end

    def _rendered_turn(self, messages: list[dict], i: int, tools=None) -> str:
        """Turn ``i`` as the template writes it when it is the last one (what the generation
        prompt is followed by); '' when the template cannot render that."""
        try:
            prompt = self.render(messages[:i], add_generation_prompt=True, tools=tools)
            done = self.render(messages[:i + 1], tools=tools)
        except Exception:
            return ""
        return done[len(prompt):] if done.startswith(prompt) else ""

    def _span_by_search(self, full: str, content: str, cursor: int) -> tuple[int, int] | None:
        # Reasoning templates (Qwen3, DeepSeek-R1) drop an earlier turn's <think> block:
        # then only the answer after it is rendered.
        for text in (content.strip(), content.split("</think>")[-1].strip()):
            if not text:
                continue
            start = cursor
            if self.assistant_header:
                header = full.find(self.assistant_header, cursor)
                if header >= 0 and full.find(text, header + len(self.assistant_header)) >= 0:
                    start = header + len(self.assistant_header)
            pos = full.find(text, start)
            if pos >= 0:
                end = pos + len(text)
                return pos, end + self._end_of_turn_length(full, end, len(full), run=False)
        return None

    def assistant_spans(self, messages: list[dict], sample_id: str = "?") -> tuple[str, list[tuple[int, int]]]:
        """The full rendering and the character spans ``[start, end)`` of its assistant turns
        (a tool-calling turn's span holds the calls as the template writes them; a tool's
        output is not the assistant's)."""
        tools = getattr(messages, "tools", None)
        full = self.render(messages, tools=tools)
        spans: list[tuple[int, int]] = []
        cursor = 0
        missing = []
        for i, message in enumerate(messages):
            content = message["content"]
            if message["role"] != "assistant":
                # Move past this turn so an assistant reply repeating it is found after it.
                pos = full.find(content.strip(), cursor)
                if pos >= 0:
                    cursor = pos + len(content.strip())
                continue
            span = self._span_by_prefix(messages, i, full, tools)
            if span is None:
                # A tool-calling turn has no content to look for: its own rendering is the text
                # (the calls as the template writes them, up to the end-of-turn marker).
                text = content if content.strip() or not message.get("tool_calls") else \
                    self._rendered_turn(messages, i, tools)
                span = self._span_by_search(full, text, cursor)
            if span is None:
                missing.append(i)
                continue
            spans.append(span)
            cursor = span[1]
        if missing and not spans:
            raise MaskError(f"sample {sample_id!r}: loss mask is all 0 (no assistant turn found in "
                            "the rendered conversation; check the chat template and the data)")
        if missing:
            raise MaskError(f"sample {sample_id!r}: assistant turn(s) {missing} not found in the "
                            "rendered conversation")
        return full, spans

    def tokenize(self, messages: list[dict], sample_id: str = "?") -> tuple[np.ndarray, np.ndarray]:
        """``input_ids`` int32 ``[T]`` and ``loss_mask`` int8 ``[T]`` of one conversation.

        Raises MaskError (naming ``sample_id``) when the mask is all 0 or all 1.
        """
        full, spans = self.assistant_spans(messages, sample_id)
        if getattr(self.tokenizer, "is_fast", False):
            encoding = self.tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
            input_ids = np.asarray(encoding["input_ids"], dtype=np.int32)
            starts = np.asarray([start for start, _ in encoding["offset_mapping"]], dtype=np.int64)
            loss_mask = np.zeros(len(input_ids), dtype=np.int8)
            for start, end in spans:
                # A token belongs to the turn its first character is in.
                loss_mask[(starts >= start) & (starts < end)] = 1
        else:
            input_ids, loss_mask = self.tokenize_without_offsets(full, spans)
        if len(loss_mask) == 0 or not loss_mask.any():
            raise MaskError(f"sample {sample_id!r}: loss mask is all 0 (no assistant token found; "
                            "check the chat template and the data)")
        if loss_mask.all():
            raise MaskError(f"sample {sample_id!r}: loss mask is all 1 (nothing but assistant "
                            "tokens; the chat template or the data is wrong)")
        return input_ids, loss_mask

    def tokenize_without_offsets(self, full: str, spans: list[tuple[int, int]]) -> tuple[np.ndarray, np.ndarray]:
        """A slow tokenizer has no offsets: each span edge becomes the index of the first
        token at or after it, from the tokens of the text before the edge. The ids are the
        whole text's, as the server tokenizes it; a chat template's spans start and end at
        special tokens, which every tokenizer splits on, so the prefixes tokenize as the
        whole text's first tokens."""
        encode = lambda text: self.tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
        ids = encode(full)
        loss_mask = np.zeros(len(ids), dtype=np.int8)
        for start, end in spans:
            loss_mask[first_token_at(ids, encode(full[:start])):first_token_at(ids, encode(full[:end]))] = 1
        return np.asarray(ids, dtype=np.int32), loss_mask


def first_token_at(ids: list[int], prefix_ids: list[int]) -> int:
    """The index in ``ids`` (the whole text's tokens) of the first token that starts at or
    after the end of a prefix whose own tokens are ``prefix_ids``: a token the edge cuts
    through starts before it, so it belongs to the text before (as with offsets)."""
    common = 0
    for a, b in zip(ids, prefix_ids):
        if a != b:
            break
        common += 1
    return common if common == len(prefix_ids) else common + 1
