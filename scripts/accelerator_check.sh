#!/usr/bin/env bash
# One-shot accelerator check (issue 37): run on ONE GPU or TPU host, from the repository root.
#   bash scripts/accelerator_check.sh [--json /tmp/accelerator_check.json]
# Compiles, then times the bf16 rollout and the bf16 actor update (MFU), peak device memory, and greedy
# parity with the CPU path, on SmolLM2-135M and a ~1B random model; prints a table and one JSON line
# (scripts/accelerator_check.py). Bounded to 8 minutes. `--tiny` runs the same code on a toy (CPU).
set -euo pipefail
cd "$(dirname "$0")/.."
timeout 480 python scripts/accelerator_check.py "$@"
