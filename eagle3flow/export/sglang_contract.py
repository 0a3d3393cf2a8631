"""What SGLang's EAGLE-3 loader needs of an exported draft, checked without SGLang.

SGLang's CPU build does not install here, so its loader contract is written down from
its source (sglang 0.5.23, python/sglang/srt/models/llama_eagle3.py, the draft worker
and spec_aux_hidden_state.py) and held against every export (export.py prints what
fails; the model card says which engines serve the draft as trained):

* ``architectures`` names ``LlamaForCausalLMEagle3`` (the only Llama EAGLE-3 class it
  registers; MLA drafts go through its Kimi/DeepSeek EAGLE-3 class);
* ``draft_vocab_size`` is a key (it reads it unconditionally);
* ``eagle_config.eagle_aux_hidden_state_layer_ids`` lists the aux layers as outputs of
  layer i (it captures layer i+1's input; -1 = the embeddings, from 0.5.23): without it,
  SGLang captures its own default layers and serves the draft wrongly, with no error;
* weights named ``midlayer.*`` (or ``layers.0.*``), ``fc``, ``norm``, ``lm_head``, ``d2t``
  (offsets, as here), ``input_norm`` / ``fc_norm.*``; it drops unknown names silently and
  never reports a missing one;
* ``norm_before_residual`` is not implemented (read nowhere): such a draft loads and
  computes something else;
* ``hidden_act`` silu, ``tie_word_embeddings`` false, a context at least the target's.
"""
from __future__ import annotations

from eagle3flow.layers import to_layer_outputs

ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3DeepseekV2ForCausalLM")
WEIGHT_PREFIXES = ("midlayer.", "layers.0.", "fc.", "fc_norm.", "input_norm.", "norm.", "lm_head.")
MAPPING_TENSORS = ("d2t", "t2d")


def sglang_problems(config: dict, tensor_names: set[str], target_config: dict | None = None) -> list[str]:
    """Why SGLang would not serve this exported draft as it was trained (empty: it would)."""
    problems = []
    if (config.get("architectures") or [None])[0] not in ARCHITECTURES:
        problems.append(f"architectures {config.get('architectures')}: SGLang registers {list(ARCHITECTURES)}")
    if "draft_vocab_size" not in config:
        problems.append("no draft_vocab_size key (SGLang reads it unconditionally)")
    eagle = config.get("eagle_config") or {}
    expected = to_layer_outputs(config.get("eagle_aux_hidden_state_layer_ids") or [])
    if eagle.get("eagle_aux_hidden_state_layer_ids") != expected:
        problems.append(f"eagle_config.eagle_aux_hidden_state_layer_ids {eagle.get('eagle_aux_hidden_state_layer_ids')}"
                        f" != {expected}: SGLang would capture other layers than trained")
    if config.get("norm_before_residual"):
        problems.append("norm_before_residual: SGLang does not implement it (vLLM does)")
    if config.get("hidden_act", "silu") != "silu":
        problems.append(f"hidden_act {config.get('hidden_act')}: SGLang needs silu")
    if config.get("tie_word_embeddings"):
        problems.append("tie_word_embeddings: SGLang would replace the trained lm_head by the embeddings")
    unknown = sorted(n for n in tensor_names if n not in MAPPING_TENSORS and not n.startswith(WEIGHT_PREFIXES))
    if unknown:
        problems.append(f"tensors SGLang drops without a word: {unknown}")
    if target_config and int(config.get("max_position_embeddings") or 0) < int(
            target_config.get("max_position_embeddings") or 0):
        problems.append("a shorter context than the target's (SGLang refuses it)")
    return problems
