"""vLLM's example hidden-states connector, made to run on the CPU build of vLLM.

speculators' ``generate-offline-data`` gets its hidden states from a vLLM server that
runs ``extract_hidden_states`` with ``ExampleHiddenStatesConnector``, which copies the
captured states off the GPU on a CUDA stream into pinned memory: on vLLM's CPU build
that raises ("torch.cuda.Stream requires CUDA support"). Here the copy is a plain
clone, done before the write is queued; file names, lock files and the
``{"hidden_states": [T, L, H], "token_ids": [T]}`` layout speculators reads are the
base class's. Loaded by the server through ``kv_connector_module_path`` (the quality
benchmark's ``run.py`` puts this directory on ``PYTHONPATH``).
"""
from __future__ import annotations

import fcntl
import os
from functools import partial

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
    ExampleHiddenStatesConnector, PendingSave, extract_from_kv_cache)


class _Finished:
    """What the base class polls instead of a CUDA event: the copy is already done."""

    @staticmethod
    def query() -> bool:
        return True

    @staticmethod
    def synchronize() -> None:
        return None


class CpuHiddenStatesConnector(ExampleHiddenStatesConnector):
    def _submit_async_write(self, pending: PendingSave) -> None:
        if not self._is_tp_rank_zero:
            return
        blocks = torch.tensor(pending.block_ids, dtype=torch.long)
        slots = (torch.arange(self._block_size).view(1, -1) + blocks.view(-1, 1) * self._block_size).flatten()
        # A copy: the cache blocks are reused once the request is reported done.
        states = extract_from_kv_cache(self._kv_cache, slots, pending.token_ids.shape[0]).clone()
        os.makedirs(os.path.dirname(pending.filename), exist_ok=True)
        lock_fd = self._lock_fds.pop(pending.req_id, None)
        if lock_fd is None and self.use_lock:
            lock_fd = os.open(pending.filename + ".lock", os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
            fcntl.flock(lock_fd, fcntl.LOCK_EX)
        done = _Finished()
        future = self._executor.submit(self._write_tensors,
                                       {"hidden_states": states, "token_ids": pending.token_ids.clone()},
                                       done, pending.filename, lock_fd)
        self._req_copy_events[pending.req_id] = done
        self._req_futures[pending.req_id] = future
        future.add_done_callback(partial(self._on_write_done, pending.req_id))
