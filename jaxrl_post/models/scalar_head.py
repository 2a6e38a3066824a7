"""A scalar head on the decoder's hidden states: `h [B, T, D] -> [B, T] float32` (`h @ w (+ b)`).

Shared by the critic (verl's value head: per-token values, with a bias) and the reward model (HF
`*ForSequenceClassification`'s `score`: no bias, read at the last real token). The head is computed in
float32 whatever the backbone's compute dtype.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxrl_post.models.decoder import Transformer


def headless_backbone(owner: str, config, backbone, *, rngs, dtype=None, param_dtype=None, remat=False):
    """The `Transformer` a scalar-head model sits on: `backbone` (e.g. a copy of the policy) or a new one from
    `config`, with its LM head dropped (unused). Raises ValueError (naming `owner`) with neither."""
    if backbone is None:
        if config is None:
            raise ValueError(f"{owner} needs a config or a backbone")

        backbone = Transformer(config, rngs=rngs, dtype=dtype, param_dtype=param_dtype, remat=remat)
    backbone.lm_head = None
    return backbone


def head_param(d: int, *, stddev: float = 0.0, key: jax.Array | None = None) -> nnx.Param:
    """`[D, 1] float32` head kernel (logical axes ('embed', None)): zeros, or normal(0, stddev) from `key`."""
    if stddev and key is None:
        raise ValueError("head_param: a nonzero stddev needs a key")
    value = stddev * jax.random.normal(key, (d, 1), jnp.float32) if stddev else jnp.zeros((d, 1), jnp.float32)
    return nnx.Param(value, out_sharding=("embed", None), eager_sharding=False)


def scalar_head(h_BTD: jax.Array, w_D1: jax.Array, b_1: jax.Array | None = None) -> jax.Array:
    """`h [B, T, D]` (any float dtype), `w [D, 1]`, optional bias `[1]` -> `[B, T] float32`."""
    out = jnp.einsum("BTD,DO->BTO", h_BTD.astype(jnp.float32), w_D1.astype(jnp.float32))
    if b_1 is not None:
        out = out + b_1.astype(jnp.float32)
    return out[..., 0]
