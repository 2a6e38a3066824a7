"""MXFP4 GPT-OSS checkpoints (`models/mxfp4.py`): the dequantizer against transformers' own function
(`integrations/mxfp4.convert_moe_packed_tensors`, torch as a test-only reference) bit for bit, a tiny GPT-OSS whose
experts this test quantizes to MXFP4 loaded by our loader and by transformers (`Mxfp4Config(dequantize=True)`, on
CPU) with equal logits, and the malformed inputs refused with one line each."""

import json

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import save_file

from jaxrl_post.models import ModelConfig
from jaxrl_post.models.hf_io import empty_model, load_hf_dir, load_state_dict_into, param_map
from jaxrl_post.models.hf_tensors import iter_safetensors
from jaxrl_post.models.mxfp4 import FP4_VALUES, dequantize_experts, dequantize_mxfp4
from tests.models.test_gpt_oss import _hf_model, _tiny
from tests.models.test_moe import _batch, _close, _forward

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
    cfg["quantization_config"] = {
        "quant_method": "mxfp4",
        "modules_to_not_convert": [
            "model.layers.*.self_attn",
            "model.layers.*.mlp.router",
            "model.embed_tokens",
            "lm_head",
        ],
    }
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    return floats


@pytest.mark.slow  # transformers' load + our compile: ~10 s on 2 loaded cores
def test_mxfp4_gpt_oss_loads_like_transformers_dequantize(tmp_path):
    """Our loader on the MXFP4 checkpoint == transformers' `from_pretrained(quantization_config=Mxfp4Config(
    dequantize=True))` on CPU: every expert tensor bit for bit (the quantization moved them off the float model's),
    logits within 1e-5 in float32; in bfloat16 the params are the float32 ones exactly (FP4 x 2**k is a bf16)."""
    floats = _mxfp4_checkpoint(tmp_path)
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path,
        quantization_config=transformers.Mxfp4Config(dequantize=True),
        dtype=torch.float32,
        attn_implementation="eager",
    ).eval()
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
    ids, mask = _batch(model.config.vocab_size, b=3, t=9)
    pos = np.maximum(np.cumsum(mask, 1) - 1, 0)
    with torch.no_grad():
        ref = hf(input_ids=torch.tensor(ids).long(), attention_mask=torch.tensor(mask), position_ids=torch.tensor(pos))
    valid = mask.astype(bool)
    _close(np.asarray(_forward(model, ids, mask))[valid], ref.logits.numpy()[valid], 1e-5, "logits")
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
