"""verl's policy losses added with the registry (issue 32): clip_cov, kl_cov, geo_mean, sapo, dppo_tv, dppo_kl
against numpy references of their value, gradient and metrics (formulas from verl's `core_algos.py`), the
aggregation GSPO / SAPO fix, the hyper-parameters forwarded from `policy_loss_params`, and micro-batch
exactness of geo_mean's per-sequence mean."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_post.algos import core_algos as ca
from jaxrl_post.algos.policy_losses.cov import token_budget


def close(a, b, rtol=1e-4, atol=1e-6):
    np.testing.assert_allclose(np.asarray(a, np.float64), np.asarray(b, np.float64), rtol=rtol, atol=atol)


loss_jit = functools.partial(jax.jit, static_argnames=("loss_mode", "loss_agg_mode", "policy_loss_params"))(
    lambda *a, policy_loss_params=None, **kw: ca.compute_policy_loss(
        *a, policy_loss_params=dict(policy_loss_params or ()), **kw
    )
)


def value_and_grad(old, lp, adv, mask, **kw):
    fn = lambda x: loss_jit(old, x, adv, mask, **kw)
    (loss, metrics), grad = jax.value_and_grad(fn, has_aux=True)(jnp.asarray(lp))
    return float(loss), {k: float(v) for k, v in metrics.items()}, np.asarray(grad)


def batch(seed, b=4, r=6, spread=0.4, empty_row=None):
    rng = np.random.default_rng(seed)
    lens = rng.integers(2, r + 1, size=b)
    mask = (np.arange(r)[None, :] < lens[:, None]).astype(np.float32)
    if empty_row is not None:
        mask[empty_row] = 0
    old = np.log(rng.uniform(0.05, 0.95, size=(b, r))).astype(np.float32)
    lp = (old + spread * rng.normal(size=(b, r))).astype(np.float32)
    lp = np.minimum(lp, -1e-3).astype(np.float32)  # probabilities < 1
    adv = rng.normal(size=(b, r)).astype(np.float32)
    return old, lp, adv, mask


def np_mm(v, m):
    return float((v * m).sum() / m.sum())


def np_agg(loss, m, mode):
    if mode == "token-mean":
        return (loss * m).sum() / m.sum()
    n = m.sum(-1)
    seq = (loss * m).sum(-1) / np.maximum(n, 1)
    return seq[n > 0].sum() / (n > 0).sum()


def agg_weight(m, mode):
    """d pg_loss / d per-token loss of `np_agg`."""
    if mode == "token-mean":
        return m / m.sum()
    n = m.sum(-1, keepdims=True)
    return m / np.maximum(n, 1) / (n > 0).sum()


# ------------------------------------------------------------------------------------------ sapo
def test_sapo_value_gradient_and_fixed_aggregation():
    old, lp, adv, mask = batch(1)
    tp, tn = 1.0, 1.05
    # loss_agg_mode="token-mean" is overridden: SAPO aggregates seq-mean-token-mean (verl); unrelated
    # policy_loss_params entries (clip_cov_ratio) are not passed to it
    params = (("tau_pos", tp), ("tau_neg", tn), ("clip_cov_ratio", 0.5))
    loss, m, grad = value_and_grad(
        old, lp, adv, mask, loss_mode="sapo", loss_agg_mode="token-mean", policy_loss_params=params
    )
    d = np.clip(lp.astype(np.float64) - old, -20, 20)
    r = np.exp(d)
    tau = np.where(adv > 0, tp, tn)
    sig = 1 / (1 + np.exp(-tau * (r - 1)))
    close(loss, np_agg(-sig * 4 / tau * adv, mask, "seq-mean-token-mean"))
    assert abs(loss - np_agg(-sig * 4 / tau * adv, mask, "token-mean")) > 1e-4  # the override matters here
    # d/dlogp [-A (4/tau) sigmoid(tau (r - 1))] = -4 A sigmoid' r
    close(grad, -4 * adv * sig * (1 - sig) * r * agg_weight(mask, "seq-mean-token-mean"), atol=1e-6)
    close(m["ppo_kl"], np_mm(-d, mask))
    assert m["pg_clipfrac"] == 0 and m["pg_clipfrac_lower"] == 0
    # tau_neg reaches the loss
    loss2, _, _ = value_and_grad(old, lp, adv, mask, loss_mode="sapo", policy_loss_params=(("tau_neg", 3.0),))
    assert abs(loss2 - loss) > 1e-5


# ------------------------------------------------------------------------------------------ geo_mean
def np_geo_mean(old, lp, adv, mask, low, high, isw=None):
    d = lp.astype(np.float64) - old
    sgn = np.sign(adv)
    dc = np.clip(d, -low, high)
    dmin = sgn * np.minimum(sgn * d, sgn * dc)
    n = mask.sum(-1)
    ratio = np.exp((dmin * mask).sum(-1) / (n + 1e-8))
    abar = (adv * mask).sum(-1) / (n + 1e-8)
    seq = -abar * ratio
    if isw is not None:
        seq = seq * np.exp((np.log(isw + 1e-10) * mask).sum(-1) / (n + 1e-8))
    unclipped = (sgn * d <= sgn * dc) | (sgn == 0)
    grad_tok = (-abar * ratio)[:, None] * mask * unclipped * (sgn != 0) / (n + 1e-8)[:, None]
    if isw is not None:
        grad_tok = grad_tok * np.exp((np.log(isw + 1e-10) * mask).sum(-1) / (n + 1e-8))[:, None]
    clipped = d != dc
    return seq, grad_tok, np_mm(clipped * (adv > 0), mask), np_mm(clipped * (adv < 0), mask), np_mm(-d, mask)


def test_geo_mean_matches_numpy_with_sequence_level_advantages():
    old, lp, adv, mask = batch(2, spread=0.5)
    adv = np.repeat(adv[:, :1], adv.shape[1], 1)  # sequence-level advantages (GRPO), as the paper
    rng = np.random.default_rng(3)
    isw = rng.uniform(0.5, 1.5, size=adv.shape).astype(np.float32)
    kw = dict(loss_mode="geo_mean", clip_ratio_low=0.2, clip_ratio_high=0.28)
    loss, m, grad = value_and_grad(old, lp, adv, mask, loss_agg_mode="token-mean", **kw)
    seq, gtok, cf, cfl, kl = np_geo_mean(old, lp, adv, mask, 0.2, 0.28)
    b = adv.shape[0]
    close(loss, seq.mean())  # verl: torch.mean over the (all non-empty) rows
    close(grad, gtok / b)
    close(m["pg_clipfrac"], cf)
    close(m["pg_clipfrac_lower"], cfl)
    close(m["ppo_kl"], kl)
    assert 0 < cf + cfl < 1  # some tokens are clipped, not all
    fn = lambda x: loss_jit(old, x, adv, mask, rollout_is_weights=isw, **kw)[0]
    loss_w, grad_w = jax.value_and_grad(fn)(jnp.asarray(lp))
    seq_w, gtok_w, *_ = np_geo_mean(old, lp, adv, mask, 0.2, 0.28, isw)
    close(loss_w, seq_w.mean())
    close(grad_w, gtok_w / b)


def test_geo_mean_counts_sequences_globally_across_micro_batches():
    old, lp, adv, mask = batch(4, b=6, empty_row=2)
    kw = dict(loss_mode="geo_mean", clip_ratio_low=0.3, clip_ratio_high=0.3)
    full, _, _ = value_and_grad(old, lp, adv, mask, **kw)
    seq, *_ = np_geo_mean(old, lp, adv, mask, 0.3, 0.3)
    close(full, seq[mask.sum(-1) > 0].mean())  # the empty row is not counted (verl's torch.mean would)
    counts = ca.global_batch_info(mask)
    parts = [
        value_and_grad(old[s], lp[s], adv[s], mask[s], global_batch_size=counts["global_batch_size"], **kw)[0]
        for s in (slice(0, 3), slice(3, 6))
    ]
    close(sum(parts), full, rtol=1e-5)


# ------------------------------------------------------------------------------------------ dppo
def np_dppo(old, lp, adv, mask, low, high, c, kind):
    d = np.clip(lp.astype(np.float64) - old, -20, 20)
    r = np.exp(d)
    p, po = np.exp(lp.astype(np.float64)), np.exp(old.astype(np.float64))
    if kind == "tv":
        pos, neg = p - po <= high, p - po >= -low
    else:
        bkl = po * (old - lp) + (1 - po) * np.log((1 - po + 1e-8) / (1 - p + 1e-8))
        pos, neg = (bkl <= high) | (p <= po), (bkl <= low) | (p >= po)
    keep = np.where(adv > 0, pos, neg).astype(np.float64)
    tr = np.minimum(r, c)
    loss = -adv * tr * lp * keep
    grad = -adv * tr * keep * mask / mask.sum()
    return loss, grad, keep, r, d


@pytest.mark.parametrize("kind,low,high", [("tv", 0.1, 0.15), ("kl", 0.02, 0.03)])
def test_dppo_matches_numpy(kind, low, high):
    old, lp, adv, mask = batch(5, b=5, r=8, spread=0.6)
    kw = dict(loss_mode=f"dppo_{kind}", clip_ratio_low=low, clip_ratio_high=high, clip_ratio_c=1.5)
    loss, m, grad = value_and_grad(old, lp, adv, mask, **kw)
    ref, gref, keep, r, d = np_dppo(old, lp, adv, mask, low, high, 1.5, kind)
    close(loss, np_agg(ref, mask, "token-mean"))
    close(grad, gref)  # the kept tokens' gradient is -A min(rho, c) (a constant weight on grad logp)
    close(m["pg_clipfrac"], np_mm(1 - keep, mask))
    close(m["pg_clipfrac_lower"], np_mm((r > 1.5) * keep, mask))
    close(m["ppo_kl"], np_mm(-d, mask))
    assert 0 < m["pg_clipfrac"] < 1 and m["pg_clipfrac_lower"] > 0  # both branches exercised


# ------------------------------------------------------------------------------------------ clip_cov / kl_cov
def np_cov(adv, lp, mask, weighted=True):
    valid = mask > 0
    ma = np_mm(adv, mask) if weighted else adv[valid].mean()
    ml = np_mm(lp, mask) if weighted else lp[valid].mean()
    return (adv - ma) * (lp.astype(np.float64) - ml)


def test_clip_cov_cuts_the_candidates_and_keeps_the_rest():
    old, lp, adv, mask = batch(6, b=4, r=8, spread=0.5)
    params = (("clip_cov_ratio", 1.0), ("clip_cov_lb", 0.05), ("clip_cov_ub", 5.0))
    kw = dict(loss_mode="clip_cov", clip_ratio_low=0.2, clip_ratio_high=0.28, policy_loss_params=params)
    loss, m, grad = value_and_grad(old, lp, adv, mask, **kw)
    d = lp.astype(np.float64) - old
    r = np.exp(d)
    l1, l2 = -adv * r, -adv * np.clip(r, 0.8, 1.28)
    cov = np_cov(adv, lp, mask)
    cand = (mask > 0) & ~(l2 > l1) & (cov > 0.05) & (cov < 5.0)
    assert 2 <= cand.sum() < (mask > 0).sum()
    # ratio 1.0: the budget (all valid tokens) covers every candidate -> all cut, deterministically
    pg = np.where(cand, 0.0, np.maximum(l1, l2))
    close(loss, np_agg(pg, mask, "token-mean"))
    close(grad, np.where(cand | (l2 > l1), 0.0, -adv * r) * mask / mask.sum())
    close(m["pg_clipfrac"], np_mm(cand, mask))
    close(m["ppo_kl"], np_mm(-d, mask))
    # a budget of 1 token (verl's floor max(int(ratio * n), 1)): exactly one candidate cut, the same one on
    # every call with the same batch
    kw["policy_loss_params"] = (("clip_cov_ratio", 1e-4), ("clip_cov_lb", 0.05), ("clip_cov_ub", 5.0))
    _, m1, g1 = value_and_grad(old, lp, adv, mask, **kw)
    _, _, g2 = value_and_grad(old, lp, adv, mask, **kw)
    full = np.where(l2 > l1, 0.0, -adv * r) * mask / mask.sum()
    cut = (g1 == 0) & (full != 0)
    assert cut.sum() == 1 and cand[cut].all()
    np.testing.assert_array_equal(g1, g2)
    close(m1["pg_clipfrac"], 1 / mask.sum())
    with pytest.raises(ValueError, match="clip_cov_ratio"):
        ca.compute_policy_loss(old, lp, adv, mask, loss_mode="clip_cov", policy_loss_params={"clip_cov_ratio": 0.0})


def test_kl_cov_penalises_the_top_covariance_tokens():
    old, lp, adv, mask = batch(7, b=4, r=8, spread=0.5)
    params = (("kl_cov_ratio", 0.25), ("ppo_kl_coef", 0.3))
    kw = dict(loss_mode="kl_cov", clip_ratio_low=0.2, policy_loss_params=params)
    loss, m, grad = value_and_grad(old, lp, adv, mask, **kw)
    d = lp.astype(np.float64) - old
    r = np.exp(d)
    valid = mask > 0
    cov = np.where(valid, np_cov(adv, lp, mask, weighted=False), -np.inf)
    k = max(int(valid.sum() * 0.25), 1)
    top = np.zeros(cov.size, bool)
    top[np.argsort(-cov.reshape(-1), kind="stable")[:k]] = True
    top = top.reshape(cov.shape)
    assert top.sum() == k >= 2 and valid[top].all()
    pg = -adv * r + np.where(top, 0.3 * np.abs(d), 0.0)
    close(loss, np_agg(pg, mask, "token-mean"))
    close(grad, (-adv * r + np.where(top, 0.3 * np.sign(d), 0.0)) * mask / mask.sum())
    close(m["ppo_kl"], np_mm(np.abs(d), mask))  # verl reports mean |log ratio| for kl_cov
    assert m["pg_clipfrac"] == 0 and m["pg_clipfrac_lower"] == 0


@pytest.mark.parametrize("ratio,n", [(0.0002, 10000), (0.0002, 4999), (0.3, 10), (0.7, 10), (0.25, 3), (1.0, 7)])
def test_token_budget_is_verls_floor(ratio, n):
    assert int(token_budget(ratio, jnp.asarray(n), 20000)) == max(int(ratio * n), 1)


# ------------------------------------------------------------------------------------------ gspo override
def test_gspo_aggregates_seq_mean_token_mean_whatever_the_configured_mode():
    old, lp, adv, mask = batch(8, b=4, r=6, spread=0.3)
    adv = np.repeat(adv[:, :1], adv.shape[1], 1)
    kw = dict(loss_mode="gspo", clip_ratio_low=3e-4, clip_ratio_high=4e-4)
    n = mask.sum(-1)
    s = np.exp(((lp - old) * mask).sum(-1) / n)[:, None]
    per_tok = np.maximum(-adv * s, -adv * np.clip(s, 1 - 3e-4, 1 + 4e-4))
    want = np_agg(per_tok, mask, "seq-mean-token-mean")
    assert abs(want - np_agg(per_tok, mask, "token-mean")) > 1e-3  # the two modes differ on this batch
    for mode in ca.LOSS_AGG_MODES:
        close(value_and_grad(old, lp, adv, mask, loss_agg_mode=mode, **kw)[0], want)
    for mode in ("token-mean",):  # the function itself, called directly, aggregates the same way (as verl's)
        direct = ca.compute_policy_loss_gspo(
            old, lp, adv, mask, loss_agg_mode=mode, clip_ratio_low=3e-4, clip_ratio_high=4e-4
        )
        close(direct[0], want)
    assert ca.policy_loss_spec("gspo").loss_agg_mode == "seq-mean-token-mean"
    assert ca.policy_loss_spec("vanilla").loss_agg_mode is None
