"""The one atomic writer: whole files only, and the permissions a plain open() gives."""
from __future__ import annotations

import os
import stat

import pytest
import torch
from safetensors.torch import save_file

from eagle3flow import atomic


def mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def test_replacing_gives_the_umask_permissions_even_to_0600_writers(tmp_path):
    """safetensors creates 0600 files; the exported draft must stay readable by a vLLM
    unit that runs as another user."""
    old = os.umask(0o022)
    try:
        with atomic.replacing(tmp_path / "model.safetensors") as tmp:
            save_file({"w": torch.zeros(2)}, str(tmp))
        atomic.write_json(tmp_path / "config.json", {"a": 1})
        os.umask(0o027)
        atomic.write_text(tmp_path / "strict.txt", "x")
    finally:
        os.umask(old)
    assert mode(tmp_path / "model.safetensors") == 0o644
    assert mode(tmp_path / "config.json") == 0o644
    assert mode(tmp_path / "strict.txt") == 0o640


def test_a_failed_write_leaves_the_old_file_and_no_temporary(tmp_path):
    target = tmp_path / "stats.json"
    atomic.write_json(target, {"version": 1})
    with pytest.raises(RuntimeError):
        with atomic.replacing(target) as tmp:
            tmp.write_text("{\"version\": 2")
            raise RuntimeError("killed mid-write")
    assert target.read_text() == atomic.json.dumps({"version": 1}, indent=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["stats.json"]
