#!/usr/bin/env bash
# The wheels a GPU machine without a package index lacks for this repo's GPU benchmarks and tests:
# its image has torch, transformers, pyarrow, pandas, pyyaml, but not what eagle3flow.config
# imports (jsonschema) nor speculators 0.9 (train_throughput.py --against speculators).
#   bash benchmarks/gpu_wheels.sh DIR [speed|quality]      (DIR under the repo, ignored by git)
# speed (default, ~4 MB): jsonschema and speculators' model code with pydantic; quality: also what
# benchmarks/quality/gpu_session.sh needs (datasets, gguf, hs-connectors, loguru, ...).
# There, in the call that carries DIR:
#   python3 -m pip install -q --no-index --no-deps --target /tmp/pd DIR/*.whl; export PYTHONPATH=$PWD:/tmp/pd
set -euo pipefail
cd "$(dirname "$0")/.."
D=$(realpath -m "${1:?DIR}"); SET=${2:-speed}
PY=${PYTHON:-.venv/bin/python}
WHEELS="jsonschema jsonschema-specifications referencing rpds-py attrs
 speculators==0.9.0 pydantic pydantic-core pydantic-settings annotated-types typing-inspection python-dotenv
 typing_extensions"
if [ "$SET" = quality ]; then
  # openai is stubbed there (speculators imports it for its data generation client only), so it
  # and its HTTP stack do not travel
  WHEELS="$WHEELS hs-connectors==0.9.0 loguru datasets==5.1.0 multiprocess xxhash fsspec dill tzdata
 python_dateutil gguf==0.19.0 rich markdown-it-py mdurl pygments shellingham click psutil tqdm protobuf filelock
 packaging aiohttp aiohappyeyeballs aiosignal frozenlist multidict propcache yarl"
elif [ "$SET" != speed ]; then
  echo "gpu_wheels: unknown set '$SET' (speed or quality)" >&2; exit 2
fi
PLATFORMS="--platform manylinux2014_x86_64"
for n in 17 24 26 27 28 31 34; do PLATFORMS="$PLATFORMS --platform manylinux_2_${n}_x86_64"; done
mkdir -p "$D"
for w in $WHEELS; do
  "$PY" -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --abi cp312 --abi abi3 --abi none $PLATFORMS -d "$D" "$w" \
    2> >(grep -v "is ignored" >&2)
done
echo "gpu_wheels: $(ls "$D" | wc -l) wheels, $(du -sh "$D" | cut -f1) in $D"
