"""Export format, target-weight loading, and real vLLM (CPU) serving the exported draft."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from eagle3flow.model.config import EXPORTED_PARAM_NAMES, exported_param_names
from eagle3flow.model.draft import Eagle3Draft
from eagle3flow.export.load import load_exported_draft
from eagle3flow.export.checkpoint import export_draft
from eagle3flow.target.config import load_target_config
from eagle3flow.target.weights import load_target_head
from eagle3flow.train.build import build_draft, load_vocab_map
from support.builders import make_hidden_states, make_random_vocab_map, make_vocab_map, save_train_dir

REPO = Path(__file__).resolve().parent.parent


def test_export_roundtrip(random_llama_target, tmp_path):
    vmap = make_random_vocab_map(512, 100, tmp_path / "vocab.safetensors")
    d2t, t2d = load_vocab_map(vmap)
    model, teacher = build_draft(random_llama_target, [2, 4, 5], d2t, t2d, {"intermediate_size": 96}, seed=0)
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.add_(0.05 * torch.randn_like(p))
    torch.testing.assert_close(teacher, load_target_head(random_llama_target)["lm_head"][t2d])
    out = export_draft(save_train_dir(model, tmp_path / "train"), vmap, random_llama_target, tmp_path / "draft")
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["num_hidden_layers"] == 1
    assert (config["draft_vocab_size"], config["vocab_size"], config["target_hidden_size"]) == (100, 512, 64)
    assert config["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5] and config["tie_word_embeddings"] is False
    assert config["torch_dtype"] == "float32" and config["intermediate_size"] == 96
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        names = set(f.keys())
        assert f.get_tensor("d2t").dtype == torch.int64 and f.get_tensor("t2d").dtype == torch.bool
        assert f.get_tensor("fc.weight").dtype == torch.float32
    # the default architecture's RMSNorm before fc is exported as vLLM names it
    assert names == set(exported_param_names(model.config)) | {"d2t", "t2d"}
    assert names - set(EXPORTED_PARAM_NAMES) == {"input_norm.weight", "d2t", "t2d"}
    assert config["norm_before_fc"] is True and config["norm_output"] is True
    loaded = load_exported_draft(out, random_llama_target)
    aux, ids, cu = torch.randn(20, 192), torch.randint(0, 512, (20,)), torch.tensor([0, 12, 20])
    with torch.no_grad():
        for a, b in zip(model.eval().forward_ttt(aux, ids, cu, 3)[0], loaded.forward_ttt(aux, ids, cu, 3)[0]):
            torch.testing.assert_close(a, b)
    # a bf16 target gets a bf16 draft; a mismatched vocab map is refused
    bf16_target = tmp_path / "bf16_target"
    shutil.copytree(random_llama_target, bf16_target)
    cfg = json.loads((bf16_target / "config.json").read_text())
    cfg.pop("torch_dtype", None)
    cfg["dtype"] = "bfloat16"
    (bf16_target / "config.json").write_text(json.dumps(cfg))
    subprocess.run([sys.executable, "-m", "eagle3flow.export.checkpoint", "--train-dir", str(tmp_path / "train"),
                    "--vocab-map", str(vmap), "--target", str(bf16_target),
                    "--out-dir", str(tmp_path / "draft_bf16")], check=True, cwd=REPO)
    assert load_file(str(tmp_path / "draft_bf16" / "model.safetensors"))["lm_head.weight"].dtype == torch.bfloat16
    with pytest.raises(ValueError, match="not the vocab map"):
        export_draft(tmp_path / "train", make_random_vocab_map(512, 100, tmp_path / "other.safetensors", seed=1),
                     random_llama_target, tmp_path / "draft_bad")


def test_target_weights_sharded_prefixed_and_tied(tmp_path):
    torch.manual_seed(0)
    embed, norm, head = torch.randn(10, 4), torch.randn(4), torch.randn(10, 4)
    sharded = tmp_path / "mm"
    sharded.mkdir()
    # a multimodal-style checkpoint over 3 shards, with decoys that must not be picked
    files = {"model-00001-of-00003.safetensors": {"model.language_model.embed_tokens.weight": embed,
                                                  "model.language_model.layers.0.input_layernorm.weight": norm + 1},
             "model-00002-of-00003.safetensors": {"model.language_model.norm.weight": norm,
                                                  "model.visual.norm.weight": norm + 2},
             "model-00003-of-00003.safetensors": {"lm_head.weight": head}}
    weight_map = {}
    for name, tensors in files.items():
        save_file(tensors, str(sharded / name))
        weight_map.update({k: name for k in tensors})
    (sharded / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    (sharded / "config.json").write_text(json.dumps({"architectures": ["X"], "torch_dtype": "bfloat16",
                                                     "text_config": {"hidden_size": 4, "vocab_size": 10}}))
    got = load_target_head(sharded)
    for key, ref in (("embed_tokens", embed), ("norm", norm), ("lm_head", head)):
        torch.testing.assert_close(got[key], ref)
    assert load_target_config(sharded) == {"hidden_size": 4, "vocab_size": 10, "torch_dtype": "bfloat16"}
    tied = tmp_path / "tied"
    tied.mkdir()
    save_file({"model.embed_tokens.weight": embed, "model.norm.weight": norm}, str(tied / "model.safetensors"))
    (tied / "config.json").write_text(json.dumps({"tie_word_embeddings": True}))
    torch.testing.assert_close(load_target_head(tied)["lm_head"], embed)
    (tied / "config.json").write_text(json.dumps({"tie_word_embeddings": False}))
    with pytest.raises(ValueError, match="no lm_head"):
        load_target_head(tied)


VLLM_SCRIPT = r"""
import json, os, sys
os.environ["VLLM_CPU_KVCACHE_SPACE"] = "1"
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
from vllm import LLM, SamplingParams
req = json.loads(sys.argv[1])
kwargs = dict(model=req["target"], dtype="float32", max_model_len=512, enforce_eager=True,
              seed=0, disable_log_stats=False, distributed_executor_backend="uni")
if req.get("draft"):
    kwargs["speculative_config"] = {"method": "eagle3", "model": req["draft"],
                                    "num_speculative_tokens": req["k"]}
llm = LLM(**kwargs)
outs = llm.generate([{"prompt_token_ids": p} for p in req["prompts"]],
                    SamplingParams(temperature=0.0, max_tokens=req["max_tokens"], ignore_eos=True),
                    use_tqdm=False)
metrics = {}
for m in llm.get_metrics():
    if m.name.startswith("vllm:spec_decode"):
        metrics[m.name] = list(m.values) if hasattr(m, "values") else m.value
print("RESULT " + json.dumps({"outputs": [list(o.outputs[0].token_ids) for o in outs], "metrics": metrics}))
"""


def add_tokenizer(target: Path, vocab_size: int) -> None:
    """A word-level tokenizer (``t0``..``tN``) so vLLM can load the tokenizer-less random target."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab_size)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0", pad_token="t0", bos_token="t1",
                            eos_token="t2").save_pretrained(target)


def run_vllm(request: dict) -> dict:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "1"}
    proc = subprocess.run([sys.executable, "-c", VLLM_SCRIPT, json.dumps(request)], env=env,
                          cwd=REPO.parent, capture_output=True, text=True, timeout=600)
    lines = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stdout[-3000:] + proc.stderr[-6000:]
    return json.loads(lines[-1][len("RESULT "):])


def replay_acceptance(model: Eagle3Draft, target: Path, prompt: list[int], output: list[int], k: int,
                      aux_layer_ids) -> tuple[int, list[int]]:
    """(verify steps, accepted tokens per draft position) greedy speculative decoding would have, from predict_chains."""
    from transformers import LlamaForCausalLM

    hf = LlamaForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    ids = torch.tensor(prompt + output)
    with torch.no_grad():
        hs = hf(ids[None], output_hidden_states=True).hidden_states
    aux = torch.cat([hs[i][0] for i in aux_layer_ids], -1)
    chains = model.predict_chains(aux, ids, k)
    t, end, steps, accepted = len(prompt) - 1, len(ids), 0, [0] * k
    # chain at row t guesses indices t+2..t+k+1; the target's own token at t+1 is always kept
    while t + 1 < end - 1:
        a = 0
        while a < k and t + a + 2 < end and int(chains[t, a]) == int(ids[t + a + 2]):
            a += 1
        steps += 1
        for i in range(a):
            accepted[i] += 1
        t += a + 1
    return steps, accepted


@pytest.mark.slow
def test_vllm_serves_exported_draft(random_llama_target, tmp_path):
    """vLLM loads the export, drafts with it, keeps greedy outputs identical, and accepts
    exactly the tokens our own replay of its serving loop predicts."""
    sys.path.insert(0, str(Path(__file__).parent))

    from eagle3flow.train.build import load_trained
    from eagle3flow.train.trainer import train

    target = tmp_path / "target"
    shutil.copytree(random_llama_target, target)
    add_tokenizer(target, 512)
    manifest = make_hidden_states(target, tmp_path / "hs", 24, seed=0)
    vmap = make_vocab_map(manifest, 512, 200, tmp_path / "vocab.safetensors")
    train(manifest, None, vmap, target, tmp_path / "train", tmp_path / "cache",
          {"ttt_steps": 3, "epochs": 8, "batch_tokens": 256, "lr": 5e-3, "device": "cpu"})
    draft = export_draft(tmp_path / "train", vmap, target, tmp_path / "draft")

    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(3, 512, (n,), generator=g).tolist() for n in (4, 9, 6)]
    req = {"target": str(target), "prompts": prompts, "max_tokens": 24, "k": 3}
    base = run_vllm(req)
    spec = run_vllm({**req, "draft": str(draft)})
    assert spec["outputs"] == base["outputs"]
    m = spec["metrics"]
    assert m["vllm:spec_decode_num_drafts"] > 0 and m["vllm:spec_decode_num_draft_tokens"] > 0
    model = load_trained(tmp_path / "train", target)
    steps, per_pos = 0, [0, 0, 0]
    for p, o in zip(prompts, spec["outputs"]):
        s, a = replay_acceptance(model, target, p, o, 3, [2, 4, 5])
        steps, per_pos = steps + s, [x + y for x, y in zip(per_pos, a)]
    print("vllm", m, "replay steps", steps, "accepted per position", per_pos)
    assert m["vllm:spec_decode_num_accepted_tokens"] > 0
    assert m["vllm:spec_decode_num_drafts"] == steps
    assert m["vllm:spec_decode_num_accepted_tokens_per_pos"] == per_pos
    # The same draft in the speculators format: vLLM reads it natively, speculates the same.
    spec_dir = export_draft(tmp_path / "train", vmap, target, tmp_path / "draft-speculators", "speculators")
    config = json.loads((spec_dir / "config.json").read_text())
    assert config["speculators_model_type"] == "eagle3"
    assert config["speculators_config"]["verifier"]["name_or_path"] == str(target.resolve())
    assert config["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 3
    with safe_open(str(spec_dir / "model.safetensors"), "pt") as f:
        assert "layers.0.self_attn.q_proj.weight" in set(f.keys())
    other = run_vllm({**req, "draft": str(spec_dir)})
    assert other["outputs"] == spec["outputs"] and other["metrics"] == spec["metrics"], (other["metrics"], m)
    assert load_exported_draft(spec_dir, target).config == load_exported_draft(draft, target).config


def test_mla_draft_exports_as_vllm_names_it_and_learns(tmp_path):
    """An MLA draft (architecture auto on a DeepSeek-V3 target: MLA + MoE) trains and exports
    as vLLM's Eagle3DeepseekV2ForCausalLM, with its weight names, and the exported draft,
    loaded back, accepts more of the target's greedy tokens in the exact replay than a
    random-weight MLA draft. vLLM serving such a draft on its target (lossless, its counters
    equal to the replay's) is tests/test_workflow.py's Kimi-K2.5-layout end-to-end test."""
    from transformers import AutoModelForCausalLM

    from eagle3flow.eval.replay import acceptance_summary, simulate_on_outputs
    from support.tiny_targets import make_tiny_deepseek_v3
    from eagle3flow.train.trainer import train

    target = make_tiny_deepseek_v3(tmp_path / "target", seed=0)
    vocab = json.loads((target / "config.json").read_text())["vocab_size"]
    manifest = make_hidden_states(target, tmp_path / "hs", 96, seed=0)
    vmap = make_vocab_map(manifest, vocab, 512, tmp_path / "vocab.safetensors")
    train(manifest, None, vmap, target, tmp_path / "train", tmp_path / "cache",
          {"ttt_steps": 3, "epochs": 10, "batch_tokens": 256, "device": "cpu"})
    draft = export_draft(tmp_path / "train", vmap, target, tmp_path / "draft")
    config = json.loads((draft / "config.json").read_text())
    assert config["architectures"] == ["Eagle3DeepseekV2ForCausalLM"] and config["model_type"] == "deepseek_v2"
    with safe_open(str(draft / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert {"midlayer.self_attn.q_a_proj.weight", "midlayer.self_attn.kv_a_proj_with_mqa.weight",
            "midlayer.self_attn.kv_b_proj.weight", "midlayer.self_attn.kv_a_layernorm.weight"} <= names
    assert "midlayer.self_attn.k_proj.weight" not in names
    d2t, t2d = load_vocab_map(vmap)
    random_draft, _ = build_draft(target, [2, 4, 5], d2t, t2d, {}, seed=1)
    random_dir = export_draft(save_train_dir(random_draft, tmp_path / "random_train"), vmap, target,
                              tmp_path / "random_draft")

    # Held-out samples of the training distribution (support.builders.make_hidden_states):
    # the target's greedy continuations of random 4-token prompts (another seed).
    hf = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    prompts = torch.randint(3, vocab, (8, 4), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        out = hf.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=32, min_new_tokens=32,
                          do_sample=False, pad_token_id=0)
    units = [{"key": f"p{i}", "prompt_token_ids": prompts[i].tolist(), "output_token_ids": out[i, 4:].tolist()}
             for i in range(len(prompts))]

    def acceptance_length(draft_dir: Path, name: str) -> float:
        replays = simulate_on_outputs(draft_dir, target, units, 3, "cpu", "float32", tmp_path / f"{name}.jsonl", name)
        rounds = [r["by_k"]["3"] for r in replays.values()]
        return acceptance_summary(sum(r["rounds"] for r in rounds), sum(r["accepted"] for r in rounds),
                                  [sum(col) for col in zip(*(r["accepted_per_pos"] for r in rounds))]
                                  )["acceptance_length"]

    trained, untrained = acceptance_length(draft, "trained"), acceptance_length(random_dir, "random")
    print(f"replayed acceptance length at K=3: trained {trained:.3f}, random {untrained:.3f}")
    assert trained > untrained + 0.1, (trained, untrained)
