"""`scripts/memory_plan.py`: XLA's per-device memory of the real update, on a fake 8-device mesh."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.slow  # one XLA:CPU compile of a 2-layer SmolLM2-shaped update in a subprocess (8 fake devices)
def test_arguments_are_the_sharded_params_and_adam_moments_by_hand(tmp_path):
    """Full fine-tuning, float32, fsdp=8: the update's arguments per device are params + Adam mu + nu, each
    1/8 of the params except the replicated norm scales, plus the small packed batch. Counted by hand from
    SmolLM2-135M's shapes with 2 layers (tied embedding)."""
    out = tmp_path / "plan.json"
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu")
    cmd = [sys.executable, "scripts/memory_plan.py", "--plans", "smoke_135m", "--layers", "2", "--json", str(out)]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=1500)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (rec,) = json.loads(out.read_text())
    d, f, v, kv = 576, 1536, 49152, 3 * 64
    sharded = v * d + 2 * (d * d + 2 * d * kv + d * d + 3 * d * f)  # embedding + q, k, v, o + gate, up, down
    norms = 2 * 2 * d + d  # two per layer + the final norm (replicated)
    per_device = 3 * 4 * (sharded / 8 + norms)  # params, mu, nu in float32
    assert rec["layers"] == 2 and "REDUCED" in rec["layers_note"]
    b = rec["bytes"]
    assert per_device <= b["arguments"] < per_device * 1.02  # + the packed batch (< 2%)
    assert b["aliased"] == pytest.approx(per_device, rel=0.01)  # params + opt state donated
    total = b["arguments"] + b["outputs"] - b["aliased"] + b["temps"]
    assert rec["update_total_gb"] == pytest.approx(total / 1e9, abs=1e-3)
    assert b["reference"] == 0  # no KL term in this plan
    assert b["rollout_copy"] == 2 * sharded // 8 + 4 * norms  # bf16 matrices, norm scales kept in float32
