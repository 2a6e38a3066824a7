"""Expert-parallel dispatch of the MoE block (`moe.MoE.experts`) over the mesh's 'expert' axis.

Used when the ambient mesh (`jax.set_mesh`, `sharding.InMesh`) has an 'expert' axis of size ep > 1. The stacked
expert weights `[E, D, F]` / `[E, F, D]` (GPT-OSS: the fused gate/up `[E, D, 2F]` and the biases `[E, 2F]`, `[E, D]`)
are split over 'expert' (`sharding.LOGICAL_AXIS_RULES`: each device holds E/ep experts, their F dim over 'tensor'
when it divides) and never gathered along E. Inside one
`jax.shard_map` over the mesh (the MaxText / Megablox pattern), per device with its own token shard:

1. its N*k (token, expert) assignments are sorted by expert; their counts per expert are all-gathered over
   'expert' (`[ep, E]` int32, the only metadata exchanged) and give every device the offsets and sizes below;
2. `jax.lax.ragged_all_to_all` sends each device the rows of its experts, sender after sender;
3. the received rows are sorted by local expert and go through the experts' MLP (`MoE.ffn`: grouped matmuls,
   ragged_dot or megablox, `MoE.impl`; GPT-OSS's biases and clamped SwiGLU, its down bias added on one 'tensor'
   shard only, as the outputs are summed over 'tensor');
4. a second `ragged_all_to_all` with the roles swapped sends the outputs back to their tokens' devices, where
   they are unsorted and summed weighted by the routing weights (psum over 'tensor' for a split F).

Dropless: a device's receive buffer has room for ep * N*k rows (every assignment of every peer on its experts).
Under a capacity factor the dropped assignments are neither sent nor computed, and the buffers hold only the rows
the per-row capacity allows (`_buffer_rows`: about cf * N*k received instead of ep * N*k).

When the token rows do not divide over the batch axes (a decode batch smaller than the mesh), the tokens are
replicated instead: every device runs its own experts' assignments and the outputs are summed over 'expert'
(no all-to-all; still no expert weight leaves its device).

XLA:CPU cannot compile `ragged-all-to-all` (JAX 0.10: "HLO opcode `ragged-all-to-all` is not supported by
XLA:CPU ThunkEmitter"), so on CPU `ragged_all_to_all` is replaced by `padded_ragged_all_to_all`, the same
semantics built from a fixed-size `jax.lax.all_to_all` of one padded chunk per peer; the offset bookkeeping
is shared, so the CPU tests run it. TPU / GPU use the ragged collective.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxrl_post.runtime.sharding import LOGICAL_AXIS_RULES

AXIS = "expert"  # mesh axis of expert parallelism (sharding.MESH_AXES)
# the dim of each expert param (`MoE.expert_params`) that holds F (split over 'tensor' when F divides), or None
_F_DIM = {
    "gate_proj": 2,
    "up_proj": 2,
    "down_proj": 1,
    "gate_up_proj": 2,
    "gate_up_proj_bias": 1,
    "down_proj_bias": None,
}


def expert_parallel_size() -> int:
    """Size of the ambient mesh's 'expert' axis (1 without a mesh or without that axis)."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh is None or mesh.empty or AXIS not in mesh.axis_names:
        return 1
    return dict(zip(mesh.axis_names, mesh.axis_sizes))[AXIS]


def ragged_all_to_all_supported(platform: str | None = None) -> bool:
    """Whether `platform` (default: `jax.default_backend()`) compiles `jax.lax.ragged_all_to_all`: not XLA:CPU."""
    return (platform or jax.default_backend()) != "cpu"


def padded_ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, *, axis_name):
    """`jax.lax.ragged_all_to_all`'s semantics (one slice per peer) from a fixed-size `jax.lax.all_to_all`:
    every slice is padded to C = min(N, M) rows (no slice is longer than the operand or the receiver's output).
    operand `[N, ...]`, output `[M, ...]`, the four int32 `[ep]` arrays as for `ragged_all_to_all`. Returns
    `output` with the received slices written. Holds `[ep, C, ...]` chunks on each side besides the output."""
    n, ep = operand.shape[0], input_offsets.shape[0]
    c = min(n, output.shape[0])
    rows = jnp.arange(c, dtype=jnp.int32)
    src = input_offsets[:, None] + rows[None, :]  # [ep, C] rows of operand sent to each peer
    chunks = jnp.take(operand, jnp.minimum(src, n - 1), axis=0)
    keep = (rows[None, :] < send_sizes[:, None]).reshape(ep, c, *([1] * (operand.ndim - 1)))
    chunks = jnp.where(keep, chunks, jnp.zeros((), operand.dtype))
    got = jax.lax.all_to_all(chunks, axis_name, 0, 0)  # [ep, C, ...]: slot s = sender s's slice
    at = jax.lax.all_to_all(output_offsets, axis_name, 0, 0, tiled=True)  # where sender s's slice lands here
    dst = jnp.where(rows[None, :] < recv_sizes[:, None], at[:, None] + rows[None, :], output.shape[0])
    return output.at[dst.reshape(-1)].set(got.reshape(ep * c, *operand.shape[1:]), mode="drop")


def _exclusive_cumsum(x, axis):
    return jnp.cumsum(x, axis=axis) - x


def _local_experts(buf, local_id, e_local: int, params: dict, ffn: Callable):
    """Rows `buf` `[R, D]` of local experts `local_id` `[R]` (e_local = padding, computes zeros) -> `[R, D]`
    expert outputs in the compute dtype (`ffn` over the rows sorted by local expert)."""
    order = jnp.argsort(local_id, stable=True)
    sizes = jnp.bincount(local_id, length=e_local).astype(jnp.int32)  # padding ids (== e_local) not counted
    ys = ffn(jnp.take(buf, order, axis=0), sizes, jnp.take(local_id, order), params)
    inverse = jnp.zeros_like(order).at[order].set(jnp.arange(order.shape[0], dtype=order.dtype))
    return jnp.take(ys, inverse, axis=0)


def _dispatch_local(
    x, weights, experts, keep, params, *, ffn, num_experts, dtype, exchange, tokens_sharded, sum_axes, capacity
):
    """shard_map body: this device's tokens x `[b, T, D]`, weights/experts `[b, T, k]`, keep `[b, T, k]` bool or None
    (dropless), its experts' params (`[E/ep, D, F/tp]`, `[E/ep, F/tp, D]`, ...) -> `[b, T, D]` float32, summed over
    `sum_axes` ('tensor' when F is split over it, 'expert' when the tokens are replicated). capacity: the capacity
    factor's per-row expert capacity C (`moe.expert_capacity`) or None: dropped assignments are sorted last, neither
    sent nor in any group, and the buffers hold the most rows C allows (`_buffer_rows`)."""
    b, t, d = x.shape
    k = experts.shape[-1]
    ep, me = jax.lax.axis_size(AXIS), jax.lax.axis_index(AXIS)
    e_local = num_experts // ep
    flat = experts.reshape(-1)  # [n*k], assignment a = token a // k
    if keep is not None:  # a dropped assignment: expert id E, after every kept one, outside every bincount below
        flat = jnp.where(keep.reshape(-1), flat, num_experts)
    if tokens_sharded:
        send_rows, recv_rows = _buffer_rows(b, t, k, num_experts, ep, capacity)
        order = jnp.argsort(flat, stable=True)[:send_rows]  # grouped by expert, so by owning device; kept only
        xs = jnp.take(x.reshape(b * t, d), order // k, axis=0).astype(dtype)  # [send_rows, D]
        sizes = jnp.bincount(flat, length=num_experts).astype(jnp.int32)  # [E] this device's rows per expert
        counts = jax.lax.all_gather(sizes, AXIS).reshape(ep, ep, e_local)  # [sender, receiver, local expert]
        pair = jnp.sum(counts, axis=-1)  # [sender, receiver] rows
        send_sizes, recv_sizes = pair[me], pair[:, me]
        send_offsets = _exclusive_cumsum(send_sizes, 0)  # where my slice for each peer starts in xs
        land = _exclusive_cumsum(pair, 0)  # [sender, receiver]: where sender's slice starts at the receiver
        buf = exchange(
            xs, jnp.zeros((recv_rows, d), dtype), send_offsets, send_sizes, land[me], recv_sizes, axis_name=AXIS
        )  # fmt: skip
        # received rows: sender by sender, each sender's rows by local expert; padding after the last one
        ends = jnp.cumsum(counts[:, me].reshape(-1))  # [ep * e_local]
        pos = jnp.arange(recv_rows, dtype=jnp.int32)
        slot = jnp.searchsorted(ends, pos, side="right").astype(jnp.int32)
        local_id = jnp.where(slot < ep * e_local, slot % e_local, e_local)
        out = _local_experts(buf, local_id, e_local, params, ffn)
        back_at = _exclusive_cumsum(pair, 1)[:, me]  # where each sender's slice came from in its xs
        ys = exchange(
            out, jnp.zeros_like(xs), land[:, me], recv_sizes, back_at, send_sizes, axis_name=AXIS
        )  # fmt: skip
    else:  # replicated tokens: my experts' kept assignments only (first, by expert), summed over 'expert' below
        local = flat - me * e_local
        local_id = jnp.where((local >= 0) & (local < e_local), local, e_local)
        rows = b * t * k if capacity is None else min(b * t * k, b * e_local * capacity)
        order = jnp.argsort(local_id, stable=True)[:rows]
        xs = jnp.take(x.reshape(b * t, d), order // k, axis=0).astype(dtype)
        sizes = jnp.bincount(local_id, length=e_local).astype(jnp.int32)  # padding ids (== e_local) not counted
        ys = ffn(xs, sizes, jnp.take(local_id, order), params)
    # where each assignment sits in `ys`; out of range (-> 0) for one past the buffer (dropped)
    used = order.shape[0]
    inverse = jnp.full(flat.shape, used, order.dtype).at[order].set(jnp.arange(used, dtype=order.dtype))
    ys = jnp.take(ys, inverse, axis=0, mode="fill", fill_value=0).astype(jnp.float32).reshape(b * t, k, d)
    y = jnp.einsum("NKD,NK->ND", ys, weights.reshape(b * t, k)).reshape(b, t, d)
    return jax.lax.psum(y, sum_axes) if sum_axes else y


def _buffer_rows(b: int, t: int, k: int, num_experts: int, ep: int, capacity: int | None) -> tuple[int, int]:
    """(send, receive) rows of one device's exchange buffers for its b rows of T tokens. Dropless: its b*T*k
    assignments, and ep times that (every peer's assignments on its experts). Capacity C: at most b*E*C kept
    assignments to send (each of its b rows gives each expert at most C) and ep*b*(E/ep)*C to receive (each peer's b
    rows give each of its E/ep experts at most C), each capped by the dropless count."""
    send, recv = b * t * k, ep * b * t * k
    if capacity is None:
        return send, recv
    return min(send, b * num_experts * capacity), min(recv, ep * b * (num_experts // ep) * capacity)


def dispatch(
    x,
    weights,
    experts,
    params: dict,
    ffn: Callable,
    *,
    num_experts: int,
    dtype=None,
    check_vma: bool = True,
    keep=None,
    capacity: int | None = None,
):
    """Expert-parallel MoE experts on the ambient mesh: x `[B, T, D]`, weights `[B, T, k]` float32, experts
    `[B, T, k]` int32, params the experts' arrays by name (`MoE.expert_params`: gate/up `[E, D, F]`, down
    `[E, F, D]`; or GPT-OSS's gate_up `[E, D, 2F]`, gate_up bias `[E, 2F]`, down, down bias `[E, D]`) -> `[B, T, D]`
    float32 (what the single-device `MoE.experts` computes). ffn: the experts' MLP on one device's rows
    (`MoE.ffn(xs, sizes, expert_of, params)`); dtype: the rows' compute dtype (default x's); check_vma: False for a
    Pallas grouped matmul (its output carries no varying-axes type); keep: `[B, T, k]` bool, the assignments a
    capacity factor keeps (`moe.capacity_keep`; None: dropless), with capacity its per-row expert capacity C
    (`moe.expert_capacity`): the dropped assignments are neither exchanged nor computed, and the exchange buffers and
    grouped matmuls shrink to the rows C allows. Raises ValueError when E does not divide over the 'expert' axis, or
    when only one of keep / capacity is given."""

    mesh = jax.sharding.get_abstract_mesh()
    sizes = dict(zip(mesh.axis_names, mesh.axis_sizes))
    ep, tp = sizes[AXIS], sizes.get("tensor", 1)
    if num_experts % ep:
        raise ValueError(f"num_experts={num_experts} does not divide over the mesh's expert axis (size {ep})")
    if (keep is None) != (capacity is None):
        raise ValueError("moe_ep.dispatch: keep and capacity go together (both None: dropless)")
    batch_axes = LOGICAL_AXIS_RULES["batch"]
    n_rows = 1
    for a in batch_axes:
        n_rows *= sizes.get(a, 1)
    sharded = x.shape[0] % n_rows == 0
    rows = batch_axes if sharded else None
    f = "tensor" if params["down_proj"].shape[1] % tp == 0 else None  # F (and a fused 2F as F pairs) over 'tensor'
    tok, route = P(rows, None, None), P(rows, None, None)
    exchange = jax.lax.ragged_all_to_all if ragged_all_to_all_supported() else padded_ragged_all_to_all
    names = sorted(params)

    def spec(name):
        dims = [AXIS] + [None] * (params[name].ndim - 1)
        if _F_DIM[name] is not None:
            dims[_F_DIM[name]] = f
        return P(*dims)

    def body(x, weights, experts, *arrays):
        kept = arrays[0] if keep is not None else None
        local = dict(zip(names, arrays[keep is not None :]))
        if f and "down_proj_bias" in local:  # outputs are summed over 'tensor': add the down bias on one shard
            local["down_proj_bias"] = jnp.where(jax.lax.axis_index("tensor") == 0, local["down_proj_bias"], 0)
        return _dispatch_local(
            x, weights, experts, kept, local,
            ffn=ffn, num_experts=num_experts, dtype=dtype or x.dtype, exchange=exchange, tokens_sharded=sharded,
            sum_axes=(() if sharded else (AXIS,)) + (("tensor",) if f else ()), capacity=capacity,
        )  # fmt: skip

    return jax.shard_map(
        body,
        in_specs=(tok, route, route, *((route,) if keep is not None else ()), *(spec(n) for n in names)),
        out_specs=tok,
        check_vma=check_vma,
    )(x, weights, experts, *((keep,) if keep is not None else ()), *(params[n] for n in names))
