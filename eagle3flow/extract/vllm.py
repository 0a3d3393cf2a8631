"""Hidden-state extraction through vLLM: the backend for targets only vLLM serves well.

It uses only vLLM's extension points: the ``extract_hidden_states`` speculative method
(vLLM stacks the target's aux hidden states of each scheduled token into a cache-only
KV layer) and a KV connector of ours (eagle3flow/extract/vllm_connector.py), loaded by module
path (``kv_connector_module_path``), that reads those states from the KV cache when a
request finishes and writes whole shards in the project's format (docs/formats.md)
with the same writer as the HF backend. Checks, plan, fingerprint, disk check and
manifest are the backend-neutral ones (:func:`eagle3flow.extract.extraction.prepare`,
with :data:`FINGERPRINT` in the cache key); here only the engine and the shard loop.

Data path of one shard (shapes: T tokens of a sample, A aux ids, C = A+1, H hidden)::

    driver  submit_shard            one request per sample, max_tokens=1,
                                    kv_transfer_params = {shard path, slot, id, loss_mask}
    engine  extract_hidden_states   cache-only layer <- [T, C, H] (sorted aux ids, then N)
    worker  ShardConnector          the request's blocks -> gather_sample (configured order,
                                    final norm, host copy); all samples in -> write the
                                    shard in a background thread (TP rank 0 only)
    driver  ShardWrite.result()     waits for the shard's entry file (written last),
                                    after the next shard's forward passes were submitted

The layer-id convention is the project's (eagle3flow/layers.py): id k = the input of
decoder layer k, which is exactly what vLLM captures for ``eagle_aux_hidden_state_layer_ids``
= k. vLLM returns the ids in ascending order whatever order they are given in; they are put
back in the configured order here. The stored last state is the final-norm output (what
lm_head consumes), as in the HF backend: vLLM hands over the pre-norm residual stream
for id N, so the target's own final RMSNorm weight is applied at this boundary.

vLLM CPU build specifics handled here: the rotary custom op is turned off (with it on,
MLA outputs are silently wrong); no pinned memory or CUDA streams on the CPU; the cache
group is found by the cache-only layer's name, not by spec type, so MLA targets (whose
KV cache forms a second group) work. This module imports vLLM only inside functions:
the extraction CLI (eagle3flow/extract/__main__.py) imports it whichever backend runs.
"""
from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from eagle3flow.extract import shards
from eagle3flow.extract.extraction import (LOADING_LINE, SHARD_DELAY_ENV, Extraction,
                                           check_disk_room, log, prepare, read_target_config,
                                           shards_to_compute)
from eagle3flow.extract.throughput import record_throughput, throughput_path
from eagle3flow.progress import Progress
from eagle3flow.serving.vllm_runner import cpu_engine_options, engine_process_env

CONNECTOR_NAME = "ShardConnector"
CONNECTOR_MODULE = "eagle3flow.extract.vllm_connector"
PARAMS_KEY = "eagle3flow_shard"     # our entry in a request's kv_transfer_params
ERROR_SUFFIX = ".error"             # beside a shard whose write failed in the engine
# Targets whose vLLM model crashes when asked for id 0 (the embeddings): DeepSeek's
# decoder loop reads `hidden_states + residual` before the first layer, residual None.
NO_EMBEDDING_CAPTURE = ("deepseek_v2", "deepseek_v3", "deepseek_v32", "kimi_k2", "kimi_k25")
WRITE_TIMEOUT_ENV = "EAGLE3FLOW_VLLM_WRITE_TIMEOUT_S"
# Goes into the cache fingerprint: vLLM's kernels round differently from HF's.
FINGERPRINT = {"backend": "vllm"}


# ----------------------------------------------------------------------------- layer ids

def capture_layer_ids(aux_layer_ids: list[int], num_layers: int) -> list[int]:
    """What vLLM is asked to capture: the aux ids ascending, then ``num_layers`` (the last
    decoder layer's output, before the final norm)."""
    return sorted(set(aux_layer_ids)) + [num_layers]


def check_layer_ids(aux_layer_ids: list[int], text_config: dict, config_file: str) -> None:
    """Reject what vLLM cannot capture for this target, before the engine loads."""
    model_type = str(text_config.get("model_type", ""))
    if 0 in aux_layer_ids and model_type in NO_EMBEDDING_CAPTURE:
        raise ValueError(
            f"extract.aux_layer_ids {aux_layer_ids}: id 0 (the embeddings) cannot be captured "
            f"by vLLM for a {model_type} target ({config_file}): its DeepSeek decoder crashes "
            f"on it. Use ids >= 1, or extract.backend: hf.")


def restore_order(states: torch.Tensor, aux_layer_ids: list[int], num_layers: int
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """``states [T, C, H]`` in :func:`capture_layer_ids` order -> ``aux [T, A*H]`` in the
    configured order and ``pre_norm [T, H]`` (the last layer's output)."""
    order = capture_layer_ids(aux_layer_ids, num_layers)
    aux = states[:, [order.index(k) for k in aux_layer_ids]].flatten(1)
    return aux, states[:, -1]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The final RMSNorm as HF Llama/DeepSeek compute it (float32 inside, input dtype out)."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def find_cache_group(kv_cache_config, num_layers: int) -> int:
    """Index of the KV cache group that holds the cache-only layer ``cache_only_layers.{N}``.

    By name, not by spec type: an MLA target's KV cache is a group of its own next to
    the hidden-state one, where vLLM's example connector gives up ("MLA verifiers are
    unsupported").
    """
    if kv_cache_config is None:
        return 0
    groups = kv_cache_config.kv_cache_groups
    found = [gid for gid, group in enumerate(groups)
             if any(name.split(".")[-2:] == ["cache_only_layers", str(num_layers)]
                    for name in group.layer_names)]
    if len(found) != 1:
        raise ValueError(f"cache-only layer cache_only_layers.{num_layers} found in groups "
                         f"{found} of {[g.layer_names for g in groups]}; expected exactly one")
    return found[0]


def gather_sample(cache: torch.Tensor, block_ids: list[int], num_tokens: int,
                  aux_layer_ids: list[int], num_layers: int, norm_weight: torch.Tensor,
                  eps: float, fp8: bool = False, copy_stream=None) -> tuple[dict[str, torch.Tensor], Any]:
    """One sample's states out of the hidden-state KV cache, ready for the shard writer.

    ``cache [blocks, C, block_size, H]`` (C = :func:`capture_layer_ids`), the sample's
    ``block_ids`` in order -> ``{"aux": [T, A*H] configured order, "last": [T, H]
    final-norm output}`` (fp8: quantized on the device, plus ``aux_scale [T, A]`` and
    ``last_scale [T, 1]``) on the host, and the CUDA event that completes their async
    copy on ``copy_stream`` into pinned memory (None on the CPU, where they are fresh
    tensors already: the blocks may be reused as soon as the request is reported).
    """
    block_size = cache.shape[2]
    blocks = torch.tensor(block_ids, dtype=torch.long)
    slots = (blocks[:, None] * block_size + torch.arange(block_size)).flatten()[:num_tokens]
    slots = slots.to(cache.device)
    states = cache[slots // block_size, :, slots % block_size]          # [T, C, H], a copy
    aux, pre_norm = restore_order(states, aux_layer_ids, num_layers)
    out = {"aux": aux, "last": rms_norm(pre_norm, norm_weight, eps)}
    if fp8:   # on the device, as the HF backend: half the bytes to copy
        out["aux"], out["aux_scale"] = shards.quantize_fp8(out["aux"], len(aux_layer_ids))
        out["last"], out["last_scale"] = shards.quantize_fp8(out["last"], 1)
    if cache.device.type != "cuda":
        return {k: v.contiguous() for k, v in out.items()}, None
    copy_stream.wait_stream(torch.cuda.current_stream(cache.device))
    host = {}
    with torch.cuda.stream(copy_stream):
        for name, tensor in out.items():
            host[name] = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
            host[name].copy_(tensor, non_blocking=True)
    for tensor in out.values():
        tensor.record_stream(copy_stream)   # not reused before the copy ran
    event = torch.cuda.Event()
    event.record(copy_stream)
    return host, event


# ----------------------------------------------------------------------------- driver

class ShardWrite:
    """The pending write of one shard by the engine; ``result()`` is its manifest entry."""

    def __init__(self, path: Path, timeout_s: float, step: Callable[[], Any] | None = None):
        self.path, self.timeout_s, self.step = path, timeout_s, step
        self.entry_file = shards.entry_file(path)
        self.error_file = path.with_name(path.name + ERROR_SUFFIX)

    def result(self) -> dict:
        deadline = time.monotonic() + self.timeout_s
        while True:
            if self.error_file.is_file():
                raise RuntimeError(f"{self.path}: the vLLM worker failed to write it:\n"
                                   f"{self.error_file.read_text()}")
            if self.entry_file.is_file():
                with open(self.entry_file) as f:
                    return json.load(f)
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.path}: not written {self.timeout_s:.0f} s after its "
                                   f"forward passes ended (is the vLLM engine still alive?)")
            if self.step is not None:
                self.step()     # an in-process engine only hands the finished samples over
            time.sleep(0.02)    # to the connector (in the metadata of a step) when stepped


@dataclass
class VllmEngine:
    llm: Any
    write_timeout_s: float

    def stepper(self) -> Callable[[], Any] | None:
        """How to make an in-process engine core run a step (None: it runs in its own
        process and keeps stepping while finished requests still hold blocks)."""
        from vllm.v1.engine.core_client import InprocClient  # vLLM only once an engine runs

        engine = self.llm.llm_engine
        return engine.step if isinstance(engine.engine_core, InprocClient) else None


def resolve_tensor_parallel_size(requested: int | None, device: torch.device) -> int:
    """None = every visible GPU on CUDA (the whole node); ``requested`` (resources.gpus)
    there too. 1 on the CPU, whatever the node's GPUs are: a GPU stage that falls back to
    the CPU (vLLM's CPU build) runs one engine, not one per GPU it was given."""
    if device.type == "cpu":
        return 1
    if requested is not None:
        if requested < 1:
            raise ValueError(f"tensor_parallel_size {requested}: must be >= 1")
        return requested
    return max(1, torch.cuda.device_count())


def load_engine(x: Extraction, max_model_len: int, tensor_parallel_size: int | None = None,
                gpu_memory_utilization: float = 0.85, max_num_seqs: int = 256) -> VllmEngine:
    """A vLLM engine over ``x.target_path`` that captures ``x.aux_layer_ids`` into shards.

    ``x`` is any prepared split (they share target, layer ids, dtypes and batch size).
    """
    tp = resolve_tensor_parallel_size(tensor_parallel_size, x.device)
    on_cpu = x.device.type == "cpu"
    text_config = read_target_config(x.target_path)
    if max_model_len > int(text_config.get("max_position_embeddings") or max_model_len):
        # A sample as long as the context: vLLM wants room for the one token each request
        # samples, which is never fed back, so no position past the context is computed.
        os.environ.setdefault("VLLM_ALLOW_LONG_MAX_MODEL_LEN", "1")
    if on_cpu:
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB; read when vLLM starts
    if tp == 1:
        # One process where the target allows: no engine-core child to start, or to leave
        # behind when killed (serving/vllm_runner.py engine_core_in_process).
        engine_process_env(x.target_path)
    # vLLM reads the environment above when imported, so only now.
    from vllm import LLM
    from vllm.platforms import current_platform

    if current_platform.is_cpu() != on_cpu:
        raise ValueError(f"extract.device is {x.device.type} but this vLLM build targets "
                         f"{current_platform.device_type}")
    kwargs: dict[str, Any] = dict(
        model=str(x.target_path), dtype=x.dtype_name, tensor_parallel_size=tp, seed=0,
        trust_remote_code=x.trust_remote_code,
        max_model_len=max_model_len, enable_prefix_caching=False, skip_tokenizer_init=True,
        # vLLM's CPU build turns chunked prefill off for MLA: a whole prompt per step.
        max_num_batched_tokens=max(x.batch_tokens, max_model_len) if on_cpu else x.batch_tokens,
        max_num_seqs=min(max_num_seqs, x.batch_tokens),
        speculative_config={
            "method": "extract_hidden_states", "num_speculative_tokens": 1,
            "draft_model_config": {"hf_config": {
                "eagle_aux_hidden_state_layer_ids": capture_layer_ids(x.aux_layer_ids,
                                                                      x.num_layers)}}},
        kv_transfer_config={
            "kv_connector": CONNECTOR_NAME, "kv_connector_module_path": CONNECTOR_MODULE,
            "kv_role": "kv_producer",
            "kv_connector_extra_config": {
                "aux_layer_ids": list(x.aux_layer_ids), "target_path": str(x.target_path),
                "rms_norm_eps": float(text_config.get("rms_norm_eps", 1e-6)),
                "storage_dtype": x.storage_dtype, "compute_dtype": x.dtype_name}})
    if on_cpu:
        kwargs.update(cpu_engine_options(text_config, x.dtype_name))
    else:
        kwargs["gpu_memory_utilization"] = gpu_memory_utilization
    if tp == 1:
        kwargs["distributed_executor_backend"] = "uni"
    llm = LLM(**kwargs)
    return VllmEngine(llm, float(os.environ.get(WRITE_TIMEOUT_ENV, "900")))


def submit_shard(engine: VllmEngine, path: Path, rows: list[dict]) -> ShardWrite:
    """Run one shard's samples (dataset order) through the engine, which writes ``path``.

    Returns once the forward passes are done; the engine's connector writes the shard
    in the background (``ShardWrite.result()`` waits), so the next shard computes meanwhile.
    """
    from vllm import SamplingParams  # vLLM only once an engine runs

    pending = ShardWrite(path, engine.write_timeout_s, engine.stepper())
    for stale in (pending.entry_file, pending.error_file):
        stale.unlink(missing_ok=True)   # left by a run killed mid-write; recomputed now
    prompts = [{"prompt_token_ids": list(r["input_ids"])} for r in rows]
    params = [SamplingParams(max_tokens=1, temperature=0.0, detokenize=False, extra_args={
        "kv_transfer_params": {PARAMS_KEY: {
            "shard": str(path), "slot": i, "num_samples": len(rows), "sample_id": r["id"],
            "loss_mask": list(r["loss_mask"])}}}) for i, r in enumerate(rows)]
    engine.llm.generate(prompts, params, use_tqdm=False)
    return pending


def run(x: Extraction, load: Callable[[], VllmEngine]) -> dict:
    """Compute the missing shards of a prepared extraction through vLLM; write its manifest.

    The same loop as the HF backend's :func:`eagle3flow.extract.hf.run` (cached shards
    verified by their sample ids, throughput log, manifest), with shard k+1's forward
    passes running while the engine writes shard k.
    """
    engine = load() if x.missing else None   # before the clock starts
    progress = Progress(x.tag, sum(p.num_tokens for p in x.plan), "tokens",
                        done=sum(e["num_tokens"] for e in x.entries.values()))
    throughput_log = throughput_path(x.manifest_out)
    pending: tuple[int, ShardWrite] | None = None
    delay = float(os.environ.get(SHARD_DELAY_ENV, "0") or 0)
    for plan, rows, path in shards_to_compute(x, progress):
        if pending is not None and delay:
            # tests: the previous shard written, wait before beginning this one
            x.entries[pending[0]] = pending[1].result()
            pending = None
            time.sleep(delay)
        engine = engine or load()
        t0 = time.monotonic()
        write = submit_shard(engine, path, rows)
        record_throughput(throughput_log, x.split_name, x.key, plan, time.monotonic() - t0)
        progress.update(plan.num_tokens)
        if pending is not None:
            x.entries[pending[0]] = pending[1].result()
        pending = plan.index, write
    if pending is not None:
        x.entries[pending[0]] = pending[1].result()
    progress.close()
    return x.write_manifest()


def run_all(extractions: list[Extraction], tensor_parallel_size: int | None = None) -> list[dict]:
    """Every prepared split through one engine, loaded only if some shard is missing.

    Checks what vLLM cannot do for this target before loading it.
    """
    if not extractions:
        return []
    first = extractions[0]
    check_layer_ids(first.aux_layer_ids, read_target_config(first.target_path),
                    str(first.target_path / "config.json"))
    longest = max((int(x.scan.lengths.max()) for x in extractions if len(x.scan.lengths)), default=1)
    engines: list[VllmEngine] = []

    def load() -> VllmEngine:
        if not engines:
            log(f"{first.tag}: {LOADING_LINE} {first.target_path} into vLLM "
                f"({first.dtype_name} on {first.device})")
            # One more position than the longest sample: the one token each request samples.
            engines.append(load_engine(first, longest + 1, tensor_parallel_size))
        return engines[0]

    return [run(x, load) for x in extractions]


def extract(dataset_parquet, target_path, manifest_out, cache_root, aux_layer_ids=None,
            tensor_parallel_size: int | None = None, **options) -> dict:
    """:func:`eagle3flow.extract.hf.extract` through vLLM (same options and checks)."""
    x = prepare(dataset_parquet, target_path, manifest_out, cache_root, aux_layer_ids,
                fingerprint_extra=FINGERPRINT, **options)
    check_disk_room([x])
    return run_all([x], tensor_parallel_size)[0]
