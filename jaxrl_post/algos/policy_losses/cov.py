"""Clip-Cov and KL-Cov (verl ``loss_mode=clip_cov`` / ``kl_cov``): PPO variants that act on the few tokens
whose centred advantage x log-prob product (their contribution to the covariance that drives the entropy
change) is largest, to keep the policy's entropy from collapsing.

Batch statistics: both losses compute the covariance means and the token budget ``k`` over the arrays they
are given, i.e. over one *micro-batch* (all of its rows, on every device: JAX arrays are global). verl does the
same per GPU micro-batch (``dp_actor`` calls the loss on each micro-batch of each rank). So unlike the other
losses, the selected tokens (not the aggregation, which uses the mini-batch counts) depend on how a
mini-batch is split into micro-batches, in ours as in verl.

Source: Cui et al. 2025, "The Entropy Mechanism of Reinforcement Learning for Reasoning Language Models"
(https://arxiv.org/abs/2505.22617); verl ``compute_policy_loss_clip_cov`` / ``compute_policy_loss_kl_cov``.
"""

from __future__ import annotations

from fractions import Fraction

import jax
import jax.numpy as jnp

from jaxrl_post.algos.functional import _F32, _f32, masked_mean
from jaxrl_post.algos.policy_losses._common import finish
from jaxrl_post.algos.registry import register_policy_loss


def _check_ratio(name: str, value) -> None:
    if isinstance(value, (int, float)) and not 0 < value <= 1:
        raise ValueError(f"actor.policy_loss.{name} must be in (0, 1], got {value}")


def token_budget(ratio: float, n_valid: jax.Array, size: int) -> jax.Array:
    """``max(floor(ratio * n_valid), 1)`` as int32, as verl's ``max(int(ratio * n), 1)``.

    ``ratio`` (static) is taken as the fraction p/q nearest to it (denominator <= 10^6, exact for decimal
    ratios such as 0.0002 = 1/5000) and the floor computed in integers, so a product that is an integer in
    exact arithmetic is not floored one too low by float32 rounding. ``size`` (static) bounds ``n_valid``.
    """
    frac = Fraction(ratio).limit_denominator(1_000_000)
    n = jnp.asarray(n_valid).astype(jnp.int32)
    if frac.numerator * size < 2**31:
        k = (n * frac.numerator) // frac.denominator
    else:  # cannot overflow-proof the integer product: float32
        k = jnp.floor(n.astype(_F32) * _F32(ratio)).astype(jnp.int32)
    return jnp.maximum(k, 1)


def _top_k(score: jax.Array, eligible: jax.Array, k: jax.Array) -> jax.Array:
    """Bool mask of the ``k`` (traced) eligible entries with the largest ``score`` (ties: lower flat index
    first, as a stable sort); fewer when fewer are eligible. Shapes ``[B, R]``."""
    flat = jnp.where(eligible, score, -jnp.inf).reshape(-1)
    order = jnp.argsort(-flat, stable=True)
    rank = jnp.zeros_like(order).at[order].set(jnp.arange(flat.size, dtype=order.dtype))
    return (rank.reshape(score.shape) < k) & eligible


def _data_key(old_log_prob: jax.Array, mask: jax.Array) -> jax.Array:
    """A PRNG key from the bits of ``sum(mask * old_log_prob)``: reproducible for a given batch, different
    from batch to batch (verl draws ``torch.randperm`` from the global torch RNG)."""
    total = jnp.sum(jnp.where(mask, jax.lax.stop_gradient(_f32(old_log_prob)), 0.0))
    return jax.random.fold_in(jax.random.PRNGKey(0), jax.lax.bitcast_convert_type(total, jnp.uint32))


@register_policy_loss("clip_cov", params=("clip_cov_ratio", "clip_cov_lb", "clip_cov_ub"))
def compute_policy_loss_clip_cov(
    old_log_prob,
    log_prob,
    advantages,
    response_mask,
    *,
    clip_ratio_low=0.2,
    clip_ratio_high=0.2,
    clip_ratio_c=3.0,
    loss_agg_mode="token-mean",
    rollout_is_weights=None,
    clip_cov_ratio=0.0002,
    clip_cov_lb=1.0,
    clip_cov_ub=5.0,
    **agg_kwargs,
):
    """Clip-Cov: PPO clipped surrogate with the gradient of a few random high-covariance tokens cut.

    ``rho = exp(logp - logp_old)`` (no clamp, as verl); ``L1 = -A rho``, ``L2 = -A clip(rho, 1 - eps_low,
    1 + eps_high)``; ``cov = (A - mean_m A) (logp - mean_m logp)`` (masked means over the micro-batch).
    Candidates: valid tokens not already clipped (``L2 <= L1``) with ``clip_cov_lb < cov < clip_cov_ub``; of
    them ``min(#candidates, max(floor(clip_cov_ratio * sum(mask)), 1))`` are picked uniformly at random
    (key from the batch's bits, see :func:`_data_key`) and get ``L = 0``; the others ``L = max(L1, L2)``.
    No dual clip (``clip_ratio_c`` unused). Metrics: ``pg_clipfrac`` = fraction of valid tokens cut (verl's
    meaning for this loss), ``pg_clipfrac_lower`` = 0 (verl does not report it), ``ppo_kl = mean_m[-log rho]``.

    Args: ``[B, R]`` float32 log-probs/advantages, ``response_mask`` ``[B, R]`` 0/1; ``clip_cov_ratio`` in
    (0, 1] (static), ``clip_cov_lb`` / ``clip_cov_ub`` scalars (config ``actor.policy_loss.*``); the rest as
    :func:`jaxrl_post.algos.policy_losses.compute_policy_loss`. Raises ValueError for ``clip_cov_ratio`` outside (0, 1].
    Source: Cui et al. 2025 (https://arxiv.org/abs/2505.22617); verl ``compute_policy_loss_clip_cov``.
    """
    del clip_ratio_c
    _check_ratio("clip_cov_ratio", clip_cov_ratio)
    adv, lp = _f32(advantages), _f32(log_prob)
    valid = jnp.asarray(response_mask) != 0
    neg_kl = lp - _f32(old_log_prob)
    ratio = jnp.exp(neg_kl)
    loss1 = -adv * ratio
    loss2 = -adv * jnp.clip(ratio, 1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
    sg_lp = jax.lax.stop_gradient(lp)
    cov = (adv - masked_mean(adv, response_mask)) * (sg_lp - masked_mean(sg_lp, response_mask))
    candidate = valid & ~(loss2 > loss1) & (cov > clip_cov_lb) & (cov < clip_cov_ub)
    k = token_budget(clip_cov_ratio, jnp.sum(valid), valid.size)
    priority = jax.random.uniform(_data_key(old_log_prob, valid), adv.shape)
    cut = jax.lax.stop_gradient(_top_k(priority, candidate, k))
    pg_losses = jnp.where(cut, 0.0, jnp.maximum(loss1, loss2))
    clipfrac = masked_mean(cut.astype(_F32), response_mask)
    return finish(
        pg_losses,
        response_mask,
        loss_agg_mode,
        rollout_is_weights,
        agg_kwargs,
        clipfrac,
        0.0,
        masked_mean(-neg_kl, response_mask),
    )


@register_policy_loss("kl_cov", params=("kl_cov_ratio", "ppo_kl_coef"))
def compute_policy_loss_kl_cov(
    old_log_prob,
    log_prob,
    advantages,
    response_mask,
    *,
    clip_ratio_low=0.2,
    clip_ratio_high=0.2,
    clip_ratio_c=3.0,
    loss_agg_mode="token-mean",
    rollout_is_weights=None,
    kl_cov_ratio=0.0002,
    ppo_kl_coef=0.1,
    **agg_kwargs,
):
    """KL-Cov: unclipped policy gradient, plus a ``|log rho|`` penalty on the highest-covariance tokens.

    ``rho = exp(logp - logp_old)`` (no clamp); ``cov = (A - mean A) (logp - mean logp)`` with plain means over
    the valid tokens of the micro-batch; the ``max(floor(kl_cov_ratio * n_valid), 1)`` valid tokens with the
    largest ``cov`` (ties: first in row-major order) get ``L = -A rho + ppo_kl_coef |log rho|``, the others
    ``L = -A rho``. The clip ratios are unused. Metrics: ``ppo_kl = mean_m |log rho|`` (verl's meaning for this
    loss); ``pg_clipfrac`` = ``pg_clipfrac_lower`` = 0 (verl does not report them).

    Args: as :func:`compute_policy_loss_clip_cov`; ``kl_cov_ratio`` in (0, 1] (static), ``ppo_kl_coef``
    scalar (config ``actor.policy_loss.*``). Raises ValueError for ``kl_cov_ratio`` outside (0, 1].
    Source: Cui et al. 2025 (https://arxiv.org/abs/2505.22617); verl ``compute_policy_loss_kl_cov``.
    """
    del clip_ratio_low, clip_ratio_high, clip_ratio_c
    _check_ratio("kl_cov_ratio", kl_cov_ratio)
    adv, lp = _f32(advantages), _f32(log_prob)
    valid = jnp.asarray(response_mask) != 0
    neg_kl = lp - _f32(old_log_prob)
    abs_kl = jnp.abs(neg_kl)
    loss = -adv * jnp.exp(neg_kl)
    sg_lp = jax.lax.stop_gradient(lp)
    cov = (adv - masked_mean(adv, valid)) * (sg_lp - masked_mean(sg_lp, valid))
    k = token_budget(kl_cov_ratio, jnp.sum(valid), valid.size)
    chosen = jax.lax.stop_gradient(_top_k(cov, valid, k))
    pg_losses = jnp.where(chosen, loss + ppo_kl_coef * abs_kl, loss)
    return finish(
        pg_losses,
        response_mask,
        loss_agg_mode,
        rollout_is_weights,
        agg_kwargs,
        0.0,
        0.0,
        masked_mean(abs_kl, response_mask),
    )
