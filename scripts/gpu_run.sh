#!/usr/bin/env bash
# The device run of scripts/gpu_check.py as one prepared command, for a GPU machine that reaches no package
# index (docs/gpu/README.md, "Running it"):
#
#   scripts/gpu_run.sh --fetch          # on a machine with the package index: the wheels into wheels/ (ignored)
#   scripts/gpu_run.sh [gpu_check args] # on the GPU machine, from the repository's root: install them, then
#                                       # gpu_check within its budget, stopped by `timeout` if it overruns
#
# The wheels: megatron-core (the project's dependency, never vendored) and torchtitan with what its Trainer
# imports that a GPU image with torch, transformers, pyarrow, pandas, tensorboard lacks; each --no-deps,
# Python 3.12, installed into a folder of their own. Everything else comes from the machine's image.
# Results go to $GPU_CHECK_OUT, else $OUT (a folder the caller collects), else docs/gpu.
set -euo pipefail
cd "$(dirname "$0")/.."

WHEELS=${WHEELS:-wheels}
PINNED=(
    megatron-core==0.19.2 torchao==0.18.0
    torchtitan==0.3.0 spmd_types==0.2.3 torch_checkpointing==0.1.1 torchdata==0.11.0
    tyro==1.0.17 docstring-parser==0.18.0 typeguard==4.6.1
    datasets==4.7.0 dill==0.4.0 multiprocess==0.70.18
)

if [ "${1:-}" = "--fetch" ]; then
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        -d "$WHEELS" "${PINNED[@]}"
    du -sh "$WHEELS"
    exit 0
fi

SITE=${GPU_RUN_SITE:-/tmp/gpu_run_site}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "$WHEELS"/*.whl
export PYTHONPATH="$PWD:$PWD/scripts:$SITE${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
OUT_DIR=${GPU_CHECK_OUT:-${OUT:-docs/gpu}}
# gpu_check's own budget (--budget-s, 480 s by default) stops sections; this stops the whole at 9 minutes
exec timeout --signal=TERM --kill-after=15 "${GPU_RUN_TIMEOUT_S:-540}" python3 scripts/gpu_check.py --out "$OUT_DIR" "$@"
