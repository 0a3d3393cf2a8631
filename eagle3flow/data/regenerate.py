"""regenerate_responses: the target answers the dataset's prompts itself, through its server.

A draft learns to predict the target; trained on answers someone else wrote it learns
another distribution. This stage asks the target's own OpenAI-compatible server
(``/v1/chat/completions``, the production vLLM unit, before any drain) for every
assistant turn of the dataset; ``prepare_dataset --regenerated`` then trains on them.

Prompts: the conversations ``prepare_dataset`` would use, parsed the same way (same
sample ids, same order, same ``max_samples`` cap: ``order.iter_conversations``).
A multi-turn conversation is answered turn by turn: turn ``t`` is sent with the user
turns so far and the target's own answers to turns ``< t`` (their content only, as a
chat client sends them back). Reasoning a server returns (``reasoning_content`` or
vLLM's ``reasoning``) is kept in the form the chat template expects: a
``reasoning_content`` field when the template reads one, else ``<think>...</think>``
before the answer (``reasoning: auto``; or forced ``field``/``think_tags``/``drop``).

Server: ``base_url`` and ``model`` (or $EAGLE3FLOW_REGENERATE_URL / _MODEL); the
bearer token only from the environment variable named by ``api_key_env``, never from
the config (which the report shows) nor the command line (which Snakemake prints),
and never logged. Before the first prompt the server must list ``model`` at
``/v1/models``: a server that is down, rejects the token or serves another model
fails the stage at once. ``--serve-target DIR`` (the embedded default, which has no
production server) starts ``vllm.entrypoints.openai.api_server`` on 127.0.0.1 for the
duration of the run and stops it after (serving/vllm_server.py), in ``serve_dtype``
(auto: the dtype evaluation runs the target in, so the answers trained on are the
greedy answers evaluation sees; the dtype is part of the cache fingerprint).

Politeness: at most ``max_concurrency`` conversations in flight over as many pooled
keep-alive connections (httpx, data/chat_client.py); 429, 5xx, timeouts and dropped connections are retried
``max_retries`` times with exponential backoff and jitter (``Retry-After`` honoured);
any other 4xx fails that prompt at once.

Resume: each finished conversation is appended (one JSON line, flushed) to
``<cache>/<fingerprint>/responses.jsonl``, keyed by sample id and a hash of its
prompt turns; the fingerprint covers what determines the answers (what the server
serves: its ``root`` at /v1/models, and the target's identity when that root is the
target directory, not only the served name; sampling, reasoning form, template kwargs),
not the URL or the concurrency. A rerun sends only
the conversations not in the cache. Failed prompts are not cached (a rerun retries
them); the stage fails once they exceed ``max_failed_fraction`` of the prompts,
else they are listed with their reason and skipped.

More answers per prompt (``answers_per_prompt`` N > 1): the first answer as above, then
N-1 more of each conversation sampled at ``extra_temperature``, each its own request
(sample id ``<id>~answer<k>``, so its own seed and cache entry) after every first answer
is in. Changing N or ``extra_temperature`` keeps the first answers cached.

Outputs (written when every prompt is answered or skipped; stats.json last):
``responses.jsonl``, one row per sample in prompt order, either
``{"id", "messages": [...all turns, assistant ones regenerated...], "finish_reasons":
[...per assistant turn...]}`` (with N > 1 also ``"more_answers": [{"id", "messages",
"finish_reasons"}, ...]``, those that did not fail) or ``{"id", "failed": reason}``;
``stats.json`` (counts, truncated answers (finish_reason "length"), failures, tokens, tokens/s).

CLI::

    python -m eagle3flow.data.regenerate --input DATA --tokenizer TARGET_DIR --out-dir results/regenerate
        --cache-root cache/regenerate
        --config-json '{...regenerate section, format, dataset_seed, max_samples, chat_template_kwargs,
                        trust_remote_code...}'
        [--serve-target TARGET_DIR --server-log logs/regenerate_server.log] [--vllm-python PATH]
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import threading
import time
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from pathlib import Path

from eagle3flow.atomic import write_json
from eagle3flow.config import REGENERATE_URL_ENV as URL_ENV
from eagle3flow.config import REGENERATE_BORROWED, cli_settings, redact_url, section_settings
from eagle3flow.data.chat_client import ChatClient, PromptFailed, Transient, call_with_retries
from eagle3flow.data.order import iter_conversations
from eagle3flow.data.records import tool_calls_for_templates
from eagle3flow.data.regenerated import more_answer_id
from eagle3flow.progress import Progress
from eagle3flow.serving.vllm_server import ServerError, resolve_serve_dtype, serve_target
from eagle3flow.target.identity import target_digest

# What determines the answers: a change starts a new cache directory.
FINGERPRINT_KEYS = ("model", "temperature", "top_p", "max_tokens", "seed", "reasoning", "extra_body")
MODEL_ENV = "EAGLE3FLOW_REGENERATE_MODEL"
LIST_LIMIT = 1000


class RegenerateError(RuntimeError):
    """The stage cannot go on (server unreachable, wrong model, too many failures)."""


def check_server(client: ChatClient, model: str | None, url: str, api_key_env: str) -> tuple[str, str | None]:
    """The model name to request and what the server serves under it (its ``root`` at
    /v1/models, None when it lists none); fails clearly when the server is down, rejects
    the token or does not serve ``model`` (None: the server's only model)."""
    where = redact_url(url)
    try:
        served = client.models()
    except PromptFailed as error:
        if "HTTP 401" in error.reason or "HTTP 403" in error.reason:
            raise RegenerateError(f"the server at {where} rejected the request ({error.reason}); "
                                  f"put its API token in ${api_key_env}") from None
        raise RegenerateError(f"the server at {where} answered /v1/models with {error.reason}") from None
    except Transient as error:
        raise RegenerateError(f"cannot reach the target's server at {where} ({error.reason}); is it "
                              f"up? Set regenerate.base_url (or ${URL_ENV}) to its URL") from None
    names = list(served)
    if model is None:
        if len(names) != 1:
            raise RegenerateError(f"the server at {where} serves {names}: set regenerate.model "
                                  "(or $" + MODEL_ENV + ") to the target's name")
        model = names[0]
    if model not in served:
        raise RegenerateError(f"the server at {where} does not serve model {model!r}; it serves "
                              f"{names}: set regenerate.model (or ${MODEL_ENV}) to one of them")
    return model, served[model]


def served_identity(root: str | None, target_dir: str | None) -> dict:
    """What the cache is keyed by besides the settings: what the server serves, not the
    name it serves it under (production upgraded under the same --served-model-name must
    be asked again). Its ``root``; and, when that is the target directory this stage was
    given (the workflow's own server of it, or production serving target.path), the
    target's identity (eagle3flow/target/identity.py): the same path rewritten with new
    weights is another model."""
    key = {"served_root": root}
    if root and target_dir and Path(root).is_dir() and Path(root).resolve() == Path(target_dir).resolve():
        key["target_identity"] = target_digest(target_dir)
    return key


# ---------------------------------------------------------------- one conversation

def prompt_hash(messages: list[dict]) -> str:
    """What the answers depend on in a conversation: its non-assistant turns and where
    the assistant turns fall (so a changed dataset row is never served from the cache)."""
    shape = [m["content"] if m["role"] != "assistant" else None for m in messages]
    roles = [m["role"] for m in messages]
    return hashlib.sha256(json.dumps([roles, shape], ensure_ascii=False).encode()).hexdigest()[:16]


def request_seed(seed: int, sample_id: str, turn: int) -> int:
    """A per-request seed: reproducible sampling whatever the batching, distinct per turn."""
    digest = hashlib.sha256(f"{seed}\x00{sample_id}\x00{turn}".encode()).digest()
    return int.from_bytes(digest[:4], "little") & 0x7FFFFFFF


def assistant_message(message: dict, form: str) -> dict:
    """The server's message as the chat template expects it in training data (its tool
    calls kept, their arguments parsed as templates take them)."""
    content = message.get("content") or ""
    reasoning = message.get("reasoning_content") or message.get("reasoning") or ""
    if not reasoning or form == "drop":
        kept = {"role": "assistant", "content": content}
    elif form == "field":
        kept = {"role": "assistant", "content": content, "reasoning_content": reasoning}
    else:
        kept = {"role": "assistant", "content": f"<think>\n{reasoning.strip()}\n</think>\n\n{content.lstrip()}"}
    if message.get("tool_calls"):
        kept["tool_calls"] = tool_calls_for_templates(message["tool_calls"], "the answer")
    return kept


def wire_message(message: dict) -> dict:
    """A turn as an OpenAI-compatible server takes it back: tool calls with their arguments
    as a JSON string, a tool's output with the id of the call it answers."""
    sent = {"role": message["role"], "content": message.get("content") or ""}
    for key in ("tool_call_id", "name"):
        if message.get(key) is not None:
            sent[key] = message[key]
    if message.get("tool_calls"):
        sent["tool_calls"] = [{**call, "function": {**call["function"], "arguments": call["function"]["arguments"]
                                                    if isinstance(call["function"]["arguments"], str)
                                                    else json.dumps(call["function"]["arguments"])}}
                              for call in message["tool_calls"]]
    return sent


def reasoning_form(setting: str, tokenizer_dir: str | None) -> str:
    """``auto``: a ``reasoning_content`` field when the target's chat template reads one,
    else think tags inline."""
    if setting != "auto":
        return setting
    template = ""
    if tokenizer_dir:
        for name in ("tokenizer_config.json", "chat_template.jinja", "chat_template.json"):
            path = Path(tokenizer_dir) / name
            if path.is_file():
                template += path.read_text(encoding="utf-8", errors="replace")
    return "field" if "reasoning_content" in template else "think_tags"


class Settings:
    """What one request needs besides the conversation (immutable during a run)."""

    def __init__(self, cfg: dict, model: str, form: str, template_kwargs: dict):
        self.cfg, self.model, self.form, self.template_kwargs = cfg, model, form, template_kwargs


def answer_conversation(client: ChatClient, settings: Settings, sample_id: str, messages: list[dict],
                        stop: threading.Event, counters: dict, lock: threading.Lock,
                        temperature: float | None = None) -> dict:
    """The conversation with every assistant turn answered by the target, turn by turn
    (at ``temperature``, else the configured one).

    Returns the cache entry ``{"id", "prompt_sha", "messages", "finish_reasons",
    "prompt_tokens", "completion_tokens"}``; raises PromptFailed.
    """
    cfg = settings.cfg
    sent: list[dict] = []      # what the server sees: previous answers as content only
    kept: list[dict] = []      # what training sees: answers with their reasoning
    finish_reasons, prompt_tokens, completion_tokens = [], 0, 0
    tools = getattr(messages, "tools", None)
    for message in messages:
        if message["role"] != "assistant":
            sent.append(wire_message(message))
            kept.append(dict(message))
            continue
        if stop.is_set():
            raise PromptFailed("stopped")
        turn = len(finish_reasons)
        body = {"model": settings.model, "messages": sent, "max_tokens": cfg["max_tokens"],
                "temperature": cfg["temperature"] if temperature is None else temperature, "top_p": cfg["top_p"],
                "seed": request_seed(cfg["seed"], sample_id, turn), **cfg["extra_body"]}
        if tools:
            body["tools"] = tools
        if settings.template_kwargs:
            body.setdefault("chat_template_kwargs", settings.template_kwargs)
        answer = call_with_retries(client, body, cfg, stop, counters, lock)
        try:
            choice = answer["choices"][0]
            reply = choice["message"]
        except (KeyError, IndexError, TypeError):
            raise PromptFailed(f"turn {turn}: malformed answer: {json.dumps(answer)[:200]}") from None
        regenerated = assistant_message(reply, settings.form)
        if not regenerated["content"].strip() and not regenerated.get("reasoning_content") \
                and not regenerated.get("tool_calls"):
            raise PromptFailed(f"turn {turn}: empty answer (finish_reason {choice.get('finish_reason')})")
        finish_reasons.append(choice.get("finish_reason"))
        usage = answer.get("usage") or {}
        prompt_tokens += int(usage.get("prompt_tokens") or 0)
        completion_tokens += int(usage.get("completion_tokens") or 0)
        sent.append(wire_message({"role": "assistant", "content": reply.get("content"),
                                  "tool_calls": reply.get("tool_calls")}))
        kept.append(regenerated)
    return {"id": sample_id, "prompt_sha": prompt_hash(messages), "messages": kept,
            "finish_reasons": finish_reasons, "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens}


# ---------------------------------------------------------------- cache

class ResponseCache:
    """``responses.jsonl`` in the cache: one finished conversation per line, appended.

    A line cut by a kill is dropped on open (and truncated away, so the next append
    starts a fresh line); a later entry for an id wins."""

    def __init__(self, path: Path):
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        self.entries: dict[str, dict] = {}
        if path.exists():
            data = path.read_bytes()
            end = data.rfind(b"\n") + 1
            if end < len(data):
                with open(path, "r+b") as f:
                    f.truncate(end)
            for line in data[:end].splitlines():
                try:
                    entry = json.loads(line)
                except ValueError:
                    continue
                self.entries[entry["id"]] = entry
        self._file = open(path, "a", encoding="utf-8")

    def add(self, entry: dict) -> None:
        self._file.write(json.dumps(entry, ensure_ascii=False) + "\n")
        self._file.flush()
        self.entries[entry["id"]] = entry

    def close(self) -> None:
        self._file.close()


class Job:
    """One request chain: a conversation's first answer, or its k-th (k >= 2)."""

    def __init__(self, sample_id: str, messages: list[dict], k: int, cfg: dict):
        self.base_id, self.messages, self.first = sample_id, messages, k == 1
        self.id = sample_id if k == 1 else more_answer_id(sample_id, k)
        self.temperature = None if k == 1 else float(cfg["extra_temperature"])
        # A further answer is also keyed by its temperature: a new one asks again.
        self.sha = prompt_hash(messages) if k == 1 else f"{prompt_hash(messages)}@t{self.temperature!r}"


def jobs_for(conversations: list[tuple[str, list[dict]]], cfg: dict) -> list[Job]:
    """Every conversation's first answer, then (answers_per_prompt > 1) the further ones."""
    return [Job(sid, msgs, k, cfg) for k in range(1, int(cfg["answers_per_prompt"]) + 1)
            for sid, msgs in conversations]


def fingerprint(cfg: dict, model: str, form: str, template_kwargs: dict, served_dtype: str | None = None,
                served: dict | None = None) -> str:
    """``served``: :func:`served_identity` of the server's model."""
    keys = {k: cfg[k] for k in FINGERPRINT_KEYS}
    keys.update(model=model, reasoning=form, chat_template_kwargs=template_kwargs, **(served or {}))
    if served_dtype is not None:    # the stage serves the target itself, in this dtype
        keys["served_dtype"] = served_dtype
    return hashlib.sha256(json.dumps(keys, sort_keys=True).encode()).hexdigest()[:16]


# ---------------------------------------------------------------- the stage

# The serving rate measured while answering, in the cache (the plan projects the rest of
# an interrupted regeneration from it): rewritten at most every RATE_EVERY_S seconds.
RATE_FILE = "rate.json"
RATE_EVERY_S = 5.0


def _write_rate(cache_dir: Path, completion_tokens: int, seconds: float) -> None:
    try:
        write_json(cache_dir / RATE_FILE, {"completion_tokens": completion_tokens,
                                           "seconds": round(seconds, 2), "at": time.time()}, indent=None)
    except OSError:
        pass


def regenerate(conversations: list[tuple[str, list[dict]]], out_dir: str | Path, cache_root: str | Path,
               base_url: str, cfg: dict | None = None, tokenizer_dir: str | None = None,
               template_kwargs: dict | None = None, bad_rows: list[dict] | None = None,
               progress_interval: float = 5.0, served_dtype: str | None = None) -> dict:
    """Answer every ``(sample_id, messages)`` with the server at ``base_url``; write
    ``out_dir/responses.jsonl`` and ``out_dir/stats.json``; return the stats.

    ``messages``: ``[{"role", "content"}, ...]`` ending with an assistant turn (the
    original answers, replaced). ``served_dtype``: the dtype of the server this stage
    started (part of the cache fingerprint), None for a server of its own. Raises
    RegenerateError (the outputs are then not written; the cache keeps every
    conversation already answered).
    """
    cfg = section_settings("regenerate", cfg)
    template_kwargs = dict(template_kwargs or {})
    out_dir, t0 = Path(out_dir), time.monotonic()
    api_key = os.environ.get(cfg["api_key_env"]) or None
    client = ChatClient(base_url, api_key, cfg["request_timeout_s"], cfg["max_concurrency"])
    form = reasoning_form(cfg["reasoning"], tokenizer_dir)
    model_setting = cfg["model"] or os.environ.get(MODEL_ENV) or None
    # What the server serves is part of the fingerprint, so the server is asked even on a
    # rerun with everything cached.
    model, root = check_server(client, model_setting, base_url, cfg["api_key_env"])
    if root is None:
        print(f"regenerate: the server at {redact_url(base_url)} lists no root for {model!r} at /v1/models: "
              "its cache is keyed by the name alone, so after another model is served under that "
              "name, delete the cache folder named below", file=sys.stderr, flush=True)
    served = served_identity(root, tokenizer_dir)
    cache_dir = Path(cache_root) / fingerprint(cfg, model, form, template_kwargs, served_dtype, served)
    cache = ResponseCache(cache_dir / "responses.jsonl")
    jobs = jobs_for(conversations, cfg)
    todo = [job for job in jobs if cache.entries.get(job.id, {}).get("prompt_sha") != job.sha]
    total = len(jobs)
    each = f", {cfg['answers_per_prompt']} answers each" if len(jobs) > len(conversations) else ""
    print(f"regenerate: {len(conversations)} conversations{each}, {total - len(todo)} answers already in "
          f"{cache_dir}, sending {len(todo)} to {redact_url(base_url)} (model {model!r}, reasoning as {form}, "
          f"at most {cfg['max_concurrency']} at a time)", file=sys.stderr, flush=True)

    settings = Settings(cfg, model, form, template_kwargs)
    failures: list[dict] = []
    counters = {"retries": 0, "completion_tokens": 0}
    lock, stop = threading.Lock(), threading.Event()
    progress = Progress("regenerate", len(todo), "answers" if each else "conversations",
                        interval=progress_interval)
    t_send, rate_written = time.monotonic(), 0.0
    # First answers and further ones are held to max_failed_fraction each: a conversation
    # without its first answer is lost to the dataset, a missing further answer is not.
    first_failed: set[str] = set()
    failed_of = {True: [], False: []}      # job.first -> its kind's failures
    allowed = {True: cfg["max_failed_fraction"] * len(conversations),
               False: cfg["max_failed_fraction"] * (total - len(conversations))}
    pending: dict = {}
    pool = ThreadPoolExecutor(max_workers=cfg["max_concurrency"], thread_name_prefix="regenerate")
    try:
        queue = iter(todo)
        while True:
            # A bounded window of submitted conversations (memory stays flat for any dataset).
            for job in queue:
                if not job.first and job.base_id in first_failed:
                    progress.update(1)    # its conversation is left out: no further answer needed
                    continue
                pending[pool.submit(answer_conversation, client, settings, job.id, job.messages, stop,
                                    counters, lock, job.temperature)] = job
                if len(pending) >= 2 * cfg["max_concurrency"]:
                    break
            if not pending:
                break
            done, _ = wait(pending, return_when=FIRST_COMPLETED)
            for future in done:
                job = pending.pop(future)
                try:
                    entry = {**future.result(), "prompt_sha": job.sha}
                except PromptFailed as error:
                    failures.append({"id": job.id, "reason": error.reason})
                    failed_of[job.first].append(failures[-1])
                    print(f"regenerate: {job.id}: failed: {error.reason}", file=sys.stderr, flush=True)
                    if job.first:
                        first_failed.add(job.id)
                    if len(failed_of[job.first]) > allowed[job.first]:
                        stop.set()
                        raise RegenerateError(_too_many(
                            failed_of[job.first], len(conversations) if job.first else total - len(conversations),
                            cfg["max_failed_fraction"], "conversations" if job.first else "further answers"))
                else:
                    cache.add(entry)
                    counters["completion_tokens"] += entry["completion_tokens"]
                elapsed = max(time.monotonic() - t_send, 1e-9)
                if elapsed - rate_written >= RATE_EVERY_S:
                    rate_written = elapsed
                    _write_rate(cache_dir, counters["completion_tokens"], elapsed)
                progress.update(1, extra=f"{counters['completion_tokens'] / elapsed:,.0f} tokens/s, "
                                         f"{len(failures)} failed, {counters['retries']} retries")
    finally:
        stop.set()
        pool.shutdown(wait=True, cancel_futures=True)
        cache.close()
        client.close()
    progress.close()

    stats = _write_outputs(conversations, int(cfg["answers_per_prompt"]), cache.entries, failures, out_dir, {
        "server": {"url": redact_url(base_url), "model": model, **served}
        | ({"dtype": served_dtype} if served_dtype else {}),
        "settings": {k: cfg[k] for k in FINGERPRINT_KEYS if k != "model"} | {
            "reasoning": form, "chat_template_kwargs": template_kwargs,
            "answers_per_prompt": cfg["answers_per_prompt"], "extra_temperature": cfg["extra_temperature"]},
        "cache": str(cache_dir),
        "sent": {"conversations": len(todo), "requests": client.requests - 1,  # minus /v1/models
                 "retries": counters["retries"], "wall_s": round(time.monotonic() - t0, 1),
                 "completion_tokens": counters["completion_tokens"],
                 "tokens_per_s": round(counters["completion_tokens"] / max(time.monotonic() - t0, 1e-9), 1)},
        "bad_input_rows": {"count": len(bad_rows or []), "rows": (bad_rows or [])[:LIST_LIMIT]},
    })
    print(f"regenerate: {stats['regenerated']} conversations regenerated ({stats['turns']} answers, "
          f"{stats['truncated']['count']} truncated at max_tokens), {stats['failed']['count']} failed "
          f"-> {out_dir}", file=sys.stderr, flush=True)
    return stats


def _too_many(failures: list[dict], total: int, fraction: float, what: str = "conversations") -> str:
    first = "; ".join(f"{f['id']} ({f['reason']})" for f in failures[:3])
    return (f"{len(failures)} of {total} {what} failed ({100.0 * len(failures) / max(total, 1):.2f}% "
            f"> regenerate.max_failed_fraction {100.0 * fraction:.2f}%); first: {first}. Answers so far "
            f"are kept in the cache; a rerun sends only the rest")


def _write_outputs(conversations, answers_per_prompt: int, entries: dict, failures: list[dict], out_dir: Path,
                   extra: dict) -> dict:
    failed = {f["id"]: f["reason"] for f in failures}
    out_dir.mkdir(parents=True, exist_ok=True)
    truncated, turns, tokens, more = [], 0, 0, 0
    tmp = out_dir / ".responses.jsonl.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        for sid, _ in conversations:
            if sid in failed:
                f.write(json.dumps({"id": sid, "failed": failed[sid]}, ensure_ascii=False) + "\n")
                continue
            entry = entries[sid]
            turns += len(entry["finish_reasons"])
            tokens += entry["completion_tokens"]
            if "length" in entry["finish_reasons"]:
                truncated.append(sid)
            row = {"id": sid, "messages": entry["messages"], "finish_reasons": entry["finish_reasons"]}
            if answers_per_prompt > 1:
                extras = [entries[i] for i in (more_answer_id(sid, k) for k in range(2, answers_per_prompt + 1))
                          if i not in failed]
                row["more_answers"] = [{"id": e["id"], "messages": e["messages"],
                                        "finish_reasons": e["finish_reasons"]} for e in extras]
                more += len(extras)
                for e in extras:
                    turns += len(e["finish_reasons"])
                    tokens += e["completion_tokens"]
                    if "length" in e["finish_reasons"]:
                        truncated.append(e["id"])
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    stats = {
        "conversations": len(conversations),
        "regenerated": sum(sid not in failed for sid, _ in conversations),
        "more_answers": more,
        "turns": turns,
        "completion_tokens": tokens,
        "truncated": {"count": len(truncated), "ids": truncated[:LIST_LIMIT],
                      "note": "finish_reason length: the answer hit regenerate.max_tokens"},
        "failed": {"count": len(failures),
                   "conversations": sum(sid in failed for sid, _ in conversations),
                   "fraction": len(failures) / max(len(conversations) * answers_per_prompt, 1),
                   "rows": failures[:LIST_LIMIT]},
        **extra,
    }
    stats_tmp = out_dir / ".stats.json.tmp"
    stats_tmp.write_text(json.dumps(stats, indent=2, ensure_ascii=False) + "\n")
    os.replace(tmp, out_dir / "responses.jsonl")
    os.replace(stats_tmp, out_dir / "stats.json")  # last: its presence means complete
    return stats


# ---------------------------------------------------------------- CLI

def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m eagle3flow.data.regenerate", description=__doc__.split("\n")[0])
    parser.add_argument("--input", required=True, help="data file, directory or Hub id (as prepare_dataset)")
    parser.add_argument("--tokenizer", help="target directory: its chat template decides the reasoning form")
    parser.add_argument("--out-dir", required=True)
    parser.add_argument("--cache-root", required=True)
    parser.add_argument("--config-json", default="{}",
                        help="the regenerate section, with " + ", ".join(f"{k} ({v})" for k, v in REGENERATE_BORROWED.items()))
    parser.add_argument("--serve-target", help="the target, served by vLLM for the run when there is no URL")
    parser.add_argument("--server-log", default="regenerate_server.log")
    parser.add_argument("--vllm-python", default=None, help="interpreter with vLLM for --serve-target")
    args = parser.parse_args(argv)
    cfg = cli_settings(parser, "regenerate", args.config_json, borrowed=REGENERATE_BORROWED)
    # the borrowed keys (the dataset's, target.trust_remote_code) apart: regenerate() takes the section
    borrowed = {key: cfg.pop(key) for key in REGENERATE_BORROWED}
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        conversations, bad = [], []
        for sid, messages in iter_conversations(args.input, borrowed["format"], seed=borrowed["dataset_seed"],
                                                max_samples=borrowed["max_samples"]):
            if isinstance(messages, Exception):
                bad.append({"id": sid, "reason": str(messages)})
            else:
                conversations.append((sid, messages))
        if not conversations:
            raise RegenerateError(f"{args.input}: no usable conversation to regenerate")
        kwargs = dict(tokenizer_dir=args.tokenizer, template_kwargs=borrowed["chat_template_kwargs"],
                      bad_rows=bad)
        base_url = cfg["base_url"] or os.environ.get(URL_ENV)
        if args.serve_target and not base_url:
            dtype = resolve_serve_dtype(cfg["serve_dtype"], args.vllm_python)
            with serve_target(args.serve_target, args.server_log, args.vllm_python,
                              cfg["serve_max_model_len"], cfg["serve_startup_timeout_s"],
                              log_tag="regenerate", dtype=dtype,
                              trust_remote_code=borrowed["trust_remote_code"]) as url:
                regenerate(conversations, args.out_dir, args.cache_root, url, cfg, served_dtype=dtype, **kwargs)
        elif base_url:
            regenerate(conversations, args.out_dir, args.cache_root, base_url, cfg, **kwargs)
        else:
            raise RegenerateError(f"no server to ask: set regenerate.base_url (or ${URL_ENV})")
    except (RegenerateError, ServerError, ValueError, OSError) as error:
        print(f"regenerate: error: {error}", file=sys.stderr, flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
