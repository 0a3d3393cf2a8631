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
# speculators' own requirements that the image lacks, the project's (jsonschema), and gguf for
# transformers' GGUF reader; openai is stubbed there (speculators imports it for its data
# generation client only), so it and its HTTP stack do not travel
WHEELS="speculators==0.9.0 hs-connectors==0.9.0 pydantic pydantic-core pydantic-settings annotated-types
 typing-inspection python-dotenv typing_extensions loguru datasets==5.1.0 multiprocess xxhash fsspec dill
 tzdata python_dateutil gguf==0.19.0 jsonschema jsonschema-specifications referencing rpds-py attrs
 rich markdown-it-py mdurl pygments shellingham click psutil tqdm protobuf filelock packaging
 aiohttp aiohappyeyeballs aiosignal frozenlist multidict propcache yarl"
PLATFORMS="--platform manylinux2014_x86_64"
for n in 17 24 26 27 28 31 34; do PLATFORMS="$PLATFORMS --platform manylinux_2_${n}_x86_64"; done
for w in $WHEELS; do
  "$PY" -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --abi cp312 --abi abi3 --abi none $PLATFORMS -d "$D/stage/whl" "$w" \
    2> >(grep -v "is ignored" >&2)
done
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
