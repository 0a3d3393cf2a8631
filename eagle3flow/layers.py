"""The one layer-id convention of this project, and conversions at its boundary.

Convention (the same as vLLM's top-level ``eagle_aux_hidden_state_layer_ids``):
layer id ``k`` names the hidden state that *enters* decoder layer ``k``, which is
HF transformers' ``outputs.hidden_states[k]`` (index 0 = the token embeddings).
Valid ids for a target with ``N`` decoder layers are ``0 <= k <= N-1``.

SpecForge and the EAGLE-3 paper name the *output* of decoder layer ``i``; their
default ``[1, N//2-1, N-4]`` is ``[2, N//2, N-3]`` here. Convert with
:func:`from_layer_outputs` / :func:`to_layer_outputs`, never by hand.

Order: vLLM hands the aux states to the draft in ascending layer order, whatever order
the config lists them in, so the draft's ``fc`` must be trained on them in that order:
ids are sorted (and deduplicated) where they enter, at config time
(:func:`normalize_aux_layer_ids`), with a notice when that changed them.
"""
from __future__ import annotations

import sys


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


def normalize_aux_layer_ids(configured: list[int] | None, num_layers: int | None = None,
                            ) -> tuple[list[int] | None, str | None]:
    """``(ids, notice)``: the configured ids sorted ascending and deduplicated (what vLLM
    feeds the draft), and a notice when that changed them; None stays None (the default,
    already ascending). Refuses an empty list, and ids out of range when ``num_layers``
    (the target's decoder layers) is known."""
    if configured is None:
        return None, None
    given = [int(k) for k in configured]
    if not given:
        raise ValueError("extract.aux_layer_ids is empty; EAGLE-3 needs at least one aux layer")
    bad = [k for k in given if k < 0 or (num_layers is not None and k > num_layers - 1)]
    if bad:
        valid = f"0..{num_layers - 1}" if num_layers is not None else ">= 0"
        raise ValueError(
            f"extract.aux_layer_ids {given}: {bad} out of range"
            + (f" for a target with {num_layers} decoder layers" if num_layers is not None else "")
            + f" (valid: {valid}, id k = input of decoder layer k)")
    ids = sorted(set(given))
    notice = None
    if ids != given:
        notice = (f"extract.aux_layer_ids {given} -> {ids}: vLLM feeds the draft the aux states in "
                  "ascending layer order (and each layer once), so the draft is trained on them in that "
                  "order")
    return ids, notice


def default_dflash_layer_ids(num_layers: int, num_draft_layers: int) -> list[int]:
    """The DFlash paper's choice in this project's convention: as many target layers as
    draft layers, spread evenly over the outputs of layers ``1..N-3`` (one draft layer:
    the middle layer's output), i.e. ids in ``2..N-2``."""
    if num_layers < 4:
        raise ValueError(f"DFlash needs a target with at least 4 decoder layers, got {num_layers}")
    if num_draft_layers == 1:
        return from_layer_outputs([num_layers // 2])
    start, end = 1, num_layers - 3
    outputs = [round(start + i * (end - start) / (num_draft_layers - 1)) for i in range(num_draft_layers)]
    return from_layer_outputs(sorted(set(outputs)))


def default_layer_ids(num_layers: int, method: str = "eagle3", dflash_layers: int = 1) -> list[int]:
    """The default target layers of a draft of ``method`` (``train.method``)."""
    if method == "dflash":
        return default_dflash_layer_ids(num_layers, dflash_layers)
    return default_aux_layer_ids(num_layers)


def resolve_aux_layer_ids(configured: list[int] | None, num_layers: int, method: str = "eagle3",
                          dflash_layers: int = 1) -> list[int]:
    """The configured ids (or the default of the draft ``method``, :func:`default_layer_ids`)
    normalized (sorted, deduplicated, with a notice on stderr when that changed them) and
    checked against the target's depth."""
    if configured is None:
        return default_layer_ids(num_layers, method, dflash_layers)
    ids, notice = normalize_aux_layer_ids(configured, num_layers)
    if notice:
        print(f"layers: {notice}", file=sys.stderr, flush=True)
    return ids
