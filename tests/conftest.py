"""Shared fixtures: small random targets made offline, in seconds; the embedded default
build; the drain tests' workflow with its CPU stages done. Builders are in tests/support/."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from support.box import FakeBox, run_snakemake, snakemake_args, tiny_config
from support.targets import make_random_llama
from support.workflow import workflow_copy

REPO = Path(__file__).resolve().parent.parent
SHARED = REPO.parent / "shared"
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).parent))


@pytest.fixture(scope="session")
def random_llama_target(tmp_path_factory) -> Path:
    """A random 8-layer LlamaForCausalLM (H=64, head_dim 32, vocab 512) saved as an HF dir (no tokenizer)."""
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


@pytest.fixture(scope="module")
def upstream(tmp_path_factory) -> Path:
    """The drain tests' (test_drain, test_fault_matrix) workflow copy with the CPU stages
    before extraction done (drain on). Running them never touches the service: no GPU
    stage had to run."""
    root = tmp_path_factory.mktemp("upstream")
    box = FakeBox(root / "box")
    workdir = workflow_copy(root / "wf")
    config = tiny_config(box, root / "tiny.json")
    result = run_snakemake(box, workdir, "results/dataset/train.parquet",
                           "results/vocab/vocab_map.safetensors", *snakemake_args(workdir, config))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert not (box.systemd / "calls.log").exists(), "a CPU-only run touched the service"
    return workdir


def pytest_terminal_summary(terminalreporter):
    """CI's log shows the fault matrix (tests/test_fault_matrix.py writes it) when it ran."""
    matrix = sys.modules.get("test_fault_matrix")
    if matrix is not None and (matrix.ROWS or matrix.DRY_ROWS):
        terminalreporter.write_sep("=", "fault matrix (tests/fault_matrix.md)")
        terminalreporter.write_line(matrix.render(matrix.ROWS, matrix.DRY_ROWS))
