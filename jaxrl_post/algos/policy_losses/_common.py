"""Shared tail of the policy losses: IS weights, aggregation, the three verl metrics."""

from __future__ import annotations

import jax

from jaxrl_post.algos.functional import _f32
from jaxrl_post.algos.loss_agg import agg_loss


def finish(
    pg_losses, response_mask, loss_agg_mode, rollout_is_weights, agg_kwargs, clipfrac, clipfrac_lower, ppo_kl
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """``pg_losses [B, R]`` (times ``rollout_is_weights`` if given) aggregated with ``agg_loss``, and the
    metrics ``{"pg_clipfrac", "pg_clipfrac_lower", "ppo_kl"}`` as float32 scalars (verl's names)."""
    if rollout_is_weights is not None:
        pg_losses = pg_losses * _f32(rollout_is_weights)
    pg_loss = agg_loss(pg_losses, response_mask, loss_agg_mode, **agg_kwargs)
    metrics = {
        "pg_clipfrac": _f32(clipfrac),
        "pg_clipfrac_lower": _f32(clipfrac_lower),
        "ppo_kl": _f32(ppo_kl),
    }
    return pg_loss, metrics
