"""Evaluation: the greedy-speculation replay (exact counts) and real vLLM runs on a tiny target."""
from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch

from eagle3flow.eval.agreement import compare_outputs
from eagle3flow.eval.evaluate import EvalOptions, evaluate, job_gpus
from eagle3flow.eval.replay import acceptance_summary, replay_greedy_speculation
from eagle3flow.serving.vllm_runner import render_prompts, run_vllm
from support.deadline import deadline
from support.targets import make_chat_target, make_random_llama, save_bpe_chat_tokenizer

# ----------------------------------------------------------------------------- replay

def chains_from(rows: dict[int, list[int]], total: int, k: int, fill: int = -1) -> torch.Tensor:
    """A ``[total, k]`` chain tensor, ``fill`` everywhere except the given rows."""
    chains = torch.full((total, k), fill, dtype=torch.long)
    for t, guesses in rows.items():
        chains[t] = torch.tensor(guesses)
    return chains


def test_replay_none_accepted():
    ids = [5, 6, 7, 10, 11, 12, 13]          # prompt 3 tokens, output 4 (10 from prefill)
    res = replay_greedy_speculation(chains_from({}, 7, 3), ids, prompt_len=3)
    # Each round the target adds one token: 11, 12, 13 -> three rounds, nothing accepted.
    assert res == {"rounds": 3, "accepted": 0, "accepted_per_pos": [0, 0, 0], "per_round": [0, 0, 0]}


def test_replay_all_accepted():
    ids = [5, 6, 10, 11, 12, 13, 14, 15, 16, 17]   # prompt 2, output 8
    # Round 1 at p=1 proposes indices 3,4,5; then p = 1+3+1 = 5 proposes 7,8,9.
    chains = chains_from({1: [11, 12, 13], 5: [15, 16, 17]}, len(ids), 3)
    res = replay_greedy_speculation(chains, ids, prompt_len=2)
    assert res["per_round"] == [3, 3]
    assert res["rounds"] == 2 and res["accepted"] == 6 and res["accepted_per_pos"] == [2, 2, 2]
    s = acceptance_summary(res["rounds"], res["accepted"], res["accepted_per_pos"])
    assert s["acceptance_length"] == 4.0 and s["acceptance_rate_per_position"] == [1.0, 1.0, 1.0]


def test_replay_partial_and_mid_round_end():
    ids = [1, 2, 3, 20, 21, 22, 23, 24, 25]        # prompt 3, output 6 (indices 3..8)
    chains = chains_from({
        2: [21, 99, 23],     # p=2: accept 21 (idx 4), reject at idx 5 -> n=1, p=4
        4: [22, 23, 24],     # p=4: proposes idx 6,7,8 = 23,24,25? no: 22 != 23 -> n=0, p=5
        5: [24, 25, 26],     # p=5: idx 7,8 match, idx 9 is past the end -> n=2, p=8: done
    }, len(ids), 3)
    res = replay_greedy_speculation(chains, ids, prompt_len=3)
    assert res["per_round"] == [1, 0, 2]
    assert res["accepted_per_pos"] == [2, 1, 0]
    # Tokens produced: 1 (prefill) + sum(n+1 per round) = 1 + 2 + 1 + 3 = 7 >= 6 outputs:
    # the last round's bonus token falls past the end, like vLLM at max_tokens.
    assert res["rounds"] == 3 and res["accepted"] == 3


def test_replay_ends_exactly_on_bonus_token():
    ids = [1, 2, 10, 11, 12]       # prompt 2, output 3
    chains = chains_from({1: [11, 0, 0], 3: [9, 9, 9]}, len(ids), 3)
    res = replay_greedy_speculation(chains, ids, prompt_len=2)
    # p=1: accept 11 (idx 3), reject idx 4 -> bonus 12 is the last token: done.
    assert res["per_round"] == [1]


def test_replay_short_outputs_have_no_rounds():
    # One output token comes from prefill alone: nothing is ever verified.
    assert replay_greedy_speculation(torch.zeros(4, 2, dtype=torch.long), [1, 2, 3, 4], 3)["rounds"] == 0
    assert replay_greedy_speculation(torch.zeros(3, 2, dtype=torch.long), [1, 2, 3], 3)["rounds"] == 0
    # Two output tokens: exactly one round; a correct guess for idx 4 cannot be accepted past the end.
    res = replay_greedy_speculation(chains_from({2: [8, 9]}, 5, 2), [1, 2, 3, 7, 8], 3)
    assert res["per_round"] == [1]


def test_replay_accepts_only_leading_prefix():
    ids = [1, 10, 11, 12, 13, 14]
    # Steps 0 wrong, steps 1 and 2 right: a later match after a miss is never accepted.
    chains = chains_from({0: [0, 12, 13]}, len(ids), 3)
    assert replay_greedy_speculation(chains, ids, 1)["per_round"][0] == 0


def test_replay_rejects_bad_shapes():
    with pytest.raises(ValueError, match="rows"):
        replay_greedy_speculation(torch.zeros(3, 2, dtype=torch.long), [1, 2, 3, 4], 2)
    with pytest.raises(ValueError, match="prompt_len"):
        replay_greedy_speculation(torch.zeros(3, 2, dtype=torch.long), [1, 2, 3], 0)


def test_compare_outputs_lists_mismatches():
    base = [{"id": "a", "output_token_ids": [1, 2, 3]}, {"id": "b", "output_token_ids": [4, 5]},
            {"id": "c", "output_token_ids": [6]}]
    spec = [{"id": "a", "output_token_ids": [1, 2, 3]}, {"id": "b", "output_token_ids": [4, 9]},
            {"id": "c", "output_token_ids": [6, 7]}]
    res = compare_outputs(base, spec)
    assert not res["passed"] and res["mismatched_ids"] == ["b", "c"]
    assert res["first_divergence"] == {"b": 1, "c": 1}
    assert compare_outputs(base, base)["passed"]


# ----------------------------------------------------------------------------- tiny target

def write_eval_prompts(path: Path, n: int) -> Path:
    words = ["fox", "dog", "hello", "quick", "lazy", "world", "brown", "today"]
    with open(path, "w") as f:
        for i in range(n):
            messages = [{"role": "user", "content": " ".join(words[(i + j) % 8] for j in range(3 + i % 4))}]
            if i % 2:
                messages.insert(0, {"role": "system", "content": "be brief"})
            f.write(json.dumps({"id": f"p{i}", "messages": messages}) + "\n")
    return path


@pytest.fixture(scope="module")
def chat_target(tmp_path_factory) -> Path:
    return make_chat_target(tmp_path_factory.mktemp("chat_target"))


def test_render_prompts_uses_chat_template(chat_target, tmp_path):
    from transformers import AutoTokenizer

    path = write_eval_prompts(tmp_path / "eval_prompts.jsonl", 5)
    prompts = render_prompts(path, chat_target, num_prompts=3)
    assert [p["id"] for p in prompts] == ["p0", "p1", "p2"]
    tok = AutoTokenizer.from_pretrained(str(chat_target))
    assistant = tok.convert_tokens_to_ids("<|assistant|>")
    for p in prompts:
        assert p["prompt_token_ids"][-1] == assistant          # add_generation_prompt=True
    assert tok.decode(prompts[1]["prompt_token_ids"]).startswith("<|system|>be brief</s><|user|>")

    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": "x", "messages": []}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:1"):
        render_prompts(bad, chat_target)


# ----------------------------------------------------------------------------- vLLM

def export_random_draft(target: Path, out_dir: Path, draft_tokens: list[int] | None = None,
                        seed: int = 0, std: float = 0.1) -> Path:
    """A random draft for ``target``, saved as training saves it, exported by export.py.

    ``draft_tokens``: the target ids of a reduced draft vocab; None = the full vocab. A
    reduced vocab of the tokens the target emits most makes a random draft that is right
    often enough to test acceptance, while which of them it picks still depends on every
    hidden state it is fed.
    """
    import numpy as np
    from safetensors.torch import save_file

    from eagle3flow.model.config import DraftConfig
    from eagle3flow.model.draft import Eagle3Draft
    from eagle3flow.export.checkpoint import export_draft
    from eagle3flow.layers import default_aux_layer_ids
    from eagle3flow.target.config import load_target_config
    from eagle3flow.data.vocab import vocab_maps

    config = load_target_config(target)
    vocab = int(config["vocab_size"])
    tokens = np.array(sorted(set(draft_tokens)) if draft_tokens else range(vocab), dtype=np.int64)
    d2t, t2d = vocab_maps(tokens, vocab)
    cfg = DraftConfig.from_target_config(config, default_aux_layer_ids(config["num_hidden_layers"]),
                                         len(tokens))
    torch.manual_seed(seed)
    model = Eagle3Draft(cfg)
    model.reset_parameters(std=std)
    with torch.no_grad():
        model.d2t.copy_(d2t)
        model.t2d.copy_(t2d)
    train_dir = out_dir.parent / f"{out_dir.name}_train"
    train_dir.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in model.trainable_state_dict().items()},
              str(train_dir / "draft.safetensors"))
    (train_dir / "draft_config.json").write_text(json.dumps(cfg.to_dict()))
    save_file({"d2t": d2t, "t2d": t2d}, str(train_dir / "vocab_map.safetensors"))
    return export_draft(train_dir, train_dir / "vocab_map.safetensors", target, out_dir)


def hf_greedy(target: Path, prompts: list[dict], max_new_tokens: int) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(target), dtype=torch.float32).eval()
    outputs = []
    for p in prompts:
        ids = torch.tensor([p["prompt_token_ids"]])
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 max_new_tokens=max_new_tokens, eos_token_id=2, pad_token_id=0)
        outputs.append(out[0, ids.shape[1]:].tolist())
    return outputs


@pytest.mark.slow
def test_vllm_runner_subprocess_greedy(chat_target, tmp_path):
    """A real vLLM engine in a child process: greedy ids match HF's greedy decoding, and the
    two best raw logits it records per position (what judges a divergence) are HF's. Then
    seeded samples whose prompts overrun one step's token budget (8,192 here): vLLM 0.32 on
    CPU crashed rewinding the generator of a partly prefilled seeded request."""
    path = write_eval_prompts(tmp_path / "eval_prompts.jsonl", 3)
    prompts = render_prompts(path, chat_target)
    samples = 1 + 8192 // sum(len(p["prompt_token_ids"]) for p in prompts)
    request = {"target": str(chat_target), "prompts": prompts, "max_tokens": 12,
               "max_model_len": 128, "dtype": "float32", "device": "cpu", "top_logits": 2,
               "temperatures": [1.0], "samples_per_prompt": samples}
    t0 = time.monotonic()
    result = run_vllm(request, tmp_path / "run.json", log_path=tmp_path / "run.log")
    print(f"vLLM baseline run: {time.monotonic() - t0:.1f}s")
    assert result["device"] == "cpu" and result["dtype"] == "float32"
    assert result["spec_decode"] is None
    assert [o["id"] for o in result["outputs"]] == ["p0", "p1", "p2"]
    assert result["num_output_tokens"] == sum(len(o["output_token_ids"]) for o in result["outputs"])
    assert result["output_tokens_per_s"] > 0
    sampled = [o for run in result["temperature_runs"] for st in run["sets"] for o in st["outputs"]]
    assert len(sampled) == samples * len(prompts) and all(o["output_token_ids"] for o in sampled)

    for p, o, hf_out in zip(prompts, result["outputs"], hf_greedy(chat_target, prompts, 12)):
        assert o["prompt_len"] == len(p["prompt_token_ids"])
        assert o["output_token_ids"] == hf_out, p["id"]

    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(str(chat_target), dtype=torch.float32).eval()
    for o in result["outputs"]:
        assert len(o["top_logits"]) == len(o["output_token_ids"])
        with torch.no_grad():
            logits = model(torch.tensor([o["prompt_token_ids"] + o["output_token_ids"]])).logits[0]
        for j, top in enumerate(o["top_logits"]):
            values, tokens = logits[o["prompt_len"] - 1 + j].topk(2)
            assert [t for t, _ in top] == tokens.tolist() and top[0][0] == o["output_token_ids"][j]
            assert [v for _, v in top] == pytest.approx(values.tolist(), abs=1e-4), (o["id"], j)


def test_vllm_runner_bad_request_fails_clearly(tmp_path):
    with pytest.raises(RuntimeError, match="vLLM run failed"):
        run_vllm({"target": str(tmp_path / "missing"), "prompts": []}, tmp_path / "r.json",
                 log_path=tmp_path / "r.log")
    assert "missing" in (tmp_path / "r.log").read_text()


def write_eval_split(path: Path, prompts: list[dict], outputs: list[list[int]]) -> Path:
    """A tokenized eval split (docs/formats.md): prompt + greedy answer, loss on the answer."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    ids = [p["prompt_token_ids"] + o for p, o in zip(prompts, outputs)]
    masks = [[0] * len(p["prompt_token_ids"]) + [1] * len(o) for p, o in zip(prompts, outputs)]
    pq.write_table(pa.table({
        "id": pa.array([p["id"] for p in prompts], pa.string()),
        "input_ids": pa.array(ids, pa.list_(pa.int32())),
        "loss_mask": pa.array(masks, pa.list_(pa.int8())),
        "num_tokens": pa.array([len(x) for x in ids], pa.int32())}), path)
    return path


@pytest.mark.slow
def test_evaluate_end_to_end_random_draft(chat_target, tmp_path, capsys):
    """Both vLLM engines, the replay and the eval split on a random draft whose reduced
    vocab (the target's 4 most frequent greedy tokens) makes it right part of the time:
    greedy outputs stay identical, and the replay reproduces vLLM's rounds exactly. The
    same two engines also sample at one temperature (no engine start added): vLLM's
    acceptance there has a bootstrap interval, the offline estimate falls in it, and the
    answers with and without the draft pass the distributional lossless test."""
    from collections import Counter

    from eagle3flow.extract.hf import extract
    from eagle3flow.eval.evaluate import main

    num_prompts, max_tokens, k = 6, 24, 3
    temperature, samples = 0.3, 8
    prompts_file = write_eval_prompts(tmp_path / "eval_prompts.jsonl", num_prompts)
    prompts = render_prompts(prompts_file, chat_target)
    outputs = hf_greedy(chat_target, prompts, max_tokens)
    frequent = [t for t, _ in Counter(t for o in outputs for t in o).most_common(4)]
    draft = export_random_draft(chat_target, tmp_path / "draft", draft_tokens=frequent)
    aux_ids = json.loads((draft / "config.json").read_text())["eagle_aux_hidden_state_layer_ids"]
    manifest = tmp_path / "hidden_states" / "manifest.json"
    extract(write_eval_split(tmp_path / "eval.parquet", prompts, outputs), chat_target, manifest,
            tmp_path / "cache", aux_layer_ids=aux_ids, device="cpu", split_name="eval")

    out = tmp_path / "eval" / "summary.json"
    t0 = time.monotonic()
    summary = evaluate(draft, chat_target, prompts_file, manifest, out, EvalOptions(num_speculative_tokens=k,
                       max_tokens=max_tokens, num_prompts=num_prompts, device="cpu",
                       temperatures=[0, temperature], samples_per_prompt=samples))
    print(f"evaluate end to end: {time.monotonic() - t0:.1f}s")
    assert json.loads(out.read_text())["agreement"] == summary["agreement"]

    vllm, sim = summary["vllm"], summary["simulated"]
    assert summary["lossless"]["passed"], summary["lossless"]
    assert summary["settings"]["num_speculative_tokens"] == k
    assert summary["settings"]["vllm_version"] and summary["settings"]["aux_layer_ids"] == aux_ids
    assert vllm["num_draft_tokens"] == k * vllm["num_drafts"]
    assert vllm["acceptance_length"] > 1.1, vllm          # the draft is right some of the time
    assert len(vllm["acceptance_rate_per_position"]) == k
    # vLLM's aggregate counters equal the sum of its per-request counts.
    per_prompt = summary["per_prompt"]
    assert sum(p["vllm_accepted"] for p in per_prompt) == vllm["num_accepted_tokens"]
    assert sum(p["vllm_rounds"] for p in per_prompt) == vllm["num_drafts"]
    # The replay sees what vLLM did, round by round (vLLM's last round may also count
    # drafts accepted past max_tokens, which the replay cannot see).
    assert summary["round_agreement"]["prompts_rounds_equal_but_last"] == num_prompts
    assert summary["agreement_ok"] and abs(summary["agreement"] - 1) <= 0.15
    assert sim["num_output_tokens"] == sum(len(o) for o in outputs)
    split = summary["eval_split"]
    assert len(split["step_accuracy"]) == k and set(split["simulated_acceptance_length"]) == {"1", "2", "3"}

    assert summary["settings"]["replay"]["run"] and summary["settings"]["replay"]["setting"] == "auto"
    assert "fit" in summary["settings"]["replay"]["reason"]

    # At temperature, in the same engines: the greedy keys above are where they were.
    assert summary["settings"]["temperatures"] == [0.0, temperature]
    assert summary["settings"]["draft_sample_method"] == "probabilistic"   # vLLM 0.32 has it
    hot = summary["by_temperature"][repr(temperature)]
    served, offline, lossless = hot["vllm"], hot["offline"], hot["lossless"]
    assert served["num_generations"] == num_prompts * samples
    assert served["num_draft_tokens"] == k * served["num_drafts"] and served["num_accepted_tokens"] > 0
    assert served["ci_low"] <= served["acceptance_length"] <= served["ci_high"], served
    assert "bootstrap over prompts" in served["ci_method"]
    # CI's check: the offline estimate (rejection sampling along the target's own sampled
    # answers) agrees with vLLM within its interval.
    assert offline["within_ci"], (offline, served)
    assert lossless["passed"] and lossless["num_prompts"] == num_prompts, lossless
    assert lossless["num_samples"] == 2 * num_prompts * samples and "permutation" in lossless["test"]
    # The CPU build's broken expand kernel was replaced (else answers at temperature collapse
    # toward the argmax with a draft, which the lossless test above would fail).
    engine = json.loads((out.parent / "vllm_eagle3.json").read_text())
    assert engine["cpu_expand_kernel"] == "replaced" and engine["draft_sample_method"] == "probabilistic"
    assert f"T={temperature:g} vLLM AL" in capsys.readouterr().err      # the summary's lines
    print(f"T={temperature}: vLLM AL {served['acceptance_length']:.3f} "
          f"[{served['ci_low']:.3f}, {served['ci_high']:.3f}], offline {offline['acceptance_length']:.3f}, "
          f"greedy {vllm['acceptance_length']:.3f}, lossless p={lossless['p_value']:.3f}")

    # A rerun through the CLI reuses both vLLM runs and every replayed prompt.
    capsys.readouterr()
    settings = {"num_speculative_tokens": k, "max_tokens": max_tokens, "num_prompts": num_prompts, "device": "cpu",
                "temperatures": [0, temperature], "samples_per_prompt": samples}
    with deadline(120, "a rerun that should start no vLLM engine"):
        main(["--draft", str(draft), "--target", str(chat_target), "--eval-prompts", str(prompts_file),
              "--eval-manifest", str(manifest), "--out", str(out), "--config-json", json.dumps(settings)])
    err = capsys.readouterr().err
    assert err.count("evaluate: reusing") == 2 and "evaluate[replay]" not in err
    assert "evaluate[estimate" not in err
    assert json.loads(out.read_text())["vllm"] == vllm

    # Without the replay (evaluate.replay: false, as auto decides for a target no device
    # holds): vLLM's acceptance and the lossless check are the same; the replay's numbers null.
    main(["--draft", str(draft), "--target", str(chat_target), "--eval-prompts", str(prompts_file),
          "--eval-manifest", str(manifest), "--out", str(out), "--config-json",
          json.dumps({**settings, "replay": False})])
    err = capsys.readouterr().err
    unreplayed = json.loads(out.read_text())
    assert "evaluate: replay skipped: evaluate.replay: false" in err and "replay                   skipped" in err
    assert unreplayed["vllm"] == vllm and unreplayed["lossless"] == summary["lossless"]
    assert unreplayed["simulated"] is None and unreplayed["acceptance_length_vs_k"] is None
    assert unreplayed["eval_split"] == summary["eval_split"]
    unreplayed_hot = unreplayed["by_temperature"][repr(temperature)]
    assert unreplayed_hot["vllm"] == served and unreplayed_hot["offline"] is None


def test_replay_is_skipped_for_a_target_no_device_holds(chat_target, tmp_path):
    """evaluate.replay auto reads the target's size from its safetensors headers: the small
    target is replayed; one whose header declares 4 TB of float32 weights (a sparse file: no
    disk taken) exceeds the host's memory and is not, with the sizes named."""
    from eagle3flow.eval.replay import replay_decision

    assert replay_decision("auto", chat_target, "cpu", "float32")["run"]
    huge = tmp_path / "huge"
    huge.mkdir()
    header = json.dumps({"w": {"dtype": "BF16", "shape": [1 << 20, 1 << 20], "data_offsets": [0, 1 << 41]}}).encode()
    with open(huge / "model.safetensors", "wb") as f:
        f.write(len(header).to_bytes(8, "little") + header)
        f.truncate(8 + len(header) + (1 << 41))
    decision = replay_decision("auto", huge, "cpu", "float32")
    assert not decision["run"] and decision["target_bytes"] == 4 << 40   # widened to float32
    assert "4,398.0 GB" in decision["reason"] and "exceed" in decision["reason"]
    assert replay_decision(True, huge, "cpu", "float32")["run"]          # asked for: tried anyway


# ----------------------------------------------------------------------------- prompt sets, drafts

def test_load_prompt_set_reads_mt_bench_and_messages(chat_target, tmp_path):
    from transformers import AutoTokenizer

    from eagle3flow.eval.prompt_sets import load_prompt_set

    tok = AutoTokenizer.from_pretrained(str(chat_target))
    mixed = tmp_path / "mixed.jsonl"
    mixed.write_text(
        json.dumps({"question_id": 7, "category": "math", "turns": ["one plus one?", "and two?"]}) + "\n"
        + json.dumps({"id": "m1", "messages": [{"role": "user", "content": "hello"}]}) + "\n")
    s = load_prompt_set("mine", mixed, tok)
    assert [c["id"] for c in s["conversations"]] == ["7"] and s["conversations"][0]["turns"][1] == "and two?"
    assert [p["id"] for p in s["prompts"]] == ["m1"]
    assert s["category_of"] == {"7": "math", "m1": "mine"}   # no category: the set's name

    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"question_id": 1, "turns": []}) + "\n")
    with pytest.raises(ValueError, match=r"bad.jsonl:1 \(id 1\): 'turns'"):
        load_prompt_set("bad", bad, tok)
    bad.write_text(json.dumps({"turns": ["x"]}) + "\n")
    with pytest.raises(ValueError, match=r"bad.jsonl:1: need an 'id'"):
        load_prompt_set("bad", bad, tok)


def mt_bench_chat_target(out_dir: Path, questions: Path) -> Path:
    """A random Llama with a 2048-token BPE tokenizer trained on the MT-bench questions
    themselves (about 4 characters a token, so prompts stay short and the test cheap)
    and room for the longest question plus a second turn."""
    make_random_llama(out_dir, vocab_size=2048, heads=2, kv_heads=1)
    config = json.loads((out_dir / "config.json").read_text())
    config["max_position_embeddings"] = 2048
    (out_dir / "config.json").write_text(json.dumps(config))
    texts = [t for line in questions.read_text().splitlines() if line.strip()
             for t in json.loads(line)["turns"]]
    save_bpe_chat_tokenizer(out_dir, texts + ["the quick brown fox jumps over the lazy dog"] * 20, 2048)
    return out_dir


@pytest.mark.slow
def test_mt_bench_and_two_drafts_side_by_side(tmp_path):
    """All 80 MT-bench questions, answered turn by turn in vLLM, with two drafts on the
    same prompts in one run: one row per category, both drafts in one table."""
    from conftest import SHARED
    from transformers import AutoTokenizer

    from eagle3flow.report.render import evaluation_html

    questions = SHARED / "data" / "mt_bench" / "question.jsonl"
    if not questions.exists():
        pytest.skip(f"{questions} not present (the repo's sibling shared/ data)")
    rows = [json.loads(line) for line in questions.read_text().splitlines() if line.strip()]
    categories = {r["category"] for r in rows}
    target = mt_bench_chat_target(tmp_path / "target", questions)
    eval_prompts = write_eval_prompts(tmp_path / "eval_prompts.jsonl", 2)
    prompts = render_prompts(eval_prompts, target)
    # A reduced draft vocab of the tokens the target emits most (as in the test above).
    from collections import Counter
    from transformers import AutoTokenizer as _Tok
    _tok = _Tok.from_pretrained(str(target))
    probe = prompts + [{"id": str(r["question_id"]), "prompt_token_ids": _tok.apply_chat_template(
        [{"role": "user", "content": r["turns"][0]}], add_generation_prompt=True, tokenize=True,
        return_dict=True)["input_ids"]} for r in rows[::10]]
    frequent = [t for t, _ in Counter(t for o in hf_greedy(target, probe, 6) for t in o).most_common(4)]
    draft_a = export_random_draft(target, tmp_path / "draft_a", draft_tokens=frequent, seed=0)
    draft_b = export_random_draft(target, tmp_path / "draft_b", draft_tokens=frequent, seed=1)

    t0 = time.monotonic()
    summary = evaluate(draft_a, target, eval_prompts, None, tmp_path / "eval" / "summary.json", EvalOptions(
                       num_speculative_tokens=2, max_tokens=6, num_prompts=2, device="cpu",
                       draft_name="new", prompt_sets={"mt_bench": str(questions)},
                       compare_drafts={"mine": str(draft_b)}, replay_max_k=3))
    print(f"MT-bench x 2 drafts: {time.monotonic() - t0:.1f}s")

    mt = summary["prompt_sets"]["mt_bench"]
    assert mt["num_prompts"] == 80 and mt["multi_turn"]
    assert mt["num_generations"] == sum(len(r["turns"]) for r in rows)
    for draft in ("new", "mine"):
        r = summary["results"]["mt_bench"][draft]
        assert set(r["per_category"]) == categories
        assert sum(c["generations"] for c in r["per_category"].values()) == mt["num_generations"]
        # Per-category counts add up to vLLM's own counters for the set.
        assert sum(c["vllm_accepted"] for c in r["per_category"].values()) == r["vllm"]["num_accepted_tokens"]
        assert r["lossless"]["passed"], r["lossless"]
        assert set(r["acceptance_length_vs_k"]) == {"1", "2", "3"}
        # The replay sees vLLM's rounds; over 160 generations a random draft's near-tie
        # argmax may flip between HF and vLLM kernels in one or two of them.
        agree = r["round_agreement"]
        assert agree["prompts_compared"] == mt["num_generations"]
        assert agree["prompts_rounds_equal_but_last"] >= 0.95 * mt["num_generations"], agree
    # Each draft was served by its own engine, on the same baseline.
    for draft, run in (("new", "vllm_eagle3"), ("mine", "vllm_eagle3_mine")):
        served = json.loads((tmp_path / "eval" / f"{run}.json").read_text())["speculative_config"]
        assert Path(served["model"]) == Path(summary["drafts"][draft]).resolve()
    assert summary["results"]["mt_bench"]["new"]["vllm"]["num_accepted_tokens"] > 0

    # Turn 2's prompt holds turn 1's greedy answer.
    baseline = json.loads((tmp_path / "eval" / "vllm_baseline.json").read_text())
    outputs = {o["id"]: o for s in baseline["sets"] if s["name"] == "mt_bench" for o in s["outputs"]}
    tok = AutoTokenizer.from_pretrained(str(target))
    first, second = outputs["81#1"], outputs["81#2"]
    answer = tok.decode(first["output_token_ids"], skip_special_tokens=True)
    assert first["prompt_token_ids"] == second["prompt_token_ids"][:len(first["prompt_token_ids"])]
    assert f"<|assistant|>{answer}</s><|user|>{rows[0]['turns'][1]}" in tok.decode(second["prompt_token_ids"])

    page = evaluation_html(summary)
    drafts_table = page.split('id="drafts"')[1].split("</table>")[0]
    for set_name in ("eval", "mt_bench"):
        for draft in ("new", "mine"):
            assert f'data-set="{set_name}" data-draft="{draft}"' in drafts_table
    mt_table = page.split('id="categories-mt_bench"')[1].split("</table>")[0]
    assert mt_table.count("<tr data-category=") == len(categories)
    assert "new: accepted tokens" in mt_table and "mine: accepted tokens" in mt_table


def test_unset_tensor_parallelism_takes_the_gpus_the_job_sees(monkeypatch):
    """evaluate.tensor_parallel_size null on a node with GPUs (config.evaluate_settings leaves
    it unset): every CUDA device the job sees; the CPU build (this torch on the CPU runs
    vLLM): 1, not one worker per GPU the stage wrapper gave the job; a separate vLLM
    (evaluate.vllm_python): the devices CUDA_VISIBLE_DEVICES names."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3,4,5,6,7")
    assert job_gpus(torch.device("cpu"), None) == 1
    assert job_gpus(torch.device("cpu"), "/opt/vllm-cuda/bin/python") == 8
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    assert job_gpus(torch.device("cuda"), None) == 8


# ----------------------------------------------------------------------------- at temperature

def test_acceptance_length_ci_is_a_bootstrap_over_prompts():
    from eagle3flow.eval.confidence import CI_METHOD, acceptance_length_ci, within

    # Every prompt accepts 1 of 2 drafts: no spread, the interval is the point.
    flat = acceptance_length_ci([(1, 2)] * 10)
    assert flat["acceptance_length"] == 1.5 and flat["ci_low"] == flat["ci_high"] == 1.5
    assert "bootstrap over prompts" in flat["method"] == CI_METHOD or "bootstrap" in CI_METHOD
    # Half the prompts accept everything, half nothing: the ratio of sums is 1.5, and
    # the 95% interval is about 1.5 +- 1.96 * sqrt(0.25 / 40) = 1.5 +- 0.155.
    mixed = acceptance_length_ci([(4, 4), (0, 4)] * 20)
    assert mixed["acceptance_length"] == 1.5 and mixed["num_prompts"] == 40
    assert mixed["ci_low"] == pytest.approx(1.345, abs=0.04)
    assert mixed["ci_high"] == pytest.approx(1.655, abs=0.04)
    assert within(1.5, mixed) and not within(1.8, mixed) and within(None, mixed) is None
    # A prompt without a round carries nothing; one informative prompt gives no interval.
    one = acceptance_length_ci([(2, 4), (0, 0)])
    assert one["acceptance_length"] == 1.5 and one["ci_low"] is None and one["num_prompts"] == 1
    with pytest.raises(ValueError, match="confidence"):
        acceptance_length_ci([(1, 2)], confidence=1.0)


def test_offline_estimate_closed_form_on_tiny_distributions():
    """Per step, acceptance is sum_x min(p, q); a round of K accepts N with
    P(N >= i) = prod alpha; the walk is the expectation over where rounds start."""
    from eagle3flow.train.rejection_estimate import (acceptance_length, expected_acceptance,
                                                    step_acceptance, tempered)

    p = torch.tensor([0.5, 0.3, 0.2])
    q = torch.tensor([0.2, 0.6, 0.2])
    assert step_acceptance(p, q).item() == pytest.approx(0.2 + 0.3 + 0.2)
    assert tempered(torch.tensor([1.0, 3.0]), 0).tolist() == [0.0, 1.0]
    assert tempered(torch.tensor([0.0, 2.0 * 0.5]), 0.5).tolist() == pytest.approx(
        torch.softmax(torch.tensor([0.0, 2.0]), 0).tolist())

    # A long answer, alpha = a at every step, K = 2: one round accepts
    # E[N] = a + a^2; the next round starts N + 1 later.
    a, total = 0.5, 4
    walk = expected_acceptance([[a, a]] * total, prompt_len=1, total=total)
    # Rows: a round at 0 (indices 2, 3 may be accepted), then, from where it left, at 1
    # (N = 0, p = 1/2) with only index 3 left, or at 2 (N = 1, p = 1/4): no round (past the end).
    assert walk["rounds"] == pytest.approx(1 + 0.5)
    assert walk["accepted"] == pytest.approx((a + a * a) + 0.5 * a)
    assert walk["accepted_per_pos"] == pytest.approx([a + 0.5 * a, a * a])
    assert acceptance_length([walk]) == pytest.approx(1 + (0.75 + 0.25) / 1.5)


def test_offline_estimate_is_the_greedy_replay_where_alpha_is_0_or_1():
    from eagle3flow.train.rejection_estimate import expected_acceptance

    ids = [1, 2, 3, 20, 21, 22, 23, 24, 25]
    chains = chains_from({2: [21, 99, 23], 4: [22, 23, 24], 5: [24, 25, 26]}, len(ids), 3)
    replay = replay_greedy_speculation(chains, ids, prompt_len=3)
    # alpha 1 where the draft's guess is the next token, 0 elsewhere.
    alpha = [[float(t + 2 + j < len(ids) and chains[t, j].item() == ids[t + 2 + j]) for j in range(3)]
             for t in range(len(ids))]
    walk = expected_acceptance(alpha, prompt_len=3, total=len(ids))
    assert walk["rounds"] == replay["rounds"] and walk["accepted"] == replay["accepted"]
    assert walk["accepted_per_pos"] == replay["accepted_per_pos"]


def test_bad_temperature_settings_are_refused_before_anything_loads(tmp_path):
    """Named by their key, before the draft, the tokenizer or an engine is read (the draft
    directory here does not even exist)."""
    prompts = write_eval_prompts(tmp_path / "eval_prompts.jsonl", 1)
    missing = tmp_path / "no_draft"
    with pytest.raises(ValueError, match="evaluate.temperatures"):
        evaluate(missing, missing, prompts, None, tmp_path / "s.json", EvalOptions(temperatures=[0, -0.5]))
    with pytest.raises(ValueError, match="evaluate.samples_per_prompt"):
        evaluate(missing, missing, prompts, None, tmp_path / "s.json",
                 EvalOptions(temperatures=[0.6], samples_per_prompt=1))
    with pytest.raises(FileNotFoundError):      # greedy alone: those settings are not read
        evaluate(missing, missing, prompts, None, tmp_path / "s.json", EvalOptions(samples_per_prompt=1))
