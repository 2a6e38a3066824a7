"""The staleness rule of asynchronous training and its metrics.

A group sampled under policy version v (the weights after v training steps; with partial rollout, the version of
its oldest token) may train at step t (the update that turns version t into t + 1) only if `t - v <= threshold`;
otherwise it is dropped and counted (`GroupQueue.drop(group, 'stale')`). AReaL calls the threshold
`max_staleness`; verl's fully-async recipe `async_training.staleness_threshold`.
"""

from __future__ import annotations

import numpy as np

STALE = "stale"


def is_fresh(version: int, step: int, threshold: int) -> bool:
    """`step - version <= threshold` (a version from the future is a bug: ValueError)."""
    if version > step:
        raise ValueError(f"a group of policy version {version} at training step {step}: versions run ahead")
    return step - version <= threshold


def staleness_metrics(versions_BR: np.ndarray, mask_BR: np.ndarray, step: int) -> dict[str, float]:
    """`async/staleness/{mean,max}` over samples (a sample's staleness: `step` minus the version of its oldest
    token; `versions_BR [B, R] int32`, `mask_BR [B, R]` the tokens that exist) and `async/token_staleness/mean`
    over tokens."""
    v = np.asarray(versions_BR, np.int64)
    m = np.asarray(mask_BR) > 0
    big = np.iinfo(np.int64).max
    oldest = np.where(m, v, big).min(axis=1)
    oldest = np.where(oldest == big, step, oldest)  # a row without tokens: not stale
    per_sample = step - oldest
    tok = (step - v)[m]
    return {
        "async/staleness/mean": float(per_sample.mean()),
        "async/staleness/max": float(per_sample.max()),
        "async/token_staleness/mean": float(tok.mean()) if tok.size else 0.0,
    }
