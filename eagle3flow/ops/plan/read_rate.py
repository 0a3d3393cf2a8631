"""Whether the disk can feed training: the read rate training needs (its projected tokens/s
x the hidden-state bytes per token) against what the disk under the cache reads, measured
by a probe file written there, evicted from the page cache and read back. No torch.

The probe reads sequentially once, as the loader reads a shard; its pages are dropped with
``posix_fadvise(DONTNEED)`` after an fsync, which needs no root (on tmpfs nothing is
dropped: that memory is the disk)."""
from __future__ import annotations

import os
import time
from pathlib import Path

PROBE_BYTES = 128 << 20
CHUNK = 8 << 20
# The loader has to keep up with the GPUs with room to spare: above this share of the
# measured rate, the plan says the disk is the limit.
HEADROOM = 0.8


def evict_from_page_cache(fd: int) -> None:
    """Drop an open file's cached pages (flushed first: dirty pages are not dropped); no root."""
    os.fsync(fd)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)


def measure_read_rate(folder: Path, size: int = PROBE_BYTES) -> float | None:
    """Bytes/s a sequential read of a ``size``-byte file under ``folder`` (or its nearest
    existing parent) reached, from the disk (the file's pages dropped first); None where the
    probe cannot be written."""
    folder = Path(folder).absolute()
    while not folder.is_dir() and folder != folder.parent:     # the disk it will be on; nothing created
        folder = folder.parent
    probe = folder / f".read-probe-{os.getpid()}"
    try:
        block = os.urandom(CHUNK)
        with open(probe, "wb") as f:
            for _ in range(max(1, size // CHUNK)):
                f.write(block)
            f.flush()
        fd = os.open(probe, os.O_RDONLY)
        try:
            evict_from_page_cache(fd)
            read, t0 = 0, time.perf_counter()
            while chunk := os.read(fd, CHUNK):
                read += len(chunk)
            seconds = time.perf_counter() - t0
        finally:
            os.close(fd)
        return read / seconds if seconds > 0 else None
    except OSError:
        return None
    finally:
        probe.unlink(missing_ok=True)


def read_rate_note(tokens_per_s: float, bytes_per_token: int, disk_bytes_per_s: float | None,
                   folder: Path, storage_dtype: str) -> str | None:
    """The plan's note when training would read faster than ``HEADROOM`` of the disk's
    measured rate, with what lowers it; None when the disk keeps up or was not measured."""
    need = tokens_per_s * bytes_per_token
    if not disk_bytes_per_s or need <= HEADROOM * disk_bytes_per_s:
        return None
    remedies = ["extract.storage_dtype: fp8 (about half the bytes per token)"] \
        if storage_dtype != "float8_e4m3fn" else []
    remedies.append("streaming (extract.partitions >= 2 under storage.max_bytes: each partition is trained "
                    "soon after it is written, much of it still in the page cache)")
    remedies.append("a faster local disk for the cache")
    return (f"training would read hidden states at {need / 1e9:.2f} GB/s ({tokens_per_s:,.0f} tokens/s projected x "
            f"{bytes_per_token:,} B/token, {storage_dtype}) but the disk under {folder} read "
            f"{disk_bytes_per_s / 1e9:.2f} GB/s (a {PROBE_BYTES >> 20} MiB probe, page cache dropped): the GPUs "
            f"would wait for data, training at about {HEADROOM * disk_bytes_per_s / bytes_per_token:,.0f} "
            f"tokens/s at most. Lower it with " + "; or ".join(remedies))
