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
of two). The model then trains in its own dtype (bf16 / float32) and exports in it, or back to MXFP4 on request
(`quantize_mxfp4`, `save_pretrained(quantization='mxfp4')`): per block of 32 the smallest power of two that brings
the largest |value| within 6 (no value saturates), each value rounded to the nearest FP4 value, ties to the even
code (the OCP MX spec's rounding). Weights that came from an MXFP4 checkpoint and were not trained quantize back to
the same values exactly.
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


_FP4_MIDPOINTS = (FP4_VALUES[1:8] + FP4_VALUES[:7]) / 2  # between consecutive FP4 magnitudes 0, 0.5, ..., 6


def quantize_mxfp4(x: np.ndarray, *, name: str = "tensor") -> tuple[np.ndarray, np.ndarray]:
    """The inverse layout of `dequantize_mxfp4`: `x [E, In, Out]` (float) -> MXFP4 blocks `[E, Out, In/32, 16]`
    uint8 and scales `[E, Out, In/32]` uint8. Per block of 32 inputs the scale is the smallest power of two
    `2 ** k` with `max |x| / 2 ** k <= 6` (k clipped to the E8M0 range -127..127; an all-zero block gets 2 ** -127),
    each `x / 2 ** k` rounded to the nearest FP4 value, ties to the even code; -0.0 keeps its sign bit.

    Raises ValueError naming `name` when In is not a multiple of 32 or a value is not finite."""
    x = np.asarray(x, np.float32)
    if x.ndim != 3 or x.shape[1] % (2 * BLOCK_BYTES):
        raise ValueError(f"mxfp4 export of {name}: shape {tuple(x.shape)} is not [E, In, Out] with In a multiple of 32")
    if not np.all(np.isfinite(x)):
        raise ValueError(f"mxfp4 export of {name}: the tensor has a NaN or inf (MXFP4 holds finite values only)")
    e, n_in, n_out = x.shape
    blocks = np.empty((e, n_out, n_in // 32, BLOCK_BYTES), np.uint8)
    scales = np.empty((e, n_out, n_in // 32), np.uint8)
    for j in range(e):  # one expert's float64 copy at a time
        v = x[j].T.reshape(n_out, n_in // 32, 32).astype(np.float64)
        amax = np.abs(v).max(-1)
        m, exp = np.frexp(amax / 6.0)  # amax / 6 = m * 2 ** exp, m in [0.5, 1): k = exp, or exp - 1 when m == 0.5
        k = np.where(m == 0.5, exp - 1, exp)
        k = np.clip(np.where(amax > 0, k, -127), -127, 127)
        mag = np.abs(v) / np.ldexp(1.0, k)[..., None]  # exact: a division by a power of two
        lo = np.searchsorted(_FP4_MIDPOINTS, mag, side="left")  # the nearest code; on a midpoint the lower one
        tie = (lo < 7) & (mag == _FP4_MIDPOINTS[np.minimum(lo, 6)])
        code = np.where(tie & (lo % 2 == 1), lo + 1, lo)  # ties to the even code
        code = (code | np.where(np.signbit(v), 8, 0)).astype(np.uint8)
        blocks[j] = code[..., 0::2] | (code[..., 1::2] << 4)
        scales[j] = (k + SCALE_BIAS).astype(np.uint8)
    return blocks, scales


_EXPERTS = re.compile(r"^model\.layers\.\d+\.mlp\.experts\.(?:gate_up_proj|down_proj)$")
# config.json's `quantization_config` of an MXFP4 export: what gpt-oss-20b / 120b ship (only the experts quantized)
QUANTIZATION_CONFIG = {
    "quant_method": "mxfp4",
    "modules_to_not_convert": [
        "model.layers.*.self_attn",
        "model.layers.*.mlp.router",
        "model.embed_tokens",
        "lm_head",
    ],
}


def check_export(family: str, quantization: str | None) -> None:
    """`save_pretrained(quantization=...)`: None, or 'mxfp4' on GPT-OSS. Raises ValueError otherwise."""
    if quantization is None:
        return
    if quantization != "mxfp4" or family != "gpt_oss":
        raise ValueError(
            f"export quantization {quantization!r} on {family}: only 'mxfp4' on GPT-OSS (its experts) is written; "
            "leave it None to export in the model's own dtype"
        )


def export_tensors(name: str, array: np.ndarray, quantization: str | None) -> list[tuple[str, np.ndarray]]:
    """The checkpoint tensors of one HF tensor: `[(name, array)]`, or with `quantization='mxfp4'` a GPT-OSS expert
    tensor (`...mlp.experts.gate_up_proj` / `down_proj`, `[E, In, Out]`) as its `_blocks` and `_scales`
    (`quantize_mxfp4`). Raises ValueError as `quantize_mxfp4`."""
    if quantization != "mxfp4" or not _EXPERTS.match(name):
        return [(name, array)]
    blocks, scales = quantize_mxfp4(array, name=name)
    return [(name + "_blocks", blocks), (name + "_scales", scales)]
