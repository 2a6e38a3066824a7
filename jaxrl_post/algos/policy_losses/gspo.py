"""GSPO (verl ``loss_mode=gspo``): a sequence-level importance ratio, aggregated seq-mean-token-mean."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxrl_post.algos.functional import _F32, _f32, masked_mean, masked_sum
from jaxrl_post.algos.policy_losses._common import finish
from jaxrl_post.algos.registry import register_policy_loss


@register_policy_loss("gspo", loss_agg_mode="seq-mean-token-mean")
def compute_policy_loss_gspo(
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
    **agg_kwargs,
):
    """GSPO: sequence-level importance ratio ``s_i = exp(mean_t m (logp - logp_old))``.

    Token form ``s_it = sg(s_i) * pi / sg(pi)`` (value s_i, gradient s_i * grad log pi_t), log clamped at 10;
    ``L = max(-A s_it, -A clip(s_it, 1 - eps_low, 1 + eps_high))``. ``clip_ratio_c`` unused. Always
    aggregated ``seq-mean-token-mean``, whatever ``loss_agg_mode`` is passed (as verl: the registration
    declares it, so the registered function overrides the argument). ``pg_clipfrac_lower`` = 0.
    Source: Zheng et al. 2025 (https://arxiv.org/abs/2507.18071); verl ``compute_policy_loss_gspo``.
    """
    del clip_ratio_c
    adv, lp = _f32(advantages), _f32(log_prob)
    neg_kl = lp - _f32(old_log_prob)
    m = (jnp.asarray(response_mask) != 0).astype(_F32)
    seq_neg_kl = masked_sum(neg_kl, m, axis=-1) / jnp.maximum(jnp.sum(m, axis=-1), 1.0)
    log_ratio = lp - jax.lax.stop_gradient(lp) + jax.lax.stop_gradient(seq_neg_kl)[:, None]
    ratio = jnp.exp(jnp.minimum(log_ratio, 10.0))
    loss1 = -adv * ratio
    loss2 = -adv * jnp.clip(ratio, 1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
    clipfrac = masked_mean((loss2 > loss1).astype(_F32), m)
    return finish(
        jnp.maximum(loss1, loss2),
        m,
        loss_agg_mode,
        rollout_is_weights,
        agg_kwargs,
        clipfrac,
        0.0,
        masked_mean(-neg_kl, m),
    )
