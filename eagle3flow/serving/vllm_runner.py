"""Run one vLLM engine over token-id prompts in a subprocess and record what it did.

Why a subprocess: vLLM keeps memory, threads and a global Prometheus registry for the
life of the process, so two engines (baseline and speculative) in one process would
mix their counters; a child process per engine also lets the caller use another
Python (a CUDA build of vLLM in its own venv) through ``--python``.

Request JSON (written by :func:`run_vllm`, read by :func:`main`)::

    {"target": DIR, "prompts": [{"id": str, "prompt_token_ids": [int, ...]}, ...],
     "sets": null | [{"name": str, "prompts": [...as above...],
                      "conversations": [{"id": str, "messages": [...], "turns": [str, ...]}]}],
     "chat_template_kwargs": {},
     "speculative_config": null | {"method": "eagle3", "model": DRAFT_DIR,
                                   "num_speculative_tokens": K},
     "max_tokens": 64, "max_model_len": 2048, "dtype": "auto", "device": "auto",
     "tensor_parallel_size": 1, "enforce_eager": null, "gpu_memory_utilization": 0.85,
     "ignore_eos": false, "seed": 0, "trust_remote_code": false, "top_logits": 0,
     "temperatures": [], "samples_per_prompt": 4, "sample_seed": 0,
     "probabilistic_draft": false}

Result JSON::

    {"vllm_version", "device", "dtype", "speculative_config", "load_time_s", "wall_time_s",
     "num_output_tokens", "output_tokens_per_s",
     "outputs": [{"id", "prompt_len", "prompt_token_ids", "output_token_ids", "finish_reason",
                  "conversation", "turn", "top_logits" (with top_logits N > 0),
                  "spec_decode": null | {"histogram", "num_draft_tokens",
                                         "per_step_accepted", "per_step_drafted"}}],
     "spec_decode": null | {"num_drafts", "num_draft_tokens", "num_accepted_tokens",
                            "num_accepted_tokens_per_pos": [K ints]},
     "sets": [{"name", "wall_time_s", "num_output_tokens", "output_tokens_per_s",
               "outputs": [...], "spec_decode": ...}],
     "draft_sample_method": null | "greedy" | "probabilistic", "draft_sample_note": str,
     "cpu_expand_kernel": null | str (the CPU build's fix: eagle3flow/serving/vllm_cpu_fixes.py),
     "temperature_runs": [{"temperature", "sets": [{"name", "wall_time_s", "num_output_tokens",
                            "outputs": [{"id", "sample", "seed", "prompt_token_ids",
                                         "output_token_ids", "finish_reason", "spec_decode"}],
                            "spec_decode": ...}]}]}

Prompt sets (``sets``; without it ``prompts`` is one set named ``default``) run one
after the other in the same engine, each timed on its own. A set's ``prompts`` are
single generations; its ``conversations`` are answered turn by turn (MT-bench): turn
``t``'s prompt is ``messages`` + the user turns so far with this engine's own greedy
answers in between, rendered here with the target's chat template; their outputs are
named ``<id>#<turn>`` (turn from 1). Top-level ``outputs``/timings/counters are the
totals over all sets.

``top_logits`` N > 0: every output also carries, per generated position, the engine's
own N best next tokens with their raw logits (``[[token, logit], ...]``, best first; vLLM's
``logprobs_mode="raw_logits"``). What judges a greedy divergence (eagle3flow/eval/agreement.py)
without loading the target a second time, and in the numbers the serving engine computed.
They come from a second, untimed pass of the same batch: the timings are of plain decoding.

Greedy decoding (temperature 0) first. Then, for each of ``temperatures`` (each > 0), in
the same engine (an engine start costs more than the sampling here): every single prompt of
every set, and every conversation's first turn, sampled ``samples_per_prompt`` times, each
sample with its own seed (:func:`sample_seed`, a function of the request's ``sample_seed``,
the set, the prompt and the sample's index: the baseline and every speculative engine draw
with the same seeds). ``probabilistic_draft``: the draft samples its proposals at the
request's temperature (vLLM's ``draft_sample_method: probabilistic``) where this vLLM has it;
``draft_sample_method`` in the result says what ran, ``draft_sample_note`` why.

Prompts are token ids rendered by the caller, so
every engine sees exactly the same input. This module imports only the standard
library at import time: it must run under any Python that has vLLM.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import zlib
from pathlib import Path

from eagle3flow.atomic import write_json
from eagle3flow.jsonl import iter_jsonl
from eagle3flow.progress import Progress
from eagle3flow.serving.vllm_cpu_fixes import fix_expand_kernel, whole_prompt_prefill
from eagle3flow.target.config import is_wrapper, load_target_config, read_config_file
from eagle3flow.target.tokenizer import load_tokenizer

SPEC_COUNTERS = {
    "vllm:spec_decode_num_drafts": "num_drafts",
    "vllm:spec_decode_num_draft_tokens": "num_draft_tokens",
    "vllm:spec_decode_num_accepted_tokens": "num_accepted_tokens",
}
SPEC_PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos"

REQUEST_DEFAULTS = {
    "speculative_config": None,
    "max_tokens": 64,
    "max_model_len": 2048,
    "dtype": "auto",
    "device": "auto",
    "tensor_parallel_size": 1,
    "enforce_eager": None,          # None: True on CPU (no graph capture there), False on GPU
    "gpu_memory_utilization": 0.85,
    "ignore_eos": False,
    "seed": 0,
    "sets": None,
    "chat_template_kwargs": {},
    "trust_remote_code": False,     # target.trust_remote_code: the engine's and the tokenizer's
    "top_logits": 0,                # N best raw logits per generated position (module doc)
    "temperatures": [],             # sampled runs after the greedy one (module doc)
    "samples_per_prompt": 4,
    "sample_seed": 0,
    "probabilistic_draft": False,
    "dense_mla_on_cpu": False,      # an MLA target's attention run dense on the CPU (cpu_engine_options)
}


def render_prompts(eval_prompts_jsonl: str | os.PathLike, target_path: str | os.PathLike,
                   num_prompts: int | None = None, trust_remote_code: bool = False) -> list[dict]:
    """Render ``{"id", "messages"}`` rows with the target's chat template into token ids.

    Done here, outside vLLM, so the baseline and speculative engines (and the HF replay)
    all see identical ids. Returns ``[{"id", "prompt_token_ids"}]`` for the first
    ``num_prompts`` rows (all when None).
    """
    tokenizer = load_tokenizer(target_path, trust_remote_code)
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(f"{target_path}: the tokenizer has no chat_template; cannot render "
                         f"the eval prompts")
    prompts = []
    for where, row in iter_jsonl(eval_prompts_jsonl):
        if num_prompts is not None and len(prompts) >= num_prompts:
            break
        messages = row.get("messages") if isinstance(row, dict) else None
        if not isinstance(messages, list) or not messages or "id" not in row:
            raise ValueError(f"{where}: need fields 'id' and a non-empty 'messages' list")
        encoded = tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                tokenize=True, return_dict=True)
        ids = [int(t) for t in encoded["input_ids"]]
        if not ids:
            raise ValueError(f"{where} (id {row['id']}): renders to no tokens")
        prompts.append({"id": str(row["id"]), "prompt_token_ids": ids})
    if not prompts:
        raise ValueError(f"{eval_prompts_jsonl}: no prompts")
    return prompts


def run_vllm(request: dict, out_json: str | os.PathLike, python: str | None = None,
             timeout: float | None = None, log_path: str | os.PathLike | None = None) -> dict:
    """Run :func:`generate` in a child ``python -m eagle3flow.serving.vllm_runner``; return its result.

    ``python`` selects the interpreter that has vLLM (default: this one). The child's
    stdout/stderr go to ``log_path`` when given (else inherited, i.e. the rule's log).
    """
    out_json = Path(out_json)
    out_json.parent.mkdir(parents=True, exist_ok=True)
    request_path = out_json.with_name(out_json.stem + ".request.json")
    with open(request_path, "w") as f:
        json.dump(request, f)
    env = dict(os.environ)
    # The child may be another venv without eagle3flow installed: put this repo first.
    repo_root = str(Path(__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (repo_root, env.get("PYTHONPATH")) if p)
    env.setdefault("HF_HUB_OFFLINE", "1")
    cmd = [python or sys.executable, "-m", "eagle3flow.serving.vllm_runner",
           "--request", str(request_path), "--out", str(out_json)]
    if out_json.exists():
        out_json.unlink()
    log = open(log_path, "w") if log_path else None
    try:
        proc = subprocess.run(cmd, env=env, stdout=log, stderr=subprocess.STDOUT if log else None,
                              timeout=timeout)
    finally:
        if log:
            log.close()
    if proc.returncode != 0 or not out_json.exists():
        where = f"; see {log_path}" if log_path else ""
        raise RuntimeError(f"vLLM run failed (exit {proc.returncode}): {' '.join(cmd)}{where}")
    with open(out_json) as f:
        return json.load(f)


def _spec_decode_counters(metrics) -> dict:
    """Sum vLLM's spec-decode Prometheus counters over engines (labels)."""
    totals = {name: 0 for name in SPEC_COUNTERS.values()}
    per_pos: list[int] = []
    for metric in metrics:
        if metric.name in SPEC_COUNTERS:
            totals[SPEC_COUNTERS[metric.name]] += int(metric.value)
        elif metric.name == SPEC_PER_POS:
            values = list(metric.values)
            per_pos += [0] * (len(values) - len(per_pos))
            for i, v in enumerate(values):
                per_pos[i] += int(v)
    totals["num_accepted_tokens_per_pos"] = per_pos
    return totals


def _counter_delta(after: dict, before: dict) -> dict:
    delta = {k: after[k] - before[k] for k in SPEC_COUNTERS.values()}
    pos_before = before["num_accepted_tokens_per_pos"]
    pos_before = pos_before + [0] * (len(after["num_accepted_tokens_per_pos"]) - len(pos_before))
    delta["num_accepted_tokens_per_pos"] = [
        a - b for a, b in zip(after["num_accepted_tokens_per_pos"], pos_before)]
    return delta


def _request_metrics(completion) -> dict | None:
    m = getattr(completion, "spec_decode_metrics", None)
    if m is None:
        return None
    return {"histogram": list(m.histogram), "num_draft_tokens": int(m.num_draft_tokens),
            "per_step_accepted": list(m.per_step_accepted),
            "per_step_drafted": list(m.per_step_drafted)}


def engine_arg_names() -> set[str]:
    """The keyword arguments the installed vLLM's ``LLM(...)`` takes (its ``EngineArgs``
    fields): what the engine options below are chosen by, rather than by version."""
    import dataclasses

    from vllm.engine.arg_utils import EngineArgs

    return {f.name for f in dataclasses.fields(EngineArgs)}


def spec_engine_options(arg_names: set[str]) -> dict:
    """Engine options of a speculative run that the installed vLLM may lack.

    ``per_request_spec_decode_metrics`` (0.32; absent in 0.25): acceptance per verify
    step for each request, so the replay can be compared prompt by prompt. Without it
    the outputs carry no ``spec_decode`` and the evaluation reports no round agreement
    (``round_agreement`` null); the acceptance itself comes from the engine's counters,
    which every supported vLLM has."""
    if "per_request_spec_decode_metrics" in arg_names:
        return {"per_request_spec_decode_metrics": "detailed"}
    return {}


def top_logits_options(arg_names: set[str], top_logits: int) -> dict:
    """Engine options that make a request's logprobs the raw logits (``top_logits`` > 0).

    Raw, not log-probabilities: whether two tokens tie is a question of their logits at the
    serving dtype's resolution (eagle3flow/eval/agreement.py), and a log-softmax moves their
    magnitude. A vLLM without ``logprobs_mode`` is refused: its logprobs would be judged as
    logits."""
    if not top_logits:
        return {}
    if "logprobs_mode" not in arg_names:
        raise RuntimeError("this vLLM has no logprobs_mode engine argument: it cannot report "
                           "raw logits, which the lossless check needs (top_logits); use a vLLM "
                           "of the tested range (README, vLLM)")
    return {"logprobs_mode": "raw_logits", "max_logprobs": max(20, int(top_logits))}


def engine_core_in_process(target: str | os.PathLike) -> bool:
    """Whether a one-worker engine may run its core in this process (no engine-core child
    to start, whose imports take seconds, or to leave behind when killed).

    Not for a multimodal wrapper (Kimi-K2.5): vLLM builds its input processor in this
    process first, importing the model's module (Kimi-K2.5's imports numba for its image
    preprocessing), and then vLLM 0.32's CPU worker, rebinding Triton kernels by scanning
    every loaded module, meets llvmlite's library object, which answers even ``__dict__``
    with a function wrapper, and fails before the model loads ("'_lib_fn_wrapper' object
    has no attribute 'get'"). An engine core in a child process scans before it imports
    the model, as ``vllm serve`` does (tests/test_kimi_target.py shows both)."""
    return not is_wrapper(read_config_file(target))


def engine_process_env(target: str | os.PathLike) -> None:
    """Where a one-worker engine's core runs (:func:`engine_core_in_process`), for vLLM to
    read when the engine starts; a value already in the environment wins."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0" if engine_core_in_process(target) else "1")


def is_mla(target_config: dict) -> bool:
    """Multi-head latent attention (DeepSeek-V2/V3, Kimi-K2): ``kv_lora_rank`` in the config."""
    return "kv_lora_rank" in target_config


def cpu_engine_options(target_config: dict, dtype: str, dense_mla: bool = False) -> dict:
    """vLLM CPU engine options a target needs to compute what transformers computes.

    An MLA target: the CPU rotary custom op gives silently wrong MLA outputs (the native
    one is right); and on hosts with AMX, vLLM prefers its AMX MLA kernels, which take
    only bf16/fp16/int8 weights and refuse a float32 engine: there the reference CPU_MLA
    backend is asked for, unless ``dense_mla`` (``VLLM_MLA_DISABLE``, set by
    :func:`generate`) runs its attention as standard attention over the decompressed keys
    and values, the same function with another cache.
    """
    options: dict = {"enforce_eager": True}
    if is_mla(target_config):
        options["compilation_config"] = {"custom_ops": ["-rotary_embedding"]}
        if dtype == "float32" and not dense_mla:
            options["attention_config"] = {"backend": "CPU_MLA"}
    return options


def sample_seed(base: int, set_name: str, prompt_id: str, sample: int) -> int:
    """The seed of one sampled answer: the same in every engine of an evaluation, so the
    answers with and without the draft are drawn prompt by prompt, sample by sample, with
    the same seeds (a stable hash: Python's own is salted per process)."""
    return zlib.crc32(f"{base}/{set_name}/{prompt_id}/{sample}".encode()) & 0x7FFFFFFF


def draft_sampling(spec: dict, wanted: bool) -> tuple[dict, str | None, str]:
    """The speculative config with probabilistic draft sampling where it is ``wanted`` and
    the installed vLLM has it (``SpeculativeConfig.draft_sample_method``, 0.32); the method
    that runs and why. Without it the draft proposes its argmax at every temperature and
    the rejection sampler treats that as a one-hot proposal: acceptance reads low."""
    import dataclasses

    from vllm.config import SpeculativeConfig

    if not wanted:
        return spec, spec.get("draft_sample_method", "greedy"), "greedy requests only"
    if "draft_sample_method" not in {f.name for f in dataclasses.fields(SpeculativeConfig)}:
        return spec, "greedy", ("this vLLM has no draft_sample_method: EAGLE-3 drafts propose "
                                "greedily at temperature and acceptance reads low")
    return ({**spec, "draft_sample_method": "probabilistic"}, "probabilistic",
            "vLLM's draft_sample_method probabilistic: the draft samples at the request's "
            "temperature and the rejection sampler uses its full distribution")


def generate(request: dict) -> dict:
    """Load one engine, generate greedily for every prompt (then sampled at each of
    ``temperatures``), return the result dict."""
    request = {**REQUEST_DEFAULTS, **request}
    for field in ("target",):
        if field not in request:
            raise ValueError(f"vLLM request: missing field {field!r}")
    if not (Path(request["target"]) / "config.json").is_file():
        raise FileNotFoundError(f"vLLM request: target {request['target']} has no config.json")
    if not request.get("prompts") and not request.get("sets"):
        raise ValueError("vLLM request: no prompts")
    for prompt_set in request.get("sets") or []:
        if not prompt_set.get("prompts") and not prompt_set.get("conversations"):
            raise ValueError(f"vLLM request: set {prompt_set.get('name')!r} has no prompts")
    device = request["device"]
    if device == "cpu" or device == "auto":
        # Must be set before vLLM is imported; 1 GiB of KV cache is plenty for eval.
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    if int(request["tensor_parallel_size"]) == 1:
        # One engine, one process where the target allows (engine_core_in_process): no
        # engine-core/worker children to start (each would import torch and vLLM again) or
        # to leave behind; the counters are the engine's either way.
        engine_process_env(request["target"])
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.platforms import current_platform

    on_cpu = current_platform.is_cpu()
    cpu_fix = None
    if on_cpu:
        # Sampling at temperature with a draft needs it (eagle3flow/serving/vllm_cpu_fixes.py).
        cpu_fix = (fix_expand_kernel() if os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "0"
                   else "not applied: the engine core runs in a child process")
    if device == "auto":
        device = "cpu" if on_cpu else current_platform.device_type
    if device == "cpu" and not on_cpu:
        raise ValueError(f"device=cpu asked, but this vLLM build targets "
                         f"{current_platform.device_type}")
    if device != "cpu" and on_cpu:
        raise ValueError(f"device={device} asked, but this vLLM build ({vllm.__version__}) is "
                         f"CPU-only; pass the Python of a GPU build with --python")
    enforce_eager = request["enforce_eager"]
    if enforce_eager is None:
        enforce_eager = on_cpu
    spec = request["speculative_config"]
    kwargs = dict(model=str(request["target"]), dtype=request["dtype"],
                  max_model_len=int(request["max_model_len"]),
                  tensor_parallel_size=int(request["tensor_parallel_size"]),
                  enforce_eager=bool(enforce_eager), seed=int(request["seed"]),
                  trust_remote_code=bool(request["trust_remote_code"]),
                  disable_log_stats=False)  # get_metrics() asserts stat logging is on
    if int(request["tensor_parallel_size"]) == 1:
        kwargs["distributed_executor_backend"] = "uni"
    dense_mla = False
    if on_cpu:
        target_config = load_target_config(request["target"])
        # A DFlash draft beside an MLA target: vLLM's CPU MLA cache takes blocks of 16 and
        # its standard attention cache (the draft's) multiples of 32, and one engine's caches
        # must share a block size, so every engine of such an evaluation (the baseline too,
        # for the same arithmetic) runs the target's attention dense.
        mla = is_mla(target_config)
        dense_mla = bool(request["dense_mla_on_cpu"]) and mla
        if mla:                        # read when the engine's config is built; set either way,
            # so one inherited from the caller's environment cannot make the summary's
            # settings.mla_attention say what did not run
            os.environ["VLLM_MLA_DISABLE"] = "1" if dense_mla else "0"
        kwargs.update({k: v for k, v in cpu_engine_options(target_config, str(request["dtype"]),
                                                           dense_mla).items()
                       if k != "enforce_eager"})
    else:
        kwargs["gpu_memory_utilization"] = float(request["gpu_memory_utilization"])
    temperatures = [float(t) for t in request["temperatures"] or []]
    if any(t <= 0 for t in temperatures):
        raise ValueError(f"vLLM request: temperatures must be > 0 (the greedy run is always "
                         f"made), got {temperatures}")
    if on_cpu and temperatures:   # seeded requests on CPU (vllm_cpu_fixes.py says why)
        kwargs.update(whole_prompt_prefill(request["max_model_len"]))
    draft_method = draft_note = None
    if spec:
        spec, draft_method, draft_note = draft_sampling(
            dict(spec), bool(request["probabilistic_draft"]) and bool(temperatures))
        kwargs["speculative_config"] = dict(spec)
        backend = (kwargs.get("attention_config") or {}).get("backend")
        if backend:   # an MLA draft picks its own backend: the same one as its target
            kwargs["speculative_config"].setdefault("attention_backend", backend)
        kwargs.update(spec_engine_options(engine_arg_names()))
    top_logits = int(request["top_logits"])
    kwargs.update(top_logits_options(engine_arg_names() if top_logits else set(), top_logits))

    t0 = time.perf_counter()
    llm = LLM(**kwargs)
    load_time = time.perf_counter() - t0

    params = SamplingParams(temperature=0.0, max_tokens=int(request["max_tokens"]),
                            ignore_eos=bool(request["ignore_eos"]), logprobs=top_logits or None)
    sets = request["sets"] or [{"name": "default", "prompts": request["prompts"]}]
    first = next(([{"prompt_token_ids": list(p["prompt_token_ids"])}] for s in sets
                  for p in (s.get("prompts") or [])[:1]), None)
    tokenizer = None
    if any(s.get("conversations") for s in sets):
        tokenizer = load_tokenizer(request["target"], bool(request["trust_remote_code"]))
        if first is None:
            conv = next(c for s in sets for c in s.get("conversations") or [])
            first = [{"prompt_token_ids": _render_turn(tokenizer, _turn_messages(conv, 0, []),
                                                       request["chat_template_kwargs"])}]
    # Warm-up outside the timed run (first-call allocations, lazy kernel init); its
    # spec-decode counts are subtracted below.
    llm.generate(first, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True),
                 use_tqdm=False)
    progress = Progress("vllm[" + (spec["method"] if spec else "baseline") + "]",
                        total=sum(_num_generations(s) for s in sets), unit="generations")
    set_results = []
    for prompt_set in sets:
        progress.extra = f"set {prompt_set['name']}"
        set_results.append(_generate_set(llm, prompt_set, params, spec, tokenizer,
                                         request, progress))
    progress.close()
    temperature_runs = [sampled_run(llm, sets, t, spec, tokenizer, request) for t in temperatures]

    outputs = [o for r in set_results for o in r["outputs"]]
    wall = sum(r["wall_time_s"] for r in set_results)
    num_out = sum(r["num_output_tokens"] for r in set_results)
    totals = None
    if spec:
        totals = {k: sum(r["spec_decode"][k] for r in set_results) for k in SPEC_COUNTERS.values()}
        width = max(len(r["spec_decode"]["num_accepted_tokens_per_pos"]) for r in set_results)
        totals["num_accepted_tokens_per_pos"] = [
            sum((r["spec_decode"]["num_accepted_tokens_per_pos"] + [0] * width)[j]
                for r in set_results) for j in range(width)]
    return {
        "vllm_version": vllm.__version__,
        "device": device,
        "dtype": str(llm.llm_engine.model_config.dtype).replace("torch.", ""),
        "speculative_config": spec,
        "load_time_s": load_time,
        "wall_time_s": wall,
        "num_output_tokens": num_out,
        "output_tokens_per_s": num_out / wall if wall > 0 else None,
        "outputs": outputs,
        "spec_decode": totals,
        "sets": set_results,
        "draft_sample_method": draft_method,
        "draft_sample_note": draft_note,
        "cpu_expand_kernel": cpu_fix,
        "dense_mla": dense_mla,
        "temperature_runs": temperature_runs,
    }


def sampled_run(llm, sets: list[dict], temperature: float, spec, tokenizer, request: dict) -> dict:
    """Every set's prompts (and conversations' first turns) sampled at ``temperature``,
    ``samples_per_prompt`` answers each with their own seeds (:func:`sample_seed`); each
    set's spec-decode counters apart."""
    from vllm import SamplingParams

    n = int(request["samples_per_prompt"])
    if n < 1:
        raise ValueError(f"vLLM request: samples_per_prompt must be >= 1, got {n}")
    progress = Progress(f"vllm[{spec['method'] if spec else 'baseline'} T={temperature:g}]",
                        total=sum(len(_first_turns(s, tokenizer, request)) * n for s in sets),
                        unit="generations")
    results = []
    for prompt_set in sets:
        items = [dict(item, sample=j, seed=sample_seed(int(request["sample_seed"]),
                                                       prompt_set["name"], item["id"], j))
                 for item in _first_turns(prompt_set, tokenizer, request) for j in range(n)]
        params = [SamplingParams(temperature=temperature, top_p=1.0, seed=item["seed"],
                                 max_tokens=int(request["max_tokens"]),
                                 ignore_eos=bool(request["ignore_eos"])) for item in items]
        before = _spec_decode_counters(llm.get_metrics()) if spec else None
        t0 = time.perf_counter()
        done = llm.generate([{"prompt_token_ids": list(i["prompt_token_ids"])} for i in items],
                            params, use_tqdm=False)
        wall = time.perf_counter() - t0
        outputs = [{**item, "output_token_ids": [int(t) for t in r.outputs[0].token_ids],
                    "finish_reason": r.outputs[0].finish_reason,
                    "spec_decode": _request_metrics(r.outputs[0]) if spec else None}
                   for item, r in zip(items, done)]
        progress.update(len(items))
        num_out = sum(len(o["output_token_ids"]) for o in outputs)
        results.append({"name": prompt_set["name"], "wall_time_s": wall, "num_output_tokens": num_out,
                        "output_tokens_per_s": num_out / wall if wall > 0 else None,
                        "outputs": outputs,
                        "spec_decode": _counter_delta(_spec_decode_counters(llm.get_metrics()), before)
                                       if spec else None})
    progress.close()
    return {"temperature": temperature, "samples_per_prompt": n, "sets": results}


def _first_turns(prompt_set: dict, tokenizer, request: dict) -> list[dict]:
    """A set's single prompts and its conversations' first turns (later turns would hang on
    each engine's own sampled answers, so they are not the same prompts across engines)."""
    items = [{"id": p["id"], "prompt_token_ids": list(p["prompt_token_ids"])}
             for p in prompt_set.get("prompts") or []]
    items += [{"id": f"{c['id']}#1", "conversation": c["id"], "turn": 1,
               "prompt_token_ids": _render_turn(tokenizer, _turn_messages(c, 0, []),
                                                request["chat_template_kwargs"])}
              for c in prompt_set.get("conversations") or []]
    return items


def _without_logprobs(params):
    if not params.logprobs:
        return params
    timed = params.clone()
    timed.logprobs = None
    return timed


def _top_logits(completion, n: int) -> list[list[list]]:
    """Per generated position, the ``n`` best ``[token, raw logit]`` pairs, best first (vLLM
    adds the sampled token to the top ``n`` where it is not among them: dropped here)."""
    rows = []
    for position in completion.logprobs or []:
        best = sorted(position.items(), key=lambda item: item[1].rank)[:n]
        rows.append([[int(token), float(entry.logprob)] for token, entry in best])
    return rows


def _num_generations(prompt_set: dict) -> int:
    return (len(prompt_set.get("prompts") or [])
            + sum(len(c["turns"]) for c in prompt_set.get("conversations") or []))


def _turn_messages(conversation: dict, turn: int, answers: list[str]) -> list[dict]:
    """The messages before turn ``turn``'s answer: the conversation's own leading
    messages, then each user turn followed by its greedy answer."""
    messages = list(conversation.get("messages") or [])
    for t in range(turn + 1):
        messages.append({"role": "user", "content": conversation["turns"][t]})
        if t < turn:
            messages.append({"role": "assistant", "content": answers[t]})
    return messages


def _render_turn(tokenizer, messages: list[dict], template_kwargs: dict) -> list[int]:
    encoded = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                            return_dict=True, **(template_kwargs or {}))
    return [int(t) for t in encoded["input_ids"]]


def _generate_set(llm, prompt_set: dict, params, spec, tokenizer, request: dict,
                  progress) -> dict:
    """Generate one prompt set: its single prompts in one batch, then its conversations
    one turn at a time (every conversation's turn t in one batch)."""
    max_len = int(request["max_model_len"])
    before = _spec_decode_counters(llm.get_metrics()) if spec else None
    wall = 0.0
    outputs = []

    def run(items):
        nonlocal wall
        for item in items:
            if len(item["prompt_token_ids"]) + int(request["max_tokens"]) > max_len:
                raise ValueError(f"set {prompt_set['name']}, prompt {item['id']}: "
                                 f"{len(item['prompt_token_ids'])} tokens + max_tokens "
                                 f"{request['max_tokens']} > max_model_len {max_len}")
        batch = [{"prompt_token_ids": list(i["prompt_token_ids"])} for i in items]
        t0 = time.perf_counter()
        results = llm.generate(batch, _without_logprobs(params), use_tqdm=False)
        wall += time.perf_counter() - t0
        if params.logprobs:
            # An untimed second pass records the logits: computing them slowed vLLM 0.25's
            # decoding five-fold on an H200, which the baseline's tokens/s must not carry.
            results = llm.generate(batch, params, use_tqdm=False)
        done = []
        for item, r in zip(items, results):
            c = r.outputs[0]
            done.append({**{k: v for k, v in item.items() if k != "prompt_token_ids"},
                         "prompt_len": len(item["prompt_token_ids"]),
                         "prompt_token_ids": list(item["prompt_token_ids"]),
                         "output_token_ids": [int(t) for t in c.token_ids],
                         "finish_reason": c.finish_reason,
                         **({"top_logits": _top_logits(c, params.logprobs)} if params.logprobs else {}),
                         "spec_decode": _request_metrics(c) if spec else None})
        progress.update(len(items))
        return done

    prompts = prompt_set.get("prompts") or []
    if prompts:
        outputs += run([{"id": p["id"], "prompt_token_ids": p["prompt_token_ids"]}
                        for p in prompts])
    conversations = prompt_set.get("conversations") or []
    answers: dict[str, list[str]] = {c["id"]: [] for c in conversations}
    for turn in range(max((len(c["turns"]) for c in conversations), default=0)):
        active = [c for c in conversations if turn < len(c["turns"])]
        items = [{"id": f"{c['id']}#{turn + 1}", "conversation": c["id"], "turn": turn + 1,
                  "prompt_token_ids": _render_turn(tokenizer,
                                                   _turn_messages(c, turn, answers[c["id"]]),
                                                   request["chat_template_kwargs"])}
                 for c in active]
        done = run(items)
        for c, o in zip(active, done):
            answers[c["id"]].append(tokenizer.decode(o["output_token_ids"],
                                                     skip_special_tokens=True))
        outputs += done
    num_out = sum(len(o["output_token_ids"]) for o in outputs)
    return {"name": prompt_set["name"], "wall_time_s": wall, "num_output_tokens": num_out,
            "output_tokens_per_s": num_out / wall if wall > 0 else None, "outputs": outputs,
            "spec_decode": _counter_delta(_spec_decode_counters(llm.get_metrics()), before)
                           if spec else None}


def main(argv=None) -> None:
    """CLI: ``python -m eagle3flow.serving.vllm_runner --request REQ.json --out RESULT.json``.

    REQ.json is the request described in the module docstring; the result is written
    atomically to RESULT.json.
    """
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--request", required=True, help="request JSON (see module docstring)")
    parser.add_argument("--out", required=True, help="result JSON to write")
    args = parser.parse_args(argv)
    with open(args.request) as f:
        request = json.load(f)
    result = generate(request)
    out = Path(args.out)
    write_json(out, result, indent=None)


if __name__ == "__main__":
    main()
