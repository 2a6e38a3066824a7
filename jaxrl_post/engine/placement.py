"""Where arrays live and how the trainer's jitted functions are built and called: one `Placement` per run.

`Placement` holds the device mesh and the trace counters of every jitted fn, and the helpers every role uses
to commit params to their shardings (`commit`), jit an update with donated params / optimizer state
(`jit_update`), put a host batch on the mesh (`put`, packed: `put_packed` / `pack`) and run a jitted forward
over a whole `[B, ...]` host batch (`forward`). `pack_spec` is the static packing geometry of one pass.
Every jitted fn counts its traces in `Placement.trace_counts` (tests assert zero recompiles after step 1).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_post.batch.keys import FORWARD_KEYS, OPTIONAL_PACK_KEYS, PACK_KEYS, REPLAY_KEYS, TOKEN_KEYS
from jaxrl_post.engine import packing
from jaxrl_post.engine.token_fields import pack_tokens, unpack_tokens
from jaxrl_post.runtime.distributed import global_from_local, local_part, local_rows, to_host
from jaxrl_post.runtime.sharding import LOGICAL_AXIS_RULES, InMesh, batch_shards, on_host, shard_batch


def to_numpy(x) -> np.ndarray:
    """A (possibly sharded, possibly multi-process) device array as one host numpy array (every process)."""

    return to_host(x)


def pad_rows(arrays: dict[str, np.ndarray], multiple: int) -> tuple[dict[str, np.ndarray], int]:
    """Pad the leading dim of every array up to a multiple of `multiple` with copies of row 0."""
    n = next(iter(arrays.values())).shape[0]
    pad = (-n) % multiple
    if not pad:
        return arrays, 0
    return {k: np.concatenate([v, np.repeat(v[:1], pad, axis=0)], axis=0) for k, v in arrays.items()}, pad


def _opt_state_to_device(fn, device_shardings):
    """`fn(params, opt_state, *rest)` with `opt_state` first put in device memory (`device_shardings`)."""

    def update(params, opt_state, *rest, **kwargs):
        return fn(params, jax.device_put(opt_state, device_shardings), *rest, **kwargs)

    return update


class Placement:
    """The run's mesh, trace counters and placement / jit helpers (see the module docstring).

    Args:
      mesh: the device mesh (`builders.build_mesh`).
      n_devices: devices of the run (default `jax.device_count()`); 1 = no shardings, no mesh context.
      sharded: arrays placed on `mesh` by explicit shardings (default: `n_devices > 1`); True for a one-device
        mesh that is not the default device (the split placement's training mesh, `builders.build_meshes`).

    Attribute `process_local_rows` (set by the trainer, `trainer.distributed.process_local_rows` on several
    processes): host batches given to `put` / `forward` are this process's rows only (built into global arrays by
    `distributed.global_from_local`) and `forward` returns this process's rows; False: the global batch.
    """

    def __init__(self, mesh, n_devices: int | None = None, *, sharded: bool | None = None):
        self.mesh = mesh
        self.n_devices = jax.device_count() if n_devices is None else int(n_devices)
        self.sharded = self.n_devices > 1 if sharded is None else bool(sharded)
        self.trace_counts: dict[str, int] = {}
        self.process_local_rows = False

    @property
    def active_mesh(self):
        """The mesh jitted fns run under (None on one device, unless `sharded`)."""
        return self.mesh if self.sharded else None

    def tracer(self, name: str) -> Callable[[], None]:
        """A callback that counts one trace of the jitted fn `name` in `trace_counts`."""

        def on_trace():
            self.trace_counts[name] = self.trace_counts.get(name, 0) + 1

        return on_trace

    def commit(self, tree):
        """Commit every leaf to its sharding, so jit sees the same argument signature on every call
        (outputs of the donated update are committed; fresh arrays may not be -> a second compile).
        Leaves living on a single device (e.g. optimizer step counts) are replicated over the mesh."""
        from jax.sharding import NamedSharding, PartitionSpec

        replicated = NamedSharding(self.mesh, PartitionSpec())

        def one(x):
            if isinstance(x.sharding, NamedSharding) or not self.sharded:
                return jax.device_put(x, x.sharding)
            return jax.device_put(x, replicated)

        return jax.tree.map(one, tree)

    def opt_mesh(self):
        """The mesh optimizer states are sharded over like their params (None on one device)."""
        return self.active_mesh

    def jit_update(self, fn, params, opt_state):
        """jit with donated params/opt state and their shardings pinned on the way out.

        An optimizer state in host memory (`sharding.init_opt_state(..., offload=True)`: memory kind
        'pinned_host') is moved to device memory at the start of the update and the new state written back to
        host memory (its out_shardings keep the host memory kind); the arithmetic is unchanged."""

        shard = lambda t: jax.tree.map(lambda x: x.sharding, t)
        if on_host(opt_state):
            fn = _opt_state_to_device(fn, jax.tree.map(lambda s: s.with_memory_kind("device"), shard(opt_state)))
        jitted = jax.jit(fn, donate_argnums=(0, 1), out_shardings=(shard(params), shard(opt_state), None))
        return InMesh(jitted, self.active_mesh)  # activation constraints take effect

    def put(self, tree: dict[str, np.ndarray]) -> dict[str, jax.Array]:
        """Host `[M, ...]` arrays on the mesh, rows split over the batch axes (one device: plain arrays); with
        `process_local_rows`, this process's `[M / processes, ...]` rows of the global `[M, ...]` arrays."""
        if self.process_local_rows:
            return {k: global_from_local(v, self.mesh) for k, v in tree.items()}
        if self.sharded:
            return shard_batch(tree, self.mesh)
        return {k: jnp.asarray(v) for k, v in tree.items()}

    def put_packed(self, tree: dict[str, np.ndarray]) -> dict[str, jax.Array]:
        """Place a packed mini-batch: packed rows `[n, rows, L]` split over ('data', 'fsdp', 'expert') on the rows dim,
        and so a per-shard `slot_pos [n, shards, Q / shards]` on its shard dim (`packing.PackSpec.shards`); the
        rest of the small packing plan (`[n, Q]`, `[n, S, ...]`) replicated, `[M, ...]` fields as `put`."""
        if not self.sharded:
            return {k: jnp.asarray(v) for k, v in tree.items()}
        from jax.sharding import NamedSharding, PartitionSpec

        rows = NamedSharding(self.mesh, PartitionSpec(None, LOGICAL_AXIS_RULES["batch"]))
        plan = NamedSharding(self.mesh, PartitionSpec())
        # `slot_threshold [n, Q]` too; the packed `routed_experts [n, rows, L, M, k]` go with the rows
        plan_keys = [k for k in PACK_KEYS + OPTIONAL_PACK_KEYS + REPLAY_KEYS if k in tree]
        out = self.put({k: v for k, v in tree.items() if k not in plan_keys})
        for k in plan_keys:
            per_shard = k == "slot_pos" and np.ndim(tree[k]) == 3
            sharding = rows if k in ("input_ids", "segment_ids", "positions", *REPLAY_KEYS) or per_shard else plan
            out[k] = jax.device_put(tree[k], sharding)
        return out

    @staticmethod
    def pack(mb: dict[str, np.ndarray], spec: packing.PackSpec, plan=None) -> dict[str, np.ndarray]:
        """`[M, ...]` host mini-batch -> the packed step's input: packing plan + the `[M, R]` fields, and the
        `[M, T, ...]` replay fields (`routed_experts`) packed like `input_ids`. `plan`: `packing.plan_batch`."""
        plan = packing.plan_batch(mb, spec) if plan is None else plan
        packed = packing.pack_batch(mb, spec, plan)
        rest = {k: v for k, v in mb.items() if k not in TOKEN_KEYS + REPLAY_KEYS}
        packed.update({k: pack_tokens(mb[k], plan, spec) for k in REPLAY_KEYS if k in mb})
        return dict(rest, **packed)

    def put_minibatch(self, mb: dict[str, np.ndarray], spec: packing.PackSpec | None) -> dict[str, jax.Array]:
        """An update's mini-batch on the mesh: packed with `spec`, else padded rows as they are."""
        return self.put(mb) if spec is None else self.put_packed(self.pack(mb, spec))

    def forward(
        self,
        fn,
        params,
        batch: dict[str, np.ndarray],
        micro: int,
        spec: packing.PackSpec | None = None,
        frozen=None,
        keys: tuple[str, ...] = FORWARD_KEYS,
        token_output: bool = False,
    ):
        """Run a jitted forward over the whole [B, ...] batch: packed with `spec`, else padded to a multiple
        of `micro` rows (under the mesh, so activation constraints take effect). `frozen`: a LoRA actor's base
        params (the fn's trailing argument). `keys`: the batch keys the fn gets (the actor's forward adds
        `REPLAY_KEYS`). `token_output`: the fn's last output is a per-token field in the layout's token layout
        (packed rows `[n, rows, L, ...]` or `[B, T, ...]`), returned as `[B, T, ...]` (`token_fields`).
        Returns the fn's outputs as host numpy arrays, `[B, ...]`. With `process_local_rows` (padded layout only):
        `batch` and the outputs are this process's rows, padded per process."""
        fn = InMesh(fn, self.active_mesh)
        if self.process_local_rows:
            return self._forward_local(fn, params, batch, micro, spec, frozen, keys)
        extra = () if frozen is None else (frozen,)
        if spec is not None:
            mb = {k: batch[k] for k in keys if k in batch}
            plan = packing.plan_batch(mb, spec)
            out = jax.tree.map(to_numpy, fn(params, self.put_packed(self.pack(mb, spec, plan)), *extra))
            if token_output:
                out = (*out[:-1], unpack_tokens(out[-1], plan, spec, batch["input_ids"].shape[1]))
            return out
        arrays, pad = pad_rows({k: batch[k] for k in keys if k in batch}, micro)
        out = fn(params, self.put(arrays), *extra)
        out = jax.tree.map(lambda x: to_numpy(x)[: arrays["input_ids"].shape[0] - pad], out)
        return out

    def _forward_local(self, fn, params, batch, micro, spec, frozen, keys):
        """`forward` on this process's rows: padded to a multiple of its share of `micro` (and of its devices on
        the batch axes), placed by `global_from_local`; the outputs' rows of this process returned."""
        if spec is not None:
            raise ValueError("process-local rows run the padded layout only (model.use_remove_padding=False)")
        nproc = jax.process_count()
        mine = max(micro // nproc, 1) if micro % nproc == 0 else micro
        arrays, pad = pad_rows({k: batch[k] for k in keys if k in batch}, math.lcm(mine, self._local_batch_devices()))
        n = arrays["input_ids"].shape[0]
        out = fn(params, self.put(arrays), *(() if frozen is None else (frozen,)))
        return jax.tree.map(lambda x: self._own_rows(x, n * nproc)[: n - pad], out)

    def _local_batch_devices(self) -> int:
        """This process's share of the mesh's batch-axes devices (rows of a batch-sharded array it holds per row
        of each of its devices)."""
        sl = local_rows(self.mesh, batch_shards(self.mesh))
        return sl.stop - sl.start

    def _own_rows(self, x, n_global: int) -> np.ndarray:
        """This process's rows of a `[n_global, ...]` output (batch-sharded or replicated)."""
        if getattr(x, "is_fully_replicated", False) or getattr(x, "is_fully_addressable", True):
            sl = local_rows(self.mesh, n_global)
            return np.asarray(x.addressable_data(0) if hasattr(x, "addressable_data") else x)[sl]
        return local_part(x)
