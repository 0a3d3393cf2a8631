"""The HF transformers extraction backend: capture the target's hidden states, write shards.

:func:`capture` runs the target once and returns, per token, the aux hidden states
(the inputs of decoder layers ``aux_layer_ids``, see eagle3flow/layers.py) and the
final-norm output (the teacher's logits are ``lm_head(last)``).

:func:`extract` does that for a whole tokenized dataset and writes shards (format in
docs/formats.md) under ``cache_root/<fingerprint>/``, then the manifest:
:func:`eagle3flow.extract.extraction.prepare` checks and plans before any model loads,
then :func:`run` computes the missing shards (:class:`HFPipeline`: forward,
device-to-host copies and disk writes overlap). The model is only loaded if some
shard is missing.

The extraction rule's command line for both backends is eagle3flow/extract/__main__.py.
"""
from __future__ import annotations

import contextlib
import os
import queue
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import numpy as np
import torch

from eagle3flow.atomic import write_json
from eagle3flow.extract import shards
from eagle3flow.extract.cache import HASH_THREADS
from eagle3flow.extract.extraction import (LOADING_LINE, SHARD_DELAY_ENV, Extraction,
                                           check_disk_room, log, prepare, shards_to_compute)
from eagle3flow.extract.shard_plan import ShardPlan
from eagle3flow.extract.throughput import record_throughput, throughput_path
from eagle3flow.progress import Progress
from eagle3flow.target.model import load_target_model

# Shard-sized host buffers in rotation. A buffer is held for compute + write of its
# shard, so with compute ~= write, 2 leave no slack (measured 0.82 of the bound on an
# H200), 3 absorb the jitter. Costs 3 x shard bytes of pinned memory.
STAGING_BUFFERS = 3


# ----------------------------------------------------------------------------- capture

def decoder_layers(base_model: torch.nn.Module) -> torch.nn.ModuleList:
    """The decoder layers of an HF base model (``model.layers`` or a nested language model's)."""
    for owner in (base_model, getattr(base_model, "language_model", None)):
        layers = getattr(owner, "layers", None)
        if isinstance(layers, torch.nn.ModuleList):
            return layers
    raise TypeError(f"cannot find the decoder layers of {type(base_model).__name__}")



def _record_layer_input(store: dict, layer_id: int, module, args, kwargs):
    store[layer_id] = args[0] if args else kwargs["hidden_states"]


def capture(model, input_ids: torch.Tensor, attention_mask: torch.Tensor,
            aux_layer_ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Aux and last hidden states of an HF CausalLM for a right-padded batch.

    ``input_ids [B, T]``, ``attention_mask [B, T]`` (1 = token, 0 = padding) ->
    ``aux [B, T, A*H]`` = the inputs of decoder layers ``aux_layer_ids`` (= HF
    ``hidden_states[k]``) concatenated in that order, and ``last [B, T, H]`` = the
    final-norm output, so ``model.lm_head(last)`` are the model's logits.

    Pre-hooks on the A chosen layers keep only what is needed (``output_hidden_states``
    would hold all N+1 states), and only the base model runs: no ``[B, T, V]`` logits.
    """
    base = model.get_decoder() if hasattr(model, "get_decoder") else model.base_model
    layers = decoder_layers(base)
    captured: dict[int, torch.Tensor] = {}
    handles = [layers[k].register_forward_pre_hook(partial(_record_layer_input, captured, k),
                                                   with_kwargs=True)
               for k in aux_layer_ids]
    try:
        # no_grad, not inference_mode: callers may still use the outputs under autograd.
        with torch.no_grad():
            out = base(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
    finally:
        for handle in handles:
            handle.remove()
    aux = torch.cat([captured[k] for k in aux_layer_ids], dim=-1)
    return aux, out.last_hidden_state




def load_target(target_path, dtype: torch.dtype, device: torch.device, trust_remote_code: bool = False):
    """The target's causal LM (a multimodal wrapper's language model: eagle3flow/target/model.py)."""
    return load_target_model(target_path, dtype, device, trust_remote_code)


def length_batches(lengths: list[int], batch_tokens: int) -> list[list[int]]:
    """Sample indices grouped longest first, each batch padding to <= ``batch_tokens`` tokens.

    Sorting by length keeps padding small; a sample longer than ``batch_tokens`` runs alone.
    """
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    batches: list[list[int]] = []
    for i in order:
        if batches and (len(batches[-1]) + 1) * lengths[batches[-1][0]] <= batch_tokens:
            batches[-1].append(i)
        else:
            batches.append([i])
    return batches



# ----------------------------------------------------------------------------- pipeline

@dataclass
class _Staging:
    """Host memory one shard's hidden states are copied into (pinned on CUDA).

    ``aux [cap, A*H]``, ``last [cap, H]`` in the storage dtype; in fp8 also
    ``aux_scale [cap, A]``, ``last_scale [cap, 1]`` float32.
    """
    aux: torch.Tensor
    last: torch.Tensor
    aux_scale: torch.Tensor | None
    last_scale: torch.Tensor | None

    @classmethod
    def allocate(cls, rows: int, num_aux: int, hidden: int, dtype: torch.dtype, fp8: bool, pin: bool):
        store = shards.FP8 if fp8 else dtype
        empty = partial(torch.empty, pin_memory=pin)
        return cls(empty(rows, num_aux * hidden, dtype=store), empty(rows, hidden, dtype=store),
                   empty(rows, num_aux, dtype=torch.float32) if fp8 else None,
                   empty(rows, 1, dtype=torch.float32) if fp8 else None)


class BackgroundWriter:
    """Writes finished shards on one thread, fed through a bounded queue.

    Jobs are callables; the first exception stops the writer and is raised again by
    the next :meth:`submit` or by :meth:`close`, so a full disk fails the run.
    """

    def __init__(self, depth: int = 1):
        self.jobs: queue.Queue = queue.Queue(maxsize=depth)
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name="shard-writer", daemon=True)
        self.thread.start()

    def _run(self):
        while (job := self.jobs.get()) is not None:
            if self.error is None:
                try:
                    job()
                except BaseException as error:  # re-raised in the main thread
                    self.error = error

    def check(self):
        if self.error is not None:
            raise RuntimeError(f"writing a shard failed: {self.error}") from self.error

    def submit(self, job) -> None:
        self.check()
        self.jobs.put(job)

    def close(self) -> None:
        self.jobs.put(None)
        self.thread.join()
        self.check()


class HFPipeline:
    """Computes shards with an HF model and hands them to a background writer.

    Per batch: forward on the compute stream; the real tokens (padding dropped) are
    quantized there when storing fp8, then copied on a second CUDA stream, once the
    compute stream's event says they are ready, straight into a pinned staging buffer
    at their place in the shard (dataset order). When a shard's last copy is queued,
    the writer gets the buffer and an event; it waits on that event only. Buffers
    rotate (:data:`STAGING_BUFFERS`), so the GPU computes shard k+1 while the disk takes
    shard k: throughput is about min(compute, disk), and the pool is the bounded queue
    (backpressure). Checksums are computed by other threads from the written files.
    """

    def __init__(self, model, extraction: Extraction, progress: Progress,
                 buffers: int = STAGING_BUFFERS):
        self.model, self.x, self.progress = model, extraction, progress
        self.cuda = extraction.device.type == "cuda"
        self.fp8 = shards.is_fp8(extraction.storage_dtype)
        self.copy_stream = torch.cuda.Stream(extraction.device) if self.cuda else None
        # Any planned shard may turn out to need computing (other samples than planned).
        self.capacity = max(p.num_tokens for p in extraction.plan)
        # Pinning GBs takes ~1 s/GB: the first buffer now, the others on a thread while
        # the GPU works on the first shards.
        self.free: queue.Queue = queue.Queue()
        self.free.put(self._allocate())
        self.allocator = threading.Thread(
            target=lambda: [self.free.put(self._allocate()) for _ in range(buffers - 1)],
            name="staging-allocator", daemon=True)
        self.allocator.start()
        self.writer = BackgroundWriter(depth=buffers)
        # sha256 (~1 GB/s a core) would cap a fast disk: finished files are hashed here,
        # several at once, from the page cache, while the writer goes on.
        self.hasher = ThreadPoolExecutor(max_workers=HASH_THREADS, thread_name_prefix="shard-sha256")
        self.hashing: list[Future] = []
        self.delay = float(os.environ.get(SHARD_DELAY_ENV, "0") or 0)
        # (event, shard, perf_counter) per step of each shard, for benchmarks/extract_throughput.py.
        self.timeline: list[tuple[str, int, float]] = []

    def _allocate(self) -> _Staging:
        return _Staging.allocate(self.capacity, len(self.x.aux_layer_ids), self.x.hidden_size,
                                 self.x.dtype, self.fp8, pin=self.cuda)

    def _take_buffer(self) -> _Staging:
        while True:  # wait for the writer to hand a buffer back, unless it died
            self.writer.check()
            try:
                return self.free.get(timeout=1.0)
            except queue.Empty:
                continue

    def _mark(self, what: str, shard: int) -> None:
        self.timeline.append((what, shard, time.perf_counter()))

    def compute(self, plan: ShardPlan, rows: list[dict], path: Path) -> None:
        """Queue one shard: ``rows`` are its kept samples in dataset order."""
        self._mark("wait_buffer", plan.index)
        buf = self._take_buffer()
        self._mark("queue_compute", plan.index)
        lengths = [len(r["input_ids"]) for r in rows]
        offsets = np.concatenate([[0], np.cumsum(lengths)]).tolist()
        hidden, num_aux = self.x.hidden_size, len(self.x.aux_layer_ids)
        for batch in length_batches(lengths, self.x.batch_tokens):
            width = lengths[batch[0]]
            ids = torch.zeros(len(batch), width, dtype=torch.long)
            mask = torch.zeros(len(batch), width, dtype=torch.long)
            for b, i in enumerate(batch):
                ids[b, :lengths[i]] = torch.as_tensor(rows[i]["input_ids"], dtype=torch.long)
                mask[b, :lengths[i]] = 1
            device = self.x.device
            aux, last = capture(self.model, ids.to(device, non_blocking=True),
                                mask.to(device, non_blocking=True), self.x.aux_layer_ids)
            outputs = {"aux": aux, "last": last}
            if self.fp8:
                outputs["aux"], outputs["aux_scale"] = shards.quantize_fp8(aux, num_aux)
                outputs["last"], outputs["last_scale"] = shards.quantize_fp8(last, 1)
            self._copy_out(outputs, buf, batch, lengths, offsets)
            self.progress.update(sum(lengths[i] for i in batch))
        done = None
        if self.cuda:
            done = torch.cuda.Event()
            done.record(self.copy_stream)
        self._mark("queued", plan.index)
        self.writer.submit(partial(self._write, plan, rows, buf, done, path, offsets[-1]))

    def _copy_out(self, outputs: dict, buf: _Staging, batch, lengths, offsets) -> None:
        """Real tokens of each sample -> its rows of the staging buffer (async on CUDA)."""
        if self.cuda:
            ready = torch.cuda.Event()
            ready.record()  # on the compute stream, after the forward (and quantization)
            self.copy_stream.wait_event(ready)
            context = torch.cuda.stream(self.copy_stream)
        else:
            context = contextlib.nullcontext()
        with context:
            for name, source in outputs.items():
                target = getattr(buf, name)
                for b, i in enumerate(batch):
                    target[offsets[i]:offsets[i] + lengths[i]].copy_(source[b, :lengths[i]],
                                                                      non_blocking=self.cuda)
        if self.cuda:
            for source in outputs.values():
                source.record_stream(self.copy_stream)  # not reused before the copy ran

    def _write(self, plan: ShardPlan, rows, buf: _Staging, done, path: Path, tokens: int) -> None:
        """Writer thread: wait for the shard's copies, write it, hand the buffer back, queue its hash."""
        try:
            if done is not None:
                done.synchronize()
            self._mark("copied", plan.index)
            lengths = [len(r["input_ids"]) for r in rows]
            cu = torch.zeros(len(rows) + 1, dtype=torch.int64)
            cu[1:] = torch.cumsum(torch.tensor(lengths, dtype=torch.int64), 0)
            input_ids = torch.tensor([t for r in rows for t in r["input_ids"]], dtype=torch.int32)
            loss_mask = torch.tensor([t for r in rows for t in r["loss_mask"]], dtype=torch.uint8)
            entry = shards.write_packed_shard(
                path, [r["id"] for r in rows], input_ids, loss_mask, cu,
                buf.aux[:tokens], buf.last[:tokens],
                aux_scale=buf.aux_scale[:tokens] if self.fp8 else None,
                last_scale=buf.last_scale[:tokens] if self.fp8 else None,
                compute_dtype=self.x.dtype_name, checksum=False)
        finally:
            self.free.put(buf)
        self._mark("written", plan.index)
        self.hashing.append(self.hasher.submit(self._record_entry, plan, path, entry))
        if self.delay:
            time.sleep(self.delay)

    def _record_entry(self, plan: ShardPlan, path: Path, entry: dict) -> None:
        entry["sha256"] = shards.sha256_file(path)
        # Recorded beside the shard so a resumed run can check the file's bytes, not just its
        # shape (a shard killed before this line gets its entry from the file on resume).
        write_json(shards.entry_file(path), entry)
        self.x.entries[plan.index] = entry
        self._mark("hashed", plan.index)

    def close(self) -> None:
        try:
            self.allocator.join()
            self.writer.close()
        finally:
            for job in self.hashing:
                job.result()
            self.hasher.shutdown()



def run(x: Extraction, loaded_models: dict | None = None, timeline: list | None = None) -> dict:
    """Compute the extraction's missing shards with the HF backend; write its manifest."""
    models = {} if loaded_models is None else loaded_models
    model_key = model_cache_key(x.target_path, x.dtype, x.device)
    cached_tokens = sum(e["num_tokens"] for e in x.entries.values())
    total = sum(p.num_tokens for p in x.plan)

    def loaded_model():
        if model_key not in models:
            log(f"{x.tag}: {LOADING_LINE} {x.target_path} ({x.dtype_name} on {x.device})")
            models[model_key] = load_target(x.target_path, x.dtype, x.device, x.trust_remote_code)
        return models[model_key]

    if x.missing:
        loaded_model()  # before the clock starts, so the rate is the extraction's own
    progress = Progress(x.tag, total, "tokens", done=cached_tokens)
    # Per computed shard, for the report's throughput plot; survives kills and resumes.
    throughput_log = throughput_path(x.manifest_out)
    pipeline = None
    try:
        for plan, rows, path in shards_to_compute(x, progress):
            if pipeline is None:
                pipeline = HFPipeline(loaded_model(), x, progress)
                if timeline is not None:
                    pipeline.timeline = timeline
            t0 = time.monotonic()
            pipeline.compute(plan, rows, path)
            record_throughput(throughput_log, x.split_name, x.key, plan, time.monotonic() - t0)
    finally:
        if pipeline is not None:
            pipeline.close()
    progress.close()
    return x.write_manifest()


def model_cache_key(target_path, dtype: torch.dtype, device: torch.device) -> tuple:
    """Key of a loaded target in ``loaded_models`` (a caller may put an already built model there)."""
    return str(Path(target_path).resolve()), str(dtype).removeprefix("torch."), str(device)



def extract(dataset_parquet, target_path, manifest_out, cache_root, aux_layer_ids=None,
            dtype: str = "auto", device: str = "auto", batch_tokens: int = 8192,
            shard_tokens: int = 32768, max_length: int | None = None,
            length_policy: str = "truncate", storage_dtype: str = "auto",
            split_name: str = "train", partition: tuple[int, int] = (0, 1),
            loaded_models: dict | None = None, trust_remote_code: bool = False) -> dict:
    """Extract hidden states of every dataset sample into cached shards; write the manifest.

    :func:`prepare` (all checks, the plan, the disk check) then :func:`run`. Returns
    the manifest dict. ``loaded_models`` (a dict the caller keeps) lets several calls
    share one loaded target: loading a 1T-parameter target takes far longer than a
    small split's work.
    """
    x = prepare(dataset_parquet, target_path, manifest_out, cache_root, aux_layer_ids, dtype,
                device, batch_tokens, shard_tokens, max_length, length_policy, storage_dtype,
                split_name, partition, trust_remote_code=trust_remote_code)
    check_disk_room([x])
    return run(x, loaded_models)
