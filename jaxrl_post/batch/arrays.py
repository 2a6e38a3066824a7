"""Row-wise array helpers behind ``DataProto`` (``jaxrl_post.batch.protocol``): numpy arrays stay numpy, jax arrays
stay jax; index arrays are validated on the host (a jax gather would clamp out-of-range indices)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

Array = jax.Array | np.ndarray


def is_jax(x: Any) -> bool:
    return isinstance(x, jax.Array)


def to_object_array(values: Sequence[Any]) -> np.ndarray:
    """A list/tuple of B arbitrary Python objects -> 1-D ``object`` array of length B.

    ``np.array(list_of_lists, dtype=object)`` would build a 2-D array when the inner lists have equal
    lengths; filling element by element always gives shape ``[B]``.
    """
    out = np.empty(len(values), dtype=object)
    for i, v in enumerate(values):
        out[i] = v
    return out


def as_batch_array(key: str, value: Any) -> Array:
    if is_jax(value):
        return value
    arr = value if isinstance(value, np.ndarray) else np.asarray(value)
    if arr.dtype.kind in "OUS":
        raise TypeError(f"batch key {key!r} has dtype {arr.dtype}; put non-numeric data in non_tensor_batch instead")
    return arr


def as_non_tensor_array(key: str, value: Any) -> np.ndarray:
    if isinstance(value, np.ndarray):
        return value
    if is_jax(value):
        return np.asarray(value)
    if isinstance(value, (list, tuple)):
        return to_object_array(value)
    raise TypeError(f"non_tensor_batch key {key!r} must be a numpy array, list or tuple, got {type(value).__name__}")


def take(x: Array, idx: slice | np.ndarray) -> Array:
    """Rows ``idx`` of ``x`` (leading dim), keeping numpy/jax type. ``idx`` is a slice or int64 array."""
    if isinstance(idx, slice) or not is_jax(x):
        return x[idx]
    return x[jnp.asarray(idx)]


def concat(arrays: Sequence[Array]) -> Array:
    if any(is_jax(a) for a in arrays):
        return jnp.concatenate([jnp.asarray(a) for a in arrays], axis=0)
    return np.concatenate(arrays, axis=0)


def normalize_index(idx: Any, n: int) -> np.ndarray:
    """An index array/list (int or bool) -> validated non-negative int64 numpy array."""
    arr = np.asarray(idx)
    if arr.dtype == bool:
        if arr.shape != (n,):
            raise IndexError(f"boolean mask has shape {arr.shape}, expected ({n},)")
        return np.flatnonzero(arr)
    if arr.size == 0:
        arr = arr.astype(np.int64)
    if not np.issubdtype(arr.dtype, np.integer):
        raise IndexError(f"index array must have an integer or bool dtype, got {arr.dtype}")
    if arr.ndim != 1:
        raise IndexError(f"index array must be 1-D, got shape {arr.shape}")
    if arr.size and (arr.max() >= n or arr.min() < -n):
        bad = int(arr[(arr >= n) | (arr < -n)][0])
        raise IndexError(f"index {bad} is out of bounds for DataProto of length {n}")
    return np.where(arr < 0, arr + n, arr).astype(np.int64)


def deep_equal(a: Any, b: Any) -> bool:
    """Structural equality for arrays (numpy/jax/object), dicts, lists and scalars; NaN == NaN."""
    if a is b:
        return True
    if isinstance(a, (np.ndarray, jax.Array)) or isinstance(b, (np.ndarray, jax.Array)):
        if not isinstance(a, (np.ndarray, jax.Array)) or not isinstance(b, (np.ndarray, jax.Array)):
            return False
        if a.shape != b.shape:
            return False
        if is_jax(a) and is_jax(b):
            if a.dtype != b.dtype:
                return False
            return bool(jnp.array_equal(a, b, equal_nan=jnp.issubdtype(a.dtype, jnp.inexact)))
        a, b = np.asarray(a), np.asarray(b)
        if a.dtype == object or b.dtype == object:
            return all(deep_equal(x, y) for x, y in zip(a.ravel(), b.ravel()))
        if a.dtype != b.dtype:
            return False
        return bool(np.array_equal(a, b, equal_nan=np.issubdtype(a.dtype, np.inexact)))
    if isinstance(a, dict) or isinstance(b, dict):
        if not (isinstance(a, dict) and isinstance(b, dict)) or a.keys() != b.keys():
            return False
        return all(deep_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) or isinstance(b, (list, tuple)):
        if type(a) is not type(b) or len(a) != len(b):
            return False
        return all(deep_equal(x, y) for x, y in zip(a, b))
    if isinstance(a, float) and isinstance(b, float) and a != a and b != b:
        return True  # both NaN
    try:
        return bool(a == b)
    except Exception:
        return False


def describe(x: Any) -> str:
    kind = "jax" if is_jax(x) else "np"
    return f"{kind}.{x.dtype}{list(x.shape)}"


def check_same_keys_and_shapes(items: Sequence[tuple[dict, dict]]) -> None:
    """`(batch, non_tensor_batch)` pairs of the parts `DataProto.concat` joins: the same keys and the same
    trailing shapes in every part as in the first. Raises ValueError naming the key and the part."""
    for i, (batch, non_tensor) in enumerate(items[1:], start=1):
        for where, a, b in (
            ("batch", items[0][0], batch),
            ("non_tensor_batch", items[0][1], non_tensor),
        ):
            if a.keys() != b.keys():
                raise ValueError(f"concat: item {i} has {where} keys {sorted(b)} but item 0 has {sorted(a)}")
            for k in a:
                if a[k].shape[1:] != b[k].shape[1:]:
                    raise ValueError(
                        f"concat: {where} key {k!r} has trailing shape {a[k].shape[1:]} in item 0 "
                        f"but {b[k].shape[1:]} in item {i}"
                    )


def merge_meta_info(metas: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The `meta_info` of concatenated parts: a key in several parts must hold equal values (`deep_equal`),
    except `"metrics"` dicts, which become `{name: [v_part0, ...]}`. Raises ValueError."""
    meta: dict[str, Any] = {}
    metrics: list[dict] = []
    for m_info in metas:
        for k, v in m_info.items():
            if k == "metrics" and isinstance(v, dict):
                metrics.append(v)
            elif k in meta and not deep_equal(meta[k], v):
                raise ValueError(f"concat: meta_info key {k!r} differs between items")
            else:
                meta.setdefault(k, v)
    if metrics:
        merged: dict[str, list] = {}
        for m in metrics:
            for name, v in m.items():
                merged.setdefault(name, []).append(v)
        meta["metrics"] = merged
    return meta
