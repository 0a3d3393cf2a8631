#!/usr/bin/env bash
# The established trainer in its own venv: speculators 0.9.0 on the CPU torch 2.13.0.
# usage: benchmarks/quality/setup_speculators.sh [VENV]   (default .venv-speculators)
# speculators declares torchvision and torchaudio but never imports them, and PyPI's
# builds of them do not import beside torch 2.13.0+cpu (a plain install would pull a
# CUDA torch): its other requirements are installed, then speculators with --no-deps.
# Its trainer assumes an accelerator in three places, and its checkpoint loader (used when
# a training run resumes) in a fourth; they are patched to fall back to the CPU (the
# files are printed; the check fails on any other version).
set -euo pipefail
VENV=${1:-.venv-speculators}
[[ -x $VENV/bin/python ]] || python3 -m venv "$VENV"
"$VENV/bin/pip" install -q --disable-pip-version-check torch==2.13.0 2> >(grep -v "is ignored" >&2)
"$VENV/bin/pip" install -q --disable-pip-version-check torch==2.13.0 aiohttp click "datasets>=4.0.0,<=5.1.0" \
    httpx huggingface-hub "loguru>=0.7.2,<=0.7.3" "numpy>=2.0.0,<=2.5.4" "openai>=2.0.0" protobuf psutil \
    "pydantic>=2.0.0" "pydantic-settings>=2.0.0" rich safetensors "tqdm>=4.66.3,<=4.70.1" \
    "transformers>=5.0.0,<=5.19.0" "typer>=0.12.0" 2> >(grep -v "is ignored" >&2)
"$VENV/bin/pip" install -q --disable-pip-version-check --no-deps speculators==0.9.0 hs-connectors==0.9.0 \
    2> >(grep -v "is ignored" >&2)
TRAINER=$("$VENV/bin/python" -c "import speculators.train.trainer as m; print(m.__file__)")
sed -i \
  -e 's/^\(\s*\)self\.local_rank = get_local_rank()$/\1self.local_rank = get_local_rank() if torch.accelerator.is_available() else "cpu"/' \
  -e 's/acc\.type if acc is not None else "cuda"$/acc.type if acc is not None else "cpu"/' \
  -e 's/^\(\s*\)torch\.accelerator\.synchronize()$/\1torch.accelerator.is_available() and torch.accelerator.synchronize()/' \
  "$TRAINER"
[[ $(grep -c 'get_local_rank() if torch.accelerator.is_available() else "cpu"' "$TRAINER") == 1 &&
   $(grep -c 'acc.type if acc is not None else "cpu"' "$TRAINER") == 1 &&
   $(grep -c 'torch.accelerator.is_available() and torch.accelerator.synchronize()' "$TRAINER") == 2 ]] \
    || { echo "setup_speculators: the CPU patch did not apply to $TRAINER" >&2; exit 1; }
UTIL=$("$VENV/bin/python" -c "import speculators.utils.util as m; print(m.__file__)")
sed -i -e 's/^\(\s*\)return "cuda:0"$/\1return "cpu"/' "$UTIL"
[[ $(grep -c '^ *return "cpu"$' "$UTIL") == 1 && $(grep -c 'return "cuda:0"' "$UTIL") == 0 ]] \
    || { echo "setup_speculators: the CPU patch did not apply to $UTIL" >&2; exit 1; }
echo "setup_speculators: $("$VENV/bin/speculators" --version 2>/dev/null | tail -1) in $VENV (CPU patch: $TRAINER, $UTIL)"
