"""Non-finite updates are skipped bit-exactly; the guard stops the run after too many in a row."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxrl_post.engine.nonfinite import NonFiniteError, NonFiniteGuard, apply_if_finite


def _setup():
    params = {"w": jnp.array([[-0.0, 1.5], [2.0, -3.0]]), "b": jnp.array([0.25, -0.0])}
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-2, weight_decay=0.1))
    opt = tx.init(params)
    # a first real step so the Adam moments are non-zero
    g0 = jax.tree.map(lambda p: jnp.ones_like(p) * 0.3, params)
    u, opt = tx.update(g0, opt, params)
    params = optax.apply_updates(params, u)
    params["w"] = params["w"].at[0, 0].set(-0.0)  # a negative zero must survive a skipped step
    return tx, params, opt


def _bits(tree):
    return [np.asarray(x).tobytes() for x in jax.tree.leaves(tree)]


@pytest.mark.parametrize("case", ["nan_grad", "inf_grad", "nan_loss"])
def test_skipped_update_is_bitwise_noop_under_jit_with_donation(case):
    tx, params, opt = _setup()
    grads = jax.tree.map(lambda p: jnp.full_like(p, 0.1), params)
    loss = jnp.float32(1.0)
    if case == "nan_grad":
        grads["b"] = grads["b"].at[1].set(jnp.nan)
    elif case == "inf_grad":
        grads["w"] = grads["w"].at[1, 1].set(jnp.inf)
    else:
        loss = jnp.float32(jnp.nan)
    want_p, want_o = _bits(params), _bits(opt)
    step = jax.jit(lambda p, o, g, l: apply_if_finite(tx, p, o, g, l), donate_argnums=(0, 1))
    new_p, new_o, gnorm, finite = step(params, opt, grads, loss)
    assert not bool(finite)
    assert _bits(new_p) == want_p and _bits(new_o) == want_o
    assert np.signbit(np.asarray(new_p["w"])[0, 0])
    if case != "nan_loss":
        assert not np.isfinite(float(gnorm))


def test_finite_update_matches_plain_optax():
    tx, params, opt = _setup()
    grads = jax.tree.map(lambda p: jnp.full_like(p, 0.1), params)
    new_p, new_o, gnorm, finite = apply_if_finite(tx, params, opt, grads, jnp.float32(2.0))
    u, ref_o = tx.update(grads, opt, params)
    ref_p = optax.apply_updates(params, u)
    assert bool(finite) and float(gnorm) == pytest.approx(0.1 * 6**0.5)  # 6 entries of 0.1
    for a, b in zip(jax.tree.leaves((new_p, new_o)), jax.tree.leaves((ref_p, ref_o))):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert _bits(new_p) != _bits(params)


def test_guard_counts_and_raises_after_max_consecutive():
    g = NonFiniteGuard(3, name="actor")
    assert g.observe([0.0, 1.0, 1.0], step=1) == {
        "actor/num_nonfinite_skipped": 2.0,
        "actor/nonfinite_skipped_total": 2.0,
    }
    assert g.consecutive == 2
    g.observe([0.0], step=2)  # a finite update resets the streak
    assert g.consecutive == 0 and g.total == 2
    g.observe([True, True], step=3)
    state = g.state_dict()
    g2 = NonFiniteGuard(3)
    g2.load_state_dict(state)  # resumes the streak
    with pytest.raises(NonFiniteError, match=r"3 consecutive actor .*step 4.*max_consecutive_nonfinite=3"):
        g2.observe([1.0], step=4)
    off = NonFiniteGuard(0)
    off.observe([1.0] * 100)
    assert off.total == 100
