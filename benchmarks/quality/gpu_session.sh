#!/usr/bin/env bash
# Issue 31's four drafts on one GPU machine without a package index, from gpu_transfer.sh's parts:
#   bash benchmarks/quality/gpu_session.sh start PARTS      # PARTS: the folder holding every part_*
#   bash benchmarks/quality/gpu_session.sh collect [WAIT_S]     # later calls: the next results
# start installs the wheels (after the image's own packages on the path, so nothing it has is
# shadowed), stubs openai (speculators imports it only for its data-generation client), builds the
# target, takes the workflow's regenerated data where the parts carry it (else gpu_data.py's greedy
# answers), prepares speculators' rows, and starts round31.sh for the defaults (the project's draft and
# speculators' two runs) and, once gpu_data.py has sampled two more answers per train prompt at 0.7,
# for the workflow variant (three answers, one epoch); both in the background, so they outlive the
# call. It then waits for the drafts (at most LIMIT s of the call, 480 by default) and packs them.
# collect waits up to WAIT_S for what is still training, packs each finished draft (one tar in 15 MB
# parts, p<i>_*) and copies the next four parts not yet sent into $OUT (64 MiB a call). Locally, per
# draft: cat p<i>_* | tar -x -C KEEP (run.py evaluate --drafts-from KEEP).
set -uo pipefail
cd "$(dirname "$0")/../.."
R=$PWD; W=/tmp/w31; B=/tmp/w31-bundle; P=/tmp/w31-pack; SITE=/tmp/w31-site
DRAFTS="eagle3flow eagle3flow-answers3 speculators speculators-lk_hybrid"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 PYTHONPATH=$R SPECULATORS_SITE=$SITE
T0=$(date +%s); step() { echo "=== $(( $(date +%s) - T0 ))s $*"; }
# a draft is whole once round31.sh wrote its last file: stripped.json (speculators), ablate-NAME.json (the project)
have() { [ -f $W/keep/$1/stripped.json ] || [ -f $W/keep/$1/ablate-$1.json ]; }

pack() {  # one tar per finished draft (and the logs with the first), split in 15 MB parts
  mkdir -p $P/s
  cp $W/*.log $W/data/dataset/eval_prompts.jsonl $W/data/dataset/stats.json $W/data/*.log $P/s/ 2>/dev/null
  local i=0
  for d in $DRAFTS; do
    i=$((i + 1))
    if have $d && [ ! -f $P/p${i}_aa ]; then
      tar -cf - -C $W/keep $d -C $P s | split -b 15000000 - $P/p${i}_
    fi
  done
  (cd $P && sha256sum p*_* > SHA256SUMS 2>/dev/null)
}

wait_for() {  # at most $1 s, until every draft is there or no round is still running
  local until=$(( $(date +%s) + $1 ))
  while [ $(date +%s) -lt $until ]; do
    local missing=0; for d in $DRAFTS; do have $d || missing=1; done
    [ $missing = 0 ] && break
    pgrep -f round31.sh > /dev/null || pgrep -f gpu_data.py > /dev/null || break   # nothing more will come
    sleep 5
  done
  tail -n 3 $W/round-*.log; ls -la $W/keep/*/*.safetensors 2>/dev/null
}

case "${1:?start PARTS | collect [WAIT_S]}" in
start)
  X=$(realpath "${2:?PARTS}")
  (cd $X && sha256sum -c --quiet SHA256SUMS) || exit 1
  mkdir -p $B && cat $X/part_* | tar -x -C $B || exit 1
  python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target $SITE $B/whl/*.whl 2>&1 | tail -2
  mkdir -p $SITE/openai && cat > $SITE/openai/__init__.py <<'EOF'
# A stand-in for openai: speculators imports it (and openai.types.chat) for its vLLM data client,
# which training never calls. Any name is a placeholder class; dunder lookups fail as on a module.
import importlib.abc
import importlib.machinery
import sys
from types import ModuleType as _ModuleType


def _placeholder(name):
    if name.startswith("__"):
        raise AttributeError(name)
    return type(name, (), {})


class _Submodules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name, path, target=None):
        return importlib.machinery.ModuleSpec(name, self, is_package=True) if name.startswith("openai.") else None

    def create_module(self, spec):
        module = _ModuleType(spec.name)
        module.__path__ = []
        module.__getattr__ = _placeholder
        return module

    def exec_module(self, module):
        pass


sys.meta_path.insert(0, _Submodules())
__getattr__ = _placeholder
EOF
  echo $SITE > "$(python3 -c 'import site; print(site.getsitepackages()[0])')/zz_w31_site.pth"
  python3 -c "
import importlib
for m in ['torch', 'transformers', 'datasets', 'pyarrow', 'jsonschema', 'gguf', 'speculators', 'eagle3flow.config']:
    x = importlib.import_module(m); print(m, getattr(x, '__version__', ''), x.__file__)
" || exit 1
  nvidia-smi -L
  GGUF=$(ls $B/*.gguf)
  mkdir -p $W
  [ -f $W/target/config.json ] || { step target; python3 -m eagle3flow.target.pretrained --out-dir $W/target --gguf $GGUF > $W/target.log 2>&1 || { tail $W/target.log; exit 1; }; }
  GD="python3 benchmarks/quality/gpu_data.py --target $W/target --out $W/data --prompts 1500 --temperature 0.7 --batch 512"
  if [ -d $B/wf ]; then
    step "the workflow's regenerated data"
    mkdir -p $W/data/dataset && cp $B/wf/dataset/* $W/data/dataset/ && gunzip -c $B/wf/responses.jsonl.gz > $W/data/responses.jsonl
  else
    step gpu_data; $GD > $W/gpu_data.log 2>&1 || { tail -30 $W/gpu_data.log; exit 1; }
  fi
  D1=$W/d/default; D2=$W/d/answers3; mkdir -p $D1 $D2
  cp $W/data/dataset/train.parquet $W/data/dataset/eval.parquet $D1/
  if [ ! -f $D1/prepared/token_freq.pt ]; then
    step "speculators prepare-data"
    python3 -c "import sys; from pathlib import Path; sys.path.insert(0, 'benchmarks/quality'); from run import export_rows; \
print(export_rows(Path('$D1/train.parquet'), Path('$W/rows.jsonl')), 'rows')"
    python3 -m speculators prepare-data --model $W/target --data $W/rows.jsonl --output $D1/prepared --seq-length 1024 \
      --num-preprocessing-workers 1 --no-skip-token-freq > $W/prepare.log 2>&1 || { tail -30 $W/prepare.log; exit 1; }
  fi
  step "round31 defaults"
  setsid nohup bash benchmarks/quality/round31.sh $GGUF $D1 $W eagle3flow > $W/round-default.log 2>&1 < /dev/null &
  step "gpu_data: two more answers per train prompt"
  $GD --samples 2 > $W/gpu_data_samples.log 2>&1 || { tail -30 $W/gpu_data_samples.log; exit 1; }
  cp $W/data/train_sampled.parquet $D2/train.parquet && cp $W/data/dataset/eval.parquet $D2/
  step "round31 answers3"
  setsid nohup bash benchmarks/quality/round31.sh $GGUF $D2 $W eagle3flow-answers3 '{"epochs": 1}' \
    > $W/round-answers3.log 2>&1 < /dev/null &
  wait_for $(( ${LIMIT:-480} - $(date +%s) + T0 ))
  bash "$0" collect 0 ;;
collect)
  wait_for ${2:-0}; pack
  cp $P/SHA256SUMS $OUT/ 2>/dev/null; touch $P/sent
  for f in $(ls $P/p*_* 2>/dev/null | grep -vxFf $P/sent | head -4); do cp $f $OUT/ && echo $f >> $P/sent; done
  ls -la $OUT; echo "gpu_session: $(wc -l < $P/sent) of $(ls $P/p*_* 2>/dev/null | wc -l) parts sent" ;;
esac
