"""Weights from a training process to rollout processes of their own (issue 57 item 6), through
`jax.experimental.transfer`: JAX's point-to-point device transfer server (the mechanism verl's and NeMo-RL's JAX
peers use for disaggregated rollout), not a transport of ours.

A split placement inside one process moves the weights with one `jax.device_put` (placement.py). Across processes,
the rollout and the trainer are separate JAX programs (separate processes, no `jax.distributed` collective between
them): the training process stages the params in the rollout's layout on its own devices and offers them under the
policy version (`TransferServer.await_pull`); the rollout process pulls them straight into its mesh
(`TransferConnection.pull`). The transfer copies shards as they are, so the staging layout must be the rollout's:
the same mesh shape and the same partition specs (from the params' logical names, `runtime.sharding.param_shardings`)
on the first `rollout mesh size` local devices of the training process (measured: a 2-shard source pulled into a
1-device destination fails in the pull with "Async transfer object was deleted before transfers completed").

Use:
  training process:  pub = WeightPublisher(rollout_mesh_shape); addr = pub.address  (hand it to the rollout process)
                     nbytes = pub.publish(version, params)       (every weight publication)
  rollout process:   sub = WeightSubscriber(addr, like=abstract params, mesh=rollout mesh)
                     params = sub.pull(version)                  (blocks until offered)

Servers bind the given address; the default is loopback (tests). On a cluster, pass the host's routable address.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import jax
import numpy as np
from jax.experimental import transfer
from jax.sharding import Mesh

from jaxrl_post.runtime.sharding import MESH_AXES, param_shardings

LOOPBACK = "127.0.0.1:0"


def start_server(address: str = LOOPBACK):
    """A transfer server on this process's devices (`jax.local_devices()[0].client`), listening on `address`
    ('host:port'; port 0 picks a free one) for connections and transfers."""
    return transfer.start_transfer_server(jax.local_devices()[0].client, address, [address])


def staging_mesh(shape: dict[str, int], devices: Sequence | None = None) -> Mesh:
    """A mesh of `shape` (mesh axis -> size, as the rollout mesh's `dict(mesh.shape)`) over the first
    `prod(shape)` of `devices` (default: this process's devices). Raises ValueError when there are too few."""
    sizes = [int(shape.get(a, 1)) for a in MESH_AXES]
    devs = list(jax.local_devices() if devices is None else devices)
    n = math.prod(sizes)
    if n > len(devs):
        raise ValueError(
            f"the rollout mesh {dict(zip(MESH_AXES, sizes))} needs {n} devices to stage on, have {len(devs)}"
        )
    return Mesh(np.asarray(devs[:n], dtype=object).reshape(sizes), MESH_AXES)


class WeightPublisher:
    """The training process's side.

    Args:
      rollout_mesh_shape: the rollout mesh's axis sizes (`dict(rollout_mesh.shape)`), which the staging mesh copies.
      address: where the server listens ('host:port'; default loopback, a free port).
      devices: the devices to stage on (default: this process's; the first `prod(shape)` are used).

    Attributes: `address` (what the rollout process connects to), `mesh` (the staging mesh).
    """

    def __init__(self, rollout_mesh_shape: dict[str, int], address: str = LOOPBACK, devices: Sequence | None = None):
        self.mesh = staging_mesh(rollout_mesh_shape, devices)
        self._server = start_server(address)
        self._offered: dict[int, object] = {}  # version -> the staged arrays, alive until pulled or replaced

    @property
    def address(self) -> str:
        return self._server.address()

    def publish(self, version: int, params) -> int:
        """Offer `params` (an nnx.State or any pytree of arrays with logical names) as policy `version`, staged in
        the rollout's layout; returns the bytes offered (what crosses to the rollout process). Only the newest
        offer is kept alive: the rollout pulls each version once, the latest."""
        staged = jax.device_put(params, param_shardings(params, self.mesh))
        self._offered = {int(version): staged}
        self._server.await_pull(int(version), staged)
        return sum(int(x.size) * x.dtype.itemsize for x in jax.tree.leaves(staged))


class WeightSubscriber:
    """The rollout process's side.

    Args:
      address: the publisher's `address`.
      like: the params' abstract tree (`nnx.eval_shape` of the model's state, or arrays: shapes and dtypes).
      mesh: the rollout mesh (this process's devices) the weights land on, sharded by their logical names.
      listen: this side's own server address (default loopback).
    """

    def __init__(self, address: str, like, mesh: Mesh, listen: str = LOOPBACK):
        self._server = start_server(listen)
        self._conn = self._server.connect(address)
        shardings = param_shardings(like, mesh)
        self._like = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), like, shardings)

    def pull(self, version: int):
        """The params offered as `version`, on the rollout mesh (blocks until the publisher offers them)."""
        return self._conn.pull(int(version), self._like)
