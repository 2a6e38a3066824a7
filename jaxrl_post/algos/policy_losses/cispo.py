"""CISPO (verl ``loss_mode=cispo``): clipped stop-gradient IS weight times REINFORCE."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxrl_post.algos.functional import _F32, _f32, masked_mean
from jaxrl_post.algos.policy_losses._common import finish
from jaxrl_post.algos.registry import register_policy_loss


@register_policy_loss("cispo")
def compute_policy_loss_cispo(
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
    """CISPO: clipped, stop-gradient IS weight times REINFORCE.

    ``rho = exp(clip(logp - logp_old, -20, 20))``; ``L = -sg(clip(rho, 1 - eps_low, 1 + eps_high)) * A * logp``
    (every token keeps a gradient). ``pg_clipfrac = mean_mask[rho != clip(rho)]``; ``pg_clipfrac_lower`` = 0.
    Source: MiniMax-M1 (https://arxiv.org/abs/2506.13585); verl ``compute_policy_loss_cispo``.
    """
    del clip_ratio_c
    lp = _f32(log_prob)
    neg_kl = jnp.clip(lp - _f32(old_log_prob), -20.0, 20.0)
    ratio = jnp.exp(neg_kl)
    clipped = jnp.clip(ratio, 1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
    pg_losses = -jax.lax.stop_gradient(clipped) * _f32(advantages) * lp
    clipfrac = masked_mean((ratio != clipped).astype(_F32), response_mask)
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
