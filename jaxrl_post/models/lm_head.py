"""Fused, chunked LM head + log-softmax: token log-probs (and entropy) straight from hidden states.

`head_token_stats(h [Q, D], w, labels [Q], n_valid)` returns what `functional.logprobs_from_logits` /
`entropy_from_logits` return for `logits = h @ W^T` (+ final soft-cap, / temperature), without ever holding
the `[Q, V]` logits: the slots are processed in chunks of `chunk` rows, forward and backward (a custom VJP
that recomputes each chunk's logits from `h` and the saved log-sum-exp), so the vocab-sized temporaries are
`[chunk, V]`. Only the first `n_valid` slots (a traced int32) are computed: the loops over chunks have a
traced trip count, so the padding slots of a packed micro-batch cost nothing; their outputs are 0 and they
get no gradient.

Gradients (z = softcap(logits) / T, p = softmax(z)): d log p_y / dz = onehot(y) - p,
dH / dz = -p (z - lse + H); dz / dlogits = (1 - tanh^2(logits / cap)) / T; dh = dlogits @ W, dW = dlogits^T @ h.
The backward runs its matmuls in the compute dtype (h's) with float32 accumulation, as autodiff of the
unfused head does.

Source: the chunked / fused cross-entropy of Liger-Kernel and MaxText's vocab tiling (same math as verl's
`logprobs_from_logits` on the full logits).
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp

_F32 = jnp.float32


def _logits(hc, w, w_layout: str, softcap, temperature):
    """Chunk logits: (raw [C, V] float32 before the soft-cap, z = softcap(raw) / T [C, V] float32)."""
    spec = "CD,VD->CV" if w_layout == "vd" else "CD,DV->CV"
    raw = jnp.einsum(spec, hc, w, preferred_element_type=_F32)
    z = raw if softcap is None else jnp.tanh(raw / softcap) * softcap
    return raw, z / temperature


def _pad(x, q_pad):
    return jnp.pad(x, [(0, q_pad - x.shape[0])] + [(0, 0)] * (x.ndim - 1))


def _n_chunks(n_valid, chunk):
    return (jnp.asarray(n_valid, jnp.int32) + chunk - 1) // chunk


def _forward(h, w, labels, n_valid, temperature, w_layout, softcap, chunk, with_ent):
    q = h.shape[0]
    q_pad = -(-q // chunk) * chunk
    hp, lab = _pad(h, q_pad), _pad(jnp.asarray(labels, jnp.int32), q_pad)

    def body(i, bufs):
        lp_b, ent_b, lse_b = bufs
        lo = i * chunk
        hc = jax.lax.dynamic_slice_in_dim(hp, lo, chunk)
        _, z = _logits(hc, w, w_layout, softcap, temperature)
        lse = jax.nn.logsumexp(z, axis=-1)
        lp = jnp.take_along_axis(z, jax.lax.dynamic_slice_in_dim(lab, lo, chunk)[:, None], axis=-1)[:, 0] - lse
        ent = lse - jnp.sum(jnp.exp(z - lse[:, None]) * z, axis=-1) if with_ent else jnp.zeros_like(lse)
        put = lambda b, x: jax.lax.dynamic_update_slice_in_dim(b, x, lo, 0)
        return put(lp_b, lp), put(ent_b, ent), put(lse_b, lse)

    zeros = jnp.zeros((q_pad,), _F32)
    lp, ent, lse = jax.lax.fori_loop(0, _n_chunks(n_valid, chunk), body, (zeros, zeros, zeros))
    valid = jnp.arange(q_pad) < n_valid
    return jnp.where(valid, lp, 0.0)[:q], jnp.where(valid, ent, 0.0)[:q], lse


@partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7, 8))
def _head_stats(h, w, labels, n_valid, temperature, w_layout, softcap, chunk, ent_mode):
    lp, ent, _ = _forward(h, w, labels, n_valid, temperature, w_layout, softcap, chunk, ent_mode != "none")
    return lp, ent


def _head_stats_fwd(h, w, labels, n_valid, temperature, w_layout, softcap, chunk, ent_mode):
    lp, ent, lse = _forward(h, w, labels, n_valid, temperature, w_layout, softcap, chunk, ent_mode != "none")
    return (lp, ent), (h, w, labels, n_valid, temperature, lse, ent)


def _head_stats_bwd(w_layout, softcap, chunk, ent_mode, res, g):
    h, w, labels, n_valid, temperature, lse, ent = res
    g_lp, g_ent = g
    q, cd = h.shape[0], h.dtype
    q_pad = lse.shape[0]
    hp, lab = _pad(h, q_pad), _pad(jnp.asarray(labels, jnp.int32), q_pad)
    valid = jnp.arange(q_pad) < n_valid  # outputs past n_valid are constant 0: no gradient
    g_lp, g_ent, ent = (jnp.where(valid, _pad(x.astype(_F32), q_pad), 0.0) for x in (g_lp, g_ent, ent))

    def body(i, acc):
        dh, dw = acc
        lo = i * chunk
        sl = lambda x: jax.lax.dynamic_slice_in_dim(x, lo, chunk)
        hc = sl(hp)
        raw, z = _logits(hc, w, w_layout, softcap, temperature)
        lse_c = sl(lse)[:, None]
        p = jnp.exp(z - lse_c)
        onehot = jnp.arange(z.shape[-1])[None, :] == sl(lab)[:, None]
        gz = sl(g_lp)[:, None] * (onehot.astype(_F32) - p)
        if ent_mode == "loss":
            gz = gz - sl(g_ent)[:, None] * p * (z - lse_c + sl(ent)[:, None])
        gz = gz / temperature
        if softcap is not None:
            gz = gz * (1.0 - jnp.square(jnp.tanh(raw / softcap)))
        gz = gz.astype(cd)
        spec_h = "CV,VD->CD" if w_layout == "vd" else "CV,DV->CD"
        dh_c = jnp.einsum(spec_h, gz, w, preferred_element_type=_F32)
        spec_w = "CV,CD->VD" if w_layout == "vd" else "CV,CD->DV"
        dw = dw + jnp.einsum(spec_w, gz, hc, preferred_element_type=_F32)
        return jax.lax.dynamic_update_slice_in_dim(dh, dh_c, lo, 0), dw

    init = (jnp.zeros((q_pad, h.shape[1]), _F32), jnp.zeros(w.shape, _F32))
    dh, dw = jax.lax.fori_loop(0, _n_chunks(n_valid, chunk), body, init)
    g_temp = None if isinstance(temperature, (int, float)) else jnp.zeros_like(temperature)
    return dh[:q].astype(cd), dw.astype(w.dtype), None, None, g_temp


_head_stats.defvjp(_head_stats_fwd, _head_stats_bwd)


def head_token_stats(
    h: jax.Array,
    w: jax.Array,
    labels: jax.Array,
    n_valid: jax.Array | int,
    *,
    temperature: float | jax.Array = 1.0,
    w_layout: str = "vd",
    softcap: float | None = None,
    chunk: int = 512,
    entropy: str = "metric",
) -> tuple[jax.Array, jax.Array | None]:
    """Log-probs of `labels` and the entropy under `softmax(softcap(h @ W^T) / temperature)`, chunked.

    Args:
      h: `[Q, D]` hidden states (compute dtype) of the Q slots; only slots `[0, n_valid)` are computed.
      w: the head weight in the compute dtype, `[V, D]` (`w_layout="vd"`, a tied embedding) or `[D, V]` ("dv").
      labels: `[Q]` int token ids. n_valid: int32 scalar (traced or Python int), `0 <= n_valid <= Q`.
      temperature: scalar > 0 (not differentiated). softcap: the model's final logit soft-cap or None.
      chunk: slots per chunk (static): the `[chunk, V]` float32 temporaries bound the memory.
      entropy: 'none' (returns None), 'metric' (entropy returned, no gradient through it) or 'loss'
        (differentiated).
    Returns `(log_probs [Q] float32, entropy [Q] float32 or None)`, 0 at slots >= n_valid.
    Raises ValueError for a bad `entropy`, `w_layout` or `chunk`.
    """
    if entropy not in ("none", "metric", "loss"):
        raise ValueError(f"entropy must be 'none', 'metric' or 'loss', got {entropy!r}")
    if w_layout not in ("vd", "dv"):
        raise ValueError(f"w_layout must be 'vd' or 'dv', got {w_layout!r}")
    if int(chunk) < 1:
        raise ValueError(f"chunk must be >= 1, got {chunk}")
    chunk = min(int(chunk), h.shape[0])
    lp, ent = _head_stats(h, w, labels, n_valid, temperature, w_layout, softcap, chunk, entropy)
    if entropy == "none":
        return lp, None
    return lp, ent if entropy == "loss" else jax.lax.stop_gradient(ent)


def model_logits(model, h: jax.Array) -> jax.Array:
    """`decoder.Transformer.logits_from_hidden`: h `[B, T, D]` -> logits `[B, T, V]` float32 through `model`'s tied
    (`embedding`) or untied (`lm_head`) head in its compute dtype, then the final soft-cap."""
    if model.lm_head is None:
        spec, w = "BTD,VD->BTV", model.embedding[...]
    else:
        spec, w = "BTD,DV->BTV", model.lm_head[...]
    logits = jnp.einsum(spec, h, w.astype(model.dtype), preferred_element_type=jnp.float32)
    cap = model.config.final_logit_softcap
    return logits if cap is None else jnp.tanh(logits / cap) * cap


def model_token_stats(model, h, labels, n_valid, temperature=1.0, entropy="metric", chunk=512, *, in_loop_with=None):
    """`decoder.Transformer.token_stats_from_hidden`: log-probs `[Q] float32` of `labels [Q]` (and entropy `[Q]`
    or None) from hidden states `h [Q, D]` through `model`'s LM head, chunked (`head_token_stats`: no `[Q, V]`
    logits; slots >= `n_valid` are skipped and give 0). entropy: 'none' | 'metric' | 'loss' (as
    `losses.token_log_probs`). in_loop_with: an optional array computed inside the caller's loop; the head weight
    is tied to it by `lax.optimization_barrier`, so XLA gathers an FSDP-sharded weight where it is used instead of
    hoisting the gather out of the loop (the whole weight would then stay on every device for the program)."""
    tied = model.lm_head is None
    w = (model.embedding if tied else model.lm_head)[...]
    if in_loop_with is not None:
        w, _ = jax.lax.optimization_barrier((w, in_loop_with))
    return head_token_stats(
        h,
        w.astype(model.dtype),
        labels,
        n_valid,
        temperature=temperature,
        w_layout="vd" if tied else "dv",
        softcap=model.config.final_logit_softcap,
        chunk=chunk,
        entropy=entropy,
    )
