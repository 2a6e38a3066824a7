"""The MoE block's grouped matmul (`moe.MoE.experts`, `moe_ep`): rows sorted by expert times each expert's weights.

`model.moe_impl` picks the implementation (`resolve_moe_impl`; `moe.set_moe_impl`):

- "ragged_dot": `jax.lax.ragged_dot` (any platform; XLA's own lowering).
- "megablox": the Pallas TPU kernel `gmm` of `jax.experimental.pallas.ops.tpu.megablox` (MaxText's `megablox`):
  tiles of (tm, tk, tn) = `GMM_TILING` rows / contraction / output columns; its custom VJP computes the lhs
  gradient with `gmm` on the transposed weights (the same tiles, K and N swapped) and the weight gradient with
  `tgmm`. Its constraints, handled here (`gmm_tiling`): the row count must be a multiple of tm (rows are
  zero-padded up to one, tm shrunk to the rows, rounded to 16, for small batches); a Mosaic block must be a
  multiple of 128 or the whole dim, in the forward and in the swapped backward, so K and N share one tile and a
  dim smaller than it is zero-padded up to it (small test models; real expert dims are >= 128, a remainder tile
  is masked by the kernel); rows after the last group are left unwritten by the kernel, in the output and in the
  lhs gradient (Pallas interpret mode fills them with NaN): both are masked here, so those rows give 0 as with
  ragged_dot.
- "auto": "ragged_dot" everywhere. Megablox is not chosen on TPU by default because no measurement of it against
  ragged_dot on a TPU exists for this project yet (`scripts/bench_grouped_matmul.py` is that measurement;
  docs/moe.md).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental.pallas.ops.tpu import megablox

MOE_IMPLS = ("auto", "ragged_dot", "megablox")
GMM_TILING = (128, 128, 128)  # megablox's default (tm, tk, tn)
_ROW_ALIGN = 16  # tm is a multiple of this (bf16 packs 16 rows per TPU vreg tile)


def resolve_moe_impl(impl: str, platform: str, *, interpret: bool = False) -> str:
    """`model.moe_impl` -> "ragged_dot" or "megablox". "auto" -> "ragged_dot" (module docstring).
    platform: `jax.default_backend()`; interpret: the caller runs megablox in Pallas interpret mode (tests).

    Raises ValueError: an unknown name, or "megablox" off TPU without interpret."""
    if impl not in MOE_IMPLS:
        raise ValueError(f"config.model.moe_impl={impl!r}: expected one of {MOE_IMPLS}")
    if impl == "auto":
        return "ragged_dot"
    if impl == "megablox" and platform != "tpu" and not interpret:
        raise ValueError(
            f"config.model.moe_impl='megablox' is a TPU kernel but the platform is {platform!r}; use 'auto' or "
            "'ragged_dot'"
        )
    return impl


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def gmm_tiling(m: int, k: int, n: int, tiling: tuple[int, int, int] = GMM_TILING) -> tuple[int, int, int, int]:
    """(tm, t, k', n') for an `[m, k] x [G, k, n]` grouped matmul: tm = min(tiling tm, m rounded up to 16); one tile
    t = min(tk, tn) for both K and N, because megablox's VJP reuses (tk, tn) for the lhs gradient, whose contraction
    is N and output K; k' / n': K and N zero-padded up to t when smaller (a Mosaic block must be a multiple of 128 or
    the whole dim, in both roles), else unchanged (a remainder tile is masked by the kernel)."""
    tm, tk, tn = tiling
    t = min(tk, tn)
    return min(tm, _round_up(max(m, 1), _ROW_ALIGN)), t, max(k, t), max(n, t)


def grouped_matmul(
    lhs: jax.Array,
    rhs: jax.Array,
    group_sizes: jax.Array,
    *,
    impl: str = "ragged_dot",
    tiling: tuple[int, int, int] = GMM_TILING,
    interpret: bool = False,
) -> jax.Array:
    """lhs `[M, K]`, rhs `[G, K, N]` (same dtype), group_sizes `[G]` int (sum <= M) -> `[M, N]` in lhs.dtype,
    accumulated in float32: rows `sum(group_sizes[:g]) ... + group_sizes[g]` times `rhs[g]`; rows after the last
    group are 0. impl: "ragged_dot" or "megablox" (module docstring); tiling: megablox's (tm, tk, tn) upper
    bounds; interpret: run megablox in Pallas interpret mode (CPU tests). Differentiable in lhs and rhs.

    Raises ValueError for another impl."""
    group_sizes = group_sizes.astype(jnp.int32)
    if impl == "ragged_dot":
        return jax.lax.ragged_dot(lhs, rhs, group_sizes, preferred_element_type=jnp.float32).astype(lhs.dtype)
    if impl != "megablox":
        raise ValueError(f"grouped_matmul impl must be 'ragged_dot' or 'megablox', got {impl!r}")
    (m, k), n = lhs.shape, rhs.shape[2]
    tm, t, kp, n_p = gmm_tiling(m, k, n, tiling)
    padded = _round_up(m, tm)
    valid = (jnp.arange(padded, dtype=jnp.int32) < jnp.sum(group_sizes))[:, None]
    # the select also masks the lhs gradient, whose rows after the last group the kernel leaves unwritten
    x = jnp.where(valid, jnp.pad(lhs, ((0, padded - m), (0, kp - k))), jnp.zeros((), lhs.dtype))
    w = rhs if (kp, n_p) == (k, n) else jnp.pad(rhs, ((0, 0), (0, kp - k), (0, n_p - n)))
    # positional: megablox.gmm is a custom_vjp with (preferred_element_type, tiling, transpose_rhs, interpret) static
    out = megablox.gmm(x, w, group_sizes, lhs.dtype, (tm, t, t), None, None, False, interpret)
    return jnp.where(valid, out, jnp.zeros((), out.dtype))[:m, :n]
