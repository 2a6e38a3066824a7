"""The paged engine's GPU decode attention (issue 56 item 3, `rollout/paged/attention_gpu.py`): the Pallas GPU kernel
of jax 0.10 over the engine's pool as it is. No GPU here:

- numerics: the kernel in Pallas interpret mode on CPU equals the XLA path on ragged decode sequences (lengths 1 to
  150, a page table split over 2 k-splits, padded), GQA (3 query heads per kv head, padded to 16), a soft-cap, a
  layer offset into the whole pool and a padding sequence (float32, 1e-5); in bfloat16 its error against a float64
  numpy reference is within the XLA path's own bfloat16 error (x 1.25); a prefill call (`decode=False`) takes the
  XLA path; with a float32 pool the kernel's dots are IEEE float32 ('highest', not Triton's TF32 default);
- the engine with the GPU impl in interpret mode returns the dense `Generator`'s greedy tokens (log-probs 1e-5) on a
  tiny model, its decode steps through the kernel;
- lowering: the engine's whole K-step decode program with the kernel lowers for CUDA on this CPU at Qwen2.5-7B's
  head layout (28 query heads, 4 kv heads, head_dim 128, bf16): the Triton custom call reads the pool through a
  free reshape (`[L * P, page, 2N, K]`, passed as keys and as values) and no gather or transpose reads the pool
  (the XLA path's program, checked alongside, gathers its pages from it);
- `resolve_for_model`: 'auto' picks the GPU kernel on 'gpu' / 'cuda' and falls back to XLA for models it cannot
  run (sliding window, sinks, head_dim 80, page size 12: Triton's power-of-two tiles); naming it raises.
"""

import logging
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxrl_post.batch.protocol import DataProto
from jaxrl_post.models import ModelConfig, init_model
from jaxrl_post.rollout import Generator, SamplingParams
from jaxrl_post.rollout.paged import attention, attention_gpu, forward, programs
from jaxrl_post.rollout.paged.attention import paged_attention, resolve_for_model
from jaxrl_post.rollout.paged.engine import PagedGenerator

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
L, P, PS, N, K, H = 2, 40, 4, 2, 16, 6  # layers, pages, page size, kv heads, head dim, query heads (G = 3)
LENS = [1, 7, 150, 13, 0]  # ragged; the 5th sequence is padding (past num_seqs)
SCALE = 0.3


@pytest.fixture(scope="module")
def case():
    """q `[5, H, K]`, pool `[L, P, PS, 2N, K]`, lengths, tables `[5, 40]` (pages scattered over the pool)."""
    rng = np.random.default_rng(0)
    pool = rng.standard_normal((L, P, PS, 2 * N, K)).astype(np.float32)
    tables, free = np.zeros((len(LENS), P), np.int32), list(rng.permutation(np.arange(1, P)))
    for i, n in enumerate(LENS):
        pages = -(-n // PS)
        tables[i, :pages] = [free.pop() if free else rng.integers(1, P) for _ in range(pages)]
    q = (rng.standard_normal((len(LENS), H, K)) * 2).astype(np.float32)
    return q, pool, np.asarray(LENS, np.int32), tables


def _run(case, impl, dtype, soft_cap, decode=True):
    q, pool, lens, tables = case
    s, lens, tables = len(LENS), jnp.asarray(lens), jnp.asarray(tables)
    cu, num = jnp.arange(s + 1, dtype=jnp.int32), jnp.array([s - 1], jnp.int32)

    def f(q, pool):
        return paged_attention(
            q, pool, lens, tables, cu, num, sm_scale=SCALE, soft_cap=soft_cap, impl=impl, layer=jnp.int32(1),
            decode=decode, dtype=dtype,
        )  # fmt: skip

    return np.asarray(jax.jit(f)(jnp.asarray(q, dtype), jnp.asarray(pool, dtype)).astype(jnp.float32))


def _numpy_reference(case, dtype, soft_cap):
    """float64 attention of layer 1 from the inputs rounded to `dtype`: `[5, H, K]` (0 for the padding sequence)."""
    q, pool, lens, tables = case
    q = np.asarray(jnp.asarray(q, dtype).astype(jnp.float32), np.float64)
    pool = np.asarray(jnp.asarray(pool, dtype).astype(jnp.float32), np.float64)[1]
    out = np.zeros(q.shape)
    for i, n in enumerate(lens[:-1]):
        kv = pool[tables[i]].reshape(-1, 2 * N, K)[:n]
        for h in range(H):
            j = h // (H // N)
            sc = kv[:, 2 * j] @ q[i, h] * SCALE
            sc = sc if soft_cap is None else np.tanh(sc / soft_cap) * soft_cap
            p = np.exp(sc - sc.max())
            out[i, h] = p / p.sum() @ kv[:, 2 * j + 1]
    return out


def test_block_choice_splits_the_table_and_pads_it():
    # the case below: 5 sequences x 2 kv heads, 40 pages of 4: 32-page compute blocks, 2 k-splits, table 64 wide
    assert attention_gpu.decode_blocks(5, 2, 6, 40, 4) == (32, 2, 64)
    # Qwen2.5-7B, 64 slots x 4 kv heads, 1k-token tables of 16-token pages: the wrapper's 8 pages, 4 splits
    assert attention_gpu.decode_blocks(64, 4, 28, 64, 16) == (8, 4, 64)
    assert attention_gpu.decode_blocks(512, 4, 28, 1024, 16) == (8, 1, 1024)  # enough programs: no split
    assert attention_gpu.decode_blocks(1, 1, 16, 3, 16) == (4, 1, 4)  # short table: one block, padded


@pytest.mark.parametrize("soft_cap", [pytest.param(None, marks=pytest.mark.slow), 5.0])  # 4-11 s each: one fast
def test_gpu_kernel_equals_the_xla_path_float32(case, soft_cap):
    got, want = (_run(case, impl, jnp.float32, soft_cap) for impl in ("pallas_gpu_interpret", "xla"))
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(got, _numpy_reference(case, jnp.float32, soft_cap), atol=1e-5, rtol=1e-5)
    assert not got[-1].any()  # the padding sequence


@pytest.mark.slow  # two interpret-mode compiles, ~12 s on 2 loaded cores
def test_gpu_kernel_bf16_within_the_xla_paths_own_error(case):
    ref = _numpy_reference(case, jnp.bfloat16, 5.0)
    got, xla = (_run(case, impl, jnp.bfloat16, 5.0) for impl in ("pallas_gpu_interpret", "xla"))
    err_gpu, err_xla = np.abs(got - ref).max(), np.abs(xla - ref).max()
    assert 0 < err_xla < 0.02 and err_gpu <= 1.25 * err_xla, (err_gpu, err_xla)


def test_prefill_takes_the_xla_path_and_float32_dots_are_ieee(case, monkeypatch):
    calls = []
    monkeypatch.setattr(attention, "paged_decode_attention_gpu", lambda *a, **k: calls.append(1))
    q, pool, lens, tables = (jnp.asarray(x) for x in case)
    s = len(LENS)
    args = (q, pool, lens, tables, jnp.arange(s + 1, dtype=jnp.int32), jnp.array([s], jnp.int32))
    prefill = jax.make_jaxpr(lambda *a: paged_attention(*a, sm_scale=SCALE, impl="pallas_gpu", layer=jnp.int32(0)))
    assert "pallas_call" not in str(prefill(*args)) and not calls
    monkeypatch.undo()
    highest = "precision=(Precision.HIGHEST, Precision.HIGHEST)"
    for dtype, precision in ((jnp.float32, highest), (jnp.bfloat16, "preferred_element_type=float32")):
        jaxpr = str(
            jax.make_jaxpr(
                lambda q, p: attention_gpu.paged_decode_attention_gpu(q, p, lens, tables, sm_scale=1.0, interpret=True)
            )(q.astype(dtype), pool[0].astype(dtype))
        )
        dots = re.findall(r"dot_general\[\s*dimension_numbers=[^\n]*\n\s*([^\n]*)", jaxpr)  # the next param
        assert dots == [precision] * 2, (dtype, dots)  # q.k and p.v in the kernel body (bf16: no precision set)


def test_resolve_for_model_falls_back_where_the_gpu_kernel_cannot_run(caplog):
    caplog.set_level(logging.INFO, logger=attention.__name__)
    base = ModelConfig(**TINY)
    assert resolve_for_model("auto", "gpu", base, 16) == resolve_for_model("auto", "cuda", base, 16) == "pallas_gpu"
    assert resolve_for_model("pallas_gpu", "cpu", base, 16, interpret=True) == "pallas_gpu_interpret"
    assert resolve_for_model("auto", "cpu", base, 16) == "xla"
    window = base.replace(sliding_window=4, layer_types=("sliding_attention", "full_attention"))
    unsupported = {
        "sliding window": (window, 16),
        "attention sinks": (base.replace(attention_sinks=True), 16),
        "head_dim >= 16, the model's is 80": (base.replace(head_dim=80), 16),
        "page size, this engine's is 12": (base, 12),
    }
    for why, (cfg, page_size) in unsupported.items():
        assert resolve_for_model("auto", "gpu", cfg, page_size) == "xla"
        assert why in caplog.text
        with pytest.raises(ValueError, match=f"'pallas_gpu' cannot run this model: .*{why}"):
            resolve_for_model("pallas_gpu", "gpu", cfg, page_size)
    assert resolve_for_model("auto", "tpu", window, 12) == "pallas_tpu"  # the TPU kernel has a window
    with pytest.raises(ValueError, match="GPU kernel but the platform is 'cpu'"):
        PagedGenerator(init_model(base, seed=0), attention_impl="pallas_gpu")


@pytest.mark.slow  # the engine's programs with the kernel in interpret mode: ~30 s on 2 loaded cores
def test_paged_engine_with_the_gpu_kernel_equals_the_dense_generator(monkeypatch):
    model = init_model(ModelConfig(**TINY), seed=3)
    rng = np.random.default_rng(0)
    ids, mask = np.zeros((5, 12), np.int32), np.zeros((5, 12), np.int32)
    for i, n in enumerate([5, 9, 2, 12, 7]):
        ids[i, 12 - n :], mask[i, 12 - n :] = rng.integers(7, 96, n), 1
    dp = DataProto.from_dict({"input_ids": ids, "attention_mask": mask})
    greedy = SamplingParams(max_new_tokens=10, do_sample=False, seed=2)
    first = Generator(model, decode_chunk=4).generate(dp, greedy).batch["responses"]
    greedy = SamplingParams(max_new_tokens=10, do_sample=False, eos_token_ids=(int(first[2, 3]),), seed=2)
    dense = Generator(model, decode_chunk=4).generate(dp, greedy)  # row 2 ends by step 3, others later or never
    traced = []
    kernel = attention.paged_decode_attention_gpu
    monkeypatch.setattr(attention, "paged_decode_attention_gpu", lambda *a, **k: traced.append(1) or kernel(*a, **k))
    eng = PagedGenerator(
        model, max_num_seqs=4, max_num_batched_tokens=16, page_size=4, steps_per_dispatch=4,
        attention_impl="pallas_gpu", attention_interpret=True,
    )  # fmt: skip
    out = eng.generate(dp, greedy)
    assert eng.impl == "pallas_gpu_interpret" and traced  # the decode steps traced the kernel
    for key in ("responses", "response_attention_mask", "attention_mask"):
        np.testing.assert_array_equal(out.batch[key], dense.batch[key], err_msg=key)
    np.testing.assert_allclose(out.batch["rollout_log_probs"], dense.batch["rollout_log_probs"], atol=1e-5, rtol=0)
    assert len(set(dense.batch["response_attention_mask"].sum(1))) > 1  # rows end at different steps


def _decode_program_text(impl):
    """The engine's 4-step decode program, 2 scanned layers at Qwen2.5-7B's head layout, bf16, lowered for CUDA."""
    cfg = ModelConfig(**{**TINY, "hidden_size": 256, "num_heads": 28, "num_kv_heads": 4, "head_dim": 128})
    model = init_model(cfg, seed=0, dtype="bfloat16")
    graphdef, state = nnx.split(model)
    graphdefs, layers = forward.stack_layers(model)
    s, pps, ps = 8, 4, 16
    kv = jax.ShapeDtypeStruct((1, 2, 33, ps, 8, 128), jnp.bfloat16)  # one replica: 2 layers x 33 pages
    i32 = lambda *shape: jax.ShapeDtypeStruct((1, *shape), jnp.int32)
    args = (graphdef, state, graphdefs, layers, kv, jax.ShapeDtypeStruct((1, s, 96), jnp.float32))
    args += (i32(s),) * 5 + (jax.ShapeDtypeStruct((1, s), jnp.bool_), i32(s, pps), jax.random.key(0))
    params = SamplingParams(max_new_tokens=8, top_p=0.9, eos_token_ids=(4,))
    traced = programs.decode.trace(*args, impl=impl, params=params, steps=4)
    return traced.lower(lowering_platforms=("cuda",)).as_text()


def _pool_reads(text, op):
    """`op` ops (e.g. 'gather') of the text whose operands include the pool (`[2, 33, 16, 8, 128]` or merged)."""
    return [ln for ln in text.splitlines() if op in ln and re.search(r"tensor<(1x)?(2x33|66)x16x8x128xbf16>", ln)]


@pytest.mark.slow  # two decode programs traced and lowered: ~15 s on 2 loaded cores
def test_whole_decode_program_with_the_kernel_lowers_for_cuda_at_qwen2_7b_heads():
    text = _decode_program_text("pallas_gpu")
    calls = [ln for ln in text.splitlines() if "stablehlo.custom_call @__gpu$xla.gpu.triton" in ln]
    assert len(calls) == 1  # one kernel in the layer scan's body
    operands = re.search(r"\} : \(([^)]*)\)", calls[0]).group(1).split(", ")
    # q [8 slots, 4 kv heads, their 7 query heads padded to 16, 128], the merged pool twice (keys, values)
    assert operands[:3] == ["tensor<8x4x16x128xbf16>", "tensor<66x16x8x128xbf16>", "tensor<66x16x8x128xbf16>"]
    for op in ("gather", "transpose"):
        assert not _pool_reads(text, f"stablehlo.{op}"), op
    assert _pool_reads(_decode_program_text("xla"), "stablehlo.gather")  # the check sees the XLA path's reads
