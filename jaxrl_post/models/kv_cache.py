"""Segmented key/value cache of the decoder (`Transformer.init_cache` builds one) and its slot writer."""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp


@flax.struct.dataclass
class KVCache:
    """Key/value cache shared by all rows of a batch: per layer, the slots split into segments.

    k: per layer a tuple of segments [B, N, K, S_j] (keys after RoPE, slots last); v: per layer a tuple of
    segments [B, N, S_j, K]; sum(S_j) = S, every layer segmented alike. mask: [B, S] bool (slot holds a real
    token). index: next slot to write: an int32 scalar (same for every row), or the Python int 0 of a fresh
    cache (the first write then uses static offsets), or a per-row [B] int32 array (multi-turn rollouts,
    `rollout.turn_cache`: rows of different lengths each append at their own slot). A model call with T new
    tokens writes slots [index, index + T); with a scalar index the caller must keep index + T <= S (not
    checked under jit); with a per-row index the writes past slot S are dropped.

    Layout: slots last in k and next-to-last in v make both attention products of a decode step plain
    per-(row, kv head) matmuls ``[G*T, K] @ [K, S_j]`` and ``[G*T, S_j] @ [S_j, K]`` with no transpose of the
    cache. Segments let attention skip (``lax.cond``) every segment with no visible key yet, so a decode
    step reads only the slots written so far instead of all S (see ``Transformer.init_cache``).
    """

    k: tuple
    v: tuple
    mask: jax.Array
    index: jax.Array | int

    @property
    def max_len(self) -> int:
        return self.mask.shape[1]

    @property
    def segments(self) -> tuple[int, ...]:
        """Slot count of each segment (S_j)."""
        return tuple(seg.shape[-1] for seg in self.k[0])


def write_slots(segments: tuple, new: jax.Array, index, axis: int) -> tuple:
    """Write ``new`` (T slots along ``axis``) into a segmented buffer at slot ``index``.

    Static ``index`` (Python int): each segment gets its overlapping part at a static offset. Traced
    index: one dynamic_update_slice for a single segment; with several segments one masked single-slot
    write per token and segment (a write may cross segment boundaries), all in place.
    """
    t = new.shape[axis]
    out, off = [], 0
    for seg in segments:
        n = seg.shape[axis]
        dtype = seg.dtype
        upd = new.astype(dtype)
        if dtype.itemsize == 2 and jnp.issubdtype(dtype, jnp.floating):
            # Write 16-bit floats as uint16 bit patterns: XLA:CPU otherwise widens a bf16 select/update to
            # float32 over the whole segment (a full copy per step instead of an in-place slot write).
            seg, upd = (jax.lax.bitcast_convert_type(a, jnp.uint16) for a in (seg, upd))
        if isinstance(index, int):
            lo, hi = max(index, off), min(index + t, off + n)
            if lo < hi:
                part = jax.lax.slice_in_dim(upd, lo - index, hi - index, axis=axis)
                seg = jax.lax.dynamic_update_slice_in_dim(seg, part, lo - off, axis)
        elif len(segments) == 1:
            seg = jax.lax.dynamic_update_slice_in_dim(seg, upd, index, axis)
        else:
            for i in range(t):
                slot = index + i
                start = jnp.clip(slot - off, 0, n - 1)
                inside = (slot >= off) & (slot < off + n)
                cur = jax.lax.dynamic_slice_in_dim(seg, start, 1, axis)
                tok = jax.lax.slice_in_dim(upd, i, i + 1, axis=axis)
                seg = jax.lax.dynamic_update_slice_in_dim(seg, jnp.where(inside, tok, cur), start, axis)
        out.append(jax.lax.bitcast_convert_type(seg, dtype) if seg.dtype != dtype else seg)
        off += n
    return tuple(out)


def per_row_index(index) -> bool:
    """Whether a cache ``index`` is per row ([B] array) rather than one slot shared by every row."""
    return not isinstance(index, int) and jax.numpy.ndim(index) == 1


def write_slots_per_row(segments: tuple, new: jax.Array, index: jax.Array, axis: int) -> tuple:
    """Write ``new`` ([B, ..., T, ...], T slots along ``axis``) into a segmented buffer, row b at slot
    ``index[b]`` ([B] int32): one scatter per segment; slots outside a segment (or past the last one) are
    dropped, so a row near the end of the cache never shifts its write onto earlier slots."""
    t = new.shape[axis]
    slots = index[:, None] + jnp.arange(t, dtype=jnp.int32)[None]  # [B, T]
    out, off = [], 0
    for seg in segments:
        n = seg.shape[axis]
        local = jnp.where((slots >= off) & (slots < off + n), slots - off, n)  # n = out of bounds: dropped

        def put(row, upd, idx, ax=axis - 1):
            return row.at[(slice(None),) * ax + (idx,)].set(upd.astype(row.dtype), mode="drop")

        out.append(jax.vmap(put)(seg, new, local))
        off += n
    return tuple(out)
