"""Shared fixtures: small random targets made offline, in seconds."""
from __future__ import annotations

import os
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
