"""The DFlash draft's configuration (:class:`DFlashConfig`): derived from a target's HF
config, written as and read from the ``config.json`` vLLM's ``qwen3_dflash.py`` loads,
and the tensor names an exported DFlash draft holds. No torch: the planner and the
export read it too.

Layer ids. ``target_layer_ids`` here are this project's aux ids (eagle3flow/layers.py:
id ``k`` = the hidden state entering decoder layer ``k``, HF's ``hidden_states[k]``).
vLLM's ``dflash_config.target_layer_ids`` name the *output* of layer ``i``; vLLM adds one
to turn them into its aux ids (eagle3_utils.get_eagle3_aux_layers_from_config), so the
exported list is :func:`~eagle3flow.layers.to_layer_outputs` of ours and hidden-state
extraction captures exactly the states vLLM hands the draft.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

from eagle3flow.layers import default_dflash_layer_ids, from_layer_outputs, to_layer_outputs
from eagle3flow.model.config import yarn_rope_for_llama
from eagle3flow.target.config import text_config

# Checkpoints a DFlash training run keeps in its cache dir (the trainer writes them, the
# plan counts them; one more exists while the newest is written).
DFLASH_KEEP_CHECKPOINTS = 2
# vLLM's registry maps this architecture to qwen3_dflash.DFlashQwen3ForCausalLM.
DFLASH_ARCHITECTURE = "DFlashDraftModel"
LAYER_PARAM_NAMES = (
    "input_layernorm.weight", "post_attention_layernorm.weight",
    "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
    "self_attn.o_proj.weight", "self_attn.q_norm.weight", "self_attn.k_norm.weight",
    "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight",
)


def default_loss_gamma(block_size: int) -> float:
    """The paper's position-decay constant: 7 for blocks of 16, 5 for 10, 4 for 8; in
    between, the nearest of those (smaller blocks keep 4)."""
    table = {16: 7.0, 10: 5.0, 8: 4.0}
    return table.get(block_size, 7.0 if block_size > 12 else 5.0 if block_size > 9 else 4.0)


@dataclass
class DFlashConfig:
    hidden_size: int
    target_hidden_size: int
    num_hidden_layers: int          # the draft's own decoder layers
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    vocab_size: int
    target_layer_ids: list[int]     # this project's aux ids (input of layer k), ascending
    block_size: int                 # the anchor + block_size - 1 masked slots (K = block_size - 1)
    mask_token_id: int
    rope_scaling: dict | None = None
    torch_dtype: str = "bfloat16"
    extra: dict = field(default_factory=dict)   # unknown config.json keys, kept as they were

    def __post_init__(self):
        self.target_layer_ids = [int(k) for k in self.target_layer_ids]
        if self.target_layer_ids != sorted(set(self.target_layer_ids)) or not self.target_layer_ids:
            # vLLM hands the aux states over in ascending layer order
            raise ValueError(f"target_layer_ids {self.target_layer_ids} must be non-empty, unique, ascending")
        if self.block_size < 2:
            raise ValueError(f"block_size {self.block_size}: a block is the anchor plus at least one masked slot")
        if not 0 <= self.mask_token_id < self.vocab_size:
            raise ValueError(f"mask_token_id {self.mask_token_id} not in 0..{self.vocab_size - 1}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_attention_heads {self.num_attention_heads} is not a multiple "
                             f"of num_key_value_heads {self.num_key_value_heads}")
        if self.hidden_size != self.target_hidden_size:
            # vLLM shares the target's embeddings and lm_head only at equal widths
            raise ValueError(f"draft hidden_size {self.hidden_size} must equal the target's {self.target_hidden_size}")

    @property
    def num_aux(self) -> int:
        return len(self.target_layer_ids)

    @property
    def num_speculative_tokens(self) -> int:
        """The K vLLM serves this draft with: every masked slot of a block."""
        return self.block_size - 1

    @classmethod
    def from_target_config(cls, target_config: dict, block_size: int, mask_token_id: int,
                           num_hidden_layers: int = 1, target_layer_ids: list[int] | None = None,
                           overrides: dict | None = None) -> "DFlashConfig":
        """A draft of the target's layer shape (heads, KV heads, head_dim, FFN width,
        rope) with ``num_hidden_layers`` layers, fed ``target_layer_ids`` (default: the
        paper's, eagle3flow/layers.py :func:`default_dflash_layer_ids`). ``overrides`` replaces any other field."""
        cfg = text_config(target_config)
        if "kv_lora_rank" in cfg:
            # An MLA target still gets a GQA draft (the DFlash draft's attention need not follow
            # the target's); its head size is v_head_dim, as the EAGLE-3 draft's.
            head_dim = int(cfg.get("v_head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"])
        else:
            head_dim = int(cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"])
        rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
        rope_theta = float(cfg.get("rope_theta") or rope.get("rope_theta") or 10000.0)
        rope.pop("rope_theta", None)
        if "type" in rope and "rope_type" not in rope:
            rope["rope_type"] = rope.pop("type")
        rope_scaling = rope if rope.get("rope_type", "default") != "default" else None
        if rope_scaling and rope_scaling["rope_type"] in ("yarn", "deepseek_yarn"):
            # Kimi-K2.5 / DeepSeek-V3: the EAGLE-3 draft's reading of YaRN (the magnitude scale
            # explicit), so both drafts of one target place positions alike
            rope_scaling = yarn_rope_for_llama(rope_scaling, cfg)
        if rope_scaling and rope_scaling["rope_type"] not in ("llama3", "linear", "dynamic", "yarn"):
            raise ValueError(f"DFlash draft: rope {rope_scaling['rope_type']!r} is not supported yet")
        num_layers = int(cfg["num_hidden_layers"])
        ids = (default_dflash_layer_ids(num_layers, num_hidden_layers) if target_layer_ids is None
               else sorted(set(int(k) for k in target_layer_ids)))
        bad = [k for k in ids if not 0 <= k <= num_layers - 1]
        if bad:
            raise ValueError(f"target_layer_ids {ids}: {bad} out of range 0..{num_layers - 1} (id k = input of layer k)")
        heads = int(cfg["num_attention_heads"])
        values = dict(
            hidden_size=int(cfg["hidden_size"]), target_hidden_size=int(cfg["hidden_size"]),
            num_hidden_layers=int(num_hidden_layers), num_attention_heads=heads,
            num_key_value_heads=int(cfg.get("num_key_value_heads") or heads), head_dim=head_dim,
            intermediate_size=int(cfg["intermediate_size"]), rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta, max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
            vocab_size=int(cfg["vocab_size"]), target_layer_ids=ids, block_size=int(block_size),
            mask_token_id=int(mask_token_id), rope_scaling=rope_scaling,
            torch_dtype=str(cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16").replace("torch.", ""))
        for key, value in (overrides or {}).items():
            if key not in values:
                raise ValueError(f"DFlash draft override {key!r} is not a config field (known: {sorted(values)})")
            values[key] = value
        return cls(**values)

    def rope_parameters(self) -> dict:
        params = {"rope_type": "default", **(self.rope_scaling or {})}
        params["rope_theta"] = self.rope_theta
        return params

    def to_hf_config(self) -> dict:
        """The exported ``config.json``: a Qwen3-shaped draft vLLM serves as
        ``DFlashQwen3ForCausalLM`` (``speculative_config.method: dflash``). No lm_head or
        embed_tokens ship: vLLM then shares the target's (the draft trained on them frozen)."""
        config = {
            **self.extra,
            "architectures": [DFLASH_ARCHITECTURE],
            "model_type": "qwen3",
            "hidden_size": self.hidden_size,
            "target_hidden_size": self.target_hidden_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "intermediate_size": self.intermediate_size,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_parameters": self.rope_parameters(),
            "max_position_embeddings": self.max_position_embeddings,
            "vocab_size": self.vocab_size,
            "attention_bias": False,
            "tie_word_embeddings": False,
            "torch_dtype": self.torch_dtype,
            "block_size": self.block_size,
            # Every layer non-causal inside the block (no layer_types, no causal flag):
            # vLLM's default for a plain DFlash draft, and what this draft is trained with.
            "dflash_config": {
                "mask_token_id": self.mask_token_id,
                "target_layer_ids": to_layer_outputs(self.target_layer_ids),
            },
        }
        if self.rope_scaling:
            config["rope_scaling"] = dict(self.rope_scaling)
        return config

    @classmethod
    def from_hf_config(cls, hf: dict) -> "DFlashConfig":
        """Inverse of :meth:`to_hf_config` (an exported draft's config.json)."""
        dflash = hf.get("dflash_config") or {}
        rope = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
        theta = float(hf.get("rope_theta") or rope.get("rope_theta") or 10000.0)
        rope.pop("rope_theta", None)
        known = set(cls.__dataclass_fields__) | {
            "architectures", "model_type", "hidden_act", "rope_parameters", "attention_bias",
            "tie_word_embeddings", "dflash_config"}
        return cls(hidden_size=hf["hidden_size"], target_hidden_size=hf.get("target_hidden_size", hf["hidden_size"]),
                   num_hidden_layers=hf["num_hidden_layers"], num_attention_heads=hf["num_attention_heads"],
                   num_key_value_heads=hf.get("num_key_value_heads", hf["num_attention_heads"]),
                   head_dim=hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"],
                   intermediate_size=hf["intermediate_size"], rms_norm_eps=hf["rms_norm_eps"], rope_theta=theta,
                   max_position_embeddings=hf["max_position_embeddings"], vocab_size=hf["vocab_size"],
                   target_layer_ids=from_layer_outputs(dflash["target_layer_ids"]),
                   block_size=hf["block_size"], mask_token_id=dflash["mask_token_id"],
                   rope_scaling=rope if rope.get("rope_type", "default") != "default" else None,
                   torch_dtype=hf.get("torch_dtype", "bfloat16"),
                   extra={k: v for k, v in hf.items() if k not in known})

    def trainable_params(self) -> int:
        """Parameters trained (and exported): fc, the norms and the decoder layers; not the
        target's embeddings and lm_head."""
        h, q, kv = self.hidden_size, self.num_attention_heads * self.head_dim, self.num_key_value_heads * self.head_dim
        layer = 2 * h + h * q + 2 * h * kv + q * h + 2 * self.head_dim + 3 * h * self.intermediate_size
        return self.num_aux * self.target_hidden_size * h + 2 * h + self.num_hidden_layers * layer

    def exported_param_names(self) -> tuple[str, ...]:
        """The tensors an exported draft holds, by the names qwen3_dflash.py maps."""
        return ("fc.weight", "hidden_norm.weight", "norm.weight") + tuple(
            f"layers.{i}.{name}" for i in range(self.num_hidden_layers) for name in LAYER_PARAM_NAMES)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "DFlashConfig":
        return cls(**d)
