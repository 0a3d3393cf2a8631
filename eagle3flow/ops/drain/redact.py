"""Secrets out of the command lines the drain writes down.

A GPU holder is named with its command line (eagle3flow/ops/drain/gpu_holders.py) in
messages, the session, the downtime records and the report; a vLLM server or a job
started as ``vllm serve ... --api-key sk-...`` would leak its key there. Replaced by
``***``: the value of a flag or an environment-style ``NAME=VALUE`` whose name says key,
token, secret, password or credential (``--api-key``, ``--hf-token=``, ``HF_TOKEN=``,
``DB_PASSWORD=``; counts of tokens and tokenizer paths are no secrets), the password of a
``user:password@`` URL, and a ``Bearer`` token.
"""
from __future__ import annotations

import re

MASK = "***"
_SECRET_WORD = re.compile(r"key|token|secret|passw|credential", re.IGNORECASE)
_NOT_SECRET = {"tokens", "tokenizer", "tokenize", "tokenization", "keys"}
_FLAG_EQUALS = re.compile(r"(?<!\S)(--?[A-Za-z][\w.-]*)=(\S+)")
# A value after a space never starts with "-": that is the next flag (--use-token-cache --model m).
_FLAG_VALUE = re.compile(r"(?<!\S)(--?[A-Za-z][\w.-]*)(\s+)(?!-)(\S+)")
_ENV = re.compile(r"(?<![\w.-])([A-Za-z_][A-Za-z0-9_]*)=(\S+)")
_URL_PASSWORD = re.compile(r"\b([A-Za-z][A-Za-z0-9+.-]*://[^\s/:@]*):[^\s/@]+@")
_BEARER = re.compile(r"\b(bearer)\s+\S+", re.IGNORECASE)


def secret_name(name: str) -> bool:
    """Whether a flag or variable name says its value is a secret."""
    words = re.split(r"[-_.]+", name.strip("-").lower())
    return any(_SECRET_WORD.search(word) and word not in _NOT_SECRET for word in words)


def redact(text: str) -> str:
    """``text`` (a command line, a message) with the values of secrets masked."""
    text = _FLAG_EQUALS.sub(lambda m: f"{m[1]}={MASK}" if secret_name(m[1]) else m[0], text)
    text = _FLAG_VALUE.sub(lambda m: f"{m[1]}{m[2]}{MASK}" if secret_name(m[1]) else m[0], text)
    text = _ENV.sub(lambda m: f"{m[1]}={MASK}" if secret_name(m[1]) else m[0], text)
    text = _URL_PASSWORD.sub(rf"\1:{MASK}@", text)
    return _BEARER.sub(rf"\1 {MASK}", text)
