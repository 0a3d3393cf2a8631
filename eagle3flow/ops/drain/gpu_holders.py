"""Who holds which GPU: nvidia-smi's compute apps, with each process's user and command.

The drain (eagle3flow/ops/drain/cycle.py) needs two answers before a GPU stage may load a
model: is any process still using the GPUs the stage will use, and is the GPU
memory back to idle. nvidia-smi is asked in its stable CSV query format, the same
on every driver since 2015, so no NVML binding is needed in the environment.
"""
from __future__ import annotations

import pwd
import subprocess
from dataclasses import dataclass

from eagle3flow.ops.drain.redact import redact
from eagle3flow.procfs import cmdline, owner_uid


class GpuQueryError(RuntimeError):
    """nvidia-smi is missing or answered something this module cannot read."""


@dataclass(frozen=True)
class GpuProcess:
    pid: int
    gpu_index: int
    used_mib: int


# How long nvidia-smi may take to answer (drain.nvidia_smi_timeout_s): a driver stuck
# after an Xid error or a reset makes it hang, exactly when GPU jobs die.
QUERY_TIMEOUT_S = 60


def _query(nvidia_smi: str, query: str, timeout_s: float = QUERY_TIMEOUT_S) -> list[list[str]]:
    command = [nvidia_smi, query, "--format=csv,noheader,nounits"]
    try:
        result = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s)
    except FileNotFoundError as error:
        raise GpuQueryError(f"{nvidia_smi} not found: the drain cannot tell whether the GPUs are "
                            "free (set drain.nvidia_smi to its path)") from error
    except subprocess.TimeoutExpired as error:
        raise GpuQueryError(f"{' '.join(command)} did not answer within {timeout_s:g} s "
                            "(drain.nvidia_smi_timeout_s)") from error
    if result.returncode != 0:
        raise GpuQueryError(f"{' '.join(command)} failed (rc={result.returncode}): "
                            f"{(result.stderr or result.stdout).strip()}")
    return [[field.strip() for field in line.split(",")]
            for line in result.stdout.splitlines() if line.strip()]


def gpu_memory_used(nvidia_smi: str, timeout_s: float = QUERY_TIMEOUT_S) -> dict[int, tuple[str, int]]:
    """{index: (uuid, used MiB)} for every GPU of the node."""
    gpus = {}
    for row in _query(nvidia_smi, "--query-gpu=index,uuid,memory.used", timeout_s):
        try:
            gpus[int(row[0])] = (row[1], int(float(row[2])))
        except (IndexError, ValueError) as error:
            raise GpuQueryError(f"unreadable nvidia-smi GPU line: {', '.join(row)}") from error
    return gpus


def gpu_processes(nvidia_smi: str, gpu_indices: list[int] | None = None,
                  timeout_s: float = QUERY_TIMEOUT_S) -> list[GpuProcess]:
    """Processes with a context on the given GPUs (all when None)."""
    index_of = {uuid: index for index, (uuid, _) in gpu_memory_used(nvidia_smi, timeout_s).items()}
    found = []
    for row in _query(nvidia_smi, "--query-compute-apps=gpu_uuid,pid,used_memory", timeout_s):
        try:
            uuid, pid, used = row[0], int(row[1]), row[2]
        except (IndexError, ValueError) as error:
            raise GpuQueryError(f"unreadable nvidia-smi process line: {', '.join(row)}") from error
        index = index_of.get(uuid)
        if index is None or (gpu_indices is not None and index not in gpu_indices):
            continue
        # "[N/A]" when the driver cannot attribute memory (e.g. under MIG)
        used_mib = int(float(used)) if used.replace(".", "", 1).isdigit() else 0
        found.append(GpuProcess(pid, index, used_mib))
    return found


def describe_process(pid: int) -> str:
    """'pid 123 (user alice): python train.py' or a note that it cannot be seen from here;
    secrets in the command line (--api-key ..., user:password@) masked: it goes into
    messages, the session, the downtime records and the report."""
    uid, command = owner_uid(pid), cmdline(pid)
    if uid is None or command is None:
        return f"pid {pid} (not visible from here: another pid namespace, e.g. a container)"
    try:
        user = pwd.getpwuid(uid).pw_name
    except KeyError:
        user = str(uid)
    return f"pid {pid} (user {user}): {redact(command) or '[kernel thread]'}"
