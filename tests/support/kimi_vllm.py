"""vLLM engines on Kimi-K2.5-layout targets, run as a script (tests/test_kimi_target.py).

``python kimi_vllm.py REQUEST.json`` loads one engine per run of the request, in order,
and prints one ``RESULT {json}`` line per run: the greedy tokens with their logprobs and
the prompt's token ids, or the exception that stopped the engine. A script, not a test
helper: vLLM's engine processes are spawned, and what a failed engine leaves in its
process must not reach the test's.

A run: ``{"target", "dtype", "prompt", "max_tokens", "in_process"}``. ``in_process`` runs
the engine core in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, how the project's
extraction and evaluation run a single-GPU engine); otherwise in a child process, as
``vllm serve`` does. Either way the model runs in the engine core's process. vLLM reads that variable until an engine core starts in this
process, so in-process runs come last. The target's remote code is trusted, as a
Kimi-K2.5 deployment must.
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path


def run(request: dict) -> dict:
    from vllm import LLM, SamplingParams

    from eagle3flow.serving.vllm_runner import cpu_engine_options
    from eagle3flow.target.config import load_target_config

    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0" if request.get("in_process") else "1"
    kwargs = dict(model=request["target"], trust_remote_code=True, dtype=request["dtype"], seed=0,
                  max_model_len=256, max_num_seqs=2, distributed_executor_backend="uni")
    kwargs.update(cpu_engine_options(load_target_config(request["target"]), request["dtype"]))
    try:
        llm = LLM(**kwargs)
    except Exception as error:
        return {"error": type(error).__name__, "message": str(error)}
    params = SamplingParams(max_tokens=request["max_tokens"], temperature=0.0, logprobs=1)
    out = llm.generate([request["prompt"]], params)[0]
    completion = out.outputs[0]
    result = {"prompt_token_ids": list(out.prompt_token_ids), "token_ids": list(completion.token_ids),
              "logprobs": [step[token].logprob for step, token in zip(completion.logprobs, completion.token_ids)]}
    llm.llm_engine.engine_core.shutdown()
    return result


def main() -> None:
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))   # the checkout, for eagle3flow
    for request in json.loads(Path(sys.argv[1]).read_text()):
        print("RESULT " + json.dumps(run(request)), flush=True)


if __name__ == "__main__":
    main()
