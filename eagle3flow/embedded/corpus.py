"""The demo chat dataset: Python stdlib docstrings turned into Q/A conversations.

Every machine with Python has this text, so the embedded default needs no download.
A conversation asks what a stdlib function/class/method does, with its documentation
(signature and the first paragraph of its docstring) quoted in the question, and the
answer explains it from that documentation; a stable fraction get a second turn (its
signature, or its module) so multi-turn conversations exist, and some open with a
system prompt. The answer is grounded in the prompt on purpose: a model of a few
million parameters trained for a minute cannot know what an unseen function does, but
it can learn to read it from the question, so its greedy answers to held-out prompts
are as varied and as long as real answers, and a draft has something real to predict
at every position.

Determinism: modules come from a fixed sorted list, members in sorted name order,
and every "random" choice is a hash of the conversation id, so two builds with the
same Python produce byte-identical files. Contents follow the running Python's
docstrings; the version is recorded in the build stats.
"""
from __future__ import annotations

import hashlib
import importlib
import inspect
import re
import sys
import warnings
from pathlib import Path

from eagle3flow.atomic import write_jsonl
from eagle3flow.jsonl import iter_jsonl

# Pure-Python or always-built modules present on every CPython >= 3.10 on Linux/macOS.
# Modules deprecated for removal (PEP 594), platform-only ones and ones with import
# side effects (antigravity, this, turtle) are left out so the list stays portable.
STDLIB_MODULES: tuple[str, ...] = tuple(sorted([
    "abc", "argparse", "array", "ast", "asyncio", "asyncio.base_events", "asyncio.events",
    "asyncio.futures", "asyncio.locks", "asyncio.protocols", "asyncio.queues",
    "asyncio.runners", "asyncio.streams", "asyncio.subprocess", "asyncio.taskgroups",
    "asyncio.tasks", "asyncio.timeouts", "asyncio.transports", "base64", "bdb", "binascii",
    "bisect", "builtins", "bz2", "calendar", "cmath", "cmd", "code", "codecs",
    "collections", "collections.abc", "colorsys", "compileall", "concurrent.futures",
    "concurrent.futures.process", "concurrent.futures.thread", "configparser",
    "contextlib", "contextvars", "copy", "copyreg", "csv", "ctypes", "ctypes.util",
    "dataclasses", "datetime", "dbm", "dbm.dumb", "decimal", "difflib", "dis", "doctest",
    "email.charset", "email.contentmanager", "email.feedparser", "email.generator",
    "email.header", "email.headerregistry", "email.iterators", "email.message",
    "email.mime.base", "email.mime.multipart", "email.mime.text", "email.parser",
    "email.policy", "email.utils", "ensurepip", "enum", "filecmp", "fileinput", "fnmatch",
    "fractions", "ftplib", "functools", "gc", "getopt", "getpass", "gettext", "glob",
    "graphlib", "gzip", "hashlib", "heapq", "hmac", "html", "html.parser", "http",
    "http.client", "http.cookiejar", "http.cookies", "http.server", "imaplib", "importlib",
    "importlib.abc", "importlib.machinery", "importlib.metadata", "importlib.resources",
    "importlib.util", "inspect", "io", "ipaddress", "itertools", "json", "json.decoder",
    "json.encoder", "json.scanner", "keyword", "linecache", "locale", "logging",
    "logging.config", "logging.handlers", "lzma", "mailbox", "marshal", "math",
    "mimetypes", "mmap", "modulefinder", "multiprocessing", "multiprocessing.connection",
    "multiprocessing.context", "multiprocessing.managers", "multiprocessing.pool",
    "multiprocessing.queues", "multiprocessing.shared_memory",
    "multiprocessing.synchronize", "netrc", "numbers", "operator", "optparse", "os",
    "os.path", "pathlib", "pdb", "pickle", "pickletools", "pkgutil", "platform",
    "plistlib", "poplib", "pprint", "profile", "pstats", "py_compile", "pyclbr", "pydoc",
    "queue", "quopri", "random", "re", "reprlib", "runpy", "sched", "secrets", "select",
    "selectors", "shelve", "shlex", "shutil", "signal", "site", "smtplib", "socket",
    "socketserver", "sqlite3", "ssl", "stat", "statistics", "string", "string.templatelib",
    "struct", "subprocess", "symtable", "sys", "sysconfig", "tabnanny", "tarfile",
    "tempfile", "textwrap", "threading", "time", "timeit", "token", "tokenize", "tomllib",
    "trace", "traceback", "tracemalloc", "types", "typing", "unicodedata", "unittest",
    "unittest.case", "unittest.loader", "unittest.main", "unittest.mock",
    "unittest.result", "unittest.runner", "unittest.suite", "urllib.error", "urllib.parse",
    "urllib.request", "urllib.robotparser", "uuid", "venv", "warnings", "wave", "weakref",
    "wsgiref.handlers", "wsgiref.simple_server", "wsgiref.util", "xml.dom.minidom",
    "xml.dom.pulldom", "xml.etree.ElementTree", "xml.sax", "xml.sax.handler",
    "xml.sax.saxutils", "xml.sax.xmlreader", "xmlrpc.client", "xmlrpc.server", "zipapp",
    "zipfile", "zipimport", "zlib", "zoneinfo",
]))

SYSTEM_PROMPT = "You are a concise assistant that explains the Python standard library."

QUESTION_TEMPLATES = (
    "What does `{name}` do?",
    "What is `{name}` for?",
    "Explain `{name}`.",
    "Can you describe `{name}` in Python?",
    "What is `{name}` in the Python standard library?",
    "Tell me about `{name}`.",
)
MODULE_QUESTION_TEMPLATES = (
    "What is the `{name}` module?",
    "What does the `{name}` module provide?",
    "Explain the Python module `{name}`.",
)
ANSWER_LEADS = ("`{name}`: ", "According to its documentation, `{name}`: ", "In short, `{name}`: ")
SIGNATURE_QUESTION = "What is its signature?"
MODULE_QUESTION = "Which module is it in?"

MIN_ANSWER_CHARS = 20
MIN_DOCUMENTATION_CHARS = 200  # shorter first paragraphs are followed by the next ones
MAX_DOCSTRING_CHARS = 6000   # longer docstrings are manuals, not answers: skip them
MAX_ANSWER_CHARS = 450       # ~150 tokens of the embedded tokenizer at worst (code-heavy text),
                             # so the quoted documentation and the answer fit dataset.max_length
MAX_SIGNATURE_CHARS = 300
_SIGNATURE_LINE = re.compile(r"^[\w.]+\(.*\)(\s*->\s*.+)?$")


def stable_fraction(key: str, salt: str) -> float:
    """A number in [0, 1) fixed by ``key`` and ``salt`` (replaces a seeded RNG draw)."""
    digest = hashlib.sha256(f"{salt}:{key}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


def prose_paragraphs(doc: str) -> list[str]:
    """The prose paragraphs of a cleaned docstring, lines joined.

    C builtins often start with a signature line (``dumps(obj, ...) -> bytes``):
    such paragraphs are skipped so the answer is prose.
    """
    paragraphs = []
    for paragraph in re.split(r"\n\s*\n", doc.strip()):
        lines = [line.strip() for line in paragraph.strip().splitlines()]
        if lines and not all(_SIGNATURE_LINE.match(line) for line in lines):
            paragraphs.append(" ".join(lines))
    return paragraphs


def first_paragraph(doc: str) -> str:
    """The first prose paragraph of a cleaned docstring, or ''."""
    paragraphs = prose_paragraphs(doc)
    return paragraphs[0] if paragraphs else ""


def leading_paragraphs(doc: str, min_chars: int = MIN_DOCUMENTATION_CHARS,
                       max_chars: int = MAX_ANSWER_CHARS) -> str:
    """The first prose paragraph, followed by the next ones while it is shorter than
    ``min_chars`` and they fit in ``max_chars`` (one-line docstrings make short answers)."""
    paragraphs = prose_paragraphs(doc)
    if not paragraphs:
        return ""
    text = paragraphs[0]
    for paragraph in paragraphs[1:]:
        if len(text) >= min_chars or len(text) + 1 + len(paragraph) > max_chars:
            break
        text = f"{text} {paragraph}"
    return text


def cap_answer(text: str, max_chars: int = MAX_ANSWER_CHARS) -> str:
    """``text`` cut at the last sentence end before ``max_chars`` (a word end if none)."""
    if len(text) <= max_chars:
        return text
    head = text[:max_chars]
    cut = max(head.rfind(". "), head.rfind(".\n"))
    if cut >= max_chars // 3:
        return head[:cut + 1]
    return head.rsplit(" ", 1)[0] + " ..."


def _signature_text(qualified_name: str, obj) -> str | None:
    try:
        signature = str(inspect.signature(obj))
    except (TypeError, ValueError):
        return None
    text = f"`{qualified_name}{signature}`"
    # Reprs of default objects carry memory addresses, and some defaults are this
    # machine's paths (platform.architecture(executable=sys.executable)): either would
    # make two checkouts build different corpora, so different targets.
    if len(text) > MAX_SIGNATURE_CHARS or " at 0x" in text or any(repr(path) in text for path in _interpreter_paths()):
        return None
    return text


def _interpreter_paths() -> set[str]:
    """Values that differ between checkouts and machines: this interpreter and its venv."""
    return {p for p in (sys.executable, sys.prefix, sys.base_prefix, sys.exec_prefix) if p}


def _defined_here(obj, module_name: str) -> bool:
    """Whether ``obj`` belongs to ``module_name`` (not a re-export from elsewhere)."""
    owner = getattr(obj, "__module__", None)
    if owner == module_name:
        return True
    # os.path is posixpath, builtins' C functions report "builtins"; accept the real home.
    module = importlib.import_module(module_name)
    return owner is not None and getattr(module, "__name__", None) == owner


def iter_documented_members(modules: tuple[str, ...] = STDLIB_MODULES):
    """Yield ``(qualified_name, module_name, obj, cleaned_doc)`` in a fixed order.

    The module itself, its public functions and classes (defined there, not
    re-exported), then the public methods a class defines itself, in sorted name order.
    """
    for module_name in modules:
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            continue  # not built on this platform; the stats list what was used
        module_doc = module.__doc__ if isinstance(module.__doc__, str) else ""
        yield module_name, module_name, module, inspect.cleandoc(module_doc)
        for name in sorted(vars(module)):
            if name.startswith("_"):
                continue
            obj = vars(module)[name]
            if not (inspect.isroutine(obj) or inspect.isclass(obj)):
                continue
            if not _defined_here(obj, module_name):
                continue
            qualified = f"{module_name}.{name}"
            doc = inspect.cleandoc(obj.__doc__) if isinstance(obj.__doc__, str) else ""
            yield qualified, module_name, obj, doc
            if inspect.isclass(obj):
                for method_name in sorted(vars(obj)):
                    if method_name.startswith("_"):
                        continue
                    raw = vars(obj)[method_name]
                    method = getattr(obj, method_name, None)
                    if not (inspect.isroutine(raw) or isinstance(raw, (classmethod, staticmethod))):
                        continue
                    method_doc = method.__doc__ if method is not None else None
                    # A method that only inherits its parent's docstring adds nothing new.
                    if not isinstance(method_doc, str):
                        continue
                    yield (f"{qualified}.{method_name}", module_name, method,
                           inspect.cleandoc(method_doc))


def make_conversation(qualified_name: str, module_name: str, obj, answer: str) -> dict:
    """One conversation for a documented object; every choice is keyed by its id."""
    conv_id = f"stdlib-{qualified_name}"
    # Builtins are asked about as people write them: `len`, not `builtins.len`.
    display_name = qualified_name.removeprefix("builtins.")
    templates = MODULE_QUESTION_TEMPLATES if inspect.ismodule(obj) else QUESTION_TEMPLATES
    template = templates[int(stable_fraction(conv_id, "question") * len(templates))]
    messages = []
    if stable_fraction(conv_id, "system") < 0.15:
        messages.append({"role": "system", "content": SYSTEM_PROMPT})
    signature = _signature_text(display_name, obj)
    header = signature or f"`{display_name}`"
    question = template.format(name=display_name)
    messages.append({"role": "user", "content": f"{question}\n\nDocumentation of {header}:\n{answer}"})
    lead = ANSWER_LEADS[int(stable_fraction(conv_id, "lead") * len(ANSWER_LEADS))]
    called = f" It is called as {signature}." if signature else ""
    messages.append({"role": "assistant", "content": lead.format(name=display_name) + answer + called})
    second = stable_fraction(conv_id, "second_turn")
    if second >= 0.3:
        signature = None
    if signature is not None:
        messages.append({"role": "user", "content": SIGNATURE_QUESTION})
        messages.append({"role": "assistant", "content": f"Its signature is {signature}."})
    elif second >= 0.9 and not inspect.ismodule(obj):
        messages.append({"role": "user", "content": MODULE_QUESTION})
        messages.append({"role": "assistant",
                         "content": f"`{display_name}` is in the `{module_name}` module."})
    return {"id": conv_id, "messages": messages}


def collect_conversations(max_conversations: int | None = 4000,
                          modules: tuple[str, ...] = STDLIB_MODULES) -> tuple[list[dict], dict]:
    """All conversations (or a stable subset of ``max_conversations``), sorted by id.

    Returns ``(conversations, stats)``; stats count skips by reason.
    """
    seen_ids, seen_answers = set(), set()
    candidates = []
    skipped = {"empty_doc": 0, "huge_doc": 0, "no_prose": 0, "duplicate": 0}
    with warnings.catch_warnings():
        # Importing and introspecting deprecated corners (typing.re, ...) warns; harmless here.
        warnings.simplefilter("ignore", DeprecationWarning)
        members = list(iter_documented_members(modules))
    for qualified, module_name, obj, doc in members:
        if not doc.strip():
            skipped["empty_doc"] += 1
            continue
        if len(doc) > MAX_DOCSTRING_CHARS:
            skipped["huge_doc"] += 1
            continue
        answer = leading_paragraphs(doc)
        if len(answer) < MIN_ANSWER_CHARS:
            skipped["no_prose"] += 1
            continue
        answer = cap_answer(answer)
        conv_id = f"stdlib-{qualified}"
        # Aliases and inherited docstrings repeat text; one copy teaches as much.
        if conv_id in seen_ids or answer in seen_answers:
            skipped["duplicate"] += 1
            continue
        seen_ids.add(conv_id)
        seen_answers.add(answer)
        candidates.append(make_conversation(qualified, module_name, obj, answer))
    available = len(candidates)
    if max_conversations is not None and available > max_conversations:
        # A hash order spreads the subset over all modules instead of the first few.
        candidates.sort(key=lambda conv: stable_fraction(conv["id"], "subset"))
        candidates = candidates[:max_conversations]
    candidates.sort(key=lambda conv: conv["id"])
    stats = {"available": available, "conversations": len(candidates), "skipped": skipped,
             "multi_turn": sum(1 for c in candidates if len(c["messages"]) > 3),
             "with_system": sum(1 for c in candidates if c["messages"][0]["role"] == "system")}
    return candidates, stats


def write_conversations(conversations: list[dict], path: Path) -> None:
    """Write JSONL atomically (temp name, then rename)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_jsonl(path, conversations, sort_keys=True)


def build_corpus(out_path: Path, max_conversations: int | None = 4000) -> dict:
    """Write ``conversations.jsonl`` at ``out_path``; return its stats."""
    conversations, stats = collect_conversations(max_conversations)
    write_conversations(conversations, out_path)
    return stats


def read_conversations(path: Path) -> list[dict]:
    """Read a conversations JSONL, failing with the file and line on bad rows."""
    conversations = []
    for where, conv in iter_jsonl(path):
        if not isinstance(conv, dict) or not isinstance(conv.get("messages"), list) or "id" not in conv:
            raise ValueError(f"{where}: needs fields 'id' and 'messages' (a list)")
        conversations.append(conv)
    return conversations
