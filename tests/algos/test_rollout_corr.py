"""Tests for jaxrl_post.algos.rollout_corr (verl's rollout correction): a loop-by-row float64 numpy reference written
from verl's formulas, hand-computed 2x3 cases, identical policies, jit, padding, errors, and the config keys."""

from __future__ import annotations

import math
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_post.algos import core_algos
from jaxrl_post.algos import rollout_corr as rc
from jaxrl_post.rl import ppo_update

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

from configs import base
from jaxrl_post.errors import ConfigError
from jaxrl_post.rl.config_check import validate_config

S = 20.0
RS_CASES = [  # (rollout_rs, rollout_rs_threshold): thresholds chosen to bind on the random data below
    ("token_k1", "0.6_1.5"),
    ("token_k1", 1.8),
    ("token_k2", 0.05),
    ("token_k3", "0.05"),
    ("seq_sum_k1", "0.3_3.0"),
    ("seq_sum_k2", 0.5),
    ("seq_sum_k3", 0.5),
    ("seq_mean_k1", "0.9_1.2"),
    ("seq_mean_k2", 0.05),
    ("seq_mean_k3", 0.05),
    ("seq_max_k2", 0.1),
    ("seq_max_k3", 0.1),
    ("token_k1,seq_max_k3, token_k1", "0.5_2.0,0.1"),  # duplicates dropped first (verl)
    ("seq_mean_k1,token_k2", "1.25,0.05"),
]


# ------------------------------------------------------------------ numpy reference (float64, one row at a time)


def _std1(x):  # torch.std (unbiased); verl uses 0 for a single value
    return float(np.std(x, ddof=1)) if len(x) > 1 else 0.0


def _clamped_std(x, lo, hi):
    c = np.clip(x, lo, hi)
    return math.sqrt(max(np.mean(c**2) - np.mean(c) ** 2, 0.0)) if len(x) > 1 else 0.0


def ref_weights(lr, mask, level, thr, normalize=False):
    b, r = lr.shape
    v = mask != 0
    lo = 1.0 / thr
    w = np.zeros((b, r))
    seq_logs = np.array([lr[i][v[i]].sum() for i in range(b)])
    for i in range(b):
        for t in range(r):
            if v[i, t]:
                w[i, t] = math.exp(min(max(lr[i, t] if level == "token" else seq_logs[i], -S), S))
    tok = w[v]
    m = {"rollout_is_mean": tok.mean()}
    if level == "token":
        m |= {"rollout_is_max": tok.max(), "rollout_is_min": tok.min()}
        m |= {"rollout_is_ratio_fraction_high": np.mean(tok > thr), "rollout_is_ratio_fraction_low": np.mean(tok < lo)}
    else:
        m |= {"rollout_is_max": math.exp(min(seq_logs.max(), S)), "rollout_is_min": math.exp(seq_logs.min())}
        m["rollout_is_ratio_fraction_high"] = np.mean(seq_logs > math.log(thr))
        m["rollout_is_ratio_fraction_low"] = np.mean(seq_logs < math.log(lo))
    m["rollout_is_std"] = _clamped_std(tok, lo, thr)
    c = np.clip(tok, lo, thr)
    m["rollout_is_eff_sample_size"] = 1.0 / np.mean((c / (c.mean() + 1e-8)) ** 2)
    seq = np.array([w[i][v[i]].mean() for i in range(b)])
    m |= {"rollout_is_seq_mean": seq.mean(), "rollout_is_seq_std": _std1(seq)}
    m |= {"rollout_is_seq_max": seq.max(), "rollout_is_seq_min": seq.min()}
    m["rollout_is_seq_max_deviation"] = np.abs(seq - 1.0).max()
    m["rollout_is_seq_fraction_high"] = np.mean(seq > thr)
    m["rollout_is_seq_fraction_low"] = np.mean(seq < lo)
    w = np.minimum(w, thr)
    if normalize:
        mean = w[v].mean() if level == "token" else np.mean([w[i][v[i]].mean() for i in range(b)])
        w = w / mean
        m["rollout_is_batch_norm_factor"] = mean
    return w, m


def _ref_thresholds(opts, spec):
    specs = [str(spec)] if not isinstance(spec, str) else [s.strip() for s in spec.split(",")]
    specs = specs * len(opts) if len(specs) == 1 else specs
    out = []
    for o, s in zip(opts, specs):
        if o.endswith("k1"):
            lo, hi = (float(x) for x in s.split("_")) if "_" in s else (1.0 / float(s), float(s))
            out.append((math.log(lo), math.log(hi), True))
        else:
            out.append((0.0, float(s), False))
    return out


def ref_rejection(lr, mask, rollout_rs, spec):
    b, r = lr.shape
    v = mask != 0
    opts = list(dict.fromkeys(o.strip() for o in rollout_rs.split(",")))
    l = np.clip(lr, -S, S)
    kk = {"k1": -l, "k2": 0.5 * l**2, "k3": np.exp(l) - 1.0 - l}
    keep_all = np.ones((b, r), bool)
    m = {}
    for o, (lo, hi, k1) in zip(opts, _ref_thresholds(opts, spec)):
        k, p = kk[o[-2:]], f"rollout_rs_{o}"
        if o.startswith("token"):
            stat = k
            seq = np.array([k[i][v[i]].mean() for i in range(b)])
        else:
            agg = {"sum": np.sum, "mean": np.mean, "max": np.max}[o.split("_")[1]]
            seq = np.array([agg(k[i][v[i]]) for i in range(b)])
            stat = np.repeat(seq[:, None], r, axis=1)
        keep = (stat >= lo) & (stat <= hi) if k1 else stat <= hi
        keep_all &= keep
        tok = stat[v]
        src = tok if o.startswith("token") else seq
        m[f"{p}_mean"] = tok.mean()
        m[f"{p}_max"], m[f"{p}_min"] = src.max(), src.min()
        m[f"{p}_fraction_high"] = np.mean(src > hi)
        m[f"{p}_fraction_low"] = np.mean(src < lo) if k1 else 0.0
        m[f"{p}_std"] = _clamped_std(tok, lo, hi)
        m |= {f"{p}_seq_mean": seq.mean(), f"{p}_seq_std": _std1(seq), f"{p}_seq_max": seq.max()}
        m |= {f"{p}_seq_min": seq.min(), f"{p}_seq_max_deviation": np.abs(seq).max()}
        m[f"{p}_seq_fraction_high"] = np.mean(seq > hi)
        if k1:
            m[f"{p}_seq_fraction_low"] = np.mean(seq < lo)
        m[f"{p}_masked_fraction"] = np.mean(~keep[v])
        m[f"{p}_seq_masked_fraction"] = np.mean([np.any(~keep[i][v[i]]) for i in range(b)])
    m["rollout_rs_masked_fraction"] = np.mean(~keep_all[v])
    m["rollout_rs_seq_masked_fraction"] = np.mean([np.any(~keep_all[i][v[i]]) for i in range(b)])
    return mask * keep_all, m


def ref_offpolicy(old, roll, mask):
    v = mask != 0
    rows = range(old.shape[0])
    lp_t = np.array([old[i][v[i]].mean() for i in rows])
    lp_r = np.array([roll[i][v[i]].mean() for i in rows])
    lr = (old - roll)[v]
    d = lp_r - lp_t
    seq_sum = np.array([(old[i] - roll[i])[v[i]].sum() for i in rows])
    m = {"training_ppl": np.exp(-lp_t).mean(), "training_log_ppl": (-lp_t).mean()}
    m |= {"rollout_ppl": np.exp(-lp_r).mean(), "rollout_log_ppl": (-lp_r).mean()}
    m |= {"kl": np.mean(-lr), "k3_kl": np.mean(np.exp(lr) - lr - 1.0)}
    m |= {"log_ppl_diff": d.mean(), "log_ppl_abs_diff": np.abs(d).mean(), "log_ppl_diff_max": d.max()}
    m |= {"log_ppl_diff_min": d.min(), "ppl_ratio": np.exp(d).mean()}
    m["chi2_token"] = np.mean(np.exp(np.clip(lr, -S, S)) ** 2) - 1.0
    m["chi2_seq"] = np.mean(np.exp(2.0 * np.clip(seq_sum, -S, S))) - 1.0
    return m


def ref_probs_diff(old, roll, mask):
    v = mask != 0
    pt, pr = np.exp(old[v]), np.exp(roll[v])
    d = np.abs(pt - pr)
    return {
        "training/rollout_probs_diff_valid": 1.0,
        "training/rollout_probs_diff_max": d.max(),
        "training/rollout_probs_diff_mean": d.mean(),
        "training/rollout_probs_diff_std": np.std(d, ddof=1),
        "training/rollout_actor_probs_pearson_corr": np.corrcoef(pt, pr)[0, 1],
    }


# ------------------------------------------------------------------ helpers


def random_batch(seed, b=6, r=7, scale=0.5):
    rng = np.random.default_rng(seed)
    lens = rng.integers(1, r + 1, size=b)
    lens[0] = r
    mask = (np.arange(r)[None, :] < lens[:, None]).astype(np.int32)
    roll = np.log(rng.uniform(0.05, 1.0, size=(b, r))).astype(np.float32)
    old = (roll + scale * rng.standard_normal((b, r))).astype(np.float32)
    old[mask == 0], roll[mask == 0] = np.nan, -np.inf  # padding garbage must never leak
    return old, roll, mask


def f64(x):
    return np.asarray(x, np.float64)


def assert_metrics(got, want, rtol=2e-5, atol=2e-6):
    assert set(got) == set(want), (sorted(set(got) - set(want)), sorted(set(want) - set(got)))
    for k in want:
        np.testing.assert_allclose(f64(got[k]), want[k], rtol=rtol, atol=atol, err_msg=k)


# Eager on purpose: op compilations are shared across calls of one shape, while jit would compile every static
# configuration (seconds each). test_jit_and_weights_are_constants covers jit.
entry = rc.compute_rollout_correction_and_rejection_mask


def entry_ref(old, roll, mask, rollout_is=None, thr=2.0, normalize=False, rollout_rs=None, rs_thr=None):
    o64, r64 = f64(old), f64(roll)
    lr = np.where(mask != 0, o64 - r64, 0.0)
    w, metrics = None, {}
    if rollout_is is not None:
        w, mi = ref_weights(lr, mask, rollout_is, thr, normalize)
        metrics |= mi
    new_mask = mask
    if rollout_rs is not None:
        new_mask, mr = ref_rejection(lr, mask, rollout_rs, rs_thr)
        metrics |= mr
    metrics |= ref_offpolicy(np.where(mask != 0, o64, 0), np.where(mask != 0, r64, 0), mask)
    out = {f"rollout_corr/{k}": v for k, v in metrics.items()}
    return w, new_mask, out | ref_probs_diff(o64, r64, mask)


# ------------------------------------------------------------------ numpy reference comparisons


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("normalize", [False, True])
@pytest.mark.parametrize("seed", [0, 1])
def test_weights_match_reference(level, normalize, seed):
    old, roll, mask = random_batch(seed)
    w, new_mask, m = entry(
        old, roll, mask, rollout_is=level, rollout_is_threshold=1.5, rollout_is_batch_normalize=normalize
    )
    rw, _, rm = entry_ref(old, roll, mask, level, 1.5, normalize)
    assert w.dtype == jnp.float32 and w.shape == mask.shape
    np.testing.assert_allclose(f64(w), rw, rtol=2e-5, atol=1e-6)
    np.testing.assert_array_equal(np.asarray(new_mask), mask)
    assert_metrics(m, rm)
    raw = np.exp(np.clip(f64(old) - f64(roll), -S, S))[mask != 0]
    if level == "token":
        assert (raw > 1.5).any() and (raw < 1.5).any()  # truncation binds somewhere, not everywhere


@pytest.mark.parametrize("rollout_rs,rs_thr", RS_CASES)
def test_rejection_matches_reference(rollout_rs, rs_thr):
    old, roll, mask = random_batch(3, scale=0.4)
    w, new_mask, m = entry(old, roll, mask, rollout_rs=rollout_rs, rollout_rs_threshold=rs_thr)
    assert w is None
    _, rmask, rm = entry_ref(old, roll, mask, rollout_rs=rollout_rs, rs_thr=rs_thr)
    assert new_mask.dtype == mask.dtype
    np.testing.assert_array_equal(np.asarray(new_mask), rmask)
    assert 0 < np.asarray(new_mask).sum() < mask.sum(), "threshold should reject some tokens and keep others"
    assert_metrics(m, rm)


def test_weights_and_rejection_together_match_reference():
    old, roll, mask = random_batch(5)
    args = dict(
        rollout_is="sequence",
        rollout_is_threshold=3.0,
        rollout_rs="seq_sum_k1,token_k3",
        rollout_rs_threshold="0.2_5,0.2",
    )
    w, new_mask, m = entry(old, roll, mask, **args)
    rw, rmask, rm = entry_ref(old, roll, mask, "sequence", 3.0, False, args["rollout_rs"], args["rollout_rs_threshold"])
    np.testing.assert_allclose(f64(w), rw, rtol=2e-5, atol=1e-6)
    np.testing.assert_array_equal(np.asarray(new_mask), rmask)
    assert_metrics(m, rm)


# ------------------------------------------------------------------ hand-computed 2x3 cases

P_OLD = np.array([[0.5, 0.25, 0.1], [0.2, 0.4, 0.3]])
P_ROLL = np.array([[0.25, 0.5, 0.1], [0.2, 0.1, 0.9]])  # ratios pi_old/pi_rollout: [2, 1/2, 1], [1, 4, pad]
MASK = np.array([[1, 1, 1], [1, 1, 0]], np.int32)
OLD, ROLL = np.log(P_OLD).astype(np.float32), np.log(P_ROLL).astype(np.float32)


def hand(**kwargs):
    """The 2x3 case, run inside a 6x7 batch of padding (which is ignored: see the padding test) so that eager
    mode reuses the random tests' compilations. Returns the 2x3 weights/mask and the metrics."""
    big = lambda x: np.pad(x, ((0, 4), (0, 4)))
    w, mask, m = entry(big(OLD), big(ROLL), big(MASK), **kwargs)
    assert not np.asarray(mask)[2:].any() and not np.asarray(mask)[:, 3:].any()
    return (None if w is None else np.asarray(w)[:2, :3]), np.asarray(mask)[:2, :3], m


def test_hand_token_is():
    w, _, m = hand(rollout_is="token")
    np.testing.assert_allclose(w, [[2.0, 0.5, 1.0], [1.0, 2.0, 0.0]], rtol=1e-6)
    # before truncation: 2, .5, 1, 1, 4
    expect = {"rollout_is_mean": 8.5 / 5, "rollout_is_max": 4.0, "rollout_is_min": 0.5}
    expect |= {"rollout_is_ratio_fraction_high": 0.2, "rollout_is_ratio_fraction_low": 0.0}
    expect |= {"rollout_is_seq_mean": (3.5 / 3 + 2.5) / 2, "rollout_is_seq_max_deviation": 1.5}
    for k, v in expect.items():
        np.testing.assert_allclose(m[f"rollout_corr/{k}"], v, rtol=1e-6, err_msg=k)
    # clamped to [1/2, 2]: 2, .5, 1, 1, 2 -> mean 1.3, E[c^2] = 10.25 / 5
    np.testing.assert_allclose(m["rollout_corr/rollout_is_std"], math.sqrt(10.25 / 5 - 1.3**2), rtol=1e-5)
    np.testing.assert_allclose(m["rollout_corr/rollout_is_eff_sample_size"], 1.3**2 / (10.25 / 5), rtol=1e-5)
    wn, _, mn = hand(rollout_is="token", rollout_is_batch_normalize=True)
    np.testing.assert_allclose(wn, w / 1.3, rtol=1e-6)
    np.testing.assert_allclose(mn["rollout_corr/rollout_is_batch_norm_factor"], 1.3, rtol=1e-6)


def test_hand_sequence_is():
    w, _, m = hand(rollout_is="sequence")
    # row products: 2 * 1/2 * 1 = 1, 1 * 4 = 4 (truncated to 2)
    np.testing.assert_allclose(w, [[1.0, 1.0, 1.0], [2.0, 2.0, 0.0]], rtol=1e-6)
    expect = {"rollout_is_mean": 11 / 5, "rollout_is_max": 4.0, "rollout_is_min": 1.0}
    expect |= {"rollout_is_ratio_fraction_high": 0.5, "rollout_is_ratio_fraction_low": 0.0}
    expect |= {"rollout_is_seq_mean": 2.5, "rollout_is_seq_fraction_high": 0.5, "rollout_is_seq_min": 1.0}
    for k, v in expect.items():
        np.testing.assert_allclose(m[f"rollout_corr/{k}"], v, rtol=1e-6, err_msg=k)


@pytest.mark.parametrize(
    "rollout_rs,thr,kept",
    [
        ("token_k1", 3.0, [[1, 1, 1], [1, 0, 0]]),  # keeps 1/3 <= ratio <= 3: the 4 goes
        ("token_k1", "0.2_1.5", [[1, 0, 1], [1, 1, 0]]),  # verl's k1 = -log r in [log .2, log 1.5]: 1/r in [.2, 1.5]
        ("token_k2", 0.5, [[1, 1, 1], [1, 0, 0]]),  # (log 2)^2/2 = .24 kept, (log 4)^2/2 = .96 rejected
        ("seq_sum_k1", 3.0, [[1, 1, 1], [0, 0, 0]]),  # row sums of log r: 0 (kept), log 4 (rejected)
        ("seq_mean_k1", 3.0, [[1, 1, 1], [1, 1, 0]]),  # row means: 0, log 4 / 2 = log 2 (kept)
        ("seq_max_k3", 1.0, [[1, 1, 1], [0, 0, 0]]),  # k3 max: .307 vs 4 - 1 - log 4 = 1.61
        ("seq_max_k3,token_k1", "1.0,0.2_1.5", [[1, 0, 1], [0, 0, 0]]),  # all options must pass
    ],
)
def test_hand_rejection(rollout_rs, thr, kept):
    _, new_mask, m = hand(rollout_rs=rollout_rs, rollout_rs_threshold=thr)
    np.testing.assert_array_equal(new_mask, kept)
    rejected_tokens = 5 - np.sum(kept)
    rejected_rows = sum(np.sum(k) < n for k, n in zip(kept, (3, 2)))
    np.testing.assert_allclose(m["rollout_corr/rollout_rs_masked_fraction"], rejected_tokens / 5, rtol=1e-6)
    np.testing.assert_allclose(m["rollout_corr/rollout_rs_seq_masked_fraction"], rejected_rows / 2, rtol=1e-6)


def test_hand_offpolicy_and_probs_diff():
    _, _, m = hand()
    assert not any("rollout_is" in k or "rollout_rs" in k for k in m)  # metrics-only mode
    log_r = np.log([2, 0.5, 1, 1, 4])
    r = np.exp(log_r)
    expect = {
        "rollout_corr/kl": -np.log(4) / 5,
        "rollout_corr/k3_kl": np.mean(r - log_r - 1),
        "rollout_corr/chi2_token": np.mean(r**2) - 1,
        "rollout_corr/chi2_seq": (1 + 16) / 2 - 1,
        "rollout_corr/log_ppl_diff": (0 - np.log(4) / 2) / 2,  # per row mean(log p_rollout - log p_old)
        "rollout_corr/ppl_ratio": (1 + 0.5) / 2,
        "rollout_corr/training_ppl": (np.exp(-np.log([0.5, 0.25, 0.1]).mean()) + np.exp(-np.log([0.2, 0.4]).mean()))
        / 2,
        "training/rollout_probs_diff_mean": (0.25 + 0.25 + 0 + 0 + 0.3) / 5,
        "training/rollout_probs_diff_max": 0.3,
    }
    for k, v in expect.items():
        np.testing.assert_allclose(m[k], v, rtol=1e-5, atol=1e-7, err_msg=k)


def test_identical_policies_weights_one_nothing_rejected_kl_zero():
    old, _, mask = random_batch(7)
    roll = old.copy()
    for level in ("token", "sequence"):
        w, _, m = rc.compute_rollout_correction_and_rejection_mask(old, roll, mask, rollout_is=level)
        np.testing.assert_array_equal(np.asarray(w), mask.astype(np.float32))  # exactly 1 on valid tokens
        assert float(m["rollout_corr/rollout_is_eff_sample_size"]) == pytest.approx(1.0)
    for rs, thr in RS_CASES:
        _, new_mask, m = rc.compute_rollout_correction_and_rejection_mask(
            old, roll, mask, rollout_rs=rs, rollout_rs_threshold=thr
        )
        np.testing.assert_array_equal(np.asarray(new_mask), mask)
        assert float(m["rollout_corr/rollout_rs_masked_fraction"]) == 0.0
    for k in ("kl", "k3_kl", "chi2_token", "chi2_seq", "log_ppl_diff", "log_ppl_abs_diff"):
        assert float(m[f"rollout_corr/{k}"]) == 0.0, k
    assert float(m["rollout_corr/ppl_ratio"]) == 1.0
    assert float(m["training/rollout_probs_diff_max"]) == 0.0
    assert float(m["training/rollout_actor_probs_pearson_corr"]) == pytest.approx(1.0)


# ------------------------------------------------------------------ padding, jit, gradients, errors


def test_empty_rows_and_padding_garbage_change_nothing():
    """Rows without valid tokens (batch padding) are ignored by every statistic (verl would count them)."""
    old, roll, mask = random_batch(11)  # the shape of the other random tests: no new eager compilations
    old[-2:], roll[-2:], mask[-2:] = np.inf, np.nan, 0
    rs, rs_thr = "seq_mean_k3,token_k1", "0.05,0.5_2"
    w, new_mask, m = entry(old, roll, mask, rollout_is="token", rollout_rs=rs, rollout_rs_threshold=rs_thr)
    rw, rmask, rm = entry_ref(old[:-2], roll[:-2], mask[:-2], "token", 2.0, False, rs, rs_thr)
    np.testing.assert_allclose(f64(w)[:-2], rw, rtol=2e-5, atol=1e-6)
    np.testing.assert_array_equal(np.asarray(w)[-2:], 0)
    np.testing.assert_array_equal(np.asarray(new_mask), np.concatenate([rmask, mask[-2:]]))
    assert_metrics(m, rm)


def test_jit_and_weights_are_constants():
    old, roll, mask = random_batch(2)
    args = dict(rollout_is="sequence", rollout_rs="token_k2", rollout_rs_threshold=0.1)
    # The whole entry point traces under jit (traced threshold); tracing alone keeps this test cheap.
    fn = lambda o, r, m, t: entry(o, r, m, rollout_is_threshold=t, **args)
    jaxpr = jax.make_jaxpr(fn)(old, roll, mask, jnp.float32(2.0))
    assert len(jaxpr.out_avals) == 2 + len(entry(old, roll, mask, **args)[2])
    lr = np.where(mask != 0, old - roll, 0.0)
    weights_jit = jax.jit(rc.compute_rollout_correction_weights, static_argnames=("rollout_is",))
    wj, mj = weights_jit(lr, mask, rollout_is="token", rollout_is_threshold=jnp.float32(1.5))
    we, me = rc.compute_rollout_correction_weights(lr, mask, "token", 1.5)
    np.testing.assert_allclose(wj, we, rtol=1e-6)
    assert_metrics(mj, {k: f64(v) for k, v in me.items()}, rtol=1e-5, atol=1e-7)
    g = jax.grad(lambda l: jnp.sum(rc.compute_rollout_correction_weights(l, mask, "token", 5.0)[0]))(lr)
    assert not np.any(np.asarray(g))


def test_parse_rollout_rs():
    assert rc.parse_rollout_rs("token_k1", 2.0) == [("token_k1", 0.5, 2.0)]
    assert rc.parse_rollout_rs("seq_sum_k1, seq_max_k2,seq_sum_k1", "0.5_3,0.1") == [
        ("seq_sum_k1", 0.5, 3.0),
        ("seq_max_k2", None, 0.1),
    ]
    assert rc.parse_rollout_rs("token_k3,seq_mean_k1", "4") == [("token_k3", None, 4.0), ("seq_mean_k1", 0.25, 4.0)]


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(rollout_is="geometric"), "Invalid rollout_is"),
        (dict(rollout_is="token", rollout_is_threshold=0.0), "rollout_is_threshold must be > 0"),
        (dict(rollout_is="token", rollout_is_threshold=-1.0), "rollout_is_threshold must be > 0"),
        (dict(rollout_rs="token_k4", rollout_rs_threshold=2.0), "unknown rollout_rs"),
        (dict(rollout_rs="seq_max_k1", rollout_rs_threshold=2.0), "unknown rollout_rs"),
        (dict(rollout_rs=" , ", rollout_rs_threshold=2.0), "unknown rollout_rs"),
        (dict(rollout_rs="token_k1"), "rollout_rs_threshold is required"),
        (dict(rollout_rs="token_k1", rollout_rs_threshold="2_0.5"), "lower 2.0 > upper 0.5"),
        (dict(rollout_rs="token_k1", rollout_rs_threshold="0_2"), "must be finite and > 0"),
        (dict(rollout_rs="token_k2", rollout_rs_threshold=-0.1), "must be finite and > 0"),
        (dict(rollout_rs="token_k2", rollout_rs_threshold="0.1_0.2"), "one upper bound"),
        (dict(rollout_rs="token_k2", rollout_rs_threshold="abc"), "not a number"),
        (dict(rollout_rs="token_k2,token_k3,token_k1", rollout_rs_threshold="1,2"), "needs 1 or 3 entries"),
    ],
)
def test_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        rc.compute_rollout_correction_and_rejection_mask(OLD, ROLL, MASK, **kwargs)


def test_shape_and_empty_mask_errors():
    with pytest.raises(ValueError, match="does not match"):
        rc.compute_rollout_correction_and_rejection_mask(OLD, ROLL[:, :2], MASK)
    with pytest.raises(ValueError, match="at least one valid token"):
        rc.compute_rollout_correction_and_rejection_mask(OLD, ROLL, np.zeros_like(MASK))


# ------------------------------------------------------------------ config keys and validation

RC_KEYS = ("rollout_is", "rollout_is_threshold", "rollout_is_batch_normalize", "rollout_rs", "rollout_rs_threshold")


def test_config_defaults_are_verl_keys_and_off():
    c = base.get_base_config().algorithm.rollout_correction
    assert (c.rollout_is, c.rollout_is_threshold, c.rollout_is_batch_normalize) == (None, 2.0, False)
    assert (c.rollout_rs, c.rollout_rs_threshold) == (None, None)
    for k in RC_KEYS:
        key = f"algorithm.rollout_correction.{k}"
        assert key in base.VERL_KEYS and base.verl_key(key) == key


def _cfg(**rc_values):
    c = base.get_base_config()
    for k, v in rc_values.items():
        c.algorithm.rollout_correction[k] = v
    return c


@pytest.mark.parametrize(
    "values,key,match",
    [
        (dict(rollout_is="geometric"), "rollout_is", "None, 'token' or 'sequence'"),
        (dict(rollout_is_threshold=0.0), "rollout_is_threshold", "must be > 0"),
        (dict(rollout_is_threshold=-1), "rollout_is_threshold", "must be > 0"),
        (dict(rollout_rs="token_k9", rollout_rs_threshold="2"), "rollout_rs", "unknown rollout_rs"),
        (dict(rollout_rs="token_k1"), "rollout_rs", "rollout_rs_threshold is required"),
        (dict(rollout_rs="token_k1", rollout_rs_threshold="3_2"), "rollout_rs", "lower 3.0 > upper 2.0"),
    ],
)
def test_config_check_names_the_key(values, key, match):
    with pytest.raises(ConfigError, match=rf"config\.algorithm\.rollout_correction\.{key}=.*{match}"):
        validate_config(_cfg(**values), n_devices=1)


def test_config_check_accepts_valid():
    good = dict(rollout_is="sequence", rollout_rs="seq_mean_k1,token_k3", rollout_rs_threshold="0.9_1.1,0.5")
    validate_config(_cfg(), n_devices=1)  # defaults: off
    validate_config(_cfg(**good), n_devices=1)


def test_policy_loss_weights_multiply_per_token_losses():
    """`losses.actor_loss` passes `rollout_is_weights` to the policy loss: per-token losses are multiplied
    after clipping, so weights of 2 double pg_loss in token-mean (ratios and clip fractions unchanged)."""
    from jaxrl_post.rl import losses

    rng = np.random.default_rng(0)
    b, r = 4, 5
    mask = (rng.random((b, r)) < 0.8).astype(np.int32)
    mb = dict(
        loss_mask=jnp.asarray(mask),
        advantages=jnp.asarray(rng.normal(size=(b, r)), jnp.float32),
        old_log_probs=jnp.asarray(rng.normal(size=(b, r)) * 0.1 - 2, jnp.float32),
    )
    lp = mb["old_log_probs"] + jnp.asarray(rng.normal(size=(b, r)) * 0.3, jnp.float32)
    counts = core_algos.global_batch_info(mb["loss_mask"])
    cfg = ppo_update.ActorLossConfig()
    base, m0 = losses.actor_loss(cfg, lp, jnp.zeros((b, r)), mb, counts)
    doubled, m1 = losses.actor_loss(
        cfg, lp, jnp.zeros((b, r)), dict(mb, rollout_is_weights=jnp.full((b, r), 2.0)), counts
    )
    np.testing.assert_allclose(float(doubled), 2 * float(base), rtol=1e-6)
    assert float(m1["pg_clipfrac"]) == float(m0["pg_clipfrac"]) > 0


@pytest.mark.slow
def test_trainer_applies_rollout_correction_to_a_bf16_rollout(tmp_path):
    """Tiny GRPO whose sampler runs on a bfloat16 copy (`rollout.dtype`) while training is float32: token IS
    weights and token_k1 rejection are computed from the actual mismatch, rejected tokens leave the loss
    mask, and the metrics are logged under verl's names."""
    from configs import grpo
    from jaxrl_post.rl import updates
    from jaxrl_post.rl.trainer import RLTrainer

    c = grpo.get_config("tiny")
    c.trainer.default_local_dir = str(tmp_path / "rc")
    c.trainer.save_freq = -1
    c.trainer.total_training_steps = 1
    c.trainer.val_before_train = c.trainer.val_at_end = False
    c.rollout.dtype = "bfloat16"
    rc = c.algorithm.rollout_correction
    rc.rollout_is, rc.rollout_is_threshold = "token", 1.0005
    rc.rollout_rs, rc.rollout_rs_threshold = "token_k1", "0.999_1.001"
    trainer = RLTrainer(c, console_write=lambda s: None)
    try:
        assert trainer.rollout.copy and trainer.geometry.use_rollout_corr and not trainer.geometry.on_policy
        b, _, _ = trainer.rollout.generate_and_score(next(trainer.data.train_loader), 3, {}, trainer.reward_fn)
        b["old_log_probs"] = trainer.placement.forward(
            trainer.policy.old_log_prob_fn, trainer.state.actor.params, b, 8, trainer.policy.old_log_prob_spec
        )[0]
        before = b["loss_mask"].astype(np.int32)
        w, kept, m = updates.rollout_correction(trainer.config, b, before.copy())
        assert "rollout_is_weights" not in b  # returned, not written behind the caller's back
        log_ratio = b["old_log_probs"] - b["rollout_log_probs"]  # bf16 sampler vs f32 training: |.| ~1e-3
        valid = before.astype(bool)
        lo, hi = np.log(0.999), np.log(1.001)  # verl's token_k1 keeps tokens with -log_ratio in [log lo, log hi]
        keep = (-log_ratio >= lo) & (-log_ratio <= hi)
        clear = valid & (np.abs(-log_ratio - lo) > 1e-6) & (np.abs(-log_ratio - hi) > 1e-6)
        assert 0.02 < m["rollout_corr/rollout_rs_masked_fraction"] < 0.98
        np.testing.assert_array_equal(kept.astype(bool)[clear], keep[clear])
        assert not kept[~valid].any()
        np.testing.assert_allclose(w[valid], np.minimum(np.exp(log_ratio[valid]), 1.0005), rtol=1e-5)
        for k in ("rollout_corr/rollout_is_mean", "rollout_corr/kl", "training/rollout_probs_diff_max"):
            assert np.isfinite(m[k]), k
        hist = trainer.fit()["history"]
        assert "rollout_corr/rollout_is_mean" in hist[-1] and np.isfinite(hist[-1]["actor/pg_loss"])
    finally:
        trainer.close()
