"""The statistics a multi-process step exchanges instead of its rows (`trainer.distributed.process_local_rows`).

Each process holds only its rows of the step's batch (docs/multihost.md). A statistic over the whole batch is then
combined from per-process *moments* of the values it averages: `[count, sum, sum of squares, max, min]` (float64),
one small vector per statistic, exchanged in one all-gather of `[processes, K, 5]` (`allreduce_moments`) and
combined in process order (`combine`), so every process gets the same numbers. The mean is `sum / count`, the
(population) variance `sumsq / count - mean^2`; max and min are exact. An empty part has count 0, sum 0,
max -inf and min +inf, so it changes nothing.

Source: the reduction verl's metric utilities apply to one worker's gathered batch (`compute_data_metrics`),
split into per-process partial sums the way `torch.distributed.all_reduce` users compute a global mean.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from jaxrl_post.runtime import distributed

MOMENTS = ("count", "sum", "sumsq", "max", "min")


def moments(x) -> np.ndarray:
    """`[count, sum, sumsq, max, min] float64` of the values of `x` (any shape; empty: `[0, 0, 0, -inf, inf]`)."""
    v = np.asarray(x, np.float64).reshape(-1)
    if v.size == 0:
        return np.asarray([0.0, 0.0, 0.0, -np.inf, np.inf])
    return np.asarray([float(v.size), v.sum(), (v * v).sum(), v.max(), v.min()])


def combine(parts) -> np.ndarray:
    """Per-process moments `[P, ..., 5]` -> the moments of all the values `[..., 5]` (counts and sums added in
    process order, max of the maxima, min of the minima). Raises ValueError when the last dim is not 5."""
    p = np.asarray(parts, np.float64)
    if p.shape[-1] != len(MOMENTS):
        raise ValueError(f"moments must end in a dim of {len(MOMENTS)} {MOMENTS}, got shape {p.shape}")
    total = np.zeros(p.shape[1:], np.float64)
    for part in p:  # in process order: the same float64 additions on every process
        total[..., :3] += part[..., :3]
    total[..., 3] = p[..., 3].max(axis=0)
    total[..., 4] = p[..., 4].min(axis=0)
    return total


def mean(m: np.ndarray) -> float:
    """The mean of the values of moments `m` (0.0 for no values, as verl's metrics of an empty selection)."""
    return float(m[1] / m[0]) if m[0] > 0 else 0.0


def var(m: np.ndarray) -> float:
    """The population variance (numpy's `var`, ddof 0) of the values of moments `m` (0.0 for no values)."""
    if m[0] <= 0:
        return 0.0
    mu = m[1] / m[0]
    return float(max(m[2] / m[0] - mu * mu, 0.0))


def stats_of(m: np.ndarray) -> tuple[float, float, float]:
    """`(mean, max, min)` of moments `m`; no values: `(0, 0, 0)` (what `metrics._stats` reports for an empty array)."""
    if m[0] <= 0:
        return 0.0, 0.0, 0.0
    return mean(m), float(m[3]), float(m[4])


def allreduce_moments(local: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """This process's moments per name -> the moments over every process's values (every process must call it
    with the same names). One `process_allgather` of a `[K, 5] float64` array (its bytes counted by
    `distributed.received_bytes`); one process: `local` as is."""
    names = sorted(local)
    stacked = np.stack([np.asarray(local[k], np.float64) for k in names]) if names else np.zeros((0, 5))
    parts = distributed.gather_rows(stacked[None])  # [P, K, 5]
    total = combine(parts)
    return {k: total[i] for i, k in enumerate(names)}


def allreduce_sums(local: Mapping[str, float]) -> dict[str, float]:
    """Sums over processes of this process's numbers (e.g. dropped responses, token counts); same call rules."""
    got = allreduce_moments({k: moments(np.asarray([v], np.float64)) for k, v in local.items()})
    return {k: float(m[1]) for k, m in got.items()}


def reduce_reward(res):
    """A `RewardOutput` of this process's rows -> the same rows with the metrics of all rows (process-local rows,
    `trainer.distributed.process_local_rows`): error counts summed, `reward/extra/<k>/mean` from every process's
    non-NaN float values (their moments, `row_stats`), error messages of all processes (the first 8). Only these
    small per-process values are exchanged (`gather_objects`), never the rows. One process: `res` as is."""
    import dataclasses

    import jax

    if jax.process_count() == 1:
        return res
    extra = {}
    for k, v in res.extra_infos.items():
        v = np.asarray(v)
        extra[k] = moments(v[~np.isnan(v)]) if v.dtype.kind == "f" else None
    counts = {k: float(res.metrics.get(k, 0.0)) for k in ("reward/num_errors", "reward/num_timeouts")}
    parts = distributed.gather_objects({"extra": extra, "errors": res.errors, "metrics": counts})
    metrics = {k: float(sum(p["metrics"][k] for p in parts)) for k in counts}
    for k in sorted({k for p in parts for k in p["extra"]}):
        got = [p["extra"][k] for p in parts if k in p["extra"]]
        if all(m is not None for m in got):
            m = combine(got)
            if m[0] > 0:
                metrics[f"reward/extra/{k}/mean"] = mean(m)
    return dataclasses.replace(res, metrics=metrics, errors=[e for p in parts for e in p["errors"]][:8])
