"""Evaluate an exported EAGLE-3 draft: vLLM's own acceptance, losslessness, and our simulation.

Four measurements, all written to ``summary.json`` (docs/formats.md, Evaluation):

1. vLLM, served as it will be: the target alone (baseline) and the target with the
   exported draft (``method: eagle3``), greedy, on the held-out prompts rendered once
   with the target's chat template. From vLLM's spec-decode counters:
   ``acceptance_length = 1 + accepted / drafts`` and per-position acceptance
   ``accepted_per_pos / drafts``. Lossless check: greedy outputs must be identical per
   prompt. Speedup = output tokens/s ratio (reported, meaningless on CPU).
2. The same acceptance simulated on vLLM's own baseline outputs: the HF target captures
   the aux states of ``prompt + output``, the draft predicts its chains
   (``Eagle3Draft.predict_chains``) and :func:`replay_greedy_speculation` replays greedy
   speculative decoding round by round. This is the number that must agree with (1);
   ``agreement = simulated / vLLM``.
3. Teacher-forced per-step accuracy and simulated acceptance on the eval split
   (``train.evaluate_split`` on the eval manifest).
4. The same for more prompt sets (MT-bench question files, answered turn by turn, or
   any ``{"id", "messages"}`` file, per category) and more drafts side by side (one
   vLLM engine per draft, all on the same baseline outputs), and the replayed
   acceptance length for every K up to the draft's TTT steps from the one baseline run
   (``acceptance_length_vs_k``); optionally vLLM itself at more Ks (``vllm_sweep_k``).

Resumable: each vLLM run's result and each prompt's replay are kept next to
``summary.json`` (``vllm_baseline.json``, ``vllm_eagle3.json``, ``replay.jsonl``), keyed
by a fingerprint of everything that determines them, and reused on a rerun.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time
from pathlib import Path

from eagle3flow.config import schema_defaults
from eagle3flow.jsonl import iter_jsonl
from eagle3flow.progress import Progress
from eagle3flow.atomic import write_json
from eagle3flow.serving.vllm_runner import run_vllm

# The config's `evaluate` section with its defaults (schemas/config.schema.yaml).
EVAL_DEFAULTS = schema_defaults("evaluate")
# Bump when the replay's meaning changes, so cached per-prompt replays are not reused.
REPLAY_VERSION = 2


# ----------------------------------------------------------------------------- replay

def replay_greedy_speculation(chains, token_ids, prompt_len: int) -> dict:
    """Replay greedy speculative decoding of one sequence against its known greedy output.

    ``chains [T, K]``: target ids, ``chains[t, j]`` = the draft's guess for index
    ``t+j+2`` given the target's states up to row ``t`` and ``token_ids[..t+1]``.
    ``token_ids [T]`` = prompt + the target's greedy output; ``prompt_len`` = prompt length.

    A round starts at ``p`` once the target has produced ``token_ids[p+1]`` (the first
    round at ``p = prompt_len - 1``, after prefill). The draft proposes indices
    ``p+2..p+K+1``; the accepted count ``n`` is the longest prefix equal to the actual
    greedy tokens (never past the end of the output); the target then adds its own
    token, so ``p += n + 1``. Rounds continue while a token remains to be generated.

    Returns ``{"rounds", "accepted", "accepted_per_pos" [K], "per_round" [rounds]}``.
    """
    chains = chains.tolist() if hasattr(chains, "tolist") else [list(c) for c in chains]
    ids = token_ids.tolist() if hasattr(token_ids, "tolist") else list(token_ids)
    total = len(ids)
    if len(chains) != total:
        raise ValueError(f"chains have {len(chains)} rows but the sequence has {total} tokens")
    if not 1 <= prompt_len <= total:
        raise ValueError(f"prompt_len {prompt_len} not in 1..{total}")
    k = len(chains[0]) if chains else 0
    per_round: list[int] = []
    p = prompt_len - 1
    while p + 2 <= total - 1:
        row = chains[p]
        n = 0
        while n < k and p + 2 + n < total and row[n] == ids[p + 2 + n]:
            n += 1
        per_round.append(n)
        p += n + 1
    return {"rounds": len(per_round), "accepted": sum(per_round),
            "accepted_per_pos": [sum(1 for n in per_round if n > j) for j in range(k)],
            "per_round": per_round}


def acceptance_summary(rounds: int, accepted: int, accepted_per_pos: list[int]) -> dict:
    """Acceptance length ``1 + accepted/rounds`` and per-position rates ``accepted_j / rounds``."""
    return {
        "acceptance_length": 1.0 + accepted / rounds if rounds else None,
        "acceptance_rate_per_position": [a / rounds if rounds else None for a in accepted_per_pos],
        "num_drafts": int(rounds),
        "num_accepted_tokens": int(accepted),
        "num_accepted_tokens_per_pos": [int(a) for a in accepted_per_pos],
    }


# ----------------------------------------------------------------------------- helpers

def _file_stamp(path: Path) -> list:
    st = path.stat()
    return [str(path.resolve()), st.st_size, st.st_mtime_ns]


def _dir_stamp(path: Path) -> list:
    """Cheap identity of a model dir: name, size and mtime of every file (never hashes weights)."""
    path = Path(path)
    return [_file_stamp(p) for p in sorted(path.iterdir()) if p.is_file()]


def _fingerprint(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:16]


def _read_draft_config(draft_dir: Path) -> dict:
    config_file = Path(draft_dir) / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(f"{config_file}: missing; --draft must be an exported draft dir")
    if not (Path(draft_dir) / "model.safetensors").is_file():
        raise FileNotFoundError(f"{draft_dir}/model.safetensors: missing")
    with open(config_file) as f:
        config = json.load(f)
    if not config.get("eagle_aux_hidden_state_layer_ids"):
        raise ValueError(f"{config_file}: no top-level eagle_aux_hidden_state_layer_ids")
    return config


def _resolve(device: str, dtype: str):
    import torch

    from eagle3flow.extract.hf import resolve_dtype, resolve_device
    torch_device = resolve_device(device)
    torch_dtype = resolve_dtype(dtype, torch_device)
    return torch_device, torch_dtype, str(torch_dtype).replace("torch.", "")


def _cached_vllm_run(name: str, request: dict, out_dir: Path, python: str | None) -> dict:
    """Run vLLM unless ``out_dir/name.json`` already holds this request's result."""
    out = out_dir / f"{name}.json"
    key = _fingerprint(request)
    if out.is_file():
        try:
            with open(out) as f:
                cached = json.load(f)
            if cached.get("request_fingerprint") == key:
                print(f"evaluate: reusing {out}", file=sys.stderr, flush=True)
                return cached
        except ValueError:
            pass
    sets = request.get("sets") or [{"prompts": request.get("prompts") or []}]
    generations = sum(len(s.get("prompts") or []) + sum(len(c["turns"]) for c in
                                                        s.get("conversations") or [])
                      for s in sets)
    print(f"evaluate: vLLM {name} run, {generations} generations in {len(sets)} prompt sets "
          f"(log: {out_dir / (name + '.log')})", file=sys.stderr, flush=True)
    t0 = time.monotonic()
    result = run_vllm(request, out, python=python, log_path=out_dir / f"{name}.log")
    result["request_fingerprint"] = key
    write_json(out, result)
    print(f"evaluate: vLLM {name} done in {time.monotonic() - t0:.0f}s "
          f"({result['output_tokens_per_s']:.1f} output tokens/s)", file=sys.stderr, flush=True)
    return result


def compare_outputs(baseline: list[dict], speculative: list[dict]) -> dict:
    """Greedy equality per prompt: ids that differ and where they first diverge."""
    spec_by_id = {o["id"]: o["output_token_ids"] for o in speculative}
    mismatched, first = [], {}
    for o in baseline:
        a, b = o["output_token_ids"], spec_by_id.get(o["id"])
        if b is None or a != b:
            mismatched.append(o["id"])
            if b is not None:
                first[o["id"]] = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y),
                                      min(len(a), len(b)))
    return {"passed": not mismatched, "num_prompts": len(baseline),
            "num_mismatched": len(mismatched), "mismatched_ids": mismatched,
            "first_divergence": first}


def _load_replays(path: Path, key: str) -> dict[str, dict]:
    done = {}
    if path.is_file():
        with open(path) as f:
            for line in f:
                try:
                    row = json.loads(line)
                except ValueError:
                    continue   # a line cut by a kill; that prompt is simply redone
                if row.get("fingerprint") == key:
                    done[row["id"]] = row
    return done


def simulate_on_outputs(draft_dir: Path, target_path: Path, units: list[dict], max_k: int,
                        device: str, dtype: str, replay_path: Path, key: str,
                        loaded: dict | None = None, label: str = "replay") -> dict[str, dict]:
    """Replay greedy speculation on each generation (prompt + its vLLM greedy output).

    ``units``: ``[{"key", "prompt_token_ids", "output_token_ids"}]``. Per unit: ``aux
    [T, A*H]`` from the HF target, ``chains [T, max_k]`` from the draft, then
    :func:`replay_greedy_speculation` for every K in ``1..max_k`` on the chains' first K
    columns: one draft pass gives the whole acceptance-vs-K curve, exactly as vLLM would
    have accepted at that K. Each unit's result is appended to ``replay_path`` as soon as
    it is done (resume). ``loaded`` keeps the HF target across drafts. Returns
    ``{unit key: {"by_k": {"K": replay}}}``.
    """
    import torch

    from eagle3flow.model.draft import Eagle3Draft
    from eagle3flow.extract.hf import capture, load_target

    done = _load_replays(replay_path, key)
    todo = [u for u in units if u["key"] not in done]
    if todo:
        torch_device, torch_dtype, _ = _resolve(device, dtype)
        aux_layer_ids = _read_draft_config(draft_dir)["eagle_aux_hidden_state_layer_ids"]
        print(f"evaluate: {label} on {torch_device} ({torch_dtype}), aux layers {aux_layer_ids}, "
              f"K=1..{max_k}, {len(done)} of {len(units)} generations cached",
              file=sys.stderr, flush=True)
        loaded = {} if loaded is None else loaded
        target_key = (str(target_path), str(torch_dtype), str(torch_device))
        if target_key not in loaded:
            loaded[target_key] = load_target(target_path, torch_dtype, torch_device)
        target = loaded[target_key]
        draft = Eagle3Draft.from_exported(draft_dir, target_path, dtype=torch_dtype,
                                          device=torch_device).eval()
        progress = Progress(f"evaluate[{label}]", total=len(units), unit="generations",
                            done=len(done))
        with open(replay_path, "a") as f:
            for unit in todo:
                ids = list(unit["prompt_token_ids"]) + list(unit["output_token_ids"])
                input_ids = torch.tensor([ids], dtype=torch.long, device=torch_device)
                aux, _ = capture(target, input_ids, torch.ones_like(input_ids), aux_layer_ids)
                chains = draft.predict_chains(aux[0], input_ids[0], max_k).cpu()
                row = {"id": unit["key"], "fingerprint": key, "by_k": {
                    str(k): replay_greedy_speculation(chains[:, :k], ids,
                                                      len(unit["prompt_token_ids"]))
                    for k in range(1, max_k + 1)}}
                f.write(json.dumps(row) + "\n")
                f.flush()
                done[unit["key"]] = row
                progress.update(1)
        progress.close()
    return {u["key"]: done[u["key"]] for u in units}


def _round_agreement(replays: list[dict], speculative: list[dict]) -> dict | None:
    """How many prompts' replayed rounds match vLLM's per-request accepted counts exactly.

    vLLM counts, in a request's last round, draft tokens accepted past ``max_tokens``
    (then cut), which the replay cannot see; rounds are compared without that last one.
    """
    by_id = {o["id"]: (o.get("spec_decode") or {}).get("per_step_accepted") for o in speculative}
    if not any(by_id.values()):
        return None
    exact = prefix_equal = compared = 0
    for r in replays:
        served = by_id.get(r["id"])
        if served is None:
            continue
        compared += 1
        exact += served == r["per_round"]
        prefix_equal += served[:-1] == r["per_round"][:-1]
    return {"prompts_compared": compared, "prompts_rounds_equal": exact,
            "prompts_rounds_equal_but_last": prefix_equal}


def _per_prompt(replays: list[dict], baseline: list[dict], speculative: list[dict]) -> list[dict]:
    spec_by_id = {o["id"]: o for o in speculative}
    rows = []
    for r, o in zip(replays, baseline):
        served = (spec_by_id.get(o["id"], {}).get("spec_decode") or {}).get("per_step_accepted")
        rows.append({"id": r["id"], "output_tokens": len(o["output_token_ids"]),
                     "rounds": r["rounds"], "accepted": r["accepted"],
                     "vllm_rounds": len(served) if served is not None else None,
                     "vllm_accepted": sum(served) if served is not None else None})
    return rows


# ----------------------------------------------------------------------------- prompt sets

def _render_messages(tokenizer, messages: list[dict]) -> list[int]:
    encoded = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                            return_dict=True)
    return [int(t) for t in encoded["input_ids"]]


def load_prompt_set(name: str, path, tokenizer, max_prompts: int | None = None) -> dict:
    """Read a prompt file into a set the vLLM runner generates.

    JSONL rows of either kind, mixed freely:

    * ``{"id", "messages": [...], "category"?}``: one generation; the messages (before
      the answer) are rendered here with the target's chat template.
    * MT-bench questions ``{"question_id" | "id", "category"?, "turns": [str, ...],
      "messages"?: [leading system messages]}``: answered turn by turn in vLLM; turn 2's
      prompt holds turn 1's greedy answer.

    A row's category defaults to the set's name. Returns ``{"name", "source", "prompts",
    "conversations", "category_of": {prompt or conversation id: category}}``.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"prompt set {name!r}: {path} not found")
    prompts, conversations, category_of = [], [], {}
    for where, row in iter_jsonl(path):
        if max_prompts is not None and len(category_of) >= max_prompts:
            break
        if not isinstance(row, dict):
            raise ValueError(f"{where}: not a JSON object")
        row_id = row.get("question_id", row.get("id"))
        if row_id is None:
            raise ValueError(f"{where}: need an 'id' (or MT-bench 'question_id')")
        row_id = str(row_id)
        if row_id in category_of:
            raise ValueError(f"{where}: id {row_id} appears twice")
        turns, messages = row.get("turns"), row.get("messages")
        if turns is not None:
            if (not isinstance(turns, list) or not turns
                    or not all(isinstance(t, str) and t for t in turns)):
                raise ValueError(f"{where} (id {row_id}): 'turns' must be a non-empty list "
                                 f"of non-empty strings")
            conversations.append({"id": row_id, "turns": turns,
                                  "messages": list(messages or [])})
        elif isinstance(messages, list) and messages:
            prompts.append({"id": row_id, "prompt_token_ids":
                            _render_messages(tokenizer, messages)})
        else:
            raise ValueError(f"{where} (id {row_id}): need 'turns' (MT-bench) or a "
                             f"non-empty 'messages' list")
        category_of[row_id] = str(row.get("category") or name)
    if not category_of:
        raise ValueError(f"prompt set {name!r}: {path} has no prompts")
    return {"name": name, "source": str(path), "prompts": prompts,
            "conversations": conversations, "category_of": category_of}


def _longest_context(prompt_set: dict, tokenizer, max_tokens: int) -> int:
    """Tokens the longest generation of a set can need (prompt + answer): for a
    conversation, its rendered user turns plus ``max_tokens`` per answer and some
    slack for re-tokenizing the answers."""
    longest = max((len(p["prompt_token_ids"]) + max_tokens for p in prompt_set["prompts"]),
                  default=0)
    for c in prompt_set["conversations"]:
        messages = list(c["messages"])
        for turn in c["turns"]:
            messages += [{"role": "user", "content": turn}, {"role": "assistant", "content": ""}]
        longest = max(longest, len(_render_messages(tokenizer, messages[:-1]))
                      + len(c["turns"]) * (max_tokens + 16))
    return longest


# ----------------------------------------------------------------------------- aggregation

def _vllm_acceptance(counters: dict, base_set: dict, spec_set: dict) -> dict:
    acc = acceptance_summary(counters["num_drafts"], counters["num_accepted_tokens"],
                             counters["num_accepted_tokens_per_pos"])
    acc["num_draft_tokens"] = counters["num_draft_tokens"]
    acc["draft_acceptance_rate"] = (counters["num_accepted_tokens"] / counters["num_draft_tokens"]
                                    if counters["num_draft_tokens"] else None)
    base_tps, spec_tps = base_set["output_tokens_per_s"], spec_set["output_tokens_per_s"]
    acc.update(baseline_output_tokens_per_s=base_tps, eagle3_output_tokens_per_s=spec_tps,
               speedup=spec_tps / base_tps if base_tps and spec_tps else None,
               baseline_wall_time_s=base_set["wall_time_s"],
               eagle3_wall_time_s=spec_set["wall_time_s"])
    return acc


def _replay_totals(replays: list[dict], k: int) -> dict:
    rows = [r["by_k"][str(k)] for r in replays]
    return acceptance_summary(sum(r["rounds"] for r in rows), sum(r["accepted"] for r in rows),
                              [sum(r["accepted_per_pos"][j] for r in rows) for j in range(k)])


def _per_category(prompt_set: dict, spec_outputs: list[dict], replays: dict, k: int) -> dict:
    """Accepted draft tokens per category, from vLLM's per-request counts and the replay."""
    table: dict[str, dict] = {}
    for o in spec_outputs:
        cat = prompt_set["category_of"][o.get("conversation") or o["id"]]
        row = table.setdefault(cat, {"generations": 0, "output_tokens": 0, "vllm_drafts": 0,
                                     "vllm_accepted": 0, "replay_drafts": 0,
                                     "replay_accepted": 0})
        served = (o.get("spec_decode") or {}).get("per_step_accepted") or []
        replay = replays[f"{prompt_set['name']}/{o['id']}"]["by_k"][str(k)]
        row["generations"] += 1
        row["output_tokens"] += len(o["output_token_ids"])
        row["vllm_drafts"] += len(served)
        row["vllm_accepted"] += sum(served)
        row["replay_drafts"] += replay["rounds"]
        row["replay_accepted"] += replay["accepted"]
    for row in table.values():
        for src in ("vllm", "replay"):
            drafts = row[f"{src}_drafts"]
            row[f"{src}_acceptance_length"] = (1 + row[f"{src}_accepted"] / drafts
                                               if drafts else None)
    return dict(sorted(table.items()))


def _set_result(prompt_set: dict, base_set: dict, spec_set: dict, replays: dict, k: int,
                max_k: int, tolerance: float) -> dict:
    """Everything measured for one draft on one prompt set."""
    name = prompt_set["name"]
    set_replays = [replays[f"{name}/{o['id']}"] for o in base_set["outputs"]]
    vllm_acc = _vllm_acceptance(spec_set["spec_decode"], base_set, spec_set)
    simulated = _replay_totals(set_replays, k)
    simulated["num_output_tokens"] = base_set["num_output_tokens"]
    agreement = (simulated["acceptance_length"] / vllm_acc["acceptance_length"]
                 if simulated["acceptance_length"] and vllm_acc["acceptance_length"] else None)
    at_k = [{"id": o["id"], **r["by_k"][str(k)]} for o, r in zip(base_set["outputs"], set_replays)]
    return {
        "vllm": vllm_acc,
        "lossless": compare_outputs(base_set["outputs"], spec_set["outputs"]),
        "simulated": simulated,
        "agreement": agreement,
        "agreement_ok": agreement is not None and abs(agreement - 1.0) <= tolerance,
        "round_agreement": _round_agreement(at_k, spec_set["outputs"]),
        "acceptance_length_vs_k": {str(j): _replay_totals(set_replays, j)["acceptance_length"]
                                   for j in range(1, max_k + 1)},
        "per_category": _per_category(prompt_set, spec_set["outputs"], replays, k),
        "per_prompt": _per_prompt(at_k, base_set["outputs"], spec_set["outputs"]),
    }


def _units(prompt_sets: list[dict], baseline: dict) -> list[dict]:
    by_name = {s["name"]: s for s in baseline["sets"]}
    return [{"key": f"{s['name']}/{o['id']}", "prompt_token_ids": o["prompt_token_ids"],
             "output_token_ids": o["output_token_ids"]}
            for s in prompt_sets for o in by_name[s["name"]]["outputs"]]


def _safe_name(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in name)


# ----------------------------------------------------------------------------- evaluate

def evaluate(draft_dir, target_path, eval_prompts_jsonl, eval_manifest, out_json,
             num_speculative_tokens: int = EVAL_DEFAULTS["num_speculative_tokens"],
             max_tokens: int = EVAL_DEFAULTS["max_tokens"],
             num_prompts: int | None = EVAL_DEFAULTS["num_prompts"],
             device: str = EVAL_DEFAULTS["device"], dtype: str = EVAL_DEFAULTS["dtype"],
             max_model_len: int | None = None, tensor_parallel_size: int | None = None,
             vllm_python: str | None = None, ignore_eos: bool = False,
             eval_split_max_tokens: int | None = None,
             agreement_tolerance: float = EVAL_DEFAULTS["agreement_tolerance"],
             draft_name: str = EVAL_DEFAULTS["draft_name"],
             prompt_sets: dict | None = None, prompt_set_num_prompts: int | None = None,
             compare_drafts: dict | None = None, replay_max_k: int | None = None,
             vllm_sweep_k: list | None = None, optional_prompt_sets: dict | None = None) -> dict:
    """Run the whole evaluation and write ``out_json`` (summary); returns the summary dict.

    Prompt sets: ``eval`` (the held-out prompts, first ``num_prompts``) plus
    ``prompt_sets {name: jsonl}`` (:func:`load_prompt_set`; first
    ``prompt_set_num_prompts`` rows each). Drafts: ``draft_dir`` (named ``draft_name``)
    plus ``compare_drafts {name: exported draft dir}``, each served by vLLM at K on
    every set and replayed for K = 1..``replay_max_k`` (default K) on the baseline's
    outputs. ``vllm_sweep_k``: more Ks the main draft is served at (one engine each).
    ``eval_manifest`` may be None to skip the eval-split step accuracy.

    The top-level ``vllm``/``simulated``/``lossless``/... keys are the main draft's on
    ``eval``; ``results[set][draft]`` holds every pair.
    """
    from transformers import AutoTokenizer

    draft_dir, target_path, out_json = Path(draft_dir), Path(target_path), Path(out_json)
    k = int(num_speculative_tokens)
    if k < 1:
        raise ValueError(f"num_speculative_tokens must be >= 1, got {k}")
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    if not Path(eval_prompts_jsonl).is_file():
        raise FileNotFoundError(f"{eval_prompts_jsonl}: eval prompts file missing")
    max_k = max(k, int(replay_max_k or k))
    sweep = sorted({int(x) for x in (vllm_sweep_k or [])})
    if any(x < 1 for x in sweep):
        raise ValueError(f"vllm_sweep_k: every K must be >= 1, got {sweep}")
    drafts = {draft_name: draft_dir}
    for name, path in (compare_drafts or {}).items():
        if name in drafts:
            raise ValueError(f"compare_drafts: name {name!r} is taken (the new draft is "
                             f"{draft_name!r}); pick another")
        drafts[name] = Path(path)
    draft_configs = {name: _read_draft_config(path) for name, path in drafts.items()}
    # Optional sets whose file is there (MT-bench beside a checkout), then the required ones.
    extra_sets = {**{name: path for name, path in (optional_prompt_sets or {}).items() if Path(path).is_file()},
                  **(prompt_sets or {})}
    tensor_parallel_size = int(tensor_parallel_size or 1)
    if "eval" in extra_sets:
        raise ValueError("prompt_sets: 'eval' is the held-out split's name; pick another")
    out_dir = out_json.parent
    out_dir.mkdir(parents=True, exist_ok=True)
    t_start = time.monotonic()

    tokenizer = AutoTokenizer.from_pretrained(str(target_path))
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(f"{target_path}: the tokenizer has no chat_template; cannot render "
                         f"the prompts")
    sets = [load_prompt_set("eval", eval_prompts_jsonl, tokenizer, num_prompts)]
    sets += [load_prompt_set(name, path, tokenizer, prompt_set_num_prompts)
             for name, path in extra_sets.items()]
    longest = max(_longest_context(s, tokenizer, int(max_tokens)) for s in sets)
    if max_model_len is None:
        max_model_len = longest + max([k] + sweep) + 8
    elif longest > max_model_len:
        raise ValueError(f"max_model_len {max_model_len} < longest prompt + max_tokens "
                         f"({longest} tokens)")
    torch_device, _, dtype_name = _resolve(device, dtype)
    vllm_device = device if device == "auto" else torch_device.type
    base_request = {
        "target": str(target_path.resolve()), "max_tokens": int(max_tokens),
        "sets": [{"name": s["name"], "prompts": s["prompts"],
                  "conversations": s["conversations"]} for s in sets],
        "max_model_len": int(max_model_len), "dtype": dtype_name, "device": vllm_device,
        "tensor_parallel_size": int(tensor_parallel_size), "ignore_eos": bool(ignore_eos),
        "target_stamp": _dir_stamp(target_path),   # only for the fingerprint
    }

    def spec_request(path: Path, num_tokens: int) -> dict:
        return dict(base_request, speculative_config={
            "method": "eagle3", "model": str(Path(path).resolve()),
            "num_speculative_tokens": int(num_tokens)}, draft_stamp=_dir_stamp(path))

    def run_name(name: str, num_tokens: int) -> str:
        base = "vllm_eagle3" if name == draft_name else f"vllm_eagle3_{_safe_name(name)}"
        return base if num_tokens == k else f"{base}_k{num_tokens}"

    runs = [("vllm_baseline", base_request)]
    runs += [(run_name(name, x), spec_request(path, x)) for x in [k] + [x for x in sweep if x != k]
             for name, path in drafts.items()]
    # Engine runs dominate on GPUs and CPUs alike: count them for the ETA.
    progress = Progress("evaluate[vLLM runs]", total=len(runs), unit="runs", interval=0)
    results = {}
    for name, request in runs:
        results[name] = _cached_vllm_run(name, request, out_dir, vllm_python)
        progress.update(1, extra=name)
    progress.close()
    baseline = results["vllm_baseline"]
    base_sets = {s["name"]: s for s in baseline["sets"]}

    # Replays are keyed by what determines them: the baseline outputs, the draft, K, dtype.
    units = _units(sets, baseline)
    loaded: dict = {}
    by_draft = {}
    for name, path in drafts.items():
        replay_key = _fingerprint([REPLAY_VERSION, baseline["request_fingerprint"],
                                   _dir_stamp(path), max_k, dtype_name, torch_device.type])
        replay_file = ("replay.jsonl" if name == draft_name
                       else f"replay_{_safe_name(name)}.jsonl")
        by_draft[name] = simulate_on_outputs(path, target_path, units, max_k, device, dtype,
                                             out_dir / replay_file, replay_key, loaded,
                                             label=f"replay {name}")
    loaded.clear()

    per_set: dict[str, dict] = {}
    for s in sets:
        per_set[s["name"]] = {}
        for name in drafts:
            spec_sets = {x["name"]: x for x in results[run_name(name, k)]["sets"]}
            per_set[s["name"]][name] = _set_result(s, base_sets[s["name"]],
                                                   spec_sets[s["name"]], by_draft[name], k,
                                                   max_k, agreement_tolerance)
    # vLLM itself at every swept K, for every draft: {set: {draft: {K: acceptance}}}.
    k_sweep_by_draft = {}
    for s in sets:
        k_sweep_by_draft[s["name"]] = {}
        for name in drafts:
            by_k = k_sweep_by_draft[s["name"]][name] = {}
            for x in sweep:
                spec_set = {y["name"]: y for y in results[run_name(name, x)]["sets"]}[s["name"]]
                acc = _vllm_acceptance(spec_set["spec_decode"], base_sets[s["name"]], spec_set)
                acc["lossless"] = compare_outputs(base_sets[s["name"]]["outputs"],
                                                  spec_set["outputs"])["passed"]
                by_k[str(x)] = acc
    k_sweep = {set_name: by_name[draft_name] for set_name, by_name in k_sweep_by_draft.items()}

    eval_split = None
    if eval_manifest is not None:
        eval_split = _evaluate_split(draft_dir, target_path, eval_manifest, max_k, torch_device,
                                     eval_split_max_tokens)

    main = per_set["eval"][draft_name]
    speculative = results["vllm_eagle3"]
    summary = {
        "settings": {
            "num_speculative_tokens": k, "num_prompts": len(base_sets["eval"]["outputs"]),
            "max_tokens": int(max_tokens), "replay_max_k": max_k, "vllm_sweep_k": sweep,
            "max_model_len": int(max_model_len), "device": speculative["device"],
            "replay_device": torch_device.type, "dtype": dtype_name,
            "tensor_parallel_size": int(tensor_parallel_size), "ignore_eos": bool(ignore_eos),
            "vllm_version": speculative["vllm_version"], "draft": str(draft_dir),
            "target": str(target_path), "eval_prompts": str(eval_prompts_jsonl),
            "eval_manifest": str(eval_manifest) if eval_manifest is not None else None,
            "aux_layer_ids": draft_configs[draft_name]["eagle_aux_hidden_state_layer_ids"],
        },
        "main_draft": draft_name,
        "drafts": {name: str(path) for name, path in drafts.items()},
        "prompt_sets": {s["name"]: {
            "source": s["source"], "num_prompts": len(s["category_of"]),
            "num_generations": len(base_sets[s["name"]]["outputs"]),
            "multi_turn": bool(s["conversations"]),
            "categories": sorted(set(s["category_of"].values())),
            "baseline_output_tokens_per_s": base_sets[s["name"]]["output_tokens_per_s"],
            "baseline_num_output_tokens": base_sets[s["name"]]["num_output_tokens"],
        } for s in sets},
        "results": {name: {d: {key: v for key, v in r.items() if key != "per_prompt"}
                           for d, r in by_set.items()} for name, by_set in per_set.items()},
        "vllm_k_sweep": k_sweep,
        "vllm_k_sweep_by_draft": k_sweep_by_draft,
        # The main draft on the held-out prompts, as before sets and drafts existed.
        "vllm": main["vllm"],
        "lossless": main["lossless"],
        "simulated": main["simulated"],
        "acceptance_length_vs_k": main["acceptance_length_vs_k"],
        "agreement": main["agreement"],
        "agreement_tolerance": agreement_tolerance,
        "agreement_ok": main["agreement_ok"],
        "round_agreement": main["round_agreement"],
        "eval_split": eval_split,
        "per_prompt": main["per_prompt"],
        "elapsed_s": time.monotonic() - t_start,
    }
    write_json(out_json, summary)
    print(format_summary(summary), file=sys.stderr, flush=True)
    return summary


def _evaluate_split(draft_dir: Path, target_path: Path, eval_manifest, k: int, torch_device,
                    max_tokens: int | None) -> dict:
    import torch

    from eagle3flow.model.draft import Eagle3Draft
    from eagle3flow.train.eval_split import evaluate_split

    print(f"evaluate: step accuracy on {eval_manifest}", file=sys.stderr, flush=True)
    # float32 like training's own eval, so the numbers compare with metrics.jsonl.
    draft = Eagle3Draft.from_exported(draft_dir, target_path, dtype=torch.float32,
                                      device=torch_device).eval()
    return evaluate_split(draft, eval_manifest, k, max_tokens=max_tokens)


def _fmt(x, spec=".3f"):
    return "n/a" if x is None else format(x, spec)


def format_summary(s: dict) -> str:
    v, sim, loss = s["vllm"], s["simulated"], s["lossless"]
    lines = [
        f"evaluate: K={s['settings']['num_speculative_tokens']} prompts={s['settings']['num_prompts']} "
        f"max_tokens={s['settings']['max_tokens']} device={s['settings']['device']} "
        f"vllm={s['settings']['vllm_version']}",
        f"  vLLM acceptance length   {_fmt(v['acceptance_length'])}  per position "
        f"[{', '.join(_fmt(a) for a in v['acceptance_rate_per_position'])}]",
        f"  simulated (replay)       {_fmt(sim['acceptance_length'])}  per position "
        f"[{', '.join(_fmt(a) for a in sim['acceptance_rate_per_position'])}]",
        f"  agreement sim/vLLM       {_fmt(s['agreement'])} "
        f"({'ok' if s['agreement_ok'] else 'OUTSIDE'} +-{s['agreement_tolerance']:.0%})",
        f"  lossless greedy          {'PASS' if loss['passed'] else 'FAIL'} "
        f"({loss['num_mismatched']}/{loss['num_prompts']} prompts differ"
        f"{': ' + ', '.join(map(str, loss['mismatched_ids'][:5])) if loss['mismatched_ids'] else ''})",
        f"  tokens/s                 baseline {_fmt(v['baseline_output_tokens_per_s'], '.1f')}, "
        f"eagle3 {_fmt(v['eagle3_output_tokens_per_s'], '.1f')}, speedup {_fmt(v['speedup'], '.2f')}x",
    ]
    if s.get("acceptance_length_vs_k"):
        lines.append("  replayed AL vs K          " + ", ".join(
            f"K={j}: {_fmt(a, '.2f')}" for j, a in s["acceptance_length_vs_k"].items()))
    for set_name, by_draft in (s.get("results") or {}).items():
        for draft, r in by_draft.items():
            lines.append(f"  [{set_name}] {draft:<12} vLLM AL {_fmt(r['vllm']['acceptance_length'])}"
                         f"  replay AL {_fmt(r['simulated']['acceptance_length'])}"
                         f"  speedup {_fmt(r['vllm']['speedup'], '.2f')}x"
                         f"  lossless {'PASS' if r['lossless']['passed'] else 'FAIL'}")
    if s.get("eval_split"):
        e = s["eval_split"]
        lines.append(f"  eval split step accuracy [{', '.join(_fmt(a) for a in e['step_accuracy'])}], "
                     f"simulated acceptance {e['simulated_acceptance_length']}")
    return "\n".join(lines)


def main(argv=None) -> None:
    """CLI; individual flags, or ``--config-json '<the evaluate config section>'`` whose keys
    (see EVAL_DEFAULTS) are overridden by any flag given explicitly.

    python -m eagle3flow.eval.evaluate --draft results/draft --target DIR \\
        --eval-prompts results/dataset/eval_prompts.jsonl \\
        --eval-manifest results/hidden_states/eval/manifest.json \\
        --out results/eval/summary.json [--num-speculative-tokens 3] [--max-tokens 64] \\
        [--num-prompts 32] [--device auto] [--dtype auto] [--max-model-len N] \\
        [--tensor-parallel-size 1] [--vllm-python PATH] [--ignore-eos] \\
        [--eval-split-max-tokens N] [--config-json JSON]
    """
    parser = argparse.ArgumentParser(prog="python -m eagle3flow.eval.evaluate", description=main.__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--draft", required=True, help="exported draft dir (config.json + model.safetensors)")
    parser.add_argument("--target", required=True, help="HF target model dir")
    parser.add_argument("--eval-prompts", required=True, help="eval_prompts.jsonl")
    parser.add_argument("--eval-manifest", default=None,
                        help="eval hidden-state manifest.json (omit to skip step accuracy)")
    parser.add_argument("--out", required=True, help="summary.json to write")
    parser.add_argument("--config-json", default=None, help="JSON object of EVAL_DEFAULTS keys")
    parser.add_argument("--num-speculative-tokens", type=int)
    parser.add_argument("--max-tokens", type=int)
    parser.add_argument("--num-prompts", type=int, help="0 or negative: all prompts")
    parser.add_argument("--device", help="auto | cpu | cuda")
    parser.add_argument("--dtype", help="auto | float32 | bfloat16 | float16")
    parser.add_argument("--max-model-len", type=int)
    parser.add_argument("--tensor-parallel-size", type=int)
    parser.add_argument("--vllm-python", help="Python interpreter whose environment has vLLM")
    parser.add_argument("--ignore-eos", action="store_true", default=None)
    parser.add_argument("--eval-split-max-tokens", type=int)
    parser.add_argument("--prompt-set", action="append", default=[], metavar="NAME=JSONL",
                        help="another prompt set (MT-bench questions or {id, messages} rows); repeat")
    parser.add_argument("--compare-draft", action="append", default=[], metavar="NAME=DIR",
                        help="another exported draft evaluated side by side; repeat")
    args = parser.parse_args(argv)

    config = dict(EVAL_DEFAULTS)
    if args.config_json:
        given = json.loads(args.config_json)
        unknown = sorted(set(given) - set(EVAL_DEFAULTS))
        if unknown:
            raise SystemExit(f"--config-json: unknown keys {unknown} (known: {sorted(EVAL_DEFAULTS)})")
        config.update(given)
    for key in EVAL_DEFAULTS:
        value = getattr(args, key, None)
        if value is not None:
            config[key] = value
    for flag, key in (("prompt_set", "prompt_sets"), ("compare_draft", "compare_drafts")):
        for item in getattr(args, flag):
            name, sep, path = item.partition("=")
            if not sep or not name or not path:
                raise SystemExit(f"--{flag.replace('_', '-')} {item!r}: expected NAME=PATH")
            config[key] = {**(config[key] or {}), name: path}
    if config["num_prompts"] is not None and int(config["num_prompts"]) <= 0:
        config["num_prompts"] = None
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    evaluate(args.draft, args.target, args.eval_prompts, args.eval_manifest, args.out, **config)


if __name__ == "__main__":
    main()
