"""MXFP4 GPT-OSS checkpoints (`models/mxfp4.py`): the dequantizer against transformers' own function
(`integrations/mxfp4.convert_moe_packed_tensors`, torch as a test-only reference) bit for bit, a tiny GPT-OSS whose
experts this test quantizes to MXFP4 loaded by our loader and by transformers (`Mxfp4Config(dequantize=True)`, on
CPU) with equal logits, and the malformed inputs refused with one line each. The quantizer (`quantize_mxfp4`, for
`save_pretrained(quantization='mxfp4')`) by hand, against this file's own reference quantizer, and on an export
that transformers loads and that holds the values of the checkpoint it came from bit for bit."""

import json

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import save_file

from jaxrl_post.models import ModelConfig
from jaxrl_post.models.hf_io import empty_model, load_hf_dir, load_state_dict_into, param_map, save_pretrained
from jaxrl_post.models.hf_tensors import iter_safetensors
from jaxrl_post.models.mxfp4 import (
    FP4_VALUES,
    QUANTIZATION_CONFIG,
    dequantize_experts,
    dequantize_mxfp4,
    quantize_mxfp4,
)
from tests.models.test_gpt_oss import _hf_model, _tiny
from tests.models.test_moe import _batch, _close, _forward, _tiny_cfg

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
from transformers.integrations.mxfp4 import convert_moe_packed_tensors

_BITS = {np.float32: np.uint32, ml_dtypes.bfloat16: np.uint16}


def test_dequantize_matches_transformers_bit_for_bit():
    """Random blocks (every byte value, so every FP4 code in both nibbles, -0 included) and every finite scale byte
    0..254 (2**-127 .. 2**127): our `[E, G*32, R]` equals transformers' in float32 and bfloat16, bit for bit."""
    rng = np.random.default_rng(0)
    blocks = rng.integers(0, 256, (3, 5, 34, 16), dtype=np.uint8)
    scales = np.arange(3 * 5 * 34).reshape(3, 5, 34).astype(np.uint8) % 255  # 0..254, each at least twice
    blocks[0, 0, 0] = np.arange(16, dtype=np.uint8) * 17  # both nibbles = code c, for c in 0..15
    for ours_dt, torch_dt in ((np.float32, torch.float32), (ml_dtypes.bfloat16, torch.bfloat16)):
        ref = convert_moe_packed_tensors(torch.from_numpy(blocks), torch.from_numpy(scales), dtype=torch_dt)
        ref = ref.float().numpy().astype(ours_dt)
        with np.errstate(over="ignore"):  # scales near 254 overflow float32 to inf, as transformers' do
            got = dequantize_mxfp4(blocks, scales, ours_dt)
        assert got.shape == (3, 34 * 32, 5) and got.dtype == np.dtype(ours_dt)
        np.testing.assert_array_equal(got.view(_BITS[ours_dt]), ref.view(_BITS[ours_dt]))
    one = dequantize_mxfp4(blocks[:1, :1, :1], np.full((1, 1, 1), 127, np.uint8))[0, :, 0]
    np.testing.assert_array_equal(one[:32], np.repeat(FP4_VALUES, 2))  # scale 127 = 2**0: the FP4 table itself


def _quantize(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """transformers' expert tensor `[E, In, Out]` -> MXFP4 (blocks `[E, Out, In/32, 16]`, scales `[E, Out, In/32]`):
    per block of 32 inputs the smallest power of two that puts the largest |value| within 6, each value rounded to
    the nearest FP4 magnitude, packed low nibble first."""
    e, n_in, n_out = w.shape
    x = w.transpose(0, 2, 1).reshape(e, n_out, n_in // 32, 32).astype(np.float64)
    amax = np.maximum(np.abs(x).max(-1), 1e-30)
    exp = np.clip(np.ceil(np.log2(amax / 6.0)), -127, 127).astype(np.int32)
    q = np.abs(x) / np.ldexp(1.0, exp)[..., None]
    code = np.abs(q[..., None] - FP4_VALUES[:8]).argmin(-1).astype(np.uint8) | np.where(x < 0, 8, 0).astype(np.uint8)
    blocks = code[..., 0::2] | (code[..., 1::2] << 4)
    return np.ascontiguousarray(blocks, np.uint8), np.ascontiguousarray(exp + 127, np.uint8)  # save_file: C order


def _mxfp4_checkpoint(tmp_path):
    """A tiny random GPT-OSS (3 layers, 6 experts) saved by transformers, then rewritten with its experts as
    MXFP4 `_blocks` / `_scales` and `quantization_config` in config.json, as the released checkpoints are."""
    hf = _hf_model()
    hf.save_pretrained(tmp_path)
    tensors = {n: np.array(a) for n, a in iter_safetensors(str(tmp_path))}  # copies: the file is rewritten below
    floats = {}
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        floats[name] = tensors.pop(name)
        tensors[name + "_blocks"], tensors[name + "_scales"] = _quantize(floats[name])
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["quantization_config"] = QUANTIZATION_CONFIG  # gpt-oss-20b's, which our export writes too
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    return floats


def _hf_dequantized(path):
    """transformers' model of the MXFP4 directory `path`, dequantized on load (CPU, float32, eager attention)."""
    return transformers.AutoModelForCausalLM.from_pretrained(
        path,
        quantization_config=transformers.Mxfp4Config(dequantize=True),
        dtype=torch.float32,
        attn_implementation="eager",
    ).eval()


def _assert_logits_match(model, hf, b: int, t: int) -> None:
    """Our `model`'s logits on a random left-padded batch `[b, t]` within 1e-5 of transformers' `hf`."""
    ids, mask = _batch(model.config.vocab_size, b=b, t=t)
    pos = np.maximum(np.cumsum(mask, 1) - 1, 0)
    with torch.no_grad():
        ref = hf(input_ids=torch.tensor(ids).long(), attention_mask=torch.tensor(mask), position_ids=torch.tensor(pos))
    valid = mask.astype(bool)
    _close(np.asarray(_forward(model, ids, mask))[valid], ref.logits.numpy()[valid], 1e-5, "logits")


@pytest.mark.slow  # transformers' load + our compile: ~10 s on 2 loaded cores
def test_mxfp4_gpt_oss_loads_like_transformers_dequantize(tmp_path):
    """Our loader on the MXFP4 checkpoint == transformers' `from_pretrained(quantization_config=Mxfp4Config(
    dequantize=True))` on CPU: every expert tensor bit for bit (the quantization moved them off the float model's),
    logits within 1e-5 in float32; in bfloat16 the params are the float32 ones exactly (FP4 x 2**k is a bf16)."""
    floats = _mxfp4_checkpoint(tmp_path)
    hf = _hf_dequantized(tmp_path)
    model = load_hf_dir(tmp_path)
    assert model.config.family == "gpt_oss" and model.config.num_experts == 6
    hf_params = dict(hf.named_parameters())
    for name, (path, _, to_hf) in param_map(model.config).items():
        var = model
        for p in path:
            var = var[p] if isinstance(p, int) else getattr(var, p)
        np.testing.assert_array_equal(np.asarray(to_hf(var[...])), hf_params[name].detach().numpy(), err_msg=name)
        if name in floats:  # really quantized: near the float weights, not equal to them
            diff = np.abs(np.asarray(var[...]) - floats[name])
            assert 0 < diff.max() < 0.25 * np.abs(floats[name]).max(), name
    _assert_logits_match(model, hf, b=3, t=9)
    bf16 = load_hf_dir(tmp_path, dtype="bfloat16")
    for i in range(model.config.num_layers):
        for proj in ("gate_up_proj", "down_proj"):
            got = getattr(bf16.layers[i].mlp, proj)[...]
            assert got.dtype == jnp.bfloat16
            np.testing.assert_array_equal(
                np.asarray(got, np.float32), np.asarray(getattr(model.layers[i].mlp, proj)[...])
            )


def test_malformed_mxfp4_tensors_and_other_quantizations_are_refused():
    """One error line each: blocks not uint8, blocks/scales shapes that disagree, a block that is not 16 bytes, a
    scale byte of 255 (NaN), a `_blocks` without its `_scales` (the loader's unexpected-tensor list), and a
    quantization_config other than GPT-OSS's mxfp4."""
    b, s = np.zeros((2, 4, 1, 16), np.uint8), np.full((2, 4, 1), 127, np.uint8)
    with pytest.raises(ValueError, match="mxfp4 tensor w: _blocks and _scales must be uint8, got int8"):
        dequantize_mxfp4(b.astype(np.int8), s, name="w")
    with pytest.raises(ValueError, match=r"_blocks \(2, 4, 1, 16\) and _scales \(2, 3, 1\) are not"):
        dequantize_mxfp4(b, s[:, :3], name="w")
    with pytest.raises(ValueError, match=r"_blocks \(2, 4, 2, 8\)"):
        dequantize_mxfp4(b.reshape(2, 4, 2, 8), s, name="w")
    with pytest.raises(ValueError, match="a scale byte is 255"):
        dequantize_mxfp4(b, np.full_like(s, 255), name="w")
    name = "model.layers.0.mlp.experts.down_proj"
    incomplete = []
    out = list(dequantize_experts([(name + "_blocks", b), ("x", 1)], lambda n: np.float32, incomplete))
    assert out == [("x", 1)] and incomplete == [f"{name}_blocks (no {name}_scales)"]
    hf = ModelConfig.from_hf_config(_hf_model().config.to_dict()).to_hf_config()
    assert ModelConfig.from_hf_config(dict(hf, quantization_config={"quant_method": "mxfp4"})).family == "gpt_oss"
    with pytest.raises(NotImplementedError, match="quant_method 'fp8'"):
        ModelConfig.from_hf_config(dict(hf, quantization_config={"quant_method": "fp8"}))
    qwen = dict(hf, model_type="qwen3", quantization_config={"quant_method": "mxfp4"})
    with pytest.raises(NotImplementedError, match="quant_method 'mxfp4'.* on qwen3"):
        ModelConfig.from_hf_config(qwen)


def test_unpaired_mxfp4_half_is_reported_by_the_loader():
    """A checkpoint stream with a `_scales` whose `_blocks` is missing fails `load_state_dict_into` with one
    ValueError naming both the missing expert tensor and the lone half."""
    model = empty_model(_tiny())
    name = "model.layers.0.mlp.experts.down_proj"
    with pytest.raises(ValueError, match=rf"missing tensors: .*{name}.*unexpected tensors: {name}_scales \(no "):
        load_state_dict_into(model, [(name + "_scales", np.zeros((4, 32, 1), np.uint8))])


def test_quantize_by_hand_against_the_reference_and_round_trip():
    """`quantize_mxfp4`: the scale is the smallest power of two bringing max |x| within 6; each value rounds to the
    nearest FP4 value, ties to the even code; -0.0 keeps its sign; an all-zero block gets scale byte 0. It equals
    this file's reference quantizer (`_quantize`) on random weights (no ties), and dequantized MXFP4 values
    quantize back to themselves. NaN / inf and an input dim that is not a multiple of 32 are refused."""
    x = np.zeros((1, 64, 2), np.float32)
    x[0, :10, 0] = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, -0.0, -2.9]  # scale 2**0: midpoints and a plain value
    x[0, 32:35, 0] = [6.5, 0.75, -0.2]  # max 6.5 > 6: scale 2**1, so 6.5 / 2 = 3.25 -> 3, 0.375 -> 0.5, -0.1 -> -0
    blocks, scales = quantize_mxfp4(x)
    assert blocks.shape == (1, 2, 2, 16) and scales.tolist() == [[[127, 128], [0, 0]]]  # column 1: all zeros
    back = dequantize_mxfp4(blocks, scales)
    want = [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6.0, -0.0, -3.0]  # ties to 0 / 1 / 1 / 2 / 2 / 4 / 4 (even codes)
    np.testing.assert_array_equal(back[0, :10, 0], want)
    assert np.signbit(back[0, 8, 0]) and not np.signbit(back[0, 0, 0])
    np.testing.assert_array_equal(back[0, 32:35, 0], [6.0, 1.0, -0.0])
    rng = np.random.default_rng(1)
    w = (rng.standard_normal((3, 96, 5)) * np.exp(rng.uniform(-6, 3, (3, 1, 5)))).astype(np.float32)
    for got, ref in zip(quantize_mxfp4(w), _quantize(w), strict=True):
        np.testing.assert_array_equal(got, ref)
    b = rng.integers(0, 256, (2, 4, 3, 16), dtype=np.uint8)
    values = dequantize_mxfp4(b, rng.integers(100, 150, (2, 4, 3)).astype(np.uint8))
    np.testing.assert_array_equal(dequantize_mxfp4(*quantize_mxfp4(values)).view(np.uint32), values.view(np.uint32))
    with pytest.raises(ValueError, match="mxfp4 export of w: the tensor has a NaN or inf"):
        quantize_mxfp4(np.where(np.arange(64)[None, :, None] == 3, np.nan, x), name="w")
    with pytest.raises(ValueError, match=r"mxfp4 export of w: shape \(1, 48, 2\) is not \[E, In, Out\]"):
        quantize_mxfp4(x[:, :48], name="w")


@pytest.mark.slow  # transformers' load of the export + our loads: ~10 s on 2 loaded cores
def test_mxfp4_export_reproduces_the_checkpoint_and_loads_in_transformers(tmp_path):
    """An MXFP4 GPT-OSS checkpoint loaded and exported with `quantization='mxfp4'`: the export's expert tensors
    hold the checkpoint's values bit for bit (untrained MXFP4 weights quantize back exactly; a block whose largest
    value rounded down, e.g. to 3 x 2**k, is written as 6 x 2**(k-1): other bytes, same values), config.json names the
    quantization, transformers (`Mxfp4Config(dequantize=True)`, CPU) loads it with logits within 1e-5 of ours, and
    our loader reads it back to the same params. Another family with the quantization: one error line."""
    src, out = tmp_path / "src", tmp_path / "out"
    _mxfp4_checkpoint(src)
    model = load_hf_dir(src)
    save_pretrained(model, None, out, quantization="mxfp4")
    before, after = dict(iter_safetensors(str(src))), dict(iter_safetensors(str(out)))
    packed = sorted(n for n in before if n.endswith(("_blocks", "_scales")))
    assert packed and sorted(n for n in after if n.endswith(("_blocks", "_scales"))) == packed
    for name in packed[::2]:  # each pair's `_blocks` (sorted before its `_scales`): the values, bit for bit
        base = name.removesuffix("_blocks")
        got = dequantize_mxfp4(after[name], after[base + "_scales"])
        want = dequantize_mxfp4(before[name], before[base + "_scales"])
        np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32), err_msg=base)
    assert json.loads((out / "config.json").read_text())["quantization_config"]["quant_method"] == "mxfp4"
    _assert_logits_match(model, _hf_dequantized(out), b=2, t=7)
    again = load_hf_dir(out)
    for i in range(model.config.num_layers):
        for proj in ("gate_up_proj", "down_proj"):
            np.testing.assert_array_equal(
                np.asarray(getattr(again.layers[i].mlp, proj)[...]), np.asarray(getattr(model.layers[i].mlp, proj)[...])
            )
    with pytest.raises(ValueError, match="export quantization 'mxfp4' on qwen3_moe: only 'mxfp4' on GPT-OSS"):
        save_pretrained(empty_model(_tiny_cfg()), None, tmp_path / "q", quantization="mxfp4")
