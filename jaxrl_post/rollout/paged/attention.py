"""Attention of queries over the paged KV pool, ragged: sequences with different query and key counts in one call.

The inputs are those of the Pallas TPU kernel `jax.experimental.pallas.ops.tpu.ragged_paged_attention` (vLLM's
TPU backend uses the same): queries `q [T, H, K]` of all sequences concatenated, `cu_q_lens [S + 1] int32`
(sequence i's queries are `q[cu_q_lens[i]:cu_q_lens[i + 1]]`), `kv_lens [S] int32` (keys in its pages, its new
tokens' included: its queries are its last `q_len` tokens, causal), `page_indices [S, pages_per_seq] int32`, and
`num_seqs [1] int32` (only the first `num_seqs` sequences are real). Shape letters: T query tokens, H query heads,
N kv heads (head h reads kv head h // (H / N), the decoder's GQA layout), K head dim, S sequences.

- "xla": exact, any platform (the CPU rollout and the tests): each query gathers its sequence's pages and runs the
  decoder's dense math (`decoder.Attention`): float32 scores, the scale, the soft-cap, a causal (and sliding-window)
  mask with the same fill value, attention sinks (GPT-OSS), probabilities rounded to the compute dtype before the
  value product. Memory `[T, pages_per_seq * page_size]` per head: meant for decode and small prefills.
- "pallas_tpu": the TPU kernel (flash-style online softmax in float32). Under an ambient mesh (`jax.set_mesh`) with
  a 'tensor' axis of size tp > 1 (the engine's rollout tensor parallelism) it runs in a `jax.shard_map` over the
  mesh: each device calls the kernel on its H / tp query heads and its slice of the pool's combined-head dim (the
  2N / tp interleaved keys and values of kv heads d * N / tp ... (d + 1) * N / tp - 1, exactly the heads its query
  heads read under the GQA layout), with the page tables, lengths and `num_seqs` replicated; the output stays split
  over heads (the output projection's all-reduce follows, as for the XLA path). No communication inside.
  No attention sinks (GPT-OSS models take the XLA path).
- "pallas_gpu": decode steps (`decode=True`: one query per sequence, query i sequence i's last token) run the
  Pallas GPU (Triton) kernel over the pool as it is (`attention_gpu.py`: the pool passed as keys and values with
  per-head block specs, no copy); prefill chunks (several queries per sequence) take the XLA path. Under a 'tensor'
  mesh axis it runs in the same `jax.shard_map` as "pallas_tpu". No sliding window, no sinks (such models take the
  XLA path, `resolve_for_model`). "pallas_gpu_interpret": the same in Pallas interpret mode (any platform; CPU
  tests), what `resolve_paged_attention_impl("pallas_gpu", ..., interpret=True)` returns.
"""

from __future__ import annotations

import functools
import logging

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from jaxrl_post.models.attention import softmax_with_sinks
from jaxrl_post.rollout.paged.attention_gpu import gpu_kernel_unsupported, paged_decode_attention_gpu

log = logging.getLogger(__name__)
PAGED_ATTENTION_IMPLS = ("xla", "pallas_tpu", "pallas_gpu")
GPU_PLATFORMS = ("gpu", "cuda")  # `jax.default_backend()` names CUDA devices 'gpu'
GPU_INTERPRET = "pallas_gpu_interpret"  # the GPU kernel in Pallas interpret mode (CPU tests; not a user choice)
TENSOR_AXIS = "tensor"  # the rollout mesh's tensor-parallel axis (the pool's combined heads are split over it)
_NEG = float(np.finfo(np.float32).min)  # the decoder's mask fill
MIN_SEGMENT_SLOTS = 128  # the XLA path's page-table segments hold at least this many slots (`_segment_pages`)


def resolve_paged_attention_impl(impl: str, platform: str, *, interpret: bool = False) -> str:
    """ "auto" -> "pallas_tpu" on TPU, "pallas_gpu" on 'gpu' / 'cuda', else "xla". interpret: a GPU kernel runs
    in Pallas interpret mode ("pallas_gpu" -> "pallas_gpu_interpret", any platform). Raises ValueError for an
    unknown name or a kernel named off its platform ("pallas_gpu" off GPU without interpret)."""
    if impl == "auto":
        impl = "pallas_tpu" if platform == "tpu" else "pallas_gpu" if platform in GPU_PLATFORMS else "xla"
    if impl not in PAGED_ATTENTION_IMPLS:
        raise ValueError(f"paged attention impl {impl!r}: expected 'auto' or one of {PAGED_ATTENTION_IMPLS}")
    if impl == "pallas_tpu" and platform != "tpu":
        raise ValueError(f"paged attention impl 'pallas_tpu' is a TPU kernel but the platform is {platform!r}")
    if impl == "pallas_gpu" and interpret:
        return GPU_INTERPRET
    if impl == "pallas_gpu" and platform not in GPU_PLATFORMS:
        raise ValueError(f"paged attention impl 'pallas_gpu' is a GPU kernel but the platform is {platform!r}")
    return impl


def resolve_for_model(impl: str, platform: str, config, page_size: int, *, interpret: bool = False) -> str:
    """The paged engine's impl for a model (`models.ModelConfig`, or None: no model checks):
    `resolve_paged_attention_impl`, then a kernel that cannot run the model (the TPU kernel: attention sinks; the
    GPU kernel: sinks, a sliding window in any layer, a head_dim or `page_size` Triton cannot tile,
    `attention_gpu.gpu_kernel_unsupported`) gives "xla" under "auto" (logged) and raises ValueError when
    named."""
    got = resolve_paged_attention_impl(impl, platform, interpret=interpret)
    if config is None or got == "xla":
        return got
    sinks = bool(getattr(config, "attention_sinks", False))
    if got == "pallas_tpu":
        why = "it has no attention sinks (GPT-OSS)" if sinks else None
    else:
        window = any(config.is_sliding(i) for i in range(config.num_layers))
        why = gpu_kernel_unsupported(config.head_dim, page_size, window, sinks)
    if why is None:
        return got
    name = "pallas_tpu" if got == "pallas_tpu" else "pallas_gpu"
    if impl != "auto":
        raise ValueError(f"paged attention '{name}' cannot run this model: {why}; use 'xla'")
    log.info("paged rollout: the %s kernel cannot run this model (%s); it uses the XLA attention", name, why)
    return "xla"


def query_positions(cu_q_lens: jax.Array, kv_lens: jax.Array, num_seqs: jax.Array, t: int):
    """(sequence `[T] int32`, position in that sequence `[T] int32`, real `[T] bool`) of each of the T query
    tokens of the ragged layout; padding tokens past `cu_q_lens[num_seqs]` are not real (sequence clamped)."""
    tok = jnp.arange(t, dtype=jnp.int32)
    s = kv_lens.shape[0]
    seq = jnp.clip(jnp.searchsorted(cu_q_lens[1:], tok, side="right").astype(jnp.int32), 0, s - 1)
    real = tok < cu_q_lens[num_seqs[0]]
    q_len = cu_q_lens[seq + 1] - cu_q_lens[seq]
    pos = kv_lens[seq] - q_len + (tok - cu_q_lens[seq])
    return seq, jnp.where(real, pos, 0), real


def _segment_pages(pps: int, page_size: int) -> int:
    """Pages per segment of the XLA path: an eighth of the table, at least `MIN_SEGMENT_SLOTS` slots."""
    return max(-(-MIN_SEGMENT_SLOTS // page_size), -(-pps // 8))


def paged_attention_xla(
    q,
    kv_pages,
    kv_lens,
    page_indices,
    cu_q_lens,
    num_seqs,
    *,
    sm_scale,
    sliding_window=None,
    soft_cap=None,
    dtype=None,
    layer=None,
    segment_pages=None,
    sinks=None,
):
    """Exact XLA ragged paged attention (module docstring). kv_pages `[P, page_size, 2N, K]`, or the whole pool
    `[L, P, page_size, 2N, K]` with `layer` (int32 scalar): the pages are gathered from it directly (no copy of
    the layer); dtype: the compute dtype the probabilities are rounded to (default q.dtype). The page tables are
    split into segments of `segment_pages` pages (default `_segment_pages`); a segment no query sees is neither
    gathered nor multiplied (`lax.cond`, as the dense cache's segments), so a step costs about the pages written.
    sinks: `[H]` float32 attention sinks (`models.attention.softmax_with_sinks`) or None.
    Returns `[T, H, K]` in dtype; padding queries give 0."""
    dtype = jnp.dtype(dtype or q.dtype)
    t, h, kd = q.shape
    ps, n2 = kv_pages.shape[-3:-1]
    n, pps = n2 // 2, page_indices.shape[1]
    g = h // n
    seq, pos, real = query_positions(cu_q_lens, kv_lens, num_seqs, t)
    att = jnp.promote_types(dtype, kv_pages.dtype)  # a wider cache is read as it is (decoder.Attention)
    tables = page_indices[seq]  # [T, pages_per_seq]
    slot = jnp.arange(pps * ps, dtype=jnp.int32)[None]
    allowed = (slot <= pos[:, None]) & real[:, None]  # [T, S_max]
    if sliding_window is not None:
        allowed &= slot > pos[:, None] - sliding_window
    sp = segment_pages or _segment_pages(pps, ps)
    bounds = [(lo, min(lo + sp, pps)) for lo in range(0, pps, sp)]
    visible = [jnp.any(allowed[:, lo * ps : hi * ps]) for lo, hi in bounds]

    def pages(lo, hi, half):  # keys (half 0) or values (half 1) of pages [lo, hi): [T, (hi - lo) * ps, N, K]
        x = kv_pages[tables[:, lo:hi]] if layer is None else kv_pages[layer, tables[:, lo:hi]]
        # [.., 2N, K] -> [.., N, 2, K]: splits the combined heads as a 'tensor'-sharded pool holds them (kv head n
        # whole on one device), where a stride-2 slice would not
        return x.reshape(*x.shape[:-2], n, 2, kd)[..., half, :].reshape(t, (hi - lo) * ps, n, kd).astype(att)

    def segment(i, fn, shape, fill):
        if len(bounds) == 1:
            return fn()
        return jax.lax.cond(visible[i], fn, lambda: jnp.full(shape, fill, jnp.float32))

    qg = q.reshape(t, n, g, kd).astype(att)
    scores = [
        segment(
            i,
            lambda lo=lo, hi=hi: jnp.einsum(
                "TNGK,TSNK->TNGS", qg, pages(lo, hi, 0), preferred_element_type=jnp.float32
            ),
            (t, n, g, (hi - lo) * ps),
            _NEG,
        )
        for i, (lo, hi) in enumerate(bounds)
    ]
    scores = jnp.concatenate(scores, axis=-1) * sm_scale
    if soft_cap is not None:
        scores = jnp.tanh(scores / soft_cap) * soft_cap
    scores = jnp.where(allowed[:, None, None], scores, _NEG)
    sink = None if sinks is None else sinks.astype(jnp.float32).reshape(n, g)[None, :, :, None]
    probs = softmax_with_sinks(scores, sink).astype(dtype).astype(att)
    out = None
    for i, (lo, hi) in enumerate(bounds):
        part = segment(
            i,
            lambda lo=lo, hi=hi: jnp.einsum(
                "TNGS,TSNK->TNGK", probs[..., lo * ps : hi * ps], pages(lo, hi, 1), preferred_element_type=jnp.float32
            ),
            (t, n, g, kd),
            0.0,
        )
        out = part if out is None else out + part
    return jnp.where(real[:, None, None, None], out, 0.0).astype(dtype).reshape(t, h, kd)


def paged_attention_pallas_tpu(
    q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, *, sm_scale, sliding_window=None, soft_cap=None
):
    """The Pallas TPU kernel, with static block sizes (so tracing needs no TPU device kind): all of a sequence's
    pages per block up to 16, queries per block min(T, 32). Returns `[T, H, K]` in q.dtype."""
    from jax.experimental.pallas.ops.tpu.ragged_paged_attention import ragged_paged_attention

    q_blk = min(q.shape[0], 32)
    return ragged_paged_attention(
        q,
        kv_pages.astype(q.dtype),
        kv_lens,
        page_indices,
        cu_q_lens,
        num_seqs,
        sm_scale=sm_scale,
        sliding_window=sliding_window,
        soft_cap=soft_cap,
        num_kv_pages_per_block=min(page_indices.shape[1], 16),
        num_queries_per_block=q_blk,
        vmem_limit_bytes=64 * 1024 * 1024,
    )


def tensor_parallel_size() -> int:
    """Size of the ambient mesh's 'tensor' axis (`jax.set_mesh`; 1 without a mesh or without that axis)."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh is None or mesh.empty or TENSOR_AXIS not in mesh.axis_names:
        return 1
    return dict(zip(mesh.axis_names, mesh.axis_sizes))[TENSOR_AXIS]


def _kernel_over_pool(q, pool, kv_lens, page_indices, cu_q_lens, num_seqs, layer, *, impl, dtype, **kw):
    """The kernel `impl` on layer `layer` of a whole pool `[L, P, page_size, 2N, K]`: the layers' pages as one pool
    (a free reshape), the tables offset to this layer's pages. The GPU kernel: a decode step (query i sequence i's
    last token; sequences past `num_seqs` get length 0, so 0 out, as the XLA path's padding)."""
    num_layers, num_pages = pool.shape[:2]
    pool = pool.reshape(num_layers * num_pages, *pool.shape[2:])
    tables = page_indices + layer * num_pages
    if impl == "pallas_tpu":
        return paged_attention_pallas_tpu(q.astype(dtype), pool, kv_lens, tables, cu_q_lens, num_seqs, **kw)
    lengths = jnp.where(jnp.arange(kv_lens.shape[0]) < num_seqs[0], kv_lens, 0)
    return paged_decode_attention_gpu(
        q.astype(dtype),
        pool,
        lengths,
        tables,
        sm_scale=kw["sm_scale"],
        soft_cap=kw["soft_cap"],
        interpret=impl == GPU_INTERPRET,
    )


def paged_attention(
    q,
    kv_pages,
    kv_lens,
    page_indices,
    cu_q_lens,
    num_seqs,
    *,
    sm_scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    dtype=None,
    impl: str = "xla",
    layer=None,
    segment_pages=None,
    sinks=None,
    decode: bool = False,
):
    """Ragged paged attention through `impl` ("xla", "pallas_tpu", "pallas_gpu" or "pallas_gpu_interpret";
    `resolve_paged_attention_impl`). Shapes as the module docstring (kv_pages one layer's, or the whole pool with
    `layer`); segment_pages, sinks: the XLA path's (`paged_attention_xla`). decode: one query per sequence (T = S,
    query i is sequence i's last token, `cu_q_lens` = 0 ... S); the GPU kernel runs only then, other calls take
    the XLA path. Returns `[T, H, K]` in dtype (default q.dtype). Raises ValueError for a kernel under a 'tensor'
    mesh axis that does not divide the query and kv heads, with sinks, or (GPU) with a sliding window or T != S."""
    gpu = impl in ("pallas_gpu", GPU_INTERPRET)
    if impl == "pallas_tpu" or (gpu and decode):
        if sinks is not None:
            raise ValueError(f"the {impl} paged attention has no attention sinks (GPT-OSS); use the 'xla' impl")
        if gpu and sliding_window is not None:
            raise ValueError("the Pallas GPU paged attention has no sliding window; use the 'xla' impl")
        if gpu and q.shape[0] != page_indices.shape[0]:
            raise ValueError(f"paged decode attention: {q.shape[0]} queries for {page_indices.shape[0]} sequences")
        dt = dtype or q.dtype
        kernel = functools.partial(
            _kernel_over_pool, impl=impl, dtype=dt, sm_scale=sm_scale, soft_cap=soft_cap, sliding_window=sliding_window
        )
        if layer is None:  # one layer's pages: a pool of one layer
            kv_pages, layer = kv_pages[None], jnp.int32(0)
        tp = tensor_parallel_size()
        if tp > 1:  # each device: its query heads over its kv heads' slice of the pool (module docstring)
            n = kv_pages.shape[-2] // 2
            if q.shape[1] % tp or n % tp:
                raise ValueError(
                    f"paged attention: the 'tensor' size {tp} must divide {q.shape[1]} query and {n} kv heads"
                )
            heads, rep = P(None, TENSOR_AXIS, None), P()
            kernel = jax.shard_map(
                kernel,
                in_specs=(heads, P(None, None, None, TENSOR_AXIS, None), rep, rep, rep, rep, rep),
                out_specs=heads,
                check_vma=False,
            )
        return kernel(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, layer).astype(dt)
    return paged_attention_xla(
        q,
        kv_pages,
        kv_lens,
        page_indices,
        cu_q_lens,
        num_seqs,
        sm_scale=sm_scale,
        sliding_window=sliding_window,
        soft_cap=soft_cap,
        dtype=dtype,
        layer=layer,
        segment_pages=segment_pages,
        sinks=sinks,
    )
