"""Device mesh, the ONE logical-axis rules table, and param/batch sharding helpers.

Mesh axes ('data', 'fsdp', 'expert', 'tensor'). Params carry logical axis names as NNX `out_sharding` metadata
(`nnx.get_partition_spec(state)` returns them); `LOGICAL_AXIS_RULES` maps each logical name to a mesh axis
(or tuple of axes, or None = replicated). FSDP shards the embed dimension of params, tensor parallelism
shards heads / kv heads / mlp / vocab, expert parallelism shards the experts dimension of MoE expert weights
(`models/moe.py` exchanges tokens over it), and the batch dimension of activations goes over
('data', 'fsdp', 'expert') -- the expert axis is a data-parallel axis for everything but the experts (MaxText's
layout). A mesh of size 1 along an axis shards nothing along it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

MESH_AXES = ("data", "fsdp", "expert", "tensor")

LOGICAL_AXIS_RULES: dict[str, Any] = {
    "batch": ("data", "fsdp", "expert"),
    "embed": "fsdp",
    "mlp": "tensor",
    "heads": "tensor",
    "kv_heads": "tensor",
    "vocab": "tensor",
    "head_dim": None,
    "norm": None,
    "layers": None,
    "lora": None,  # rank dim of LoRA A/B (tiny: replicated)
    "expert": "expert",  # experts dim of MoE expert weights (models/moe.py): expert parallelism
    "cache_seq": None,
    "replica": "data",  # leading dim of the paged rollout engine's per-replica arrays (rollout/paged/replicas.py)
}


def _named(sizes: Sequence[int]) -> str:
    return " x ".join(f"{a}={s}" for a, s in zip(MESH_AXES, sizes))


def _resolve_sizes(sizes: list[int], n: int, what: str) -> list[int]:
    """`sizes` (in `MESH_AXES` order) with its one -1 set to the rest of `n`; ValueError when they cannot
    multiply to `n`."""
    sizes = list(sizes)
    if sizes.count(-1) > 1:
        raise ValueError(f"at most one mesh axis may be -1, got {_named(sizes)}")
    if -1 in sizes:
        known = math.prod(s for s in sizes if s != -1)
        if n % known:
            raise ValueError(f"{n} {what} are not divisible by the fixed mesh axes (product {known})")
        sizes[sizes.index(-1)] = n // known
    if math.prod(sizes) != n:
        raise ValueError(f"mesh {_named(sizes)} needs {math.prod(sizes)} {what}, have {n}")
    return sizes


def slice_groups(devices: Sequence) -> tuple[str, dict[Any, list]]:
    """The DCN granules of `devices`: by `slice_index` when the devices have one (TPU multi-slice), else by
    `process_index` (GPU / CPU: one process = one granule). Returns `(attribute name, {key: [devices]})`."""
    attr = "slice_index" if all(hasattr(d, "slice_index") for d in devices) else "process_index"
    groups: dict[Any, list] = {}
    for d in devices:
        groups.setdefault(getattr(d, attr), []).append(d)
    return attr, groups


def hybrid_device_array(ici: Sequence[int], dcn: Sequence[int], devices: Sequence):
    """`[data*dcn_data, fsdp*dcn_fsdp, expert, tensor]` numpy array of devices for a multi-slice mesh (`ici`,
    `dcn`: per-axis sizes): each slice (see `slice_groups`) laid out by `mesh_utils.create_device_mesh` over
    `ici` (its ICI topology), the slices tiled over `dcn` -- a slice is a contiguous block of each axis that has
    a dcn factor > 1.

    Raises ValueError when the granule count is not `prod(dcn)` or a granule does not hold `prod(ici)` devices.
    """
    from jax.experimental import mesh_utils

    attr, groups = slice_groups(devices)
    n_dcn = math.prod(dcn)
    if len(groups) != n_dcn:
        raise ValueError(
            f"dcn_data*dcn_fsdp = {n_dcn} slices, but the {len(devices)} devices form {len(groups)} "
            f"group(s) by {attr} (one {'slice' if attr == 'slice_index' else 'process'} = one slice)"
        )
    sizes = sorted({len(g) for g in groups.values()})
    if sizes != [math.prod(ici)]:
        raise ValueError(f"each slice must hold data*fsdp*expert*tensor = {math.prod(ici)} devices, got sizes {sizes}")
    return mesh_utils.create_hybrid_device_mesh(
        tuple(ici), tuple(dcn), list(devices), process_is_granule=attr == "process_index"
    )


def make_mesh(
    data: int = 1,
    fsdp: int = -1,
    tensor: int = 1,
    devices: Sequence | None = None,
    *,
    dcn_data: int = 1,
    dcn_fsdp: int = 1,
    expert: int = 1,
) -> Mesh:
    """Mesh with axes ('data', 'fsdp', 'expert', 'tensor') over `devices` (default: all devices of all hosts).
    `expert` (`trainer.mesh.expert`) > 1 is expert parallelism: MoE expert weights split over it, tokens
    exchanged by all-to-all (`models/moe.py`); for the rest of the model it is one more batch axis.

    At most one size may be -1 (= the remaining devices). Raises ValueError when the sizes do not multiply to
    the device count. Without explicit devices, `jax.make_mesh` picks a topology-aware device order.

    Multi-slice (`dcn_data` or `dcn_fsdp` > 1; `trainer.mesh.dcn_*`): `data` / `fsdp` / `tensor` are per slice
    (ICI) and the mesh is `[data*dcn_data, fsdp*dcn_fsdp, expert, tensor]`, built by `hybrid_device_array`
    (`mesh_utils.create_hybrid_device_mesh`, the MaxText layout) so the cross-slice (DCN) traffic is only
    along the data / fsdp axes. Raises ValueError when the devices do not form `dcn_data*dcn_fsdp` equal slices.
    """
    devs = list(jax.devices() if devices is None else devices)
    auto = (jax.sharding.AxisType.Auto,) * len(MESH_AXES)  # GSPMD propagation, not explicit-sharding types
    if dcn_data < 1 or dcn_fsdp < 1:
        raise ValueError(f"dcn_data / dcn_fsdp must be >= 1, got {dcn_data} / {dcn_fsdp}")
    if dcn_data == dcn_fsdp == 1:
        sizes = _resolve_sizes([data, fsdp, expert, tensor], len(devs), "devices")
        return jax.make_mesh(tuple(sizes), MESH_AXES, axis_types=auto, devices=devs)
    n_slices = dcn_data * dcn_fsdp
    if len(devs) % n_slices:
        raise ValueError(f"{len(devs)} devices are not divisible by dcn_data*dcn_fsdp = {n_slices} slices")
    ici = _resolve_sizes([data, fsdp, expert, tensor], len(devs) // n_slices, "devices per slice")
    return Mesh(hybrid_device_array(ici, (dcn_data, dcn_fsdp, 1, 1), devs), MESH_AXES, axis_types=auto)


def relayout_mesh(mesh: Mesh, tensor: int) -> Mesh:
    """The devices of `mesh`, in its order, as a mesh ('data', 'fsdp', 'expert', 'tensor') = (n / tensor, 1, 1,
    tensor): a second layout over the same devices (the colocated rollout's, `rollout.tensor_model_parallel_size`):
    params split over 'tensor' only and replicated over 'data', the batch split over 'data'. Keeping the device order
    lets one jitted program read arrays on `mesh` and write them on the new mesh (jit needs one device assignment).
    Raises ValueError when `tensor` does not divide the device count."""
    devs = np.asarray(mesh.devices).reshape(-1)
    if tensor < 1 or devs.size % tensor:
        raise ValueError(f"tensor={tensor} does not divide the mesh's {devs.size} devices")
    auto = (jax.sharding.AxisType.Auto,) * len(MESH_AXES)
    return Mesh(devs.reshape(devs.size // tensor, 1, 1, tensor), MESH_AXES, axis_types=auto)


def bytes_per_device(tree) -> int:
    """The most bytes of `tree`'s array leaves that one (addressable) device holds: the sum of each device's shards,
    replicated leaves counted on every device that holds them."""
    held: dict[Any, int] = {}
    for x in jax.tree.leaves(tree):
        for shard in x.addressable_shards:
            held[shard.device] = held.get(shard.device, 0) + int(shard.data.size) * shard.data.dtype.itemsize
    return max(held.values(), default=0)


def logical_to_mesh_spec(names: Sequence[str | None] | None) -> P:
    """Logical axis names -> PartitionSpec via LOGICAL_AXIS_RULES (unknown names raise KeyError)."""
    if names is None:
        return P()
    out = []
    for name in names:
        if name is None:
            out.append(None)
        elif name in LOGICAL_AXIS_RULES:
            out.append(LOGICAL_AXIS_RULES[name])
        else:
            raise KeyError(f"logical axis {name!r} has no rule; known: {sorted(LOGICAL_AXIS_RULES)}")
    return P(*out)


def _axis_size(mesh_shape: dict, axes) -> int:
    if axes is None:
        return 1
    axes = (axes,) if isinstance(axes, str) else axes
    return math.prod(mesh_shape[a] for a in axes)


def _check_divisible(path: str, shape: tuple, spec: P, mesh: Mesh) -> None:
    for dim, axes in enumerate(spec):
        n = _axis_size(dict(mesh.shape), axes)
        if n > 1 and shape[dim] % n:
            raise ValueError(
                f"param {path}: dim {dim} (size {shape[dim]}) is not divisible by mesh axis "
                f"{axes!r} (size {n}); shape {tuple(shape)}, spec {spec}"
            )


def _logical_names(var) -> tuple | None:
    meta = var.get_metadata() if hasattr(var, "get_metadata") else {}
    return meta.get("out_sharding")


def param_shardings(abstract_state, mesh: Mesh):
    """NamedSharding for every Variable of an (abstract or concrete) nnx.State, from its logical names.

    Returns a tree with the state's structure (Variables holding NamedShardings), usable as jit
    `out_shardings`. Raises ValueError naming param path, dim and mesh axis when a dim does not divide.
    """
    from flax import nnx

    def one(path, var):
        spec = logical_to_mesh_spec(_logical_names(var))
        shape = var.shape
        _check_divisible(".".join(str(p) for p in path), tuple(shape), spec, mesh)
        return var.replace(NamedSharding(mesh, spec))

    return nnx.map_state(one, abstract_state)


def shard_params(state, mesh: Mesh):
    """Place a concrete nnx.State onto the mesh according to its logical names (see `param_shardings`)."""
    shardings = param_shardings(state, mesh)
    return jax.device_put(state, shardings)


def batch_shards(mesh) -> int:
    """Devices the batch dim is split over: the product of `mesh`'s sizes along `LOGICAL_AXIS_RULES['batch']`
    (axes the mesh lacks count 1)."""
    shape = dict(mesh.shape)
    return math.prod(shape.get(a, 1) for a in LOGICAL_AXIS_RULES["batch"])


def batch_sharding(mesh: Mesh, ndim: int) -> NamedSharding:
    """Leading dim over ('data', 'fsdp', 'expert'), other dims replicated."""
    return NamedSharding(mesh, P(LOGICAL_AXIS_RULES["batch"], *([None] * (ndim - 1))))


def shard_batch(tree, mesh: Mesh):
    """Place every array leaf with its leading (batch) dim over ('data', 'fsdp', 'expert').

    Host leaves are the GLOBAL batch, the same on every process of a multi-process run (each process places
    its own rows); process-local rows go through `distributed.global_from_local` instead.
    Raises ValueError when a leading dim does not divide the batch axes' size.
    """
    n = _axis_size(dict(mesh.shape), LOGICAL_AXIS_RULES["batch"])

    def put(path, x):
        if not hasattr(x, "shape") or x.ndim == 0:
            return x
        sharding = batch_sharding(mesh, x.ndim)
        if x.shape[0] % n:
            raise ValueError(
                f"batch leaf {jax.tree_util.keystr(path)}: leading dim {x.shape[0]} is not divisible by "
                f"data*fsdp*expert={n}"
            )
        return jax.device_put(x, sharding)

    return jax.tree_util.tree_map_with_path(put, tree)


def cache_shardings(cache, mesh: Mesh):
    """Shardings for a decoder KVCache (per layer k [B, N, K, S], v [B, N, S, K]): batch over data/fsdp/expert,
    kv heads over tensor; same pytree structure as `cache`."""
    k = NamedSharding(mesh, logical_to_mesh_spec(("batch", "kv_heads", "head_dim", "cache_seq")))
    v = NamedSharding(mesh, logical_to_mesh_spec(("batch", "kv_heads", "cache_seq", "head_dim")))
    return type(cache)(
        k=tuple(k for _ in cache.k),
        v=tuple(v for _ in cache.v),
        mask=batch_sharding(mesh, 2),
        index=NamedSharding(mesh, P()),
    )


def constrain(x: jax.Array, names: Sequence[str | None]) -> jax.Array:
    """with_sharding_constraint by logical names when an ambient mesh with our axes is set
    (`jax.set_mesh`); a no-op otherwise or when a dim does not divide its axes. Inside a `shard_map` the spec keeps
    only the automatic axes (a no-op when all are manual)."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh is None or mesh.empty or not set(MESH_AXES) <= set(mesh.axis_names) or mesh.are_all_axes_manual:
        return x
    spec = _drop_axes(logical_to_mesh_spec(names), set(mesh.manual_axes))  # inside a shard_map: its auto axes
    sizes = dict(zip(mesh.axis_names, mesh.axis_sizes))
    if any(x.shape[d] % _axis_size(sizes, a) for d, a in enumerate(spec)):
        return x
    return jax.lax.with_sharding_constraint(x, spec)


def _drop_axes(spec: P, axes: set) -> P:
    """`spec` without the mesh axes `axes` (a dim left with none: None)."""
    if not axes:
        return spec
    out = []
    for a in spec:
        kept = tuple(x for x in ((a,) if isinstance(a, str) else (a or ())) if x not in axes)
        out.append(None if not kept else kept[0] if len(kept) == 1 else kept)
    return P(*out)


class InMesh:
    """A jitted fn called -- and so traced -- with `mesh` as the ambient mesh (`jax.set_mesh`), so the model's
    activation constraints (`constrain`) take effect inside it; other attributes (`lower`, `_cache_size`)
    are the jitted fn's. `mesh=None` calls `fn` as it is."""

    def __init__(self, fn, mesh: Mesh | None):
        self._fn, self._mesh = fn, mesh

    def __call__(self, *args, **kwargs):
        if self._mesh is None:
            return self._fn(*args, **kwargs)
        with jax.set_mesh(self._mesh):
            return self._fn(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._fn, name)


HOST_MEMORY = "pinned_host"  # memory kind of an offloaded optimizer state (host RAM the device can DMA)


def on_host(tree) -> bool:
    """True when any array leaf of `tree` lives in host memory (`sharding.memory_kind == 'pinned_host'`)."""
    return any(getattr(x.sharding, "memory_kind", None) == HOST_MEMORY for x in jax.tree.leaves(tree))


def init_opt_state(tx, params, mesh: Mesh | None, *, offload: bool = False):
    """`tx.init(params)` with every param-shaped optimizer leaf (Adam mu / nu, ...) sharded like its param and
    the rest (step counts) replicated -- under FSDP a device holds 1/N of the optimizer state, as of the
    params (`jax.jit(tx.init)` alone returns every leaf replicated).

    `offload=True` (`actor.fsdp_config.optimizer_offload`): the same shardings with `memory_kind='pinned_host'`,
    so the state lives in host RAM between updates (`placement.Placement.jit_update` moves it to the device
    inside the update and back). `mesh=None` (one device): every leaf on the params' device."""
    if mesh is None:
        if not offload:
            return jax.jit(tx.init)(params)
        (device,) = jax.tree.leaves(params)[0].sharding.device_set
        one = jax.sharding.SingleDeviceSharding(device, memory_kind=HOST_MEMORY)
        return jax.jit(tx.init, out_shardings=jax.tree.map(lambda _: one, jax.eval_shape(tx.init, params)))(params)
    import optax

    replicated = NamedSharding(mesh, P())
    abstract = jax.eval_shape(tx.init, params)
    param_sh = jax.tree.map(lambda x: x.sharding, params)
    shardings = optax.tree_map_params(
        tx, lambda _, sh: sh, abstract, param_sh, transform_non_params=lambda _: replicated
    )
    if offload:
        shardings = jax.tree.map(lambda sh: sh.with_memory_kind(HOST_MEMORY), shardings)
    return jax.jit(tx.init, out_shardings=shardings)(params)
