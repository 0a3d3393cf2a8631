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


def test_sweep_removes_only_what_dead_writers_of_this_host_left(tmp_path):
    """A temporary file or folder of a writer that no longer exists goes; one of a live
    writer (it is still writing), of another host sharing the folder, or any other
    hidden file stays."""
    import socket
    import subprocess

    dead = subprocess.Popen(["true"])
    dead.wait()
    host = socket.gethostname()
    gone_file = tmp_path / f".shard-00001.safetensors.tmp-{host}-{dead.pid}"
    gone_file.write_bytes(b"x" * 10)
    gone_dir = tmp_path / f".step-00000004.tmp-{host}-{dead.pid}"
    gone_dir.mkdir()
    (gone_dir / "state.pt").write_bytes(b"y" * 7)
    kept = [tmp_path / f".shard-00002.safetensors.tmp-{host}-{os.getpid()}",
            tmp_path / f".shard-00003.safetensors.tmp-another-host-{dead.pid}", tmp_path / ".hidden"]
    for path in kept:
        path.write_text("z")
    removed = atomic.sweep_stale_temporaries(tmp_path)
    assert sorted(removed) == sorted([(gone_file, 10), (gone_dir, 7)])
    assert sorted(tmp_path.iterdir()) == sorted(kept)
