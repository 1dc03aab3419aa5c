#!/usr/bin/env bash
# The one prepared run for a lent GPU machine (one GPU, no network, its own CUDA torch): what the
# CPU machine cannot measure, in about six minutes. Not run in CI (no GPU there).
#
#   benchmarks/gpu_check.sh        # writes $OUT (default benchmarks/results) gpu_*.json
#
# * benchmarks/gpu_decode.py: the per-rank decode iteration of TP-1/2/4/8 engines of a
#   Qwen3-8B-shaped model (the simulator's TP cost curve, less the all-reduces one GPU cannot
#   show), an engine and a trainer time-sharing the GPU as verl's hybrid replicas do (sleep,
#   wake and weight sync: seconds and the memory each frees), pinned vs pageable host staging;
# * benchmarks/resize_torch.py on CUDA tensors: the torch backend's transfers through its pinned
#   staging buffer (gloo: NCCL needs two GPUs for two ranks).
#
# The machine has no network: the project's pure-Python needs that its image lacks (msgspec,
# structlog, pyzmq) travel as wheels in .whl/ (docs/benchmarks.md, "On a GPU machine", says how
# to fetch them). vLLM does not: its CUDA wheel is far over what a run may carry, so vLLM's
# sleep / wake / reload_weights on a GPU stay unmeasured (gpu_decode.py's time_share measures
# the same transitions on plain torch tensors).
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python3}
OUT=${OUT:-benchmarks/results}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv,noheader > "$OUT/gpu.txt" 2>&1
cat "$OUT/gpu.txt"
if [ -d .whl ]; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
"$PY" -m pip install -q --no-index --no-deps --no-build-isolation --no-cache-dir --target /tmp/project . >/dev/null 2>&1 \
    && export PYTHONPATH=/tmp/project:$PYTHONPATH || echo "note: the project did not install; resize_torch.py will fail" >&2

if [ -z "${SKIP_DECODE:-}" ]; then
    echo "== gpu_decode.py" >&2
    timeout 330 "$PY" benchmarks/gpu_decode.py --budget-s 280 > "$OUT/gpu_decode.json" 2> "$OUT/gpu_decode.log"
    echo "gpu_decode.py exit $?" >&2
    tail -3 "$OUT/gpu_decode.log" >&2
fi

echo "== resize_torch.py --device cuda --backend gloo (transfer, staging)" >&2
# from outside the checkout: its ranks are spawned processes, and the checkout's dynaresized/
# (no backends/ in it: they install as dynaresized.backends) would shadow the installed package
here=$(pwd)
(cd /tmp && timeout 200 "$PY" "$here/benchmarks/resize_torch.py" --device cuda --backend gloo --only transfer,staging) \
    > "$OUT/gpu_resize.json" 2> "$OUT/gpu_resize.log"
echo "resize_torch.py exit $?" >&2
tail -3 "$OUT/gpu_resize.log" >&2
ls -l "$OUT" >&2
