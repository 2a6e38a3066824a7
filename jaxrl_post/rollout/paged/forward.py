"""The decoder's forward over the paged KV pool: the project's `models.decoder.Transformer` modules (projections,
norms, RoPE, MLP) with attention replaced by ragged paged attention, layers run as a `lax.scan` over stacked
params (`stack_layers`, period as `decoder.layer_period`: 1 for Llama/Qwen, 2 for Gemma 2, 6 for Gemma 3) that
carries the whole pool, so each step writes its new keys/values in place and reads only the pages it gathers.

`Ragged` holds one call's token layout: tokens `[B', T']` (decode: one token per slot, `[S, 1]`; prefill: a chunk
of prompt tokens, `[1, T]`), each token's position in its sequence (its RoPE position and slot), its flat pool slot,
and the kernel's per-sequence metadata (`attention` module docstring).
"""

from __future__ import annotations

import math

import flax.struct
import jax
import jax.numpy as jnp
from flax import nnx

from jaxrl_post.models.decoder import layer_period
from jaxrl_post.models.layers import _rope_angles, apply_rope
from jaxrl_post.rollout.paged.attention import paged_attention
from jaxrl_post.rollout.paged.kv_pool import write_kv


@flax.struct.dataclass
class Ragged:
    """tokens `[B', T'] int32`; positions `[B', T'] int32` (index in the sequence); slots `[B' * T'] int32` (flat
    pool slots, the null page's for padding); kv_lens `[S] int32`, page_indices `[S, pages_per_seq] int32`,
    cu_q_lens `[S + 1] int32`, num_seqs `[1] int32` over the B' * T' tokens flattened (row-major)."""

    tokens: jax.Array
    positions: jax.Array
    slots: jax.Array
    kv_lens: jax.Array
    page_indices: jax.Array
    cu_q_lens: jax.Array
    num_seqs: jax.Array


@flax.struct.dataclass
class LayerStack:
    """The model's blocks as `period` stacks `[L // period, ...]` of params (scanned) plus the `L % period` last
    blocks' params (unrolled). Built once per weight version (`stack_layers`), outside the decode program."""

    stacked: tuple
    tail: tuple


def stack_layers(model) -> tuple[tuple, LayerStack]:
    """(graphdefs: static, one per position in the period + the tail's, `LayerStack`) of `model.layers`.
    Raises ValueError when layers j, j + period, ... differ in param structure."""
    layers = list(model.layers)
    p = layer_period(model.config)
    groups = len(layers) // p
    gds, stacked = [], []
    for j in range(p if groups else 0):  # fewer layers than a period: all unrolled
        splits = [nnx.split(layers[g * p + j]) for g in range(groups)]
        if any(gd != splits[0][0] for gd, _ in splits):
            raise ValueError(f"layers {j}, {j + p}, ... differ in structure; they cannot be scanned with period {p}")
        gds.append(splits[0][0])
        stacked.append(jax.tree.map(lambda *xs: jnp.stack(xs), *[st for _, st in splits]))
    tail = [nnx.split(b) for b in layers[groups * p :]]
    return (tuple(gds), tuple(gd for gd, _ in tail)), LayerStack(tuple(stacked), tuple(st for _, st in tail))


def _attention(attn, x, positions, kv, layer, rag: Ragged, impl: str):
    """`decoder.Attention` over the pool: x `[B', T', D]` -> (y `[B', T', D]`, pool with this layer written)."""
    b, t, _ = x.shape
    q, k, v = attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)
    if attn.q_norm is not None:
        q, k = attn.q_norm(q), attn.k_norm(k)
    angles = _rope_angles(positions, attn.head_dim, attn.rope_base, dict(attn.rope_scaling), attn.max_pos)
    q, k = apply_rope(q, angles), apply_rope(k, angles)
    flat = lambda a: a.reshape(b * t, *a.shape[2:])
    kv = write_kv(kv, layer, flat(k), flat(v), rag.slots)
    out = paged_attention(
        flat(q),
        kv,
        rag.kv_lens,
        rag.page_indices,
        rag.cu_q_lens,
        rag.num_seqs,
        sm_scale=attn.scale,
        sliding_window=attn.window,
        soft_cap=attn.softcap,
        dtype=attn.dtype,
        impl=impl,
        layer=layer,
    )
    return attn.o_proj(out.reshape(b, t, attn.num_heads, attn.head_dim)), kv


def _block(block, x, positions, kv, layer, rag: Ragged, impl: str):
    """`decoder.Block.__call__` with `_attention` (pre-norm residual; Gemma's post norms)."""
    h, kv = _attention(block.attn, block.input_norm(x), positions, kv, layer, rag, impl)
    if block.post_attn_norm is not None:
        h = block.post_attn_norm(h)
    x = x + h
    h = block.mlp(block.pre_mlp_norm(x))
    if block.post_mlp_norm is not None:
        h = block.post_mlp_norm(h)
    return x + h, kv


def hidden_states(model, graphdefs, layers: LayerStack, kv, rag: Ragged, impl: str = "xla"):
    """Final-normed hidden states `[B', T', D]` (compute dtype) of `rag.tokens` and the pool `kv [L, ...]` with
    their keys/values written. `model`: the decoder (its embedding and final norm are read; its blocks' params
    come from `layers`, `stack_layers`'s). graphdefs and layers None: the model's own blocks, unrolled (each layer
    reads its params in place: no per-layer slice of stacked params, which XLA:CPU copies)."""
    x = jnp.take(model.embedding[...], rag.tokens, axis=0).astype(model.dtype)
    if model.config.embed_scale:
        x = x * jnp.asarray(math.sqrt(model.config.hidden_size), model.dtype)
    positions = rag.positions
    if layers is None:
        for i, block in enumerate(model.layers):
            x, kv = _block(block, x, positions, kv, i, rag, impl)
        return model.final_norm(x), kv
    gds, tail_gds = graphdefs
    p = len(gds)

    def body(carry, states):
        x, kv, layer = carry
        for j, (gd, st) in enumerate(zip(gds, states)):
            x, kv = _block(nnx.merge(gd, st), x, positions, kv, layer + j, rag, impl)
        return (x, kv, layer + p), None

    layer = jnp.int32(0)
    if p:
        (x, kv, layer), _ = jax.lax.scan(body, (x, kv, layer), layers.stacked)
    for gd, st in zip(tail_gds, layers.tail):
        x, kv = _block(nnx.merge(gd, st), x, positions, kv, layer, rag, impl)
        layer = layer + 1
    return model.final_norm(x), kv
