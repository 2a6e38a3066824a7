"""DataProto: the batch container that flows through the RL pipeline (verl's ``DataProto``).

A ``DataProto`` holds three things:

* ``batch``: ``dict[str, jax.Array | np.ndarray]`` of numeric arrays. Every array has a leading batch
  dimension and all leading dims are equal (``len(data)``), e.g. ``input_ids [B, T] int32``.
* ``non_tensor_batch``: ``dict[str, np.ndarray]`` with the same leading dim, ``dtype=object`` allowed
  (strings, dicts, lists: ``data_source``, ``extra_info``, ``raw_prompt``, ``uid``...).
* ``meta_info``: a plain ``dict`` of per-batch (not per-row) information (temperature, metrics, ...).

Row operations (indexing, ``chunk``, ``split``, ``concat``, ``repeat``, ``reorder``, padding) act on the
leading dimension of every array and keep each array's type: numpy arrays stay numpy (indexed with numpy),
jax arrays stay jax (indexed/concatenated with ``jnp``; index arrays are bounds-checked on the host first
because a jax gather would silently clamp out-of-range indices).

**JIT boundary decision.** ``DataProto`` is deliberately *not* registered as a JAX pytree: the
non-tensor part holds object arrays (unhashable, not valid leaves or aux data) and ``meta_info`` holds
arbitrary Python values, so a pytree registration would either be wrong or retrace on every call.
Instead the host loop passes the array part across jit boundaries: ``step(data.batch)`` or
``step(data.select(["input_ids", "attention_mask"]).batch)`` -- ``batch`` is a plain ``dict`` of arrays,
which is already a pytree. Results come back as dicts of arrays and are attached with
``data.union(DataProto.from_dict(out))``. ``device_put`` / ``to_numpy`` move the array part between host
and devices (e.g. with a ``NamedSharding`` from ``jaxrl_post.runtime.sharding``).

Source: verl ``verl/protocol.py`` (semantics of ``DataProto``, ``DataProtoItem``,
``pad_dataproto_to_divisor``, ``unpad_dataproto``); the implementation is independent.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_post.batch.arrays import (
    Array,
    as_batch_array,
    as_non_tensor_array,
    check_same_keys_and_shapes,
    concat,
    deep_equal,
    describe,
    is_jax,
    merge_meta_info,
    normalize_index,
    take,
)
from jaxrl_post.batch.padding import pad_dataproto_to_divisor, pad_to_divisor, unpad, unpad_dataproto

__all__ = [
    "DataProto",
    "DataProtoItem",
    "pad_to_divisor",
    "unpad",
    "pad_dataproto_to_divisor",
    "unpad_dataproto",
]

# ----------------------------------------------------------------------------- containers


@dataclasses.dataclass(eq=False)
class DataProtoItem:
    """One row of a ``DataProto`` (what ``data[i]`` returns, as verl's ``DataProtoItem``).

    ``batch[k]`` is row ``i`` of each array (shape = the array's trailing dims, same array type),
    ``non_tensor_batch[k]`` the row's element (e.g. a ``str`` or ``dict``), ``meta_info`` the parent's.
    """

    batch: dict[str, Array] = dataclasses.field(default_factory=dict)
    non_tensor_batch: dict[str, Any] = dataclasses.field(default_factory=dict)
    meta_info: dict[str, Any] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(eq=False, repr=False)
class DataProto:
    """verl's batch container: ``batch`` arrays, ``non_tensor_batch`` numpy (object) arrays, ``meta_info``.

    Args:
      batch: ``{key: [B, ...]}`` numeric ``jax.Array`` or ``np.ndarray`` (lists are converted with
        ``np.asarray``; object dtype is rejected with ``TypeError``).
      non_tensor_batch: ``{key: [B, ...] np.ndarray}``; lists/tuples become 1-D object arrays of length B.
      meta_info: free-form dict.

    Raises:
      ValueError: leading dims differ (message names the key, its size and the expected size) or an
        array has no leading dim. TypeError: a value of the wrong type.
    """

    batch: dict[str, Array] = dataclasses.field(default_factory=dict)
    non_tensor_batch: dict[str, np.ndarray] = dataclasses.field(default_factory=dict)
    meta_info: dict[str, Any] = dataclasses.field(default_factory=dict)

    def __post_init__(self):
        if self.batch is None:
            self.batch = {}
        if self.non_tensor_batch is None:
            self.non_tensor_batch = {}
        if self.meta_info is None:
            self.meta_info = {}
        if not isinstance(self.meta_info, dict):
            raise TypeError(f"meta_info must be a dict, got {type(self.meta_info).__name__}")
        self.batch = {k: as_batch_array(k, v) for k, v in self.batch.items()}
        self.non_tensor_batch = {k: as_non_tensor_array(k, v) for k, v in self.non_tensor_batch.items()}
        self.check_consistency()

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_dict(
        cls,
        tensors: dict[str, Any] | None = None,
        non_tensors: dict[str, Any] | None = None,
        meta_info: dict[str, Any] | None = None,
    ) -> DataProto:
        """Build from plain dicts (verl ``DataProto.from_dict``); dicts are copied, arrays are not.
        Lists in ``non_tensors`` become 1-D object arrays of length B (never 2-D)."""
        return cls(dict(tensors or {}), dict(non_tensors or {}), dict(meta_info or {}))

    @classmethod
    def from_single_dict(cls, data: dict[str, Any], meta_info: dict[str, Any] | None = None) -> DataProto:
        """Split one dict by value type (verl ``from_single_dict``): numeric arrays -> ``batch``;
        lists, tuples, and object/string numpy arrays -> ``non_tensor_batch``."""
        tensors, non_tensors = {}, {}
        for k, v in data.items():
            if is_jax(v) or (isinstance(v, np.ndarray) and v.dtype.kind in "biufc"):
                tensors[k] = v
            else:
                non_tensors[k] = v
        return cls(tensors, non_tensors, dict(meta_info or {}))

    def check_consistency(self) -> None:
        """Raise ``ValueError`` unless every array has a leading dim equal to the batch size."""
        expected, source = None, None
        for where, d in (("batch", self.batch), ("non_tensor_batch", self.non_tensor_batch)):
            for k, v in d.items():
                if v.ndim == 0:
                    raise ValueError(f"{where} key {k!r} is a scalar; it needs a leading batch dim")
                if expected is None:
                    expected, source = v.shape[0], f"{where} key {k!r}"
                elif v.shape[0] != expected:
                    raise ValueError(
                        f"{where} key {k!r} has leading dim {v.shape[0]}, expected {expected} "
                        f"(the batch size, taken from {source})"
                    )

    # ------------------------------------------------------------------ basic protocol
    def __len__(self) -> int:
        for d in (self.batch, self.non_tensor_batch):
            for v in d.values():
                return int(v.shape[0])
        return 0

    def __contains__(self, key: str) -> bool:
        return key in self.batch or key in self.non_tensor_batch

    def __iter__(self) -> Iterator[DataProtoItem]:
        for i in range(len(self)):
            yield self[i]

    def __repr__(self) -> str:
        b = ", ".join(f"{k}: {describe(v)}" for k, v in self.batch.items())
        nt = ", ".join(f"{k}: {describe(v)}" for k, v in self.non_tensor_batch.items())
        return (
            f"DataProto(len={len(self)}, batch={{{b}}}, non_tensor_batch={{{nt}}}, "
            f"meta_info_keys={list(self.meta_info)})"
        )

    def _rows(self, idx: slice | np.ndarray) -> DataProto:
        return DataProto(
            {k: take(v, idx) for k, v in self.batch.items()},
            {k: v[idx] for k, v in self.non_tensor_batch.items()},
            dict(self.meta_info),
        )

    def __getitem__(self, item: Any) -> DataProto | DataProtoItem:
        """``int`` -> ``DataProtoItem`` (one row, as verl); ``slice`` -> ``DataProto`` (numpy views);
        1-D int/bool index array, list or jax array -> ``DataProto`` (rows gathered, order kept).

        Raises IndexError (out of range, wrong mask length) / TypeError (unsupported key).
        """
        n = len(self)
        if isinstance(item, (bool, np.bool_)):
            raise TypeError("DataProto cannot be indexed with a bool scalar")
        if isinstance(item, (int, np.integer)):
            i = int(item)
            if not -n <= i < n:
                raise IndexError(f"index {i} is out of bounds for DataProto of length {n}")
            i %= n
            return DataProtoItem(
                {k: v[i] for k, v in self.batch.items()},
                {k: v[i] for k, v in self.non_tensor_batch.items()},
                self.meta_info,
            )
        if isinstance(item, slice):
            return self._rows(item)
        if isinstance(item, (list, tuple, np.ndarray, jax.Array)):
            return self._rows(normalize_index(item, n))
        raise TypeError(f"DataProto indices must be int, slice or 1-D index array, not {type(item).__name__}")

    # ------------------------------------------------------------------ key operations
    @staticmethod
    def _pick(d: dict, keys: Iterable[str] | None, where: str) -> dict:
        if keys is None:
            return dict(d)
        keys = [keys] if isinstance(keys, str) else list(keys)
        missing = [k for k in keys if k not in d]
        if missing:
            raise KeyError(f"{where} has no key(s) {missing}; available: {sorted(d)}")
        return {k: d[k] for k in keys}

    def select(
        self,
        batch_keys: Iterable[str] | None = None,
        non_tensor_batch_keys: Iterable[str] | None = None,
        meta_info_keys: Iterable[str] | None = None,
        deepcopy: bool = False,
    ) -> DataProto:
        """New ``DataProto`` with only the given keys (``None`` = all). Arrays are shared unless
        ``deepcopy`` (numpy arrays copied, object elements deep-copied; jax arrays are immutable).
        Raises KeyError naming missing keys."""
        batch = self._pick(self.batch, batch_keys, "batch")
        non_tensor = self._pick(self.non_tensor_batch, non_tensor_batch_keys, "non_tensor_batch")
        meta = self._pick(self.meta_info, meta_info_keys, "meta_info")
        if deepcopy:
            batch = {k: v if is_jax(v) else v.copy() for k, v in batch.items()}
            non_tensor = {k: copy.deepcopy(v) for k, v in non_tensor.items()}
            meta = copy.deepcopy(meta)
        return DataProto(batch, non_tensor, meta)

    def pop(
        self,
        batch_keys: Iterable[str] = (),
        non_tensor_batch_keys: Iterable[str] = (),
        meta_info_keys: Iterable[str] = (),
    ) -> DataProto:
        """Remove the given keys from ``self`` and return them as a new ``DataProto``.
        Raises KeyError (nothing removed) if a key is missing."""
        batch = self._pick(self.batch, batch_keys or (), "batch")
        non_tensor = self._pick(self.non_tensor_batch, non_tensor_batch_keys or (), "non_tensor_batch")
        meta = self._pick(self.meta_info, meta_info_keys or (), "meta_info")
        for d, picked in ((self.batch, batch), (self.non_tensor_batch, non_tensor), (self.meta_info, meta)):
            for k in picked:
                del d[k]
        return DataProto(batch, non_tensor, meta)

    def rename(self, old_keys: str | Sequence[str], new_keys: str | Sequence[str]) -> DataProto:
        """Rename keys of ``batch`` or ``non_tensor_batch`` in place; returns ``self`` (as verl).
        Raises KeyError (unknown old key) / ValueError (length mismatch or new key already present)."""
        old = [old_keys] if isinstance(old_keys, str) else list(old_keys)
        new = [new_keys] if isinstance(new_keys, str) else list(new_keys)
        if len(old) != len(new):
            raise ValueError(f"rename: {len(old)} old keys but {len(new)} new keys")
        for o, nk in zip(old, new):
            d = self.batch if o in self.batch else self.non_tensor_batch if o in self.non_tensor_batch else None
            if d is None:
                raise KeyError(f"rename: no key {o!r} in batch or non_tensor_batch")
            if nk != o and nk in self:
                raise ValueError(f"rename: key {nk!r} already exists")
            d[nk] = d.pop(o)
        return self

    def union(self, other: DataProto) -> DataProto:
        """Merge ``other`` into ``self`` in place and return ``self`` (as verl). A key present in both
        must hold equal values (arrays compared exactly, NaN == NaN), in ``batch``, ``non_tensor_batch``
        and ``meta_info`` alike. Raises ValueError on a length mismatch or a conflicting key."""
        if (self.batch or self.non_tensor_batch) and (other.batch or other.non_tensor_batch):
            if len(self) != len(other):
                raise ValueError(f"union: batch sizes differ ({len(self)} vs {len(other)})")
        for where, mine, theirs in (
            ("batch", self.batch, other.batch),
            ("non_tensor_batch", self.non_tensor_batch, other.non_tensor_batch),
            ("meta_info", self.meta_info, other.meta_info),
        ):
            for k, v in theirs.items():
                if k in mine and not deep_equal(mine[k], v):
                    raise ValueError(f"union: {where} key {k!r} exists in both with different values")
        self.batch.update(other.batch)
        self.non_tensor_batch.update(other.non_tensor_batch)
        self.meta_info.update(other.meta_info)
        return self

    # ------------------------------------------------------------------ row operations
    def chunk(self, chunks: int) -> list[DataProto]:
        """Split into ``chunks`` equal parts (verl ``chunk``). Raises ValueError if ``len(self)`` is not
        divisible by ``chunks``; pad first with ``pad_to_divisor``."""
        if not isinstance(chunks, (int, np.integer)) or chunks < 1:
            raise ValueError(f"chunk: chunks must be a positive int, got {chunks!r}")
        n = len(self)
        if n % chunks:
            raise ValueError(f"chunk: batch size {n} is not divisible by chunks={chunks}")
        size = n // chunks
        return [self._rows(slice(i * size, (i + 1) * size)) for i in range(chunks)]

    def split(self, split_size: int) -> list[DataProto]:
        """Consecutive parts of ``split_size`` rows; the last one may be smaller (verl ``split``)."""
        if not isinstance(split_size, (int, np.integer)) or split_size < 1:
            raise ValueError(f"split: split_size must be a positive int, got {split_size!r}")
        return [self._rows(slice(s, s + split_size)) for s in range(0, len(self), split_size)]

    @staticmethod
    def concat(data: Sequence[DataProto]) -> DataProto:
        """Concatenate along the batch dim (verl ``DataProto.concat``). All items must have the same
        batch / non_tensor keys and trailing shapes. ``meta_info`` is merged: a key in several items
        must hold equal values, except ``"metrics"`` (dicts), which become ``{name: [v_item0, ...]}``.
        jax arrays are joined with ``jnp.concatenate`` (numpy otherwise). Raises ValueError."""
        data = list(data)
        if not data:
            raise ValueError("concat: got an empty list")
        first = data[0]
        check_same_keys_and_shapes([(d.batch, d.non_tensor_batch) for d in data])
        batch = {k: concat([d.batch[k] for d in data]) for k in first.batch}
        non_tensor = {k: np.concatenate([d.non_tensor_batch[k] for d in data]) for k in first.non_tensor_batch}
        meta = merge_meta_info([d.meta_info for d in data])
        return DataProto(batch, non_tensor, meta)

    def repeat(self, repeat_times: int = 2, interleave: bool = True) -> DataProto:
        """Repeat every row ``repeat_times`` times (verl ``repeat``), e.g. to sample ``rollout.n``
        responses per prompt. ``interleave=True``: rows ``[a, a, b, b]`` (the copies of one prompt stay
        adjacent, ``np.repeat``); ``False``: ``[a, b, a, b]`` (``np.tile``). ``meta_info`` is copied."""
        if not isinstance(repeat_times, (int, np.integer)) or repeat_times < 1:
            raise ValueError(f"repeat: repeat_times must be a positive int, got {repeat_times!r}")
        base = np.arange(len(self), dtype=np.int64)
        idx = np.repeat(base, repeat_times) if interleave else np.tile(base, repeat_times)
        return self._rows(idx)

    def reorder(self, indices: Any) -> None:
        """Reorder rows in place, ``row i <- old row indices[i]`` (verl ``reorder``; usually a
        permutation, e.g. from sequence-length balancing). Raises IndexError on bad indices."""
        idx = normalize_index(indices, len(self))
        self.batch = {k: take(v, idx) for k, v in self.batch.items()}
        self.non_tensor_batch = {k: v[idx] for k, v in self.non_tensor_batch.items()}

    def pad_to_divisor(self, size_divisor: int) -> tuple[DataProto, int]:
        """Method form of :func:`pad_to_divisor`."""
        return pad_to_divisor(self, size_divisor)

    def unpad(self, pad_size: int) -> DataProto:
        """Method form of :func:`unpad`."""
        return unpad(self, pad_size)

    # ------------------------------------------------------------------ host/device
    def to_numpy(self) -> DataProto:
        """Copy with every ``batch`` array on the host as ``np.ndarray`` (``jax.device_get``; arrays must
        be fully addressable, i.e. gather multi-host arrays first). Other parts are shared."""
        return DataProto(jax.device_get(self.batch), dict(self.non_tensor_batch), dict(self.meta_info))

    def device_put(self, device_or_sharding: Any = None) -> DataProto:
        """Copy with every ``batch`` array as a ``jax.Array`` placed by ``jax.device_put``.

        ``device_or_sharding``: ``None`` (default device), a ``jax.Device`` or ``jax.sharding.Sharding``
        applied to every array (e.g. ``NamedSharding(mesh, P(('data', 'fsdp')))`` shards the leading
        dim), or a dict ``{key: device_or_sharding}`` (keys not in it go to the default device).
        Non-tensor data stays on the host."""
        if isinstance(device_or_sharding, dict):
            batch = {k: jax.device_put(v, device_or_sharding.get(k)) for k, v in self.batch.items()}
        else:
            batch = jax.device_put(self.batch, device_or_sharding)
        return DataProto(batch, dict(self.non_tensor_batch), dict(self.meta_info))

    # ------------------------------------------------------------------ pickling
    def __getstate__(self) -> dict[str, Any]:
        """Pickle with numpy arrays only (jax arrays are fetched to host; ``jax_keys`` records them)."""
        return {
            "batch": jax.device_get(self.batch),
            "jax_keys": [k for k, v in self.batch.items() if is_jax(v)],
            "non_tensor_batch": self.non_tensor_batch,
            "meta_info": self.meta_info,
        }

    def __setstate__(self, state: dict[str, Any]) -> None:
        """Restore; arrays that were jax become jax arrays on the default device again."""
        jax_keys = set(state.get("jax_keys", ()))
        self.batch = {k: jnp.asarray(v) if k in jax_keys else v for k, v in state["batch"].items()}
        self.non_tensor_batch = state["non_tensor_batch"]
        self.meta_info = state["meta_info"]
