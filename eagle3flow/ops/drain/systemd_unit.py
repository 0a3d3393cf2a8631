"""The systemd unit that serves the target: its state, its processes, start/stop, health.

systemctl is a configurable command (``drain.systemctl``: ``systemctl``, ``sudo
systemctl``, ``systemctl --user`` or a test double); the unit's processes are those of
its cgroup, where vLLM's workers live even when they are not children of MainPID.
"""
from __future__ import annotations

import os
import subprocess
import urllib.error
import urllib.request
from pathlib import Path

from eagle3flow.ops.drain.state import JOB_ENV, RUN_ENV, ServiceError
from eagle3flow.procfs import descendants

def systemctl(settings: dict, *args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    command = [*settings["systemctl"], *args]
    # No run token to the unit: it is not a job of any run (systemd gives its units a
    # clean environment anyway; a wrapper or a test double may not).
    env = {k: v for k, v in os.environ.items() if k not in (RUN_ENV, JOB_ENV)}
    try:
        return subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env)
    except FileNotFoundError as error:
        raise ServiceError(f"{command[0]} not found (drain.systemctl)") from error
    except subprocess.TimeoutExpired as error:
        # A hung systemd (or sudo asking for a password) is a failed step like any other:
        # the callers record it and retry; it must never end them.
        raise ServiceError(f"`{' '.join(command)}` did not return within {timeout:.0f} s") from error


# The three command lines run through drain.systemctl (a privilege prefix such as
# `sudo -n` must allow exactly these: docs/service.md's sudoers lines). `-p` once per
# property, not `--property=A,B`: a sudoers rule would need `=` and `,` escaped.
SHOW_PROPERTIES = ("LoadState", "ActiveState", "MainPID", "ControlGroup")


def unit_properties(settings: dict) -> dict:
    result = systemctl(settings, "show", settings["unit"], *(a for p in SHOW_PROPERTIES for a in ("-p", p)))
    if result.returncode != 0:
        raise ServiceError(f"systemctl show {settings['unit']} failed: {result.stderr.strip()}")
    return dict(line.split("=", 1) for line in result.stdout.splitlines() if "=" in line)


def unit_pids(settings: dict, properties: dict | None = None) -> set[int]:
    """Processes in the unit's cgroup (sub-cgroups included): vLLM's workers live there
    even when they are not children of MainPID any more."""
    properties = properties or unit_properties(settings)
    cgroup = properties.get("ControlGroup", "")
    pids: set[int] = set()
    if cgroup:
        root = Path(settings["cgroup_root"]) / cgroup.lstrip("/")
        if root.is_dir():
            for procs in root.rglob("cgroup.procs"):
                try:
                    pids.update(int(line) for line in procs.read_text().split())
                except OSError:
                    continue
            return pids
    # No readable cgroup (cgroup v1 layouts): MainPID and its descendants.
    main_pid = int(properties.get("MainPID") or 0)
    return descendants(main_pid) if main_pid > 0 else pids


def require_unit(settings: dict) -> dict:
    if not settings["unit"]:
        raise ServiceError("drain.enabled is true but drain.unit is not set: put the systemd unit "
                           "that serves the target (e.g. vllm-kimi-k25-int4.service) in "
                           "profiles/local-8gpu/workflow.yaml or config.yaml")
    properties = unit_properties(settings)
    if properties.get("LoadState") != "loaded":
        raise ServiceError(f"systemd does not know unit {settings['unit']} "
                           f"(LoadState={properties.get('LoadState')}): check drain.unit")
    return properties


def unit_healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return 200 <= response.status < 300
    except (urllib.error.URLError, OSError, ValueError):
        return False
