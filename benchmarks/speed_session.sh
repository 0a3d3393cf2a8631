#!/bin/bash
# Issue 32's measurements on one GPU in one call of at most 10 minutes, each step under its own
# time limit so the ones before it always come back. Writes JSON and logs into OUT_DIR.
#   PYTHONPATH=$PWD:<speculators wheels> bash benchmarks/speed_session.sh OUT_DIR SCRATCH_DIR
# (the wheels: bash benchmarks/gpu_wheels.sh .whl here, carried; its header says how they install there)
# 1. the 8B shape compute-only with fused AdamW and with the trainer's Muon, and speculators 0.9
#    in the same run (~3 min); 2. the CUDA tests of training (~2.5 min; test_triton_kernels'
#    interpreter run is left to the CPU suite); 3. the trainer from fp8 shards, compute-only with
#    the same optimizer (~2.5 min: 8.6 GB written, then trained; bf16 takes twice the writing).
set -u
OUT=$(realpath -m "${1:?OUT_DIR}"); S=$(realpath -m "${2:?SCRATCH_DIR}")
mkdir -p "$OUT" "$S"
export PYTHONUNBUFFERED=1
step() { echo "== $(date +%T) $*"; }
step throughput
timeout 220 python3 benchmarks/train_throughput.py --settings llama8b --masks ones --compile on --shapes varying \
  --optimizer adamw,muon --warmup 3 --iters 10 --against speculators --out "$OUT/throughput.json" \
  > "$OUT/throughput.log" 2>&1
tail -6 "$OUT/throughput.log"
step tests
timeout 170 python3 -m pytest -p no:cacheprovider -q tests/test_cuda_paths.py tests/test_train_distributed.py \
  tests/test_flops.py > "$OUT/tests.log" 2>&1
tail -2 "$OUT/tests.log"
step from_shards
timeout 170 python3 benchmarks/train_from_shards.py --setting llama8b --storage fp8 --dir "$S/from_shards" \
  --drop-caches --optimizer muon --out "$OUT/from_shards.json" > "$OUT/from_shards.log" 2>&1
grep "^from_shards: [cf]" "$OUT/from_shards.log"
step done
