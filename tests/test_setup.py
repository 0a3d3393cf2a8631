"""scripts/setup.sh's choice of build, on this CPU machine, in its dry-run mode.

A stand-in nvidia-smi on PATH (tests/fixtures/service/nvidia-smi) makes the machine look
like the user's GPU box; SETUP_DRY_RUN=1 prints the choice, the pre-install check and
the commands, installing nothing. setup.sh runs in a copy of the files it reads, so
neither the checkout's .venv nor ~/.config/snakemake is touched.
"""
from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
FAKE_NVIDIA_SMI_DIR = REPO / "tests" / "fixtures" / "service"
BLACKWELL = "NVIDIA RTX PRO 6000 Blackwell Server Edition"


@pytest.fixture
def checkout(tmp_path) -> Path:
    """What setup.sh reads, copied: it works in the folder above its own."""
    root = tmp_path / "repo"
    for name in ("scripts", "envs", "profiles"):
        shutil.copytree(REPO / name, root / name)
    gpu_env = Path("eagle3flow", "ops", "drain", "gpu_env.py")
    (root / gpu_env.parent).mkdir(parents=True)
    shutil.copy2(REPO / gpu_env, root / gpu_env)
    shutil.copy2(REPO / "pyproject.toml", root / "pyproject.toml")
    return root


def fake_gpus(tmp_path: Path, count: int = 8, name: str = BLACKWELL, compute_cap: str = "12.0",
              driver: str = "580.95.05") -> Path:
    gpus = tmp_path / "gpus"
    gpus.mkdir()
    for key, value in {"count": count, "name": name, "compute_cap": compute_cap,
                       "driver_version": driver}.items():
        (gpus / key).write_text(str(value))
    return gpus


def setup(checkout: Path, tmp_path: Path, gpus: Path | None = None, **env) -> subprocess.CompletedProcess:
    environment = {k: v for k, v in os.environ.items() if k not in ("DEVICE", "NVIDIA_SMI", "PYTHON")}
    environment.update(SETUP_DRY_RUN="1", HOME=str(tmp_path / "home"), XDG_CONFIG_HOME=str(tmp_path / "config"))
    if gpus is not None:
        environment["PATH"] = f"{FAKE_NVIDIA_SMI_DIR}{os.pathsep}{environment['PATH']}"
        environment["FAKE_GPU_DIR"] = str(gpus)
    else:  # a machine without GPUs, even where this test runs on one
        environment["NVIDIA_SMI"] = str(tmp_path / "no-nvidia-smi")
    environment.update(env)
    result = subprocess.run(["bash", str(checkout / "scripts" / "setup.sh")], env=environment,
                            capture_output=True, text=True, timeout=120)
    assert not (checkout / ".venv").exists(), "the dry run built a venv"
    assert not (tmp_path / "config").exists(), "the dry run linked profiles"
    return result


def test_gpu_box_gets_the_cuda_requirements(checkout, tmp_path):
    result = setup(checkout, tmp_path, fake_gpus(tmp_path))
    out = result.stdout
    assert result.returncode == 0, result.stdout + result.stderr
    assert ("setup: cuda build (envs/requirements-cuda.txt): nvidia-smi -L lists 8 GPU(s) "
            "(DEVICE=auto") in out, out
    # the pinned build checked against the GPUs before anything is installed
    assert f"GPU 0,1,2,3,4,5,6,7: {BLACKWELL} (sm_120); driver 580.95.05" in out
    assert ("torch 2.13.0 of envs/requirements-cuda.txt is built for CUDA 13.0 (sm_75 to sm_121, "
            "driver >= 580.65.06): supports these GPUs") in out
    assert out.index("supports these GPUs") < out.index("would run")
    commands = [line.removeprefix("setup: would run: ") for line in out.splitlines() if "would run" in line]
    assert ".venv/bin/python -m pip install -q --disable-pip-version-check -r envs/requirements-cuda.txt" in commands
    assert ".venv/bin/python -m pip install -q --no-deps -r envs/requirements-nodeps.txt" in commands
    assert ".venv/bin/python -m pip install -q --no-deps -e ." in commands
    assert ".venv/bin/python -m eagle3flow.ops.drain.gpu_env check --device cuda --nvidia-smi nvidia-smi" in commands
    # vLLM's CUDA build needs the torchvision/torchaudio it pins: they stay
    assert not any("uninstall" in c for c in commands)
    assert not any("requirements-cpu.txt" in c for c in commands)


def test_machine_without_gpus_gets_the_cpu_requirements_as_before(checkout, tmp_path):
    result = setup(checkout, tmp_path)
    out = result.stdout
    assert result.returncode == 0, result.stdout + result.stderr
    assert "setup: cpu build (envs/requirements-cpu.txt): no " in out and "no-nvidia-smi on PATH" in out
    commands = [line.removeprefix("setup: would run: ") for line in out.splitlines() if "would run" in line]
    assert commands[1:] == [
        ".venv/bin/python -m pip install -q --disable-pip-version-check -r envs/requirements-cpu.txt",
        ".venv/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec",
        ".venv/bin/python -m pip install -q --no-deps -r envs/requirements-nodeps.txt",
        ".venv/bin/python -m pip install -q --no-deps -e .",
        f".venv/bin/python -m eagle3flow.ops.drain.gpu_env check --device cpu --nvidia-smi {tmp_path / 'no-nvidia-smi'}",
    ], commands
    assert "GPU 0" not in out


def test_device_forces_the_build(checkout, tmp_path):
    gpus = fake_gpus(tmp_path)
    result = setup(checkout, tmp_path, gpus, DEVICE="cpu")
    assert result.returncode == 0 and "setup: cpu build (envs/requirements-cpu.txt): DEVICE=cpu" in result.stdout
    # DEVICE=cuda without GPUs: a login node building the shared venv for the GPU nodes
    result = setup(checkout, tmp_path, DEVICE="cuda")
    assert result.returncode == 0, result.stderr
    assert "setup: cuda build (envs/requirements-cuda.txt): DEVICE=cuda" in result.stdout
    assert "no GPU visible here" in result.stdout and "installing it unchecked" in result.stdout
    result = setup(checkout, tmp_path, DEVICE="rocm")
    assert result.returncode == 2 and "DEVICE=rocm: expected auto, cpu or cuda" in result.stderr


def test_cuda_build_that_cannot_run_on_the_gpus_stops_before_installing(checkout, tmp_path):
    result = setup(checkout, tmp_path, fake_gpus(tmp_path, driver="570.86.10"))
    assert result.returncode == 1
    assert ("NVIDIA driver 570.86.10 is too old for torch 2.13.0 (envs/requirements-cuda.txt: CUDA 13.0, "
            "needs driver >= 580.65.06). Fix: upgrade the driver, or DEVICE=cpu") in result.stderr
    assert "would run" not in result.stdout
    volta = tmp_path / "volta"
    volta.mkdir()
    result = setup(checkout, volta, fake_gpus(volta, name="Tesla V100-SXM2-32GB", compute_cap="7.0"))
    assert result.returncode == 1
    assert "GPU 0 (Tesla V100-SXM2-32GB, sm_70) is outside what CUDA 13.0 builds run on (sm_75 to sm_121)" in result.stderr


def test_make_setup_passes_device():
    result = subprocess.run(["make", "-n", "-C", str(REPO), "setup", "DEVICE=cuda"], capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 0 and "DEVICE=cuda bash scripts/setup.sh" in result.stdout, result.stdout


def test_the_rules_conda_environment_is_the_tested_pins():
    """Every rule names the one conda environment, and it installs exactly the pinned CUDA
    requirements (what .venv is built from on a GPU box) and the package: no second list
    of versions that could drift from what the tests ran."""
    import re

    import yaml

    env = yaml.safe_load((REPO / "envs" / "eagle3flow.yaml").read_text())
    pip = next(d["pip"] for d in env["dependencies"] if isinstance(d, dict))
    assert pip == ["-r requirements-cuda.txt", "-e .."], pip
    assert sorted(p.name for p in (REPO / "envs").glob("*.yaml")) == ["eagle3flow.yaml"]
    for smk in sorted((REPO / "rules").glob("*.smk")):
        text = smk.read_text()
        shells = len(re.findall(r"^\s*shell:$", text, re.M))
        condas = re.findall(r"^(\s*)conda:\n\1    (\S+)$", text, re.M)
        assert len(condas) == shells and all(name == "CONDA_ENV" for _, name in condas), (smk.name, condas)
    assert 'CONDA_ENV = "../envs/eagle3flow.yaml"' in (REPO / "rules" / "common.smk").read_text()
