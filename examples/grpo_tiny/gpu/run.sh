#!/usr/bin/env bash
# The GRPO example on one GPU machine (N >= 2 GPUs; device i = GPU i). Not run in this project's
# CI (no GPU there). Each device keeps one trainer rank (NCCL, cuda:i) and one vLLM engine pinned
# to GPU i; a release puts the engine to sleep (vLLM sleep mode, level 1) instead of stopping it.
# Per-op resize latencies are in the daemon's event log: `dynaresized events --state-dir $WORK/state`
# (op_acked / op_completed facts, one per op, with seconds), summarised by ops.py below.
set -euo pipefail
cd "$(dirname "$0")/../../.."
N=${N:-$(nvidia-smi -L | wc -l)}
WORK=${WORK:-/tmp/grpo-tiny-gpu}
STEPS=${STEPS:-60}
rm -rf "$WORK"
python -m examples.grpo_tiny.run --gpu --devices "$N" --initial-train $((N / 2)) --steps "$STEPS" \
    --prompts 64 --group 8 --micro-batches 8 --kv-cache-mib 2048 --policy hysteresis \
    --force 5:grow,25:shrink --deterministic --work "$WORK" --json | tee "$WORK.out"
python examples/grpo_tiny/gpu/ops.py "$WORK/state/events.sqlite"
