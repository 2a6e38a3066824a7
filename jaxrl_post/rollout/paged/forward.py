"""The decoder's forward over the paged KV pool: the project's `models.decoder.Transformer` modules (projections,
norms, RoPE, MLP) with attention replaced by ragged paged attention, layers run as a `lax.scan` over stacked
params (`stack_layers`, period as `decoder.layer_period`: 1 for Llama/Qwen, 2 for Gemma 2, 6 for Gemma 3) that
carries the whole pool, so each step writes its new keys/values in place and reads only the pages it gathers.

`Ragged` holds one call's token layout: tokens `[B', T']` (decode: one token per slot, `[S, 1]`; prefill: a chunk
of prompt tokens, `[1, T]`), each token's position in its sequence (its RoPE position and slot), its flat pool slot,
the kernel's per-sequence metadata (`attention` module docstring) and which tokens are real.

MoE layers run the decoder's own `models.moe.MoE` on the call's B' * T' tokens, padding included: routing is per
token and the dispatch dropless, so a padded slot changes no real token's experts or output; the token mask keeps
padding out of the routing statistics. `hidden_states(..., with_routes=True)` also returns every token's experts
(routing replay's `routed_experts`, issue 58).
"""

from __future__ import annotations

import math

import flax.struct
import jax
import jax.numpy as jnp
from flax import nnx

from jaxrl_post.models.decoder import layer_period
from jaxrl_post.models.layers import _rope_angles, apply_rope
from jaxrl_post.models.moe import MoE, routes_dtype
from jaxrl_post.rollout.paged.attention import paged_attention
from jaxrl_post.rollout.paged.kv_pool import constrain_pool, write_kv


@flax.struct.dataclass
class Ragged:
    """tokens `[B', T'] int32`; positions `[B', T'] int32` (index in the sequence); slots `[B' * T'] int32` (flat
    pool slots, the null page's for padding); kv_lens `[S] int32`, page_indices `[S, pages_per_seq] int32`,
    cu_q_lens `[S + 1] int32`, num_seqs `[1] int32` over the B' * T' tokens flattened (row-major); token_mask
    `[B', T'] bool` (real tokens, counted in MoE routing statistics) or None (all); decode (static): a decode step,
    one token per sequence (`[S, 1]`, the GPU kernel's case; `attention.paged_attention`)."""

    tokens: jax.Array
    positions: jax.Array
    slots: jax.Array
    kv_lens: jax.Array
    page_indices: jax.Array
    cu_q_lens: jax.Array
    num_seqs: jax.Array
    token_mask: jax.Array | None = None
    decode: bool = flax.struct.field(pytree_node=False, default=False)


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
    kv = constrain_pool(write_kv(kv, layer, flat(k), flat(v), rag.slots))  # kv heads stay split (a mesh's 'tensor')
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
        sinks=None if attn.sinks is None else attn.sinks[...],
        dtype=attn.dtype,
        impl=impl,
        layer=layer,
        decode=rag.decode,
    )
    return attn.o_proj(out.reshape(b, t, attn.num_heads, attn.head_dim)), kv


def _block(block, x, positions, kv, layer, rag: Ragged, impl: str):
    """`decoder.Block.__call__` with `_attention` (pre-norm residual; Gemma's post norms). Returns (x, pool, the
    tokens' experts `[B', T', k] int32` of an MoE layer, else None)."""
    h, kv = _attention(block.attn, block.input_norm(x), positions, kv, layer, rag, impl)
    if block.post_attn_norm is not None:
        h = block.post_attn_norm(h)
    x = x + h
    experts = None
    if isinstance(block.mlp, MoE):
        mask = jnp.ones(x.shape[:2], bool) if rag.token_mask is None else rag.token_mask
        h, (experts, *_) = block.mlp(block.pre_mlp_norm(x), mask)
    else:
        h = block.mlp(block.pre_mlp_norm(x))
    if block.post_mlp_norm is not None:
        h = block.post_mlp_norm(h)
    return x + h, kv, experts


def _routes(per_layer: list, num_experts: int):
    """Experts per layer (None for dense layers), in layer order -> `[B', T', M, k]` (`moe.routes_dtype`)."""
    moe = [e for e in per_layer if e is not None]
    return jnp.stack(moe, axis=2).astype(routes_dtype(num_experts)) if moe else None


def hidden_states(model, graphdefs, layers: LayerStack, kv, rag: Ragged, impl: str = "xla", with_routes: bool = False):
    """Final-normed hidden states `[B', T', D]` (compute dtype) of `rag.tokens` and the pool `kv [L, ...]` with
    their keys/values written. `model`: the decoder (its embedding and final norm are read; its blocks' params
    come from `layers`, `stack_layers`'s). graphdefs and layers None: the model's own blocks, unrolled (each layer
    reads its params in place: no per-layer slice of stacked params, which XLA:CPU copies).
    with_routes: returns (hidden, pool, routes): routes `[B', T', M, k]` uint8/int16, each token's experts in the
    model's M MoE layers (`moe.MoEOutput.routed_experts`'s layout), None for a dense model."""
    x = jnp.take(model.embedding[...], rag.tokens, axis=0).astype(model.dtype)
    if model.config.embed_scale:
        x = x * jnp.asarray(math.sqrt(model.config.hidden_size), model.dtype)
    positions, experts = rag.positions, []
    if layers is None:
        for i, block in enumerate(model.layers):
            x, kv, e = _block(block, x, positions, kv, i, rag, impl)
            experts.append(e)
    else:
        gds, tail_gds = graphdefs
        p = len(gds)

        def body(carry, states):
            x, kv, layer = carry
            es = []
            for j, (gd, st) in enumerate(zip(gds, states)):
                x, kv, e = _block(nnx.merge(gd, st), x, positions, kv, layer + j, rag, impl)
                es.append(e)
            return (x, kv, layer + p), (tuple(es) if with_routes else None)

        layer = jnp.int32(0)
        if p:
            (x, kv, layer), ys = jax.lax.scan(body, (x, kv, layer), layers.stacked)
            groups = jax.tree.leaves(layers.stacked)[0].shape[0]  # L // p
            ys = ys or (None,) * p
            experts = [None if ys[j] is None else ys[j][g] for g in range(groups) for j in range(p)]
        for gd, st in zip(tail_gds, layers.tail):
            x, kv, e = _block(nnx.merge(gd, st), x, positions, kv, layer, rag, impl)
            experts.append(e)
            layer = layer + 1
    h = model.final_norm(x)
    return (h, kv, _routes(experts, model.config.num_experts)) if with_routes else (h, kv)
