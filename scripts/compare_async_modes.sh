#!/usr/bin/env bash
# Issue 57's comparison on SmolLM2-135M-Instruct: the default task (configs/grpo.py, 30 steps) synchronous
# (colocated) vs one-step-off vs fully asynchronous with partial rollout (staleness <= 2, token IS), the two
# asynchronous runs on the split placement (2 host devices: 1 generates, 1 trains), then one plot and one table
# (scripts/compare_runs.py). ~40 min on a quiet 2-core CPU; run it alone: the step times mean nothing under load.
#   bash scripts/compare_async_modes.sh [OUT_DIR]          (default: runs/async_compare)
# Extra arguments after OUT_DIR go to all three runs (e.g. --config.trainer.total_training_steps=3 to try it).
# The fully-async run logs its scored responses (trainer.rollout_data_dir: lengths for simulate_rollout.py --lengths).
# MODES="sync one_step_off" runs only those (the table and plot are made when all three runs are in OUT_DIR).
set -euo pipefail
cd "$(dirname "$0")/.."
config="${CONFIG:-configs/grpo.py}"  # CONFIG=configs/grpo.py:tiny tries the script in a few minutes
out="${1:-runs/async_compare}"
shift || true
mkdir -p "$out"
split=(--config.rollout.n_gpus_per_node=1)
run() {  # name, then the run's own arguments
  local name="$1"
  shift
  echo "$name: start $(date -u +%T), load average $(cut -d' ' -f1-3 /proc/loadavg)" | tee -a "$out/timeline.txt"
  python -m jaxrl_post.main --config="$config" --config.trainer.default_local_dir="$out/$name" "$@" \
    >"$out/$name.log" 2>"$out/$name.err"
  echo "$name: end $(date -u +%T), load average $(cut -d' ' -f1-3 /proc/loadavg)" | tee -a "$out/timeline.txt"
}
extra=("$@")
modes=" ${MODES:-sync one_step_off fully_async} "
want() { [[ "$modes" == *" $1 "* ]]; }
if want sync; then run sync "${extra[@]}"; fi
if want one_step_off; then XLA_FLAGS=--xla_force_host_platform_device_count=2 run one_step_off "${split[@]}" \
  --config.async_training.mode=one_step_off "${extra[@]}"; fi
# 16 slots: a generation batch is 2 prompts x 8 samples (the pool then holds 16 sequences, not vLLM's default 256;
# before the decode batch followed the running sequences, 256 slots computed 16x the rows: 117-232 s a step)
if want fully_async; then XLA_FLAGS=--xla_force_host_platform_device_count=2 run fully_async "${split[@]}" --config.rollout.name=paged \
  --config.rollout.max_num_seqs=16 \
  --config.async_training.mode=fully_async --config.async_training.staleness_threshold=2 \
  --config.async_training.trigger_parameter_sync_step=1 --config.async_training.require_batches=2 \
  --config.async_training.partial_rollout=True --config.algorithm.rollout_correction.rollout_is=token \
  --config.algorithm.rollout_correction.rollout_is_threshold=2.0 \
  --config.trainer.rollout_data_dir="$out/fully_async_rollouts" "${extra[@]}"; fi
for name in sync one_step_off fully_async; do [ -d "$out/$name" ] || exit 0; done
python scripts/compare_runs.py "$out/sync" "$out/one_step_off" "$out/fully_async" \
  --labels sync,one_step_off,fully_async --out "$out/compare.png" --json "$out/compare.json"
