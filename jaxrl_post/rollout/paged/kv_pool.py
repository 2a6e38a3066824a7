"""The paged KV cache on the device: one page pool per layer, stacked over layers so decode can scan over them.

Layout `kv [L, num_pages, page_size, 2N, K]`: keys at even and values at odd combined heads (kv head n's key is
head 2n, its value 2n + 1), the layout of the Pallas TPU kernel `ragged_paged_attention`, so TPU decode reads the
pool as it is. Keys are stored after RoPE. Token `i` of a sequence with page table `table` lives in slot
`table[i // page_size] * page_size + i % page_size` of the flattened pool (`token_slots`); page 0 is the null page
(`allocator.NULL_PAGE`): idle slots write there and nothing unmasked reads it.
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np


@flax.struct.dataclass
class PagedKVPool:
    """kv: `[L, P, page_size, 2N, K]` in the cache dtype (keys at even, values at odd combined heads)."""

    kv: jax.Array

    @property
    def num_layers(self) -> int:
        return self.kv.shape[0]

    @property
    def num_pages(self) -> int:
        return self.kv.shape[1]

    @property
    def page_size(self) -> int:
        return self.kv.shape[2]


def init_pool(num_layers: int, num_pages: int, page_size: int, num_kv_heads: int, head_dim: int, dtype) -> PagedKVPool:
    """Zeros `[L, P, page_size, 2N, K]` of `dtype`."""
    return PagedKVPool(jnp.zeros((num_layers, num_pages, page_size, 2 * num_kv_heads, head_dim), dtype))


def pool_bytes(num_layers: int, num_pages: int, page_size: int, num_kv_heads: int, head_dim: int, dtype) -> int:
    """Bytes of a pool of these dimensions."""
    return num_layers * num_pages * page_size * 2 * num_kv_heads * head_dim * np.dtype(dtype).itemsize


def token_slots(positions: jax.Array, tables: jax.Array, page_size: int) -> jax.Array:
    """Flat pool slots `[T] int32` of tokens at `positions [T] int32` (index in their sequence) whose sequences
    have page tables `tables [T, pages_per_seq] int32`. Positions past the table land in the null page."""
    pps = tables.shape[1]
    page_idx = positions // page_size
    page = jnp.take_along_axis(tables, jnp.clip(page_idx, 0, pps - 1)[:, None], axis=1)[:, 0]
    page = jnp.where(page_idx < pps, page, 0)
    return page * page_size + positions % page_size


def write_kv(kv: jax.Array, layer, k: jax.Array, v: jax.Array, slots: jax.Array) -> jax.Array:
    """The pool `kv [L, P, page_size, 2N, K]` with layer `layer`'s keys `k [T, N, K]` and values `v [T, N, K]`
    written at flat `slots [T] int32` (`token_slots`), interleaved as the pool's layout: one scatter of T slots
    (in place inside a loop that carries the pool). Several writes to one slot (idle tokens on the null page):
    one of them wins."""
    l, p, ps, n2, kd = kv.shape
    new = jnp.stack([k, v], axis=2).reshape(k.shape[0], n2, kd).astype(kv.dtype)
    flat = kv.reshape(l, p * ps, n2, kd)
    return flat.at[layer, slots].set(new, mode="drop").reshape(kv.shape)


def copy_pages(pool: PagedKVPool, src: jax.Array, dst: jax.Array) -> PagedKVPool:
    """Pool with pages `dst [C] int32` set to pages `src [C]` in every layer (a forked sample's partly filled
    prompt page, `PageAllocator.fork`). Pad unused entries with (0, 0): the null page copied onto itself."""
    return pool.replace(kv=pool.kv.at[:, dst].set(pool.kv[:, src]))
