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

from eagle3flow.progress import Progress
from eagle3flow.shards import atomic_write_json
from eagle3flow.vllm_runner import render_prompts, run_vllm

EVAL_DEFAULTS = {
    "num_speculative_tokens": 3,   # K: draft tokens per round in vLLM and the replay
    "max_tokens": 64,              # greedy output tokens per prompt
    "num_prompts": 32,             # first N of eval_prompts.jsonl (None: all)
    "device": "auto",              # auto | cpu | cuda: vLLM platform and HF replay device
    "dtype": "auto",               # auto: float32 on CPU, bfloat16 on CUDA (vLLM and HF alike)
    "max_model_len": None,         # None: longest prompt + max_tokens + K + 8
    "tensor_parallel_size": 1,
    "vllm_python": None,           # Python with vLLM (None: this one)
    "ignore_eos": False,           # True: every prompt generates exactly max_tokens
    "eval_split_max_tokens": None, # cap on eval-split tokens for step accuracy (None: all)
    "agreement_tolerance": 0.15,   # |simulated / vLLM - 1| allowed before flagging
}
# Bump when the replay's meaning changes, so cached per-prompt replays are not reused.
REPLAY_VERSION = 1


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

    from eagle3flow.hidden_states import resolve_dtype, resolve_device
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
    print(f"evaluate: vLLM {name} run on {len(request['prompts'])} prompts "
          f"(log: {out_dir / (name + '.log')})", file=sys.stderr, flush=True)
    t0 = time.monotonic()
    result = run_vllm(request, out, python=python, log_path=out_dir / f"{name}.log")
    result["request_fingerprint"] = key
    atomic_write_json(out, result)
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


def simulate_on_outputs(draft_dir: Path, target_path: Path, prompts: list[dict],
                        outputs: list[dict], num_steps: int, device: str, dtype: str,
                        replay_path: Path, key: str) -> list[dict]:
    """Replay greedy speculation on each prompt + its vLLM greedy output (HF target + our draft).

    Per prompt: ``ids [T]`` = prompt + output, ``aux [T, A*H]`` from the HF target,
    ``chains [T, K]`` from the draft, then :func:`replay_greedy_speculation`. Each
    prompt's result is appended to ``replay_path`` as soon as it is done (resume).
    """
    import torch

    from eagle3flow.draft_model import Eagle3Draft
    from eagle3flow.hidden_states import capture, load_target

    done = _load_replays(replay_path, key)
    todo = [(p, o) for p, o in zip(prompts, outputs) if p["id"] not in done]
    if todo:
        torch_device, torch_dtype, _ = _resolve(device, dtype)
        aux_layer_ids = _read_draft_config(draft_dir)["eagle_aux_hidden_state_layer_ids"]
        print(f"evaluate: replay on {torch_device} ({torch_dtype}), aux layers {aux_layer_ids}, "
              f"{len(done)} prompts cached", file=sys.stderr, flush=True)
        target = load_target(target_path, torch_dtype, torch_device)
        draft = Eagle3Draft.from_exported(draft_dir, target_path, dtype=torch_dtype,
                                          device=torch_device).eval()
        progress = Progress("evaluate[replay]", total=len(prompts), unit="prompts",
                            done=len(done))
        with open(replay_path, "a") as f:
            for prompt, output in todo:
                ids = list(prompt["prompt_token_ids"]) + list(output["output_token_ids"])
                input_ids = torch.tensor([ids], dtype=torch.long, device=torch_device)
                aux, _ = capture(target, input_ids, torch.ones_like(input_ids), aux_layer_ids)
                chains = draft.predict_chains(aux[0], input_ids[0], num_steps)
                row = replay_greedy_speculation(chains.cpu(), ids, len(prompt["prompt_token_ids"]))
                row.update(id=prompt["id"], fingerprint=key)
                f.write(json.dumps(row) + "\n")
                f.flush()
                done[prompt["id"]] = row
                progress.update(1)
        progress.close()
    return [done[p["id"]] for p in prompts]


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


# ----------------------------------------------------------------------------- evaluate

def evaluate(draft_dir, target_path, eval_prompts_jsonl, eval_manifest, out_json,
             num_speculative_tokens: int = EVAL_DEFAULTS["num_speculative_tokens"],
             max_tokens: int = EVAL_DEFAULTS["max_tokens"],
             num_prompts: int | None = EVAL_DEFAULTS["num_prompts"],
             device: str = EVAL_DEFAULTS["device"], dtype: str = EVAL_DEFAULTS["dtype"],
             max_model_len: int | None = None, tensor_parallel_size: int = 1,
             vllm_python: str | None = None, ignore_eos: bool = False,
             eval_split_max_tokens: int | None = None,
             agreement_tolerance: float = EVAL_DEFAULTS["agreement_tolerance"]) -> dict:
    """Run the whole evaluation and write ``out_json`` (summary); returns the summary dict.

    ``eval_manifest`` may be None to skip the eval-split step accuracy.
    """
    draft_dir, target_path, out_json = Path(draft_dir), Path(target_path), Path(out_json)
    k = int(num_speculative_tokens)
    if k < 1:
        raise ValueError(f"num_speculative_tokens must be >= 1, got {k}")
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    if not Path(eval_prompts_jsonl).is_file():
        raise FileNotFoundError(f"{eval_prompts_jsonl}: eval prompts file missing")
    draft_config = _read_draft_config(draft_dir)
    out_dir = out_json.parent
    out_dir.mkdir(parents=True, exist_ok=True)
    t_start = time.monotonic()

    prompts = render_prompts(eval_prompts_jsonl, target_path, num_prompts)
    longest = max(len(p["prompt_token_ids"]) for p in prompts)
    if max_model_len is None:
        max_model_len = longest + max_tokens + k + 8
    elif longest + max_tokens > max_model_len:
        raise ValueError(f"max_model_len {max_model_len} < longest prompt ({longest} tokens) + "
                         f"max_tokens {max_tokens}")
    torch_device, _, dtype_name = _resolve(device, dtype)
    vllm_device = device if device == "auto" else torch_device.type
    base_request = {
        "target": str(target_path.resolve()), "prompts": prompts, "max_tokens": int(max_tokens),
        "max_model_len": int(max_model_len), "dtype": dtype_name, "device": vllm_device,
        "tensor_parallel_size": int(tensor_parallel_size), "ignore_eos": bool(ignore_eos),
        "target_stamp": _dir_stamp(target_path),   # only for the fingerprint
    }
    baseline = _cached_vllm_run("vllm_baseline", base_request, out_dir, vllm_python)
    spec_request = dict(base_request, speculative_config={
        "method": "eagle3", "model": str(draft_dir.resolve()), "num_speculative_tokens": k},
        draft_stamp=_dir_stamp(draft_dir))
    speculative = _cached_vllm_run("vllm_eagle3", spec_request, out_dir, vllm_python)

    counters = speculative["spec_decode"]
    vllm_acc = acceptance_summary(counters["num_drafts"], counters["num_accepted_tokens"],
                                  counters["num_accepted_tokens_per_pos"])
    vllm_acc["num_draft_tokens"] = counters["num_draft_tokens"]
    vllm_acc["draft_acceptance_rate"] = (counters["num_accepted_tokens"] / counters["num_draft_tokens"]
                                         if counters["num_draft_tokens"] else None)
    base_tps, spec_tps = baseline["output_tokens_per_s"], speculative["output_tokens_per_s"]
    vllm_acc.update(baseline_output_tokens_per_s=base_tps, eagle3_output_tokens_per_s=spec_tps,
                    speedup=spec_tps / base_tps if base_tps and spec_tps else None,
                    baseline_wall_time_s=baseline["wall_time_s"],
                    eagle3_wall_time_s=speculative["wall_time_s"])
    lossless = compare_outputs(baseline["outputs"], speculative["outputs"])

    # The replay is keyed by what determines it: the baseline outputs, the draft, K, dtype.
    replay_key = _fingerprint([REPLAY_VERSION, baseline["request_fingerprint"],
                               _dir_stamp(draft_dir), k, dtype_name, torch_device.type])
    replays = simulate_on_outputs(draft_dir, target_path, prompts, baseline["outputs"], k,
                                  device, dtype, out_dir / "replay.jsonl", replay_key)
    rounds = sum(r["rounds"] for r in replays)
    accepted = sum(r["accepted"] for r in replays)
    per_pos = [sum(r["accepted_per_pos"][j] for r in replays) for j in range(k)]
    simulated = acceptance_summary(rounds, accepted, per_pos)
    simulated["num_output_tokens"] = sum(len(o["output_token_ids"]) for o in baseline["outputs"])

    eval_split = None
    if eval_manifest is not None:
        eval_split = _evaluate_split(draft_dir, target_path, eval_manifest, k, torch_device,
                                     eval_split_max_tokens)

    agreement = (simulated["acceptance_length"] / vllm_acc["acceptance_length"]
                 if simulated["acceptance_length"] and vllm_acc["acceptance_length"] else None)
    summary = {
        "settings": {
            "num_speculative_tokens": k, "num_prompts": len(prompts), "max_tokens": int(max_tokens),
            "max_model_len": int(max_model_len), "device": speculative["device"],
            "replay_device": torch_device.type, "dtype": dtype_name,
            "tensor_parallel_size": int(tensor_parallel_size), "ignore_eos": bool(ignore_eos),
            "vllm_version": speculative["vllm_version"], "draft": str(draft_dir),
            "target": str(target_path), "eval_prompts": str(eval_prompts_jsonl),
            "eval_manifest": str(eval_manifest) if eval_manifest is not None else None,
            "aux_layer_ids": draft_config["eagle_aux_hidden_state_layer_ids"],
        },
        "vllm": vllm_acc,
        "lossless": lossless,
        "simulated": simulated,
        "agreement": agreement,
        "agreement_tolerance": agreement_tolerance,
        "agreement_ok": agreement is not None and abs(agreement - 1.0) <= agreement_tolerance,
        "round_agreement": _round_agreement(replays, speculative["outputs"]),
        "eval_split": eval_split,
        "per_prompt": _per_prompt(replays, baseline["outputs"], speculative["outputs"]),
        "elapsed_s": time.monotonic() - t_start,
    }
    atomic_write_json(out_json, summary)
    print(format_summary(summary), file=sys.stderr, flush=True)
    return summary


def _evaluate_split(draft_dir: Path, target_path: Path, eval_manifest, k: int, torch_device,
                    max_tokens: int | None) -> dict:
    import torch

    from eagle3flow.draft_model import Eagle3Draft
    from eagle3flow.train import evaluate_split

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
    if s.get("eval_split"):
        e = s["eval_split"]
        lines.append(f"  eval split step accuracy [{', '.join(_fmt(a) for a in e['step_accuracy'])}], "
                     f"simulated acceptance {e['simulated_acceptance_length']}")
    return "\n".join(lines)


def main(argv=None) -> None:
    """CLI; individual flags, or ``--config-json '<the evaluate config section>'`` whose keys
    (see EVAL_DEFAULTS) are overridden by any flag given explicitly.

    python -m eagle3flow.evaluate --draft results/draft --target DIR \\
        --eval-prompts results/dataset/eval_prompts.jsonl \\
        --eval-manifest results/hidden_states/eval/manifest.json \\
        --out results/eval/summary.json [--num-speculative-tokens 3] [--max-tokens 64] \\
        [--num-prompts 32] [--device auto] [--dtype auto] [--max-model-len N] \\
        [--tensor-parallel-size 1] [--vllm-python PATH] [--ignore-eos] \\
        [--eval-split-max-tokens N] [--config-json JSON]
    """
    parser = argparse.ArgumentParser(prog="python -m eagle3flow.evaluate", description=main.__doc__,
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
    if config["num_prompts"] is not None and int(config["num_prompts"]) <= 0:
        config["num_prompts"] = None
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    evaluate(args.draft, args.target, args.eval_prompts, args.eval_manifest, args.out, **config)


if __name__ == "__main__":
    main()
