"""Reading JSONL with errors that name the file and line; joining JSONL files."""
from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

from eagle3flow.atomic import write_text


def iter_jsonl(path: str | os.PathLike) -> Iterator[tuple[str, object]]:
    """Yield ``("path:line", row)`` for each non-blank line; a line that is not JSON
    raises ``ValueError`` naming its place."""
    with open(path, encoding="utf-8") as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path}:{line_no}"
            try:
                yield where, json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{where}: not JSON ({e})") from None


def concat_jsonl(sources: list[str | os.PathLike], out: str | os.PathLike) -> None:
    """Write the non-blank lines of ``sources`` (missing files skipped), in order, to
    ``out`` atomically."""
    lines = []
    for src in sources:
        if Path(src).is_file():
            lines.extend(line for line in Path(src).read_text().splitlines() if line.strip())
    write_text(out, "".join(line + "\n" for line in lines))
