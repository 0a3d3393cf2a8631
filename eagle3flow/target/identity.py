"""The target's identity: what tells, without reading its weights, that a target directory
still holds the model the finished stages were made from.

Per file of the directory (recursively; hidden files and folders, and documentation
and images, left out: a model card edit must not re-drain production):

* a safetensors file: its size, its mtime (ns) and the sha256 of its whole header
  (every tensor's name, dtype, shape and offsets, and the metadata);
* any other file up to ``HASHED_MAX_BYTES`` (config, index, tokenizer, chat template,
  the target's own code): its size and the sha256 of its content;
* any larger one (a ``.bin`` or ``.pth`` checkpoint): its size and mtime.

Never a hash of the weights' data: that is ~10 minutes of reading on a 595 GB target,
and this identity is taken every time the workflow is read. The headers are a few MB
even for Kimi-K2.5's 64 shards (~200k tensors), read in well under a second.

What it sees: any new or retrained checkpoint written into the directory (new files get
new mtimes, whatever bytes they hold), a file added, removed or resized, a changed
header, config or tokenizer. What it cannot see: a data region rewritten in place with
the file's size, header and mtime all kept (``touch -r``/``os.utime`` putting the old
time back). And a copy of the same weights with new mtimes (``cp -r`` without ``-p``)
counts as a new target: a copy keeping mtimes (``cp -a``, ``rsync -a``) does not.
docs/formats.md ("The target's identity") says the same for users.

The workflow writes it to ``results/target/identity.json`` when it is read (only when its
content changed, so an unchanged target keeps the file's mtime and reruns nothing;
rules/common.smk), and every stage whose output depends on the target takes that file as
an input. The stages also put :func:`identity_digest` into their cache keys (hidden
states, training runs, regenerated answers of a server serving this directory), so a
stage that reruns for a new target never reuses the old target's work.
"""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from eagle3flow.atomic import write_json

IDENTITY_VERSION = 1
# Files no stage reads: their edits must not rerun anything.
SKIPPED_SUFFIXES = (".md", ".png", ".jpg", ".jpeg", ".gif", ".svg", ".pdf")
# Non-safetensors files up to this size are hashed whole (a tokenizer.json is ~10 MB).
HASHED_MAX_BYTES = 64 << 20
# safetensors caps its header at 100 MB; a larger "length" is not a safetensors file.
HEADER_MAX_BYTES = 100 << 20
READ_CHUNK = 1 << 20


def _sha256(f, length: int | None) -> str:
    digest, left = hashlib.sha256(), length
    while left is None or left > 0:
        chunk = f.read(READ_CHUNK if left is None else min(READ_CHUNK, left))
        if not chunk:
            break
        digest.update(chunk)
        if left is not None:
            left -= len(chunk)
    return digest.hexdigest()


def file_identity(path: Path) -> dict:
    """One file's entry (see the module's docstring); a file that cannot be read gets its
    error instead: the workflow is read on, and the preflight or the stage names the problem."""
    try:
        return _file_identity(path)
    except OSError as error:
        return {"unreadable": error.strerror or str(error)}


def _file_identity(path: Path) -> dict:
    st = path.stat()
    if path.name.endswith(".safetensors"):
        with open(path, "rb") as f:
            head = f.read(8)
            length = int.from_bytes(head, "little") if len(head) == 8 else 0
            if 0 < length <= min(st.st_size - 8, HEADER_MAX_BYTES):
                return {"bytes": st.st_size, "mtime_ns": st.st_mtime_ns, "header_sha256": _sha256(f, length)}
        # not a safetensors file (cut short, say): size and mtime; the preflight names it
        return {"bytes": st.st_size, "mtime_ns": st.st_mtime_ns}
    if st.st_size <= HASHED_MAX_BYTES:
        with open(path, "rb") as f:
            return {"bytes": st.st_size, "sha256": _sha256(f, None)}
    return {"bytes": st.st_size, "mtime_ns": st.st_mtime_ns}


def identity_files(target: Path) -> list[Path]:
    """The files the identity covers, sorted. Links to files are followed, as the loaders
    follow them (a Hub cache snapshot is a folder of links); linked folders are not (no loop)."""
    target = Path(target)
    found = []
    for root, dirs, files in os.walk(target):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        for name in files:
            if name.startswith(".") or name.lower().endswith(SKIPPED_SUFFIXES):
                continue
            path = Path(root) / name
            if path.is_file():          # a broken link is no file a stage reads
                found.append(path)
    return sorted(found, key=lambda p: p.relative_to(target).as_posix())


def target_identity(target: str | Path) -> dict:
    """``{"version", "files": {relative path: entry}}`` of a target directory. Its path is
    left out: the same checkpoint moved or copied (mtimes kept) is the same target."""
    target = Path(target)
    return {"version": IDENTITY_VERSION,
            "files": {p.relative_to(target).as_posix(): file_identity(p) for p in identity_files(target)}}


def identity_digest(identity: dict) -> str:
    """A short key of an identity, for cache keys."""
    return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:20]


def target_digest(target: str | Path) -> str:
    return identity_digest(target_identity(target))


def without_weights(identity: dict) -> dict:
    """The identity less the weight files (safetensors and files too large to hash): the
    config, tokenizer, chat template and code, all that a stage reading no weight (the
    dataset, the vocab map) depends on, so that new weights do not rerun it."""
    return {**identity, "files": {name: entry for name, entry in identity["files"].items()
                                  if "mtime_ns" not in entry}}


def _write_if_changed(out: Path, obj: dict) -> bool:
    try:
        with open(out) as f:
            if json.load(f) == obj:
                return False
    except (OSError, ValueError):
        pass
    out.parent.mkdir(parents=True, exist_ok=True)
    write_json(out, obj)
    return True


def write_identity(target: str | Path, out: str | Path, config_out: str | Path | None = None) -> bool:
    """Write the target's identity to ``out`` (and :func:`without_weights` of it to
    ``config_out``) when it differs from what the file holds; leave the file untouched
    otherwise (its mtime is what Snakemake compares: an unchanged target must rerun
    nothing). Returns whether ``out`` was written."""
    identity = target_identity(target)
    if config_out is not None:
        _write_if_changed(Path(config_out), without_weights(identity))
    return _write_if_changed(Path(out), identity)
