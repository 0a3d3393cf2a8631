# The two commands of the README. Both build the environment first (once).
SHELL := /bin/bash
export PATH := $(CURDIR)/.venv/bin:$(PATH)
export HF_HUB_OFFLINE := 1

# Which build .venv gets: auto (CUDA where nvidia-smi lists a GPU), cpu or cuda.
DEVICE ?= auto

.PHONY: setup demo demo-smollm2 demo-regenerate test lint
setup:
	DEVICE=$(DEVICE) bash scripts/setup.sh

demo: setup
	snakemake --profile embedded

demo-smollm2: setup
	snakemake --profile smollm2

demo-regenerate: setup
	snakemake --profile embedded-regenerate

test: setup
	bash scripts/install_test_deps.sh
	pytest -v -rs --durations=40 -n 2 --dist loadgroup --no-loadscope-reorder tests

lint: setup
	snakemake --lint
