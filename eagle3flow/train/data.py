"""Training data: the batch plan, each rank's share of a batch, and the prefetching loader.

Data order: each epoch shuffles the shard order and the samples inside each shard
with seeds derived from ``(seed, epoch)``; samples are packed into batches of at
most ``batch_tokens`` tokens (a longer sample is a batch alone). The whole epoch's
batch plan is computed from the shards' ``cu_seqlens`` alone, so the data position
is just ``(epoch, batch index)``.

The plan is the GLOBAL batch, the same for any number of processes: under
data parallelism :func:`rank_share` splits each batch's samples between the ranks
(token-balanced, deterministic), so the samples a step trains on and their order do
not depend on the world size. :class:`BatchLoader` reads a rank's shares ahead of
the training loop in worker processes (``torch.utils.data.DataLoader``, pinned
memory on CUDA) and times how long the loop waits for each batch.

Samples are read by row range (``safe_open(...).get_slice``): a rank only touches the
bytes of its own samples, never a whole shard.
"""
from __future__ import annotations

import json
import random
import time
from collections import OrderedDict

import torch
from safetensors import safe_open

from eagle3flow.extract import shards
from eagle3flow.train.loss import scored_rows
from eagle3flow.extract.shards import Manifest

SAMPLE_TENSORS = ("input_ids", "loss_mask", "aux_hidden_states", "last_hidden_state")
# a batch's key for each hidden-state tensor of a sample
BATCH_KEYS = {"aux_hidden_states": "aux", "last_hidden_state": "last"}


class ShardData:
    """A manifest's shards: sample lengths for planning, and samples read by row range."""

    def __init__(self, manifest: Manifest, open_files: int = 8):
        self.manifest = manifest
        self.lengths: list[list[int]] = []
        self.offsets: list[list[int]] = []
        for path in manifest.shard_paths:
            if not path.is_file():
                raise FileNotFoundError(f"{manifest.path}: shard {path} is missing")
            with safe_open(str(path), "pt") as f:
                cu = f.get_tensor("cu_seqlens")
            self.offsets.append(cu.tolist())
            self.lengths.append((cu[1:] - cu[:-1]).tolist())
        self._files: OrderedDict[int, object] = OrderedDict()
        self.open_files = open_files

    def __getstate__(self):          # worker processes open their own handles
        state = dict(self.__dict__)
        state["_files"] = OrderedDict()
        return state

    @property
    def num_tokens(self) -> int:
        return sum(sum(x) for x in self.lengths)

    def _file(self, shard: int):
        if shard not in self._files:
            path = self.manifest.shard_paths[shard]
            handle = safe_open(str(path), "pt")
            meta = handle.metadata() or {}
            if meta.get("format") != shards.FORMAT:
                raise ValueError(f"{path}: not a hidden-state shard of format {shards.FORMAT} "
                                 f"(metadata format={meta.get('format')!r})")
            self._files[shard] = (handle, set(handle.keys()), meta)
            while len(self._files) > self.open_files:
                self._files.popitem(last=False)
        self._files.move_to_end(shard)
        return self._files[shard]

    def sample(self, shard: int, index: int, dequantize: bool = True) -> dict:
        """One sample's ``input_ids [T]``, ``loss_mask [T]``, ``aux_hidden_states [T, A*H]``,
        ``last_hidden_state [T, H]``. fp8 shards come back dequantized to their compute dtype,
        or with ``dequantize=False`` as stored, with ``<name>_scale [T, G]`` beside them (the
        GPU loader dequantizes after the copy: half the bytes over PCIe, no host arithmetic)."""
        handle, names, meta = self._file(shard)
        a, b = self.offsets[shard][index], self.offsets[shard][index + 1]
        out = {name: handle.get_slice(name)[a:b] for name in SAMPLE_TENSORS}
        for name in BATCH_KEYS:
            if f"{name}_scale" in names:
                scale = handle.get_slice(f"{name}_scale")[a:b]
                if dequantize:
                    out[name] = shards.dequantize_fp8(out[name], scale, shards.compute_dtype(meta))
                else:
                    out[f"{name}_scale"] = scale
        return out

    @property
    def hidden_dtype(self) -> torch.dtype:
        """What fp8 hidden states dequantize to (the shards' compute dtype)."""
        return shards.compute_dtype(self._file(0)[2]) if self.lengths else torch.bfloat16

    def sample_ids(self, shard: int) -> list[str]:
        return json.loads(self._file(shard)[2]["sample_ids"])


def epoch_order(data: ShardData, seed: int, epoch: int, shuffle: bool = True) -> list[tuple[int, int]]:
    """``(shard, sample)`` pairs of one epoch, shard order and in-shard order shuffled."""
    order_of_shards = list(range(len(data.lengths)))
    if shuffle:
        random.Random(f"{seed}-epoch-{epoch}").shuffle(order_of_shards)
    order = []
    for s in order_of_shards:
        samples = list(range(len(data.lengths[s])))
        if shuffle:
            random.Random(f"{seed}-epoch-{epoch}-shard-{s}").shuffle(samples)
        order.extend((s, i) for i in samples)
    return order


def plan_batches(data: ShardData, order: list[tuple[int, int]], batch_tokens: int,
                 seed: str | None = None, window_batches: int = 32) -> list[list[tuple[int, int]]]:
    """Length-grouped packing: a batch holds at most ``batch_tokens`` (or one longer sample).

    Attention runs on a padded ``[B, Tmax]`` view, so mixing a 500-token sample with
    thirty 40-token ones costs 8x the work. Consecutive windows of about
    ``window_batches`` batches of the (shuffled) order are sorted by length before
    packing, and the batches of a window are shuffled again with ``seed``. Windows
    follow the order, so batches still read shards one after another.
    """
    batches: list[list[tuple[int, int]]] = []
    window, window_tokens = [], 0

    def flush():
        current, size = [], 0
        planned = []
        for s, i in sorted(window, key=lambda si: data.lengths[si[0]][si[1]]):
            n = data.lengths[s][i]
            if current and size + n > batch_tokens:
                planned.append(current)
                current, size = [], 0
            current.append((s, i))
            size += n
        if current:
            planned.append(current)
        if seed is not None:
            random.Random(f"{seed}-window-{len(batches)}").shuffle(planned)
        batches.extend(planned)

    for s, i in order:
        window.append((s, i))
        window_tokens += data.lengths[s][i]
        if window_tokens >= window_batches * batch_tokens:
            flush()
            window, window_tokens = [], 0
    if window:
        flush()
    return batches


class EpochPlans:
    """The batch plan of each epoch of a run (:func:`plan_batches` on :func:`epoch_order`),
    the last one computed kept. ``first_epoch`` numbers the run's first epoch: a chained run
    (``--data-epoch``) shuffles as that epoch of the chain."""

    def __init__(self, data: ShardData, seed: int, batch_tokens: int, first_epoch: int = 0):
        self.data, self.seed, self.batch_tokens, self.first_epoch = data, seed, batch_tokens, first_epoch
        self.cached: dict[int, list[list[tuple[int, int]]]] = {}

    def __call__(self, epoch: int) -> list[list[tuple[int, int]]]:
        if epoch not in self.cached:
            self.cached.clear()
            seed_epoch = self.first_epoch + epoch
            self.cached[epoch] = plan_batches(self.data, epoch_order(self.data, self.seed, seed_epoch),
                                              self.batch_tokens, seed=f"{self.seed}-epoch-{seed_epoch}")
        return self.cached[epoch]


def rank_share(batch: list[tuple[int, int]], lengths: list[list[int]], rank: int,
               world_size: int) -> list[tuple[int, int]]:
    """The samples of a global ``batch`` that ``rank`` trains on, in the batch's order.

    Longest first, each sample goes to the rank with the fewest tokens so far (ties:
    the lowest rank), so every rank computes the same split without talking. A rank
    may get nothing when the batch has fewer samples than ranks.
    """
    if world_size == 1:
        return list(batch)
    load = [0] * world_size
    owner = {}
    for pos in sorted(range(len(batch)), key=lambda p: (-lengths[batch[p][0]][batch[p][1]], p)):
        r = min(range(world_size), key=lambda k: (load[k], k))
        owner[pos] = r
        load[r] += lengths[batch[pos][0]][batch[pos][1]]
    return [batch[p] for p in range(len(batch)) if owner[p] == rank]


def collate(data: ShardData, batch: list[tuple[int, int]], device: torch.device | None = None,
            num_steps: int = 0, dequantize: bool = True) -> dict:
    """Packed batch: ``input_ids [N]`` int64, ``loss_mask [N]`` bool, ``aux [N, A*H]``,
    ``last [N, H]`` (as stored: the model and the teacher cast on the device, so
    bf16 shards cross PCIe at half the bytes), ``cu_seqlens [B+1]`` int64, and the rows
    TTT step ``j`` is scored on (index ``t+j+2`` inside the sample and masked in;
    :func:`eagle3flow.train.loss.scored_rows`): ``scored_rows [S]`` int64 and their counts
    ``step_rows [num_steps]`` int64, what the loss divides by. An empty ``batch`` gives ``N = 0``. With ``device``, everything but
    :data:`HOST_KEYS` is moved there. ``dequantize=False`` keeps fp8 ``aux``/``last`` as
    stored with ``aux_scale``/``last_scale`` beside them (:func:`dequantize_batch`)."""
    samples = [data.sample(s, i, dequantize) for s, i in batch]
    lengths = torch.tensor([x["input_ids"].numel() for x in samples], dtype=torch.int64)
    cu = torch.zeros(len(samples) + 1, dtype=torch.int64)
    cu[1:] = lengths.cumsum(0)
    if not samples:
        return {"input_ids": torch.zeros(0, dtype=torch.int64), "cu_seqlens": cu,
                "step_rows": torch.zeros(num_steps, dtype=torch.int64)}
    loss_mask = torch.cat([x["loss_mask"] for x in samples]).bool()
    rows, counts = scored_rows(cu, loss_mask, num_steps)
    out = {
        "input_ids": torch.cat([x["input_ids"] for x in samples]).long(),
        "loss_mask": loss_mask,
        "aux": torch.cat([x["aux_hidden_states"] for x in samples]),
        "last": torch.cat([x["last_hidden_state"] for x in samples]),
        "cu_seqlens": cu, "step_rows": torch.tensor(counts, dtype=torch.int64), "scored_rows": rows,
    }
    for name, key in BATCH_KEYS.items():
        if f"{name}_scale" in samples[0]:
            out[f"{key}_scale"] = torch.cat([x[f"{name}_scale"] for x in samples])
    return to_device(out, device) if device is not None else out


def dequantize_batch(batch: dict, dtype: torch.dtype) -> dict:
    """``batch`` with fp8 ``aux``/``last`` dequantized to ``dtype`` where they are (their
    ``*_scale`` tensors consumed); a batch without scales is returned as it is."""
    out = dict(batch)
    for key in BATCH_KEYS.values():
        if f"{key}_scale" in out:
            out[key] = shards.dequantize_fp8(out[key], out.pop(f"{key}_scale"), dtype)
    return out


# Read on the host by the step (eagle3flow/train/loss.py): moving them would make it wait for the device.
HOST_KEYS = ("cu_seqlens", "step_rows")


def to_device(batch: dict, device: torch.device) -> dict:
    """The batch's tensors on ``device`` (non-blocking), except :data:`HOST_KEYS`."""
    return {k: v if k in HOST_KEYS else v.to(device, non_blocking=True) for k, v in batch.items()}


class _RankBatches(torch.utils.data.Dataset):
    """Item ``i`` = this rank's collated share of the ``i``-th remaining global batch
    (fp8 hidden states kept as stored unless ``dequantize``)."""

    def __init__(self, data: ShardData, shares: list[list[tuple[int, int]]], num_steps: int,
                 dequantize: bool = True):
        self.data, self.shares, self.num_steps, self.dequantize = data, shares, num_steps, dequantize

    def __len__(self):
        return len(self.shares)

    def __getitem__(self, i):
        return collate(self.data, self.shares[i], None, self.num_steps, self.dequantize)


class BatchLoader:
    """Iterates a rank's shares of global batches, read ahead by ``workers`` processes.

    ``workers=0`` reads in the training loop itself. :attr:`wait_s` is the time the
    last :meth:`next` call waited for its batch (0 when the batch was ready).

    On CUDA the next batch crosses to the GPU while the current one trains: its copy runs
    on a stream of its own, issued when the current batch is handed over, and the training
    stream waits only for that copy's event. A copy on the training stream would hold it
    for the whole transfer (268 MB a step at the Llama-3.1-8B shape, ~11 ms at 25 GB/s).
    fp8 shards cross as stored (half the bytes) and are dequantized there, on the GPU.
    """

    def __init__(self, data: ShardData, shares: list[list[tuple[int, int]]], num_steps: int,
                 device: torch.device, workers: int, prefetch_batches: int):
        self.device = device
        cuda = device.type == "cuda"
        workers = min(workers, len(shares))
        loader = torch.utils.data.DataLoader(
            _RankBatches(data, shares, num_steps, dequantize=not cuda), batch_size=None, shuffle=False,
            num_workers=workers, pin_memory=cuda,
            prefetch_factor=max(1, prefetch_batches // workers) if workers else None,
            persistent_workers=False)
        self._it = iter(loader)
        self._left = len(shares)
        self._hidden_dtype = data.hidden_dtype
        self._copy_stream = torch.cuda.Stream(device) if cuda else None
        self._ready = None              # (batch on the device, its copy's event)
        self.wait_s = 0.0

    def _host_batch(self) -> dict:
        t0 = time.perf_counter()
        batch = next(self._it)
        self.wait_s += time.perf_counter() - t0
        self._left -= 1
        return batch

    def _start_copy(self) -> None:
        """The next host batch, copied (and dequantized) on the copy stream."""
        batch = self._host_batch()
        with torch.cuda.stream(self._copy_stream):
            on_device = dequantize_batch(to_device(batch, self.device), self._hidden_dtype)
            done = torch.cuda.Event()
            done.record(self._copy_stream)
        self._ready = (on_device, done)

    def next(self) -> dict:
        self.wait_s = 0.0
        if self._copy_stream is None:
            return to_device(self._host_batch(), self.device)
        if self._ready is None:
            self._start_copy()
        batch, done = self._ready
        self._ready = None
        stream = torch.cuda.current_stream(self.device)
        stream.wait_event(done)
        for value in batch.values():
            if value.device.type == "cuda":
                # made on the copy stream, used on this one: not reused before this one is done
                value.record_stream(stream)
        if self._left:
            self._start_copy()
        return batch
