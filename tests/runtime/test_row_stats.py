"""The statistics exchange of process-local rows (`runtime/row_stats.py`, `rl/metrics.data_metric_moments`):
per-process moments combined equal numpy on the concatenated rows, for uneven, empty and masked parts. The
all-gather itself is `distributed.gather_rows` (one process here: the identity; 2 processes: tests/e2e/
test_multihost.py)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from jaxrl_post.rl import metrics as metrics_lib
from jaxrl_post.runtime import row_stats


def _parts(rng, sizes):
    return [rng.normal(size=n).astype(np.float32) * 3 + 1 for n in sizes]


@pytest.mark.parametrize("sizes", [(5, 7), (1, 0, 9), (4, 4, 4, 4)])
def test_combined_moments_equal_numpy_over_all_rows(sizes):
    rng = np.random.default_rng(0)
    parts = _parts(rng, sizes)
    m = row_stats.combine([row_stats.moments(p) for p in parts])
    allv = np.concatenate(parts).astype(np.float64)
    assert m[0] == allv.size
    np.testing.assert_allclose(row_stats.mean(m), np.mean(allv), rtol=1e-12)
    np.testing.assert_allclose(row_stats.var(m), np.var(allv), rtol=1e-9)
    assert (m[3], m[4]) == (allv.max(), allv.min())
    assert row_stats.stats_of(m)[1:] == (allv.max(), allv.min())


def test_empty_parts_change_nothing_and_no_values_give_zeros():
    empty = row_stats.moments(np.zeros((0,)))
    assert list(empty[:3]) == [0, 0, 0] and empty[3] == -np.inf and empty[4] == np.inf
    x = row_stats.moments(np.asarray([2.0, 4.0]))
    np.testing.assert_array_equal(row_stats.combine([empty, x, empty]), x)
    assert row_stats.stats_of(row_stats.combine([empty, empty])) == (0.0, 0.0, 0.0)
    assert row_stats.mean(empty) == 0.0 and row_stats.var(empty) == 0.0


def test_combine_keeps_leading_names_axis_and_checks_the_moment_dim():
    a = np.stack([row_stats.moments([1.0, 2.0]), row_stats.moments([5.0])])  # [K=2, 5]
    b = np.stack([row_stats.moments([3.0]), row_stats.moments([-1.0, 0.0])])
    m = row_stats.combine([a, b])
    assert m.shape == (2, 5)
    np.testing.assert_allclose([row_stats.mean(m[0]), row_stats.mean(m[1])], [2.0, 4.0 / 3.0])
    with pytest.raises(ValueError, match="dim of 5"):
        row_stats.combine(np.zeros((2, 3, 4)))


def test_single_process_exchange_is_the_identity():
    local = {"b": row_stats.moments([1.0, 2.0]), "a": row_stats.moments([])}
    got = row_stats.allreduce_moments(local)
    assert sorted(got) == ["a", "b"]
    for k in local:
        np.testing.assert_array_equal(got[k], local[k])
    assert row_stats.allreduce_sums({"n": 3.0, "m": 0.5}) == {"n": 3.0, "m": 0.5}


def _batch(rng, rows, p=6, r=5):
    resp = rng.integers(0, 2, (rows, r)).astype(np.int32)
    resp[:, 0] = 1
    attn = np.concatenate([rng.integers(0, 2, (rows, p)), resp], axis=1).astype(np.int32)
    f = lambda: rng.normal(size=(rows, r)).astype(np.float32)
    return dict(
        token_level_scores=f(),
        token_level_rewards=f(),
        advantages=f(),
        returns=f(),
        values=f(),
        loss_mask=resp,
        response_attention_mask=resp,
        attention_mask=attn,
    )


@pytest.mark.parametrize("use_critic", [False, True])
def test_data_metrics_from_per_process_moments_equal_the_gathered_batch(use_critic):
    """`data_metric_moments` of each process's rows, combined, give `compute_data_metrics` of all rows."""
    rng = np.random.default_rng(1)
    parts = [_batch(rng, 3), _batch(rng, 5)]
    kw = dict(use_critic=use_critic, max_prompt_length=4, max_response_length=4)
    whole = {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}
    want = metrics_lib.compute_data_metrics(whole, **kw)
    moms = [metrics_lib.data_metric_moments(p, **kw) for p in parts]
    total = {k: row_stats.combine([m[k] for m in moms]) for k in moms[0]}
    got = metrics_lib.data_metrics_from_moments(total, use_critic)
    assert sorted(got) == sorted(want)
    for k in want:
        np.testing.assert_allclose(got[k], want[k], rtol=1e-9, atol=1e-12, err_msg=k)


@dataclasses.dataclass
class _Reward:
    token_level_scores: np.ndarray
    scores: np.ndarray
    metrics: dict
    extra_infos: dict
    errors: list
    function_scores: object = None


def test_reduce_reward_on_one_process_is_the_identity():
    res = _Reward(np.zeros((2, 3)), np.zeros(2), {"reward/num_errors": 0.0}, {"acc": np.asarray([1.0, np.nan])}, [])
    assert row_stats.reduce_reward(res) is res
