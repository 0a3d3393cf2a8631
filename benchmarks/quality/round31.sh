#!/bin/bash
# Issue 31's drafts trained on one GPU (gpu_session.sh runs it there, on the workflow's own split):
# the project's draft (the trainer's defaults at the benchmark's budget, through ablate.py) and,
# where DATA has speculators' prepared rows, speculators 0.9's two runs (run.py's SPECULATORS_RUNS:
# its default loss and lk_hybrid) on the same train split, their hidden states written by
# speculators_gpu_data.py in the project's extraction dtype. Leaves in WORK/keep what run.py's
# evaluation serves (the speculators checkpoints without the embedding, a frozen copy of the
# target's, checked equal; run.py puts it back).
#   bash benchmarks/quality/round31.sh GGUF DATA WORK NAME [OVERRIDES_JSON]
# DATA: train.parquet, eval.parquet and, for the speculators runs, prepared/ (its prepare-data's rows).
# SPECULATORS_SITE: where speculators 0.9 and its dependencies are installed (a --target folder).
set -euo pipefail
GGUF=$(realpath "${1:?GGUF}"); DATA=$(realpath "${2:?DATA}"); W=$(realpath -m "${3:?WORK}")
NAME=${4:?NAME}; OVERRIDES=${5:-"{}"}
HERE=$(dirname "$0")
step() { echo "=== $(date +%T) $*"; }
mkdir -p "$W/keep"
[ -f "$W/target/config.json" ] || { step target; python3 -m eagle3flow.target.pretrained --out-dir "$W/target" --gguf "$GGUF"; }
LAYERS=$(python3 -c "import json; from eagle3flow.layers import default_aux_layer_ids as d; \
print(' '.join(map(str, d(json.load(open('$W/target/config.json'))['num_hidden_layers']))))")

speculators_runs() {
  local P=$W/prepared
  if [ ! -f "$P/hidden_states.done" ]; then
    step "speculators data (layers $LAYERS)"
    rm -rf "$P" && cp -r "$DATA/prepared" "$P" || return 1
    python3 "$HERE/speculators_gpu_data.py" --target "$W/target" --prepared "$P" --layer-ids $LAYERS \
      --dtype bfloat16 || return 1
    touch "$P/hidden_states.done"
  fi
  for run in "speculators:" "speculators-lk_hybrid:--loss-fn lk_hybrid"; do
    local name=${run%%:*} extra=${run#*:}
    [ -f "$W/keep/$name/model.safetensors" ] && continue
    step "train $name"
    # the benchmark's budget and data flags of run.py's speculators_train, with speculators'
    # own GPU attention (flex) instead of the CPU run's sdpa; its eager loss (the same math):
    # the fused Triton one fails to compile under torch 2.11 ("ListVariable ... already tracked")
    (PYTHONPATH=$SPECULATORS_SITE HF_HUB_OFFLINE=1 python3 -m speculators train --verifier-name-or-path "$W/target" \
      --data-path "$P" --save-path "$W/ckpt-$name" --draft-vocab-size 8192 --epochs 3 --ttt-steps 7 \
      --total-seq-len 2048 --target-layer-ids $LAYERS --train-data-ratio 0.99 --hidden-states-dtype bfloat16 \
      --loss-implementation eager --on-missing raise $extra > "$W/train-$name.log" 2>&1) || { tail -30 "$W/train-$name.log"; return 1; }
    python3 - "$W/ckpt-$name/epoch2_end" "$W/target" "$W/keep/$name" <<'EOF'
import json, shutil, sys
from pathlib import Path
import torch
from safetensors.torch import load_file, save_file
src, target, out = map(Path, sys.argv[1:])
weights = load_file(src / "model.safetensors")
embed = weights.pop("embed_tokens.weight")
reference = load_file(next(target.glob("*.safetensors")))["model.embed_tokens.weight"].to(embed.dtype)
same = torch.equal(embed, reference)
print(f"{src}: embed_tokens equal to the target's ({embed.dtype}): {same}")
if not same:
    raise SystemExit("the speculators embedding differs from the target's: keep it")
out.mkdir(parents=True, exist_ok=True)
save_file(weights, out / "model.safetensors", metadata={"format": "pt"})
shutil.copy(src / "config.json", out / "config.json")
(out / "stripped.json").write_text(json.dumps({"removed": "embed_tokens.weight", "dtype": str(embed.dtype)}) + "\n")
EOF
    [ -f "$W/keep/$name/model.safetensors" ] || return 1
  done
}

project_run() {
  step "project $NAME $OVERRIDES"
  echo "{\"$NAME\": $OVERRIDES}" > "$W/grid-$NAME.json"
  python3 "$HERE/ablate.py" --gguf "$GGUF" --train "$DATA/train.parquet" --eval "$DATA/eval.parquet" \
    --work "$W/A-$NAME" --grid "$W/grid-$NAME.json" --out "$W/ablate-$NAME.json" > "$W/project-$NAME.log" 2>&1 \
    || { tail -30 "$W/project-$NAME.log"; return 1; }
  mkdir -p "$W/keep/$NAME"
  cp "$W/A-$NAME/out/$NAME"/{draft.safetensors,draft_config.json,eval.json} "$W/A-$NAME/vocab_map.safetensors" \
    "$W/ablate-$NAME.json" "$W/keep/$NAME/" || return 1
}

# the project's draft and speculators' on the same GPU at once (a 135M target leaves it mostly idle)
project_run & P=$!
S=skipped
if [ -d "$DATA/prepared" ]; then speculators_runs && S=0 || S=$?; fi
wait $P && P=0 || P=$?
step "done (project rc ${P}, speculators rc ${S})"
du -sh "$W"/keep/*
