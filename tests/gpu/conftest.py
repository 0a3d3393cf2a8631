"""The GPU lane (tests/gpu/README.md): collected only where a CUDA device is there.

Without ``nvidia-smi`` on PATH nothing here is even imported, so the CPU suite (``make
test``, CI) pays nothing for this folder; with it, a torch that sees no CUDA device skips
the lane at collection. Each test's outcome and time go to ``EAGLE3FLOW_GPU_RESULTS``
(a JSON file) with the versions that ran, for tests/gpu/RESULTS.md.
"""
from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import pytest

if shutil.which("nvidia-smi") is None:
    collect_ignore_glob = ["test_*.py"]
else:
    import torch

    if not torch.cuda.is_available():
        collect_ignore_glob = ["test_*.py"]

_RESULTS: dict = {"tests": {}}


def pytest_sessionstart(session):
    _RESULTS["started"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def pytest_runtest_logreport(report):
    if "tests/gpu/" not in report.nodeid:
        return
    row = _RESULTS["tests"].setdefault(report.nodeid, {"outcome": "passed", "seconds": 0.0})
    row["seconds"] = round(row["seconds"] + report.duration, 1)
    if report.failed:
        row["outcome"] = "failed" if report.when == "call" else f"error ({report.when})"
        row["message"] = str(report.longrepr)[-3000:]
    elif report.skipped and row["outcome"] == "passed":
        row["outcome"] = "skipped"
    for name, value in report.user_properties:
        row.setdefault("measured", {})[name] = value


def pytest_sessionfinish(session, exitstatus):
    out = os.environ.get("EAGLE3FLOW_GPU_RESULTS")
    if not out or os.environ.get("PYTEST_XDIST_WORKER"):
        return
    versions = {}
    for name in ("torch", "vllm", "transformers", "snakemake"):
        try:
            versions[name] = __import__(name).__version__
        except Exception as error:   # reported, not fatal: the results say what was missing
            versions[name] = f"not importable: {error}"
    try:
        import torch

        versions["gpu"] = torch.cuda.get_device_name(0)
        versions["cuda"] = torch.version.cuda
    except Exception as error:
        versions["gpu"] = f"unknown: {error}"
    _RESULTS.update(versions=versions, exitstatus=int(exitstatus),
                    finished=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
    Path(out).write_text(json.dumps(_RESULTS, indent=1) + "\n")
