#!/bin/bash
# Ablation round 11 on one GPU (run on an H100 on 2026-12-05; README.md): EAGLE-3 against DFlash
# drafts at the same training tokens (grid_round11_dflash.json: block sizes, target layers,
# anchors, lr, soft targets) and the LK losses against forward KL at T=0 and at temperature
# (grid_round11_lk.json), on gpu_data.py's data with held-out and MT-bench answers greedy and
# sampled at 0.6 and 1.0. Resumes: each step skips what its outputs already hold.
#   bash benchmarks/quality/round11.sh SmolLM2-135M-Instruct.Q4_1.gguf question.jsonl WORK
source "$(dirname "$0")/gpu_round.sh"
step data
python3 benchmarks/quality/gpu_data.py --target "$W/target" --out "$W/data" --prompts 1500 \
  --mt-bench "$MT_BENCH" --eval-temperature 0.6 --eval-temperature 1
D=$W/data
SCORE=()
for split in eval128 mt_bench128 eval128_t0.6 mt_bench128_t0.6 eval128_t1 mt_bench128_t1; do
  SCORE+=(--score "$split=$D/$split.parquet")
done
for grid in ${GRIDS:-dflash lk}; do
  step "ablate $grid"
  python3 benchmarks/quality/ablate.py --gguf "$GGUF" --train "$D/dataset/train.parquet" \
    --eval "$D/dataset/eval.parquet" "${SCORE[@]}" --work "$W/A" \
    --grid "benchmarks/quality/grid_round11_$grid.json" --out "$W/round11_$grid.json"
done
step done
