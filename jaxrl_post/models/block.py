"""The decoder's residual block and its layer loop without a cache as `lax.scan` (MaxText `scan_layers`).

`Block` is attention (built by decoder.py and passed in) + the dense MLP or the MoE block (`ModelConfig.is_moe_layer`),
with pre-norms (and Gemma's post-norms). `layer_period` finds the shortest repeating pattern of the layers' static
attributes; `scan_blocks` traces one group and scans it over the stacked params of all groups (used by
`decoder.Transformer.hidden_states` when `scan_layers` is on).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxrl_post.models.config import ModelConfig
from jaxrl_post.models.layers import MLP, ParamInit, RMSNorm, _constrain
from jaxrl_post.models.moe import MoE


class Block(nnx.Module):
    """Pre-norm residual block; Gemma adds post-attention and post-MLP norms (`post_norms`). attn: the layer's
    `decoder.Attention`."""

    def __init__(self, cfg: ModelConfig, layer: int, attn: nnx.Module, *, dtype, init: ParamInit):
        def norm():
            return RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps, offset=cfg.norm_offset, names=("norm",), init=init)

        self.input_norm = norm()
        self.attn = attn
        self.post_attn_norm = norm() if cfg.post_norms else None
        self.pre_mlp_norm = norm()
        self.mlp = (MoE if cfg.is_moe_layer(layer) else MLP)(cfg, dtype=dtype, init=init)
        self.post_mlp_norm = norm() if cfg.post_norms else None

    def __call__(self, x, positions, kv_mask, index, kv=None, segment_ids=None, moe_in=None):
        """As `decoder.Attention.__call__`, plus moe_in: (token_mask [B, T] bool, forced routes [B, T, k] or
        None) for an MoE layer (default: every token counted, no forced routes). Returns (x, kv, MoE stats or
        None)."""
        h, kv = self.attn(self.input_norm(x), positions, kv_mask, index, kv, segment_ids)
        if self.post_attn_norm is not None:
            h = self.post_attn_norm(h)
        x = x + h
        stats = None
        if isinstance(self.mlp, MoE):
            token_mask, routes = moe_in or (jnp.ones(x.shape[:2], bool), None)
            h, stats = self.mlp(self.pre_mlp_norm(x), token_mask, routes)
        else:
            h = self.mlp(self.pre_mlp_norm(x))
        if self.post_mlp_norm is not None:
            h = self.post_mlp_norm(h)
        return _constrain(x + h, ("batch", None, None)), kv, stats


def run_block(block: Block, x, positions, kv_mask, index, segment_ids=None, moe_in=None):
    """One layer of a forward without a cache -> (x, MoE stats or None)."""
    x, _, stats = block(x, positions, kv_mask, index, segment_ids=segment_ids, moe_in=moe_in)
    return x, stats


def layer_period(config: ModelConfig) -> int:
    """Smallest p such that layer i and layer i % p have the same static attributes (sliding window,
    rope base/scaling, MoE or dense MLP): 1 for Llama/Qwen, 2 for Gemma 2, 6 for Gemma 3 (5 local : 1 global)."""
    sig = [
        (config.is_sliding(i), config.layer_rope(i)[0], str(config.layer_rope(i)[1]), config.is_moe_layer(i))
        for i in range(config.num_layers)
    ]
    for p in range(1, len(sig) + 1):
        if all(sig[i] == sig[i % p] for i in range(len(sig))):
            return p
    return len(sig)


def scan_blocks(layers, p: int, run, x, positions, kv_mask, index, segment_ids=None, token_mask=None, routes=None):
    """Apply `layers` (length L, period p = `layer_period`) as `lax.scan` over L // p groups of p layers,
    then the L % p remaining layers unrolled (Gemma's local/global pattern is one group). Each group's params
    are stacked `[L // p, ...]` inside the traced function (one copy of the params; the gradient flows back to
    every layer's own params), so the body is traced and compiled once instead of L times. Equal to the
    unrolled loop up to float reassociation.

    run: `run(block, x, positions, kv_mask, index, segment_ids, (token_mask, routes_i)) -> (x, stats_i)`
    (`run_block`); routes: per layer forced MoE routes `[B, T, k]` or None (None: no replay).
    Returns (x, [stats_i per layer]). Raises ValueError when layers j, j + p, ... differ in param structure.
    """
    routes = [None] * len(layers) if routes is None else list(routes)

    def call(block, h, r):
        return run(block, h, positions, kv_mask, index, segment_ids, (token_mask, r))

    n_groups = len(layers) // p
    stats = [None] * len(layers)
    if n_groups < 2:
        for i, block in enumerate(layers):
            x, stats[i] = call(block, x, routes[i])
        return x, stats
    graphdefs, stacked = [], []
    for j in range(p):
        splits = [nnx.split(layers[g * p + j]) for g in range(n_groups)]
        if any(gd != splits[0][0] for gd, _ in splits):
            raise ValueError(f"layers {j}, {j + p}, ... differ in structure; they cannot be scanned with period {p}")
        graphdefs.append(splits[0][0])
        stacked.append(jax.tree.map(lambda *xs: jnp.stack(xs), *[st for _, st in splits]))
    xs_routes = tuple(
        None if routes[j] is None else jnp.stack([routes[g * p + j] for g in range(n_groups)]) for j in range(p)
    )

    def body(h, inputs):
        outs = []
        for gd, st, r in zip(graphdefs, *inputs):
            h, s = call(nnx.merge(gd, st), h, r)
            outs.append(s)
        return h, tuple(outs)

    x, ys = jax.lax.scan(body, x, (tuple(stacked), xs_routes))
    for g in range(n_groups):
        for j in range(p):
            stats[g * p + j] = jax.tree.map(lambda a, g=g: a[g], ys[j])
    for i in range(n_groups * p, len(layers)):
        x, stats[i] = call(layers[i], x, routes[i])
    return x, stats
