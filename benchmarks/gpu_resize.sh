#!/usr/bin/env bash
# The torch backend benchmark on a GPU machine: pinned host staging, GPU tensors, and NCCL
# between GPUs where the machine has enough of them. Not run in CI (no GPU there); run it
# when a GPU machine is lent, then record its numbers in docs/torch-backend.md.
#
#   benchmarks/gpu_resize.sh            # writes benchmarks/results/gpu_resize-*.json
#
# NCCL refuses two ranks of one communicator on the same GPU, so:
# * always: --device cuda --backend gloo: 4 ranks share the GPUs (several processes per GPU),
#   GPU state moves through pinned staging buffers; staging is measured GPU <-> host;
# * with >= 4 GPUs: --device cuda --backend nccl for every part (one rank per GPU);
# * with 2-3 GPUs: NCCL for the two-rank parts (transfer, staging) only.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
OUT=${OUT:-benchmarks/results}
mkdir -p "$OUT"
if ! command -v nvidia-smi >/dev/null || ! gpus=$(nvidia-smi -L | grep -c '^GPU'); then
    echo "no NVIDIA GPU visible (nvidia-smi)" >&2
    exit 2
fi
"$PY" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else "torch sees no GPU: install a CUDA build of torch==2.13.0")'
stamp=$(date +%Y%m%d-%H%M%S)
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader > "$OUT/gpu_resize-$stamp.gpus.txt"

echo "== gloo, GPU tensors through pinned staging ($gpus GPU(s))" >&2
"$PY" benchmarks/resize_torch.py --device cuda --backend gloo > "$OUT/gpu_resize-$stamp-gloo.json"

if [ "$gpus" -ge 4 ]; then
    echo "== NCCL, one rank per GPU" >&2
    "$PY" benchmarks/resize_torch.py --device cuda --backend nccl \
        --only communicators,resize,transfer,staging > "$OUT/gpu_resize-$stamp-nccl.json"
elif [ "$gpus" -ge 2 ]; then
    echo "== NCCL, two ranks on two GPUs" >&2
    "$PY" benchmarks/resize_torch.py --device cuda --backend nccl \
        --only transfer,staging > "$OUT/gpu_resize-$stamp-nccl.json"
fi
ls -1 "$OUT"/gpu_resize-"$stamp"* >&2

# A real verl fully-async job with dynaresized deciding, where a verl GPU environment is at hand.
if [ -x "${VERL_PY:-.venv-verl-gpu/bin/python}" ]; then
    echo "== verl fully-async job with dynaresized (benchmarks/gpu_verl.sh)" >&2
    OUT="$OUT" benchmarks/gpu_verl.sh || echo "gpu_verl.sh failed (exit $?)" >&2
fi
