"""SAPO (verl ``loss_mode=sapo``): a smooth sigmoid gate on the ratio instead of a hard clip."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxrl_post.algos.functional import _f32, masked_mean
from jaxrl_post.algos.policy_losses._common import finish
from jaxrl_post.algos.registry import register_policy_loss


@register_policy_loss("sapo", loss_agg_mode="seq-mean-token-mean", params=("tau_pos", "tau_neg"))
def compute_policy_loss_sapo(
    old_log_prob,
    log_prob,
    advantages,
    response_mask,
    *,
    clip_ratio_low=0.2,
    clip_ratio_high=0.2,
    clip_ratio_c=3.0,
    loss_agg_mode="seq-mean-token-mean",
    rollout_is_weights=None,
    tau_pos=1.0,
    tau_neg=1.05,
    **agg_kwargs,
):
    """Soft Adaptive Policy Optimization: ``L = -A * (4 / tau) * sigmoid(tau * (rho - 1))``.

    ``rho = exp(clip(logp - logp_old, -20, 20))``; ``tau = tau_pos`` where ``A > 0``, else ``tau_neg``. The
    gate's slope at ``rho = 1`` is 1 (the policy-gradient there), and decays smoothly away from it. Always
    aggregated ``seq-mean-token-mean`` (as verl; declared in the registration). The clip ratios are unused.
    Metrics: ``pg_clipfrac`` = ``pg_clipfrac_lower`` = 0 (no clipping), ``ppo_kl = mean_m[-log rho]``.

    Args: ``[B, R]`` float32 log-probs/advantages, ``response_mask`` ``[B, R]``; ``tau_pos``, ``tau_neg`` > 0
    (config ``actor.policy_loss.tau_pos`` / ``tau_neg``; verl's ``actor.tau_pos`` / ``actor.tau_neg``).
    Source: Gao et al. 2025 (https://arxiv.org/abs/2511.20347); verl ``compute_policy_loss_sapo``.
    """
    del clip_ratio_low, clip_ratio_high, clip_ratio_c
    adv = _f32(advantages)
    neg_kl = jnp.clip(_f32(log_prob) - _f32(old_log_prob), -20.0, 20.0)
    tau = jnp.where(adv > 0, _f32(tau_pos), _f32(tau_neg))
    gate = jax.nn.sigmoid(tau * (jnp.exp(neg_kl) - 1.0)) * (4.0 / tau)
    return finish(
        -gate * adv,
        response_mask,
        loss_agg_mode,
        rollout_is_weights,
        agg_kwargs,
        0.0,
        0.0,
        masked_mean(-neg_kl, response_mask),
    )
