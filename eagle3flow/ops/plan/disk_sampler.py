"""The disk sampler: a detached process that sums the bytes under the run's directories
every second while the workflow lives and keeps the peak in a JSON file (the plan's
"actual" peak). Started by rules/plan.smk through ``python -m eagle3flow.ops.plan
sample-disk``. No torch."""
from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

from eagle3flow.atomic import write_json
from eagle3flow.procfs import pid_alive
from eagle3flow.ops.plan.sizes import tree_bytes


def sample_disk(paths: list[str], out: Path, pid: int, interval: float = 1.0) -> int:
    """Sum the bytes under ``paths`` every ``interval`` s while process ``pid`` lives;
    keep the peak in ``out`` (JSON: peak_bytes, at, samples). Returns the peak."""
    peak, samples, start = 0, 0, time.time()
    while True:
        alive = pid_alive(pid)
        total = sum(tree_bytes(p) for p in paths)
        samples += 1
        if total > peak or samples == 1:
            peak = max(peak, total)
            write_json(out, {"peak_bytes": peak, "at": time.time(), "started": start,
                              "samples": samples, "paths": paths})
        if not alive:
            write_json(out, {"peak_bytes": peak, "at": time.time(), "started": start,
                              "samples": samples, "paths": paths, "finished": True})
            return peak
        time.sleep(interval)


def start_sampler(paths: list[str], out: Path, pid: int, interval: float, log: Path) -> subprocess.Popen:
    """The sampler as a detached process (it outlives nothing: it stops when ``pid`` ends)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    log.parent.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "eagle3flow.ops.plan", "sample-disk", "--out", str(out),
           "--pid", str(pid), "--interval", str(interval)]
    for p in paths:
        cmd += ["--path", p]
    with open(log, "a") as log_file:
        return subprocess.Popen(cmd, stdout=log_file, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)


def read_peak(path: Path) -> int | None:
    try:
        with open(path) as f:
            return int(json.load(f)["peak_bytes"])
    except (OSError, ValueError, KeyError):
        return None


