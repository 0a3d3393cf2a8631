# Sourced by the round scripts: their arguments (GGUF, MT-bench questions, WORK), step(), and
# the target built from the GGUF in WORK/target (kept across reruns).
set -euo pipefail
GGUF=$(realpath "${1:?GGUF}"); MT_BENCH=$(realpath "${2:?MT-bench question.jsonl}"); W=$(realpath -m "${3:?WORK}")
mkdir -p "$W"
step() { echo "=== $(date +%T) $*"; }
[ -f "$W/target/config.json" ] || { step target; python3 -m eagle3flow.target.pretrained --out-dir "$W/target" --gguf "$GGUF"; }
