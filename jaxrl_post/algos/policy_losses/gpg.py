"""GPG (verl ``loss_mode=gpg``): plain policy gradient, no ratio."""

from __future__ import annotations

from jaxrl_post.algos.functional import _f32
from jaxrl_post.algos.policy_losses._common import finish
from jaxrl_post.algos.registry import register_policy_loss


@register_policy_loss("gpg")
def compute_policy_loss_gpg(
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
    """GPG: plain policy gradient ``L = -A * logp`` (no ratio, no clipping; metrics 0).

    Source: Chu et al. 2025 (https://arxiv.org/abs/2504.02546); verl ``compute_policy_loss_gpg``.
    """
    del old_log_prob, clip_ratio_low, clip_ratio_high, clip_ratio_c
    pg_losses = -_f32(log_prob) * _f32(advantages)
    return finish(pg_losses, response_mask, loss_agg_mode, rollout_is_weights, agg_kwargs, 0.0, 0.0, 0.0)
