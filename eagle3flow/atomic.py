"""Writing a file so that readers see the old one or the whole new one, never a part.

The one home of atomic writes: every stage's outputs, manifests and markers go through
:func:`replacing`. A crash (SIGKILL, node loss) mid-write leaves a hidden temporary
sibling and the previous file untouched; the new content is on disk (fsynced) before it
takes the final name, so a manifest never names data a power loss could still take back.
A signal that ends the writer (SIGTERM's default action, SIGKILL) runs no cleanup, so
the stages that write large files (shards, checkpoints) remove what dead writers of
this host left in their folder when they start: :func:`sweep_stale_temporaries`.
Torch-free, so the planner and the ops code may use it.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import socket
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from eagle3flow.procfs import pid_alive


def temporary_sibling(path: Path) -> Path:
    """A hidden name next to ``path`` that no other process writes (hosts share caches)."""
    return path.with_name(f".{path.name}.tmp-{socket.gethostname()}-{os.getpid()}")


def sweep_stale_temporaries(directory: str | os.PathLike) -> list[tuple[Path, int]]:
    """Remove the temporary siblings (:func:`temporary_sibling`) in ``directory`` whose
    writer was a process of this host that no longer exists: it was killed mid-write
    (a shard or a checkpoint can be GBs, counted against the storage budget). Those of
    live processes, and of other hosts sharing the folder, stay. Returns (path, bytes)
    of each one removed."""
    directory = Path(directory)
    pattern = re.compile(r"\..+\.tmp-" + re.escape(socket.gethostname()) + r"-(\d+)")
    removed = []
    for path in sorted(directory.iterdir()) if directory.is_dir() else []:
        match = pattern.fullmatch(path.name)
        if not match or pid_alive(int(match.group(1))):
            continue
        try:
            if path.is_dir() and not path.is_symlink():
                size = sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
                shutil.rmtree(path)
            else:
                size = path.stat().st_size
                path.unlink()
        except FileNotFoundError:   # another process swept it first
            continue
        removed.append((path, size))
    return removed


def sync_directory(path: str | os.PathLike) -> None:
    """fsync a folder: a rename into it is on disk once this returns."""
    _fsync(Path(path), directory=True)


def _process_umask() -> int:
    """The umask, read without changing it (``os.umask`` sets it, racing other threads)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except OSError:
        pass
    return 0o022


def _fsync(path: Path, directory: bool = False) -> None:
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECTORY if directory else 0))
    try:
        os.fsync(fd)
    except OSError:   # some file systems refuse fsync on a directory
        if not directory:
            raise
    finally:
        os.close(fd)


@contextmanager
def replacing(path: str | os.PathLike) -> Iterator[Path]:
    """Yields a temporary path to write ``path``'s new content to; on a clean exit it is
    synced and renamed over ``path``, on an error removed (``path`` stays as it was)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = temporary_sibling(path)
    try:
        yield tmp
        # The permissions a plain open() gives: some writers (safetensors) create 0600
        # files, which a vLLM unit running as another user could not read.
        os.chmod(tmp, 0o666 & ~_process_umask())
        _fsync(tmp)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync(path.parent, directory=True)


def write_text(path: str | os.PathLike, text: str) -> None:
    with replacing(path) as tmp:
        tmp.write_text(text, encoding="utf-8")


def write_json(path: str | os.PathLike, obj, indent: int | None = 2) -> None:
    write_text(path, json.dumps(obj, indent=indent))


def write_jsonl(path: str | os.PathLike, rows, **dumps_options) -> int:
    """One JSON object per line; returns the number of rows written."""
    count = 0
    with replacing(path) as tmp, open(tmp, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False, **dumps_options) + "\n")
            count += 1
    return count
