"""The paged KV cache on the device: one page pool per layer, stacked over layers so decode can scan over them.

Layout `kv [L, num_pages, page_size, 2N, K]`: keys at even and values at odd combined heads (kv head n's key is
head 2n, its value 2n + 1), the layout of the Pallas TPU kernel `ragged_paged_attention`, so TPU decode reads the
pool as it is. Keys are stored after RoPE. Token `i` of a sequence with page table `table` lives in slot
`table[i // page_size] * page_size + i % page_size` of the flattened pool (`token_slots`); page 0 is the null page
(`allocator.NULL_PAGE`): idle slots write there and nothing unmasked reads it.

On a tensor-parallel mesh the pool is split over its combined-head dim on 'tensor' (`POOL_AXES`): with tp dividing
N, each device holds the keys and values of its N / tp kv heads, the heads its query heads read. The engine holds
one pool per data-parallel replica, stacked `[D, L, ...]` with D over 'data' (`init_replica_pools`, `replicas.py`).
"""

from __future__ import annotations

import functools

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_post.runtime.sharding import constrain, logical_to_mesh_spec

POOL_AXES = ("layers", None, None, "kv_heads", "head_dim")  # logical names of the pool's dims
REPLICA_POOL_AXES = ("replica", *POOL_AXES)  # the engine's pools of its data-parallel replicas (`replicas.py`)


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


def init_pool(
    num_layers: int, num_pages: int, page_size: int, num_kv_heads: int, head_dim: int, dtype, mesh=None
) -> PagedKVPool:
    """Zeros `[L, P, page_size, 2N, K]` of `dtype`; with `mesh`, written in place on it, split by `POOL_AXES`."""
    shape = (num_layers, num_pages, page_size, 2 * num_kv_heads, head_dim)
    if mesh is None:
        return PagedKVPool(jnp.zeros(shape, dtype))
    return PagedKVPool(zeros_on(shape, jnp.dtype(dtype), pool_sharding(mesh)))


def pool_sharding(mesh, replicas: bool = False) -> jax.sharding.NamedSharding:
    """The pool's sharding on `mesh`: combined heads over 'tensor' (`POOL_AXES`); `replicas`: a leading replica
    dim over 'data' too (`REPLICA_POOL_AXES`)."""
    return jax.sharding.NamedSharding(mesh, logical_to_mesh_spec(REPLICA_POOL_AXES if replicas else POOL_AXES))


def init_replica_pools(
    replicas: int, num_layers: int, num_pages: int, page_size: int, num_kv_heads: int, head_dim: int, dtype, mesh=None
) -> jax.Array:
    """Zeros `[D, L, P, page_size, 2N, K]` of `dtype`: one pool per data-parallel replica (`replicas` = D); with
    `mesh`, written in place on it, split by `REPLICA_POOL_AXES` (replica over 'data', heads over 'tensor')."""
    shape = (replicas, num_layers, num_pages, page_size, 2 * num_kv_heads, head_dim)
    if mesh is None:
        return jnp.zeros(shape, dtype)
    return zeros_on(shape, jnp.dtype(dtype), pool_sharding(mesh, replicas=True))


@functools.partial(jax.jit, static_argnums=(0, 1, 2))
def zeros_on(shape: tuple, dtype, sharding):
    """Zeros of `shape` and `dtype` created on `sharding`'s devices (no full copy on one device first)."""
    return jax.lax.with_sharding_constraint(jnp.zeros(shape, dtype), sharding)


def constrain_pool(kv: jax.Array) -> jax.Array:
    """`kv` constrained to `POOL_AXES` under an ambient mesh (`jax.set_mesh`); unchanged without one."""
    return constrain(kv, POOL_AXES)


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
