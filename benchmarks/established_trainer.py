"""The established trainer's EAGLE-3 step, timed beside the project's in one run
(benchmarks/train_throughput.py ``--against speculators``): speculators 0.9's
``Eagle3DraftModel`` built for the same target shape, on the same packed batch (documents of
``sample_tokens``, every token scored), the same TTT depth, bf16 autocast over fp32 master
weights, its default flex attention and torch.compile (both as its trainer runs them on
CUDA), then backward, grad-norm clipping at 1.0 and fused AdamW, the optimizer the project's
step uses (speculators' trainer defaults to Muon; the comparison is of the model and loss).

Its layer is its trainer's default for EAGLE-3: one Llama layer with the three extra norms
(``norm_before_residual``, ``norm_before_fc``, ``norm_output``) and a 2048-token sliding
window, which equals full causal attention on 2048-token documents. Its loss is its default,
the fused forward KL. Nothing is downloaded: the frozen embeddings and heads (NaN when
built) are filled at random.

``import speculators`` pulls in its data-generation modules, which import ``openai``,
``datasets`` and ``hs_connectors`` by name; where those are not installed, placeholder
modules holding the names stand in (its model code never calls them). Its wheels for a
machine without an index::

    pip download --no-deps --only-binary=:all: --python-version 3.12 speculators==0.9.0 pydantic \\
        pydantic-core pydantic-settings annotated-types typing-inspection python-dotenv typing_extensions
"""
from __future__ import annotations

import importlib
import sys
import types

import torch

# module -> names imported from it at `import speculators` (speculators 0.9.0)
PLACEHOLDERS = {
    "openai": ("OpenAI", "Client", "AsyncClient"),
    "openai.types": (),
    "openai.types.chat": ("ChatCompletion", "ChatCompletionMessageParam"),
    "openai.types.completion": ("Completion",),
    "datasets": ("load_from_disk",),
    "hs_connectors": ("FileTransfer", "HiddenStatesTransfer"),
}


def import_speculators():
    """``(Eagle3DraftModel, Eagle3SpeculatorConfig)``, placeholders standing in for the
    data-only imports this machine lacks."""
    for name, names in PLACEHOLDERS.items():
        try:
            importlib.import_module(name)
        except ImportError:
            module = types.ModuleType(name)
            for attr in names:
                setattr(module, attr, type(attr, (), {}))
            sys.modules[name] = module
    from speculators.models.eagle3.config import Eagle3SpeculatorConfig
    from speculators.models.eagle3.core import Eagle3DraftModel
    separate_autotune_configs()
    return Eagle3DraftModel, Eagle3SpeculatorConfig


def separate_autotune_configs() -> None:
    """speculators 0.9 builds one ``triton.autotune`` decorator for its fused loss's forward
    and backward kernels, so both hold the same ``configs`` list; torch 2.11's dynamo refuses
    to trace a second kernel whose list it already tracks ("ListVariable ... is already
    tracked for mutation") when the compiled step reaches the loss's backward. Each kernel
    gets its own copy of the same configs: the search space and the kernels are unchanged."""
    try:
        from speculators.losses import fused
    except ImportError:       # no Triton (CPU): the eager loss runs
        return
    for name in ("loss_forward_kernel", "loss_backward_kernel"):
        kernel = getattr(fused, name, None)
        if kernel is not None and isinstance(getattr(kernel, "configs", None), list):
            kernel.configs = list(kernel.configs)


def build_speculators(target: dict, draft_vocab: int, device: torch.device, window: int = 2048):
    """Its draft for ``target`` (a Llama-shaped HF config dict), trainable weights fp32."""
    from transformers import LlamaConfig

    Eagle3DraftModel, Eagle3SpeculatorConfig = import_speculators()
    heads = int(target["num_attention_heads"])
    rope = {"rope_type": "default", **dict(target.get("rope_scaling") or {}),
            "rope_theta": float(target.get("rope_theta", 10000.0))}
    layer = LlamaConfig(
        vocab_size=int(target["vocab_size"]), hidden_size=int(target["hidden_size"]),
        intermediate_size=int(target["intermediate_size"]), num_hidden_layers=1, num_attention_heads=heads,
        num_key_value_heads=int(target.get("num_key_value_heads") or heads),
        head_dim=int(target.get("head_dim") or target["hidden_size"] // heads),
        rms_norm_eps=float(target.get("rms_norm_eps", 1e-5)), tie_word_embeddings=False,
        max_position_embeddings=int(target.get("max_position_embeddings", 4096)), rope_parameters=rope,
        sliding_window=window, use_sliding_window=True, layer_types=["sliding_attention"])
    layer._attn_implementation = "simple_flex_attention" if device.type == "cuda" else "sdpa"
    config = Eagle3SpeculatorConfig(transformer_layer_config=layer, draft_vocab_size=draft_vocab,
                                    norm_before_residual=True, norm_before_fc=True, norm_output=True)
    torch.manual_seed(0)
    with torch.device(device):
        model = Eagle3DraftModel(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if not param.requires_grad:
                if param.dim() == 1:
                    param.fill_(1.0)
                else:
                    param.normal_(std=0.02)
        for name, buffer in model.named_buffers():
            if buffer.is_floating_point() and torch.isnan(buffer).any():
                buffer.normal_(std=0.02)
    return model.train()


def speculators_batch(samples: int, sample_tokens: int, hidden: int, num_aux: int, vocab: int,
                      device: torch.device) -> dict:
    """One packed row of ``samples`` documents, as its collate hands it over."""
    g = torch.Generator(device=device).manual_seed(1)
    n = samples * sample_tokens
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    documents = torch.arange(samples, device=device).repeat_interleave(sample_tokens)
    positions = torch.arange(sample_tokens, device=device).repeat(samples)
    return {"hidden_states": torch.randn(1, n, num_aux * hidden, generator=g, device=device).to(dtype),
            "input_ids": torch.randint(0, vocab, (1, n), generator=g, device=device),
            "document_ids": documents[None], "position_ids": positions[None],
            "loss_mask": torch.ones(1, n, dtype=torch.long, device=device),
            "verifier_last_hidden_states": torch.randn(1, n, hidden, generator=g, device=device).to(dtype)}


def run_speculators(model, batch: dict, ttt_steps: int, warmup: int, iters: int, device: torch.device) -> dict:
    """Time ``iters`` of its steps back to back, as train_throughput.run_case times ours."""
    from train_throughput import time_steps

    from speculators.losses.utils import resolve_loss_config

    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-5, fused=device.type == "cuda")
    # its default loss, fused with Triton on CUDA; the eager one on the CPU (as its CPU runs)
    loss_config = resolve_loss_config("kl_div", "fused" if device.type == "cuda" else "eager")

    def step():
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            _, loss, _ = model(**batch, ttt_steps=ttt_steps, loss_config=loss_config)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        return loss

    result, loss = time_steps(step, warmup, iters, device)
    del optimizer
    return {"trainer": "speculators 0.9", **result, "loss": float(loss),
            "trainable_params": sum(p.numel() for p in params)}
