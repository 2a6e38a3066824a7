"""DPPO (verl ``loss_mode=dppo_tv`` / ``dppo_kl``): a trust region on the divergence between the old and new
token distributions (a binary approximation) instead of on the ratio; the clip ratios are the divergence
thresholds and ``clip_ratio_c`` caps the (stop-gradient) IS ratio.

Source: "Rethinking the Trust Region in LLM Reinforcement Learning" (https://arxiv.org/abs/2602.04879);
verl ``compute_policy_loss_dppo_tv`` / ``compute_policy_loss_dppo_kl``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxrl_post.algos.functional import _F32, _f32, masked_mean
from jaxrl_post.algos.policy_losses._common import finish
from jaxrl_post.algos.registry import register_policy_loss


def _dppo(old_log_prob, log_prob, advantages, response_mask, in_region, clip_ratio_c, rollout_is_weights, mode, kw):
    """Shared body: ``L = -A * sg(min(rho, c)) * logp * keep`` with ``keep = in_region(p_old, p)`` per the
    advantage's sign (detached), ``rho = exp(clip(logp - logp_old, -20, 20))``."""
    adv, lp, old = _f32(advantages), _f32(log_prob), _f32(old_log_prob)
    neg_kl = jnp.clip(lp - old, -20.0, 20.0)
    ratio = jnp.exp(neg_kl)
    truncated = jax.lax.stop_gradient(jnp.minimum(ratio, clip_ratio_c))
    ok_pos, ok_neg = in_region(jnp.exp(old), jnp.exp(jax.lax.stop_gradient(lp)), old, jax.lax.stop_gradient(lp))
    keep = jnp.where(adv > 0, ok_pos, ok_neg).astype(_F32)
    return finish(
        -adv * truncated * lp * keep,
        response_mask,
        mode,
        rollout_is_weights,
        kw,
        masked_mean(1.0 - keep, response_mask),
        masked_mean((ratio > clip_ratio_c).astype(_F32) * keep, response_mask),
        masked_mean(-neg_kl, response_mask),
    )


@register_policy_loss("dppo_tv")
def compute_policy_loss_dppo_tv(
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
    """DPPO-Binary-TV: ``L = -A * sg(min(rho, c)) * logp`` on tokens inside the TV trust region, else 0.

    ``p = exp(logp)``, ``p_old = exp(logp_old)``; a token is kept when ``p - p_old <= eps_high`` (``A > 0``)
    or ``p - p_old >= -eps_low`` (``A <= 0``), with eps = ``clip_ratio_high`` / ``clip_ratio_low`` (here
    probability differences, not ratio bounds). ``rho = exp(clip(logp - logp_old, -20, 20))``, ``c`` =
    ``clip_ratio_c`` (truncated IS; verl reads the same key). Metrics: ``pg_clipfrac = mean_m[not kept]``,
    ``pg_clipfrac_lower = mean_m[kept and rho > c]``, ``ppo_kl = mean_m[-log rho]``.

    Args/returns as :func:`jaxrl_post.algos.policy_losses.compute_policy_loss`.
    Source: https://arxiv.org/abs/2602.04879; verl ``compute_policy_loss_dppo_tv``.
    """

    def in_region(p_old, p, lp_old, lp):
        return p - p_old <= clip_ratio_high, p - p_old >= -clip_ratio_low

    return _dppo(
        old_log_prob,
        log_prob,
        advantages,
        response_mask,
        in_region,
        clip_ratio_c,
        rollout_is_weights,
        loss_agg_mode,
        agg_kwargs,
    )


@register_policy_loss("dppo_kl")
def compute_policy_loss_dppo_kl(
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
    """DPPO-Binary-KL: as :func:`compute_policy_loss_dppo_tv` with the binary KL as the divergence.

    ``D = p_old (logp_old - logp) + (1 - p_old) log((1 - p_old + 1e-8) / (1 - p + 1e-8))`` (the KL between
    Bernoulli(p_old) and Bernoulli(p)); kept when ``D <= eps_high or p <= p_old`` (``A > 0``), or
    ``D <= eps_low or p >= p_old`` (``A <= 0``): only moves that raise the objective are bounded.
    Metrics as dppo_tv. Source: https://arxiv.org/abs/2602.04879; verl ``compute_policy_loss_dppo_kl``.
    """

    def in_region(p_old, p, lp_old, lp):
        d = p_old * (lp_old - lp) + (1.0 - p_old) * jnp.log((1.0 - p_old + 1e-8) / (1.0 - p + 1e-8))
        return (d <= clip_ratio_high) | (p <= p_old), (d <= clip_ratio_low) | (p >= p_old)

    return _dppo(
        old_log_prob,
        log_prob,
        advantages,
        response_mask,
        in_region,
        clip_ratio_c,
        rollout_is_weights,
        loss_agg_mode,
        agg_kwargs,
    )
