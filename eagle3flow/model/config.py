"""The draft's configuration: :class:`DraftConfig`, derived from a target's HF config
(Llama / Qwen3 / DeepSeek-V3 / Kimi-K2), read from and written to an exported draft's
``config.json`` (eagle3 and speculators formats), and the tensor names an exported
draft of a config holds. No torch: the planner and the export read it too."""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields

from eagle3flow.layers import to_layer_outputs
from eagle3flow.target.config import text_config

EXPORTED_PARAM_NAMES = (
    "midlayer.input_layernorm.weight", "midlayer.hidden_norm.weight",
    "midlayer.self_attn.q_proj.weight", "midlayer.self_attn.k_proj.weight",
    "midlayer.self_attn.v_proj.weight", "midlayer.self_attn.o_proj.weight",
    "midlayer.post_attention_layernorm.weight", "midlayer.mlp.gate_proj.weight",
    "midlayer.mlp.up_proj.weight", "midlayer.mlp.down_proj.weight",
    "fc.weight", "norm.weight", "lm_head.weight",
)
# Config flags of vLLM's LlamaForCausalLMEagle3 (llama_eagle3.py) this draft implements.
ARCHITECTURE_FLAGS = ("norm_before_fc", "norm_before_residual", "norm_output")
# A new draft's: an RMSNorm over the aux states before fc and the normed state fed to the
# next step each raised the quality benchmark's simulated acceptance length (the per-row
# mean) at K=7 from 1.66 to 1.94 and 2.04 (benchmarks/quality/README.md, ablations).
# norm_before_residual did as well, but SGLang ignores that flag (it would serve such a
# draft wrongly, with no error): it stays a train.draft override, for drafts served by
# vLLM only.
# An MLA draft (vLLM's deepseek_eagle3.py) has no input_norm: only the normed state fed
# to the next step carries over (fc_norm, its per-aux-state norm, is not measured yet).
ARCHITECTURES = ("llama", "mla")
DEFAULT_FLAGS = {"llama": {"norm_before_fc": True, "norm_before_residual": False, "norm_output": True},
                 "mla": {"norm_before_fc": False, "norm_before_residual": False, "norm_output": True}}
MLA_ATTENTION_NAMES = ("kv_a_proj_with_mqa", "kv_a_layernorm", "kv_b_proj", "o_proj")


def exported_param_names(cfg: "DraftConfig") -> tuple[str, ...]:
    """The tensors an exported draft of ``cfg`` holds (besides ``d2t``/``t2d``)."""
    names = EXPORTED_PARAM_NAMES
    if cfg.architecture == "mla":
        q = ("q_a_proj", "q_a_layernorm", "q_b_proj") if cfg.q_lora_rank else ("q_proj",)
        attention = tuple(f"midlayer.self_attn.{n}.weight" for n in q + MLA_ATTENTION_NAMES)
        names = tuple(n for n in names if not n.startswith("midlayer.self_attn.")) + attention
    if cfg.norm_before_fc:
        names += ("input_norm.weight",)
    if cfg.fc_norm:
        names += tuple(f"fc_norm.{i}.weight" for i in range(cfg.num_aux))
    return names


def check_override_keys(overrides: dict) -> None:
    """Refuse a ``train.draft`` key that names no draft config field (ValueError): the
    keys alone, when the workflow is read; their values and what the target allows are
    checked by :meth:`DraftConfig.from_target_config` (the preflight builds it)."""
    known = {f.name for f in fields(DraftConfig)} | {"architecture"}
    unknown = sorted(set(overrides or {}) - known)
    if unknown:
        raise ValueError(f"train.draft: {', '.join(map(repr, unknown))} is not a field of the draft config "
                         f"(eagle3flow/model/config.py DraftConfig; known: {', '.join(sorted(known))})")


@dataclass
class DraftConfig:
    hidden_size: int
    target_hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    vocab_size: int
    draft_vocab_size: int
    aux_layer_ids: list[int]
    rope_scaling: dict | None = None
    hidden_act: str = "silu"
    torch_dtype: str = "bfloat16"
    # vLLM's LlamaForCausalLMEagle3 variants (all off = the EAGLE-3 paper's layer):
    norm_before_fc: bool = False        # RMSNorm (input_norm) over the concatenated aux states before fc
    norm_before_residual: bool = False  # the residual is hidden_norm(h_in), not h_in
    norm_output: bool = False           # the next step is fed norm(h_out), not h_out
    fc_norm: bool = False               # one RMSNorm per aux state before fc (fc_norm.<i>)
    # The midlayer's attention: llama (GQA, LlamaForCausalLMEagle3) or mla (DeepSeek's
    # multi-head latent attention, vLLM's Eagle3DeepseekV2ForCausalLM); MLA's dims:
    architecture: str = "llama"
    q_lora_rank: int | None = None      # None: a plain q_proj
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0

    def __post_init__(self):
        if self.hidden_size != self.target_hidden_size:
            # vLLM shares the target's embed_tokens with the draft only when the widths
            # match, and the draft's input embeddings must have the draft's width.
            raise ValueError(f"draft hidden_size {self.hidden_size} must equal the target's "
                             f"hidden size {self.target_hidden_size} (vLLM shares the target's "
                             f"embeddings with the draft)")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_attention_heads {self.num_attention_heads} is not a multiple "
                             f"of num_key_value_heads {self.num_key_value_heads}")
        if self.hidden_act != "silu":
            raise ValueError(f"hidden_act {self.hidden_act!r}: only 'silu' is supported")
        if not 0 < self.draft_vocab_size <= self.vocab_size:
            raise ValueError(f"draft_vocab_size {self.draft_vocab_size} not in 1..{self.vocab_size}")
        self.aux_layer_ids = [int(k) for k in self.aux_layer_ids]
        if self.architecture not in ARCHITECTURES:
            raise ValueError(f"draft architecture {self.architecture!r} is not one of {ARCHITECTURES}")
        if self.norm_before_fc and self.fc_norm:
            raise ValueError("norm_before_fc and fc_norm both normalise the aux states: pick one")
        if self.architecture == "mla":
            if not (self.kv_lora_rank > 0 and self.qk_rope_head_dim > 0 and self.v_head_dim > 0):
                raise ValueError(f"an MLA draft needs kv_lora_rank, qk_rope_head_dim and v_head_dim > 0, got "
                                 f"{self.kv_lora_rank}, {self.qk_rope_head_dim}, {self.v_head_dim}")
            if self.qk_rope_head_dim % 2:
                raise ValueError(f"qk_rope_head_dim {self.qk_rope_head_dim} must be even")
            if self.norm_before_fc:
                # vLLM's deepseek_eagle3.py has no input_norm (it offers fc_norm instead)
                raise ValueError("vLLM's MLA EAGLE-3 draft has no norm_before_fc; use fc_norm")
            if self.num_key_value_heads != self.num_attention_heads:
                raise ValueError("an MLA draft attends every head to its own key and value: "
                                 "num_key_value_heads must equal num_attention_heads")

    @property
    def num_aux(self) -> int:
        return len(self.aux_layer_ids)

    def trainable_param_counts(self) -> dict[str, int]:
        """The trainable parameters of the draft this config builds (eagle3flow/model/draft.py;
        the embeddings are frozen), as the optimizers split them (train/optim.py uses_muon):
        ``matrices``, the 2-D weights but lm_head (fc and the decoder layer's projections, its
        attention reading ``2H``), and ``rest``, lm_head and every RMSNorm. Torch-free: the
        plan sizes checkpoints with it."""
        h = self.hidden_size
        norms = 4 * h + self.num_aux * self.target_hidden_size * (int(self.norm_before_fc) + int(self.fc_norm))
        if self.architecture == "mla":
            norms += (self.q_lora_rank or 0) + self.kv_lora_rank
        return {"matrices": sum(rows * cols for rows, cols in self.hidden_matrix_shapes()),
                "rest": norms + h * self.draft_vocab_size}

    def hidden_matrix_shapes(self) -> list[tuple[int, int]]:
        """``(out, in)`` of every 2-D trainable weight but lm_head, the draft's parameters
        (eagle3flow/model/draft.py) that train/optim.py's Muon steps; their sizes sum to
        :meth:`trainable_param_counts`'s ``matrices``. Torch-free: the plan counts Muon's
        Newton-Schulz products with it (eagle3flow/model/optimizer_flops.py)."""
        h, two_h, heads = self.hidden_size, 2 * self.hidden_size, self.num_attention_heads
        shapes = [(h, self.num_aux * self.target_hidden_size)]
        if self.architecture == "mla":
            qk = self.qk_nope_head_dim + self.qk_rope_head_dim
            shapes += ([(self.q_lora_rank, two_h), (heads * qk, self.q_lora_rank)] if self.q_lora_rank
                       else [(heads * qk, two_h)])
            shapes += [(self.kv_lora_rank + self.qk_rope_head_dim, two_h),
                       (heads * (self.qk_nope_head_dim + self.v_head_dim), self.kv_lora_rank),
                       (h, heads * self.v_head_dim)]
        else:
            q, kv = heads * self.head_dim, self.num_key_value_heads * self.head_dim
            shapes += [(q, two_h), (kv, two_h), (kv, two_h), (h, q)]
        return shapes + [(self.intermediate_size, h), (self.intermediate_size, h), (h, self.intermediate_size)]

    @classmethod
    def from_target_config(cls, target_config: dict, aux_layer_ids: list[int],
                           draft_vocab_size: int, overrides: dict | None = None) -> "DraftConfig":
        """Derive the draft's shape from a Llama / Qwen3 / DeepSeek-V3 / Kimi-K2 HF config dict
        (or a multimodal wrapper's ``text_config``).

        * Llama, Qwen3: the target's heads, KV heads, ``head_dim`` (Qwen3 sets it
          explicitly), FFN width and rope (incl. ``llama3`` / ``yarn`` scaling).
        * DeepSeek-V3 / Kimi-K2 (MLA, recognised by ``kv_lora_rank``): the draft is a plain
          Llama layer. MLA has no single head size (``qk_nope + qk_rope`` for scores,
          ``v_head_dim`` for values): use ``v_head_dim`` (128 in V3/K2) with the target's
          head count and as many KV heads (MLA attends every head to its own K/V), the
          dense FFN width ``intermediate_size`` (18432), i.e. the shape of the published
          Kimi-K2 EAGLE-3 drafts. The rope is the target's YaRN (``factor``,
          ``original_max_position_embeddings``, ``beta_*``) with its cos/sin scale written
          out as ``attention_factor``, which transformers (training) and vLLM's
          ``get_rope`` (serving) both read first, so both compute the same rotation.

        ``overrides`` replaces any field (``train.draft`` in config.yaml, e.g.
        ``{"intermediate_size": 1024}``), except ``hidden_size``, tied to the target.
        """
        cfg = text_config(target_config)
        hidden = int(cfg["hidden_size"])
        heads = int(cfg["num_attention_heads"])
        kv_heads = int(cfg.get("num_key_value_heads") or heads)
        is_mla = "kv_lora_rank" in cfg
        architecture = (overrides or {}).get("architecture", "auto")
        if architecture == "auto":
            architecture = "mla" if is_mla else "llama"
        if architecture == "mla" and not is_mla:
            raise ValueError("train.draft.architecture: mla needs an MLA target (DeepSeek-V2/V3, Kimi-K2): "
                             "its config has no kv_lora_rank to take the draft's MLA dims from")
        if is_mla:
            head_dim = int(cfg.get("v_head_dim") or hidden // heads)
        else:
            head_dim = int(cfg.get("head_dim") or hidden // heads)
        rope = dict(cfg.get("rope_parameters") or {})
        legacy = cfg.get("rope_scaling")
        if legacy and rope.get("rope_type", rope.get("type", "default")) == "default":
            rope.update(legacy)
        rope_theta = float(cfg.get("rope_theta") or rope.get("rope_theta") or 10000.0)
        rope.pop("rope_theta", None)
        if "type" in rope:
            rope["rope_type"] = rope.pop("type") if "rope_type" not in rope else rope["rope_type"]
            rope.pop("type", None)
        if architecture == "llama" and rope.get("rope_type") in ("yarn", "deepseek_yarn"):
            rope = yarn_rope_for_llama(rope, cfg)
        # An MLA draft keeps the target's rope as the target's config says it: vLLM builds
        # both with the same DeepSeek rotary (interleaved, YaRN with mscale).
        rope_scaling = rope if rope and rope.get("rope_type", "default") != "default" else None
        dtype = cfg.get("torch_dtype") or cfg.get("dtype") or target_config.get("torch_dtype") \
            or target_config.get("dtype") or "bfloat16"
        values = dict(
            hidden_size=hidden, target_hidden_size=hidden, num_attention_heads=heads,
            num_key_value_heads=kv_heads, head_dim=head_dim,
            intermediate_size=int(cfg["intermediate_size"]),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)), rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
            vocab_size=int(cfg["vocab_size"]), draft_vocab_size=int(draft_vocab_size),
            aux_layer_ids=list(aux_layer_ids), torch_dtype=str(dtype).replace("torch.", ""),
            architecture=architecture, **DEFAULT_FLAGS[architecture])
        if architecture == "mla":
            qk_nope, qk_rope = int(cfg["qk_nope_head_dim"]), int(cfg["qk_rope_head_dim"])
            values.update(num_key_value_heads=heads, head_dim=qk_nope + qk_rope,
                          q_lora_rank=int(cfg["q_lora_rank"]) if cfg.get("q_lora_rank") else None,
                          kv_lora_rank=int(cfg["kv_lora_rank"]), qk_nope_head_dim=qk_nope,
                          qk_rope_head_dim=qk_rope, v_head_dim=int(cfg["v_head_dim"]))
        for key, value in (overrides or {}).items():
            if key == "architecture":
                continue
            if key not in values and key not in ("hidden_act",) + ARCHITECTURE_FLAGS:
                raise ValueError(f"draft config override {key!r} is not a draft config field "
                                 f"(known: {sorted(values)})")
            if key == "hidden_size" and int(value) != hidden:
                raise ValueError(f"draft hidden_size override {value} != target hidden size "
                                 f"{hidden}: vLLM needs them equal")
            values[key] = value
        return cls(**values)

    @classmethod
    def from_hf_config(cls, hf: dict) -> "DraftConfig":
        """Inverse of :meth:`to_hf_config` (an exported draft's config.json)."""
        rope = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
        theta = float(hf.get("rope_theta") or rope.get("rope_theta") or 10000.0)
        rope.pop("rope_theta", None)
        scaling = rope if rope and rope.get("rope_type", rope.get("type", "default")) != "default" else None
        mla = {}
        if hf.get("model_type") in ("deepseek_v2", "deepseek_v3") or "kv_lora_rank" in hf:
            mla = dict(architecture="mla", q_lora_rank=hf.get("q_lora_rank"), kv_lora_rank=hf["kv_lora_rank"],
                       qk_nope_head_dim=hf["qk_nope_head_dim"], qk_rope_head_dim=hf["qk_rope_head_dim"],
                       v_head_dim=hf["v_head_dim"])
        return cls(hidden_size=hf["hidden_size"], target_hidden_size=hf.get("target_hidden_size", hf["hidden_size"]),
                   num_attention_heads=hf["num_attention_heads"],
                   num_key_value_heads=hf.get("num_key_value_heads", hf["num_attention_heads"]),
                   head_dim=(hf["qk_nope_head_dim"] + hf["qk_rope_head_dim"] if mla
                             else hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"]),
                   intermediate_size=hf["intermediate_size"], rms_norm_eps=hf["rms_norm_eps"],
                   rope_theta=theta, rope_scaling=scaling,
                   max_position_embeddings=hf["max_position_embeddings"], vocab_size=hf["vocab_size"],
                   draft_vocab_size=hf.get("draft_vocab_size", hf["vocab_size"]),
                   aux_layer_ids=hf["eagle_aux_hidden_state_layer_ids"],
                   hidden_act=hf.get("hidden_act", "silu"), torch_dtype=hf.get("torch_dtype", "bfloat16"),
                   **{flag: bool(hf.get(flag, False)) for flag in ARCHITECTURE_FLAGS + ("fc_norm",)}, **mla)

    @classmethod
    def from_speculators_config(cls, hf: dict) -> "DraftConfig":
        """A speculators-format draft's config.json (``speculators_model_type: eagle3``,
        its layer in ``transformer_layer_config``): speculators' own trainer writes these."""
        if hf.get("speculators_model_type") != "eagle3":
            raise ValueError(f"speculators_model_type {hf.get('speculators_model_type')!r}: only eagle3 drafts load")
        layer = dict(hf["transformer_layer_config"])
        if int(layer.get("num_hidden_layers", 1)) != 1:
            raise ValueError(f"a speculators draft of {layer['num_hidden_layers']} layers: one is supported")
        # vLLM reads an absent norm_before_residual as true (speculators' default), the rest as false
        flags = {flag: bool(hf.get(flag, flag == "norm_before_residual")) for flag in ARCHITECTURE_FLAGS + ("fc_norm",)}
        merged = {**layer, "target_hidden_size": hf.get("target_hidden_size") or layer["hidden_size"],
                  "draft_vocab_size": hf["draft_vocab_size"],
                  "eagle_aux_hidden_state_layer_ids": hf["eagle_aux_hidden_state_layer_ids"], **flags}
        return cls.from_hf_config(merged)

    def to_speculators_config(self, verifier: str, verifier_architectures: list[str],
                              speculative_tokens: int) -> dict:
        """The same draft as the speculators format's config.json: vLLM loads it natively
        (``vllm serve <draft>`` finds the verifier in it) and speculators reads it."""
        if self.architecture != "llama":
            raise ValueError("the speculators format has no MLA EAGLE-3 draft: export it as eagle3")
        layer = {k: v for k, v in self.to_hf_config().items()
                 if k not in ("architectures", "eagle_config", "draft_vocab_size", "target_hidden_size",
                              "eagle_aux_hidden_state_layer_ids", "num_aux_hidden_states") + ARCHITECTURE_FLAGS
                 + ("fc_norm",)}
        return {
            "architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3",
            "speculators_version": "0.9.0", "draft_vocab_size": self.draft_vocab_size,
            "target_hidden_size": self.target_hidden_size,
            "eagle_aux_hidden_state_layer_ids": list(self.aux_layer_ids),
            **{flag: bool(getattr(self, flag)) for flag in ARCHITECTURE_FLAGS + ("fc_norm",)},
            "tie_word_embeddings": False, "torch_dtype": self.torch_dtype, "transformer_layer_config": layer,
            "speculators_config": {
                "algorithm": "eagle3", "default_proposal_method": "greedy",
                "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": int(speculative_tokens)}],
                "verifier": {"name_or_path": verifier, "architectures": list(verifier_architectures)}},
        }

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "DraftConfig":
        return cls(**d)

    def _mla_hf_fields(self) -> dict:
        """What vLLM's Eagle3DeepseekV2ForCausalLM reads besides the common keys. The
        model_type must be deepseek_v2: vLLM turns a deepseek_v3 draft config into its MTP
        model. One dense layer, no MoE."""
        return {"architectures": ["Eagle3DeepseekV2ForCausalLM"], "model_type": "deepseek_v2",
                "q_lora_rank": self.q_lora_rank, "kv_lora_rank": self.kv_lora_rank,
                "qk_nope_head_dim": self.qk_nope_head_dim, "qk_rope_head_dim": self.qk_rope_head_dim,
                "v_head_dim": self.v_head_dim, "head_dim": self.qk_rope_head_dim}

    def rope_parameters(self) -> dict:
        """transformers-5 style ``rope_parameters`` (what vLLM's get_rope reads)."""
        params = {"rope_type": "default"}
        if self.rope_scaling:
            params.update(self.rope_scaling)
        params["rope_theta"] = self.rope_theta
        return params

    def to_hf_config(self) -> dict:
        """The exported ``config.json``: a 1-layer Llama that vLLM/SGLang load as EAGLE-3."""
        config = {
            "architectures": ["LlamaForCausalLMEagle3"],
            "model_type": "llama",
            "num_hidden_layers": 1,
            "hidden_size": self.hidden_size,
            "target_hidden_size": self.target_hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "hidden_act": self.hidden_act,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_parameters": self.rope_parameters(),
            "max_position_embeddings": self.max_position_embeddings,
            "vocab_size": self.vocab_size,
            "draft_vocab_size": self.draft_vocab_size,
            "attention_bias": False,
            "mlp_bias": False,
            "tie_word_embeddings": False,
            "torch_dtype": self.torch_dtype,
            # This project's convention == vLLM's top-level key (id k = input of layer k).
            "eagle_aux_hidden_state_layer_ids": list(self.aux_layer_ids),
        }
        for flag in ARCHITECTURE_FLAGS + ("fc_norm",):
            if getattr(self, flag):
                config[flag] = True
        # vLLM sizes fc from this (else from eagle_config's ids, else 3 aux states).
        config["num_aux_hidden_states"] = self.num_aux
        if self.architecture == "mla":
            config.update(self._mla_hf_fields())
        if self.rope_scaling:
            config["rope_scaling"] = dict(self.rope_scaling)
        # SGLang captures only what eagle_config names (without it, its own default layers,
        # silently), as "output of layer i" (it captures i+1): id 0, the embeddings, is its
        # -1 (SGLang 0.5.23 and newer). vLLM prefers the top-level key above.
        config["eagle_config"] = {
            "eagle_aux_hidden_state_layer_ids": to_layer_outputs(self.aux_layer_ids),
            "use_aux_hidden_state": True,
        }
        return config


def yarn_rope_for_llama(rope: dict, target: dict) -> dict:
    """A target's YaRN parameters (``yarn``, or DeepSeek's ``deepseek_yarn``) as a Llama
    draft's ``rope_scaling``: the frequency keys kept, the cos/sin magnitude scale made
    explicit as ``attention_factor`` (from ``mscale``/``mscale_all_dim`` the way
    transformers and vLLM derive it), so no reader has to infer it."""
    factor = float(rope["factor"])

    def get_mscale(scale: float, mscale: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0

    if rope.get("attention_factor") is not None:
        attention_factor = float(rope["attention_factor"])
    elif rope.get("mscale") and rope.get("mscale_all_dim"):
        attention_factor = get_mscale(factor, rope["mscale"]) / get_mscale(factor, rope["mscale_all_dim"])
    else:
        attention_factor = get_mscale(factor)
    original = rope.get("original_max_position_embeddings") or target.get("original_max_position_embeddings")
    if original is None:
        raise ValueError(f"yarn rope scaling without original_max_position_embeddings: {rope}")
    out = {"rope_type": "yarn", "factor": factor, "original_max_position_embeddings": int(original),
           "attention_factor": attention_factor}
    for key in ("beta_fast", "beta_slow", "truncate"):
        if key in rope:
            out[key] = rope[key]
    return out

