#!/usr/bin/env bash
# The project's own imports that ../shared/gpu's offline vLLM bundle does not carry (the bundle
# holds vLLM 0.25's engine path and snakemake; NVIDIA's torch image has neither pyyaml nor
# datasets, and `vllm serve` imports model_hosting_container_standards). Seen missing on an H200
# on 2026-12-03 (tests/gpu/RESULTS.md).
#   here:  bash tests/gpu/extras.sh download DIR   -> DIR/big (pyarrow, one transfer) and DIR/small
#   there: bash tests/gpu/extras.sh install DIR TARGET   (DIR holding the wheels of both transfers)
# install puts into TARGET only the wheels whose module the machine's python lacks, so nothing
# it already has is shadowed; append TARGET to PYTHONPATH.
set -euo pipefail
WHEELS="yaml:pyyaml datasets:datasets multiprocess:multiprocess xxhash:xxhash fsspec:fsspec pandas:pandas
 tzdata:tzdata dateutil:python_dateutil dill:dill pyarrow:pyarrow jmespath:jmespath supervisor:supervisor
 model_hosting_container_standards:model_hosting_container_standards attrs:attrs"
case "${1:?download DIR | install DIR TARGET}" in
  download)
    D=$(realpath -m "${2:?DIR}"); mkdir -p "$D/big" "$D/small"
    PLAT="--platform manylinux2014_x86_64"
    for n in 17 24 26 27 28 31 34; do PLAT="$PLAT --platform manylinux_2_${n}_x86_64"; done
    for pair in $WHEELS; do
      python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --abi cp312 --abi abi3 --abi none $PLAT -d "$D/small" "${pair##*:}"
    done
    mv "$D"/small/pyarrow-*.whl "$D/big/" ;;
  install)
    D=$(realpath "${2:?DIR}"); T=$(realpath -m "${3:?TARGET}"); mkdir -p "$T"; W=()
    for pair in $WHEELS; do
      python3 -c "import ${pair%%:*}" 2>/dev/null && continue
      W+=($(find "$D" -name "${pair##*:}-*.whl" | head -1))
    done
    echo "installing into $T: ${W[*]:-nothing}"
    if [ ${#W[@]} -gt 0 ]; then
      python3 -m pip install -q --no-index --no-deps --no-compile --target "$T" "${W[@]}"
    fi ;;
esac
