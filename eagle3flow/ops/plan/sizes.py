"""Bytes on disk: the apparent size of a tree, free space, and byte counts as people
write them (``500GB``, ``1.5 TiB``). No torch: the plan and the disk sampler use it
when the workflow is read."""
from __future__ import annotations

import os
import re
import shutil
from pathlib import Path


def tree_bytes(path: str | os.PathLike) -> int:
    """Apparent size of every regular file under ``path`` (``du -sb``), 0 if missing.

    Files vanishing while walked (a shard renamed, a checkpoint deleted) are skipped.
    """
    total, stack = 0, [str(path)]
    while stack:
        top = stack.pop()
        try:
            entries = list(os.scandir(top))
        except (FileNotFoundError, NotADirectoryError, PermissionError):
            try:
                st = os.stat(top)
                total += st.st_size if os.path.isfile(top) else 0
            except OSError:
                pass
            continue
        for entry in entries:
            try:
                if entry.is_dir(follow_symlinks=False):
                    stack.append(entry.path)
                elif entry.is_file(follow_symlinks=False):
                    total += entry.stat(follow_symlinks=False).st_size
            except OSError:
                pass
    return total


def newest_subdirs_bytes(path: Path, count: int) -> int:
    """Bytes of the ``count`` most recently modified subdirectories (this run's
    fingerprints, when it resumes or reruns unchanged)."""
    try:
        subdirs = sorted((p for p in path.iterdir() if p.is_dir()), key=lambda p: p.stat().st_mtime)
    except OSError:
        return 0
    return sum(tree_bytes(p) for p in subdirs[-count:])


def free_bytes(path: Path) -> int:
    """Free bytes on the filesystem that holds ``path`` (or its nearest existing parent)."""
    path = path.resolve()
    while not path.exists():
        path = path.parent
    return shutil.disk_usage(path).free


def format_bytes(n: float | None) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KB", "MB", "GB", "TB", "PB"):
        if abs(n) < 1000 or unit == "PB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} PB"


def parse_bytes(value) -> int | None:
    """``123``, ``"500GB"``, ``"1.5 TiB"`` -> bytes; None stays None."""
    if value is None or isinstance(value, int):
        return value
    m = re.fullmatch(r"\s*([0-9.]+)\s*([kmgtpKMGTP]?)(i?)[bB]?\s*", str(value))
    if not m:
        raise ValueError(f"storage: cannot read {value!r} as a size (e.g. 500GB, 1.5TiB, 1000000)")
    base = 1024 if m.group(3) else 1000
    return int(float(m.group(1)) * base ** " KMGTP".index(m.group(2).upper() or " "))

