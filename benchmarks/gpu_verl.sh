#!/usr/bin/env bash
# A real verl fully-async job (verl's own FullyAsyncTrainer, vLLM rollout, FSDP training) with
# dynaresized deciding, on a GPU machine. Not run in CI (no GPU there; on CPU verl's trainer
# cannot start its vLLM rollout servers and FSDP workers). Run it when a GPU machine is lent:
#
#   VERL_PY=/path/to/verl-gpu-venv/bin/python benchmarks/gpu_verl.sh   # writes benchmarks/results/gpu_verl-*
#
# VERL_PY is a Python with verl>=0.9.0, a CUDA torch, vllm and this repository (`pip install -e . --no-deps`)
# installed (the machine has no
# network: nothing is installed here). The model is dynaresized's generated tiny model (no
# download), the data 64 generated prompts, the reward verl's default for the data source.
# With 2+ GPUs: one trainer GPU (one hybrid replica) and one standalone rollout GPU, so the
# daemon lends; with one GPU: verl's only-hybrid mode, where the daemon only observes.
# Passes when the job ends, every step reached the daemon and, with 2+ GPUs, the event log holds
# loans that landed (or loan_payback refusals naming their numbers).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
VERL_PY=${VERL_PY:-.venv-verl-gpu/bin/python}
OUT=${OUT:-benchmarks/results}
STEPS=${STEPS:-6}
mkdir -p "$OUT"
if ! command -v nvidia-smi >/dev/null || ! gpus=$(nvidia-smi -L | grep -c '^GPU'); then
    echo "no NVIDIA GPU visible (nvidia-smi)" >&2
    exit 2
fi
"$VERL_PY" -c 'import torch, vllm, verl, sys; sys.exit(0 if torch.cuda.is_available() else "torch sees no GPU")' || {
    echo "VERL_PY=$VERL_PY needs verl>=0.9.0, vllm and a CUDA torch" >&2; exit 2; }
stamp=$(date +%Y%m%d-%H%M%S)
work=$(mktemp -d)
trap 'kill $(cat "$work/daemon.pid" 2>/dev/null) 2>/dev/null || true' EXIT

# The tiny model and a dataset in verl's format (prompt as chat, reward_model.ground_truth).
"$VERL_PY" - "$work" <<'EOF'
import sys
from pathlib import Path
import pandas as pd
from dynaresized.backends.vllm.tiny_model import build_tiny_model, word
work = Path(sys.argv[1])
build_tiny_model(work / "model")
rows = [{"data_source": "openai/gsm8k", "prompt": [{"role": "user", "content": " ".join(word(10 + (i * 7 + j) % 500) for j in range(12))}],
         "ability": "math", "reward_model": {"style": "rule", "ground_truth": "1"}, "extra_info": {"index": i}}
        for i in range(64)]
pd.DataFrame(rows).to_parquet(work / "train.parquet")
pd.DataFrame(rows[:8]).to_parquet(work / "val.parquet")
EOF

if [ "$gpus" -ge 2 ]; then hybrid=1; standalone=1; rollout_nodes=1; else hybrid=1; standalone=0; rollout_nodes=0; fi
{ printf '[daemon]\nstate_dir = "%s/state"\nworker_endpoint = "tcp://127.0.0.1:5599"\nlog_format = "json"\n' "$work"
  printf '[policy]\nname = "hysteresis"\n[core]\nop_timeout_s = 600.0\n'
  printf '[loan_costs]\nto_rollout_s = 2.0\nlead_s = 2.0\nreturn_s = 2.0\n'
  "$PY" -m dynaresized.integrations.verl --hybrid $hybrid --standalone $standalone; } > "$work/daemon.toml"
"$PY" -m dynaresized.cli serve --config "$work/daemon.toml" > "$OUT/gpu_verl-$stamp.daemon.log" 2>&1 &
echo $! > "$work/daemon.pid"
sleep 5

echo "== verl fully_async_main, $gpus GPU(s): hybrid=$hybrid standalone=$standalone" >&2
"$VERL_PY" -m verl.experimental.fully_async_policy.fully_async_main \
    data.train_files="$work/train.parquet" data.val_files="$work/val.parquet" data.prompt_key=prompt \
    data.max_prompt_length=64 data.max_response_length=64 data.train_batch_size=0 data.gen_batch_size=1 \
    data.return_raw_chat=True actor_rollout_ref.model.path="$work/model" actor_rollout_ref.hybrid_engine=False \
    actor_rollout_ref.rollout.name=vllm actor_rollout_ref.rollout.mode=async actor_rollout_ref.rollout.n=4 \
    actor_rollout_ref.rollout.tensor_model_parallel_size=1 actor_rollout_ref.rollout.gpu_memory_utilization=0.3 \
    actor_rollout_ref.actor.ppo_mini_batch_size=4 actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4 \
    actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=4 actor_rollout_ref.actor.fsdp_config.strategy=fsdp2 \
    algorithm.adv_estimator=grpo trainer.logger=console trainer.val_before_train=False trainer.test_freq=-1 \
    trainer.save_freq=-1 trainer.nnodes=1 trainer.n_gpus_per_node=1 rollout.nnodes=$rollout_nodes \
    rollout.n_gpus_per_node=1 rollout.total_rollout_steps=$((STEPS * 16)) \
    async_training.trigger_parameter_sync_step=1 async_training.require_batches=1 \
    async_training.use_dynamic_resource_scheduling=True async_training.dynamic_schedule_policy=dynaresized \
    +ray_kwargs.ray_init.runtime_env.worker_process_setup_hook=dynaresized.integrations.verl.register \
    +ray_kwargs.ray_init.runtime_env.env_vars.DYNARESIZED_ENDPOINT=tcp://127.0.0.1:5599 \
    > "$OUT/gpu_verl-$stamp.verl.log" 2>&1 || { echo "verl job failed: $OUT/gpu_verl-$stamp.verl.log" >&2; tail -40 "$OUT/gpu_verl-$stamp.verl.log" >&2; exit 1; }

"$PY" -m dynaresized.cli events --state-dir "$work/state" --json > "$OUT/gpu_verl-$stamp.events.jsonl"
"$PY" - "$OUT/gpu_verl-$stamp.events.jsonl" "$standalone" <<'EOF' | tee "$OUT/gpu_verl-$stamp.json"
import json, sys
facts = [json.loads(line) for line in open(sys.argv[1])]
count = lambda t: sum(1 for x in facts if x["type"] == t)
out = {"steps_observed": count("step_observed"), "loans_started": count("loan_started"),
       "loans_landed": count("loan_landed"), "loans_returned": count("loan_returned"),
       "loan_refusals": [x.get("reason", "") for x in facts if x["type"] == "proposal_rejected"][:5],
       "predicted_saves_s": [x.get("saves_s") for x in facts if x["type"] == "loan_started"]}
print(json.dumps(out))
ok = out["steps_observed"] > 0 and (sys.argv[2] == "0" or out["loans_landed"] > 0 or out["loan_refusals"])
sys.exit(0 if ok else 1)
EOF
