"""Loss aggregation: a ``[B, R]`` per-token loss to a scalar with global token/sequence counts, so that
micro-batched losses sum exactly to the un-split loss (verl ``agg_loss``). Re-exported by
:mod:`jaxrl_post.algos.core_algos`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxrl_post.algos.functional import _F32, _f32, _nonzero, masked_sum

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
