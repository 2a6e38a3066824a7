"""The `adv` stage of an RL step as one jitted program: the KL penalty in the reward (verl `apply_kl_penalty`)
then the configured advantage estimator (`algorithm.adv_estimator`, `registry`), on the host batch's arrays."""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from jaxrl_post.algos import core_algos
from jaxrl_post.engine.placement import Placement


def make_advantage_fn(
    *,
    adv_estimator: str,
    gamma: float,
    lam: float,
    norm_adv_by_std_in_grpo: bool,
    use_kl_in_reward: bool,
    kl_penalty: str,
    on_trace: Callable[[], None] | None = None,
) -> Callable:
    """Pure `fn(scores, loss_mask, index, kl_coef, old_log_probs, ref_log_prob, values, baselines)
    -> (token_level_rewards, current_kl, advantages, returns)`; wrap with `jax.jit` (one small program
    instead of dozens of eagerly dispatched ops per step).

    scores `[B, R] float32` (token-level scores), loss_mask `[B, R]` (the model's own tokens: advantages,
    returns and the KL penalty live only there; verl's agent-loop `response_mask`), index `[B] int32` group ids
    (prompt uid), kl_coef `[] float32` (traced: an adaptive controller does not recompile),
    old/ref log-probs `[B, R]` (used only with `use_kl_in_reward`), values `[B, R]` or None, baselines `[B]`
    or None (each passed on only when the estimator declares it: `registry.adv_estimator_needs`).
    KL only on response tokens (verl `apply_kl_penalty`).
    """

    def fn(scores, loss_mask, index, kl_coef, old_log_probs, ref_log_prob, values, baselines):
        if on_trace is not None:
            on_trace()
        if use_kl_in_reward:
            rewards, kl = core_algos.apply_kl_penalty(
                scores, old_log_probs, ref_log_prob, loss_mask, kl_coef, kl_penalty
            )
        else:
            rewards, kl = jnp.asarray(scores, jnp.float32), jnp.zeros((), jnp.float32)
        adv, ret = core_algos.compute_advantage(
            adv_estimator,
            token_level_rewards=rewards,
            response_mask=loss_mask,
            index=index,
            values=values,
            reward_baselines=baselines,
            gamma=gamma,
            lam=lam,
            norm_adv_by_std_in_grpo=norm_adv_by_std_in_grpo,
        )
        return rewards, kl, adv, ret

    return fn


def build_advantage_fn(cfg, placement: Placement):
    """Jitted KL-in-reward + advantage estimator (`algorithm.*`, `make_advantage_fn`)."""
    al = cfg.algorithm
    return jax.jit(
        make_advantage_fn(
            adv_estimator=al.adv_estimator,
            gamma=float(al.gamma),
            lam=float(al.lam),
            norm_adv_by_std_in_grpo=bool(al.norm_adv_by_std_in_grpo),
            use_kl_in_reward=bool(al.use_kl_in_reward),
            kl_penalty=al.kl_penalty,
            on_trace=placement.tracer("adv"),
        )
    )
