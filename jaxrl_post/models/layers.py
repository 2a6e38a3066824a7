"""Building blocks of the decoder (decoder.py): deterministic hashed init, `ParamInit`, RMSNorm, RoPE, gated MLP.

Shape letters as in decoder.py (B batch, T tokens, K head dim). Params carry logical axis names
(`out_sharding` metadata) mapped to mesh axes by `jaxrl_post.runtime.sharding`.
"""

from __future__ import annotations

import math
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxrl_post.models.linear import Linear


def _fmix32(h: jax.Array) -> jax.Array:
    """murmur3 32-bit finalizer (uint32 -> uint32 avalanche hash); lax ops keep tracing cheap."""
    lax = jax.lax
    u32 = partial(lax.full_like, h)
    h = lax.mul(lax.bitwise_xor(h, lax.shift_right_logical(h, u32(16))), u32(0x85EBCA6B))
    h = lax.mul(lax.bitwise_xor(h, lax.shift_right_logical(h, u32(13))), u32(0xC2B2AE35))
    return lax.bitwise_xor(h, lax.shift_right_logical(h, u32(16)))


def hash_normal(seed: jax.Array, salt: int, shape, dtype, stddev: float = 0.02) -> jax.Array:
    """N(0, stddev^2) sample from a counter-based hash of (seed uint32 scalar, salt, element index) and
    Box-Muller.

    Used instead of `jax.random.normal` per param because XLA:CPU compiles every threefry op slowly (~1 s
    each; a 30-layer model has 200+ params) and NNX's Rngs counter update is quadratic to trace; this is
    a few elementwise integer ops, deterministic in (seed, salt), and partitions trivially when params are
    created under jit with out_shardings.
    """
    lax = jax.lax
    shape = tuple(shape)
    if math.prod(shape) >= 2**32:
        raise ValueError(f"hash_normal supports < 2**32 elements per param, got shape {shape}")
    s = _fmix32(lax.bitwise_xor(seed, jnp.uint32((salt * 0x9E3779B9) % 2**32)))
    idx, stride = None, 1  # row-major flat index, built from per-dim iotas (partitions without a flat iota)
    for d in reversed(range(len(shape))):
        term = lax.broadcasted_iota(jnp.uint32, shape, d)
        if stride > 1:
            term = lax.mul(term, lax.full_like(term, stride))
        idx = term if idx is None else lax.add(idx, term)
        stride *= shape[d]
    if idx is None:  # scalar param
        idx = jnp.zeros((), jnp.uint32)
    h1 = _fmix32(lax.bitwise_xor(idx, lax.broadcast(s, shape)))
    h2 = _fmix32(lax.bitwise_xor(h1, lax.broadcast(lax.bitwise_xor(s, jnp.uint32(0x68E31DA4)), shape)))
    u1 = (lax.shift_right_logical(h1, lax.full_like(h1, 8)).astype(jnp.float32) + 1.0) * (2.0**-24)  # (0,1]
    u2 = lax.shift_right_logical(h2, lax.full_like(h2, 8)).astype(jnp.float32) * (2.0**-24)  # [0,1)
    z = jnp.sqrt(-2.0 * jnp.log(u1)) * jnp.cos(2.0 * math.pi * u2)
    return (stddev * z).astype(dtype)


class ParamInit:
    """Creates the Params of one model from a single key (param i draws `hash_normal` salted by i)."""

    def __init__(self, key: jax.Array, param_dtype):
        words = jax.random.key_data(key).ravel().astype(jnp.uint32)
        seed = jnp.uint32(0x3C6EF372)
        for i in range(words.shape[0]):
            seed = _fmix32(jax.lax.bitwise_xor(seed, words[i]))
        self.seed, self.param_dtype, self.count = seed, param_dtype, 0

    def _param(self, value, names) -> nnx.Param:
        return nnx.Param(value, out_sharding=names, eager_sharding=False)

    def normal(self, shape, names, stddev: float = 0.02) -> nnx.Param:
        self.count += 1
        return self._param(hash_normal(self.seed, self.count, shape, self.param_dtype, stddev), names)

    def const(self, shape, names, value: float = 0.0) -> nnx.Param:
        return self._param(jnp.full(shape, value, self.param_dtype), names)


def _constrain(x: jax.Array, names: tuple) -> jax.Array:
    from jaxrl_post.runtime.sharding import constrain  # local: sharding imports nothing from models

    return constrain(x, names)


# ------------------------------------------------------------------------------------------ rope
def rope_inv_freq(head_dim: int, base: float, scaling: dict, max_pos: int | None = None) -> np.ndarray:
    """Static inverse frequencies [K/2] float32 (HF `ROPE_INIT_FUNCTIONS`: default, linear, llama3, yarn).

    max_pos: `max_position_embeddings`, YaRN's implied factor when `factor` is None.

    'dynamic' is handled in `_rope_angles` because it depends on the current positions.
    """
    inv = 1.0 / (base ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
    rope_type = scaling.get("rope_type", "default")
    if rope_type == "linear":
        inv = inv / scaling["factor"]
    elif rope_type == "llama3":  # Llama 3.1 frequency-dependent interpolation
        factor, lo, hi = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_ctx = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv
        scaled = np.where(wavelen > old_ctx / lo, inv / factor, inv)
        smooth = (old_ctx / wavelen - lo) / (hi - lo)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old_ctx / hi) & (wavelen <= old_ctx / lo)
        inv = np.where(medium, smoothed, scaled)
    elif rope_type == "yarn":  # YaRN (arXiv 2309.00071; HF `_compute_yarn_parameters`): per-dim ramp
        factor, old_ctx = _yarn_factor(scaling, max_pos), scaling["original_max_position_embeddings"]

        def dim_of(rotations):  # the dim whose wavelength makes `rotations` turns over the original context
            return head_dim * math.log(old_ctx / (rotations * 2 * math.pi)) / (2 * math.log(base))

        lo, hi = dim_of(scaling.get("beta_fast") or 32), dim_of(scaling.get("beta_slow") or 1)
        if scaling.get("truncate", True):
            lo, hi = math.floor(lo), math.ceil(hi)
        lo, hi = max(lo, 0), min(hi, head_dim - 1)
        ramp = np.clip(
            (np.arange(head_dim // 2, dtype=np.float32) - lo) / ((hi + 0.001 if lo == hi else hi) - lo), 0, 1
        )
        # HF computes the two frequency sets in float32; so do we (the parity tests compare at 1e-5)
        pos_freqs = np.float32(base) ** (np.arange(0, head_dim, 2).astype(np.float32) / np.float32(head_dim))
        extrapolate = (1 - ramp).astype(np.float32)
        inv = (1.0 / (factor * pos_freqs)) * (1 - extrapolate) + (1.0 / pos_freqs) * extrapolate
    return inv.astype(np.float32)


def _yarn_factor(scaling: dict, max_pos: int | None) -> float:
    factor = scaling.get("factor")
    return float(factor) if factor is not None else max_pos / scaling["original_max_position_embeddings"]


def rope_attention_factor(scaling: dict, max_pos: int | None = None) -> float:
    """The factor YaRN multiplies cos and sin by (HF's `attention_factor`; 1.0 for the other rope types): given, or
    `0.1 * ln(factor) + 1` (with `mscale` / `mscale_all_dim`: their ratio, as DeepSeek's). The decoder folds its
    square into the softmax scale (q and k both carry it), which is the same math."""
    if scaling.get("rope_type") != "yarn":
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    factor = _yarn_factor(scaling, max_pos)

    def mscale(m=1.0):
        return 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0

    m, m_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
    return float(mscale(m) / mscale(m_all)) if m and m_all else mscale()


def _rope_angles(positions: jax.Array, head_dim: int, base: float, scaling: dict, max_pos: int) -> jax.Array:
    """positions [B, T] int -> angles [B, T, K/2] float32."""
    pos = positions.astype(jnp.float32)
    if scaling.get("rope_type") == "dynamic":  # dynamic NTK: base grows with the longest position seen
        seq_len = jnp.maximum(jnp.max(positions) + 1, max_pos).astype(jnp.float32)
        factor = scaling["factor"]
        new_base = base * ((factor * seq_len / max_pos) - (factor - 1)) ** (head_dim / (head_dim - 2))
        inv = 1.0 / new_base ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim)
    else:
        inv = jnp.asarray(rope_inv_freq(head_dim, base, scaling, max_pos))
    return pos[..., None] * inv


def apply_rope(x: jax.Array, angles: jax.Array) -> jax.Array:
    """Rotate-half RoPE. x [B, T, N, K], angles [B, T, K/2] float32 -> [B, T, N, K] in x.dtype."""
    ang = jnp.concatenate([angles, angles], axis=-1)[:, :, None, :]
    xf = x.astype(jnp.float32)
    x1, x2 = jnp.split(xf, 2, axis=-1)
    rotated = jnp.concatenate([-x2, x1], axis=-1)
    return (xf * jnp.cos(ang) + rotated * jnp.sin(ang)).astype(x.dtype)


def positions_from_mask(attention_mask: jax.Array, prior: jax.Array | int = 0) -> jax.Array:
    """Per-row positions [B, T] int32: number of real tokens before each token (plus `prior` [B] real tokens
    already in the cache), clamped at 0 for leading padding (verl: clip(cumsum(mask) - 1, 0))."""
    m = attention_mask.astype(jnp.int32)
    pos = jnp.cumsum(m, axis=1) - 1 + jnp.asarray(prior, jnp.int32).reshape(-1, 1)
    return jnp.maximum(pos, 0)


# ------------------------------------------------------------------------------------ layers
class RMSNorm(nnx.Module):
    """RMSNorm over the last axis, statistics in float32.

    offset 0 (Llama): `w * norm(x)` (normalized value cast to x.dtype first);
    offset 1 (Gemma): `norm(x) * (1 + w)` in float32, then cast.
    """

    def __init__(self, dim: int, *, eps: float, offset: float, names: tuple, init: ParamInit):
        self.eps, self.offset = eps, offset
        self.scale = init.const((dim,), names, 1.0 - offset)

    def __call__(self, x: jax.Array) -> jax.Array:
        xf = x.astype(jnp.float32)
        y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
        if self.offset:
            return (y * (self.offset + self.scale[...].astype(jnp.float32))).astype(x.dtype)
        return y.astype(x.dtype) * self.scale[...].astype(x.dtype)


def activation(name: str, x: jax.Array) -> jax.Array:
    """The gated MLPs' activation: 'silu' (SwiGLU), 'gelu_pytorch_tanh' / 'gelu_new' (tanh approximation),
    'gelu' (exact erf)."""
    if name == "silu":
        return jax.nn.silu(x)
    return jax.nn.gelu(x, approximate=name != "gelu")


def clamped_swiglu(gate: jax.Array, up: jax.Array, alpha: float, limit: float) -> jax.Array:
    """GPT-OSS's expert activation (HF `GptOssExperts._apply_gate`): gate clamped above at `limit`, up clamped to
    `[-limit, limit]`, `(up + 1) * gate * sigmoid(alpha * gate)`. Same shapes and dtype in and out."""
    gate = jnp.minimum(gate, limit)
    up = jnp.clip(up, -limit, limit)
    return (up + 1) * (gate * jax.nn.sigmoid(gate * alpha))


class MLP(nnx.Module):
    """Gated MLP: down(act(x @ gate) * (x @ up)); SwiGLU (silu) or GeGLU (tanh gelu). `intermediate_size`
    overrides `cfg.intermediate_size` (F)."""

    def __init__(self, cfg, *, dtype, init: ParamInit, intermediate_size: int | None = None):
        d, f = cfg.hidden_size, intermediate_size or cfg.intermediate_size
        self.act, self.dtype = cfg.hidden_act, dtype
        self.gate_proj = Linear("BTD,DF->BTF", init.normal((d, f), ("embed", "mlp")), dtype=dtype)
        self.up_proj = Linear("BTD,DF->BTF", init.normal((d, f), ("embed", "mlp")), dtype=dtype)
        self.down_proj = Linear("BTF,FD->BTD", init.normal((f, d), ("mlp", "embed")), dtype=dtype)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.down_proj(activation(self.act, self.gate_proj(x)) * self.up_proj(x))
