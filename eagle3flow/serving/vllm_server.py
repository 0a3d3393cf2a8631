"""A vLLM OpenAI-compatible server of a target, run as this process's child for a while.

For a target with no production server (the embedded default): ``serve_target``
starts ``vllm.entrypoints.openai.api_server`` on 127.0.0.1, waits for ``/health``,
yields the base URL and stops the server on exit. (serving/vllm_runner.py, beside it,
runs an offline engine over token ids instead.) Standard library only.
"""
from __future__ import annotations

import functools
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from contextlib import contextmanager
from pathlib import Path

from eagle3flow.procfs import signal_on_parent_death
from eagle3flow.serving.vllm_cpu_fixes import whole_prompt_prefill

SERVED_NAME = "builtin-target"


class ServerError(RuntimeError):
    """The server exited, or was not healthy in time, before it could answer."""


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (the OS picks it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def resolve_serve_dtype(dtype: str, python: str | None = None) -> str:
    """The dtype to serve in: ``auto`` is the one evaluation runs the target in
    (``evaluate.dtype`` auto): float32 where the server's torch sees no CUDA device,
    else bfloat16. vLLM's own auto serves a float32 checkpoint in bfloat16, which a CPU
    without bf16 instructions (AVX2 only) runs ~4x slower, and whose greedy answers are
    not the float32 ones evaluation sees."""
    if dtype != "auto":
        return dtype
    # extract.extraction.resolve_dtype's rule, asked of the server's own interpreter.
    return "bfloat16" if sees_cuda(python) else "float32"


@functools.lru_cache(maxsize=None)
def sees_cuda(python: str | None = None) -> bool:
    """Whether the server's interpreter's torch sees a CUDA device (asked of that
    interpreter: this module and its callers stay torch-free)."""
    probe = subprocess.run([python or sys.executable, "-c", "import torch; print(torch.cuda.is_available())"],
                           capture_output=True, text=True, timeout=300)
    if probe.returncode != 0:
        raise ServerError(f"{python or sys.executable} cannot import torch:\n{probe.stderr[-2000:]}")
    return probe.stdout.strip() == "True"


@contextmanager
def serve_target(target: str | Path, log_path: str | Path, python: str | None = None,
                 max_model_len: int = 2048, startup_timeout_s: float = 600.0, port: int | None = None,
                 log_tag: str = "vllm_server", dtype: str = "auto", trust_remote_code: bool = False):
    """Run a vLLM OpenAI server of ``target`` on 127.0.0.1 in ``dtype`` (as vLLM names
    it; resolve ``auto`` with ``resolve_serve_dtype`` first); yield its base URL.

    The server is this process's child (its own process group, SIGTERM if we die) and
    is stopped on exit: SIGTERM to the group, SIGKILL after 30 s. Its progress lines on
    stderr start with ``log_tag:`` (the caller's stage name). ``trust_remote_code``
    (``target.trust_remote_code``): the server runs the target's own code.
    """
    port = port or free_port()
    command = [python or sys.executable, "-m", "vllm.entrypoints.openai.api_server",
               "--model", str(target), "--served-model-name", SERVED_NAME, "--dtype", dtype,
               "--host", "127.0.0.1", "--port", str(port), "--max-model-len", str(max_model_len),
               "--seed", "0", "--enforce-eager", "--disable-uvicorn-access-log"]
    if trust_remote_code:
        command.append("--trust-remote-code")
    if not sees_cuda(python):
        # regenerate's further answers are seeded samples (vllm_cpu_fixes.py says why)
        tokens = whole_prompt_prefill(max_model_len)["max_num_batched_tokens"]
        command += ["--no-enable-chunked-prefill", "--max-num-batched-tokens", str(tokens)]
    env = {**os.environ, "HF_HUB_OFFLINE": os.environ.get("HF_HUB_OFFLINE", "1")}
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    Path(log_path).parent.mkdir(parents=True, exist_ok=True)
    log = open(log_path, "ab")
    url = f"http://127.0.0.1:{port}"
    print(f"{log_tag}: starting a vLLM server of {target} ({dtype}) at {url} (log: {log_path})",
          file=sys.stderr, flush=True)
    proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env,
                            start_new_session=True,
                            preexec_fn=signal_on_parent_death)  # a killed stage leaves no server
    try:
        t0, deadline = time.monotonic(), time.monotonic() + startup_timeout_s
        while not _healthy(url):
            if proc.poll() is not None:
                raise ServerError(f"the vLLM server of {target} exited with code {proc.returncode} "
                                  f"before it was healthy; last lines of {log_path}:\n"
                                  + _tail(log_path))
            if time.monotonic() > deadline:
                raise ServerError(f"the vLLM server of {target} was not healthy after "
                                  f"{startup_timeout_s:.0f}s; see {log_path}")
            time.sleep(0.5)
        print(f"{log_tag}: server healthy after {time.monotonic() - t0:.0f}s", file=sys.stderr, flush=True)
        yield url
    finally:
        stop_server(proc)
        log.close()


def stop_server(proc: subprocess.Popen, grace_s: float = 30.0) -> None:
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        except ProcessLookupError:
            pass
    try:  # engine processes left in the group
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/health", timeout=5) as response:
            return 200 <= response.status < 300
    except (urllib.error.URLError, OSError, ValueError):
        return False


def _tail(path, lines: int = 20) -> str:
    try:
        return "\n".join(Path(path).read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"

