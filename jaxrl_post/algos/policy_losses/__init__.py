"""Policy losses: one module per loss family, each function registered with ``@register_policy_loss``.

Every module of this package is imported here (in name order), so a new loss is one new file
``jaxrl_post/algos/policy_losses/<name>.py`` with a decorated function, plus its test: the config check, the docs
generator and the trainer find it in the registry. Modules starting with ``_`` are helpers.

Signature of a loss: ``(old_log_prob, log_prob, advantages, response_mask, *, clip_ratio_low,
clip_ratio_high, clip_ratio_c, loss_agg_mode, rollout_is_weights, **params, **agg_kwargs) ->
(pg_loss [] float32, {"pg_clipfrac", "pg_clipfrac_lower", "ppo_kl"} float32 scalars)``; arrays ``[B, R]``,
aggregated with ``agg_loss`` and the mini-batch's counts (``agg_kwargs``) so micro-batches sum exactly.
Source: verl ``verl/trainer/ppo/core_algos.py`` (``compute_policy_loss_*``, ``POLICY_LOSS_REGISTRY``).
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Mapping
from typing import Any

import jax

from jaxrl_post.algos.registry import POLICY_LOSSES, get_policy_loss_fn, policy_loss_spec, register_policy_loss


def compute_policy_loss(
    old_log_prob: jax.Array,
    log_prob: jax.Array,
    advantages: jax.Array,
    response_mask: jax.Array,
    *,
    loss_mode: str = "vanilla",
    clip_ratio_low: float | jax.Array = 0.2,
    clip_ratio_high: float | jax.Array = 0.2,
    clip_ratio_c: float | jax.Array = 3.0,
    loss_agg_mode: str = "token-mean",
    rollout_is_weights: jax.Array | None = None,
    policy_loss_params: Mapping[str, Any] | None = None,
    **agg_kwargs: Any,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Actor policy-gradient loss, dispatched on ``loss_mode`` (static) through :data:`POLICY_LOSSES`.

    Args:
      old_log_prob: ``[B, R] float32`` log-probs of the rollout (behaviour) policy, constants.
      log_prob: ``[B, R] float32`` log-probs of the current policy (differentiated).
      advantages: ``[B, R] float32``. response_mask: ``[B, R]`` 0/1.
      loss_mode: a registered name (``registry.POLICY_LOSSES``: vanilla, gspo, gpg, cispo, clip_cov, kl_cov,
        geo_mean, sapo, dppo_tv, dppo_kl, ...).
      clip_ratio_low: eps_low (clip-higher; DPPO: the lower divergence threshold).
      clip_ratio_high: eps_high (clip-higher; DPPO: the upper divergence threshold).
      clip_ratio_c: dual-clip bound (> 1) where the advantage is negative (vanilla; DPPO: the IS-ratio cap).
      loss_agg_mode: static, see ``agg_loss``; a loss registered with its own ``loss_agg_mode`` (gspo, sapo,
        geo_mean) uses that one instead. ``agg_kwargs``: ``global_batch_tokens``, ``global_batch_size``,
        ``loss_scale_factor`` forwarded to ``agg_loss``.
      rollout_is_weights: optional ``[B, R]`` truncated-IS weights multiplied into the per-token loss.
      policy_loss_params: ``actor.policy_loss.*`` hyper-parameters; the loss gets those it declared
        (``register_policy_loss(params=...)``), its own defaults for the others.
    Returns:
      ``(pg_loss [] float32, {"pg_clipfrac", "pg_clipfrac_lower", "ppo_kl"} float32 scalars)``.
    Raises: ValueError for an unknown ``loss_mode``/``loss_agg_mode``, ``clip_ratio_c <= 1`` (vanilla) or a
      hyper-parameter out of range.
    Source: verl ``compute_policy_loss_*`` (registry ``get_policy_loss_fn``).
    """
    fn = get_policy_loss_fn(loss_mode)
    params = {k: v for k, v in (policy_loss_params or {}).items() if k in policy_loss_spec(loss_mode).params}
    return fn(
        old_log_prob,
        log_prob,
        advantages,
        response_mask,
        clip_ratio_low=clip_ratio_low,
        clip_ratio_high=clip_ratio_high,
        clip_ratio_c=clip_ratio_c,
        loss_agg_mode=loss_agg_mode,
        rollout_is_weights=rollout_is_weights,
        **params,
        **agg_kwargs,
    )


for _module in pkgutil.iter_modules(__path__):
    if not _module.name.startswith("_"):
        importlib.import_module(f"{__name__}.{_module.name}")

from jaxrl_post.algos.policy_losses.cispo import compute_policy_loss_cispo  # noqa: E402
from jaxrl_post.algos.policy_losses.cov import compute_policy_loss_clip_cov, compute_policy_loss_kl_cov  # noqa: E402
from jaxrl_post.algos.policy_losses.dppo import compute_policy_loss_dppo_kl, compute_policy_loss_dppo_tv  # noqa: E402
from jaxrl_post.algos.policy_losses.gmpo import compute_policy_loss_geo_mean  # noqa: E402
from jaxrl_post.algos.policy_losses.gpg import compute_policy_loss_gpg  # noqa: E402
from jaxrl_post.algos.policy_losses.gspo import compute_policy_loss_gspo  # noqa: E402
from jaxrl_post.algos.policy_losses.ppo import compute_policy_loss_vanilla  # noqa: E402
from jaxrl_post.algos.policy_losses.sapo import compute_policy_loss_sapo  # noqa: E402

__all__ = [
    "POLICY_LOSSES",
    "register_policy_loss",
    "get_policy_loss_fn",
    "policy_loss_spec",
    "compute_policy_loss",
    "compute_policy_loss_vanilla",
    "compute_policy_loss_gspo",
    "compute_policy_loss_gpg",
    "compute_policy_loss_cispo",
    "compute_policy_loss_clip_cov",
    "compute_policy_loss_kl_cov",
    "compute_policy_loss_geo_mean",
    "compute_policy_loss_sapo",
    "compute_policy_loss_dppo_tv",
    "compute_policy_loss_dppo_kl",
]
