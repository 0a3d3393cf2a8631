"""A Kimi-K2.5-layout target (tests/support/kimi_target.py) through the project's real paths:
its remote tokenizer and chat format, the loss mask, the config and weight readers, the
draft config, HF extraction (the wrapper's language model), and vLLM's CPU build.

The tokenizer, the template, the readers and the draft config work, the project's
tokenizer loader (with target.trust_remote_code; refused without it), the loss mask with
Kimi's own slow tokenizer (no offsets) and the HF backend on the wrapper's language model.
The whole workflow on this fixture runs in tests/test_workflow.py. Without
``trust_remote_code`` transformers 5 does not refuse Kimi's tokenizer: it converts
``tiktoken.model`` to a fast tokenizer with a generic split, which tokenizes some text
differently from Kimi's (asserted below). On vLLM's CPU build the wrapper (vision
tower included) runs, computing what its language model computes in HF, but only with
its engine core in a child process, and not with the INT4 experts (asserted errors).
"""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from eagle3flow.data.chat_masks import ChatMasker
from eagle3flow.target.tokenizer import load_tokenizer
from eagle3flow.model.config import DraftConfig
from eagle3flow.target.config import load_target_config, read_config_file
from eagle3flow.target.weights import load_target_head, tensor_locations
from eagle3flow.extract.shards import load_manifest
from support.kimi_target import INT4_GROUP_SIZE, NUM_SPECIAL, SPECIAL_TOKENS, make_kimi_k25_target, \
    plain_language_model

REPO = Path(__file__).resolve().parent.parent

CONVERSATION = [
    {"role": "user", "content": "What is the capital of France?"},
    {"role": "assistant", "content": "Paris is the capital of France.",
     "reasoning_content": "France is a country; its capital is Paris."},
    {"role": "user", "content": "What does getValue return?"},
    {"role": "assistant", "content": "It returns currentValue.",
     "reasoning_content": "Let me think: def getValue(self): return self.currentValue"},
]
RENDERED = (
    "<|im_system|>system<|im_middle|>You are Kimi, an AI assistant created by Moonshot AI.<|im_end|>"
    "<|im_user|>user<|im_middle|>What is the capital of France?<|im_end|>"
    "<|im_assistant|>assistant<|im_middle|><think>France is a country; its capital is Paris.</think>"
    "Paris is the capital of France.<|im_end|>"
    "<|im_user|>user<|im_middle|>What does getValue return?<|im_end|>"
    "<|im_assistant|>assistant<|im_middle|><think>Let me think: def getValue(self): return self.currentValue"
    "</think>It returns currentValue.<|im_end|>")
# What the target generates in each assistant turn: its thinking, the answer, the end of turn.
GENERATED = ["France is a country; its capital is Paris.</think>Paris is the capital of France.<|im_end|>",
             "Let me think: def getValue(self): return self.currentValue</think>It returns currentValue.<|im_end|>"]


@pytest.fixture(scope="module")
def kimi(tmp_path_factory) -> Path:
    return make_kimi_k25_target(tmp_path_factory.mktemp("kimi_k25"))


@pytest.fixture(scope="module")
def kimi_int4(tmp_path_factory) -> Path:
    return make_kimi_k25_target(tmp_path_factory.mktemp("kimi_k25_int4"), int4_experts=True)


@pytest.fixture(scope="module")
def remote_tokenizer(kimi):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(kimi), trust_remote_code=True)


def masked_texts(tokenizer, ids, mask) -> list[str]:
    """The decoded runs of consecutive masked tokens."""
    runs, current = [], []
    for token, m in zip(ids, mask):
        if m:
            current.append(int(token))
        elif current:
            runs.append(current)
            current = []
    return [tokenizer.decode(run) for run in runs + ([current] if current else [])]


# ----------------------------------------------------------------------------- tokenizer

def test_remote_tokenizer_is_kimis(kimi, remote_tokenizer):
    """With trust_remote_code: the fixture's tiktoken class, slow, Kimi's special tokens at
    their offsets after the BPE ranks, the vocab the config says."""
    tok = remote_tokenizer
    assert type(tok).__name__ == "TikTokenTokenizer" and not tok.is_fast
    config = read_config_file(kimi)
    num_ranks = config["text_config"]["vocab_size"] - NUM_SPECIAL
    assert len(tok) == config["text_config"]["vocab_size"]
    assert {name: tok.convert_tokens_to_ids(name) for name in SPECIAL_TOKENS.values()} == \
        {name: num_ranks + offset for offset, name in SPECIAL_TOKENS.items()}
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == \
        (config["bos_token_id"], config["eos_token_id"], config["pad_token_id"])
    text = "<|im_user|>user<|im_middle|>你好，世界 currentValue<|im_end|>"
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids) == text and ids[0] == tok.convert_tokens_to_ids("<|im_user|>")


def test_without_trust_remote_code_transformers_converts_it_with_another_split(kimi, remote_tokenizer):
    """transformers 5 does not refuse it: it maps model_type kimi_k25 to its own fast backend
    and converts tiktoken.model with a generic pre-tokenizer regex, not Kimi's; where the
    vocab has tokens across Kimi's split points (this fixture's ranks were fit with another
    split, so it does) the ids differ from what vLLM, trusting the remote code, tokenizes
    the same text into. So the project's loader refuses the target without
    target.trust_remote_code, naming the key and the auto_map that needs it."""
    from transformers import AutoTokenizer

    with pytest.raises(ValueError, match=r"tokenizer_config.json declares auto_map \['AutoTokenizer'\].*"
                                         r"set target.trust_remote_code: true"):
        load_tokenizer(kimi)
    converted = AutoTokenizer.from_pretrained(str(kimi))
    assert type(converted).__name__ == "TokenizersBackend" and converted.is_fast
    kimi_split = sys.modules[type(remote_tokenizer).__module__].PAT_STR
    assert "Han" in kimi_split and "Han" not in str(converted.backend_tokenizer.pre_tokenizer)
    text = "It returns currentValue."
    assert converted.encode(text, add_special_tokens=False) != remote_tokenizer.encode(text, add_special_tokens=False)
    assert converted.decode(converted.encode(text, add_special_tokens=False)) == text
    # The special tokens agree, so nothing looks wrong until a word splits differently.
    assert converted.convert_tokens_to_ids("<|im_middle|>") == remote_tokenizer.convert_tokens_to_ids("<|im_middle|>")


def test_chat_template_keeps_thinking(remote_tokenizer):
    tok = remote_tokenizer
    assert tok.apply_chat_template(CONVERSATION, tokenize=False) == RENDERED
    prompt = tok.apply_chat_template(CONVERSATION[:3], tokenize=False, add_generation_prompt=True)
    assert prompt.endswith("What does getValue return?<|im_end|><|im_assistant|>assistant<|im_middle|><think>")
    # an earlier turn's thinking stays in the prompt of the next
    assert "<think>France is a country; its capital is Paris.</think>" in prompt
    assert tok.apply_chat_template(CONVERSATION[:3], tokenize=False, add_generation_prompt=True,
                                   thinking=False).endswith("<|im_middle|><think></think>")
    ids = tok.apply_chat_template(CONVERSATION, tokenize=True, return_dict=False)
    assert ids.count(tok.convert_tokens_to_ids("<think>")) == 2 and tok.decode(ids) == RENDERED


def test_project_loads_the_remote_tokenizer(kimi, remote_tokenizer):
    tokenizer = load_tokenizer(kimi, trust_remote_code=True)
    assert type(tokenizer).__name__ == "TikTokenTokenizer"
    assert tokenizer.encode(RENDERED, add_special_tokens=False) == \
        remote_tokenizer.encode(RENDERED, add_special_tokens=False)


def test_loss_mask_spans_of_kimis_format(kimi):
    """The project's mask on Kimi's format, given offsets (transformers' converted tokenizer's):
    each assistant turn's thinking, answer and end of turn, nothing else."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(kimi))
    ids, mask = ChatMasker(tokenizer).tokenize(CONVERSATION, "kimi")
    assert masked_texts(tokenizer, ids, mask) == GENERATED


def test_loss_mask_with_kimis_tokenizer(remote_tokenizer):
    """Kimi's own (slow, remote-code) tokenizer: no offsets, the same mask from prefixes."""
    ids, mask = ChatMasker(remote_tokenizer).tokenize(CONVERSATION, "kimi")
    assert list(ids) == remote_tokenizer.encode(RENDERED, add_special_tokens=False)
    assert masked_texts(remote_tokenizer, ids, mask) == GENERATED


# ----------------------------------------------------------------------------- config, weights, draft

def test_config_head_and_draft_through_the_project_readers(kimi):
    outer = read_config_file(kimi)
    assert outer["architectures"] == ["KimiK25ForConditionalGeneration"] and "vision_config" in outer
    text = load_target_config(kimi)
    assert (text["model_type"], text["kv_lora_rank"], text["qk_rope_head_dim"], text["dtype"]) == \
        ("kimi_k2", 512, 64, "bfloat16")
    head = load_target_head(kimi)
    vocab, hidden = text["vocab_size"], text["hidden_size"]
    assert {k: (v.dtype, tuple(v.shape)) for k, v in head.items()} == {
        "embed_tokens": (torch.bfloat16, (vocab, hidden)), "norm": (torch.bfloat16, (hidden,)),
        "lm_head": (torch.bfloat16, (vocab, hidden))}
    # read by the wrapper's names, from the head's own shard
    locations = tensor_locations(kimi)
    head_files = {locations[f"language_model.{name}"] for name in
                  ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight")}
    assert len(head_files) == 1 and not any(".layers." in n for n, f in locations.items() if f in head_files)
    draft = DraftConfig.from_target_config(outer, [2, 4, 5], 256)
    assert (draft.architecture, draft.hidden_size, draft.kv_lora_rank, draft.qk_rope_head_dim,
            draft.vocab_size) == ("mla", hidden, 512, 64, vocab)
    assert draft.rope_scaling["rope_type"] == "yarn" and draft.rope_scaling["factor"] == 64.0


def test_int4_experts_are_the_dense_ones_packed_as_compressed_tensors(kimi, kimi_int4):
    """The INT4 fixture holds what compressed-tensors itself unpacks to the dense fixture's
    experts (to half a quantization step); its head reads as the dense one's."""
    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32
    from safetensors import safe_open

    text = load_target_config(kimi_int4)
    assert text["quantization_config"]["format"] == "pack-quantized"
    assert read_config_file(kimi_int4)["quantization_config"] == text["quantization_config"]
    dense, packed = tensor_locations(kimi), tensor_locations(kimi_int4)
    stem = "language_model.model.layers.3.mlp.experts.1.down_proj"
    assert stem + ".weight" not in packed and stem + ".weight_packed" not in dense
    with safe_open(str(dense[stem + ".weight"]), "pt") as f:
        weight = f.get_tensor(stem + ".weight").float()
    with safe_open(str(packed[stem + ".weight_packed"]), "pt") as f:
        shape = torch.Size(f.get_tensor(stem + ".weight_shape").tolist())
        values = unpack_from_int32(f.get_tensor(stem + ".weight_packed"), 4, shape)
        scale = f.get_tensor(stem + ".weight_scale").float()
    assert shape == weight.shape and values.min() >= -8 and values.max() <= 7
    restored = values.float() * scale.repeat_interleave(INT4_GROUP_SIZE, dim=1)
    assert (restored - weight).abs().max() <= scale.max() * 0.51
    assert all(torch.equal(a, b) for a, b in zip(load_target_head(kimi).values(), load_target_head(kimi_int4).values()))


def test_hf_extraction_of_the_wrapper_is_its_language_models(kimi, tmp_path):
    """The HF backend (and the evaluation's replay, which loads the target the same way:
    eagle3flow/target/model.py) runs the wrapper as its language model, with no modeling
    code of the wrapper's own: the same states as a plain DeepseekV3ForCausalLM of the same
    language-model tensors. Without target.trust_remote_code it is refused, naming the key."""
    from eagle3flow.extract.hf import extract, load_target
    from support.builders import write_dataset

    data = write_dataset(tmp_path / "train.parquet", 4, min_len=8, vocab=load_target_config(kimi)["vocab_size"])
    with pytest.raises(ValueError, match="target.trust_remote_code is false"):
        load_target(kimi, torch.float32, torch.device("cpu"))
    model = load_target(kimi, torch.float32, torch.device("cpu"), trust_remote_code=True)
    assert type(model).__name__ == "DeepseekV3ForCausalLM"
    states = {}
    for name, target in (("wrapper", kimi), ("plain", plain_language_model(kimi, tmp_path / "plain"))):
        manifest = extract(data, target, tmp_path / name / "manifest.json", tmp_path / name / "cache",
                           aux_layer_ids=[2, 4, 5], dtype="float32", device="cpu", shard_tokens=100,
                           trust_remote_code=name == "wrapper")
        assert manifest["num_samples"] == 4
        states[name] = list(load_manifest(tmp_path / name / "manifest.json").iter_samples())
    for wrapped, plain in zip(states["wrapper"], states["plain"], strict=True):
        assert wrapped["id"] == plain["id"]
        for key in ("input_ids", "aux_hidden_states", "last_hidden_state"):
            assert torch.equal(wrapped[key], plain[key]), key


# ----------------------------------------------------------------------------- vLLM (CPU build)

@pytest.fixture(scope="module")
def vllm_runs(kimi, kimi_int4, remote_tokenizer, tmp_path_factory) -> dict:
    """One script, three engines (tests/support/kimi_vllm.py): the INT4 fixture and the
    dense one with the engine core in a child process (as ``vllm serve`` runs it), then
    the dense one in-process (as the project's extraction and evaluation run it at TP 1)."""
    prompt = remote_tokenizer.apply_chat_template(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
        tokenize=False, add_generation_prompt=True)
    runs = {"int4": {"target": str(kimi_int4), "dtype": "bfloat16"},
            "wrapper": {"target": str(kimi), "dtype": "float32"},
            "in_process": {"target": str(kimi), "dtype": "float32", "in_process": True}}
    request = tmp_path_factory.mktemp("kimi_vllm") / "request.json"
    request.write_text(json.dumps([{**run, "prompt": prompt, "max_tokens": 3} for run in runs.values()]))
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, str(REPO / "tests" / "support" / "kimi_vllm.py"), str(request)],
                          env=env, capture_output=True, text=True, timeout=1500)
    results = [json.loads(line.removeprefix("RESULT ")) for line in done.stdout.splitlines()
               if line.startswith("RESULT ")]
    assert done.returncode == 0 and len(results) == len(runs), done.stdout[-3000:] + done.stderr[-3000:]
    return {"prompt": prompt, "log": done.stdout + done.stderr, **dict(zip(runs, results))}


def test_project_engines_run_the_wrappers_core_in_a_child_process(kimi, tmp_path, monkeypatch):
    """The extraction and the evaluation run a one-worker engine's core in their own process,
    except for a wrapper, which crashes there on vLLM's CPU build (the last test below):
    its core runs in a child process, as `vllm serve` runs it. A value already set wins."""
    from eagle3flow.serving.vllm_runner import engine_core_in_process, engine_process_env

    assert engine_core_in_process(kimi) is False
    assert engine_core_in_process(plain_language_model(kimi, tmp_path / "plain")) is True
    monkeypatch.delenv("VLLM_ENABLE_V1_MULTIPROCESSING", raising=False)
    engine_process_env(kimi)
    assert os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] == "1"
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    engine_process_env(kimi)
    assert os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"


@pytest.mark.slow
def test_vllm_cpu_runs_the_wrapper_as_its_language_model(kimi, remote_tokenizer, vllm_runs, tmp_path):
    """vLLM builds KimiK25ForConditionalGeneration (vision tower and projector loaded,
    remote tokenizer trusted) and generates what HF's DeepseekV3ForCausalLM computes
    from the same language-model tensors: same prompt ids, tokens, logprobs."""
    from transformers import DeepseekV3ForCausalLM

    run = vllm_runs["wrapper"]
    assert run["prompt_token_ids"] == remote_tokenizer.encode(vllm_runs["prompt"], add_special_tokens=False)
    model = DeepseekV3ForCausalLM.from_pretrained(str(plain_language_model(kimi, tmp_path / "plain")),
                                                  dtype=torch.float32).eval()
    ids, logprobs = list(run["prompt_token_ids"]), []
    with torch.no_grad():
        for _ in run["token_ids"]:
            step = torch.log_softmax(model(torch.tensor([ids])).logits[0, -1], -1)
            ids.append(int(step.argmax()))
            logprobs.append(float(step.max()))
    assert ids[len(run["prompt_token_ids"]):] == run["token_ids"]
    torch.testing.assert_close(torch.tensor(run["logprobs"]), torch.tensor(logprobs), atol=1e-4, rtol=0)


@pytest.mark.slow
@pytest.mark.skipif(torch.cpu._is_amx_tile_supported(), reason="this host has AMX, for which vLLM has a CPU INT4 MoE kernel")
def test_vllm_cpu_refuses_the_int4_experts(vllm_runs):
    """compressed-tensors W4A16 MoE on vLLM 0.32's CPU build: only with AMX (or zentorch)."""
    assert vllm_runs["int4"]["error"] == "RuntimeError"
    assert "NotImplementedError: No WNA16 MoE backend supports the deployment configuration." in vllm_runs["log"]


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("numba") is None, reason="the crash needs numba imported")
def test_vllm_cpu_in_process_engine_crashes_on_the_wrapper(vllm_runs):
    """vLLM 0.32's CPU worker rebinds Triton kernels by scanning every loaded module's
    objects; the Kimi-K2.5 model module imports numba (its image preprocessing), and
    llvmlite's library object answers even ``__dict__`` with a function wrapper, so the
    scan fails before the model loads. An engine core in a child process scans before
    it imports the model; one in the process that built the input processor, after."""
    assert vllm_runs["in_process"] == {"error": "AttributeError",
                                       "message": "'_lib_fn_wrapper' object has no attribute 'get'"}
