"""Paged decode attention on GPU: the Pallas GPU (Triton) kernel of jax 0.10,
`jax.experimental.pallas.ops.gpu.paged_attention.paged_attention_kernel`, over the engine's page pool as it is.

The kernel's public wrapper (`paged_attention`) takes keys and values as two arrays `[N, total_pages, page_size,
K]`; the engine's pool is one array `[L, P, page_size, 2N, K]` with keys at even and values at odd combined heads
(`kv_pool.py`, the TPU kernel's layout). Transposing the pool into the wrapper's layout would copy the whole pool
(all layers, all pages, written or not) at every layer of every decode step, more bytes than the attention reads.
So this module runs the kernel body in its own `pl.pallas_call` with block specs for the pool's layout: the pool
reshaped to `[L * P, page_size, 2N, K]` (merging the two leading dims of a row-major array: a bitcast, no copy) is
passed twice, as the keys (block: combined head 2n of kv head n) and as the values (head 2n + 1), and the page
tables are offset by `layer * P` (the layer's pages in the merged pool, as the TPU path does). Each kernel load is
one page of one head: `page_size` rows of K contiguous elements (256 bytes at K 128 in bf16), rows 2N * K apart.
A step reads the pages below each sequence's length (rounded up to a compute block), as the kernel's length mask
and loop bound give.

The rest follows the kernel's wrapper `paged_attention_unbatched` (jax 0.10): a grid (kv heads, query-head blocks
of `BLOCK_H`, k-splits) per sequence (`jax.vmap` over sequences), each k-split a flash pass over its share of the
page table, their partial outputs combined by their maxima and sums. Differences: the partial outputs are float32
(the wrapper writes them in the query dtype before combining; float32 keeps the combine exact, at
`k_splits x N x BLOCK_H x K x 4` bytes per sequence and layer); the queries are scaled by `sm_scale` before the
kernel (it has no scale; the soft-cap then applies to the scaled scores, as in `decoder.Attention`); block sizes
are chosen from the shapes (`decode_blocks`), the page table zero-padded (null page, never read: past every
length) to a multiple of them; with a float32 pool the kernel's dots run in IEEE float32 (matmul precision
'highest'; Triton's default for float32 is TF32).

Decode only: one query per sequence (query i is sequence i's last token). No sliding window and no attention sinks
(`gpu_kernel_unsupported` says why a model cannot use it). Triton needs power-of-two tile dims of at least 16:
head_dim and page_size powers of two, head_dim >= 16.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu
from jax.experimental.pallas.ops.gpu.paged_attention import DEFAULT_MASK_VALUE, paged_attention_kernel

BLOCK_H = 16  # query heads per program (a kv head's G query heads padded up to it; Triton's dot needs >= 16 rows)
BLOCK_TOKENS = 128  # keys per compute block (`pages_per_compute_block` x page_size; the wrapper's 8 x 16)
MAX_K_SPLITS = 16  # the wrapper's default k_splits
TARGET_PROGRAMS = 1024  # k-splits are added until sequences x kv heads x head blocks x splits reaches this
NUM_WARPS, NUM_STAGES = 8, 2  # the wrapper's defaults


def _pow2_ceil(x: int) -> int:
    return 1 << max(0, int(x) - 1).bit_length()


def _is_pow2(x: int) -> bool:
    return x > 0 and x & (x - 1) == 0


def gpu_kernel_unsupported(head_dim: int, page_size: int, sliding_window: bool, sinks: bool) -> str | None:
    """Why the GPU kernel cannot run a model with these dimensions (None: it can)."""
    if sinks:
        return "it has no attention sinks (GPT-OSS)"
    if sliding_window:
        return "it has no sliding window"
    if not _is_pow2(head_dim) or head_dim < 16:
        return f"Triton needs a power-of-two head_dim >= 16, the model's is {head_dim}"
    if not _is_pow2(page_size):
        return f"Triton needs a power-of-two page size, this engine's is {page_size}"
    return None


def decode_blocks(num_seqs: int, num_kv_heads: int, num_heads: int, pages_per_seq: int, page_size: int):
    """(pages per compute block, k_splits, padded pages per sequence) for a decode step: compute blocks of
    `BLOCK_TOKENS` keys (fewer for short tables, at least 16 keys), k-splits up to `MAX_K_SPLITS` until the grid
    has `TARGET_PROGRAMS` programs (long sequences at small batches), never more splits than compute blocks; the
    table padded to a multiple of k_splits x pages per compute block."""
    ppcb = min(max(1, BLOCK_TOKENS // page_size), _pow2_ceil(pages_per_seq))
    ppcb = max(ppcb, _pow2_ceil(-(-16 // page_size)))
    head_blocks = -(-(num_heads // num_kv_heads) // BLOCK_H)
    want = -(-TARGET_PROGRAMS // max(1, num_seqs * num_kv_heads * head_blocks))
    k_splits = max(1, min(MAX_K_SPLITS, want, -(-pages_per_seq // ppcb)))
    chunk = k_splits * ppcb
    return ppcb, k_splits, -(-pages_per_seq // chunk) * chunk


def _one_sequence(q, pool, table, length, *, ppcb, k_splits, soft_cap, interpret):
    """q `[H, K]` (pool dtype, scaled), pool `[P', page_size, 2N, K]`, table `[pps] int32` (pps a multiple of
    k_splits x ppcb), length `[1] int32` -> (o `[k_splits, N, G', K]`, l, m `[k_splits, N, G']`) float32,
    G' = G padded to `BLOCK_H`."""
    h, kd = q.shape
    total, ps, n2, _ = pool.shape
    n = n2 // 2
    g = h // n
    qg = q.reshape(n, g, kd)
    if g % BLOCK_H:
        qg = jnp.pad(qg, ((0, 0), (0, -g % BLOCK_H), (0, 0)))
    head_blocks, part = qg.shape[1] // BLOCK_H, table.shape[0] // k_splits
    kernel = functools.partial(
        paged_attention_kernel,
        num_heads=g,
        pages_per_compute_block=ppcb,
        mask_value=DEFAULT_MASK_VALUE,
        attn_logits_soft_cap=soft_cap,
    )

    def pages(half):  # kv head j's keys (half 0: combined head 2j) or values (half 1: 2j + 1), every page
        return pl.BlockSpec((total, ps, None, kd), lambda j, i, s: (0, 0, 2 * j + half, 0))

    f32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float32)
    return pl.pallas_call(
        kernel,
        grid=(n, head_blocks, k_splits),
        in_specs=[
            pl.BlockSpec((None, BLOCK_H, kd), lambda j, i, s: (j, i, 0)),
            pages(0),
            None,  # no key scales
            pages(1),
            None,  # no value scales
            pl.BlockSpec((None, part), lambda j, i, s: (s, 0)),
            pl.BlockSpec((1,), lambda j, i, s: (0,)),
        ],
        out_specs=[
            pl.BlockSpec((None, None, BLOCK_H, kd), lambda j, i, s: (s, j, i, 0)),
            pl.BlockSpec((None, None, BLOCK_H), lambda j, i, s: (s, j, i)),
            pl.BlockSpec((None, None, BLOCK_H), lambda j, i, s: (s, j, i)),
        ],
        out_shape=[f32(k_splits, *qg.shape), f32(k_splits, *qg.shape[:2]), f32(k_splits, *qg.shape[:2])],
        interpret=interpret,
        compiler_params=plgpu.CompilerParams(num_warps=NUM_WARPS, num_stages=NUM_STAGES),
        name=f"paged_decode_attention_{ppcb=}",
    )(qg, pool, None, pool, None, table.reshape(k_splits, part), length)


def paged_decode_attention_gpu(q, pool, lengths, tables, *, sm_scale, soft_cap=None, interpret=False):
    """Decode attention of one query per sequence over the pool with the Pallas GPU kernel (module docstring).

    Args:
      q: `[S, H, K]` the sequences' last tokens' queries (any float dtype).
      pool: `[P', page_size, 2N, K]` pages (keys at even, values at odd combined heads; a layer pool or every
        layer's pages merged, `[L * P, ...]`).
      lengths: `[S] int32` keys per sequence, the query's own included (the query sees keys `[0, length)`).
      tables: `[S, pages_per_seq] int32` page indices into `pool`'s first dim.
      sm_scale: the score scale; soft_cap: tanh soft-cap of the scaled scores or None.
      interpret: run the kernel in Pallas interpret mode (any platform: CPU tests).

    Returns `[S, H, K]` float32; a sequence of length 0 gives 0."""
    s, h, kd = q.shape
    ps, n2 = pool.shape[1:3]
    ppcb, k_splits, width = decode_blocks(s, n2 // 2, h, tables.shape[1], ps)
    tables = jnp.pad(tables.astype(jnp.int32), ((0, 0), (0, width - tables.shape[1])))
    q = (q.astype(jnp.float32) * sm_scale).astype(pool.dtype)  # the kernel's dots take one dtype
    one = functools.partial(_one_sequence, ppcb=ppcb, k_splits=k_splits, soft_cap=soft_cap, interpret=interpret)
    precision = "highest" if pool.dtype == jnp.float32 else None  # float32: IEEE dots, not TF32
    with jax.default_matmul_precision(precision):
        o, l, m = jax.vmap(one, (0, None, 0, 0))(q, pool, tables, lengths.astype(jnp.int32)[:, None])
    g = h // (n2 // 2)
    o, l, m = o[..., :g, :], l[..., :g], m[..., :g]  # [S, k_splits, N, G(, K)]
    # the k-splits' flash passes combined (the wrapper's last round)
    m_all = m.max(axis=1, keepdims=True)
    corr = jnp.exp(m - m_all)
    total = (l * corr).sum(axis=1)
    out = (o * corr[..., None]).sum(axis=1) / (total[..., None] + np.finfo(np.float32).eps)
    return out.reshape(s, h, kd)
