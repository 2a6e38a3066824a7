"""The fused chunked LM head (`models/lm_head.py`) against a float64 numpy reference and against autodiff of
the unfused head (`logits = h @ W^T` then `functional.logprobs_and_entropy_from_logits`)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_post.algos import functional
from jaxrl_post.models.lm_head import head_token_stats

Q, D, V = 37, 16, 50


def _inputs(seed=0):
    k = jax.random.split(jax.random.key(seed), 5)
    h = jax.random.normal(k[0], (Q, D))
    w = jax.random.normal(k[1], (V, D)) * 0.5
    labels = jax.random.randint(k[2], (Q,), 0, V)
    return h, w, labels, jax.random.normal(k[3], (Q,)), jax.random.normal(k[4], (Q,))


def _np_stats(h, w, labels, temperature, softcap):
    logits = np.asarray(h, np.float64) @ np.asarray(w, np.float64).T
    if softcap is not None:
        logits = np.tanh(logits / softcap) * softcap
    z = logits / temperature
    lse = np.log(np.sum(np.exp(z - z.max(-1, keepdims=True)), -1)) + z.max(-1)
    p = np.exp(z - lse[:, None])
    return z[np.arange(len(labels)), np.asarray(labels)] - lse, lse - np.sum(p * z, -1)


@pytest.mark.parametrize("layout", ["vd", "dv"])
@pytest.mark.parametrize("softcap", [None, 3.0])
@pytest.mark.parametrize("n_valid", [Q, 20, 0])
@pytest.mark.slow
def test_values_and_grads_match_unfused_head(layout, softcap, n_valid):
    h, w, labels, g_lp, g_ent = _inputs()
    temperature = 0.7
    valid = np.arange(Q) < n_valid
    lp_np, ent_np = _np_stats(h, w, labels, temperature, softcap)
    wl = w if layout == "vd" else w.T

    def unfused(h, wl):
        logits = h @ (wl.T if layout == "vd" else wl)
        if softcap is not None:
            logits = jnp.tanh(logits / softcap) * softcap
        lp, ent = functional.logprobs_and_entropy_from_logits(logits[None], labels[None], temperature)
        lp, ent = jnp.where(valid, lp[0], 0.0), jnp.where(valid, ent[0], 0.0)
        return jnp.sum(lp * g_lp + ent * g_ent), (lp, ent)

    def fused(h, wl):
        lp, ent = head_token_stats(
            h, wl, labels, jnp.int32(n_valid), temperature=temperature, w_layout=layout, softcap=softcap, chunk=8,
            entropy="loss",
        )  # fmt: skip
        return jnp.sum(lp * g_lp + ent * g_ent), (lp, ent)

    (_, (lp_u, ent_u)), grads_u = jax.value_and_grad(unfused, (0, 1), has_aux=True)(h, wl)
    (_, (lp_f, ent_f)), grads_f = jax.jit(jax.value_and_grad(fused, (0, 1), has_aux=True))(h, wl)
    np.testing.assert_allclose(lp_f, np.where(valid, lp_np, 0.0), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(ent_f, np.where(valid, ent_np, 0.0), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(lp_f, lp_u, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(ent_f, ent_u, atol=3e-5)  # float32 cancellation at low entropy (either side)
    for gf, gu in zip(grads_f, grads_u):  # slots past n_valid get no gradient (here: zero cotangent)
        np.testing.assert_allclose(gf, gu, rtol=1e-4, atol=2e-5 * float(np.max(np.abs(gu)) + 1.0))
    if n_valid == 0:
        assert not np.any(np.asarray(grads_f[0]))


@pytest.mark.slow  # compiles of the fused head per mode (30 s on 2 shared, loaded cores)
def test_entropy_modes():
    h, w, labels, g_lp, g_ent = _inputs(1)

    def loss(h, mode):
        lp, ent = head_token_stats(h, w, labels, Q, chunk=16, entropy=mode)
        return jnp.sum(lp * g_lp) + (0.0 if ent is None else jnp.sum(ent * g_ent))

    assert head_token_stats(h, w, labels, Q, entropy="none")[1] is None
    g_metric = jax.grad(loss)(h, "metric")  # entropy reported, but not differentiated
    g_none = jax.grad(loss)(h, "none")
    g_loss = jax.grad(loss)(h, "loss")
    np.testing.assert_allclose(g_metric, g_none, rtol=1e-6, atol=1e-7)
    assert np.max(np.abs(np.asarray(g_loss) - np.asarray(g_none))) > 1e-3
    with pytest.raises(ValueError, match="entropy"):
        head_token_stats(h, w, labels, Q, entropy="yes")
    with pytest.raises(ValueError, match="w_layout"):
        head_token_stats(h, w, labels, Q, w_layout="x")


def test_bfloat16_compute_close_to_unfused_bfloat16():
    """bf16 h and W, float32 accumulation, as the unfused head; bf16 rounding of the backward's logit
    cotangent (cast to the compute dtype before its matmuls) bounds the difference at bf16 precision."""
    h, w, labels, g_lp, _ = _inputs(2)
    hb, wb = h.astype(jnp.bfloat16), w.astype(jnp.bfloat16)

    def unfused(h, w):
        logits = jnp.einsum("QD,VD->QV", h, w, preferred_element_type=jnp.float32)
        return jnp.sum(functional.logprobs_from_logits(logits[None], labels[None])[0] * g_lp)

    def fused(h, w):
        return jnp.sum(head_token_stats(h, w, labels, Q, chunk=8, entropy="none")[0] * g_lp)

    np.testing.assert_allclose(fused(hb, wb), unfused(hb, wb), rtol=1e-5)
    gu, gf = jax.grad(unfused, (0, 1))(hb, wb), jax.grad(fused, (0, 1))(hb, wb)
    for a, b in zip(gf, gu):
        assert a.dtype == jnp.bfloat16
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), rtol=2e-2, atol=2e-2)
