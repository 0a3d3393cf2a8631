"""Reading JSONL with errors that name the file and line."""
from __future__ import annotations

import json
import os
from collections.abc import Iterator


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
