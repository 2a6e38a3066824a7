"""Fused attention backends for forwards without a KV cache (training, old/ref log-probs, critic values).

`model.attention_impl` picks one (`resolve_attention_impl`; `Transformer.set_attention_impl`):

- "xla": the decoder's own dense path (`decoder.Attention`): float32 scores `[B, N, G*T, S]` and a
  `[B, T, S]` mask, recomputed in the backward pass. The only path of the cached (rollout) forward.
- "cudnn": `jax.nn.dot_product_attention(implementation="cudnn")`, cuDNN flash attention on GPU. The whole
  packed mask (causal, padding, segments, shared prompts, sliding window) goes in as its boolean `mask`
  `[B, 1, T, S]` with `is_causal=True`, GQA as fewer kv heads. `interpret=True` runs the same call with
  `implementation="xla"` (jax's reference of the same semantics: the CPU tests).
- "splash": Pallas splash attention (`jax.experimental.pallas.ops.tpu.splash_attention`), the TPU kernel
  MaxText uses: segment ids + a causal (or causal-local) static mask, GQA in MHA mode (query head h reads kv
  head h // G, the decoder's layout), logit soft-cap. `interpret=True`: Pallas interpret mode (CPU tests).
  Segment ids must be plain (one id per sequence): the shared-prompt layout (`decoder.segment_mask`) needs
  responses to see another segment, which equality of ids cannot say; the trainer turns that layout off
  under splash (`roles._pack_spec`).

- "chunked": exact memory-efficient attention in plain XLA (Rabe & Staats 2021, "Self-attention does not need
  O(n^2) memory"): queries in blocks of `CHUNK`, each block's scores against all keys made, used and dropped,
  and remade in the backward pass, so one block's float32 scores `[B, N, G*CHUNK, S]` are live instead of
  `[B, N, G*T, S]`. Any platform, the whole mask (segments, shared prompts, windows, soft-cap); the same math
  and dtypes as "xla". Never chosen by "auto" (the platform defaults stay as they are); for long rows whose
  dense scores do not fit, and as the stand-in for a flash kernel's memory in `scripts/memory_plan.py`.

Also the packed rows' segment mask (`segment_mask`, `SEGMENT_SUB_BITS`; re-exported by decoder.py) and the softmax
with attention sinks (`softmax_with_sinks`) that the dense path shares.

Shape letters as decoder.py: B batch, T queries, S keys (= T here), H query heads, N kv heads, K head dim.
"""

from __future__ import annotations

import functools
import logging

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_post.runtime.sharding import LOGICAL_AXIS_RULES, MESH_AXES

log = logging.getLogger(__name__)

ATTENTION_IMPLS = ("auto", "xla", "cudnn", "splash", "chunked")
CHUNK = 512  # queries per block of "chunked"
_NEG = float(np.finfo(np.float32).min)
_KERNEL_PLATFORM = {"cudnn": "gpu", "splash": "tpu"}
# Packed segment ids `chunk << SEGMENT_SUB_BITS | sub` (`segment_mask`; written by `engine/packing.py`)
SEGMENT_SUB_BITS = 16


def segment_mask(segment_ids: jax.Array) -> jax.Array:
    """Packed rows' attention mask `[B, T, T] bool` (query, key) from segment ids `[B, T] int32`: a key is
    visible from its own segment, and a shared prompt from its responses. Ids are `chunk << SEGMENT_SUB_BITS
    | sub` (`engine/packing.py`): sub 0 = a chunk's prompt, visible from the whole chunk; sub j >= 1 = a
    response, visible from itself. Plain ids 1, 2, ... (< 2^SEGMENT_SUB_BITS) are chunk 0 with distinct
    subs: each segment sees only itself (MaxText-style; 0 = padding, hidden by the attention mask)."""
    q, k = segment_ids[:, :, None], segment_ids[:, None, :]
    prompt_key = (k & ((1 << SEGMENT_SUB_BITS) - 1)) == 0
    return (q == k) | (prompt_key & ((q >> SEGMENT_SUB_BITS) == (k >> SEGMENT_SUB_BITS)))


def resolve_attention_impl(
    impl: str, platform: str, *, dtype, softcap: float | None = None, sinks: bool = False
) -> str:
    """`model.attention_impl` -> the backend to run: "xla", "cudnn", "splash" or "chunked" (any platform).

    "auto": "xla" for a model with attention sinks (`ModelConfig.attention_sinks`: neither kernel has them);
    else "splash" on TPU; "cudnn" on GPU when the compute `dtype` is bfloat16/float16 and the model has no
    attention logit soft-cap (cuDNN's flash attention supports neither float32 nor a soft-cap); else "xla".
    platform: `jax.default_backend()` ('cpu', 'gpu'/'cuda'/'rocm', 'tpu').

    Raises ValueError: an unknown name; "cudnn" off GPU or with float32 compute or a soft-cap; "splash" off
    TPU (both kernels run on CPU only in their test modes, `Transformer.set_attention_impl(interpret=True)`);
    "cudnn" or "splash" with sinks.
    """
    if impl not in ATTENTION_IMPLS:
        raise ValueError(f"config.model.attention_impl={impl!r}: expected one of {ATTENTION_IMPLS}")
    platform = "gpu" if platform in ("gpu", "cuda", "rocm") else platform
    half = jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
    if impl == "auto":
        if sinks:
            return "xla"
        if platform == "tpu":
            return "splash"
        return "cudnn" if platform == "gpu" and half and softcap is None else "xla"
    if impl in _KERNEL_PLATFORM and platform != _KERNEL_PLATFORM[impl]:
        raise ValueError(
            f"config.model.attention_impl={impl!r} is a {_KERNEL_PLATFORM[impl].upper()} kernel but the platform is "
            f"{platform!r}; use 'auto' or 'xla' (the dense path)"
        )
    if impl == "cudnn" and (not half or softcap is not None):
        why = f"compute dtype {jnp.dtype(dtype).name}" if not half else f"attn_logit_softcap={softcap}"
        raise ValueError(
            f"config.model.attention_impl='cudnn': cuDNN flash attention does not support {why}; "
            "use model.dtype='bfloat16' (and a model without a soft-cap) or attention_impl='xla'"
        )
    check_kernel_supported(impl, softcap=None, sinks=sinks)
    return impl


def check_kernel_supported(impl: str, *, softcap: float | None, sinks: bool = False) -> None:
    """Raises ValueError when backend `impl` cannot express the model's attention (cudnn: a logit soft-cap;
    cudnn and splash: attention sinks)."""
    if impl not in ATTENTION_IMPLS[1:]:
        raise ValueError(f"attention_impl must be 'xla', 'cudnn', 'splash' or 'chunked', got {impl!r}")
    if impl == "cudnn" and softcap is not None:
        raise ValueError(f"attention_impl='cudnn' has no logit soft-cap (the model's attn_logit_softcap={softcap})")
    if impl in ("cudnn", "splash") and sinks:
        raise ValueError(
            f"config.model.attention_impl={impl!r} has no attention sinks (GPT-OSS); use 'xla' or 'chunked'"
        )


def softmax_with_sinks(scores: jax.Array, sinks: jax.Array | None) -> jax.Array:
    """Softmax over the last axis with one extra logit per row in the denominator (attention sinks, HF GPT-OSS's
    `eager_attention_forward`): scores `[..., S]` float32, sinks broadcastable to `[..., 1]` float32 (None: a
    plain softmax). Returns `[..., S]` float32 (the sink's own probability is dropped)."""
    if sinks is None:
        return jax.nn.softmax(scores, axis=-1)
    full = jnp.concatenate([scores, jnp.broadcast_to(sinks, scores.shape[:-1] + (1,)).astype(scores.dtype)], axis=-1)
    return jax.nn.softmax(full, axis=-1)[..., :-1]


def chunked_attention(
    q, k, v, allowed, *, scale: float, softcap: float | None, dtype, chunk: int = CHUNK, sinks=None
) -> jax.Array:
    """Exact attention with the queries in blocks of `chunk` (the "chunked" backend; Rabe & Staats 2021).

    q `[B, T, H, K]`, k and v `[B, S, N, K]` (N divides H; head h = n * G + g reads kv head n, the decoder's
    layout), all in the compute `dtype`; allowed `[B, T, S] bool` (query, key), the decoder's mask; softcap:
    logit soft-cap (tanh) or None. Scores and softmax in float32, probabilities rounded to `dtype` before the
    value product, as the dense path. Each block is a `jax.checkpoint`ed `lax.map` step: the backward pass
    recomputes its scores, so at most one block's `[B, N, G*chunk, S] float32` scores are live. T not a multiple
    of `chunk`: the last block is padded with masked queries (their outputs dropped). sinks: `[H]` float32 attention
    sinks (`softmax_with_sinks`) or None. Returns `[B, T, H, K]` dtype.
    """
    b, t, h, kd = q.shape
    n = k.shape[2]
    g, c = h // n, min(chunk, t)
    nb = -(-t // c)
    if nb * c != t:
        q = jnp.pad(q, ((0, 0), (0, nb * c - t), (0, 0), (0, 0)))
        allowed = jnp.pad(allowed, ((0, 0), (0, nb * c - t), (0, 0)))
    qb = jnp.moveaxis(q.reshape(b, nb, c, n, g, kd), 1, 0)  # [nb, B, C, N, G, K]
    ab = jnp.moveaxis(allowed.reshape(b, nb, c, allowed.shape[-1]), 1, 0)  # [nb, B, C, S]

    @jax.checkpoint
    def block(args):
        qc, ac = args
        s = jnp.einsum("BCNGK,BSNK->BNGCS", qc, k, preferred_element_type=jnp.float32) * scale
        if softcap is not None:
            s = jnp.tanh(s / softcap) * softcap
        s = jnp.where(ac[:, None, None], s, _NEG)
        p = softmax_with_sinks(s, None if sinks is None else sinks.reshape(n, g)[None, :, :, None, None]).astype(dtype)
        return jnp.einsum("BNGCS,BSNK->BCNGK", p, v, preferred_element_type=jnp.float32).astype(dtype)

    out = jax.lax.map(block, (qb, ab))  # [nb, B, C, N, G, K]
    return jnp.moveaxis(out, 0, 1).reshape(b, nb * c, h, kd)[:, :t]


def dot_product_attention(q, k, v, allowed, *, scale: float, interpret: bool = False) -> jax.Array:
    """Attention through `jax.nn.dot_product_attention` (cuDNN on GPU; `interpret`: implementation="xla").

    q `[B, T, H, K]`, k and v `[B, S, N, K]` (N divides H; head h reads kv head h // (H / N)), all in the
    compute dtype; allowed `[B, T, S] bool` (query, key), the decoder's mask. Queries with no visible key
    (padding) see themselves instead (their outputs are unused; no 0/0). Odd T = S get one hidden padding
    slot (cuDNN's backward with a mask needs even lengths). Returns `[B, T, H, K]` in q.dtype.
    """
    t, s = allowed.shape[1:]
    if t == s and t % 2:
        pad = lambda x: jnp.pad(x, ((0, 0), (0, 1)) + ((0, 0),) * (x.ndim - 2))
        q, k, v, allowed = pad(q), pad(k), pad(v), jnp.pad(allowed, ((0, 0), (0, 1), (0, 1)))
    mask = allowed | jnp.eye(*allowed.shape[1:], dtype=bool)[None]
    out = jax.nn.dot_product_attention(
        q, k, v, mask=mask[:, None], scale=scale, is_causal=True, implementation="xla" if interpret else "cudnn"
    )
    return out[:, :t]


def _block(t: int, interpret: bool) -> int:
    for b in (512, 256, 128):
        if t % b == 0:
            return b
    if interpret:
        return t
    raise ValueError(
        f"attention_impl='splash' needs a sequence length that is a multiple of 128 (TPU tiles); got {t}. "
        "Pad the prompt/response lengths or the packed row length, or use attention_impl='xla'"
    )


@functools.lru_cache(maxsize=32)
def _splash_kernel(heads: int, t: int, window: int | None, softcap: float | None, interpret: bool):
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as sm

    if window is None:
        one = sm.CausalMask((t, t))
    else:  # HF: key visible iff q - window < key <= q
        one = sm.LocalMask((t, t), window_size=(window - 1, 0), offset=0)
    b = _block(t, interpret)
    sizes = sk.BlockSizes(
        block_q=b,
        block_kv=b,
        block_kv_compute=b,
        block_q_dkv=b,
        block_kv_dkv=b,
        block_kv_dkv_compute=b,
        block_q_dq=b,
        block_kv_dq=b,
    )
    return sk.make_splash_mha(
        sm.MultiHeadMask([one] * heads),
        block_sizes=sizes,
        attn_logits_soft_cap=softcap,
        head_shards=1,
        q_seq_shards=1,
        interpret=interpret,
    )


def splash_attention(
    q, k, v, segment_ids, *, scale: float, window: int | None, softcap: float | None, interpret: bool = False
):
    """Pallas splash attention, causal (and causal-local with `window`) within equal segment ids.

    q `[B, T, H, K]`, k and v `[B, T, N, K]` (compute dtype; N divides H, GQA as the decoder), segment_ids
    `[B, T] int32` (0 = padding: padding sees padding, so no row is empty). The scale multiplies q first
    (splash has no scale; the soft-cap then applies to scaled logits, as the dense path). Returns
    `[B, T, H, K]` in q.dtype. Raises ValueError when T is not a multiple of 128 (outside interpret mode).
    """
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk

    def local(q, k, v, ids):  # one device's rows and heads
        kernel = _splash_kernel(q.shape[2], q.shape[1], window, softcap, bool(interpret))
        qh = (q * jnp.asarray(scale, q.dtype)).transpose(0, 2, 1, 3)  # [B, H, T, K]
        kh, vh = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)  # [B, N, T, K]

        def one(qb, kb, vb, sb):
            return kernel(qb, kb, vb, segment_ids=sk.SegmentIds(q=sb, kv=sb))

        out = jax.vmap(one)(qh, kh, vh, ids)
        return out.astype(q.dtype).transpose(0, 2, 1, 3)

    ids = segment_ids.astype(jnp.int32)
    specs = _mesh_specs(q.shape[0], q.shape[2], k.shape[2])
    if specs is None:
        return local(q, k, v, ids)
    rows, heads = specs  # a Pallas call is not partitioned by XLA: run it per shard (MaxText does the same)
    qkv = jax.sharding.PartitionSpec(rows, None, heads, None)
    return jax.shard_map(
        local, in_specs=(qkv, qkv, qkv, jax.sharding.PartitionSpec(rows, None)), out_specs=qkv, check_vma=False
    )(q, k, v, ids)


def _mesh_specs(b: int, h: int, n: int):
    """(rows axes, heads axis) of the ambient mesh (`jax.set_mesh`, `sharding.InMesh`) that divide B and
    both head counts (None for an axis that does not), or None without a mesh of our axes."""

    mesh = jax.sharding.get_abstract_mesh()
    if mesh is None or mesh.empty or not set(MESH_AXES) <= set(mesh.axis_names):
        return None
    sizes = dict(zip(mesh.axis_names, mesh.axis_sizes))
    rows_axes = LOGICAL_AXIS_RULES["batch"]
    n_rows = int(np.prod([sizes[a] for a in rows_axes]))
    heads_axis = LOGICAL_AXIS_RULES["heads"]
    rows = rows_axes if b % n_rows == 0 else None
    heads = heads_axis if h % sizes[heads_axis] == 0 and n % sizes[heads_axis] == 0 else None
    return rows, heads


def padded_segment_ids(kv_mask: jax.Array) -> jax.Array:
    """Padded (unpacked) rows as splash segment ids `[B, T] int32`: 1 for real tokens, 0 for padding. Real
    tokens see every real token before them, as the dense path's causal & key-mask."""
    return kv_mask.astype(np.int32)
