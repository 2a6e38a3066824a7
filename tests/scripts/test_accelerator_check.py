"""`scripts/accelerator_check.sh` / `.py` (issue 37): its CPU-runnable parts. The accelerator numbers come
from running it on a GPU / TPU host; here the same code runs on a toy (`--tiny`) and its parity measure is
checked by hand."""

from __future__ import annotations

import math
import os
import subprocess

import numpy as np
import pytest

from tests.script_loader import load_script

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_greedy_parity_counts_equal_rows_and_prefixes():
    ac = load_script("accelerator_check")
    a = np.array([[1, 2, 3, 4], [1, 2, 3, 4], [5, 6, 7, 8]])
    b = np.array([[1, 2, 3, 4], [1, 2, 9, 4], [0, 6, 7, 8]])
    # row 0 equal (4/4), row 1 differs at 2 (2/4), row 2 at 0 (0/4): mean 0.5
    assert ac.greedy_parity(a, b) == {"rows_equal": "1/3", "prefix_equal": 0.5}
    with pytest.raises(ValueError, match="differ in shape"):
        ac.greedy_parity(a, b[:, :3])


def test_shell_wrapper_is_bounded_and_valid_bash():
    path = os.path.join(REPO, "scripts", "accelerator_check.sh")
    assert os.access(path, os.X_OK)
    with open(path) as f:
        assert "timeout 480 python scripts/accelerator_check.py" in f.read()  # < 8 minutes
    subprocess.run(["bash", "-n", path], check=True)


@pytest.mark.slow  # one rollout + update compile of a 2-layer toy (~30 CPU seconds, minutes on a loaded machine)
def test_tiny_mode_runs_every_stage_on_cpu():
    ac = load_script("accelerator_check")
    (row,) = ac.main(["--tiny"])
    assert row["platform"] == "cpu" and row["dtype"] == "float32"  # the CPU platform defaults
    assert row["rollout_tokens_per_s"] > 0 and row["update_s"] > 0 and row["update_compile_s"] > 0
    assert math.isfinite(row["update_loss"])
    assert 0 < row["mfu"] < 1
    # the same weights greedy-decoded twice on the CPU: identical
    assert row["greedy_rows_equal"] == "2/2" and row["greedy_prefix_equal"] == 1.0
    assert row["peak_device_memory_gb"] is None  # CPU devices keep no memory stats
    assert not [k for k in row if k.endswith("_error")]
    # the kernel stage ran cuDNN's call in its CPU form on a row with shared prompts: equal to the dense path
    kp = row["kernel_parity"]
    assert kp["kernel"] == "cudnn" and kp["shared_prompt_segments"] and kp["kernel_ok"]
    assert kp["kernel_lp_err"] < 1e-5 and kp["kernel_grad_err"] < 1e-5
