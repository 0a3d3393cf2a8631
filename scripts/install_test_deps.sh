#!/usr/bin/env bash
# System packages the test suite needs beyond .venv, installed once (idempotent):
#   chromium  renders the Snakemake HTML report headless (tests/support/report_checks.py).
#   slurm     a single-node SLURM cluster (slurmctld, slurmd, munge) that
#             tests/test_slurm.py starts, runs the b200-slurm profile on, and stops.
# Skips everything already present; needs root (or sudo) only when something is missing.
set -euo pipefail
missing=()
command -v chromium >/dev/null 2>&1 || missing+=(chromium)
command -v slurmctld >/dev/null 2>&1 || missing+=(slurmctld slurmd slurm-client munge)
if [[ ${#missing[@]} -eq 0 ]]; then
    exit 0
fi
SUDO=""
if [[ $(id -u) -ne 0 ]]; then
    command -v sudo >/dev/null 2>&1 || { echo "install_test_deps: need root to install ${missing[*]}" >&2; exit 1; }
    SUDO="sudo"
fi
echo "install_test_deps: installing ${missing[*]} (apt-get)"
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
