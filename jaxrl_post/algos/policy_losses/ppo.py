"""PPO clipped surrogate (verl ``loss_mode=vanilla``): clip-higher and dual-clip."""

from __future__ import annotations

import jax.numpy as jnp

from jaxrl_post.algos.functional import _F32, _f32, masked_mean
from jaxrl_post.algos.policy_losses._common import finish
from jaxrl_post.algos.registry import register_policy_loss


@register_policy_loss("vanilla")
def compute_policy_loss_vanilla(
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
    **agg_kwargs,
):
    """PPO clipped surrogate with clip-higher and dual-clip (see :func:`compute_policy_loss`).

    ``rho = exp(clip(logp - logp_old, -20, 20))``; ``L1 = max(-A rho, -A clip(rho, 1 - eps_low, 1 + eps_high))``;
    where ``A < 0``: ``L = min(L1, -A c)`` (dual clip, Ye et al. 2019, https://arxiv.org/abs/1912.09729), else
    ``L = L1``. Metrics: ``pg_clipfrac = mean_mask[-A clip(rho) > -A rho]``,
    ``pg_clipfrac_lower = mean_mask[(L1 > -A c) & (A < 0)]``, ``ppo_kl = mean_mask[logp_old - logp]``.
    Source: Schulman et al. 2017 (https://arxiv.org/abs/1707.06347), DAPO clip-higher; verl
    ``compute_policy_loss_vanilla``.
    """
    if isinstance(clip_ratio_c, (int, float)) and clip_ratio_c <= 1.0:
        raise ValueError(f"clip_ratio_c must be > 1.0 for dual-clip PPO, got {clip_ratio_c}")
    adv = _f32(advantages)
    neg_kl = jnp.clip(_f32(log_prob) - _f32(old_log_prob), -20.0, 20.0)
    ratio = jnp.exp(neg_kl)
    ppo_kl = masked_mean(-neg_kl, response_mask)
    loss1 = -adv * ratio
    loss2 = -adv * jnp.clip(ratio, 1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
    clipped1 = jnp.maximum(loss1, loss2)
    clipfrac = masked_mean((loss2 > loss1).astype(_F32), response_mask)
    loss3 = -adv * clip_ratio_c
    clipfrac_lower = masked_mean(((clipped1 > loss3) & (adv < 0)).astype(_F32), response_mask)
    pg_losses = jnp.where(adv < 0, jnp.minimum(loss3, clipped1), clipped1)
    return finish(
        pg_losses, response_mask, loss_agg_mode, rollout_is_weights, agg_kwargs, clipfrac, clipfrac_lower, ppo_kl
    )
