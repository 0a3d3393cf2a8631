"""Shared fixtures: small random targets made offline, in seconds."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SHARED = REPO.parent / "shared"
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).parent))


@pytest.fixture(scope="session")
def random_llama_target(tmp_path_factory) -> Path:
    """A random 8-layer LlamaForCausalLM (H=64, head_dim 32, vocab 512) saved as an HF dir (no tokenizer)."""
    from helpers import make_random_llama
    return make_random_llama(tmp_path_factory.mktemp("random_llama"))


@pytest.fixture(scope="session")
def embedded_default_build(tmp_path_factory) -> Path:
    """The embedded default build (``python -m eagle3flow.embedded.build``: target/,
    conversations.jsonl, build_stats.json; minutes), made once per session and shared:
    copy from it, never write into it. EAGLE3FLOW_EMBEDDED_DIR reuses an existing one."""
    existing = os.environ.get("EAGLE3FLOW_EMBEDDED_DIR")
    if existing:
        return Path(existing)
    out = tmp_path_factory.mktemp("embedded_default")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
    result = subprocess.run([sys.executable, "-m", "eagle3flow.embedded.build", "--out-dir", str(out)],
                            cwd=REPO, env=env, capture_output=True, text=True, timeout=1800)
    assert result.returncode == 0, f"embedded build failed:\n{result.stderr[-4000:]}"
    return out


def pytest_terminal_summary(terminalreporter):
    """CI's log shows the fault matrix (tests/test_fault_matrix.py writes it) when it ran."""
    matrix = sys.modules.get("test_fault_matrix")
    if matrix is not None and (matrix.ROWS or matrix.DRY_ROWS):
        terminalreporter.write_sep("=", "fault matrix (tests/fault_matrix.md)")
        terminalreporter.write_line(matrix.render(matrix.ROWS, matrix.DRY_ROWS))
