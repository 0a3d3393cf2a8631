"""The fixes for the CPU build of vLLM that seeded sampling needs: whole-prompt prefill
(every CPU engine or server that samples) and, with a draft, the expand kernel.

vLLM 0.32 rewinds a request's generator when it drops the token sampled for a partly
prefilled prompt, which a CPU generator cannot do ("CPU Generator does not use offset"),
and the engine dies: :func:`whole_prompt_prefill` gives the options that prefill every
prompt in one step, so nothing is dropped.

vLLM 0.32's CPU stand-in for the rejection sampler's ``expand_kernel``
(``vllm.utils.cpu_triton_utils._expand_kernel_impl``) hands the C++ kernel int64 copies
of its tensors. For the per-request temperature (float) the expanded copy is written and
dropped, so the rejection sampler divides the target's logits by uninitialised memory:
with a draft, every answer at temperature collapses toward the target's argmax while
acceptance reads near zero (tests/test_evaluate.py's lossless test at temperature caught
it; greedy requests never read that buffer). :func:`fix_expand_kernel` probes the
installed function and, where it leaves a float output unwritten, replaces it with one
that expands in torch, before the engine registers its CPU kernels.

Only where the engine core runs in this process (vllm_runner.engine_core_in_process):
a child engine core imports vLLM afresh. The runner's result says whether it applied.
This module imports only the standard library at import time (vllm_runner's rule).
"""
from __future__ import annotations


def whole_prompt_prefill(max_model_len: int) -> dict:
    """Engine options (``LLM(**...)``; the server's flags say the same) under which no
    prompt is split over steps: chunked prefill off, and one step takes a whole prompt."""
    return {"enable_chunked_prefill": False, "max_num_batched_tokens": max(int(max_model_len), 8192)}


def _expand_in_torch(output, input_val, cu_num_tokens, replace_from, replace_to,
                     MAX_NUM_TOKENS=None):   # noqa: N803 - the kernel's own keyword
    """``output[t]`` = ``input_val[request of t]`` (``replace_from`` read as ``replace_to``),
    the requests' token ranges given by ``cu_num_tokens`` (cumulative ends)."""
    import torch

    ends = cu_num_tokens.to(torch.int64)
    counts = torch.diff(ends, prepend=ends.new_zeros(1))
    values = torch.where(input_val == replace_from,
                         torch.as_tensor(replace_to, dtype=input_val.dtype), input_val)
    expanded = values.repeat_interleave(counts)
    output[:expanded.numel()] = expanded.to(output.dtype)


def expand_kernel_is_broken(expand) -> bool:
    """Whether ``expand`` leaves a float output unwritten (the 0.32 behaviour)."""
    import torch

    output = torch.full((3,), -1.0)
    expand(output, torch.tensor([0.5, 2.0]), torch.tensor([1, 3]), 0, 1)
    return output.tolist() != [0.5, 2.0, 2.0]


def fix_expand_kernel() -> str:
    """Replace the CPU expand kernel where it is broken; returns what was done, for the
    result JSON (``"replaced"``, ``"not needed"`` or why not)."""
    try:
        from vllm.utils import cpu_triton_utils
    except ImportError:
        return "not needed (no CPU kernels in this vLLM)"
    original = getattr(cpu_triton_utils, "_expand_kernel_impl", None)
    if original is None:
        return "not needed (no CPU expand kernel in this vLLM)"
    try:
        # Registers the C++ kernels the probe calls. Through the platform, which picks the
        # library this CPU runs (_C_AVX2 / _C_AVX512 / _C): importing vllm._C itself executes
        # AVX-512 instructions and dies with SIGILL on an AVX2-only CPU.
        from vllm.platforms import current_platform

        current_platform.import_kernels()
        broken = expand_kernel_is_broken(original)
    except (ImportError, AttributeError, RuntimeError) as error:
        return f"not probed ({error})"
    if not broken:
        return "not needed"
    cpu_triton_utils._expand_kernel_impl = _expand_in_torch
    return "replaced"
