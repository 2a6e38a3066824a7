"""The supervised trainers' data: the examples or pairs of a run, their step order, and batches on the mesh.

`SupervisedData.build(cfg, task, tokenizer)` reads `data.train_files` (and `data.val_files`, the first
`data.max_val_samples`) with the task's reader (`load_data`; errors name the file and row before the model loads),
packs the training set once when the task asks (`pack_dataset`: `data.packing_strategy='bfd'`), checks there is
a full batch, and makes the step order (`SFTBatches`: grain, shuffled each epoch, resumable). `next_indices`
gives one step's example (or pair) indices, and with bfd each packed row's members (`unpack_rows`).
`on_mesh` places a layout's host arrays on the mesh, rows over the batch axes. SFT, DPO and the reward model
share all of it (sft/trainer.py).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Collection
from typing import Any

import grain
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from jaxrl_post.engine.placement import Placement
from jaxrl_post.errors import ConfigError
from jaxrl_post.runtime.sharding import LOGICAL_AXIS_RULES
from jaxrl_post.sft import sft_step


class SFTBatches:
    """Example indices of each training step, `[train_batch_size] int64`: grain `MapDataset` shuffled per epoch
    (`data.shuffle`, `data.seed`), remainder dropped, repeated forever; `get_state` / `set_state` are the
    checkpointed position."""

    def __init__(self, n: int, batch_size: int, *, seed: int, shuffle: bool):
        ds = grain.MapDataset.range(n)
        if shuffle:
            ds = ds.shuffle(seed=seed)
        ds = ds.batch(batch_size, drop_remainder=True, batch_fn=lambda xs: np.asarray(xs, np.int64))
        self.batches_per_epoch = len(ds)
        opts = grain.ReadOptions(num_threads=0, prefetch_buffer_size=0)
        self._iter = iter(ds.repeat(None).to_iter_dataset(opts))

    def __next__(self) -> np.ndarray:
        return next(self._iter)

    def get_state(self) -> dict[str, Any]:
        return dict(self._iter.get_state())

    def set_state(self, state: dict[str, Any]) -> None:
        self._iter.set_state(dict(state))


def unpack_rows(packed_rows: list[list[int]], rows) -> tuple[np.ndarray, list[list[int]]]:
    """bfd: packed row indices -> (the example indices of those rows in order `[N] int64`, each row's members as
    positions into them: the `plan` the layouts take)."""
    members = [packed_rows[r] for r in rows]
    at = np.cumsum([0] + [len(row) for row in members])
    return np.asarray([i for row in members for i in row], np.int64), [list(range(a, b)) for a, b in zip(at, at[1:])]


def on_mesh(
    placement: Placement, arrays: dict[str, np.ndarray], micro_batch_size, row_keys: Collection[str] | None = None
) -> dict[str, jax.Array]:
    """Host arrays on the mesh: those named in `row_keys` (default: all; `[n_micro, rows, ...]`) with rows over
    the batch axes ('data', 'fsdp', 'expert'), the rest replicated. Every process passes the same arrays (multi-process
    runs); `micro_batch_size` is `data.micro_batch_size`, named in the error.

    Raises: ConfigError: a micro-batch's rows do not divide over the batch axes' devices."""
    if placement.n_devices == 1:
        return {k: jnp.asarray(v) for k, v in arrays.items()}
    mesh = placement.mesh
    row_keys = arrays.keys() if row_keys is None else arrays.keys() & set(row_keys)
    batch_axes = LOGICAL_AXIS_RULES["batch"]
    shards = math.prod(mesh.shape[a] for a in batch_axes)
    n_rows = {int(arrays[k].shape[1]) for k in row_keys}
    bad = sorted(n for n in n_rows if n % shards)
    if bad:
        raise ConfigError(
            f"data.micro_batch_size={micro_batch_size}: a micro-batch of {bad[0]} "
            f"rows cannot be split over the {shards} devices of the mesh's batch axes {batch_axes} "
            f"(trainer.mesh.*); use a micro-batch whose row count they divide, or fewer batch devices"
        )
    rows = NamedSharding(mesh, PartitionSpec(None, batch_axes, None))
    rep = NamedSharding(mesh, PartitionSpec())
    return {k: jax.device_put(v, rows if k in row_keys else rep) for k, v in arrays.items()}


@dataclasses.dataclass
class SupervisedData:
    """A supervised run's data and batch geometry (see the module docstring).

    Fields: `train` / `val` (the task's data objects; `val` None without `data.val_files`), `packed_rows`
    (bfd: the example indices of each packed row; else None), `loader` (`SFTBatches` over examples or packed
    rows), `batch_size` (`data.train_batch_size`), `row_len` (`data.max_length`), `pack`
    (`model.use_remove_padding`), `n_micro` / `rows` (`sft_step.micro_geometry`).
    """

    train: Any
    val: Any
    packed_rows: list[list[int]] | None
    loader: SFTBatches
    batch_size: int
    row_len: int
    pack: bool
    n_micro: int
    rows: int

    @classmethod
    def build(cls, cfg, task, tokenizer) -> SupervisedData:
        """Read, pack and order the data with `task`'s reader (`task.load_data`, `task.pack_dataset`,
        `task.head`). Raises ConfigError: fewer examples (bfd: packed rows) than `data.train_batch_size`, or a
        data file that does not exist; MalformedRowError from the reader."""
        d = cfg.data
        train = task.load_data(cfg, tokenizer, d.train_files, "train_files")
        batch_size, row_len = int(d.train_batch_size), int(d.max_length)
        packed_rows = task.pack_dataset(cfg, train, row_len)
        n_items = len(train) if packed_rows is None else len(packed_rows)
        if n_items < batch_size:
            unit = "examples (after skipping)" if packed_rows is None else "packed rows"
            raise ConfigError(
                f"config.data.train_files={d.train_files!r}: {n_items} {unit} for "
                f"data.train_batch_size={batch_size}; lower the batch size or add data"
            )
        val = None
        if d.val_files:
            val = task.load_data(cfg, tokenizer, d.val_files, "val_files")
            if d.max_val_samples:
                val = task.head(val, int(d.max_val_samples))
        loader = SFTBatches(n_items, batch_size, seed=int(d.seed), shuffle=bool(d.shuffle))
        n_micro, rows = sft_step.micro_geometry(batch_size, int(d.micro_batch_size))
        pack = bool(cfg.model.use_remove_padding)
        return cls(train, val, packed_rows, loader, batch_size, row_len, pack, n_micro, rows)

    def next_indices(self) -> tuple[np.ndarray, list[list[int]] | None]:
        """The next step's example (pair) indices `[N] int64` and, with bfd, each packed row's members as
        positions into them (the layouts' `plan`; None for per-step packing)."""
        idx = next(self.loader)
        if self.packed_rows is None:
            return idx, None
        return unpack_rows(self.packed_rows, idx)
