"""`scripts/bench_grouped_matmul.py` (issue 58): the device benchmark's CPU-runnable parts. Its routing draws k
distinct experts per token; its dense per-expert baseline computes the same expert MLP as ragged_dot (float32);
`--tiny` runs every implementation (megablox in interpret mode) and reports each one's difference from ragged_dot."""

import jax.numpy as jnp
import numpy as np
import pytest

from tests.script_loader import load_script


def test_routing_draws_distinct_experts_and_skews_popularity():
    bg = load_script("bench_grouped_matmul")
    uniform, skewed = bg.routing(400, 16, 4, "uniform"), bg.routing(400, 16, 4, "skewed")
    for r in (uniform, skewed):
        assert r.shape == (400, 4) and r.dtype == np.int32 and all(len(set(row)) == 4 for row in r.tolist())
    assert np.bincount(skewed.ravel(), minlength=16)[0] > 2 * np.bincount(uniform.ravel(), minlength=16).max()


def test_dense_per_expert_baseline_equals_ragged_dot_and_numpy():
    bg = load_script("bench_grouped_matmul")
    rng = np.random.default_rng(0)
    counts = np.array([3, 0, 5, 1], np.int32)  # an empty expert; 9 rows sorted by expert
    xs = rng.standard_normal((9, 6)).astype(np.float32)
    gate, up = rng.standard_normal((2, 4, 6, 5)).astype(np.float32)
    down = rng.standard_normal((4, 5, 6)).astype(np.float32)
    sizes = jnp.asarray(counts)
    dense = np.asarray(bg.expert_mlp("dense_per_expert", sizes, 5, False)(xs, gate, up, down))
    ragged = np.asarray(bg.expert_mlp("ragged_dot", sizes, 5, False)(xs, gate, up, down))
    expert = np.repeat(np.arange(4), counts)
    silu = lambda h: h / (1 + np.exp(-h))
    want = np.stack([(silu(x @ gate[e]) * (x @ up[e])) @ down[e] for x, e in zip(xs.astype(np.float64), expert)])
    np.testing.assert_allclose(dense, want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(ragged, want, rtol=1e-5, atol=1e-5)


@pytest.mark.slow  # three implementations' forward + backward compiles, megablox interpreted (~20 CPU seconds)
def test_tiny_mode_runs_every_implementation():
    bg = load_script("bench_grouped_matmul")
    rows = bg.main(["--tiny"])
    assert [r["impl"] for r in rows] == list(bg.IMPLS) * 2  # uniform, then skewed routing
    for r in rows:
        assert r["rel_diff_vs_ragged_dot"] < 2e-2  # bf16 roundings only
        assert r["fwd_ms"] > 0 and r["fwd_bwd_mfu"] > 0
