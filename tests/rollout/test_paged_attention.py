"""Paged KV pool and ragged paged attention (issue 56): the XLA path equals a numpy reference on ragged prefill and
decode sequences with GQA, soft-cap and sliding window (float32, 1e-6); the decoder's forward over the pool equals
today's dense cached forward (`Transformer` with a `KVCache`) for llama, qwen3 and gemma2 (scanned layers, period
2); the paged decode step lowers for `tpu` (Pallas `ragged_paged_attention` at Qwen2.5-7B's head layout) and `cuda`."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxrl_post.models import ModelConfig, init_model
from jaxrl_post.rollout.paged import forward
from jaxrl_post.rollout.paged.allocator import PageAllocator
from jaxrl_post.rollout.paged.attention import paged_attention, resolve_paged_attention_impl
from jaxrl_post.rollout.paged.kv_pool import init_pool, token_slots, write_kv

TINY = dict(
    vocab_size=96,
    hidden_size=64,
    intermediate_size=128,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    max_position_embeddings=256,
    eos_token_id=None,
    pad_token_id=0,
    bos_token_id=1,
)
FAMILIES = {
    "llama": dict(family="llama"),
    "qwen3": dict(family="qwen3", qk_norm=True, num_layers=3),
    "gemma2": dict(
        family="gemma2",
        norm_offset=1.0,
        embed_scale=True,
        post_norms=True,
        hidden_act="gelu_pytorch_tanh",
        tie_word_embeddings=True,
        attn_logit_softcap=50.0,
        final_logit_softcap=30.0,
        sliding_window=6,
        query_pre_attn_scalar=16,
        layer_types=("sliding_attention", "full_attention"),
    ),
}


def _numpy_attention(q, k, v, q_len, scale, window, softcap):
    """One sequence: q [q_len, H, K] are its last q_len tokens of k, v [S, N, K] (causal)."""
    s, n, _ = k.shape
    g = q.shape[1] // n
    out = np.zeros(q.shape, np.float64)
    for i in range(q_len):
        pos = s - q_len + i
        for h in range(q.shape[1]):
            sc = k[: pos + 1, h // g] @ q[i, h] * scale
            if softcap is not None:
                sc = np.tanh(sc / softcap) * softcap
            if window is not None:
                sc[: max(0, pos - window + 1)] = -np.inf
            p = np.exp(sc - sc.max())
            out[i, h] = (p / p.sum()) @ v[: pos + 1, h // g]
    return out


@pytest.mark.parametrize(
    "heads,window,softcap,segment",
    [((4, 2), None, None, None), ((6, 2), 5, None, 2), ((4, 4), None, 20.0, 1), ((4, 2), None, None, 3)],
)
def test_xla_paged_attention_matches_numpy_on_ragged_sequences(heads, window, softcap, segment):
    """segment: pages per segment of the table (None: one segment here); sequences see 1 to 4 segments."""
    h, n = heads
    kd, ps, rng = 8, 4, np.random.default_rng(0)
    kv_lens, q_lens = [9, 1, 13, 4, 6], [9, 1, 1, 3, 1]  # a whole prompt, decodes, a prefill chunk after 3 tokens
    alloc = PageAllocator(num_pages=24, page_size=ps)
    for i, s in enumerate(kv_lens):
        alloc.allocate(i, s)
    alloc.free(1)  # scatter the later sequences' pages
    alloc.allocate(1, kv_lens[1])
    tables = alloc.page_table(list(range(5)) + [None], 5)  # one idle sequence slot
    pool = np.zeros((24, ps, 2 * n, kd), np.float32)
    ks = [rng.standard_normal((s, n, kd)).astype(np.float32) for s in kv_lens]
    vs = [rng.standard_normal((s, n, kd)).astype(np.float32) for s in kv_lens]
    for i, s in enumerate(kv_lens):
        for t in range(s):
            pool[tables[i, t // ps], t % ps, 0::2], pool[tables[i, t // ps], t % ps, 1::2] = ks[i][t], vs[i][t]
    t_pad = sum(q_lens) + 3  # padding queries past the last sequence
    q = rng.standard_normal((t_pad, h, kd)).astype(np.float32)
    cu = np.concatenate([[0], np.cumsum(q_lens), [sum(q_lens)]]).astype(np.int32)
    out = paged_attention(
        jnp.asarray(q),
        jnp.asarray(pool),
        jnp.asarray(kv_lens + [0], jnp.int32),
        jnp.asarray(tables),
        jnp.asarray(cu),
        jnp.asarray([5], jnp.int32),
        sm_scale=0.3,
        sliding_window=window,
        soft_cap=softcap,
        segment_pages=segment,
    )
    for i in range(5):
        want = _numpy_attention(q[cu[i] : cu[i + 1]], ks[i], vs[i], q_lens[i], 0.3, window, softcap)
        np.testing.assert_allclose(np.asarray(out[cu[i] : cu[i + 1]]), want, atol=1e-6, rtol=1e-6)
    assert not np.asarray(out[sum(q_lens) :]).any()


def test_write_kv_and_token_slots_interleave_keys_and_values():
    kv = init_pool(2, 5, 2, 2, 3, jnp.float32).kv
    k, v = jnp.ones((3, 2, 3)), -jnp.ones((3, 2, 3))
    slots = token_slots(jnp.array([0, 1, 2]), jnp.array([[3, 1], [3, 1], [3, 1]]), 2)
    np.testing.assert_array_equal(slots, [6, 7, 2])
    out = np.asarray(write_kv(kv, 1, k, v, slots))
    assert not out[0].any() and (out[1, 3, :, 0::2] == 1).all() and (out[1, 3, :, 1::2] == -1).all()
    assert (out[1, 1, 0] != 0).all() and not out[1, 1, 1].any()


def _prompts(lengths, vocab, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(3, vocab, size=n).astype(np.int32) for n in lengths]


def _dense(model, prompts, next_tokens):
    """Today's path: left-padded prefill into a KVCache, then one cached step: (last prompt logits, step logits)."""
    p = max(map(len, prompts))
    ids = np.zeros((len(prompts), p), np.int32)
    mask = np.zeros_like(ids)
    for i, x in enumerate(prompts):
        ids[i, p - len(x) :], mask[i, p - len(x) :] = x, 1
    cache = model.init_cache(len(prompts), p + 1)
    logits, cache = model(jnp.asarray(ids), jnp.asarray(mask), cache=cache)
    step, _ = model(jnp.asarray(next_tokens)[:, None], jnp.ones((len(prompts), 1), jnp.int32), cache=cache)
    return np.asarray(logits[:, -1]), np.asarray(step[:, 0])


def _paged(model, prompts, next_tokens, ps=4):
    """The pool path: all prompts as one ragged prefill chunk [1, T], then one decode step [S, 1]."""
    c = model.config
    graphdefs, layers = forward.stack_layers(model)
    alloc = PageAllocator(num_pages=32, page_size=ps)
    s = len(prompts)
    for i, x in enumerate(prompts):
        alloc.allocate(i, len(x) + 1)  # room for the decode token
    tables = jnp.asarray(alloc.page_table(list(range(s)), 8))
    kv = init_pool(c.num_layers, 32, ps, c.num_kv_heads, c.head_dim, jnp.float32).kv
    lens = np.array([len(x) for x in prompts], np.int32)
    tok = np.concatenate(prompts)[None]
    pos = np.concatenate([np.arange(n) for n in lens]).astype(np.int32)
    seq = np.repeat(np.arange(s), lens)
    rag = forward.Ragged(
        tokens=jnp.asarray(tok),
        positions=jnp.asarray(pos)[None],
        slots=token_slots(jnp.asarray(pos), tables[seq], ps),
        kv_lens=jnp.asarray(lens),
        page_indices=tables,
        cu_q_lens=jnp.asarray(np.concatenate([[0], np.cumsum(lens)]), jnp.int32),
        num_seqs=jnp.array([s], jnp.int32),
    )
    h, kv = jax.jit(forward.hidden_states, static_argnums=(1, 5))(model, graphdefs, layers, kv, rag, "xla")
    last = np.asarray(model.logits_from_hidden(h))[0, np.cumsum(lens) - 1]
    rag = forward.Ragged(
        tokens=jnp.asarray(next_tokens)[:, None],
        positions=jnp.asarray(lens)[:, None],
        slots=token_slots(jnp.asarray(lens), tables, ps),
        kv_lens=jnp.asarray(lens + 1),
        page_indices=tables,
        cu_q_lens=jnp.arange(s + 1, dtype=jnp.int32),
        num_seqs=jnp.array([s], jnp.int32),
    )
    h, kv = jax.jit(forward.hidden_states, static_argnums=(1, 5))(model, graphdefs, layers, kv, rag, "xla")
    return last, np.asarray(model.logits_from_hidden(h))[:, 0]


@pytest.mark.parametrize(
    "fam", ["llama", pytest.param("qwen3", marks=pytest.mark.slow), pytest.param("gemma2", marks=pytest.mark.slow)]
)  # 6-15 s each on 2 loaded cores: one fast, two slow
def test_paged_forward_equals_the_dense_cached_forward(fam):
    model = init_model(ModelConfig(**{**TINY, **FAMILIES[fam]}), seed=1)
    prompts = _prompts([7, 1, 12, 5], TINY["vocab_size"])  # gemma2's window 6 < 12: the window masks
    nxt = np.array([5, 9, 11, 40], np.int32)
    want_last, want_step = _dense(model, prompts, nxt)
    got_last, got_step = _paged(model, prompts, nxt)
    np.testing.assert_allclose(got_last, want_last, atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(got_step, want_step, atol=1e-5, rtol=1e-5)


def test_resolve_paged_attention_impl():
    assert resolve_paged_attention_impl("auto", "tpu") == "pallas_tpu"
    assert resolve_paged_attention_impl("auto", "gpu") == resolve_paged_attention_impl("auto", "cuda") == "pallas_gpu"
    assert resolve_paged_attention_impl("auto", "cpu") == "xla"
    with pytest.raises(ValueError, match="TPU kernel"):
        resolve_paged_attention_impl("pallas_tpu", "cpu")
    with pytest.raises(ValueError, match="GPU kernel"):
        resolve_paged_attention_impl("pallas_gpu", "tpu")
    assert resolve_paged_attention_impl("pallas_gpu", "cpu", interpret=True) == "pallas_gpu_interpret"
    with pytest.raises(ValueError, match="expected"):
        resolve_paged_attention_impl("flash", "cpu")


@pytest.mark.parametrize("platform,impl", [("tpu", "pallas_tpu"), ("cuda", "xla")])
def test_paged_decode_attention_lowers_at_qwen2_7b_heads(platform, impl, monkeypatch):
    """One decode step of 64 slots over a bf16 pool at Qwen2.5-7B's layout (28 query heads, 4 kv heads, K 128),
    pages of 16 tokens, 64 pages per sequence (1k tokens): lowers for the accelerator without one. Pallas' Mosaic
    lowering asks the default device for its TPU generation: stubbed as a v5p (this CPU's kind is 'cpu')."""
    from jax._src.pallas.mosaic import tpu_info

    monkeypatch.setattr(tpu_info, "get_device_kind", lambda: "TPU v5p")
    monkeypatch.setattr(tpu_info, "get_num_device_cores", lambda: 1)
    s, pps, ps = 64, 64, 16
    args = (
        jax.ShapeDtypeStruct((s, 28, 128), jnp.bfloat16),
        jax.ShapeDtypeStruct((2, 512, ps, 8, 128), jnp.bfloat16),
        jax.ShapeDtypeStruct((s,), jnp.int32),
        jax.ShapeDtypeStruct((s, pps), jnp.int32),
        jax.ShapeDtypeStruct((s + 1,), jnp.int32),
        jax.ShapeDtypeStruct((1,), jnp.int32),
    )

    def step(q, kv, lens, tables, cu, num):
        return paged_attention(q, kv, lens, tables, cu, num, sm_scale=128**-0.5, impl=impl, layer=jnp.int32(1))

    text = jax.jit(step).trace(*args).lower(lowering_platforms=(platform,)).as_text()
    assert ("ragged_paged_attention" in text) == (impl == "pallas_tpu")


@pytest.mark.slow  # the reference runs eagerly, op by op: 18-45 s on 2 loaded cores
def test_tpu_kernel_arguments_match_the_xla_path_under_the_kernels_reference(monkeypatch):
    """The 'pallas_tpu' dispatch (layer offset into the flattened pool, scale, window, soft-cap) run through the
    kernel package's own reference `ref_ragged_paged_attention` (this CPU cannot run the kernel) equals 'xla'."""
    from jax.experimental.pallas.ops.tpu import ragged_paged_attention as rpa

    def ref(*args, num_kv_pages_per_block, num_queries_per_block, vmem_limit_bytes, **kw):
        return rpa.ref_ragged_paged_attention(*args, **kw)

    monkeypatch.setattr(rpa, "ragged_paged_attention", ref)
    rng = np.random.default_rng(1)
    kv = jnp.asarray(rng.standard_normal((3, 12, 4, 4, 8)), jnp.float32)  # 3 layers, 12 pages of 4, N=2, K=8
    tables = jnp.asarray([[3, 5, 7], [2, 4, 0], [11, 0, 0]], jnp.int32)
    kv_lens, cu = jnp.asarray([10, 6, 3], jnp.int32), jnp.asarray([0, 4, 5, 6], jnp.int32)
    q = jnp.asarray(rng.standard_normal((6, 4, 8)), jnp.float32)
    for window, softcap in ((None, None), (3, 30.0)):
        got, want = (
            paged_attention(
                q,
                kv,
                kv_lens,
                tables,
                cu,
                jnp.array([3], jnp.int32),
                sm_scale=0.35,
                sliding_window=window,
                soft_cap=softcap,
                impl=impl,
                layer=jnp.int32(2),
            )
            for impl in ("pallas_tpu", "xla")
        )
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("platform,impl", [("tpu", "pallas_tpu"), ("cuda", "xla")])
def test_whole_paged_decode_program_lowers(platform, impl, monkeypatch):
    """The engine's K-step decode program (sampling, the layer scan over the pool, the LM head) of a 2-layer model
    with 128-wide heads, bf16, lowers for the accelerator (TPU device kind stubbed as in the test above)."""
    from jax._src.pallas.mosaic import tpu_info

    from jaxrl_post.rollout import SamplingParams
    from jaxrl_post.rollout.paged import programs

    monkeypatch.setattr(tpu_info, "get_device_kind", lambda: "TPU v5p")
    monkeypatch.setattr(tpu_info, "get_num_device_cores", lambda: 1)
    cfg = ModelConfig(**{**TINY, "hidden_size": 256, "num_heads": 4, "num_kv_heads": 2, "head_dim": 128})
    model = init_model(cfg, seed=0, dtype="bfloat16")
    graphdef, state = nnx.split(model)
    graphdefs, layers = forward.stack_layers(model)
    s, pps, ps = 8, 4, 16
    kv = jax.ShapeDtypeStruct((1, 2, 33, ps, 4, 128), jnp.bfloat16)  # one replica
    i32 = lambda *shape: jax.ShapeDtypeStruct((1, *shape), jnp.int32)
    args = (graphdef, state, graphdefs, layers, kv, jax.ShapeDtypeStruct((1, s, 96), jnp.float32))
    args += (i32(s),) * 5 + (jax.ShapeDtypeStruct((1, s), jnp.bool_), i32(s, pps), jax.random.key(0))
    params = SamplingParams(max_new_tokens=8, top_p=0.9, eos_token_ids=(4,))
    lowered = programs.decode.trace(*args, impl=impl, params=params, steps=4).lower(lowering_platforms=(platform,))
    assert ("ragged_paged_attention" in lowered.as_text()) == (impl == "pallas_tpu")
