"""Logits processors, response mask and the token sampler (issue 4).

Expected values come from hand cases, a NumPy reference written here, and Hugging Face's logits warpers.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_post.rollout import sampling
from jaxrl_post.rollout.sampling import (
    SamplingParams,
    apply_min_p,
    apply_temperature,
    apply_top_k,
    apply_top_p,
    get_response_mask,
    sample_tokens,
)

_sample = jax.jit(sample_tokens, static_argnums=2)


def _kept(logits):
    return np.isfinite(np.asarray(logits))


# ---------------------------------------------------------------------------------- processors


def test_top_p_sorted_keeps_crossing_token():
    logits = jnp.log(jnp.array([[0.4, 0.3, 0.2, 0.1]]))
    np.testing.assert_array_equal(_kept(apply_top_p(logits, 0.8)), [[True, True, True, False]])
    # 0.4 alone does not reach 0.5 -> the crossing token (0.3) is kept too.
    np.testing.assert_array_equal(_kept(apply_top_p(logits, 0.5)), [[True, True, False, False]])
    np.testing.assert_array_equal(_kept(apply_top_p(logits, 0.1)), [[True, False, False, False]])
    np.testing.assert_array_equal(_kept(apply_top_p(logits, 1.0)), [[True] * 4])


def test_top_p_unsorted():
    logits = jnp.log(jnp.array([[0.1, 0.4, 0.2, 0.3]]))
    out = apply_top_p(logits, 0.8)
    np.testing.assert_array_equal(_kept(out), [[False, True, True, True]])
    # kept entries are unchanged
    np.testing.assert_allclose(np.asarray(out)[0, 1:], np.log([0.4, 0.2, 0.3]), rtol=1e-6)


def test_top_k_and_min_p_hand_cases():
    logits = jnp.array([[1.0, 5.0, 3.0, 4.0, 2.0]])
    np.testing.assert_array_equal(_kept(apply_top_k(logits, 2)), [[False, True, False, True, False]])
    np.testing.assert_array_equal(_kept(apply_top_k(logits, -1)), [[True] * 5])
    np.testing.assert_array_equal(_kept(apply_top_k(logits, 5)), [[True] * 5])
    probs = jnp.log(jnp.array([[0.5, 0.3, 0.15, 0.05]]))
    # threshold 0.2 * 0.5 = 0.1
    np.testing.assert_array_equal(_kept(apply_min_p(probs, 0.2)), [[True, True, True, False]])
    np.testing.assert_array_equal(_kept(apply_min_p(probs, 0.0)), [[True] * 4])
    np.testing.assert_allclose(apply_temperature(logits, 2.0), logits / 2.0)
    with pytest.raises(ValueError):
        apply_temperature(logits, 0.0)


def test_processors_match_transformers_warpers():
    torch = pytest.importorskip("torch")
    from transformers.generation import logits_process as lp

    rng = np.random.default_rng(0)
    logits = rng.normal(size=(6, 50)).astype(np.float32) * 3
    t = torch.from_numpy(logits)
    for k in (1, 5, 17):
        ours = _kept(apply_top_k(jnp.asarray(logits), k))
        theirs = np.isfinite(lp.TopKLogitsWarper(k)(None, t.clone()).numpy())
        np.testing.assert_array_equal(ours, theirs)
    for p in (0.05, 0.3, 0.75, 0.95):
        ours = _kept(apply_top_p(jnp.asarray(logits), p))
        theirs = np.isfinite(lp.TopPLogitsWarper(p)(None, t.clone()).numpy())
        np.testing.assert_array_equal(ours, theirs)
    for m in (0.01, 0.1, 0.5):
        ours = _kept(apply_min_p(jnp.asarray(logits), m))
        theirs = np.isfinite(lp.MinPLogitsWarper(m)(None, t.clone()).numpy())
        np.testing.assert_array_equal(ours, theirs)


# ---------------------------------------------------------------------------------- response mask


def test_response_mask_cases():
    eos = 2
    ids = jnp.array(
        [
            [5, 6, 2, 2, 2],  # pad == EOS: only the first EOS counts
            [2, 2, 2, 2, 2],  # EOS at the first step
            [5, 6, 7, 8, 9],  # no EOS
            [5, 2, 0, 0, 0],  # pad 0 != EOS
        ]
    )
    expect = [[1, 1, 1, 0, 0], [1, 0, 0, 0, 0], [1, 1, 1, 1, 1], [1, 1, 0, 0, 0]]
    np.testing.assert_array_equal(get_response_mask(ids, eos), expect)
    np.testing.assert_array_equal(get_response_mask(ids, (eos,)), expect)
    assert get_response_mask(ids, eos).dtype == jnp.int32
    # several EOS ids: 6 ends rows 0 and 2 early
    multi = get_response_mask(ids, (2, 6, 7))
    np.testing.assert_array_equal(multi, [[1, 1, 0, 0, 0], [1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 1, 0, 0, 0]])
    # no EOS ids -> all ones
    np.testing.assert_array_equal(get_response_mask(ids, ()), np.ones((4, 5)))


# ---------------------------------------------------------------------------------- sampler


def _np_filtered_probs(logits, temperature, top_k, top_p, min_p):
    """Independent NumPy reference of temperature -> top-k -> top-p -> min-p (HF warper semantics:
    each filter sees the distribution renormalized over the tokens that survived the previous one)."""
    x = logits.astype(np.float64) / temperature
    keep = np.ones_like(x, dtype=bool)
    if 0 < top_k < x.size:
        keep &= x >= np.sort(x)[::-1][top_k - 1]
    if top_p < 1.0:
        p = np.where(keep, np.exp(x - x.max()), 0.0)
        p /= p.sum()
        before, kp = 0.0, np.zeros_like(keep)
        for i in np.argsort(-p, kind="stable"):
            if p[i] == 0:
                break
            if before < top_p:
                kp[i] = True
            before += p[i]
        keep &= kp
    if min_p > 0:
        p = np.where(keep, np.exp(x - x.max()), 0.0)
        keep &= p >= min_p * p.max()
    p = np.where(keep, np.exp(x - x.max()), 0.0)
    return p / p.sum()


def _chi2_critical(dof, z=3.29):
    """Wilson-Hilferty upper quantile of chi-square (z=3.29 ~ alpha 5e-4)."""
    return dof * (1 - 2 / (9 * dof) + z * math.sqrt(2 / (9 * dof))) ** 3


@pytest.mark.parametrize(
    "temperature,top_k,top_p,min_p,cands",
    [
        (1.0, -1, 1.0, 0.0, 256),
        (0.7, 6, 1.0, 0.0, 256),
        (1.3, -1, 0.8, 0.0, 256),  # top-p via candidates (covered)
        (1.3, -1, 0.8, 0.0, 2),  # top-p falls back to the full sort (lax.cond)
        (1.0, 8, 0.9, 0.05, 256),
        (1.0, -1, 1.0, 0.08, 256),
    ],
)
def test_sample_frequencies_match_filtered_distribution(temperature, top_k, top_p, min_p, cands):
    rng = np.random.default_rng(1)
    logits = rng.normal(size=(12,)).astype(np.float32) * 1.5
    n = 20000
    params = SamplingParams(
        max_new_tokens=1,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        min_p=min_p,
        top_p_candidates=cands,
    )
    tokens, logp, _ = jax.jit(lambda l, k: sample_tokens(l, k, params))(
        jnp.broadcast_to(jnp.asarray(logits), (n, logits.size)), jax.random.key(123)
    )
    tokens = np.asarray(tokens)
    expected = _np_filtered_probs(logits, temperature, top_k, top_p, min_p)
    counts = np.bincount(tokens, minlength=logits.size)
    assert counts[expected == 0].sum() == 0, "sampled a filtered-out token"
    kept = expected > 0
    exp_counts = expected[kept] * n
    chi2 = float(((counts[kept] - exp_counts) ** 2 / exp_counts).sum())
    dof = int(kept.sum()) - 1
    if dof > 0:
        assert chi2 < _chi2_critical(dof), (chi2, dof, counts, exp_counts)
    # log-prob = tempered, unfiltered log-softmax of the sampled token
    ref_lp = jax.nn.log_softmax(jnp.asarray(logits) / temperature)
    np.testing.assert_allclose(np.asarray(logp), np.asarray(ref_lp)[tokens], atol=1e-6)


def test_sampler_reference_matches_public_filters():
    """filter_logits (public processors) and the NumPy reference agree on the kept set."""
    rng = np.random.default_rng(2)
    logits = rng.normal(size=(5, 40)).astype(np.float32) * 2
    params = SamplingParams(max_new_tokens=1, temperature=0.9, top_k=10, top_p=0.85, min_p=0.02)
    ours = np.asarray(jax.jit(lambda l: jax.nn.softmax(sampling.filter_logits(l, params)))(jnp.asarray(logits)))
    for r in range(5):
        np.testing.assert_allclose(ours[r], _np_filtered_probs(logits[r], 0.9, 10, 0.85, 0.02), atol=1e-6)


def test_greedy_and_reproducibility():
    rng = np.random.default_rng(3)
    logits = jnp.asarray(rng.normal(size=(8, 30)).astype(np.float32))
    greedy = SamplingParams(max_new_tokens=1, do_sample=False)
    tok, lp, th = _sample(logits, jax.random.key(0), greedy)
    assert np.all(np.asarray(th) == -np.inf)  # greedy truncates nothing
    np.testing.assert_array_equal(tok, np.argmax(np.asarray(logits), -1))
    np.testing.assert_allclose(lp, np.asarray(jax.nn.log_softmax(logits))[np.arange(8), np.asarray(tok)], atol=1e-6)
    tok0, _, _ = _sample(logits, jax.random.key(0), SamplingParams(max_new_tokens=1, temperature=0.0))
    np.testing.assert_array_equal(tok0, tok)

    p = SamplingParams(max_new_tokens=1, temperature=1.0, top_p=0.9)
    a, _, _ = _sample(logits, jax.random.key(7), p)
    b, _, _ = _sample(logits, jax.random.key(7), p)
    c, _, _ = _sample(logits, jax.random.key(8), p)
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, c)
    # a row's sample does not depend on the batch size (per-row keys)
    half, _, _ = _sample(logits[:4], jax.random.key(7), p)
    np.testing.assert_array_equal(half, a[:4])


def test_sampling_params_validation():
    with pytest.raises(ValueError):
        SamplingParams(max_new_tokens=0)
    with pytest.raises(ValueError):
        SamplingParams(max_new_tokens=4, top_p=0.0)
    with pytest.raises(ValueError):
        SamplingParams(max_new_tokens=4, temperature=-1.0)
    assert SamplingParams(max_new_tokens=4, eos_token_ids=3).eos_token_ids == (3,)
    assert SamplingParams(max_new_tokens=4, eos_token_ids=[1, 2]).eos_token_ids == (1, 2)
    assert SamplingParams(max_new_tokens=4, do_sample=False).greedy


# ---------------------------------------------------------------------------------- sampler internals


@pytest.mark.parametrize("c", [7, 256, 1000, 49152 // 64])
def test_inverse_cdf_maps_uniform_grid_to_weights(c):
    """A fine grid of u values lands on index j with frequency w_j / sum(w) (to the grid resolution), and
    zero-weight entries (incl. the first/last) are never returned, even for u = 0 and u -> 1."""
    rng = np.random.default_rng(c)
    w = rng.random((2, c)).astype(np.float32) ** 3
    w[:, rng.random(c) < 0.4] = 0.0
    w[:, 0] = 0.0
    w[:, -1] = 0.0
    n = 20000
    u = np.concatenate([(np.arange(n) + 0.5) / n, [0.0, np.nextafter(np.float32(1), np.float32(0))]])
    f = jax.jit(jax.vmap(lambda ww, uu: sampling.sample_from_weights(ww[None], uu[None])[0], in_axes=(None, 0)))
    for r in range(2):
        idx = np.asarray(f(jnp.asarray(w[r]), jnp.asarray(u, jnp.float32)))
        assert np.all(w[r][idx] > 0)
        freq = np.bincount(idx[:n], minlength=c) / n
        np.testing.assert_allclose(freq, w[r] / w[r].sum(), atol=2.0 / n)


def test_top_p_bisection_matches_sort():
    rng = np.random.default_rng(5)
    logits = jnp.asarray(rng.normal(size=(4, 3000)).astype(np.float32) * 2)
    probs = jax.nn.softmax(logits)
    for p in (0.05, 0.5, 0.9, 0.99):
        ours = np.asarray(jax.jit(sampling._top_p_mask_bisect, static_argnums=1)(probs, p))
        np.testing.assert_array_equal(ours, _kept(apply_top_p(logits, p)))


def test_argmax_last_first_index_on_ties():
    x = jnp.array([[1.0, 3.0, 3.0, 2.0], [-1.0, -1.0, -2.0, -5.0], [0.0, 0.0, 0.0, 9.0]])
    np.testing.assert_array_equal(sampling.argmax_last(x), [1, 0, 3])
    y = jnp.asarray(np.random.default_rng(0).normal(size=(5, 77)).astype(np.float32))
    np.testing.assert_array_equal(sampling.argmax_last(y), np.argmax(np.asarray(y), -1))


@pytest.mark.parametrize(
    "temperature,top_k,top_p,min_p,cands",
    [(0.8, -1, 0.7, 0.0, 4), (1.3, 5, 0.9, 0.0, 256), (1.0, -1, 1.0, 0.08, 256), (1.0, -1, 1.0, 0.0, 256)],
)
def test_sampling_threshold_and_truncated_log_probs(temperature, top_k, top_p, min_p, cands):
    """The returned threshold is the smallest kept tempered logit of the NumPy reference's kept set; the
    truncated log-prob (sampler and `truncated_logprobs_from_logits` replaying that threshold) is the log of
    the reference's renormalized probability; with no truncation the threshold is -inf."""
    from jaxrl_post.algos.core_algos import truncated_logprobs_from_logits

    rng = np.random.default_rng(4)
    logits = (rng.normal(size=(6, 40)) * 2.0).astype(np.float32)
    kw = dict(max_new_tokens=1, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, top_p_candidates=cands)
    tok, lp, th = jax.jit(lambda x, k: sample_tokens(x, k, SamplingParams(**kw, truncated_log_probs=True)))(
        jnp.asarray(logits), jax.random.key(0)
    )
    tok_full, lp_full, th_full = jax.jit(lambda x, k: sample_tokens(x, k, SamplingParams(**kw)))(
        jnp.asarray(logits), jax.random.key(0)
    )
    np.testing.assert_array_equal(tok, tok_full)  # the flag changes the reported log-prob only
    np.testing.assert_array_equal(th, th_full)
    tok, lp, th = np.asarray(tok), np.asarray(lp), np.asarray(th)
    replay = np.asarray(
        truncated_logprobs_from_logits(
            jnp.asarray(logits)[:, None], jnp.asarray(tok)[:, None], jnp.asarray(th)[:, None], temperature
        )
    )[:, 0]
    for b in range(logits.shape[0]):
        expected = _np_filtered_probs(logits[b], temperature, top_k, top_p, min_p)
        kept = expected > 0
        z = logits[b].astype(np.float64) / temperature
        if kept.all():
            assert th[b] == -np.inf
        else:
            assert th[b] == pytest.approx(z[kept].min(), rel=1e-6)
        assert lp[b] == pytest.approx(np.log(expected[tok[b]]), abs=2e-5)
        assert replay[b] == pytest.approx(np.log(expected[tok[b]]), abs=2e-5)
        full = z[tok[b]] - np.log(np.exp(z - z.max()).sum()) - z.max()
        assert float(lp_full[b]) == pytest.approx(full, abs=2e-5)
