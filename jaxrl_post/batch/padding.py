"""Padding a `DataProto` (typed `Any` here: `DataProto`'s methods call these functions, so this module does not
import it) to a multiple of the data-parallel size and back (verl `pad_dataproto_to_divisor`,
`unpad_dataproto`); `DataProto.pad_to_divisor` / `.unpad` are the method forms."""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["pad_dataproto_to_divisor", "pad_to_divisor", "unpad", "unpad_dataproto"]


def pad_to_divisor(data: Any, size_divisor: int) -> tuple[Any, int]:
    """Pad ``data`` so that ``len`` is a multiple of ``size_divisor`` (e.g. the mesh's data-parallel
    size), filling with copies of rows taken from the start, wrapping around as needed (as verl's
    ``pad_dataproto_to_divisor``). Returns ``(padded, pad_size)``; ``pad_size`` may be 0 (``padded``
    is then ``data`` itself; an empty batch needs no padding). Raises ValueError for a non-positive
    divisor."""
    if not isinstance(size_divisor, (int, np.integer)) or size_divisor < 1:
        raise ValueError(f"pad_to_divisor: size_divisor must be a positive int, got {size_divisor!r}")
    n = len(data)
    pad_size = (-n) % size_divisor
    if pad_size == 0:
        return data, 0
    padded = data[np.arange(n + pad_size, dtype=np.int64) % n]
    return padded, int(pad_size)


def unpad(data: Any, pad_size: int) -> Any:
    """Drop the last ``pad_size`` rows added by :func:`pad_to_divisor` (verl ``unpad_dataproto``).
    Raises ValueError if ``pad_size`` is negative or larger than ``len(data)``."""
    if pad_size < 0 or pad_size > len(data):
        raise ValueError(f"unpad: pad_size {pad_size} is not in [0, {len(data)}]")
    return data if pad_size == 0 else data[: len(data) - pad_size]


pad_dataproto_to_divisor = pad_to_divisor
unpad_dataproto = unpad
