"""Split placement (`rollout.n_gpus_per_node` > 0, docs/async.md): disjoint rollout and training device sets, each
its own ('data', 'fsdp', 'expert', 'tensor') mesh, and the weight publication from the training mesh to the rollout
mesh as one batched `jax.device_put` of the whole params tree (one call: JAX moves every leaf between the two device
sets; a jitted program cannot span disjoint meshes), with its bytes. The trainer builds its meshes with
`rl.builders.build_meshes`; `RolloutRole.sync` publishes."""

from __future__ import annotations

from collections.abc import Sequence

import jax
from jax.sharding import Mesh

from jaxrl_post.runtime.sharding import make_mesh, param_shardings


def split_meshes(devices: Sequence, n_rollout: int, *, tensor: int = 1) -> tuple[Mesh, Mesh]:
    """`(rollout_mesh, train_mesh)`: the first `n_rollout` devices and the rest, each a mesh with `tensor`-way tensor
    parallelism and the remaining devices on 'fsdp'. Raises ValueError when either set is empty or `tensor` does
    not divide it."""
    devs = list(devices)
    if not 0 < n_rollout < len(devs):
        raise ValueError(f"split placement: {n_rollout} rollout devices of {len(devs)}; both sets need >= 1")
    return make_mesh(1, -1, tensor, devs[:n_rollout]), make_mesh(1, -1, tensor, devs[n_rollout:])


def publish_weights(params, rollout_mesh: Mesh):
    """The training params (an nnx.State placed on the training mesh) on `rollout_mesh`, sharded by their logical
    names (`runtime.sharding.param_shardings`). Returns `(rollout_params, bytes)`: bytes = the params' total size,
    what crosses between the device sets (the `async/publish_bytes` metric)."""
    shardings = param_shardings(params, rollout_mesh)
    out = jax.device_put(params, shardings)
    nbytes = sum(int(x.size) * x.dtype.itemsize for x in jax.tree.leaves(params))
    return out, nbytes
