"""The one layer-id convention of this project, and conversions at its boundary.

Convention (the same as vLLM's top-level ``eagle_aux_hidden_state_layer_ids``):
layer id ``k`` names the hidden state that *enters* decoder layer ``k``, which is
HF transformers' ``outputs.hidden_states[k]`` (index 0 = the token embeddings).
Valid ids for a target with ``N`` decoder layers are ``0 <= k <= N-1``.

SpecForge and the EAGLE-3 paper name the *output* of decoder layer ``i``; their
default ``[1, N//2-1, N-4]`` is ``[2, N//2, N-3]`` here. Convert with
:func:`from_layer_outputs` / :func:`to_layer_outputs`, never by hand.
"""
from __future__ import annotations


def default_aux_layer_ids(num_layers: int) -> list[int]:
    """EAGLE-3's choice (low, middle, high) in this project's convention: ``[2, N//2, N-3]``."""
    if num_layers < 4:
        raise ValueError(f"EAGLE-3 needs a target with at least 4 decoder layers, got {num_layers}")
    return [2, num_layers // 2, num_layers - 3]


def from_layer_outputs(output_layer_ids: list[int]) -> list[int]:
    """SpecForge/paper ids (output of layer i) -> this project's ids (input of layer i+1)."""
    return [int(i) + 1 for i in output_layer_ids]


def to_layer_outputs(layer_ids: list[int]) -> list[int]:
    """This project's ids (input of layer k) -> SpecForge/paper ids (output of layer k-1)."""
    return [int(k) - 1 for k in layer_ids]


def resolve_aux_layer_ids(configured: list[int] | None, num_layers: int) -> list[int]:
    """The configured ids (or the default), checked against the target's depth."""
    ids = default_aux_layer_ids(num_layers) if configured is None else [int(k) for k in configured]
    if not ids:
        raise ValueError("extract.aux_layer_ids is empty; EAGLE-3 needs at least one aux layer")
    bad = [k for k in ids if not 0 <= k <= num_layers - 1]
    if bad:
        raise ValueError(
            f"extract.aux_layer_ids {ids}: {bad} out of range for a target with {num_layers} "
            f"decoder layers (valid: 0..{num_layers - 1}, id k = input of decoder layer k)")
    if len(set(ids)) != len(ids):
        raise ValueError(f"extract.aux_layer_ids {ids} has duplicates")
    return ids
