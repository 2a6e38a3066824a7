"""Fused attention backends (models/attention.py) vs an independent numpy reference and vs the dense path.

'cudnn' runs here as `jax.nn.dot_product_attention(implementation="xla")` (the same call and mask as on GPU;
`interpret=True`), 'splash' as the Pallas TPU kernel in interpret mode (tiles of 128: rows of T = 128).
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxrl_post.models import ModelConfig, init_model
from jaxrl_post.models import attention as fused
from jaxrl_post.models.decoder import SEGMENT_SUB_BITS


# ------------------------------------------------------------------------------------------ helpers
def _cfg(family="llama", num_layers=2, **kw):
    base = dict(
        family=family,
        vocab_size=37,
        hidden_size=32,
        intermediate_size=48,
        num_layers=num_layers,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        tie_word_embeddings=True,
    )
    if family.startswith("gemma"):
        base.update(
            norm_offset=1.0,
            embed_scale=True,
            post_norms=True,
            hidden_act="gelu_pytorch_tanh",
            sliding_window=3,
            layer_types=("sliding_attention", "full_attention"),
            attn_logit_softcap=5.0 if family == "gemma2" else None,
            final_logit_softcap=10.0,
            query_pre_attn_scalar=6.0,
            qk_norm=family == "gemma3",
        )
    base.update(kw)
    return ModelConfig(**base)


def _model(cfg, seed=0):
    """Random model with O(1) logits (weights at scale 0.3, so attention is far from uniform)."""
    graphdef, state = nnx.split(init_model(cfg, seed=seed))
    rng = np.random.RandomState(seed)
    leaves, tree = jax.tree.flatten(state)
    new = [
        jnp.asarray((1.0 - cfg.norm_offset) + 0.1 * rng.randn(*x.shape) if x.ndim == 1 else 0.3 * rng.randn(*x.shape))
        for x in leaves
    ]
    return nnx.merge(graphdef, jax.tree.unflatten(tree, [x.astype(jnp.float32) for x in new]))


def _packed_row(lengths, t, shared=False):
    """Segment ids and per-segment positions `[T] int32` of one packed row. lengths: plain: one int per
    sequence; shared: one (prompt, [response lengths]) per chunk (ids chunk << SUB_BITS | sub, responses'
    positions continue after the prompt). Trailing slots are padding (id 0, position 0)."""
    ids, pos = [], []
    for i, seg in enumerate(lengths, start=1):
        if shared:
            p, rs = seg
            ids += [i << SEGMENT_SUB_BITS] * p
            pos += list(range(p))
            for j, r in enumerate(rs, start=1):
                ids += [(i << SEGMENT_SUB_BITS) | j] * r
                pos += list(range(p, p + r))
        else:
            ids += [i] * seg
            pos += list(range(seg))
    assert len(ids) <= t
    pad = t - len(ids)
    return np.array(ids + [0] * pad, np.int32), np.array(pos + [0] * pad, np.int32)


def _numpy_mask(ids, pos, window=None):
    """[B, T, T] bool written from the packing rules (not from decoder.segment_mask): key j visible from
    query i iff j <= i, j is a real token, and j is in i's segment or is the prompt of i's chunk; with a
    window, pos[i] - window < pos[j]."""
    b, t = ids.shape
    m = np.zeros((b, t, t), bool)
    for r in range(b):
        for i in range(t):
            for j in range(i + 1):
                qi, kj = int(ids[r, i]), int(ids[r, j])
                if kj == 0:
                    continue
                same_chunk_prompt = (kj >> SEGMENT_SUB_BITS) == (qi >> SEGMENT_SUB_BITS) and kj % (1 << 16) == 0
                ok = qi == kj or (same_chunk_prompt and kj >> SEGMENT_SUB_BITS > 0)
                if window is not None:
                    ok &= pos[r, i] - window < pos[r, j]
                m[r, i, j] = ok
    return m


def _numpy_attention(q, k, v, mask, scale, softcap=None):
    """float64 reference: q [B, T, H, K], k/v [B, S, N, K], head h reads kv head h // (H / N)."""
    q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
    g = q.shape[2] // k.shape[2]
    k, v = np.repeat(k, g, axis=2), np.repeat(v, g, axis=2)
    s = np.einsum("bthk,bshk->bhts", q, k) * scale
    if softcap is not None:
        s = np.tanh(s / softcap) * softcap
    s = np.where(mask[:, None], s, -1e30)  # padding queries (no visible key): uniform, unused
    p = np.exp(s - s.max(-1, keepdims=True))
    p = p / p.sum(-1, keepdims=True)
    return np.einsum("bhts,bshk->bthk", p, v)


def _qkv(b, t, h=4, n=2, k=8, seed=0):
    rng = np.random.default_rng(seed)
    return tuple(jnp.asarray(rng.normal(size=(b, t, m, k)), jnp.float32) for m in (h, n, n))


def _row_batch(rows, t, shared=False):
    ids, pos = zip(*(_packed_row(r, t, shared) for r in rows))
    return np.stack(ids), np.stack(pos)


def _fwd_and_grad(model, ids, pos, attention_mask=None, seed=1):
    """(logits at real tokens, grads of a weighted logit sum over real tokens wrt every param)."""
    mask = (ids != 0) if attention_mask is None else attention_mask
    seg = jnp.asarray(ids) if attention_mask is None else None
    graphdef, state = nnx.split(model)
    w = jnp.asarray(np.random.default_rng(seed).normal(size=(*ids.shape, model.config.vocab_size)), jnp.float32)
    tokens = jnp.asarray(np.random.default_rng(seed + 1).integers(0, model.config.vocab_size, ids.shape), jnp.int32)

    def loss(st):
        logits = nnx.merge(graphdef, st)(tokens, mask, positions=jnp.asarray(pos), segment_ids=seg)
        return jnp.sum(logits * w * jnp.asarray(mask)[..., None]), logits

    (_, logits), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(state)
    return np.asarray(logits)[np.asarray(mask)], grads


def _assert_same_as_dense(impl, cfg, ids, pos, attention_mask=None, tol=2e-5):
    dense = _model(cfg)
    kernel = _model(cfg)
    kernel.set_attention_impl(impl, interpret=True)
    lo_d, g_d = _fwd_and_grad(dense, ids, pos, attention_mask)
    lo_k, g_k = _fwd_and_grad(kernel, ids, pos, attention_mask)
    assert np.abs(lo_d).max() > 1.0  # O(1) logits: the comparison is not trivially small numbers
    np.testing.assert_allclose(lo_k, lo_d, atol=tol, rtol=tol)
    flat_d, flat_k = jax.tree.leaves(g_d), jax.tree.leaves(g_k)
    assert len(flat_d) == len(flat_k)
    for a, b in zip(flat_d, flat_k):
        scale = float(np.abs(np.asarray(a)).max()) + 1e-6
        np.testing.assert_allclose(np.asarray(b) / scale, np.asarray(a) / scale, atol=tol * 10)


# ------------------------------------------------------------------------------------------ selection
@pytest.mark.parametrize(
    "impl,platform,dtype,softcap,want",
    [
        ("auto", "cpu", "bfloat16", None, "xla"),
        ("auto", "gpu", "bfloat16", None, "cudnn"),
        ("auto", "cuda", "float16", None, "cudnn"),
        ("auto", "gpu", "float32", None, "xla"),  # cuDNN flash attention has no float32
        ("auto", "gpu", "bfloat16", 50.0, "xla"),  # ... and no soft-cap
        ("auto", "tpu", "float32", 50.0, "splash"),
        ("xla", "tpu", "bfloat16", None, "xla"),
        ("chunked", "cpu", "float32", 50.0, "chunked"),
        ("chunked", "tpu", "bfloat16", None, "chunked"),
        ("cudnn", "gpu", "bfloat16", None, "cudnn"),
        ("splash", "tpu", "bfloat16", None, "splash"),
    ],
)
def test_resolve_attention_impl(impl, platform, dtype, softcap, want):
    assert fused.resolve_attention_impl(impl, platform, dtype=dtype, softcap=softcap) == want


@pytest.mark.parametrize(
    "impl,platform,dtype,softcap,match",
    [
        ("flash", "gpu", "bfloat16", None, "expected one of"),
        ("cudnn", "cpu", "bfloat16", None, "GPU kernel but the platform is 'cpu'"),
        ("splash", "cpu", "bfloat16", None, "TPU kernel but the platform is 'cpu'"),
        ("splash", "gpu", "bfloat16", None, "TPU kernel"),
        ("cudnn", "gpu", "float32", None, "compute dtype float32"),
        ("cudnn", "gpu", "bfloat16", 50.0, "attn_logit_softcap=50.0"),
    ],
)
def test_resolve_attention_impl_errors(impl, platform, dtype, softcap, match):
    with pytest.raises(ValueError, match=match):
        fused.resolve_attention_impl(impl, platform, dtype=dtype, softcap=softcap)


def test_cudnn_refuses_softcap_model():
    with pytest.raises(ValueError, match="soft-cap"):
        _model(_cfg("gemma2")).set_attention_impl("cudnn")


# ------------------------------------------------------------------------------------------ kernels vs numpy
@pytest.mark.parametrize("shared,window,t", [(False, None, 16), (True, None, 16), (True, 3, 16), (False, None, 15)])
def test_dot_product_attention_matches_numpy(shared, window, t):
    """t = 15: an odd length gets a hidden padding slot (cuDNN trains with a mask on even lengths only)."""
    rows = [[(4, [3, 3]), (3, [2])], [(5, [4, 2, 1])]] if shared else [[5, 6, 3], [2, 9, 4]]
    ids, pos = _row_batch(rows, t, shared)
    q, k, v = _qkv(2, t)
    mask = _numpy_mask(ids, pos, window)
    out = fused.dot_product_attention(q, k, v, jnp.asarray(mask), scale=0.4, interpret=True)
    real = ids != 0
    want = _numpy_attention(q, k, v, mask, 0.4)
    np.testing.assert_allclose(np.asarray(out)[real], want[real], atol=1e-5, rtol=1e-5)
    assert np.all(np.isfinite(np.asarray(out)))  # padding queries (no visible key) see themselves: no NaN


@pytest.mark.parametrize("window,softcap", [(None, None), (5, 3.0)])
def test_splash_attention_matches_numpy(window, softcap):
    ids, pos = _row_batch([[40, 17, 50, 9], [128]], 128)
    q, k, v = _qkv(2, 128, seed=3)
    out = fused.splash_attention(q, k, v, jnp.asarray(ids), scale=0.4, window=window, softcap=softcap, interpret=True)
    real = ids != 0
    want = _numpy_attention(q, k, v, _numpy_mask(ids, pos, window), 0.4, softcap)
    np.testing.assert_allclose(np.asarray(out)[real], want[real], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("shared,window,softcap,t,chunk", [(False, None, None, 16, 4), (True, 3, 3.0, 15, 4)])
def test_chunked_attention_matches_numpy(shared, window, softcap, t, chunk):
    """Query blocks of 4: 4 blocks (t = 16), or 4 with the last one padded (t = 15)."""
    rows = [[(4, [3, 3]), (3, [2])], [(5, [4, 2, 1])]] if shared else [[5, 6, 3], [2, 9, 4]]
    ids, pos = _row_batch(rows, t, shared)
    q, k, v = _qkv(2, t, seed=4)
    mask = _numpy_mask(ids, pos, window)
    out = fused.chunked_attention(
        q, k, v, jnp.asarray(mask), scale=0.4, softcap=softcap, dtype=jnp.float32, chunk=chunk
    )
    assert out.shape == q.shape
    real = ids != 0
    want = _numpy_attention(q, k, v, mask, 0.4, softcap)
    np.testing.assert_allclose(np.asarray(out)[real], want[real], atol=1e-5, rtol=1e-5)


def test_chunked_attention_keeps_one_block_of_scores_live():
    """XLA's buffer assignment of a forward + backward at T = 512: the temps shrink with the block (about
    three score-sized float32 buffers of one block live: [B, N, G*chunk, S]), the whole row as one block
    holds the dense path's three [B, H, T, T] buffers."""
    t = 512
    q, k, v = _qkv(1, t, h=8, n=2, k=16)
    allowed = jnp.tril(jnp.ones((t, t), bool))[None]

    def temps(chunk):
        f = lambda q, k, v: jnp.sum(
            fused.chunked_attention(q, k, v, allowed, scale=0.25, softcap=None, dtype=jnp.float32, chunk=chunk) ** 2
        )
        return jax.jit(jax.grad(f, argnums=(0, 1, 2))).lower(q, k, v).compile().memory_analysis().temp_size_in_bytes

    scores = 8 * t * t * 4  # one [1, 8 heads, T, T] float32 buffer
    whole, blocks = temps(t), temps(64)
    assert whole >= 2 * scores
    assert blocks < whole / 4


def test_splash_needs_tiles_of_128_outside_interpret_mode():
    q, k, v = _qkv(1, 96)
    with pytest.raises(ValueError, match="multiple of 128"):
        fused.splash_attention(q, k, v, jnp.ones((1, 96), jnp.int32), scale=1.0, window=None, softcap=None)


# ------------------------------------------------------------------------------------------ model: kernels vs dense
@pytest.mark.parametrize(
    "family,shared",
    [("llama", False), ("llama", True), ("gemma3", False), ("gemma3", True)],
)
@pytest.mark.slow
def test_cudnn_path_matches_dense_packed(family, shared):
    """Packed rows (several segments, GQA 4:2); gemma3: sliding window 3 on one layer; shared: the shared-
    prompt layout (exact: the whole mask goes to dot_product_attention)."""
    rows = [[(4, [3, 3]), (3, [2])], [(5, [4, 2, 1])]] if shared else [[5, 6, 3], [2, 9, 4]]
    ids, pos = _row_batch(rows, 16, shared)
    _assert_same_as_dense("cudnn", _cfg(family), ids, pos)


@pytest.mark.parametrize("family,shared", [("llama", True), ("gemma2", False)])
def test_chunked_path_matches_dense_packed(family, shared, monkeypatch):
    """The model with 'chunked' attention in blocks of 4 queries (rows of 16: 4 blocks) against the dense path:
    shared-prompt packed rows (llama), plain segments with a sliding window and a logit soft-cap (gemma2)."""
    monkeypatch.setattr(fused, "CHUNK", 4)
    rows = [[(4, [3, 3]), (3, [2])], [(5, [4, 2, 1])]] if shared else [[5, 6, 3], [2, 9, 4]]
    ids, pos = _row_batch(rows, 16, shared)
    _assert_same_as_dense("chunked", _cfg(family), ids, pos)


@pytest.mark.parametrize("shared", [True, False])
def test_causal_query_blocks_equal_the_whole_row(shared, monkeypatch):
    """Dense attention without a cache in causal query blocks (`decoder.CAUSAL_BLOCK` 4: rows of 16 in 4 blocks,
    block i against keys [0, 4 (i + 1))) gives the whole-row forward's logits and gradients (packed rows, shared
    prompts or a sliding window + soft-cap), and lowers to fewer FLOPs."""
    from jaxrl_post.models import decoder

    rows = [[(4, [3, 3]), (3, [2])], [(5, [4, 2, 1])]] if shared else [[5, 6, 3], [2, 9, 4]]
    ids, pos = _row_batch(rows, 16, shared)
    cfg = _cfg("llama" if shared else "gemma2")
    monkeypatch.setattr(decoder, "CAUSAL_BLOCK", 10**6)
    lo_w, g_w = _fwd_and_grad(_model(cfg), ids, pos)
    long_ids, long_pos = _row_batch([[40, 50, 38]], 128)  # one row of 128 (FLOPs: 8 blocks of 16 at 16)
    flops_w = _forward_flops(_model(cfg), long_ids, long_pos)
    monkeypatch.setattr(decoder, "CAUSAL_BLOCK", 16)
    assert _forward_flops(_model(cfg), long_ids, long_pos) < 0.85 * flops_w  # 0.77 seen (8 blocks of 16)
    monkeypatch.setattr(decoder, "CAUSAL_BLOCK", 4)
    lo_b, g_b = _fwd_and_grad(_model(cfg), ids, pos)
    assert np.abs(lo_w).max() > 1.0
    np.testing.assert_allclose(lo_b, lo_w, atol=2e-5, rtol=2e-5)
    for a, b in zip(jax.tree.leaves(g_w), jax.tree.leaves(g_b), strict=True):
        scale = float(np.abs(np.asarray(a)).max()) + 1e-6
        np.testing.assert_allclose(np.asarray(b) / scale, np.asarray(a) / scale, atol=2e-4)


def _forward_flops(model, ids, pos) -> float:
    graphdef, state = nnx.split(model)
    fn = lambda st: nnx.merge(graphdef, st)(
        jnp.asarray(ids), jnp.asarray(ids != 0), positions=jnp.asarray(pos), segment_ids=jnp.asarray(ids)
    )
    # the lowered program's count: the compiled one depends on the backend's fusions (XLA:CPU flags)
    cost = jax.jit(fn).lower(state).cost_analysis()
    return float((cost[0] if isinstance(cost, list) else cost)["flops"])


@pytest.mark.slow
def test_cudnn_path_matches_dense_padded_rows():
    """Unpacked rows with left padding (no segment ids): causal & key mask; sliding window by slots."""
    mask = np.array([[0, 0, 0, 1, 1, 1, 1, 1, 1, 0], [1] * 10], bool)
    pos = np.maximum(np.cumsum(mask, 1) - 1, 0).astype(np.int32)
    _assert_same_as_dense("cudnn", _cfg("gemma3"), np.where(mask, 1, 0), pos, attention_mask=mask)


@pytest.mark.parametrize("family", ["llama", "gemma2"])
@pytest.mark.slow
def test_splash_path_matches_dense_packed(family):
    """Packed rows of 128 (4 sequences + padding, GQA 4:2); gemma2: sliding window 3 and logit soft-cap."""
    ids, pos = _row_batch([[40, 17, 50, 9]], 128)
    _assert_same_as_dense("splash", _cfg(family), ids, pos)


@pytest.mark.slow  # ~30 s: the Pallas interpret-mode fwd+bwd kernels compile slowly on XLA:CPU
def test_splash_path_matches_dense_padded_rows():
    mask = np.zeros((1, 128), bool)
    mask[0, 20:100] = True  # left and right padding
    pos = np.maximum(np.cumsum(mask, 1) - 1, 0).astype(np.int32)
    _assert_same_as_dense("splash", _cfg("llama", num_layers=1), np.where(mask, 1, 0), pos, attention_mask=mask)


def test_splash_refuses_shared_prompt_ids_loudly():
    """Splash sees only equal ids: shared-prompt ids (chunk >= 1) give NaN logits, never silently wrong ones."""
    ids, pos = _row_batch([[(40, [30, 20]), (20, [10])]], 128, shared=True)
    model = _model(_cfg("llama", num_layers=1))
    model.set_attention_impl("splash", interpret=True)
    logits = model(jnp.ones_like(jnp.asarray(ids)), ids != 0, positions=jnp.asarray(pos), segment_ids=ids)
    assert np.all(np.isnan(np.asarray(logits)))


def test_default_is_dense_and_cache_path_stays_dense():
    """The default is 'xla' (no fused call in the program); a cached forward ignores the backend."""
    cfg = _cfg("llama", num_layers=1)
    model = _model(cfg)
    assert model.attention_impl == "xla" and model.layers[0].attn.attention_impl == "xla"
    ids = jnp.ones((1, 8), jnp.int32)
    jaxpr = str(jax.make_jaxpr(lambda i: model(i, jnp.ones((1, 8), bool)))(ids))
    assert "dot_product_attention" not in jaxpr and "pallas_call" not in jaxpr
    want, _ = model(ids, jnp.ones((1, 8), bool), cache=model.init_cache(1, 8))
    model.set_attention_impl("splash", interpret=True)  # T = 8: would need interpret tiles; the cache skips it
    got, _ = model(ids, jnp.ones((1, 8), bool), cache=model.init_cache(1, 8))
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


# ------------------------------------------------------------------------------------------ lowering
def test_splash_training_step_lowers_for_tpu():
    """fwd+bwd of a packed bf16 model with splash lowers for TPU (Mosaic kernels: fwd, dq, dkv per layer)."""
    cfg = _cfg("llama", num_layers=1, dtype="bfloat16")
    model = init_model(cfg, seed=0, dtype="bfloat16", param_dtype="float32")
    model.set_attention_impl("splash")
    graphdef, state = nnx.split(model)
    ids = jax.ShapeDtypeStruct((2, 256), jnp.int32)

    def loss(st, tokens, seg, pos):
        return jnp.sum(nnx.merge(graphdef, st)(tokens, seg != 0, positions=pos, segment_ids=seg))

    lowered = jax.jit(jax.grad(loss)).trace(state, ids, ids, ids).lower(lowering_platforms=("tpu",))
    text = lowered.as_text()
    assert text.count("tpu_custom_call") == 3  # splash forward, dq and dkv kernels


def test_cudnn_training_step_lowers_for_cuda(monkeypatch):
    """fwd+bwd with the cudnn backend lowers for CUDA to cuDNN fused attention custom calls. No cuDNN here:
    its two availability probes (library version, GPU compute capability) are stubbed; the shape, layout
    and mask checks of `jax._src.cudnn` run as they would on an H100."""
    from jax._src.cudnn import fused_attention_stablehlo as fa

    monkeypatch.setattr(fa, "check_cudnn_version", lambda: 91000)
    monkeypatch.setattr(fa, "check_compute_capability", lambda capability: True)
    cfg = _cfg("llama", num_layers=1, dtype="bfloat16")
    model = init_model(cfg, seed=0, dtype="bfloat16", param_dtype="float32")
    model.set_attention_impl("cudnn")
    graphdef, state = nnx.split(model)
    ids = jax.ShapeDtypeStruct((2, 63), jnp.int32)  # odd: cuDNN's backward with a mask needs even lengths

    def loss(st, tokens, seg, pos):
        return jnp.sum(nnx.merge(graphdef, st)(tokens, seg != 0, positions=pos, segment_ids=seg))

    text = jax.jit(jax.grad(loss)).trace(state, ids, ids, ids).lower(lowering_platforms=("cuda",)).as_text()
    assert "custom_call @__cudnn$fmhaScaleBiasSoftmax(" in text  # forward
    assert "custom_call @__cudnn$fmhaScaleBiasSoftmaxBackward(" in text


# ------------------------------------------------------------------------------------------ trainer wiring
def test_config_selects_backend_and_splash_turns_shared_prompts_off(caplog):
    """`builders.apply_attention_impl`: 'auto' resolves by platform and is set on every layer (logged);
    a kernel on the wrong platform is a ConfigError naming the key; under splash `_pack_spec` packs each
    sequence with its own prompt (and logs why), under the other backends prompts are shared."""
    import logging
    from types import SimpleNamespace

    from configs import grpo
    from jaxrl_post.errors import ConfigError
    from jaxrl_post.rl import builders
    from jaxrl_post.rl.roles.policy import pack_spec

    c = grpo.get_config("tiny")
    assert c.model.attention_impl == "auto" and c.model.pack_shared_prompts and c.rollout.n > 1
    model = _model(_cfg("llama", num_layers=2))
    with caplog.at_level(logging.INFO, logger="jaxrl_post.rl.builders"):
        assert builders.apply_attention_impl(c, model, platform="cpu") == "xla"
        assert builders.apply_attention_impl(c, model, platform="tpu") == "splash"
    assert [blk.attn.attention_impl for blk in model.layers] == ["splash", "splash"]
    assert "'auto' -> 'xla' on cpu" in caplog.text and "pack_shared_prompts is off under splash" in caplog.text
    c.model.attention_impl = "cudnn"
    with pytest.raises(ConfigError, match="model.attention_impl='cudnn' is a GPU kernel"):
        builders.apply_attention_impl(c, model, platform="cpu")

    def spec(impl):
        fake = SimpleNamespace(
            config=c,
            response_length=int(c.data.max_response_length),
            mesh=SimpleNamespace(shape={"data": 1, "fsdp": 1, "tensor": 1}),
            actor_model=SimpleNamespace(attention_impl=impl),
        )
        return pack_spec(c, "actor", 8, 4, mesh=fake.mesh, response_length=fake.response_length, attention_impl=impl)

    assert spec("xla").share_prompts and spec("cudnn").share_prompts and spec("chunked").share_prompts
    assert not spec("splash").share_prompts
    c.model.attention_impl = "chunked"  # any platform
    assert builders.apply_attention_impl(c, model, platform="cpu") == "chunked"
    assert [blk.attn.attention_impl for blk in model.layers] == ["chunked", "chunked"]


_MESH_SCRIPT = """
import os
os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"
import jax, jax.numpy as jnp, numpy as np
from jaxrl_post.models import attention as A
from jaxrl_post.runtime.sharding import make_mesh
rng = np.random.default_rng(0)
q, k, v = (jnp.asarray(rng.normal(size=(2, 128, h, 8)), jnp.float32) for h in (4, 2, 2))
ids = jnp.asarray(np.repeat([[1, 2, 3, 0]], 32, 1).repeat(2, 0), jnp.int32)
f = jax.jit(lambda q, k, v, s: A.splash_attention(q, k, v, s, scale=0.3, window=None, softcap=None, interpret=True))
want = f(q, k, v, ids)
with jax.set_mesh(make_mesh(data=1, fsdp=2, tensor=2)):
    got = f(q, k, v, ids)
    text = f.lower(q, k, v, ids).as_text()
assert "manual_computation" in text, "no shard_map around the Pallas call"
np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
print("OK")
"""


@pytest.mark.slow  # 30-100 s: a fresh process compiling Pallas interpret-mode kernels on 4 fake devices
def test_splash_runs_per_shard_on_a_mesh(repo_root):
    """On a ('data', 'fsdp', 'tensor') = (1, 2, 2) mesh of 4 fake CPU devices the splash call is wrapped in a
    shard_map over rows and heads (XLA cannot partition a Pallas call) and gives the unsharded result."""
    import subprocess
    import sys

    env = dict(os.environ, PYTHONPATH=str(repo_root))
    run = subprocess.run([sys.executable, "-c", _MESH_SCRIPT], capture_output=True, text=True, env=env, timeout=300)
    assert run.returncode == 0 and run.stdout.strip().endswith("OK"), run.stderr[-3000:]
