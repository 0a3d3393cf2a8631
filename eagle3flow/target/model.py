"""The target as a transformers causal LM, for the stages that run it in HF (the HF
extraction backend, the evaluation's replay and its losslessness judge).

A plain causal LM loads as it is. A multimodal wrapper (Kimi-K2.5:
``KimiK25ForConditionalGeneration``, its DeepSeek-V3 language model under
``text_config`` and its weights under ``language_model.*``) loads as that language model
alone: the text config as its config class gives it (transformers' own for
``model_type`` ``kimi_k25``, or the target's code with ``trust_remote_code``), the
causal-LM class transformers has for it (DeepSeek-V3's for Kimi's ``kimi_k2``), and
only the language model's tensors, renamed from the checkpoint's prefix. Every stage
reads text through that language model only (the vision tower never runs on text), so
no code of the wrapper's own modeling file is needed, which the hub ships as remote
code transformers cannot load without it.
"""
from __future__ import annotations

import logging
import os
import re
from contextlib import contextmanager

import torch

from eagle3flow.target.config import is_wrapper, read_config_file
from eagle3flow.target.remote_code import check_remote_code
from eagle3flow.target.weights import tensor_locations

# A wrapper's checkpoint prefix of its language model -> the plain causal LM's names
# (`language_model.model.layers.0...` -> `model.layers.0...`, `language_model.lm_head`
# -> `lm_head`), as the hub's Kimi-K2.5 and as transformers' own wrappers name them.
LANGUAGE_MODEL_PREFIXES = {"language_model.": "", "model.language_model.": "model."}


def load_target_model(target_path: str | os.PathLike, dtype: torch.dtype, device: torch.device,
                      trust_remote_code: bool = False):
    """The target's causal LM in ``dtype`` on ``device``, in eval mode (module docstring)."""
    # transformers takes seconds to import: only when a model is loaded.
    from transformers import AutoModelForCausalLM

    check_remote_code(target_path, trust_remote_code)
    if is_wrapper(read_config_file(target_path)):
        model = load_language_model(target_path, dtype, trust_remote_code)
    else:
        # False, never transformers' default None: that asks on stdin, which a job has not.
        model = AutoModelForCausalLM.from_pretrained(str(target_path), dtype=dtype,
                                                     trust_remote_code=bool(trust_remote_code))
    return model.to(device).eval()


def load_language_model(target_path: str | os.PathLike, dtype: torch.dtype, trust_remote_code: bool = False):
    """A wrapper target's language model as a transformers causal LM (on the CPU)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    text = AutoConfig.from_pretrained(str(target_path), trust_remote_code=bool(trust_remote_code)
                                      ).get_text_config()
    names = list(tensor_locations(target_path))
    prefix = next((p for p in sorted(LANGUAGE_MODEL_PREFIXES, key=len, reverse=True)
                   if any(n.startswith(p) for n in names)), None)
    if prefix is None:
        raise ValueError(f"{target_path}: config.json nests a text_config, but no weight is named as a "
                         f"language model's under {sorted(LANGUAGE_MODEL_PREFIXES)}")
    with quiet_load_report():   # the other towers' tensors are left out on purpose
        model, info = AutoModelForCausalLM.from_pretrained(
            str(target_path), config=text, dtype=dtype, output_loading_info=True,
            key_mapping={"^" + re.escape(prefix): LANGUAGE_MODEL_PREFIXES[prefix]})
    missing = sorted(info.get("missing_keys") or [])
    if missing:
        raise ValueError(f"{target_path}: the language model's tensors {missing[:8]}"
                         f"{' ...' if len(missing) > 8 else ''} are not in its weights (under {prefix!r})")
    return model


@contextmanager
def quiet_load_report():
    """transformers' load report (a table of every tensor it did not take) off for a while."""
    logger = logging.getLogger("transformers.modeling_utils")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)
