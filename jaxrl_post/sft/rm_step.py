"""The reward-model trainer's jitted step: Bradley-Terry loss on preference pairs (TRL `RewardTrainer`).

Layout (`layout_pairs`): a step's B pairs as `n_micro` micro-batches of m pairs, `[n_micro, 2m, T] int32`
(`input_ids`, `attention_mask`; within a micro-batch rows 0..m-1 are `prompt + chosen`, rows m..2m-1 the
`prompt + rejected` of the same pairs, right-padded: `data.preference.collate_pairs`) and `margin`
`[n_micro, m] float32`. The reward of a sequence is the `RewardModel`'s score at its last real token.

Loss (TRL 1.16 `RewardTrainer.compute_loss`; Bradley & Terry 1952, Ouyang et al. 2022 eq. 1):

    loss = mean_i [ -log sigmoid(r_chosen_i - r_rejected_i - margin_i) ]
           + center_rewards_coefficient * mean_i [ (r_chosen_i + r_rejected_i)^2 ]     (Eisenstein et al. 2023)

The mean runs over the step's B pairs (micro-batches accumulate sums / B, so micro-batching does not change
the numbers). Metrics (TRL names): `loss`, `accuracy` = mean(r_chosen > r_rejected), `margin` =
mean(r_chosen - r_rejected), `min_reward` / `mean_reward` / `max_reward` over all 2B rewards, `grad_norm`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from jaxrl_post.data.preference import collate_pairs
from jaxrl_post.engine.update_core import apply_update, merge_model

RM_TOKEN_KEYS = ("input_ids", "attention_mask")
METRIC_KEYS = ("accuracy", "margin", "min_reward", "mean_reward", "max_reward")


def bradley_terry_loss(
    r_chosen: jax.Array, r_rejected: jax.Array, margin: jax.Array | None = None, center_coef: float | None = None
) -> jax.Array:
    """Per-pair loss `[B] float32`: `-log sigmoid(r_chosen - r_rejected - margin) + center_coef * (r_chosen +
    r_rejected)^2` (TRL `RewardTrainer`; its loss is the mean of this). r_chosen, r_rejected, margin: `[B]`."""
    d = r_chosen - r_rejected
    if margin is not None:
        d = d - margin
    loss = -jax.nn.log_sigmoid(d)
    if center_coef:
        loss = loss + center_coef * jnp.square(r_chosen + r_rejected)
    return loss


def layout_pairs(
    pairs: Sequence, *, n_micro: int, pairs_per_micro: int, row_len: int, pad_id: int = 0
) -> dict[str, np.ndarray]:
    """`n_micro * pairs_per_micro` `PreferencePair`s -> `input_ids`, `attention_mask` `[n_micro, 2m, T] int32`
    and `margin` `[n_micro, m] float32` (the pair's `margin`, 0 when it has none). Raises ValueError for the
    wrong number of pairs or a sequence longer than `row_len`."""

    m = int(pairs_per_micro)
    if len(pairs) != n_micro * m:
        raise ValueError(f"layout_pairs: got {len(pairs)} pairs for {n_micro} micro-batches of {m}")
    out = {k: np.zeros((n_micro, 2 * m, row_len), np.int32) for k in RM_TOKEN_KEYS}
    margin = np.zeros((n_micro, m), np.float32)
    for k in range(n_micro):
        chunk = pairs[k * m : (k + 1) * m]
        c = collate_pairs(chunk, max_length=row_len, pad_id=pad_id)
        for key in RM_TOKEN_KEYS:
            out[key][k] = c[key]
        margin[k] = [float(getattr(p, "margin", None) or 0.0) for p in chunk]
    out["margin"] = margin
    return out


def _micro_sums(model, ids, mask, margin, center_coef):
    """One micro-batch: (sum of per-pair losses, metric sums / extremes) for its m pairs."""
    r = model(ids, mask)  # [2m] float32
    m = margin.shape[0]
    rc, rr = r[:m], r[m:]
    loss = jnp.sum(bradley_terry_loss(rc, rr, margin, center_coef))
    stats = {
        "accuracy": jnp.sum((rc > rr).astype(jnp.float32)),
        "margin": jnp.sum(rc - rr),
        "reward_sum": jnp.sum(r),
        "min_reward": jnp.min(r),
        "max_reward": jnp.max(r),
    }
    return loss, stats


def _finish(loss_sum, stats, n_pairs):
    return loss_sum / n_pairs, {
        "accuracy": stats["accuracy"] / n_pairs,
        "margin": stats["margin"] / n_pairs,
        "mean_reward": stats["reward_sum"] / (2 * n_pairs),
        "min_reward": stats["min_reward"],
        "max_reward": stats["max_reward"],
    }


def _combine(a, b):
    return {
        k: (
            jnp.minimum(a[k], b[k])
            if k == "min_reward"
            else jnp.maximum(a[k], b[k])
            if k == "max_reward"
            else a[k] + b[k]
        )
        for k in a
    }


def make_rm_grads(graphdef: nnx.GraphDef, rest: nnx.State, *, center_coef: float | None) -> Callable:
    """Pure `fn(params, batch, frozen=None) -> (loss, metrics, grads)`: the step's mean loss, TRL's metrics and
    the gradient w.r.t. `params`, micro-batches accumulated with `lax.scan`."""

    def fn(params, batch, frozen=None):
        n_micro, two_m = batch["input_ids"].shape[:2]
        n_pairs = n_micro * (two_m // 2)

        def loss_fn(p, ids, mask, margin):
            loss, stats = _micro_sums(merge_model(graphdef, p, frozen, rest), ids, mask, margin, center_coef)
            return loss / n_pairs, stats

        grad_fn = jax.value_and_grad(loss_fn, has_aux=True)

        def body(carry, mb):
            grads, loss, stats = carry
            (l, st), g = grad_fn(params, mb["input_ids"], mb["attention_mask"], mb["margin"])
            return (jax.tree.map(jnp.add, grads, g), loss + l, _combine(stats, st)), None

        zero = jnp.zeros((), jnp.float32)
        stats0 = dict(accuracy=zero, margin=zero, reward_sum=zero, min_reward=zero + jnp.inf, max_reward=zero - jnp.inf)
        init = (jax.tree.map(jnp.zeros_like, params), zero, stats0)
        (grads, loss, stats), _ = jax.lax.scan(body, init, batch)
        _, metrics = _finish(loss * n_pairs, stats, n_pairs)
        return loss, metrics, grads

    return fn


def make_rm_update(
    graphdef: nnx.GraphDef,
    rest: nnx.State,
    tx: optax.GradientTransformation,
    *,
    center_coef: float | None = None,
    on_trace: Callable[[], None] | None = None,
) -> Callable:
    """Pure `fn(params, opt_state, batch, frozen=None) -> (params, opt_state, metrics)`: one optimizer step on
    a `layout_pairs` batch (wrap with `jax.jit`). A non-finite loss or gradient leaves params and optimizer
    state unchanged (`update_skipped` = 1). Metrics `[] float32`: loss, `METRIC_KEYS`, grad_norm (before
    clipping), update_skipped."""
    grads_fn = make_rm_grads(graphdef, rest, center_coef=center_coef)

    def fn(params, opt_state, batch, frozen=None):
        if on_trace is not None:
            on_trace()
        loss, metrics, grads = grads_fn(params, batch, frozen)
        return apply_update(tx, params, opt_state, grads, loss, dict(metrics, loss=loss))

    return fn


def make_rm_eval(
    graphdef: nnx.GraphDef,
    rest: nnx.State,
    *,
    center_coef: float | None = None,
    on_trace: Callable[[], None] | None = None,
) -> Callable:
    """Pure `fn(params, batch, frozen=None) -> (loss_sum, sums)`: the batch's summed per-pair loss and metric
    sums (`accuracy`, `margin`, `reward_sum`; `min_reward` / `max_reward` extremes), no gradient."""

    def fn(params, batch, frozen=None):
        if on_trace is not None:
            on_trace()
        model = merge_model(graphdef, params, frozen, rest)

        def one(mb):
            return _micro_sums(model, mb["input_ids"], mb["attention_mask"], mb["margin"], center_coef)

        losses, stats = jax.lax.map(one, batch)
        red = {
            k: (jnp.min(v) if k == "min_reward" else jnp.max(v) if k == "max_reward" else jnp.sum(v))
            for k, v in stats.items()
        }
        return jnp.sum(losses), red

    return fn
