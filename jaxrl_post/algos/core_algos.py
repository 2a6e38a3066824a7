"""Pure RL math for LLM post-training: verl's ``core_algos`` as JAX array functions.

Arrays in, arrays out; no models, no configs. Every function is jit-compatible: string arguments
(``loss_agg_mode``, ``loss_mode``, ``kl_penalty``, estimator names) and Python bools (``unbiased``,
``shift_mean``, ``norm_adv_by_std_in_grpo``, ``calculate_entropy``) are *static*
(``functools.partial(jax.jit, static_argnames=...)``); numbers (``gamma``, ``lam``, ``epsilon``, clip ratios,
``temperature``, ``kl_coef``, ``global_batch_tokens`` ...) may be static or traced. Math is float32 whatever
the input dtype. Masks are 0/1 arrays of any dtype; statistics only use ``mask != 0`` entries, and values at
masked positions never leak into results (``jnp.where``, so even inf/NaN padding is harmless).

Shape letters: B batch (all responses, i.e. prompts x rollout.n), R response length, T sequence length,
V vocabulary. Group ids (``index``) are ``[B]`` integers in any order (verl's ``uid``); host-side callers may
also pass a numpy array of strings/objects (converted with ``np.unique``; not possible under jit).

Advantage estimators live in :mod:`jaxrl_post.algos.advantages`, policy losses in :mod:`jaxrl_post.algos.policy_losses`
(both registered by name with a declaration: :mod:`jaxrl_post.algos.registry`), ``agg_loss`` in
:mod:`jaxrl_post.algos.loss_agg`, masked statistics and log-prob/entropy in :mod:`jaxrl_post.algos.functional`, KL
estimators/controllers in :mod:`jaxrl_post.algos.kl`, DAPO's overlong reward shaping in
:mod:`jaxrl_post.algos.reward_shaping`; all are re-exported here, so ``from jaxrl_post.algos.core_algos import ...``
covers it all. This module itself holds the value loss.
Names follow verl (``verl/trainer/ppo/core_algos.py``, ``verl/utils/torch_functional.py``).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from jaxrl_post.algos.advantages import (
    compute_advantage,
    compute_gae_advantage_return,
    compute_gae_raw,
    compute_gpg_outcome_advantage,
    compute_grpo_outcome_advantage,
    compute_grpo_passk_outcome_advantage,
    compute_opo_outcome_advantage,
    compute_reinforce_plus_plus_baseline_outcome_advantage,
    compute_reinforce_plus_plus_outcome_advantage,
    compute_remax_outcome_advantage,
    compute_rloo_outcome_advantage,
)
from jaxrl_post.algos.functional import (
    _F32,
    _f32,
    compute_response_log_probs,
    entropy_from_logits,
    logprobs_and_entropy_from_logits,
    logprobs_from_logits,
    masked_mean,
    masked_sum,
    masked_var,
    masked_whiten,
    response_logits,
    truncated_logprobs_from_logits,
)
from jaxrl_post.algos.kl import (
    KL_PENALTIES,
    AdaptiveKLController,
    FixedKLController,
    apply_kl_penalty,
    get_kl_controller,
    kl_full,
    kl_penalty,
)
from jaxrl_post.algos.loss_agg import LOSS_AGG_MODES, agg_loss, global_batch_info
from jaxrl_post.algos.policy_losses import (
    compute_policy_loss,
    compute_policy_loss_cispo,
    compute_policy_loss_clip_cov,
    compute_policy_loss_dppo_kl,
    compute_policy_loss_dppo_tv,
    compute_policy_loss_geo_mean,
    compute_policy_loss_gpg,
    compute_policy_loss_gspo,
    compute_policy_loss_kl_cov,
    compute_policy_loss_sapo,
    compute_policy_loss_vanilla,
)
from jaxrl_post.algos.registry import (
    ADV_ESTIMATORS,
    POLICY_LOSSES,
    adv_estimator_needs,
    get_adv_estimator_fn,
    get_policy_loss_fn,
    policy_loss_spec,
    register_adv_est,
    register_policy_loss,
)
from jaxrl_post.algos.reward_shaping import compute_overlong_penalty

get_adv_estimator = get_adv_estimator_fn


def compute_value_loss(
    vpreds: jax.Array,
    returns: jax.Array,
    values: jax.Array,
    response_mask: jax.Array,
    cliprange_value: float | jax.Array,
    loss_agg_mode: str = "token-mean",
    **agg_kwargs: Any,
) -> tuple[jax.Array, jax.Array]:
    """Clipped value loss: ``0.5 * agg(max((v - G)^2, (clip(v, V_old - c, V_old + c) - G)^2))``.

    Args: ``vpreds`` ``[B, R]`` current critic values (differentiated); ``returns`` ``[B, R]`` targets;
    ``values`` ``[B, R]`` critic values stored at rollout time; ``response_mask`` ``[B, R]``;
    ``cliprange_value`` c; ``loss_agg_mode`` static (+ ``agg_kwargs`` as :func:`agg_loss`).
    Returns ``(vf_loss [] float32, vf_clipfrac [] float32)`` with ``vf_clipfrac = mean_mask[clipped > unclipped]``.
    Source: verl ``compute_value_loss`` (from TRL's PPO trainer).
    """
    v, ret, old = _f32(vpreds), _f32(returns), _f32(values)
    v_clipped = jnp.clip(v, old - cliprange_value, old + cliprange_value)
    loss1 = jnp.square(v - ret)
    loss2 = jnp.square(v_clipped - ret)
    vf_loss = 0.5 * agg_loss(jnp.maximum(loss1, loss2), response_mask, loss_agg_mode, **agg_kwargs)
    return vf_loss, masked_mean((loss2 > loss1).astype(_F32), response_mask)


__all__ = [
    "masked_sum",
    "masked_mean",
    "masked_var",
    "masked_whiten",
    "logprobs_from_logits",
    "truncated_logprobs_from_logits",
    "entropy_from_logits",
    "logprobs_and_entropy_from_logits",
    "response_logits",
    "compute_response_log_probs",
    "compute_gae_raw",
    "compute_gae_advantage_return",
    "compute_grpo_outcome_advantage",
    "compute_grpo_passk_outcome_advantage",
    "compute_rloo_outcome_advantage",
    "compute_reinforce_plus_plus_outcome_advantage",
    "compute_reinforce_plus_plus_baseline_outcome_advantage",
    "compute_remax_outcome_advantage",
    "compute_opo_outcome_advantage",
    "compute_gpg_outcome_advantage",
    "ADV_ESTIMATORS",
    "register_adv_est",
    "get_adv_estimator",
    "get_adv_estimator_fn",
    "adv_estimator_needs",
    "compute_advantage",
    "LOSS_AGG_MODES",
    "global_batch_info",
    "agg_loss",
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
    "POLICY_LOSSES",
    "register_policy_loss",
    "get_policy_loss_fn",
    "policy_loss_spec",
    "compute_value_loss",
    "KL_PENALTIES",
    "kl_penalty",
    "kl_full",
    "apply_kl_penalty",
    "FixedKLController",
    "AdaptiveKLController",
    "get_kl_controller",
    "compute_overlong_penalty",
]
