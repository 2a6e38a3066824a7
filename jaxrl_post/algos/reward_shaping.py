"""Reward shaping on response lengths: DAPO's overlong reward shaping.

Part of the core RL math; re-exported by :mod:`jaxrl_post.algos.core_algos` (import it from there). A pure
``jnp`` function: arrays in, a float32 array out; jit-compatible (the lengths may be traced, the three
settings are plain numbers).

Source: Yu et al. 2025, "DAPO: An Open-Source LLM Reinforcement Learning System at Scale"
(arXiv 2503.14476), section 3.4, soft overlong punishment; verl's `DAPORewardManager`
(`verl/workers/reward_manager/dapo.py`), configured by `reward_model.overlong_buffer.*`.
"""

from __future__ import annotations

import numbers

import jax
import jax.numpy as jnp

__all__ = ["compute_overlong_penalty"]


def compute_overlong_penalty(
    response_lengths: jax.Array,
    max_response_length: int,
    overlong_buffer_len: int,
    penalty_factor: float,
) -> jax.Array:
    """DAPO's soft overlong punishment of each response, to be added to its score.

    With Lmax = `max_response_length`, Lbuf = `overlong_buffer_len` and a response of L tokens:

        0                                             if L <= Lmax - Lbuf
        penalty_factor * ((Lmax - Lbuf) - L) / Lbuf   if Lmax - Lbuf < L <= Lmax   (0 down to -penalty_factor)
        -penalty_factor                               if L > Lmax

    verl computes `min(-(L - (Lmax - Lbuf)) / Lbuf * penalty_factor, 0)` with L <= Lmax always (its
    responses never exceed Lmax); here lengths past Lmax are clamped to the full penalty.

    Args:
      response_lengths: `[B]` int, valid response tokens of each response (EOS included, as verl counts
        `attention_mask` over the response).
      max_response_length: Lmax, `data.max_response_length`.
      overlong_buffer_len: Lbuf, `reward_model.overlong_buffer.len`; 0 < Lbuf <= Lmax.
      penalty_factor: `reward_model.overlong_buffer.penalty_factor` (>= 0), the penalty at L = Lmax.

    Returns:
      `[B] float32`, each value in `[-penalty_factor, 0]`.

    Raises:
      ValueError: `overlong_buffer_len` not in (0, max_response_length], or `penalty_factor` < 0 (checked
        when they are Python numbers, i.e. not traced).
    """
    if isinstance(overlong_buffer_len, numbers.Number) and isinstance(max_response_length, numbers.Number):
        if not 0 < overlong_buffer_len <= max_response_length:
            raise ValueError(
                f"overlong_buffer_len must be in (0, max_response_length={max_response_length}], "
                f"got {overlong_buffer_len}"
            )
    if isinstance(penalty_factor, numbers.Number) and penalty_factor < 0:
        raise ValueError(f"penalty_factor must be >= 0, got {penalty_factor}")
    lengths = jnp.asarray(response_lengths).astype(jnp.float32)
    expected = jnp.float32(max_response_length) - jnp.float32(overlong_buffer_len)
    factor = jnp.float32(penalty_factor)
    penalty = (expected - lengths) / jnp.float32(overlong_buffer_len) * factor
    return jnp.clip(penalty, -factor, 0.0).astype(jnp.float32)
