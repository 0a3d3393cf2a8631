#!/usr/bin/env bash
# What gpu_session.sh needs on a GPU machine that reaches no package index, packed here into
# transfers that fit the device tool's 64 MiB per call: the target's GGUF file, the wheels that
# machine's image lacks (speculators 0.9 and what it and the project import there; the image's
# own torch, transformers, pyarrow, pandas, pyyaml, typer and httpx are used as they are), and,
# when WORK is given, the workflow's regenerated data (run.py's default variant: the target's
# greedy answers through a CPU vLLM server and the dataset stage's split), which then stands in
# for gpu_data.py's greedy answers there.
#   bash benchmarks/quality/gpu_transfer.sh DIR [WORK]    (DIR under the repo, ignored by git)
# Writes DIR/1, DIR/2, ... (one per call, each under 62 MB); on the GPU machine, one call per
# folder, back to back (files outside the transferred tree last only while it stays up):
#   mkdir -p /tmp/x && cp DIR/1/* /tmp/x/                    (carry DIR/1)
#   ... each further folder but the last likewise ...
#   cp DIR/N/* /tmp/x/ && bash benchmarks/quality/gpu_session.sh start /tmp/x     (carry DIR/N)
set -euo pipefail
cd "$(dirname "$0")/../.."
D=$(realpath -m "${1:?DIR}"); WORK=${2:-}
PY=${PYTHON:-.venv/bin/python}
rm -rf "$D" && mkdir -p "$D/stage/whl"
GGUF=$("$PY" -c "from eagle3flow.target.pretrained import gguf_location as g; d, n = g(); print(d / n)")
cp "$GGUF" "$D/stage/"
bash benchmarks/gpu_wheels.sh "$D/stage/whl" quality
if [ -n "$WORK" ]; then
  R=$WORK/workflow/results
  mkdir -p "$D/stage/wf/dataset"
  cp "$R"/dataset/{train.parquet,eval.parquet,eval_prompts.jsonl,stats.json} "$D/stage/wf/dataset/"
  gzip -9 -c "$R/regenerate/responses.jsonl" > "$D/stage/wf/responses.jsonl.gz"
fi
(cd "$D/stage" && tar -cf - *) | split -b 58000000 - "$D/part_"
rm -rf "$D/stage"
i=0
(cd "$D" && sha256sum part_* > SHA256SUMS)
for p in "$D"/part_*; do i=$((i + 1)); mkdir -p "$D/$i"; mv "$p" "$D/$i/"; done
mv "$D/SHA256SUMS" "$D/$i/"
du -sh "$D"/*/ | sed 's/^/gpu_transfer: /'
echo "gpu_transfer: $i transfers; the last: cp ${1}/$i/* /tmp/x/ && bash benchmarks/quality/gpu_session.sh start /tmp/x"
