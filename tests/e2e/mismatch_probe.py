"""Rows for the multi-host MoE job's probe of `updates.moe_mismatch_metrics` on process-local rows
(tests/e2e/test_multihost.py): each process's own old / rollout log-probs and mask, seeded by its index, so the test
can build every process's rows and compute the whole batch's reference. The run's own log-probs cannot tell a
whole-batch metric from one process's: under float32 routing replay both differ from zero only by roundoff."""

from __future__ import annotations

import numpy as np

ROWS, COLS = 8, 6  # per process: a multiple of its 4 devices on the batch axes


def probe_rows(process: int) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """`(b, mask)` of process `process`: `old_log_probs`, `rollout_log_probs` `[ROWS, COLS] float32` in (-3, 0],
    `mask [ROWS, COLS] int32` (about 70% ones)."""
    rng = np.random.default_rng(100 + process)
    b = {k: (-3.0 * rng.random((ROWS, COLS))).astype(np.float32) for k in ("old_log_probs", "rollout_log_probs")}
    return b, (rng.random((ROWS, COLS)) < 0.7).astype(np.int32)
