"""The one update core (`engine/update_core.py`): its shared helpers against hand-computed values, and both
layouts providing every `Layout` method (the padded / packed parity of the updates is in test_packing.py)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxrl_post.engine import packed_steps, steps, update_core


def test_n_used_counts_the_micro_batches_with_a_nonzero_entry():
    mask = np.zeros((4, 2, 3), np.int32)
    mask[0, 1, 2] = 1
    mask[1, 0, 0] = 7
    assert int(update_core.n_used(jnp.asarray(mask))) == 2
    assert int(update_core.n_used(jnp.asarray([[0, 1], [0, 0], [1, 1]]))) == 2  # counts, whatever the position


def test_sum_over_used_sums_only_the_first_n_and_traces_once():
    x = jnp.arange(12.0).reshape(4, 3)
    traces = []

    def value_at(i):
        traces.append(1)
        return {"a": x[i], "b": (2.0 * x[i, 0],)}

    out = jax.jit(lambda n: update_core.sum_over_used(value_at, n))(jnp.int32(3))
    np.testing.assert_array_equal(out["a"], [0 + 3 + 6, 1 + 4 + 7, 2 + 5 + 8])
    assert float(out["b"][0]) == 2.0 * (0 + 3 + 6)
    assert len(traces) == 1
    zero = jax.jit(lambda n: update_core.sum_over_used(value_at, n))(jnp.int32(0))
    np.testing.assert_array_equal(zero["a"], [0.0, 0.0, 0.0])


def test_apply_update_steps_or_leaves_everything_bitwise_unchanged():
    tx = optax.sgd(0.5)
    params = {"w": jnp.asarray([1.0, -0.0])}
    grads = {"w": jnp.asarray([2.0, 4.0])}
    p, _, m = update_core.apply_update(tx, params, tx.init(params), grads, jnp.float32(1.0), {"loss": 1.0})
    np.testing.assert_array_equal(p["w"], [0.0, -2.0])
    assert float(m["grad_norm"]) == np.float32(np.sqrt(20.0)) and float(m["update_skipped"]) == 0.0
    assert m["loss"] == 1.0
    p, _, m = update_core.apply_update(tx, params, tx.init(params), grads, jnp.float32(np.nan), {})
    assert np.signbit(np.asarray(p["w"]))[1] and float(p["w"][0]) == 1.0  # -0.0 stays -0.0
    assert float(m["update_skipped"]) == 1.0


def test_both_layouts_provide_every_layout_method():
    methods = [n for n in dir(update_core.Layout) if not n.startswith("_")]
    assert {"head", "log_probs", "gather_log_probs", "teacher_topk", "values", "forward", "accumulate"} <= set(methods)
    for layout in (steps.padded_layout(n_micro=2), packed_steps.PACKED):
        for name in methods:
            assert callable(getattr(layout, name)) or name == "name", (layout, name)
    assert {steps.padded_layout(n_micro=1).name, packed_steps.PACKED.name} == {"padded", "packed"}
