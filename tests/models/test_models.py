"""Decoder tests: logit parity with HF transformers (each family), KV cache, padding, causality, critic, export."""

import copy
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxrl_post.models import PRESETS, CriticModel, ModelConfig, Transformer, decoder, init_model, save_pretrained
from jaxrl_post.models.hf_io import empty_model, load_hf_dir, load_state_dict_into, param_map

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

BASE = dict(
    vocab_size=97,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=64,
)
LLAMA3_ROPE = dict(
    rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=16
)
GEMMA3_ROPE = {
    "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 100000.0},
    "sliding_attention": {"rope_type": "default", "rope_theta": 1000.0},
}

# name -> (transformers config class name, kwargs). Sequences are 12 long, sliding windows 4.
HF_CASES = {
    "llama_untied": ("LlamaConfig", dict(BASE, tie_word_embeddings=False)),
    "llama3_rope_tied": ("LlamaConfig", dict(BASE, tie_word_embeddings=True, rope_scaling=LLAMA3_ROPE)),
    "llama_dynamic_rope": (
        "LlamaConfig",
        dict(BASE, max_position_embeddings=8, rope_scaling=dict(rope_type="dynamic", factor=2.0)),
    ),
    "qwen2_qkv_bias": (
        "Qwen2Config",
        dict({k: v for k, v in BASE.items() if k != "head_dim"}, tie_word_embeddings=True),
    ),
    "qwen3_qk_norm": ("Qwen3Config", dict(BASE, head_dim=32)),
    "gemma2_softcap_sliding": (
        "Gemma2Config",
        dict(BASE, sliding_window=4, attn_logit_softcapping=2.0, final_logit_softcapping=3.0, query_pre_attn_scalar=24),
    ),
    "gemma3_local_global": (
        "Gemma3TextConfig",
        dict(
            BASE,
            num_hidden_layers=3,
            sliding_window=4,
            query_pre_attn_scalar=24,
            rope_parameters=GEMMA3_ROPE,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        ),
    ),
}


def _hf_model(case):
    cls_name, kw = HF_CASES[case]
    cfg = getattr(transformers, cls_name)(**kw)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").eval()
    with torch.no_grad():  # larger-than-default random weights so logits are O(1) and every op matters
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
            else:
                p.copy_(0.15 * torch.randn_like(p))
    return model


def _batch(vocab, b=3, t=12, seed=0):
    rng = np.random.RandomState(seed)
    ids = rng.randint(0, vocab, (b, t)).astype(np.int32)
    mask = np.ones((b, t), np.int32)
    mask[0, :4] = 0  # left padding
    if b > 1:
        mask[1, :1] = 0
    return ids, mask


def _hf_logits(model, ids, mask):
    pos = np.maximum(np.cumsum(mask, 1) - 1, 0)
    with torch.no_grad():
        out = model(
            input_ids=torch.tensor(ids, dtype=torch.long),
            attention_mask=torch.tensor(mask),
            position_ids=torch.tensor(pos),
        )
    return out.logits.float().numpy()


def _assert_close(got, ref, mask, tol=1e-4):
    valid = mask.astype(bool)
    scale = max(1.0, float(np.abs(ref[valid]).max()))
    diff = float(np.abs(np.asarray(got)[valid] - ref[valid]).max())
    assert diff <= tol * scale, f"max abs diff {diff} > {tol} * {scale}"
    return diff


_forward = jax.jit(lambda model, ids, mask: model(ids, mask))


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    """Each case saved once with transformers' save_pretrained (built lazily)."""
    cache = {}

    def get(case):
        if case not in cache:
            model = _hf_model(case)
            d = tmp_path_factory.mktemp(case)
            model.save_pretrained(d)
            cache[case] = (model, str(d))
        return cache[case]

    return get


@pytest.mark.parametrize("case", list(HF_CASES))
@pytest.mark.slow
def test_hf_logit_parity(case, hf_dirs):
    hf, path = hf_dirs(case)
    ours = load_hf_dir(path)
    ids, mask = _batch(hf.config.vocab_size)
    _assert_close(_forward(ours, ids, mask), _hf_logits(hf, ids, mask), mask)


@pytest.mark.parametrize(
    "case", ["llama_untied", "qwen2_qkv_bias", "qwen3_qk_norm", "gemma2_softcap_sliding", "gemma3_local_global"]
)
def test_hf_bfloat16_logit_parity(case, hf_dirs):
    """bf16 compute with f32 master weights (cast inside the forward) vs transformers in bf16. Tolerance: two
    correct bf16 implementations round at different points, so they may differ by about as much as bf16
    itself moves the logits; we allow 2x transformers' own bf16-vs-f32 gap (a real bug, e.g. a dropped norm
    offset or soft-cap, moves logits by O(1), far beyond it)."""
    hf, path = hf_dirs(case)
    ids, mask = _batch(hf.config.vocab_size)
    valid = mask.astype(bool)
    ref32 = _hf_logits(hf, ids, mask)
    ref16 = _hf_logits(copy.deepcopy(hf).to(torch.bfloat16), ids, mask)
    ours = load_hf_dir(path, dtype="bfloat16", param_dtype="float32")
    assert {x.dtype for x in jax.tree.leaves(nnx.state(ours, nnx.Param))} == {jnp.dtype("float32")}
    got = np.asarray(_forward(ours, ids, mask), np.float32)
    bf16_gap = float(np.abs(ref16 - ref32)[valid].max())
    assert 0 < bf16_gap < 0.5
    assert float(np.abs(got - ref16)[valid].max()) <= 2 * bf16_gap


def test_parity_cases_exercise_their_features(hf_dirs):
    """Dropping rope scaling / sliding window / soft-caps from the config changes the logits (the parity
    cases above would catch those features being ignored)."""
    ids, mask = _batch(97)
    for case, override in [
        ("llama3_rope_tied", dict(rope_scaling=None)),
        ("gemma2_softcap_sliding", dict(layer_types=None, sliding_window=None)),
        ("gemma3_local_global", dict(rope_local_base_freq=None)),
    ]:
        _, path = hf_dirs(case)
        model = load_hf_dir(path)
        other = empty_model(model.config.replace(**override))
        nnx.update(other, nnx.state(model))
        diff = np.abs(np.asarray(_forward(model, ids, mask) - _forward(other, ids, mask)))[mask.astype(bool)]
        assert diff.max() > 1e-3, (case, override)


def _tiny(family="llama", **kw):
    base = dict(
        family=family,
        vocab_size=61,
        hidden_size=32,
        intermediate_size=48,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
    )
    if family.startswith("gemma"):
        base.update(
            norm_offset=1.0,
            embed_scale=True,
            post_norms=True,
            hidden_act="gelu_pytorch_tanh",
            tie_word_embeddings=True,
            sliding_window=3,
            layer_types=("sliding_attention", "full_attention"),
            attn_logit_softcap=5.0 if family == "gemma2" else None,
            final_logit_softcap=10.0,
            query_pre_attn_scalar=6.0,
            qk_norm=family == "gemma3",
            rope_local_base_freq=100.0,
        )
    base.update(kw)
    return ModelConfig(**base)


def _random_model(cfg, seed=0, dtype="float32"):
    """Model with numpy-random O(1)-logit weights, loaded through the HF-name loader (no init compile)."""
    rng = np.random.RandomState(seed)
    model = empty_model(cfg, dtype=dtype)
    tensors = []
    for name, (path, _, to_hf) in param_map(cfg).items():
        shape = model
        for p in path:
            shape = shape[p] if isinstance(p, int) else getattr(shape, p)
        w = rng.randn(*shape.shape).astype(np.float32)
        w = (1.0 - cfg.norm_offset) + 0.1 * w if name.endswith("norm.weight") else 0.15 * w
        tensors.append((name, to_hf(w)))
    return load_state_dict_into(model, tensors)


@pytest.mark.parametrize("family", ["llama", "gemma2"])
def test_kv_cache_prefill_decode_matches_full_forward(family):
    cfg = _tiny(family)
    model = _random_model(cfg, seed=1)
    b, p, n = 3, 5, 6
    ids, _ = _batch(cfg.vocab_size, b=b, t=p + n, seed=2)
    mask = np.ones((b, p + n), np.int32)
    mask[0, :3] = 0  # left-padded prompts
    mask[2, :1] = 0
    full = np.asarray(_forward(model, ids, mask))

    @jax.jit
    def step(model, cache, ids, m):
        return model(ids, m, cache=cache)

    cache = model.init_cache(b, p + n + 2)
    logits, cache = step(model, cache, ids[:, :p], mask[:, :p])
    outs = [np.asarray(logits)]
    for i in range(p, p + n):
        logits, cache = step(model, cache, ids[:, i : i + 1], mask[:, i : i + 1])
        outs.append(np.asarray(logits))
    assert int(cache.index) == p + n
    last, _ = nnx.jit(lambda m, c, i, a: m(i, a, cache=c, logits_to_keep=1))(
        model, model.init_cache(b, p + 2), ids[:, :p], mask[:, :p]
    )
    np.testing.assert_allclose(np.asarray(last)[:, 0], outs[0][:, -1], atol=1e-5)
    np.testing.assert_array_equal(np.asarray(cache.mask[:, : p + n]), mask.astype(bool))
    _assert_close(np.concatenate(outs, 1), full, mask, tol=1e-5)


@pytest.mark.parametrize("family,segment_len", [("llama", 3), ("gemma2", 4)])
@pytest.mark.slow
def test_segmented_cache_matches_full_forward_and_skips_unwritten_segments(family, segment_len):
    """Writes that cross segment boundaries (static-index prefill, traced multi-token steps) give the full
    forward's logits, and attention never reads a segment before it holds a token: unwritten segments are
    filled with NaN, which would reach the logits through 0 * NaN if they were read (with one segment, or
    without the skip, they would be)."""
    cfg = _tiny(family)
    model = _random_model(cfg, seed=1)
    b, t = 3, 11
    ids, _ = _batch(cfg.vocab_size, b=b, t=t, seed=2)
    mask = np.ones((b, t), np.int32)
    mask[0, :3] = 0
    mask[2, :1] = 0
    full = np.asarray(_forward(model, ids, mask))

    max_len = t + 2 * segment_len - 1
    cache = model.init_cache(b, max_len, segment_len=segment_len)
    sizes = cache.segments
    assert sum(sizes) == max_len and max(sizes) == segment_len and len(sizes) == -(-max_len // segment_len)
    offsets = np.cumsum((0,) + sizes[:-1])
    assert (offsets >= t).sum() == 2  # two segments are never written below
    poison = lambda segs: tuple(jnp.full_like(s, jnp.nan) if o >= t else s for s, o in zip(segs, offsets))
    cache = cache.replace(k=tuple(map(poison, cache.k)), v=tuple(map(poison, cache.v)))
    logits, cache = model(ids[:, :5], mask[:, :5], cache=cache)  # eager: static index 0, crosses a boundary
    assert cache.index == 5
    outs = [np.asarray(logits)]
    step = jax.jit(lambda m, c, i, a: m(i, a, cache=c))
    for lo, hi in [(5, 7), (7, 8), (8, 11)]:  # traced index; multi-token writes cross boundaries
        logits, cache = step(model, cache, ids[:, lo:hi], mask[:, lo:hi])
        outs.append(np.asarray(logits))
    got = np.concatenate(outs, 1)
    assert np.isfinite(got).all()
    _assert_close(got, full, mask, tol=1e-5)
    # The slots after the last write are still NaN: nothing wrote there and nothing read them.
    assert np.isnan(np.asarray(cache.k[0][-1])[..., -1]).all()


@pytest.mark.slow
def test_segmented_bfloat16_cache_equals_one_segment():
    """bf16 caches are written through uint16 views when segmented; the stored keys are exactly those of a
    one-segment cache."""
    cfg = _tiny("llama")
    model = _random_model(cfg, seed=4, dtype="bfloat16")
    b, t = 2, 9
    ids, _ = _batch(cfg.vocab_size, b=b, t=t, seed=5)
    mask = np.ones((b, t), np.int32)
    mask[1, :2] = 0
    step = jax.jit(lambda m, c, i, a: m(i, a, cache=c))

    def run(segment_len):
        cache = model.init_cache(b, t + 3, segment_len=segment_len)
        outs = []
        for lo, hi in [(0, 4), (4, 5), (5, 7), (7, 8), (8, 9)]:
            logits, cache = step(model, cache, ids[:, lo:hi], mask[:, lo:hi])
            outs.append(np.asarray(logits))
        k = np.concatenate([np.asarray(seg, np.float32) for seg in cache.k[1]], axis=-1)
        return np.concatenate(outs, 1), k

    assert model.init_cache(1, 4).k[0][0].dtype == jnp.bfloat16
    (l1, k1), (l3, k3) = run(None), run(3)
    np.testing.assert_array_equal(k3[..., :t], k1[..., :t])  # the writes are exact
    assert np.abs(k1[..., :t]).max() > 0
    # attention sums per-segment partial products in float32, so logits agree to bf16 rounding
    np.testing.assert_allclose(l3, l1, atol=3e-2, rtol=0)


def test_left_padding_invariance_and_causality():
    cfg = _tiny("gemma3")
    model = _random_model(cfg, seed=3)
    ids, _ = _batch(cfg.vocab_size, b=1, t=7, seed=4)
    unpadded = np.asarray(_forward(model, ids, np.ones_like(ids)))
    padded_ids = np.concatenate([np.full((1, 4), 5, np.int32), ids], 1)
    padded_mask = np.concatenate([np.zeros((1, 4), np.int32), np.ones_like(ids)], 1)
    padded = np.asarray(_forward(model, padded_ids, padded_mask))
    np.testing.assert_allclose(padded[:, 4:], unpadded, atol=1e-5)
    # causality: changing token t changes no logits before t, and does change logits at t
    t = 4
    changed = ids.copy()
    changed[0, t] = (changed[0, t] + 1) % cfg.vocab_size
    out = np.asarray(_forward(model, changed, np.ones_like(ids)))
    np.testing.assert_array_equal(out[:, :t], unpadded[:, :t])
    assert np.abs(out[:, t:] - unpadded[:, t:]).max() > 1e-4


def test_critic_shapes_and_from_actor():
    cfg = _tiny("llama", tie_word_embeddings=False)
    actor = _random_model(cfg, seed=0)
    critic = CriticModel.from_actor(actor)
    assert actor.lm_head is not None and critic.backbone.lm_head is None
    ids, mask = _batch(cfg.vocab_size, b=2, t=6)
    values_fn = nnx.jit(lambda c, i, m: c(i, m))
    values = values_fn(critic, ids, mask)
    assert values.shape == (2, 6) and values.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(values), 0.0)  # zero-initialized head
    critic.value_head[...] = jnp.ones_like(critic.value_head[...])
    h = np.asarray(nnx.jit(lambda a, i, m: a.hidden_states(i, m))(actor, ids, mask))
    np.testing.assert_allclose(np.asarray(values_fn(critic, ids, mask)), h.sum(-1), rtol=1e-5, atol=1e-5)
    fresh = nnx.eval_shape(lambda: CriticModel(cfg, rngs=nnx.Rngs(0)))
    assert fresh.backbone.lm_head is None and fresh.value_head.shape == (cfg.hidden_size, 1)


@pytest.mark.slow  # forward+backward compiles with and without remat (28 s on 2 shared, loaded cores)
def test_remat_same_loss_and_grads():
    cfg = _tiny("llama")
    ids, mask = _batch(cfg.vocab_size, b=2, t=6)

    def loss(model):
        return jnp.mean(jax.nn.log_softmax(model(ids, mask))[..., 0])

    base = _random_model(cfg)
    models = {}
    for remat in (False, True, "dots_with_no_batch_dims_saveable"):
        models[remat] = empty_model(cfg, remat=remat)
        nnx.update(models[remat], nnx.state(base))
    grad_fn = nnx.value_and_grad(loss)
    (v0, g0), (v1, g1) = nnx.jit(grad_fn)(models[False]), nnx.jit(grad_fn)(models[True])
    np.testing.assert_allclose(v1, v0, rtol=1e-6)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-6), g1, g0)
    # remat really is in the backward program (beyond the attention core's own checkpoint, which every training
    # forward has: one per layer); a named policy traces (checked without compiling)
    n_remat = {r: str(jax.make_jaxpr(lambda m: grad_fn(m))(models[r])).count("remat") for r in (False, True)}
    assert n_remat[True] > n_remat[False] == cfg.num_layers
    nnx.eval_shape(grad_fn, models["dots_with_no_batch_dims_saveable"])


@pytest.mark.parametrize(
    "family,layer_types,period",
    [
        ("llama", None, 1),
        ("gemma2", ("sliding_attention", "full_attention") * 2 + ("sliding_attention",), 2),
        ("gemma3", ("sliding_attention", "sliding_attention", "full_attention") * 2 + ("sliding_attention",), 3),
    ],
)
@pytest.mark.slow
def test_scan_layers_equals_unrolled_loss_and_grads(family, layer_types, period):
    """lax.scan over layer groups == the unrolled loop (logits and every layer's gradient), including the
    remainder layers after the last full group, Gemma's local/global period and remat inside the scan."""
    kw = {"num_layers": len(layer_types or "x" * 5)} | ({"layer_types": layer_types} if layer_types else {})
    cfg = _tiny(family, **kw)
    assert decoder.layer_period(cfg) == period
    ids, mask = _batch(cfg.vocab_size, b=2, t=7)
    base = _random_model(cfg)

    def loss(model):
        lp = jax.nn.log_softmax(model(ids, mask))
        return jnp.mean(lp[..., 0] * jnp.asarray(mask)) + jnp.mean(lp[..., 3])

    out = {}
    combos = ((False, False), (True, False)) + (((True, True),) if family == "gemma3" else ())
    for scan, remat in combos:
        m = empty_model(cfg, remat=remat)
        nnx.update(m, nnx.state(base))
        m.scan_layers = scan
        grad_fn = nnx.value_and_grad(loss)
        out[scan, remat] = nnx.jit(grad_fn)(m)
        assert ("scan" in str(jax.make_jaxpr(grad_fn)(m))) == scan
    (v0, g0) = out[False, False]
    for key in combos[1:]:
        v1, g1 = out[key]
        np.testing.assert_allclose(v1, v0, rtol=1e-6)
        for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g0)):  # float reassociation only: 1e-5 of the scale
            assert float(jnp.abs(a - b).max()) <= 1e-5 * float(jnp.abs(b).max()) + 1e-9
    assert all(float(jnp.abs(g).max()) > 0 for g in jax.tree.leaves(nnx.state(g0.layers[4])))


def test_layer_period_of_presets():
    assert [decoder.layer_period(PRESETS[n]) for n in ("smollm2_135m", "qwen3_0_6b", "gemma2_2b", "gemma3_1b")] == [
        1,
        1,
        2,
        6,
    ]


def test_bfloat16_forward_close_to_float32():
    cfg = _tiny("gemma2")
    f32 = _random_model(cfg, seed=0)
    bf16 = _random_model(cfg, seed=0, dtype="bfloat16")
    assert bf16.embedding[...].dtype == jnp.bfloat16
    ids, mask = _batch(cfg.vocab_size, b=2, t=6)
    a, b = np.asarray(_forward(f32, ids, mask)), np.asarray(_forward(bf16, ids, mask))
    assert b.dtype == np.float32
    assert np.abs(a - b)[mask.astype(bool)].max() < 0.05 * max(1.0, np.abs(a).max())


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_export_round_trip_transformers(family, tmp_path):
    cfg = _tiny(family, tie_word_embeddings=family != "llama", bos_token_id=1, eos_token_id=2)
    model = _random_model(cfg, seed=5) if family == "llama" else init_model(cfg, seed=5)
    save_pretrained(model, None, tmp_path)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager").eval()
    assert type(hf).__name__ == {"llama": "LlamaForCausalLM", "gemma3": "Gemma3ForCausalLM"}[family]
    ids, mask = _batch(cfg.vocab_size, b=2, t=7)
    ours = np.asarray(_forward(model, ids, mask))
    _assert_close(ours, _hf_logits(hf, ids, mask), mask)
    again = load_hf_dir(tmp_path)
    assert again.config == model.config
    np.testing.assert_array_equal(np.asarray(_forward(again, ids, mask)), ours)


def test_save_pretrained_writes_tokenizer_and_shards(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    vocab = {f"w{i}": i for i in range(61)}
    tok = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="w0")),
        unk_token="w0",
        eos_token="w2",
    )
    cfg = _tiny("qwen3", qk_norm=True)
    model = _random_model(cfg, seed=0)
    save_pretrained(model, tok, tmp_path, max_shard_bytes=20_000)
    files = os.listdir(tmp_path)
    assert "tokenizer.json" in files and "model.safetensors.index.json" in files
    assert sum(f.startswith("model-") for f in files) > 1
    with open(tmp_path / "config.json") as f:
        assert json.load(f)["architectures"] == ["Qwen3ForCausalLM"]
    again = load_hf_dir(tmp_path)
    ids, mask = _batch(cfg.vocab_size, b=2, t=5)
    np.testing.assert_array_equal(np.asarray(_forward(again, ids, mask)), np.asarray(_forward(model, ids, mask)))
    assert transformers.AutoTokenizer.from_pretrained(tmp_path).convert_tokens_to_ids("w7") == 7


def test_loader_reports_missing_and_unexpected_tensors():
    cfg = _tiny("llama")
    model = _random_model(cfg)
    tensors = {}
    for name, (path, _, to_hf) in param_map(cfg).items():
        var = model
        for p in path:
            var = var[p] if isinstance(p, int) else getattr(var, p)
        tensors[name] = to_hf(np.asarray(var[...]))
    good = list(tensors.items())
    load_state_dict_into(empty_model(cfg), good)  # complete set loads
    bad = [kv for kv in good if kv[0] != "model.layers.1.mlp.up_proj.weight"] + [("model.extra.weight", np.ones(3))]
    with pytest.raises(
        ValueError,
        match=r"missing tensors: model\.layers\.1\.mlp\.up_proj\.weight.*"
        r"unexpected tensors: model\.extra\.weight",
    ):
        load_state_dict_into(empty_model(cfg), bad)
    # Gemma 3 multimodal checkpoints: text weights under language_model prefixes, vision tensors ignored
    multimodal = [(k.replace("model.", "model.language_model.", 1), v) for k, v in good]
    multimodal.append(("model.vision_tower.encoder.weight", np.ones(2)))
    loaded = load_state_dict_into(empty_model(cfg), multimodal)
    np.testing.assert_array_equal(np.asarray(loaded.embedding[...]), np.asarray(model.embedding[...]))
    wrong = [(k, v[:-1] if k == "model.norm.weight" else v) for k, v in good]
    with pytest.raises(ValueError, match="shape mismatches: model.norm.weight"):
        load_state_dict_into(empty_model(cfg), wrong)


def test_config_hf_round_trip_and_legacy_formats():
    for name, cfg in PRESETS.items():
        assert ModelConfig.from_hf_config(cfg.to_hf_config()) == cfg, name
        hf = transformers.AutoConfig.for_model(**cfg.to_hf_config())  # transformers accepts our dict
        assert ModelConfig.from_hf_config(hf) == cfg, name
    # transformers v4-style config.json keys
    legacy_llama = dict(
        model_type="llama",
        vocab_size=10,
        hidden_size=8,
        intermediate_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        rope_theta=500000.0,
        rope_scaling=dict(
            rope_type="llama3",
            factor=32.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=8192,
        ),
    )
    c = ModelConfig.from_hf_config(legacy_llama)
    assert c.rope_theta == 500000.0 and c.rope_scaling_dict["factor"] == 32.0 and c.head_dim == 4
    legacy_gemma3 = dict(
        model_type="gemma3_text",
        vocab_size=10,
        hidden_size=8,
        intermediate_size=16,
        num_hidden_layers=7,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=4,
        rope_theta=1e6,
        rope_local_base_freq=1e4,
        sliding_window=16,
        rope_scaling=dict(rope_type="linear", factor=8.0),
        sliding_window_pattern=6,
    )
    c = ModelConfig.from_hf_config(legacy_gemma3)
    assert c.layer_rope(0) == (1e4, {}) and c.layer_rope(5) == (1e6, {"rope_type": "linear", "factor": 8.0})
    assert c.layer_types[5] == "full_attention" and c.layer_types[6] == "sliding_attention"
    multimodal = dict(model_type="gemma3", text_config=dict(legacy_gemma3, model_type="gemma3_text"))
    assert ModelConfig.from_hf_config(multimodal) == c
    with pytest.raises(NotImplementedError, match="model_type"):
        ModelConfig.from_hf_config(dict(legacy_llama, model_type="gpt2"))


def test_presets_param_counts():
    # published sizes: SmolLM2-135M, Qwen2.5-0.5B (494M), Qwen3-0.6B (596M), Llama-3.2-1B (1.24B), Qwen2.5-1.5B / 7B
    expected = {
        "smollm2_135m": 134.5e6,
        "qwen2_5_0_5b": 494.0e6,
        "qwen3_0_6b": 596.0e6,
        "llama3_2_1b": 1235.8e6,
        "gemma3_1b": 999.9e6,
        "gemma2_2b": 2614.3e6,
        "qwen2_5_1_5b": 1543.7e6,  # Qwen2.5-1.5B model card: 1.54B
        "qwen2_5_7b": 7615.6e6,  # Qwen2.5-7B model card: 7.61B
        "qwen3_32b": 32.8e9,  # Qwen3-32B model card: 32.8B
    }
    for name, n in expected.items():
        assert abs(PRESETS[name].num_params() - n) / n < 0.01, (name, PRESETS[name].num_params())
    abstract = nnx.eval_shape(lambda: Transformer(PRESETS["smollm2_135m"], rngs=nnx.Rngs(0)))
    n = sum(x.size for x in jax.tree.leaves(nnx.state(abstract)))
    assert n == PRESETS["smollm2_135m"].num_params()


def test_init_model_statistics_and_determinism():
    cfg = _tiny("gemma3", vocab_size=512, hidden_size=64)
    a, b = init_model(cfg, seed=0), init_model(cfg, seed=0)
    c = init_model(cfg, seed=1)
    emb = np.asarray(a.embedding[...])
    np.testing.assert_array_equal(emb, np.asarray(b.embedding[...]))
    assert np.abs(emb - np.asarray(c.embedding[...])).max() > 0.01
    assert abs(emb.mean()) < 1e-3 and abs(emb.std() - 0.02) < 1e-3
    q = np.asarray(a.layers[0].attn.q_proj.kernel[...]).ravel()
    assert abs(np.corrcoef(q[:-1], q[1:])[0, 1]) < 0.05  # neighbouring elements independent
    assert np.abs(q[: emb.size] - emb.ravel()[: q.size]).max() > 0.01  # params draw different streams
    np.testing.assert_array_equal(np.asarray(a.layers[0].input_norm.scale[...]), 0.0)  # gemma: 1 + w
