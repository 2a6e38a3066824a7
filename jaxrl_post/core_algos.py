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

Advantage estimators live in :mod:`jaxrl_post.advantages`, masked statistics and log-prob/entropy in
:mod:`jaxrl_post.functional`, KL estimators/controllers in :mod:`jaxrl_post.kl`, DAPO's overlong reward
shaping in :mod:`jaxrl_post.reward_shaping`; all are re-exported here, so ``from jaxrl_post.core_algos
import ...`` covers it all.
Names follow verl (``verl/trainer/ppo/core_algos.py``, ``verl/utils/torch_functional.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from jaxrl_post.advantages import (
    ADV_ESTIMATORS,
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
    get_adv_estimator,
)
from jaxrl_post.functional import (
    _F32,
    _f32,
    _nonzero,
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
from jaxrl_post.kl import (
    KL_PENALTIES,
    AdaptiveKLController,
    FixedKLController,
    apply_kl_penalty,
    get_kl_controller,
    kl_full,
    kl_penalty,
)
from jaxrl_post.reward_shaping import compute_overlong_penalty

# ----------------------------------------------------------------------------------------------------------
# Loss aggregation
# ----------------------------------------------------------------------------------------------------------

LOSS_AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")


def global_batch_info(loss_mask: jax.Array) -> dict[str, jax.Array]:
    """The ``agg_loss`` normalisers of a whole mini-batch: pass them to every micro-batch's loss.

    Returns ``{"global_batch_tokens": sum(mask), "global_batch_size": #rows with >= 1 valid token}``
    (float32 scalars) for a ``[B, R]`` mask. Source: verl ``global_batch_info`` (``batch_num_tokens``,
    ``global_batch_size``; no ``dp_size`` factor here because JAX arrays are global).
    """
    m = _f32(loss_mask)
    return {
        "global_batch_tokens": jnp.sum(m),
        "global_batch_size": jnp.sum((jnp.sum(m, axis=-1) > 0).astype(_F32)),
    }


def agg_loss(
    loss_mat: jax.Array,
    loss_mask: jax.Array,
    loss_agg_mode: str = "token-mean",
    *,
    global_batch_tokens: float | jax.Array | None = None,
    global_batch_size: float | jax.Array | None = None,
    loss_scale_factor: float | jax.Array | None = None,
) -> jax.Array:
    """Aggregate a ``[B, R]`` per-token loss into a scalar (float32).

    With ``S_i = sum_t m_it l_it`` and ``n_i = sum_t m_it``:
      * ``token-mean``:              ``sum_i S_i / N_tok``                      (N_tok = global_batch_tokens)
      * ``seq-mean-token-sum``:      ``sum_i S_i / N_seq``                      (N_seq = global_batch_size)
      * ``seq-mean-token-mean``:     ``sum_i (S_i / n_i) / N_seq``
      * ``seq-mean-token-sum-norm``: ``sum_i (S_i / loss_scale_factor) / N_seq`` (Dr. GRPO; factor defaults to R)
    Defaults (``None``): ``N_tok = sum(mask)`` and ``N_seq`` = number of rows with at least one valid token
    (fully masked rows, e.g. batch padding, are not counted), both of *this* call's arrays. Every term is a
    sum over rows divided by a batch constant, so when a mini-batch is split into micro-batches and each call
    gets the mini-batch's counts (:func:`global_batch_info`), the micro-batch losses -- and their gradients --
    sum exactly to the un-split loss in every mode. Empty rows contribute 0.

    ``loss_agg_mode`` is static; the normalisers may be traced. Raises ValueError for an unknown mode.
    Source: verl ``core_algos.agg_loss`` (``batch_num_tokens``/``global_batch_size``/``loss_scale_factor``).
    """
    if loss_agg_mode not in LOSS_AGG_MODES:
        raise ValueError(f"Invalid loss_agg_mode {loss_agg_mode!r}; valid modes: {list(LOSS_AGG_MODES)}")
    m = _f32(loss_mask)  # 0/1 (fractional entries act as token weights, as in verl)
    if loss_agg_mode == "token-mean":
        n_tok = jnp.sum(m) if global_batch_tokens is None else _f32(global_batch_tokens)
        return masked_sum(loss_mat, m) / _nonzero(n_tok)
    seq_sum = masked_sum(loss_mat, m, axis=-1)
    n_i = jnp.sum(m, axis=-1)
    if loss_agg_mode == "seq-mean-token-sum":
        seq_loss = seq_sum
    elif loss_agg_mode == "seq-mean-token-mean":
        seq_loss = seq_sum / _nonzero(n_i)
    else:
        scale = m.shape[-1] if loss_scale_factor is None else loss_scale_factor
        seq_loss = seq_sum / _f32(scale)
    n_seq = jnp.sum((n_i > 0).astype(_F32)) if global_batch_size is None else _f32(global_batch_size)
    return jnp.sum(seq_loss) / _nonzero(n_seq)


# ----------------------------------------------------------------------------------------------------------
# Policy losses. Signature: (old_log_prob, log_prob, advantages, response_mask, *, clip_ratio_low,
# clip_ratio_high, clip_ratio_c, loss_agg_mode, rollout_is_weights, **agg_kwargs) -> (pg_loss, metrics)
# ----------------------------------------------------------------------------------------------------------


def _finish(pg_losses, response_mask, loss_agg_mode, rollout_is_weights, agg_kwargs, clipfrac, clipfrac_lower, ppo_kl):
    if rollout_is_weights is not None:
        pg_losses = pg_losses * _f32(rollout_is_weights)
    pg_loss = agg_loss(pg_losses, response_mask, loss_agg_mode, **agg_kwargs)
    metrics = {
        "pg_clipfrac": _f32(clipfrac),
        "pg_clipfrac_lower": _f32(clipfrac_lower),
        "ppo_kl": _f32(ppo_kl),
    }
    return pg_loss, metrics


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
    return _finish(
        pg_losses, response_mask, loss_agg_mode, rollout_is_weights, agg_kwargs, clipfrac, clipfrac_lower, ppo_kl
    )


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
    ``L = max(-A s_it, -A clip(s_it, 1 - eps_low, 1 + eps_high))``. ``clip_ratio_c`` unused. The paper
    aggregates with ``seq-mean-token-mean`` (set ``loss_agg_mode`` so). ``pg_clipfrac_lower`` = 0.
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
    return _finish(
        jnp.maximum(loss1, loss2),
        m,
        loss_agg_mode,
        rollout_is_weights,
        agg_kwargs,
        clipfrac,
        0.0,
        masked_mean(-neg_kl, m),
    )


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
    return _finish(pg_losses, response_mask, loss_agg_mode, rollout_is_weights, agg_kwargs, 0.0, 0.0, 0.0)


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
    return _finish(
        pg_losses,
        response_mask,
        loss_agg_mode,
        rollout_is_weights,
        agg_kwargs,
        clipfrac,
        0.0,
        masked_mean(-neg_kl, response_mask),
    )


POLICY_LOSSES: dict[str, Callable[..., tuple[jax.Array, dict[str, jax.Array]]]] = {
    "vanilla": compute_policy_loss_vanilla,
    "gspo": compute_policy_loss_gspo,
    "gpg": compute_policy_loss_gpg,
    "cispo": compute_policy_loss_cispo,
}


def get_policy_loss_fn(name: str) -> Callable[..., tuple[jax.Array, dict[str, jax.Array]]]:
    """Look up ``actor.policy_loss.loss_mode``. Raises ValueError listing the valid names.

    Source: verl ``get_policy_loss_fn``.
    """
    if name not in POLICY_LOSSES:
        raise ValueError(f"Unknown policy loss_mode {name!r}; valid modes: {sorted(POLICY_LOSSES)}")
    return POLICY_LOSSES[name]


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
    **agg_kwargs: Any,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Actor policy-gradient loss, dispatched on ``loss_mode`` (static) through :data:`POLICY_LOSSES`.

    Args:
      old_log_prob: ``[B, R] float32`` log-probs of the rollout (behaviour) policy, constants.
      log_prob: ``[B, R] float32`` log-probs of the current policy (differentiated).
      advantages: ``[B, R] float32``. response_mask: ``[B, R]`` 0/1.
      loss_mode: ``vanilla`` | ``gspo`` | ``gpg`` | ``cispo``.
      clip_ratio_low: eps_low (clip-higher).
      clip_ratio_high: eps_high (clip-higher). clip_ratio_c: dual-clip bound (> 1),
        applied only where the advantage is negative (vanilla).
      loss_agg_mode: static, see :func:`agg_loss`; ``agg_kwargs``: ``global_batch_tokens``,
        ``global_batch_size``, ``loss_scale_factor`` forwarded to :func:`agg_loss`.
      rollout_is_weights: optional ``[B, R]`` truncated-IS weights multiplied into the per-token loss.
    Returns:
      ``(pg_loss [] float32, {"pg_clipfrac", "pg_clipfrac_lower", "ppo_kl"} float32 scalars)``.
    Raises: ValueError for an unknown ``loss_mode``/``loss_agg_mode`` or ``clip_ratio_c <= 1``.
    Source: verl ``compute_policy_loss_*`` (registry ``get_policy_loss_fn``).
    """
    return get_policy_loss_fn(loss_mode)(
        old_log_prob,
        log_prob,
        advantages,
        response_mask,
        clip_ratio_low=clip_ratio_low,
        clip_ratio_high=clip_ratio_high,
        clip_ratio_c=clip_ratio_c,
        loss_agg_mode=loss_agg_mode,
        rollout_is_weights=rollout_is_weights,
        **agg_kwargs,
    )


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
    "get_adv_estimator",
    "compute_advantage",
    "LOSS_AGG_MODES",
    "global_batch_info",
    "agg_loss",
    "compute_policy_loss",
    "compute_policy_loss_vanilla",
    "compute_policy_loss_gspo",
    "compute_policy_loss_gpg",
    "compute_policy_loss_cispo",
    "POLICY_LOSSES",
    "get_policy_loss_fn",
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
