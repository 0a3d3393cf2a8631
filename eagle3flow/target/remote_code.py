"""Whether a target ships Python code that loading it runs, and the one refusal when it does.

transformers (and vLLM, which loads the config and tokenizer through it) runs code from the
target's directory only for what ``auto_map`` names in its ``config.json`` or
``tokenizer_config.json`` (Kimi-K2.5: its config and its tiktoken tokenizer). Such a target
loads only with ``trust_remote_code=True``, which the workflow passes from
``target.trust_remote_code``. Reading JSON only (no torch, no transformers): the preflight
asks before any drain, and every loader asks again before it calls transformers, so a
refusal names the config key and the file instead of transformers' own hint to pass an
argument the user cannot pass.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

KEY = "target.trust_remote_code"
# The files transformers reads auto_map from when it loads a config, a model or a tokenizer.
DECLARING_FILES = ("config.json", "tokenizer_config.json")


class RemoteCodeRefused(ValueError):
    """The target needs its own code run, and target.trust_remote_code is false."""


def remote_code_files(target_dir: str | os.PathLike) -> dict[str, list[str]]:
    """``{file: the auto_map entries it declares}`` for each of the target's files that makes
    transformers run the target's own code (none: ``{}``). An unreadable file declares
    nothing here: whoever loads it reports it."""
    found = {}
    for name in DECLARING_FILES:
        path = Path(target_dir) / name
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        auto_map = data.get("auto_map") if isinstance(data, dict) else None
        if auto_map:
            found[str(path)] = sorted(auto_map) if isinstance(auto_map, dict) else [str(auto_map)]
    return found


def refusal(target_dir: str | os.PathLike, files: dict[str, list[str]] | None = None,
            detail: str = "") -> RemoteCodeRefused:
    """The error for a target that needs its own code while the key is off."""
    files = remote_code_files(target_dir) if files is None else files
    where = "; ".join(f"{path} declares auto_map {entries}" for path, entries in files.items()) \
        or f"{target_dir} needs its own code to load{': ' + detail if detail else ''}"
    return RemoteCodeRefused(
        f"{where}: loading this target runs Python code from its directory, and {KEY} is false. "
        f"If you trust that code, set {KEY}: true (e.g. --config \"target={{trust_remote_code: true}}\").")


def check_remote_code(target_dir: str | os.PathLike, trust_remote_code: bool) -> None:
    """Raise :class:`RemoteCodeRefused` when the target declares its own code and it is not trusted."""
    if trust_remote_code:
        return
    files = remote_code_files(target_dir)
    if files:
        raise refusal(target_dir, files)


def is_transformers_refusal(error: BaseException) -> bool:
    """transformers' own refusal of code it was not allowed to run (a ValueError naming the
    argument), e.g. for an auto_map this module does not read."""
    return isinstance(error, ValueError) and "trust_remote_code" in str(error)
