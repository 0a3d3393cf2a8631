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

# CI's budget for `make test` on a fresh clone, the set-up included, on 2 cores; no test
# group may take more than its share of it (tests/conftest.py: MAX_GROUP_SHARE).
TEST_BUDGET_S := 2400
TEST_WORKERS := 2

test: setup
	bash scripts/install_test_deps.sh
	EAGLE3FLOW_TEST_BUDGET_S=$(TEST_BUDGET_S) EAGLE3FLOW_TEST_WORKERS=$(TEST_WORKERS) \
	pytest -v -rs --durations=40 -n $(TEST_WORKERS) --dist loadgroup --no-loadscope-reorder tests

lint: setup
	snakemake --lint
