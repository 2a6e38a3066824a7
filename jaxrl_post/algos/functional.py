"""Array primitives shared by the RL math: masked statistics and log-prob / entropy from logits.

JAX counterparts of verl's ``verl/utils/torch_functional.py`` (``masked_sum``, ``masked_mean``, ``masked_var``,
``masked_whiten``, ``logprobs_from_logits``, ``entropy_from_logits``) plus the response-logit alignment used by
verl's actor. Re-exported by :mod:`jaxrl_post.algos.core_algos` (the import path other code should use).
Pure ``jnp``; jit-compatible (Python bools ``unbiased``/``shift_mean``/``calculate_entropy`` and
``response_length`` are static); float32 math whatever the input dtype. Masks are 0/1 arrays of any dtype;
values at masked positions never leak into results (``jnp.where``), even inf/NaN.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp

_F32 = jnp.float32


def _f32(x: Any) -> jax.Array:
    return jnp.asarray(x, _F32)


def _nonzero(x: jax.Array) -> jax.Array:
    """x where x != 0 else 1 (safe denominator; x == 0 only happens with an all-zero numerator)."""
    return jnp.where(x == 0, jnp.ones_like(x), x)


# ----------------------------------------------------------------------------------------------------------
# Masked statistics (verl: verl.utils.torch_functional.masked_*)
# ----------------------------------------------------------------------------------------------------------


def masked_sum(values: jax.Array, mask: jax.Array, axis: int | tuple[int, ...] | None = None) -> jax.Array:
    """``sum(values * mask)`` over ``axis`` (all axes if None), ignoring anything at ``mask == 0``.

    Args: ``values`` ``[...]``, ``mask`` same shape (0/1, any dtype). Returns float32, ``axis`` reduced.
    Source: verl ``torch_functional.masked_sum``.
    """
    values, m = _f32(values), _f32(mask)
    return jnp.sum(jnp.where(m != 0, values * m, 0.0), axis=axis)


def masked_mean(values: jax.Array, mask: jax.Array, axis: int | tuple[int, ...] | None = None) -> jax.Array:
    """``sum(values * mask) / sum(mask)`` over ``axis``; 0 where the mask is empty.

    Source: verl ``torch_functional.masked_mean`` (which adds 1e-8 to the denominator instead).
    """
    return masked_sum(values, mask, axis) / _nonzero(jnp.sum(_f32(mask), axis=axis))


def masked_var(values: jax.Array, mask: jax.Array, unbiased: bool = True) -> jax.Array:
    """Variance over all ``mask == 1`` entries (a scalar).

    ``var = masked_mean((values - mean)^2)``, times ``n / (n - 1)`` when ``unbiased`` (static) and ``n > 1``.
    verl raises for ``n <= 1``; under jit this cannot raise, so the biased value (0 for one element) is returned.
    Source: verl ``torch_functional.masked_var``.
    """
    mean = masked_mean(values, mask)
    var = masked_mean(jnp.square(_f32(values) - mean), mask)
    if unbiased:
        n = jnp.sum(_f32(mask))
        var = var * jnp.where(n > 1, n / jnp.where(n > 1, n - 1, 1.0), 1.0)
    return var


def masked_whiten(values: jax.Array, mask: jax.Array, shift_mean: bool = True) -> jax.Array:
    """Whiten with statistics over ``mask == 1``: ``(values - mean) * rsqrt(var_unbiased + 1e-8)``.

    With ``shift_mean=False`` the mean is added back. Applied to every entry (masked ones included, as
    verl); callers mask the result. Shape preserved, float32. Source: verl ``torch_functional.masked_whiten``.
    """
    mean = masked_mean(values, mask)
    var = masked_var(values, mask, unbiased=True)
    whitened = (_f32(values) - mean) * jax.lax.rsqrt(var + 1e-8)
    if not shift_mean:
        whitened = whitened + mean
    return whitened


# ----------------------------------------------------------------------------------------------------------
# Log-probs and entropy from logits
# ----------------------------------------------------------------------------------------------------------


def _scaled_logits(logits: jax.Array, temperature: float | jax.Array) -> jax.Array:
    z = _f32(logits)  # the single [B, T, V] float32 value (a no-op when logits are already float32)
    if isinstance(temperature, (int, float)) and temperature == 1.0:
        return z
    return z / temperature


def _token_stats_fwd_impl(logits, labels, temperature, want):
    z = _scaled_logits(logits, temperature)
    lse = jax.nn.logsumexp(z, axis=-1)
    lp = ent = None
    if want != "ent":
        lp = jnp.take_along_axis(z, jnp.asarray(labels, jnp.int32)[..., None], axis=-1)[..., 0] - lse
    if want != "lp":
        ent = lse - jnp.sum(jnp.exp(z - lse[..., None]) * z, axis=-1)
    return lp, ent, lse


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _token_stats(logits, labels, temperature, want):
    lp, ent, _ = _token_stats_fwd_impl(logits, labels, temperature, want)
    return {"lp": lp, "ent": ent, "both": (lp, ent)}[want]


def _token_stats_fwd(logits, labels, temperature, want):
    lp, ent, lse = _token_stats_fwd_impl(logits, labels, temperature, want)
    out = {"lp": lp, "ent": ent, "both": (lp, ent)}[want]
    # Residuals: the caller's logits (no new [B, T, V] buffer) and [B, T] statistics.
    return out, (logits, labels, temperature, lse, ent)


def _token_stats_bwd(want, res, g):
    # d log p_y / dz = onehot(y) - p;  dH / dz = -p * (z - lse + H);  dz / dlogits = 1 / T.
    # Recomputes p from the logits so the whole cotangent is one fused [B, T, V] pass.
    logits, labels, temperature, lse, ent = res
    g_lp, g_ent = {"lp": (g, None), "ent": (None, g), "both": g}[want]
    z = _scaled_logits(logits, temperature)
    p = jnp.exp(z - lse[..., None])
    gz = jnp.zeros_like(z)
    if g_lp is not None:
        onehot = jnp.arange(z.shape[-1]) == jnp.asarray(labels, jnp.int32)[..., None]
        gz = g_lp[..., None] * (onehot.astype(_F32) - p)
    if g_ent is not None:
        gz = gz - g_ent[..., None] * p * (z - lse[..., None] + ent[..., None])
    if not (isinstance(temperature, (int, float)) and temperature == 1.0):
        gz = gz / temperature
    g_temp = None if isinstance(temperature, (int, float)) else jnp.zeros_like(temperature)
    return gz.astype(logits.dtype), None, g_temp


_token_stats.defvjp(_token_stats_fwd, _token_stats_bwd)


def logprobs_from_logits(logits: jax.Array, labels: jax.Array, temperature: float | jax.Array = 1.0) -> jax.Array:
    """Log-probability of ``labels`` under ``softmax(logits / temperature)``.

    ``log p(y) = z_y - logsumexp(z)``, ``z = logits / T`` (T = the sampler's temperature, so old/new/ref
    log-probs describe the distribution that actually produced the tokens).

    Args:
      logits: ``[B, T, V]`` (any float dtype, e.g. bfloat16; math in float32; must be finite).
      labels: ``[B, T]`` int token ids.
      temperature: scalar > 0 (static or traced; not differentiated).
    Returns: ``[B, T] float32``.

    Memory: the forward holds at most one ``[B, T, V]`` float32 value (the scaled logits) feeding a
    ``logsumexp`` reduction and a gather (no log-softmax tensor); a custom VJP recomputes the softmax from the
    saved logits, so the backward writes the logits' cotangent in one fused pass.

    Source: verl ``torch_functional.logprobs_from_logits`` (+ the actor's ``logits.div_(temperature)``).
    """
    return _token_stats(logits, labels, temperature, "lp")


def sampling_keep_mask(logits: jax.Array, labels: jax.Array, threshold: jax.Array, temperature=1.0) -> jax.Array:
    """The sampler's kept set replayed on training logits: ``z >= threshold - tol`` or the label itself.

    ``z = logits / temperature``; ``threshold [B, T] float32`` is the rollout's smallest kept tempered
    logit (``sample_tokens``; ``-inf`` keeps everything). ``tol = 1e-5 * (1 + |threshold|)`` absorbs the
    float noise between the sampler's cached decode and the training forward (the boundary token sits
    exactly at the threshold). Returns ``[B, T, V] bool``.
    """
    z = logits.astype(jnp.float32) / temperature
    th = threshold.astype(jnp.float32)[..., None]
    tol = jnp.where(jnp.isfinite(th), 1e-5 * (1.0 + jnp.abs(th)), 0.0)
    is_label = jnp.arange(z.shape[-1])[None, None, :] == labels[..., None]
    return (z >= th - tol) | is_label


def truncated_logprobs_from_logits(
    logits: jax.Array, labels: jax.Array, threshold: jax.Array, temperature: float | jax.Array = 1.0
) -> jax.Array:
    """Log-probability of ``labels`` under the distribution the sampler drew from: ``softmax(z)``
    restricted to the kept set of top-k / top-p / min-p and renormalized (mask replay, as prime-rl does;
    the full-softmax log-prob of verl biases the PPO ratio when truncation is on, TRL#6789).

    ``log p(y) = z_y - logsumexp(z[keep])`` with ``keep = sampling_keep_mask(...)``. Args: ``logits
    [B, T, V]``, ``labels [B, T] int``, ``threshold [B, T] float32`` (``-inf``: no truncation, equal to
    ``logprobs_from_logits``), ``temperature`` scalar > 0. Returns ``[B, T] float32``. Differentiable in the
    logits (the mask is constant).
    """
    z = logits.astype(jnp.float32) / temperature
    keep = sampling_keep_mask(logits, labels, threshold, temperature)
    lse = jax.nn.logsumexp(jnp.where(keep, z, -jnp.inf), axis=-1)
    return jnp.take_along_axis(z, labels[..., None].astype(jnp.int32), axis=-1)[..., 0] - lse


def entropy_from_logits(logits: jax.Array, temperature: float | jax.Array = 1.0) -> jax.Array:
    """Entropy of ``softmax(logits / T)`` per position: ``H = logsumexp(z) - sum_v softmax(z)_v * z_v``.

    Args: ``logits`` ``[B, T, V]`` (finite), ``temperature`` scalar. Returns ``[B, T] float32``.
    Same memory profile as :func:`logprobs_from_logits` (gradient ``dH/dz = -p (log p + H)``).
    Source: verl ``torch_functional.entropy_from_logits``.
    """
    return _token_stats(logits, jnp.zeros((), jnp.int32), temperature, "ent")


def logprobs_and_entropy_from_logits(
    logits: jax.Array, labels: jax.Array, temperature: float | jax.Array = 1.0
) -> tuple[jax.Array, jax.Array]:
    """Both :func:`logprobs_from_logits` and :func:`entropy_from_logits` sharing one logsumexp.

    Returns ``(log_probs [B, T] float32, entropy [B, T] float32)``.
    """
    return _token_stats(logits, labels, temperature, "both")


def response_logits(logits: jax.Array, response_length: int) -> jax.Array:
    """The logits that score the response tokens: ``logits[:, T-R-1 : T-1]`` (= ``[P-1 : P-1+R]``, T = P + R).

    The token at sequence position ``t`` is predicted by the logits at ``t - 1``, so response token ``j``
    (position ``P + j``) is scored by ``logits[:, P - 1 + j]``. ``[B, T, V] -> [B, R, V]``; ``response_length``
    is static. Source: verl ``dp_actor._forward_micro_batch`` (``logits[:, -response_length - 1 : -1]``).
    """
    t = logits.shape[1]
    return logits[:, t - response_length - 1 : t - 1]


def compute_response_log_probs(
    logits: jax.Array,
    responses: jax.Array,
    temperature: float | jax.Array = 1.0,
    calculate_entropy: bool = False,
) -> jax.Array | tuple[jax.Array, jax.Array]:
    """Log-probs (and optionally entropy) of the response tokens from full-sequence logits.

    Args:
      logits: ``[B, P+R, V]`` logits of the model on ``input_ids = concat(prompts, responses)``.
      responses: ``[B, R]`` int response token ids.
      temperature: sampler temperature. ``calculate_entropy``: static bool.
    Returns: ``log_probs [B, R] float32`` or ``(log_probs, entropy)`` each ``[B, R] float32``.
    Source: verl ``dp_actor._forward_micro_batch`` (alignment via :func:`response_logits`).
    """
    lg = response_logits(logits, responses.shape[1])
    if calculate_entropy:
        return logprobs_and_entropy_from_logits(lg, responses, temperature)
    return logprobs_from_logits(lg, responses, temperature)


__all__ = [
    "masked_sum",
    "masked_mean",
    "masked_var",
    "masked_whiten",
    "logprobs_from_logits",
    "entropy_from_logits",
    "logprobs_and_entropy_from_logits",
    "response_logits",
    "compute_response_log_probs",
]


def token_log_probs(logits, tokens, temperature: float, entropy: str, threshold=None):
    """log p(tokens) `[..., R] float32` and entropy `[..., R] float32` (or None) of `logits / temperature`.

    threshold: optional `[..., R] float32` sampling thresholds of the rollout (`rollout.sampling_mask_replay`):
    the log-prob is then the truncated distribution's (`truncated_logprobs_from_logits`); the
    entropy stays the full distribution's.

    entropy (static): 'none'; 'metric' (computed from stop_gradient(logits): no entropy term in the
    backward pass, same value; use when entropy_coeff == 0); 'loss' (differentiated, one shared logsumexp).
    Raises ValueError for another value.
    """
    if threshold is not None:
        lp = truncated_logprobs_from_logits(logits, tokens, threshold, temperature)
        if entropy == "loss":
            return lp, entropy_from_logits(logits, temperature)
    elif entropy == "loss":
        return logprobs_and_entropy_from_logits(logits, tokens, temperature)
    else:
        lp = logprobs_from_logits(logits, tokens, temperature)
    if entropy == "none":
        return lp, None
    if entropy == "metric":
        return lp, entropy_from_logits(jax.lax.stop_gradient(logits), temperature)
    raise ValueError(f"entropy must be 'none', 'metric' or 'loss', got {entropy!r}")


def entropy_mode(entropy_coeff: float) -> str:
    """'loss' when the entropy bonus is on, else 'metric' (the `actor/entropy` metric only)."""
    return "loss" if entropy_coeff else "metric"
