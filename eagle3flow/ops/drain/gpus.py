"""The drain's GPU checks: who holds the stage's GPUs, which of them are foreign, and
killing exactly the foreign ones when the config allows it.

A holder is ours when it is in the unit's cgroup, is this process, or carries the token
of one of our runs (``$EAGLE3FLOW_RUN``, eagle3flow/ops/drain/state.py); every other one
is foreign and is never killed unless ``drain.kill_foreign_gpu_processes`` is set, and
even then never a job of any run, nor a process of another pid namespace.
"""
from __future__ import annotations

import os
import signal
import time

from eagle3flow.ops.drain.state import RUN_ENV, ServiceError, log
from eagle3flow.ops.drain.gpu_holders import GpuQueryError, describe_process, gpu_memory_used, gpu_processes
from eagle3flow.procfs import environ, in_host_pid_namespace, pid_namespace, running, start_ticks
from eagle3flow.ops.drain.systemd_unit import unit_pids

def job_devices(count: int, env=None) -> list[str]:
    """The devices a GPU job of ``count`` GPUs runs on, as CUDA_VISIBLE_DEVICES names them:
    the first ``count`` of an inherited CUDA_VISIBLE_DEVICES (a user who set 4,5,6,7 keeps
    them), else 0..count-1 (numbered like nvidia-smi: CUDA_DEVICE_ORDER=PCI_BUS_ID)."""
    inherited = [d.strip() for d in (os.environ if env is None else env).get("CUDA_VISIBLE_DEVICES", "").split(",")
                 if d.strip()]
    if not inherited:
        return [str(i) for i in range(count)]
    if len(inherited) < count:
        raise ServiceError(f"CUDA_VISIBLE_DEVICES={','.join(inherited)} names {len(inherited)} GPU(s); the "
                           f"GPU stages need {count} (resources.gpus)")
    return inherited[:count]


def job_gpu_indices(settings: dict, count: int) -> list[int]:
    """nvidia-smi's indices of the GPUs a job of ``count`` GPUs runs on (job_devices; a
    GPU named by its UUID is looked up)."""
    devices = job_devices(count)
    if all(d.isdigit() for d in devices):
        return [int(d) for d in devices]
    try:
        index_of = {uuid: index for index, (uuid, _) in gpu_memory_used(settings["nvidia_smi"], settings["nvidia_smi_timeout_s"]).items()}
    except GpuQueryError as error:
        raise ServiceError(f"cannot tell which GPUs CUDA_VISIBLE_DEVICES names: {error}") from error
    unknown = [d for d in devices if not d.isdigit() and d not in index_of]
    if unknown:
        raise ServiceError(f"CUDA_VISIBLE_DEVICES names {unknown}, which nvidia-smi does not list as GPUs "
                           "(MIG instances cannot be drained for)")
    return [int(d) if d.isdigit() else index_of[d] for d in devices]


def of_runs(pid: int, run_ids) -> bool:
    """Whether process ``pid`` carries one of these run tokens (a job of those runs)."""
    token = (environ(pid) or {}).get(RUN_ENV)
    return token is not None and token in [r for r in run_ids if r]


def _foreign_holders(settings: dict, gpus: list[int], own_runs=()) -> list:
    """GPU processes on `gpus` that are not in the unit's cgroup, not this process and not
    a job of the runs `own_runs` (their token, read after the holders were listed: a job
    that started in between is still the run's)."""
    holders = gpu_processes(settings["nvidia_smi"], gpus, settings["nvidia_smi_timeout_s"])
    ours = unit_pids(settings) | {os.getpid()}
    return [p for p in holders if p.pid not in ours and not of_runs(p.pid, own_runs)]


def describe_holders(holders, own_runs=()) -> str:
    by_pid: dict[int, list[int]] = {}
    for holder in holders:
        by_pid.setdefault(holder.pid, []).append(holder.gpu_index)
    return "\n".join(f"  GPU {','.join(map(str, sorted(indices)))}: {describe_process(pid)}"
                     + (" [a job of this workflow's run]" if of_runs(pid, own_runs) else "")
                     for pid, indices in sorted(by_pid.items()))


def kill_only(pids: set[int], grace_s: float = 10.0, what: str = "foreign GPU process",
              why: str = "drain.kill_foreign_gpu_processes") -> None:
    """SIGTERM, then SIGKILL, exactly these processes (checked by start time: never a reused pid)."""
    starts = {pid: start_ticks(pid) for pid in pids}
    for pid, start in starts.items():
        if start is not None:
            log(f"killing {what} {describe_process(pid)} ({why})")
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and any(running(p, s) for p, s in starts.items() if s):
        time.sleep(0.2)
    for pid, start in starts.items():
        if start is not None and running(pid, start):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def handle_foreign(settings: dict, gpus: list[int], when: str, own_runs=()) -> None:
    holders = _foreign_holders(settings, gpus, own_runs)
    if holders:
        # A job exiting as nvidia-smi listed it reads as foreign (its environment is gone
        # by the time it is read): only a holder listed again is one.
        time.sleep(settings["poll_interval_s"])
        again = {h.pid for h in _foreign_holders(settings, gpus, own_runs)}
        holders = [h for h in holders if h.pid in again]
    if not holders:
        return
    if not settings["kill_foreign_gpu_processes"]:
        raise ServiceError(
            f"{when}: processes outside {settings['unit']} hold GPUs this stage needs; they are not "
            f"killed (set drain.kill_foreign_gpu_processes: true to allow it, or stop them):\n"
            + describe_holders(holders))
    spared = {h.pid: why for h in holders for why in [_never_killed(h.pid)] if why}
    if spared:
        raise ServiceError(
            f"{when}: processes outside {settings['unit']} hold GPUs this stage needs, and "
            f"drain.kill_foreign_gpu_processes never kills these; stop them yourself:\n"
            + "\n".join(f"  {describe_process(pid)}: {why}" for pid, why in sorted(spared.items())))
    kill_only({h.pid for h in holders})


def _never_killed(pid: int) -> str | None:
    """Why a foreign GPU holder must not be killed even with kill_foreign_gpu_processes,
    or None: a job of any run (this checkout's or another's), a process whose environment
    cannot be read (it might be one), one of another pid namespace, or any pid at all
    when this process runs in a container (nvidia-smi's pids are the host's)."""
    if not in_host_pid_namespace():
        return ("this drain runs in a container's pid namespace: nvidia-smi's pids are the host's and may "
                "name other processes here")
    if pid_namespace(pid) is None or pid_namespace(pid) != pid_namespace("self"):
        return "it is in another pid namespace (a container?), or its namespace cannot be read"
    env = environ(pid)
    if env is None:
        return "its environment cannot be read: it may be a job of a run"
    if env.get(RUN_ENV):
        return f"it is a job of eagle3flow run {env[RUN_ENV]}"
    return None


def gpus_busy(settings: dict, gpus: list[int]) -> tuple[list, list[int]]:
    """(processes on `gpus`, GPUs whose memory is above idle)."""
    memory = gpu_memory_used(settings["nvidia_smi"], settings["nvidia_smi_timeout_s"])
    busy = [i for i in gpus if memory.get(i, ("", 0))[1] > settings["gpu_idle_memory_mib"]]
    return gpu_processes(settings["nvidia_smi"], gpus, settings["nvidia_smi_timeout_s"]), busy


def wait_until(predicate, timeout_s: float, poll_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while True:
        if predicate():
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(poll_s)
