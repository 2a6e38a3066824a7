"""MXFP4 expert tensors (GPT-OSS's released checkpoints), dequantized on the host when a checkpoint loads.

gpt-oss-20b / gpt-oss-120b ship their expert weights in the OCP Microscaling format MXFP4
(config.json `quantization_config: {quant_method: mxfp4}`): each of transformers' `mlp.experts.gate_up_proj` /
`down_proj` is stored as two uint8 tensors, `<name>_blocks` `[E, R, G, 16]` and `<name>_scales` `[E, R, G]`:

- a block is 32 FP4 (e2m1) values packed two per byte, the element of even index in the low nibble and the next
  one in the high nibble; a nibble indexes `FP4_VALUES` (sign bit 3, then 2 exponent bits and 1 mantissa bit);
- every block has one E8M0 scale byte s, the power of two `2 ** (s - 127)`; s = 255 is NaN in the format (refused);
- row r of expert e holds G * 32 values along the input dim, and the dequantized `[E, R, G * 32]` is transposed
  to `[E, G * 32, R]`: gate_up `[E, 2F, D/32, 16]` -> `[E, D, 2F]`, down `[E, D, F/32, 16]` -> `[E, F, D]`, the
  layouts of our `MoE` params (and of transformers' `GptOssExperts`).

This is what transformers' `integrations/mxfp4.py` (`convert_moe_packed_tensors`, used by
`Mxfp4Config(dequantize=True)`) computes; the result is exact in bfloat16 and float32 (an FP4 value times a power
of two). The model then trains and exports in its own dtype (bf16 / float32): nothing is re-quantized.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Iterator

import numpy as np

FP4_VALUES = np.array(
    [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], np.float32
)
BLOCK_BYTES = 16  # 32 FP4 values per scale
SCALE_BIAS = 127
_PACKED = re.compile(r"^(model\.layers\.\d+\.mlp\.experts\.(?:gate_up_proj|down_proj))_(blocks|scales)$")


def check_quantization_config(family: str, quantization_config: dict | None) -> None:
    """Accept a config.json `quantization_config` this loader dequantizes: MXFP4 on GPT-OSS (`quant_method`
    'mxfp4'). Raises NotImplementedError naming the method otherwise."""
    if not quantization_config:
        return
    quant = quantization_config.get("quant_method", "?")
    if quant != "mxfp4" or family != "gpt_oss":
        raise NotImplementedError(
            f"quantization_config (quant_method {quant!r}) on {family}: only GPT-OSS's mxfp4 experts are dequantized "
            "on load; load a bf16/float32 checkpoint"
        )


def _check(name: str, blocks: np.ndarray, scales: np.ndarray) -> None:
    where = f"mxfp4 tensor {name}"
    if blocks.dtype != np.uint8 or scales.dtype != np.uint8:
        raise ValueError(f"{where}: _blocks and _scales must be uint8, got {blocks.dtype} and {scales.dtype}")
    if blocks.ndim != 4 or blocks.shape[-1] != BLOCK_BYTES or blocks.shape[:-1] != scales.shape:
        raise ValueError(
            f"{where}: _blocks {tuple(blocks.shape)} and _scales {tuple(scales.shape)} are not [E, R, G, "
            f"{BLOCK_BYTES}] and [E, R, G] (32 FP4 values per scale)"
        )
    if scales.size and int(scales.max()) == 255:
        raise ValueError(f"{where}: a scale byte is 255 (NaN in the MX format)")


def dequantize_mxfp4(blocks: np.ndarray, scales: np.ndarray, dtype=np.float32, *, name: str = "tensor") -> np.ndarray:
    """MXFP4 blocks `[E, R, G, 16]` uint8 and scales `[E, R, G]` uint8 -> `[E, G * 32, R]` `dtype` (numpy or
    ml_dtypes, e.g. float32, bfloat16), one expert at a time (one expert's float32 values besides the output).

    Raises ValueError naming `name` for another dtype or shape, or a scale byte of 255 (NaN)."""
    blocks, scales = np.asarray(blocks), np.asarray(scales)
    _check(name, blocks, scales)
    e, r, g, b = blocks.shape
    out = np.empty((e, g * 2 * b, r), dtype)
    for j in range(e):
        vals = np.empty((r, g, 2 * b), np.float32)
        vals[..., 0::2] = FP4_VALUES[blocks[j] & 0x0F]
        vals[..., 1::2] = FP4_VALUES[blocks[j] >> 4]
        vals = np.ldexp(vals, scales[j].astype(np.int32)[..., None] - SCALE_BIAS)
        out[j] = vals.reshape(r, g * 2 * b).T.astype(dtype)
    return out


def dequantize_experts(
    named: Iterable[tuple[str, np.ndarray]], dtype_of: Callable[[str], object], incomplete: list
) -> Iterator[tuple[str, np.ndarray]]:
    """Checkpoint (name, array) pairs with each `<experts>.<proj>_blocks` / `_scales` pair replaced by the
    dequantized `<experts>.<proj>` in `dtype_of(name)`, yielded when its second half arrives (only the first half
    of a pair is buffered, as packed uint8). Other tensors pass through. A half whose partner never came is appended
    to `incomplete`. Raises ValueError as `dequantize_mxfp4`."""
    pending: dict[str, dict[str, np.ndarray]] = {}
    for name, array in named:
        m = _PACKED.match(name)
        if m is None:
            yield name, array
            continue
        base, kind = m.groups()
        parts = pending.setdefault(base, {})
        parts[kind] = np.asarray(array)
        if len(parts) == 2:
            del pending[base]
            yield base, dequantize_mxfp4(parts["blocks"], parts["scales"], dtype_of(base), name=base)
    for base, parts in pending.items():
        (kind,) = parts
        other = "scales" if kind == "blocks" else "blocks"
        incomplete.append(f"{base}_{kind} (no {base}_{other})")
