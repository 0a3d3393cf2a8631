#!/bin/bash
# Round 12 on one GPU: the drafts the vLLM comparison serves (benchmarks/quality/README.md,
# "DFlash against EAGLE-3 in vLLM"): EAGLE-3 with forward KL and with lk_hybrid, and DFlash
# drafts of blocks of 8 and 4 (round 11's best settings: EAGLE-3's target layers, D-PACE,
# lr 1e-3) at the EAGLE-3 draft's training tokens, on gpu_data.py's data. Leaves in WORK/keep
# what the CPU evaluation needs: each draft's train dir, the vocabulary map, the dataset split.
#   bash benchmarks/quality/round12.sh SmolLM2-135M-Instruct.Q4_1.gguf question.jsonl WORK
# GRID (default grid_round12.json) scores another grid the same way: round 13 is
# GRID=benchmarks/quality/grid_round13_fp8.json (train.fp8_matmuls against bf16, two seeds).
source "$(dirname "$0")/gpu_round.sh"
GRID=${GRID:-benchmarks/quality/grid_round12.json}
RESULT=$W/$(basename "$GRID" .json | sed 's/^grid_//').json      # round12.json, round13_fp8.json
step data
python3 benchmarks/quality/gpu_data.py --target "$W/target" --out "$W/data" --prompts 1500 --mt-bench "$MT_BENCH"
D=$W/data
step ablate
python3 benchmarks/quality/ablate.py --gguf "$GGUF" --train "$D/dataset/train.parquet" --eval "$D/dataset/eval.parquet" \
  --score "eval128=$D/eval128.parquet" --score "mt_bench128=$D/mt_bench128.parquet" --work "$W/A" \
  --grid "$GRID" --out "$RESULT"
step keep
mkdir -p "$W/keep"
cp "$RESULT" "$W/A/vocab_map.safetensors" "$W/keep/"
cp -r "$D/dataset" "$W/keep/dataset"
for name in $(python3 -c "import json; print(' '.join(json.load(open('$GRID'))))"); do
  mkdir -p "$W/keep/$name"
  cp "$W/A/out/$name"/{draft.safetensors,draft_config.json,eval.json} "$W/keep/$name/"
done
step done
