"""GMPO (verl ``loss_mode=geo_mean``): the geometric mean of token ratios, one loss per sequence."""

from __future__ import annotations

import jax.numpy as jnp

from jaxrl_post.algos.functional import _F32, _f32, _nonzero, masked_mean, masked_sum
from jaxrl_post.algos.registry import register_policy_loss


@register_policy_loss("geo_mean", loss_agg_mode="seq-mean-token-mean")
def compute_policy_loss_geo_mean(
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
    global_batch_size=None,
    **agg_kwargs,
):
    """Geometric-Mean Policy Optimization: ``L_i = -Abar_i * exp(mean_t m d_it)``, averaged over sequences.

    ``d = logp - logp_old`` (no clamp); token-level clipping in log space, on the side the advantage's sign
    makes harmful: ``d' = sgn(A) min(sgn(A) d, sgn(A) clip(d, -eps_low, eps_high))``;
    ``ratio_i = exp(sum_t m d'_it / (n_i + 1e-8))``, ``Abar_i = sum_t m A_it / (n_i + 1e-8)`` (sequence
    advantage). With ``rollout_is_weights`` w: ``L_i *= exp(sum_t m log(w_it + 1e-10) / (n_i + 1e-8))``.
    ``pg_loss = sum_i L_i / N_seq``: each sequence counts once whatever ``loss_agg_mode`` says (registered
    with ``loss_agg_mode="seq-mean-token-mean"``, which its per-sequence mean is); ``N_seq`` =
    ``global_batch_size`` (rows with >= 1 valid token; default: this call's), so micro-batches sum exactly.
    verl takes ``torch.mean`` over the micro-batch's rows, fully masked rows (value 0) included in the count.
    ``clip_ratio_c`` unused. Metrics: ``pg_clipfrac = mean_m[d != clip(d) and A > 0]``,
    ``pg_clipfrac_lower = mean_m[d != clip(d) and A < 0]``, ``ppo_kl = mean_m[-d]``.

    Args: ``[B, R]`` float32 log-probs/advantages (sequence-level advantages, as the paper), ``response_mask``
    ``[B, R]``. Returns ``(pg_loss [] float32, metrics)``.
    Source: Zhao et al. 2025 (https://arxiv.org/abs/2507.20673); verl ``compute_policy_loss_geo_mean``.
    """
    del clip_ratio_c, loss_agg_mode, agg_kwargs
    adv, m = _f32(advantages), _f32(response_mask)
    valid = m != 0
    d = _f32(log_prob) - _f32(old_log_prob)
    sgn = jnp.sign(adv)
    d_clip = jnp.clip(d, -clip_ratio_low, clip_ratio_high)
    d_min = sgn * jnp.minimum(sgn * d, sgn * d_clip)
    n = jnp.sum(m, axis=-1)
    ratio = jnp.exp(masked_sum(d_min, m, axis=-1) / (n + 1e-8))
    seq_adv = masked_sum(adv, m, axis=-1) / (n + 1e-8)
    seq_loss = -seq_adv * ratio
    if rollout_is_weights is not None:
        log_w = jnp.log(_f32(rollout_is_weights) + 1e-10)
        seq_loss = seq_loss * jnp.exp(masked_sum(log_w, m, axis=-1) / (n + 1e-8))
    has_tokens = n > 0
    n_seq = jnp.sum(has_tokens.astype(_F32)) if global_batch_size is None else _f32(global_batch_size)
    pg_loss = jnp.sum(jnp.where(has_tokens, seq_loss, 0.0)) / _nonzero(n_seq)
    clipped = (d != d_clip) & valid
    metrics = {
        "pg_clipfrac": masked_mean((clipped & (adv > 0)).astype(_F32), m),
        "pg_clipfrac_lower": masked_mean((clipped & (adv < 0)).astype(_F32), m),
        "ppo_kl": masked_mean(-d, m),
    }
    return pg_loss, metrics
