"""Tests for jaxrl_post.algos.core_algos (+ functional, kl): numpy references under jit and hand-checked cases."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_post.algos import core_algos as ca

RTOL, ATOL = 1e-5, 1e-5


def close(a, b, rtol=RTOL, atol=ATOL):
    np.testing.assert_allclose(np.asarray(a, np.float64), np.asarray(b, np.float64), rtol=rtol, atol=atol)


def jit(fn, *static):
    return functools.partial(jax.jit, static_argnames=static)(fn)


# ------------------------------------------------------------------ random data


def right_padded_mask(rng, b, r, min_len=1, empty_rows=()):
    lens = rng.integers(min_len, r + 1, size=b)
    mask = (np.arange(r)[None, :] < lens[:, None]).astype(np.int32)
    for i in empty_rows:
        mask[i] = 0
    return mask


def random_groups(rng, sizes):
    """Group ids for groups of the given sizes, with arbitrary id values, rows shuffled."""
    ids = rng.choice(np.arange(-500, 500), size=len(sizes), replace=False)
    index = np.concatenate([np.full(n, ids[g]) for g, n in enumerate(sizes)])
    return index[rng.permutation(index.size)].astype(np.int32)


def outcome_batch(rng, sizes, r=6, levels=(0.0, 0.5, 1.0)):
    """Outcome rewards on the last valid token; junk in the padding (must be ignored)."""
    index = random_groups(rng, sizes)
    b = index.size
    mask = right_padded_mask(rng, b, r)
    scores = rng.choice(levels, size=b)
    rewards = rng.normal(size=(b, r)) * 100.0 * (1 - mask)  # junk outside the mask
    rewards[np.arange(b), mask.sum(-1) - 1] = scores
    return rewards.astype(np.float32), mask, index, scores


def groups_of(index):
    out = {}
    for i, g in enumerate(index):
        out.setdefault(int(g), []).append(i)
    return out


# ------------------------------------------------------------------ numpy references


def np_masked_mean(v, m, axis=None):
    return (v * m).sum(axis) / m.sum(axis)


def np_whiten(v, m):
    mean = np_masked_mean(v, m)
    n = m.sum()
    var = np_masked_mean((v - mean) ** 2, m) * n / (n - 1)
    return (v - mean) / np.sqrt(var + 1e-8)


def np_gae_raw(r, v, m, gamma, lam):
    b, n = r.shape
    nextv, last = np.zeros(b), np.zeros(b)
    out = np.zeros((b, n))
    for t in reversed(range(n)):
        delta = r[:, t] + gamma * nextv - v[:, t]
        gae = delta + gamma * lam * last
        nextv = v[:, t] * m[:, t] + (1 - m[:, t]) * nextv
        last = gae * m[:, t] + (1 - m[:, t]) * last
        out[:, t] = last
    return out * m, (out + v) * m


def np_group_center(scores, index, use_std, eps, single_std=1.0):
    adv = np.zeros_like(scores, dtype=np.float64)
    for _g, rows in groups_of(index).items():
        s = scores[rows].astype(np.float64)
        if len(rows) == 1:
            mean, std = 0.0, single_std
        else:
            mean, std = s.mean(), s.std(ddof=1)
        adv[rows] = (s - mean) / (std + eps) if use_std else s - mean
    return adv


def np_policy_vanilla(old, lp, adv, low, high, c):
    ratio = np.exp(np.clip(lp - old, -20, 20))
    l1 = -adv * ratio
    l2 = -adv * np.clip(ratio, 1 - low, 1 + high)
    cl1 = np.maximum(l1, l2)
    return np.where(adv < 0, np.minimum(cl1, -adv * c), cl1), (l2 > l1), ((cl1 > -adv * c) & (adv < 0))


def np_agg(loss, mask, mode, n_tok=None, n_seq=None, scale=None):
    m = mask.astype(np.float64)
    if mode == "token-mean":
        return (loss * m).sum() / (m.sum() if n_tok is None else n_tok)
    seq = (loss * m).sum(-1)
    cnt = m.sum(-1)
    n_seq = (cnt > 0).sum() if n_seq is None else n_seq
    if mode == "seq-mean-token-mean":
        seq = np.where(cnt > 0, seq / np.maximum(cnt, 1), 0.0)
    elif mode == "seq-mean-token-sum-norm":
        seq = seq / (mask.shape[-1] if scale is None else scale)
    return seq.sum() / n_seq


def np_kl(lp, ref, kind):
    d = lp - ref
    if kind in ("kl", "k1"):
        return d
    if kind == "abs":
        return np.abs(d)
    if kind in ("mse", "k2"):
        return 0.5 * d * d
    lr = np.clip(ref - lp, -20, 20)
    return np.clip(np.exp(lr) - lr - 1, -10, 10)


def np_log_softmax(z):
    z = z - z.max(-1, keepdims=True)
    return z - np.log(np.exp(z).sum(-1, keepdims=True))


# ------------------------------------------------------------------ masked statistics


def test_masked_stats_match_numpy():
    rng = np.random.default_rng(0)
    v = rng.normal(size=(5, 7)).astype(np.float32)
    m = right_padded_mask(rng, 5, 7, min_len=2)
    v_junk = np.where(m > 0, v, np.inf).astype(np.float32)  # masked entries must not leak
    f = jit(
        lambda v, m: (
            ca.masked_sum(v, m),
            ca.masked_mean(v, m),
            ca.masked_mean(v, m, axis=-1),
            ca.masked_var(v, m),
            ca.masked_var(v, m, unbiased=False),
            ca.masked_whiten(v, m),
            ca.masked_whiten(v, m, shift_mean=False),
        )
    )
    s, mean, row_mean, var_u, var_b, wh, wh_noshift = f(v_junk, m)
    vm = v[m > 0].astype(np.float64)
    close(s, vm.sum())
    close(mean, vm.mean())
    close(row_mean, np_masked_mean(v, m, axis=-1))
    close(var_u, vm.var(ddof=1))
    close(var_b, vm.var())
    close(np.asarray(wh)[m > 0], np_whiten(v, m)[m > 0], atol=1e-4)
    close(np.asarray(wh_noshift)[m > 0], (np_whiten(v, m) + vm.mean())[m > 0], atol=1e-4)


def test_masked_whiten_hand_case():
    v = jnp.array([[1.0, 2.0, 0.0, 0.0], [3.0, 0.0, 0.0, 0.0]])
    m = jnp.array([[1, 1, 0, 0], [1, 0, 0, 0]])
    out = np.asarray(jax.jit(ca.masked_whiten)(v, m))
    close(out[np.asarray(m) > 0], [-1.0, 0.0, 1.0])


def test_masked_var_single_element_is_finite():
    out = jax.jit(ca.masked_var)(jnp.array([3.0, 7.0]), jnp.array([1, 0]))
    assert float(out) == 0.0


# ------------------------------------------------------------------ log-probs / entropy


def test_logprob_entropy_temperature_hand_case():
    logits = jnp.array([[[2.0, 1.0, 0.0]]])
    lp, ent = jax.jit(
        lambda x: (
            ca.logprobs_from_logits(x, jnp.array([[0]]), temperature=0.5),
            ca.entropy_from_logits(x, temperature=0.5),
        )
    )(logits)
    close(lp, [[-0.142932]], atol=1e-6)
    close(ent, [[0.441057]], atol=1e-6)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_logprobs_entropy_match_numpy_with_grads(dtype):
    rng = np.random.default_rng(1)
    b, t, v = 3, 4, 11
    logits = jnp.asarray(rng.normal(size=(b, t, v)) * 3, dtype)
    labels = jnp.asarray(rng.integers(0, v, size=(b, t)), jnp.int32)
    w1, w2 = rng.normal(size=(b, t)), rng.normal(size=(b, t))

    @jax.jit
    def run(x, temp):
        lp, ent = ca.logprobs_and_entropy_from_logits(x, labels, temp)
        separate = (ca.logprobs_from_logits(x, labels, temp), ca.entropy_from_logits(x, temp))
        loss = lambda y: (
            jnp.sum(w1 * ca.logprobs_from_logits(y, labels, temp)) + jnp.sum(w2 * ca.entropy_from_logits(y, temp))
        )
        loss_both = lambda y: jnp.sum(
            jnp.stack(ca.logprobs_and_entropy_from_logits(y, labels, 0.7)) * jnp.stack([w1, w2])
        )  # Python-float temperature
        xf = x.astype(jnp.float32)
        return lp, ent, separate, jax.grad(loss)(xf), jax.grad(loss_both)(xf)

    lp, ent, (lp2, ent2), g, g_both = run(logits, jnp.float32(0.7))
    z = np.asarray(logits.astype(jnp.float32), np.float64) / 0.7
    logp = np_log_softmax(z)
    p = np.exp(logp)
    ref_lp = np.take_along_axis(logp, np.asarray(labels)[..., None], -1)[..., 0]
    ref_ent = -(p * logp).sum(-1)
    for a, ref in ((lp, ref_lp), (ent, ref_ent), (lp2, ref_lp), (ent2, ref_ent)):
        close(a, ref)
        assert a.dtype == jnp.float32
    # Gradient of w1 * lp + w2 * H w.r.t. the logits, against the analytic form (custom VJP).
    onehot = np.eye(v)[np.asarray(labels)]
    ref_g = (w1[..., None] * (onehot - p) - w2[..., None] * p * (logp + ref_ent[..., None])) / 0.7
    close(g, ref_g, atol=1e-4)
    close(g_both, ref_g, atol=1e-4)


def test_logprobs_memory_at_most_one_f32_copy():
    b, t, v = 2, 32, 2048
    one_copy = b * t * v * 4
    y = jnp.zeros((b, t), jnp.int32)
    for dtype, fn in (
        (jnp.float32, lambda x, y: ca.logprobs_from_logits(x, y, 0.7)),
        (jnp.bfloat16, lambda x, y: ca.logprobs_and_entropy_from_logits(x, y, 0.7)),
    ):
        x = jnp.zeros((b, t, v), dtype)
        mem = jax.jit(fn).lower(x, y).compile().memory_analysis()
        if mem is None:
            pytest.skip("memory_analysis unavailable on this backend")
        assert mem.temp_size_in_bytes <= 1.05 * one_copy, (dtype, mem.temp_size_in_bytes / one_copy)


def test_response_alignment_three_tokens():
    # Sequence [a, b, c]: prompt [a] (P=1), response [b, c] (R=2). Token b is scored by logits[0], c by logits[1];
    # logits[2] (after the last token) scores nothing.
    rng = np.random.default_rng(2)
    v = 7
    logits = rng.normal(size=(1, 3, v)).astype(np.float32)
    input_ids = np.array([[4, 2, 5]])
    responses = input_ids[:, 1:]
    run = jax.jit(
        lambda x: (
            ca.compute_response_log_probs(x, jnp.asarray(responses)),
            ca.compute_response_log_probs(x, jnp.asarray(input_ids[:, 2:]), 1.0, True),
            ca.response_logits(x, 2),
        )
    )
    lp, (lp1, ent1), sliced = run(jnp.asarray(logits))
    ls = np_log_softmax(logits.astype(np.float64))
    expected = [ls[0, 0, 2], ls[0, 1, 5]]
    close(lp[0], expected)
    wrong = [ls[0, 1, 2], ls[0, 2, 5]]
    assert np.abs(np.asarray(lp[0]) - wrong).max() > 1e-3
    # P=2, R=1: the single response token c comes from logits[P-1] = logits[1].
    close(lp1[0], [ls[0, 1, 5]])
    close(ent1[0], [-(np.exp(ls[0, 1]) * ls[0, 1]).sum()])
    close(sliced, logits[:, 0:2])


# ------------------------------------------------------------------ GAE


def test_gae_hand_case_and_padding_invariance():
    r = jnp.array([[0.0, 1.0, 0.0]])
    v = jnp.array([[0.0, 0.0, 100.0]])
    m = jnp.array([[1, 1, 0]])
    gae = jax.jit(lambda *a: (ca.compute_gae_raw(*a, 1.0, 0.95), ca.compute_gae_advantage_return(*a, 1.0, 0.95)))
    (raw, ret), (adv, ret2) = gae(r, v, m)
    close(raw, [[0.95, 1.0, 0.0]])
    close(ret, [[0.95, 1.0, 0.0]])
    close(ret2, ret)
    # whitened over the two valid entries: mean 0.975, unbiased std 0.0353553
    close(adv, [[-0.7071067, 0.7071067, 0.0]], atol=1e-4)

    # More padding with arbitrary rewards/values (even inf/nan) changes nothing on the valid tokens.
    rp = jnp.array([[0.0, 1.0, 7.0, -3.0, np.nan, 5.0]])
    vp = jnp.array([[0.0, 0.0, 100.0, np.inf, -42.0, 9.0]])
    mp = jnp.array([[1, 1, 0, 0, 0, 0]])
    (raw_p, ret_p), (adv_p, _) = gae(rp, vp, mp)
    close(raw_p, [[0.95, 1.0, 0, 0, 0, 0]])
    close(ret_p, [[0.95, 1.0, 0, 0, 0, 0]])
    close(adv_p[:, :3], adv)
    close(adv_p[:, 3:], 0.0)


def test_gae_matches_numpy_with_interior_masks():
    rng = np.random.default_rng(3)
    b, r = 4, 9
    rew = rng.normal(size=(b, r)).astype(np.float32)
    val = rng.normal(size=(b, r)).astype(np.float32)
    m = right_padded_mask(rng, b, r, min_len=4)
    m[0, 1] = 0  # interior (observation) tokens: skipped, carried over
    m[2, 2:4] = 0
    ref_raw, ref_ret = np_gae_raw(rew.astype(np.float64), val, m, 0.99, 0.9)
    gae = jax.jit(lambda *a: (ca.compute_gae_raw(*a), ca.compute_gae_advantage_return(*a)))
    (raw, ret), (adv, ret2) = gae(rew, val, m, 0.99, 0.9)
    close(raw, ref_raw)
    close(ret, ref_ret)
    close(adv, np_whiten(ref_raw, m) * m, atol=1e-4)
    close(ret2, ref_ret)


# ------------------------------------------------------------------ outcome estimators

grpo_jit = jit(ca.compute_grpo_outcome_advantage, "norm_adv_by_std_in_grpo")


def test_grpo_hand_cases():
    m = jnp.ones((8, 1), jnp.int32)
    r = jnp.array([1, 0, 0, 0, 1, 1, 1, 1], jnp.float32)[:, None]
    adv, ret = grpo_jit(r, m, jnp.array([0, 0, 0, 0, 1, 1, 1, 1]))
    close(adv[:, 0], [1.5, -0.5, -0.5, -0.5, 0, 0, 0, 0])
    close(ret, adv)
    r = jnp.array([1, 1, 0, 1, 0, 1, 0, 1], jnp.float32)[:, None]
    adv, _ = grpo_jit(r, m, jnp.array([0, 1, 0, 1, 0, 1, 0, 1]))
    close(adv[:, 0], [1.5, 0, -0.5, 0, -0.5, 0, -0.5, 0])


@pytest.mark.parametrize("norm", [True, False])
def test_grpo_matches_numpy(norm):
    rng = np.random.default_rng(4)
    rewards, mask, index, scores = outcome_batch(rng, [4, 1, 3, 4, 2, 5])
    adv, ret = grpo_jit(rewards, mask, index, 1e-6, norm)
    ref = np_group_center(scores, index, norm, 1e-6)[:, None] * mask
    close(adv, ref, atol=1e-4)
    close(ret, adv)
    assert np.all(np.asarray(adv)[mask == 0] == 0)


def test_grpo_group_of_one_and_all_equal_group():
    # group 7: a single sample -> mean 0, std 1; group 3: all equal (0.1) -> exactly 0, never NaN.
    r = jnp.array([0.1, 0.1, 0.1, 0.8, 0.3, 0.5], jnp.float32)[:, None]
    m = jnp.ones((6, 1), jnp.int32)
    idx = jnp.array([3, 3, 3, 7, 9, 9])
    run = jax.jit(
        lambda r, m, idx: (
            [ca.compute_grpo_outcome_advantage(r, m, idx, 1e-6, n)[0] for n in (True, False)],
            ca.compute_rloo_outcome_advantage(r, m, idx)[0],
        )
    )
    grpo_out, rl = run(r, m, idx)
    for norm, adv in zip((True, False), grpo_out):
        adv = np.asarray(adv[:, 0])
        assert np.all(np.isfinite(adv))
        assert np.all(adv[:3] == 0.0)
        close(adv[3], 0.8 / (1 + 1e-6) if norm else 0.8)
    assert np.all(np.asarray(rl)[:3] == 0.0)


def test_grpo_string_uids_on_host():
    # Host call with verl-style string uids (np.unique path) == jitted call with int ids (jnp.unique path).
    r = jnp.array([1, 0, 0, 0, 1, 1, 0, 1], jnp.float32)[:, None]
    m = jnp.ones((8, 1), jnp.int32)
    uid = np.array(["q2", "q1", "q1", "q2", "q1", "q2", "q1", "q2"], dtype=object)
    adv, _ = ca.compute_grpo_outcome_advantage(r, m, uid)
    adv_int, _ = grpo_jit(r, m, jnp.array([20, 10, 10, 20, 10, 20, 10, 20]))
    close(adv, adv_int)
    close(adv[:, 0], [0.5, -0.5, -0.5, -1.5, 1.5, 0.5, -0.5, 0.5])


def test_rloo_matches_numpy():
    rng = np.random.default_rng(5)
    rewards, mask, index, scores = outcome_batch(rng, [3, 1, 4, 2])
    adv, ret = jax.jit(ca.compute_rloo_outcome_advantage)(rewards, mask, index)
    ref = np.zeros(len(scores))
    for rows in groups_of(index).values():
        n = len(rows)
        for i in rows:
            ref[i] = scores[i] if n == 1 else scores[i] - (scores[rows].sum() - scores[i]) / (n - 1)
    close(adv, ref[:, None] * mask)
    close(ret, adv)


def test_reinforce_plus_plus_matches_numpy():
    rng = np.random.default_rng(6)
    b, r = 5, 7
    rew = rng.normal(size=(b, r)).astype(np.float32)
    m = right_padded_mask(rng, b, r, min_len=2)
    m[1, 2] = 0  # interior mask: the running return restarts there
    adv, ret = jax.jit(ca.compute_reinforce_plus_plus_outcome_advantage)(rew, m, 0.9)
    ref = np.zeros((b, r))
    run = np.zeros(b)
    for t in reversed(range(r)):
        run = rew[:, t] + 0.9 * run
        ref[:, t] = run
        run = run * m[:, t]
    close(ret, ref * m)
    close(adv, np_whiten(ref, m) * m, atol=1e-4)


def test_reinforce_plus_plus_baseline_matches_numpy():
    rng = np.random.default_rng(7)
    rewards, mask, index, scores = outcome_batch(rng, [2, 3, 1, 4])
    adv, ret = jax.jit(ca.compute_reinforce_plus_plus_baseline_outcome_advantage)(rewards, mask, index)
    centered = np_group_center(scores, index, False, 0.0, single_std=1.0)
    ref = np_whiten(centered[:, None] * mask, mask) * mask
    close(adv, ref, atol=1e-4)
    close(ret, adv)


def test_remax_matches_numpy():
    rng = np.random.default_rng(8)
    b, r = 4, 5
    rew = rng.normal(size=(b, r)).astype(np.float32)
    m = right_padded_mask(rng, b, r)
    base = rng.normal(size=b).astype(np.float32)
    adv, ret = jax.jit(ca.compute_remax_outcome_advantage)(rew, base, m)
    ref_ret = np.flip(np.cumsum(np.flip(rew * m, -1), -1), -1)
    close(ret, ref_ret * m)
    close(adv, (ref_ret - base[:, None]) * m)


def test_opo_matches_numpy():
    rng = np.random.default_rng(9)
    rewards, mask, index, scores = outcome_batch(rng, [3, 1, 4], r=8)
    lens = mask.sum(-1)
    adv, ret = jax.jit(ca.compute_opo_outcome_advantage)(rewards, mask, index)
    ref = np.zeros(len(scores))
    for rows in groups_of(index).values():
        bsl = 0.0 if len(rows) == 1 else (lens[rows] * scores[rows]).sum() / lens[rows].sum()
        ref[rows] = scores[rows] - bsl
    close(adv, ref[:, None] * mask)
    close(ret, adv)


def test_gpg_matches_numpy():
    rng = np.random.default_rng(10)
    rewards, mask, index, scores = outcome_batch(rng, [3, 1, 4, 2])
    adv, _ = jax.jit(ca.compute_gpg_outcome_advantage)(rewards, mask, index)
    alpha = len(scores) / max(np.count_nonzero(scores), 1)
    ref = alpha * np_group_center(scores, index, False, 0.0)
    close(adv, ref[:, None] * mask)


@pytest.mark.parametrize("norm", [True, False])
def test_grpo_passk_matches_numpy(norm):
    rng = np.random.default_rng(11)
    rewards, mask, index, scores = outcome_batch(rng, [3, 2, 4, 5], levels=(0.0, 0.25, 0.5, 1.0))
    f = jit(ca.compute_grpo_passk_outcome_advantage, "norm_adv_by_std_in_grpo")
    adv, ret = f(rewards, mask, index, 1e-6, norm)
    ref = np.zeros(len(scores))
    for rows in groups_of(index).values():
        s = scores[rows]
        order = sorted(range(len(rows)), key=lambda k: (-s[k], k))  # max first, ties -> lowest position
        gap = s[order[0]] - s[order[1]]
        ref[rows[order[0]]] = gap / (s.std(ddof=1) + 1e-6) if norm else gap
    close(adv, ref[:, None] * mask, atol=1e-4)
    close(ret, adv)


def test_grpo_passk_rejects_group_of_one_on_host():
    with pytest.raises(ValueError, match="at least 2"):
        ca.compute_grpo_passk_outcome_advantage(jnp.ones((3, 2)), jnp.ones((3, 2)), np.array([0, 0, 1]))


def test_estimator_registry_and_dispatch():
    assert set(ca.ADV_ESTIMATORS) == {
        "gae",
        "grpo",
        "reinforce_plus_plus",
        "reinforce_plus_plus_baseline",
        "remax",
        "rloo",
        "opo",
        "gpg",
        "grpo_passk",
    }
    assert ca.get_adv_estimator("grpo") is ca.compute_grpo_outcome_advantage
    with pytest.raises(ValueError, match="grpo_passk"):
        ca.get_adv_estimator("grpoo")
    rng = np.random.default_rng(12)
    rewards, mask, index, _ = outcome_batch(rng, [2, 2])
    vals = rng.normal(size=rewards.shape).astype(np.float32)
    base = rng.normal(size=rewards.shape[:1]).astype(np.float32)

    @jax.jit
    def run(rewards, mask, index, vals, base):
        kw = dict(token_level_rewards=rewards, response_mask=mask)
        out = {
            name: (ca.compute_advantage(name, **kw, index=index)[0], ca.ADV_ESTIMATORS[name](rewards, mask, index)[0])
            for name in ("grpo", "rloo", "opo", "gpg", "reinforce_plus_plus_baseline", "grpo_passk")
        }
        out["gae"] = (
            ca.compute_advantage("gae", **kw, values=vals, gamma=0.9, lam=0.8)[0],
            ca.compute_gae_advantage_return(rewards, vals, mask, 0.9, 0.8)[0],
        )
        out["remax"] = (
            ca.compute_advantage("remax", **kw, reward_baselines=base)[0],
            ca.compute_remax_outcome_advantage(rewards, base, mask)[0],
        )
        out["reinforce_plus_plus"] = (
            ca.compute_advantage("reinforce_plus_plus", **kw, gamma=0.9)[0],
            ca.compute_reinforce_plus_plus_outcome_advantage(rewards, mask, 0.9)[0],
        )
        return out

    out = run(rewards, mask, index, vals, base)
    assert set(out) == set(ca.ADV_ESTIMATORS)
    for a, b_ in out.values():
        close(a, b_)
    with pytest.raises(ValueError, match="values"):
        ca.compute_advantage("gae", token_level_rewards=rewards, response_mask=mask)


# ------------------------------------------------------------------ agg_loss


def test_token_mean_hand_case_one_batch_vs_micro_batches():
    loss = jnp.array([[1.0, 1.0, 1.0, 1.0], [5.0, 0.0, 0.0, 0.0]])
    mask = jnp.array([[1, 1, 1, 1], [1, 0, 0, 0]])

    @jax.jit
    def run(loss, mask):
        info = ca.global_batch_info(mask)
        parts = [ca.agg_loss(loss[i : i + 1], mask[i : i + 1], "token-mean", **info) for i in range(2)]
        naive = [ca.agg_loss(loss[i : i + 1], mask[i : i + 1], "token-mean") for i in range(2)]
        return ca.agg_loss(loss, mask, "token-mean"), sum(parts), sum(naive) / 2

    one_batch, micro, naive = run(loss, mask)
    close(one_batch, 1.8)
    close(micro, 1.8)
    close(naive, 3.0)  # averaging per-micro-batch token means would be wrong


def test_agg_loss_matches_numpy():
    rng = np.random.default_rng(13)
    loss = rng.normal(size=(6, 5)).astype(np.float32)
    mask = right_padded_mask(rng, 6, 5, empty_rows=(2,))

    @jax.jit
    def run(loss, mask, n_tok, n_seq, scale):
        return {
            mode: (
                ca.agg_loss(loss, mask, mode),
                ca.agg_loss(
                    loss, mask, mode, global_batch_tokens=n_tok, global_batch_size=n_seq, loss_scale_factor=scale
                ),
            )
            for mode in ca.LOSS_AGG_MODES
        }

    out = run(loss, mask, 40.0, 9.0, 3.0)
    for mode in ca.LOSS_AGG_MODES:
        close(out[mode][0], np_agg(loss, mask, mode))
        close(out[mode][1], np_agg(loss, mask, mode, n_tok=40.0, n_seq=9.0, scale=3.0))


def test_agg_loss_rejects_unknown_mode():
    with pytest.raises(ValueError, match="seq-mean-token-mean"):
        ca.agg_loss(jnp.ones((1, 1)), jnp.ones((1, 1)), "token-sum")


def test_micro_batch_split_equals_full_batch_values_and_grads():
    """For every agg mode: summed micro-batch losses and their gradients == the un-split mini-batch's."""
    rng = np.random.default_rng(14)
    b, r = 8, 6
    mask = right_padded_mask(rng, b, r, empty_rows=(5,))
    old = rng.normal(size=(b, r)).astype(np.float32) - 1.0
    lp = (old + 0.3 * rng.normal(size=(b, r))).astype(np.float32)
    adv = rng.normal(size=(b, r)).astype(np.float32)
    loss_mat = rng.normal(size=(b, r)).astype(np.float32)
    splits = [slice(0, 3), slice(3, 8)]  # uneven micro-batches

    def losses(mode):
        def pg(x, sl, **kw):
            return ca.compute_policy_loss(
                old[sl], x, adv[sl], mask[sl], loss_agg_mode=mode, clip_ratio_high=0.28, **kw
            )[0]

        def agg(x, sl, **kw):
            return ca.agg_loss(x, mask[sl], mode, **kw)

        def vf(x, sl, **kw):
            return ca.compute_value_loss(x, adv[sl], old[sl], mask[sl], 0.2, mode, **kw)[0]

        return (pg, lp), (agg, loss_mat), (vf, lp)

    @jax.jit
    def run():
        info = ca.global_batch_info(mask)
        out = {}
        for mode in ca.LOSS_AGG_MODES:
            for k, (fn, x) in enumerate(losses(mode)):
                full = jax.value_and_grad(lambda x_, fn=fn: fn(x_, slice(None)))(x)
                parts = [jax.value_and_grad(lambda x_, sl=sl, fn=fn: fn(x_, sl, **info))(x[sl]) for sl in splits]
                out[mode, k] = (full, parts)
        return out

    for (mode, k), ((full_val, full_grad), parts) in run().items():
        assert abs(float(full_val)) > 1e-3, (mode, k)
        close(sum(p[0] for p in parts), full_val)
        close(np.concatenate([p[1] for p in parts]), full_grad)
        assert np.abs(np.asarray(full_grad)).max() > 0


# ------------------------------------------------------------------ policy / value losses

policy_jit = jit(ca.compute_policy_loss, "loss_mode", "loss_agg_mode")


def test_dual_clip_hand_cases():
    cases = [((5.0, 1.0), -1.2), ((5.0, -1.0), 3.0), ((0.5, 1.0), -0.5), ((1.5, -2.0), 3.0)]
    ratio = jnp.array([[c[0][0] for c in cases]])
    adv = jnp.array([[c[0][1] for c in cases]])
    for i, (_, expected) in enumerate(cases):
        loss, _ = policy_jit(
            jnp.zeros((1, 1)),
            jnp.log(ratio[:, i : i + 1]),
            adv[:, i : i + 1],
            jnp.ones((1, 1)),
            clip_ratio_low=0.2,
            clip_ratio_high=0.2,
            clip_ratio_c=3.0,
        )
        close(loss, expected)
    # metrics: (5,+1) clipped high; (5,-1) hits the dual-clip bound; (0.5,+1) and (1.5,-2) unclipped.
    _, metrics = policy_jit(jnp.zeros((1, 4)), jnp.log(ratio), adv, jnp.ones((1, 4)))
    close(metrics["pg_clipfrac"], 0.25)
    close(metrics["pg_clipfrac_lower"], 0.25)


def test_vanilla_policy_loss_matches_numpy():
    rng = np.random.default_rng(15)
    b, r = 4, 6
    mask = right_padded_mask(rng, b, r)
    old = rng.normal(size=(b, r)).astype(np.float32) - 1.0
    lp = (old + 0.5 * rng.normal(size=(b, r))).astype(np.float32)
    lp[0, 0] = old[0, 0] + 30.0  # log-ratio clamp at 20
    adv = rng.normal(size=(b, r)).astype(np.float32) * 2
    isw = rng.uniform(0.5, 1.5, size=(b, r)).astype(np.float32)
    loss, metrics = policy_jit(
        old, lp, adv, mask, clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=3.0, rollout_is_weights=isw
    )
    pg, c1, c2 = np_policy_vanilla(old, lp, adv, 0.2, 0.28, 3.0)
    close(loss, np_agg(pg * isw, mask, "token-mean"), rtol=1e-4)
    close(metrics["pg_clipfrac"], np_masked_mean(c1, mask))
    close(metrics["pg_clipfrac_lower"], np_masked_mean(c2, mask))
    close(metrics["ppo_kl"], np_masked_mean(-np.clip(lp - old, -20, 20), mask))
    assert set(metrics) == {"pg_clipfrac", "pg_clipfrac_lower", "ppo_kl"}
    with pytest.raises(ValueError, match="clip_ratio_c"):
        ca.compute_policy_loss(old, lp, adv, mask, clip_ratio_c=1.0)


def test_gspo_loss_value_and_gradient_match_numpy():
    rng = np.random.default_rng(16)
    b, r = 4, 5
    mask = right_padded_mask(rng, b, r, min_len=2)
    old = rng.normal(size=(b, r)).astype(np.float32) - 1.0
    lp = (old + 0.3 * rng.normal(size=(b, r))).astype(np.float32)
    adv = np.repeat(rng.normal(size=(b, 1)), r, 1).astype(np.float32)
    fn = lambda x: policy_jit(
        old,
        x,
        adv,
        mask,
        loss_mode="gspo",
        loss_agg_mode="seq-mean-token-mean",
        clip_ratio_low=3e-4,
        clip_ratio_high=4e-4,
    )
    (loss, metrics), grad = jax.value_and_grad(fn, has_aux=True)(lp)
    n = mask.sum(-1)
    s = np.exp(((lp - old) * mask).sum(-1) / n)[:, None]
    l1 = -adv * s
    l2 = -adv * np.clip(s, 1 - 3e-4, 1 + 4e-4)
    close(loss, np_agg(np.maximum(l1, l2), mask, "seq-mean-token-mean"), rtol=1e-4)
    close(metrics["pg_clipfrac"], np_masked_mean((l2 > l1).astype(float), mask))
    # d/d logp_t: unclipped tokens carry -A * s_i / (n_i * B); clipped ones are flat.
    ref_grad = np.where(l1 >= l2, -adv * s, 0.0) * mask / n[:, None] / b
    close(grad, ref_grad, rtol=1e-4)


def test_cispo_and_gpg_losses_value_and_gradient():
    rng = np.random.default_rng(17)
    b, r = 3, 6
    mask = right_padded_mask(rng, b, r)
    old = rng.normal(size=(b, r)).astype(np.float32) - 1.0
    lp = (old + 0.5 * rng.normal(size=(b, r))).astype(np.float32)
    adv = rng.normal(size=(b, r)).astype(np.float32)
    ratio = np.exp(lp - old)
    clipped = np.clip(ratio, 0.8, 1.28)
    fn = lambda x: policy_jit(old, x, adv, mask, loss_mode="cispo", clip_ratio_low=0.2, clip_ratio_high=0.28)
    (loss, metrics), grad = jax.value_and_grad(fn, has_aux=True)(lp)
    close(loss, np_agg(-clipped * adv * lp, mask, "token-mean"), rtol=1e-4)
    close(grad, -clipped * adv * mask / mask.sum(), rtol=1e-4)  # the IS weight is a constant
    close(metrics["pg_clipfrac"], np_masked_mean((ratio != clipped).astype(float), mask))
    assert float(metrics["pg_clipfrac_lower"]) == 0.0
    fn = lambda x: policy_jit(old, x, adv, mask, loss_mode="gpg", loss_agg_mode="seq-mean-token-sum")
    (loss, _), grad = jax.value_and_grad(fn, has_aux=True)(lp)
    close(loss, np_agg(-lp * adv, mask, "seq-mean-token-sum"), rtol=1e-4)
    close(grad, -adv * mask / b, rtol=1e-4)


def test_policy_loss_registry():
    assert set(ca.POLICY_LOSSES) == {
        *("vanilla", "gspo", "gpg", "cispo"),
        *("clip_cov", "kl_cov", "geo_mean", "sapo", "dppo_tv", "dppo_kl"),  # issue 32: verl's other losses
    }
    assert ca.get_policy_loss_fn("cispo") is ca.compute_policy_loss_cispo
    with pytest.raises(ValueError, match="vanilla"):
        ca.get_policy_loss_fn("ppo")


def test_value_loss_matches_numpy():
    rng = np.random.default_rng(18)
    b, r = 4, 5
    mask = right_padded_mask(rng, b, r)
    vp, ret, old = (rng.normal(size=(b, r)).astype(np.float32) for _ in range(3))
    out = jax.jit(lambda *a: {m: ca.compute_value_loss(*a, 0.5, m) for m in ca.LOSS_AGG_MODES})(vp, ret, old, mask)
    for mode, (loss, frac) in out.items():
        l1 = (vp - ret) ** 2
        l2 = (np.clip(vp, old - 0.5, old + 0.5) - ret) ** 2
        close(loss, 0.5 * np_agg(np.maximum(l1, l2), mask, mode), rtol=1e-4)
        close(frac, np_masked_mean((l2 > l1).astype(float), mask))


# ------------------------------------------------------------------ KL


def test_kl_penalty_matches_numpy_and_straight_through():
    rng = np.random.default_rng(19)
    lp = rng.normal(size=(3, 4)).astype(np.float32)
    ref = (lp + rng.normal(size=(3, 4))).astype(np.float32)
    lp[0, 0], ref[0, 0] = 0.0, 30.0  # k3 clamps: log-ratio to 20, value to 10
    lp[0, 1], ref[0, 1] = 30.0, 0.0
    w = rng.normal(size=(3, 4))

    @jax.jit
    def run(lp, ref):
        out = {}
        for name in ca.KL_PENALTIES:
            grads = jax.grad(lambda a, b_, name=name: jnp.sum(w * ca.kl_penalty(a, b_, name + "+")), argnums=(0, 1))(
                lp, ref
            )
            out[name] = (ca.kl_penalty(lp, ref, name), ca.kl_penalty(lp, ref, name + "+"), grads)
        return out

    for name, (base, plus, (g_lp, g_ref)) in run(lp, ref).items():
        close(base, np_kl(lp.astype(np.float64), ref, name), rtol=1e-5)
        close(plus, base)  # value of the base estimator ...
        close(g_lp, w * (lp - ref), rtol=1e-5)  # ... gradient of k2 = (logp - logp_ref)^2 / 2
        close(g_ref, -w * (lp - ref), rtol=1e-5)
    assert float(run(lp, ref)["k3"][0][0, 0]) == 10.0


def test_kl_penalty_errors():
    with pytest.raises(ValueError, match="kl_full"):
        ca.kl_penalty(jnp.zeros(2), jnp.zeros(2), "full")
    with pytest.raises(ValueError, match="low_var_kl"):
        ca.kl_penalty(jnp.zeros(2), jnp.zeros(2), "k4")


def test_kl_full_matches_numpy():
    rng = np.random.default_rng(20)
    a = rng.normal(size=(2, 3, 9)).astype(np.float32)
    b = rng.normal(size=(2, 3, 9)).astype(np.float32)
    out = jax.jit(ca.kl_full)(a, b, 0.8)
    lp, lq = np_log_softmax(a / 0.8), np_log_softmax(b / 0.8)
    close(out, (np.exp(lp) * (lp - lq)).sum(-1))
    close(ca.kl_full(a, a), 0.0)


def test_apply_kl_penalty_matches_numpy():
    rng = np.random.default_rng(21)
    b, r = 4, 6
    mask = right_padded_mask(rng, b, r)
    old = rng.normal(size=(b, r)).astype(np.float32)
    ref = rng.normal(size=(b, r)).astype(np.float32)
    scores = np.zeros((b, r), np.float32)
    scores[np.arange(b), mask.sum(-1) - 1] = rng.normal(size=b)
    scores[mask == 0] = 99.0  # junk outside the mask must vanish
    old_j = np.where(mask > 0, old, np.nan).astype(np.float32)
    f = jit(ca.apply_kl_penalty, "kl_penalty")
    for name in ("kl", "low_var_kl"):
        rewards, cur = f(scores, old_j, ref, mask, jnp.float32(0.05), name)
        kl = np_kl(old.astype(np.float64), ref, name) * mask
        close(rewards, (scores - 0.05 * kl) * mask)
        close(cur, np.mean(kl.sum(-1) / mask.sum(-1)))


def test_kl_controllers():
    fixed = ca.get_kl_controller("fixed", 0.1)
    fixed.update(5.0, 100)
    assert fixed.value == 0.1
    ctl = ca.get_kl_controller("adaptive", 0.1, target_kl=0.05, horizon=1000)
    ctl.update(jnp.float32(0.1), 100)  # error clipped to +0.2 -> x(1 + 0.2 * 100 / 1000)
    close(ctl.value, 0.1 * 1.02)
    ctl.update(0.0, 500)  # error clipped to -0.2 -> x(1 - 0.1)
    close(ctl.value, 0.1 * 1.02 * 0.9)
    ctl.update(0.055, 1000)  # error 0.1
    close(ctl.value, 0.1 * 1.02 * 0.9 * 1.1)
    restored = ca.get_kl_controller("adaptive", 0.5, target_kl=0.05, horizon=1000)
    restored.load_state_dict(ctl.state_dict())
    assert restored.value == ctl.value
    fixed2 = ca.FixedKLController(0.3)
    fixed2.load_state_dict(fixed.state_dict())
    assert fixed2.value == 0.1
    with pytest.raises(ValueError, match="horizon"):
        ca.get_kl_controller("adaptive", 0.1, target_kl=0.05, horizon=0)
    with pytest.raises(ValueError, match="fixed"):
        ca.get_kl_controller("pid", 0.1)
