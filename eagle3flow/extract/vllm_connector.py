"""The KV connector that turns vLLM's captured hidden states into project shards.

Loaded by vLLM itself (``kv_connector_module_path="eagle3flow.extract.vllm_connector"``,
``kv_connector="ShardConnector"``) in the engine's scheduler and in each worker; the
driver side and the whole data path are described in eagle3flow/extract/vllm.py.
This module imports vLLM at import time, so only vLLM (and tests of the CPU build)
import it.

Scheduler side: when a request that carries our ``kv_transfer_params`` entry finishes,
its block ids in the hidden-state cache group and its sample info go to the worker
through the connector metadata; its blocks stay allocated until the worker reports it.
Worker side (TP rank 0): the request's ``[T, C, H]`` states are gathered from the
cache-only layer, put in the configured aux order, the last one normalized, copied to
the host (async on CUDA), and once every sample of a shard is in, the shard is written
by the shared shard writer (eagle3flow/extract/shards.py) in a background thread.

The cache-only layer's layout depends on the vLLM (README, "vLLM versions"): vLLMs with
the stride-permutation layouts (``vllm.v1.kv_cache_layout``, 0.32) are asked for
``LBNHC`` and hand the layer over as ``[blocks, C, block_size, H]``; older ones (0.25)
know only ``NHD``/``HND`` and hand it over as ``[blocks, block_size, C, H]``, which the
connector reads through a permuted view. Which one is decided by what the installed vLLM
offers (:func:`cache_layout_plan`), not by its version number.
"""
from __future__ import annotations

import traceback
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from vllm.config import get_layers_from_vllm_config
from vllm.distributed.kv_transfer.kv_connector.v1.base import (KVConnectorBase_V1,
                                                               KVConnectorMetadata, SupportsHMA)
from vllm.distributed.parallel_state import get_tensor_model_parallel_rank
from vllm.model_executor.models.extract_hidden_states import CacheOnlyAttentionLayer

from eagle3flow.extract import shards
from eagle3flow.atomic import write_json
from eagle3flow.extract.vllm import (ERROR_SUFFIX, PARAMS_KEY, capture_layer_ids,
                                     find_cache_group, gather_sample)
from eagle3flow.target.weights import load_target_head


@dataclass(frozen=True)
class CacheLayoutPlan:
    """The layout name to ask vLLM for, and how the cache-only layer it hands over is
    turned into ``[blocks, C, block_size, H]`` (what :func:`gather_sample` reads)."""
    name: str
    token_major: bool   # the layer arrives [blocks, block_size, C, H]


def cache_layout_plan(layout_names) -> CacheLayoutPlan:
    """The plan for a vLLM whose KV-cache layout names are ``layout_names``
    (:func:`installed_layout_names`): ``LBNHC`` where it is known (the states of a token
    side by side, the layer indexed captured id first), else ``NHD``, the token-major
    layout every older vLLM with ``extract_hidden_states`` knows."""
    names = set(layout_names)
    if "LBNHC" in names:
        return CacheLayoutPlan("LBNHC", token_major=False)
    if "NHD" in names:
        return CacheLayoutPlan("NHD", token_major=True)
    raise ValueError(f"this vLLM's KV-cache layouts {sorted(names)} include neither LBNHC nor "
                     f"NHD; the vLLM extraction backend supports the vLLMs the README names")


def installed_layout_names() -> set[str]:
    """The KV-cache layout names the installed vLLM resolves: its ``KVCacheLayout``
    members where it has that enum (the 5-D stride permutations), else the two names
    (``NHD``, ``HND``) that older vLLMs' attention backends accept."""
    try:
        from vllm.v1.kv_cache_layout import KVCacheLayout
    except ImportError:
        return {"NHD", "HND"}
    return {member.name for member in KVCacheLayout}


def captured_major(cache: torch.Tensor, plan: CacheLayoutPlan, captured: int) -> torch.Tensor:
    """The cache-only layer as ``[blocks, C, block_size, H]`` (a view, no copy)."""
    axis = 2 if plan.token_major else 1
    if cache.dim() != 4 or cache.shape[axis] != captured:
        order = "[blocks, block_size, C, hidden]" if plan.token_major else "[blocks, C, block_size, hidden]"
        raise ValueError(f"hidden-state cache of shape {tuple(cache.shape)} with layout {plan.name}; "
                         f"expected {order} with C = {captured}")
    return cache.permute(0, 2, 1, 3) if plan.token_major else cache


@dataclass
class SampleSave:
    """One finished request, scheduler -> worker."""
    req_id: str
    shard: str              # path of the shard file
    slot: int               # the sample's position in the shard
    num_samples: int        # samples in the shard
    sample_id: str
    loss_mask: list[int]
    token_ids: list[int]
    block_ids: list[int]    # in the hidden-state cache group


@dataclass
class ShardConnectorMetadata(KVConnectorMetadata):
    saves: list[SampleSave] = field(default_factory=list)


class ShardConnector(KVConnectorBase_V1, SupportsHMA):
    """Store-only KV connector: hidden states of finished requests -> project shards.

    ``kv_connector_extra_config``: ``aux_layer_ids`` (configured order), ``target_path``
    (read for the final-norm weight), ``rms_norm_eps``, ``storage_dtype`` (the compute
    dtype's name or ``float8_e4m3fn``) and ``compute_dtype``.
    """

    def __init__(self, vllm_config, role, kv_cache_config=None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        extra = self._kv_transfer_config.kv_connector_extra_config
        self._aux_layer_ids = [int(k) for k in extra["aux_layer_ids"]]
        self._target_path = extra["target_path"]
        self._eps = float(extra["rms_norm_eps"])
        self._fp8 = shards.is_fp8(extra["storage_dtype"])
        self._compute_dtype = extra["compute_dtype"]
        self._num_layers = vllm_config.model_config.get_total_num_hidden_layers()
        self._group = find_cache_group(kv_cache_config, self._num_layers)
        # scheduler side
        self._finished: list[SampleSave] = []
        # worker side
        self._kv_cache: torch.Tensor | None = None
        self._is_writer = True
        self._norm_weight: torch.Tensor | None = None
        self._shards: dict[str, list[dict | None]] = {}
        self._copy_stream = None
        self._copy_events: dict[str, Any] = {}
        self._unreported: set[str] = set()
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="eagle3flow-shard")

    # ---------------------------------------------------------------- scheduler side

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        return 0, False     # store-only: nothing is ever loaded

    def update_state_after_alloc(self, request, blocks, num_external_tokens):
        pass

    def build_connector_meta(self, scheduler_output):
        meta = ShardConnectorMetadata(saves=self._finished)
        self._finished = []
        return meta

    def request_finished(self, request, block_ids):
        params = (request.kv_transfer_params or {}).get(PARAMS_KEY)
        if params is None:
            return False, None
        self._finished.append(SampleSave(
            req_id=request.request_id, shard=params["shard"], slot=int(params["slot"]),
            num_samples=int(params["num_samples"]), sample_id=str(params["sample_id"]),
            loss_mask=list(params["loss_mask"]), token_ids=list(request.prompt_token_ids or []),
            block_ids=list(block_ids)))
        # True: keep the blocks until the worker has copied the states out (get_finished).
        return True, None

    def request_finished_all_groups(self, request, block_ids):
        if not 0 <= self._group < len(block_ids):
            return False, None
        return self.request_finished(request, block_ids[self._group])

    def get_finished_count(self) -> int:
        return 1    # only TP rank 0 copies and reports

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config):
        # A token's captured states side by side in memory, whatever the vLLM calls it.
        return cache_layout_plan(installed_layout_names()).name

    # ---------------------------------------------------------------- worker side

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]):
        self._is_writer = get_tensor_model_parallel_rank() == 0
        layers = list(get_layers_from_vllm_config(self._vllm_config, CacheOnlyAttentionLayer,
                                                  list(kv_caches)))
        if len(layers) != 1:
            raise ValueError(f"expected one cache-only layer, found {layers}")
        captured = len(capture_layer_ids(self._aux_layer_ids, self._num_layers))
        self._kv_cache = captured_major(kv_caches[layers[0]],
                                        cache_layout_plan(installed_layout_names()), captured)

    def start_load_kv(self, *args, **kwargs):
        pass

    def wait_for_layer_load(self, layer_name):
        pass

    def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs):
        pass    # the cache-only layer already wrote the states into the cache

    def wait_for_save(self):
        pass

    def _final_norm_weight(self) -> torch.Tensor:
        if self._norm_weight is None:
            weight = load_target_head(self._target_path, parts=("norm",))["norm"]
            self._norm_weight = weight.to(device=self._kv_cache.device, dtype=self._kv_cache.dtype)
        return self._norm_weight

    def _gather(self, save: SampleSave) -> tuple[dict[str, torch.Tensor], Any]:
        if self._copy_stream is None and self._kv_cache.device.type == "cuda":
            self._copy_stream = torch.cuda.Stream(self._kv_cache.device)
        return gather_sample(self._kv_cache, save.block_ids, len(save.token_ids),
                             self._aux_layer_ids, self._num_layers, self._final_norm_weight(),
                             self._eps, self._fp8, self._copy_stream)

    def _accept(self, save: SampleSave) -> None:
        tensors, event = self._gather(save)
        if event is not None:
            self._copy_events[save.req_id] = event
        samples = self._shards.setdefault(save.shard, [None] * save.num_samples)
        samples[save.slot] = {"id": save.sample_id, "input_ids": save.token_ids,
                              "loss_mask": save.loss_mask, "tensors": tensors, "event": event}
        if all(s is not None for s in samples):
            del self._shards[save.shard]
            self._writer.submit(write_shard_file, Path(save.shard), samples, self._compute_dtype)

    def get_finished(self, finished_req_ids):
        if self.has_connector_metadata():
            meta = self._get_connector_metadata()
            if isinstance(meta, ShardConnectorMetadata) and self._is_writer:
                for save in meta.saves:
                    self._accept(save)
                    self._unreported.add(save.req_id)
        done = set()
        for req_id in list(self._unreported):
            event = self._copy_events.get(req_id)
            if event is not None and not event.query():
                continue    # still copying out of its blocks
            self._copy_events.pop(req_id, None)
            self._unreported.discard(req_id)
            done.add(req_id)
        return (done or None), None

    def shutdown(self):
        self._writer.shutdown(wait=True)


def write_shard_file(path: Path, samples: list[dict], compute_dtype: str) -> None:
    """Background thread: a complete shard -> the shard file, then its entry file.

    The same writer and entry file as the HF backend (``shards.write_packed_shard``);
    a failure leaves ``<shard>.error`` with the traceback, which the driver raises.
    """
    try:
        for sample in samples:
            if sample["event"] is not None:
                sample["event"].synchronize()
        lengths = torch.tensor([len(s["input_ids"]) for s in samples], dtype=torch.int64)
        cu = torch.zeros(len(samples) + 1, dtype=torch.int64)
        cu[1:] = torch.cumsum(lengths, 0)
        packed = {name: torch.cat([s["tensors"][name] for s in samples])
                  for name in samples[0]["tensors"]}
        entry = shards.write_packed_shard(
            path, [s["id"] for s in samples],
            torch.tensor([t for s in samples for t in s["input_ids"]], dtype=torch.int32),
            torch.tensor([m for s in samples for m in s["loss_mask"]], dtype=torch.uint8), cu,
            packed["aux"], packed["last"], aux_scale=packed.get("aux_scale"),
            last_scale=packed.get("last_scale"), compute_dtype=compute_dtype)
        write_json(shards.entry_file(path), entry)
    except BaseException:
        path.with_name(path.name + ERROR_SUFFIX).write_text(traceback.format_exc())
        raise
