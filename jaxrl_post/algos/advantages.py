"""Advantage estimators: verl's ``compute_*_advantage`` functions and ``compute_advantage``, as JAX arrays.

Each estimator registers with ``@register_adv_est(name, needs=...)`` (:mod:`jaxrl_post.algos.registry`), declaring
the inputs it consumes; :func:`compute_advantage` passes exactly those, so a new estimator is one decorated
function here plus its test. Each returns ``(advantages [B, R] float32, returns [B, R] float32)``, 0 outside
the response mask. Group ids (``index``) are ``[B]`` integers in any order (verl's ``uid``); host-side callers may also
pass a numpy array of strings/objects (mapped with ``np.unique``; not possible under jit). Conventions
(static strings/bools, float32 math, masks) as in :mod:`jaxrl_post.algos.core_algos`, which re-exports all of
this. Source: verl ``verl/trainer/ppo/core_algos.py``.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_post.algos.functional import _F32, _f32, _nonzero, masked_sum, masked_whiten
from jaxrl_post.algos.registry import (
    ADV_ESTIMATOR_INPUTS,
    ADV_ESTIMATORS,  # noqa: F401  (re-exported: name -> estimator, filled by the decorators below)
    adv_estimator_needs,
    get_adv_estimator_fn,
    register_adv_est,
)

get_adv_estimator = get_adv_estimator_fn

# ----------------------------------------------------------------------------------------------------------
# Group statistics (segment ops over arbitrary-order group ids)
# ----------------------------------------------------------------------------------------------------------


def _group_ids(index: Any, batch_size: int) -> jax.Array:
    """Map ``[B]`` group ids (any order, any values) to dense ids in ``[0, B)``.

    Concrete ids (numpy of any dtype incl. strings/objects, lists, concrete jax arrays) are mapped on the
    host with ``np.unique``; traced ids (under jit) with ``jnp.unique(size=B)``.
    """
    if not isinstance(index, jax.core.Tracer):
        arr = np.asarray(index).reshape(-1)
        if arr.shape[0] != batch_size:
            raise ValueError(f"index has {arr.shape[0]} entries but the batch has {batch_size} rows")
        _, inv = np.unique(arr, return_inverse=True)
        return jnp.asarray(inv.reshape(-1), jnp.int32)
    idx = jnp.asarray(index).reshape(-1)
    if idx.shape[0] != batch_size:
        raise ValueError(f"index has {idx.shape[0]} entries but the batch has {batch_size} rows")
    _, inv = jnp.unique(idx, size=batch_size, return_inverse=True)
    return inv.reshape(-1).astype(jnp.int32)


def _check_group_sizes(index: Any, minimum: int, what: str) -> None:
    """Host-side check (skipped under jit, where ``index`` is a tracer)."""
    if isinstance(index, jax.core.Tracer):
        return
    _, counts = np.unique(np.asarray(index), return_counts=True)
    if counts.size and counts.min() < minimum:
        raise ValueError(f"{what} requires at least {minimum} samples per group; smallest group has {counts.min()}")


class _GroupStats:
    """Per-sample view of per-group statistics of ``scores [B]``."""

    def __init__(self, scores: jax.Array, index: Any):
        b = scores.shape[0]
        gid = _group_ids(index, b)
        seg = lambda x: jax.ops.segment_sum(x, gid, num_segments=b)[gid]
        self.gid = gid
        self.count = seg(jnp.ones_like(scores))
        self.mean = seg(scores) / self.count
        gmax = jax.ops.segment_max(scores, gid, num_segments=b)[gid]
        gmin = jax.ops.segment_min(scores, gid, num_segments=b)[gid]
        # Exactly-equal groups (size > 1) get an exactly-zero centred score (no rounding residue, no NaN).
        self.all_equal = (gmax == gmin) & (self.count > 1)
        self.centered = jnp.where(self.all_equal, 0.0, scores - self.mean)
        var = seg(jnp.square(self.centered)) / jnp.maximum(self.count - 1.0, 1.0)
        self.std = jnp.sqrt(var)  # unbiased, as torch.std
        self.segment = seg


def _outcome_scores(token_level_rewards: jax.Array, response_mask: jax.Array) -> jax.Array:
    """Sequence score = masked sum of token rewards over R (verl sums unmasked; equal when padding is 0)."""
    return jax.lax.stop_gradient(masked_sum(token_level_rewards, response_mask, axis=-1))


def _broadcast_masked(per_seq: jax.Array, response_mask: jax.Array) -> jax.Array:
    return jnp.where(jnp.asarray(response_mask) != 0, per_seq[:, None], 0.0).astype(_F32)


# ----------------------------------------------------------------------------------------------------------
# Advantage estimators. Each returns (advantages [B, R] float32, returns [B, R] float32), 0 outside the mask.
# ----------------------------------------------------------------------------------------------------------


def compute_gae_raw(
    token_level_rewards: jax.Array,
    values: jax.Array,
    response_mask: jax.Array,
    gamma: float | jax.Array,
    lam: float | jax.Array,
) -> tuple[jax.Array, jax.Array]:
    """Un-whitened GAE (the first half of :func:`compute_gae_advantage_return`).

    Reverse ``lax.scan`` over t = R-1..0 carrying ``(nextvalue, lastgaelam)`` per row, both 0 initially:
    ``delta_t = r_t + gamma * nextvalue - V_t``; ``gae_t = delta_t + gamma * lam * lastgaelam``; at a valid
    token (m_t = 1) the carry becomes ``(V_t, gae_t)``; at a masked token it passes through unchanged, so
    masked/padding positions neither contribute rewards nor get bootstrapped from (a valid token bootstraps
    from the next *valid* token). ``A_t = lastgaelam`` after step t; ``returns = A + V``.

    Args: ``token_level_rewards``, ``values`` ``[B, R] float32``; ``response_mask`` ``[B, R]`` 0/1;
    ``gamma``, ``lam`` scalars. Returns ``(advantages, returns)`` ``[B, R] float32``, 0 outside the mask.
    Source: Schulman et al. 2015 (https://arxiv.org/abs/1506.02438); verl ``compute_gae_advantage_return``.
    """
    r, v = _f32(token_level_rewards), _f32(values)
    valid = jnp.asarray(response_mask) != 0
    gamma, lam = _f32(gamma), _f32(lam)

    def step(carry, xs):
        nextvalue, lastgaelam = carry
        r_t, v_t, ok = xs
        gae = r_t + gamma * nextvalue - v_t + gamma * lam * lastgaelam
        carry = (jnp.where(ok, v_t, nextvalue), jnp.where(ok, gae, lastgaelam))
        return carry, carry[1]

    zeros = jnp.zeros(r.shape[:1], _F32)
    _, adv_rb = jax.lax.scan(step, (zeros, zeros), (r.T, v.T, valid.T), reverse=True)
    adv = adv_rb.T
    adv, ret = jnp.where(valid, adv, 0.0), jnp.where(valid, adv + v, 0.0)
    return jax.lax.stop_gradient(adv), jax.lax.stop_gradient(ret)


@register_adv_est("gae", needs=("values", "gamma", "lam"))
def compute_gae_advantage_return(
    token_level_rewards: jax.Array,
    values: jax.Array,
    response_mask: jax.Array,
    gamma: float | jax.Array,
    lam: float | jax.Array,
) -> tuple[jax.Array, jax.Array]:
    """GAE advantages whitened over the mask, and returns = raw advantages + values (PPO with a critic).

    ``A, G = compute_gae_raw(...)``; ``advantages = masked_whiten(A, mask) * mask``; ``returns = G``.
    Shapes as :func:`compute_gae_raw`. Source: verl ``compute_gae_advantage_return`` (``adv_estimator="gae"``).
    """
    adv, ret = compute_gae_raw(token_level_rewards, values, response_mask, gamma, lam)
    valid = jnp.asarray(response_mask) != 0
    return jnp.where(valid, masked_whiten(adv, response_mask), 0.0), ret


@register_adv_est("grpo", needs=("index", "epsilon", "norm_adv_by_std_in_grpo"))
def compute_grpo_outcome_advantage(
    token_level_rewards: jax.Array,
    response_mask: jax.Array,
    index: jax.Array,
    epsilon: float = 1e-6,
    norm_adv_by_std_in_grpo: bool = True,
) -> tuple[jax.Array, jax.Array]:
    """GRPO outcome advantage: score normalised within its group (same prompt).

    ``s_i = sum_t m_it r_it``; ``A_i = (s_i - mean_g) / (std_g + epsilon)`` (``std_g`` unbiased, like
    ``torch.std``), or ``s_i - mean_g`` when ``norm_adv_by_std_in_grpo`` is False (Dr. GRPO). A group of one
    uses mean 0 / std 1 (``A = s / (1 + eps)``); a group whose scores are all equal gets exactly 0.
    ``A_i`` is broadcast over the response tokens; advantages == returns.

    Args: ``token_level_rewards`` ``[B, R]``; ``response_mask`` ``[B, R]``; ``index`` ``[B]`` int group ids in
    any order; ``epsilon`` scalar; ``norm_adv_by_std_in_grpo`` static bool. Returns two ``[B, R] float32``.
    Source: Shao et al. 2024 (https://arxiv.org/abs/2402.03300); Dr. GRPO (https://arxiv.org/abs/2503.20783);
    verl ``compute_grpo_outcome_advantage``.
    """
    s = _outcome_scores(token_level_rewards, response_mask)
    g = _GroupStats(s, index)
    single = g.count == 1
    if norm_adv_by_std_in_grpo:
        adv = jnp.where(single, s / (1.0 + epsilon), g.centered / (g.std + epsilon))
    else:
        adv = jnp.where(single, s, g.centered)
    out = _broadcast_masked(adv, response_mask)
    return out, out


@register_adv_est("grpo_passk", needs=("index", "epsilon", "norm_adv_by_std_in_grpo"))
def compute_grpo_passk_outcome_advantage(
    token_level_rewards: jax.Array,
    response_mask: jax.Array,
    index: jax.Array,
    epsilon: float = 1e-6,
    norm_adv_by_std_in_grpo: bool = True,
) -> tuple[jax.Array, jax.Array]:
    """Pass@k GRPO: only the best response of each group gets a non-zero advantage.

    ``A_best = (r_max - r_second_max) / (std_g + eps)`` (or unnormalised); everyone else 0. Ties for the max
    go to the lowest batch position. Groups need >= 2 samples: checked (ValueError) when ``index`` is
    concrete; under jit a group of one just gets 0. Shapes as GRPO.
    Source: Chen et al. 2025 (https://arxiv.org/abs/2503.19595); verl ``compute_grpo_passk_outcome_advantage``.
    """
    _check_group_sizes(index, 2, "grpo_passk")
    s = _outcome_scores(token_level_rewards, response_mask)
    g = _GroupStats(s, index)
    b = s.shape[0]
    pos = jnp.arange(b)
    gmax = jax.ops.segment_max(s, g.gid, num_segments=b)[g.gid]
    best_pos = jax.ops.segment_min(jnp.where(s == gmax, pos, b), g.gid, num_segments=b)[g.gid]
    is_best = pos == best_pos
    second = jax.ops.segment_max(jnp.where(is_best, -jnp.inf, s), g.gid, num_segments=b)[g.gid]
    gap = jnp.where(g.count > 1, gmax - second, 0.0)
    if norm_adv_by_std_in_grpo:
        gap = gap / (g.std + epsilon)
    out = _broadcast_masked(jnp.where(is_best, gap, 0.0), response_mask)
    return out, out


@register_adv_est("rloo", needs=("index", "epsilon"))
def compute_rloo_outcome_advantage(
    token_level_rewards: jax.Array,
    response_mask: jax.Array,
    index: jax.Array,
    epsilon: float = 1e-6,
) -> tuple[jax.Array, jax.Array]:
    """RLOO: leave-one-out baseline. ``A_i = s_i - mean_{j != i} s_j = (s_i - mean_g) * n / (n - 1)``.

    A group of one keeps its raw score; all-equal groups get exactly 0. ``epsilon`` is unused (verl
    signature). Shapes as GRPO. Source: Ahmadian et al. 2024 (https://arxiv.org/abs/2402.14740);
    verl ``compute_rloo_outcome_advantage``.
    """
    del epsilon
    s = _outcome_scores(token_level_rewards, response_mask)
    g = _GroupStats(s, index)
    n = g.count
    adv = jnp.where(n > 1, g.centered * n / jnp.maximum(n - 1.0, 1.0), s)
    out = _broadcast_masked(adv, response_mask)
    return out, out


@register_adv_est("reinforce_plus_plus", needs=("gamma",))
def compute_reinforce_plus_plus_outcome_advantage(
    token_level_rewards: jax.Array,
    response_mask: jax.Array,
    gamma: float | jax.Array = 1.0,
) -> tuple[jax.Array, jax.Array]:
    """REINFORCE++: discounted return-to-go, whitened over the batch mask.

    Reverse scan: ``G_t = r_t + gamma * c``, then ``c = G_t * m_t`` (the running return restarts after any
    masked token, so padding never flows into earlier tokens). ``advantages = masked_whiten(G) * m``;
    ``returns = G * m``. Shapes ``[B, R]``. Source: Hu 2025 (https://arxiv.org/abs/2501.03262);
    verl ``compute_reinforce_plus_plus_outcome_advantage`` (``config.gamma``).
    """
    r = jnp.where(jnp.asarray(response_mask) != 0, _f32(token_level_rewards), 0.0)
    valid = jnp.asarray(response_mask) != 0
    gamma = _f32(gamma)

    def step(running, xs):
        r_t, ok = xs
        ret_t = r_t + gamma * running
        return jnp.where(ok, ret_t, 0.0), ret_t

    _, ret_rb = jax.lax.scan(step, jnp.zeros(r.shape[:1], _F32), (r.T, valid.T), reverse=True)
    ret = jax.lax.stop_gradient(jnp.where(valid, ret_rb.T, 0.0))
    return jnp.where(valid, masked_whiten(ret, response_mask), 0.0), ret


@register_adv_est("reinforce_plus_plus_baseline", needs=("index", "epsilon"))
def compute_reinforce_plus_plus_baseline_outcome_advantage(
    token_level_rewards: jax.Array,
    response_mask: jax.Array,
    index: jax.Array,
    epsilon: float = 1e-6,
) -> tuple[jax.Array, jax.Array]:
    """REINFORCE++-baseline: subtract the group mean (0 for a group of one), broadcast, whiten over the mask.

    ``A = masked_whiten((s_i - mean_g) * m, m) * m``; advantages == returns. ``epsilon`` unused (verl
    signature). Shapes as GRPO. Source: https://arxiv.org/abs/2501.03262; verl
    ``compute_reinforce_plus_plus_baseline_outcome_advantage``.
    """
    del epsilon
    s = _outcome_scores(token_level_rewards, response_mask)
    g = _GroupStats(s, index)
    tiled = _broadcast_masked(jnp.where(g.count > 1, g.centered, s), response_mask)
    out = jnp.where(jnp.asarray(response_mask) != 0, masked_whiten(tiled, response_mask), 0.0)
    return out, out


@register_adv_est("remax", needs=("reward_baselines",))
def compute_remax_outcome_advantage(
    token_level_rewards: jax.Array,
    reward_baselines: jax.Array,
    response_mask: jax.Array,
) -> tuple[jax.Array, jax.Array]:
    """ReMax: return-to-go minus the greedy-rollout reward baseline.

    ``G_t = sum_{u >= t} m_u r_u``; ``A_t = (G_t - b) * m_t``; ``returns = G * m``.
    Args: ``token_level_rewards`` ``[B, R]``, ``reward_baselines`` ``[B]`` (score of the greedy response),
    ``response_mask`` ``[B, R]``. Source: Li et al. 2023 (https://arxiv.org/abs/2310.10505);
    verl ``compute_remax_outcome_advantage``.
    """
    valid = jnp.asarray(response_mask) != 0
    r = jnp.where(valid, _f32(token_level_rewards), 0.0)
    ret = jnp.flip(jnp.cumsum(jnp.flip(r, -1), -1), -1)
    adv = jnp.where(valid, ret - _f32(reward_baselines)[:, None], 0.0)
    return jax.lax.stop_gradient(adv), jax.lax.stop_gradient(jnp.where(valid, ret, 0.0))


@register_adv_est("opo", needs=("index", "epsilon"))
def compute_opo_outcome_advantage(
    token_level_rewards: jax.Array,
    response_mask: jax.Array,
    index: jax.Array,
    epsilon: float = 1e-6,
) -> tuple[jax.Array, jax.Array]:
    """OPO: baseline = length-weighted group mean score. ``b_g = sum_j L_j s_j / sum_j L_j``; ``A_i = s_i - b_g``.

    ``L_j`` = number of valid response tokens. A group of one uses baseline 0; all-equal groups get exactly 0.
    ``epsilon`` unused. Shapes as GRPO. Source: Hao et al. 2025 (https://arxiv.org/abs/2505.23585);
    verl ``compute_opo_outcome_advantage``.
    """
    del epsilon
    s = _outcome_scores(token_level_rewards, response_mask)
    length = jnp.sum((jnp.asarray(response_mask) != 0).astype(_F32), axis=-1)
    g = _GroupStats(s, index)
    len_sum = g.segment(length)
    baseline = jnp.where((g.count > 1) & (len_sum > 0), g.segment(length * s) / _nonzero(len_sum), 0.0)
    adv = jnp.where(g.all_equal, 0.0, s - baseline)
    out = _broadcast_masked(adv, response_mask)
    return out, out


@register_adv_est("gpg", needs=("index", "epsilon"))
def compute_gpg_outcome_advantage(
    token_level_rewards: jax.Array,
    response_mask: jax.Array,
    index: jax.Array,
    epsilon: float = 1e-6,
    f_norm: float = 1.0,
) -> tuple[jax.Array, jax.Array]:
    """GPG: ``A_i = alpha * (s_i - mean_g) / f_norm`` with ``alpha = B / max(#{i: s_i != 0}, 1)``.

    Group of one: mean 0. ``epsilon`` unused (verl signature; verl's ``alpha`` argument is recomputed as
    above, so it is not an argument here). Shapes as GRPO. Source: Chu et al. 2025
    (https://arxiv.org/abs/2504.02546); verl ``compute_gpg_outcome_advantage``.
    """
    del epsilon
    s = _outcome_scores(token_level_rewards, response_mask)
    g = _GroupStats(s, index)
    alpha = s.shape[0] / jnp.maximum(jnp.sum((s != 0).astype(_F32)), 1.0)
    adv = alpha * jnp.where(g.count > 1, g.centered, s) / f_norm
    out = _broadcast_masked(adv, response_mask)
    return out, out


def compute_advantage(
    adv_estimator: str,
    *,
    token_level_rewards: jax.Array,
    response_mask: jax.Array,
    index: jax.Array | None = None,
    values: jax.Array | None = None,
    reward_baselines: jax.Array | None = None,
    gamma: float | jax.Array = 1.0,
    lam: float | jax.Array = 1.0,
    epsilon: float = 1e-6,
    norm_adv_by_std_in_grpo: bool = True,
) -> tuple[jax.Array, jax.Array]:
    """Call estimator ``adv_estimator`` (static) with what it declared in ``register_adv_est(needs=...)``.

    Args: ``token_level_rewards`` ``[B, R] float32``; ``response_mask`` ``[B, R]``; ``index`` ``[B]`` group
    ids; ``values`` ``[B, R] float32``; ``reward_baselines`` ``[B] float32``; the hyper-parameters as in
    ``algorithm.*``. Inputs and hyper-parameters the estimator did not declare are not passed.
    Returns ``(advantages, returns)`` ``[B, R] float32``.
    Raises ValueError on an unknown name, or when a declared input is None (naming estimator and input).
    Source: verl ``compute_advantage`` (``ray_trainer.py``).
    """
    fn = get_adv_estimator_fn(adv_estimator)
    given = dict(
        index=index,
        values=values,
        reward_baselines=reward_baselines,
        gamma=gamma,
        lam=lam,
        epsilon=epsilon,
        norm_adv_by_std_in_grpo=norm_adv_by_std_in_grpo,
    )
    kwargs = {}
    for need in adv_estimator_needs(adv_estimator):
        if given[need] is None:
            raise ValueError(f"adv_estimator {adv_estimator!r} needs {need} ({ADV_ESTIMATOR_INPUTS.get(need, need)})")
        kwargs[need] = given[need]
    return fn(token_level_rewards=token_level_rewards, response_mask=response_mask, **kwargs)
