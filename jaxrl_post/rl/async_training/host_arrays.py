"""Host arrays of the asynchronous state (queued groups, the batch in flight, pending prompts) in a checkpoint.

Numeric arrays go into one flat buffer per dtype (`ArrayPacker`), saved as the orbax array item `async.arrays`
next to the train state (written and committed with it, so as atomic as the rest of the step); the host JSON keeps
only a reference per array (`{"dtype", "shape", "offset"}`) and the small metadata (versions, counters, reasons).
Object and string arrays (`uid`, `data_source`, `extra_info` dicts: a few short values per row) stay in the JSON
as lists. Checkpoints written before the array item (every array a JSON list, `{"dtype", "shape", "data"}`) still
decode: `decode_array` reads both forms.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np


class ArrayPacker:
    """Collects numeric arrays into one flat 1-D buffer per dtype (`arrays()`: `{dtype name: [N] dtype}`).

    `add(x)` returns the JSON reference of `x`: `{"dtype", "shape", "offset"}` (offset in elements of its dtype's
    buffer). Empty arrays take no space (shape alone). The buffers are new arrays: later changes to the arrays
    added do not reach a checkpoint being written."""

    def __init__(self):
        self._parts: dict[str, list[np.ndarray]] = {}
        self._sizes: dict[str, int] = {}

    def add(self, x: np.ndarray) -> dict[str, Any]:
        x = np.asarray(x)
        key = str(x.dtype)
        offset = self._sizes.get(key, 0)
        if x.size:
            self._parts.setdefault(key, []).append(x.reshape(-1))
            self._sizes[key] = offset + x.size
        return {"dtype": key, "shape": list(x.shape), "offset": offset}

    def sizes(self) -> dict[str, int]:
        """`{dtype name: elements}` of the buffers (what a restore needs to read them)."""
        return dict(self._sizes)

    def arrays(self) -> dict[str, np.ndarray]:
        return {k: np.concatenate(v) for k, v in self._parts.items()}


def encode_array(x: np.ndarray, packer: ArrayPacker | None = None) -> dict[str, Any]:
    """`x` as JSON: a reference into `packer`'s buffers for numeric arrays when a packer is given, else (and for
    object and string arrays) `{"dtype", "shape", "data"}` with a flat list (exact for ints, bools and float32)."""
    x = np.asarray(x)
    if x.dtype == object or x.dtype.kind in "US":
        return {"dtype": "object", "shape": list(x.shape), "data": x.reshape(-1).tolist()}
    if packer is not None:
        return packer.add(x)
    return {"dtype": str(x.dtype), "shape": list(x.shape), "data": x.reshape(-1).tolist()}


def decode_array(d: dict[str, Any], arrays: dict[str, np.ndarray] | None = None) -> np.ndarray:
    """Inverse of `encode_array`: `arrays` are the packer's buffers as restored (`{dtype name: [N]}`).

    Raises:
      KeyError: a packed reference without its dtype's buffer in `arrays`.
    """
    if "data" in d:  # a JSON list (object arrays; every array of a checkpoint from before the array item)
        if d["dtype"] == "object":
            out = np.empty(len(d["data"]), dtype=object)
            out[:] = d["data"]
            return out.reshape(d["shape"])
        return np.asarray(d["data"], dtype=np.dtype(d["dtype"])).reshape(d["shape"])
    shape, dtype = tuple(d["shape"]), np.dtype(d["dtype"])
    size = math.prod(shape)
    if size == 0:
        return np.zeros(shape, dtype)
    if arrays is None or d["dtype"] not in arrays:
        raise KeyError(f"the checkpoint's async.arrays item has no {d['dtype']} buffer")
    start = int(d["offset"])
    return np.array(np.asarray(arrays[d["dtype"]])[start : start + size], dtype=dtype).reshape(shape)
