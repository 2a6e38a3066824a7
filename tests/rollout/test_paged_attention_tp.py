"""The Pallas TPU paged attention under rollout tensor parallelism (issue 56): `paged_attention(impl='pallas_tpu')`
on a 4-device 'tensor' mesh runs the kernel in a `shard_map`, each device on its query heads and its kv heads' slice
of the page pool. A subprocess with 4 fake CPU devices checks:

- numerics: the kernel cannot run on this CPU (it has no interpret mode here: jax's TPU interpret mode fails on the
  kernel's ref reshape, `'ReshapeTransform' object has no attribute 'indices'`), so each device's call goes to the
  kernel package's own reference `ref_ragged_paged_attention` through a host callback; the sharded result equals
  the one-device XLA path (float32, 1e-5) with GQA, a layer offset, a sliding window and a soft-cap, and each device
  saw `[T, H / 4, K]` queries and `[L * P, page, 2N / 4, K]` pages;
- the sharded attention lowers for TPU at Qwen2.5-7B's head layout (28 query heads, 4 kv heads, K 128, bf16) with
  tp 4: the kernel's custom call inside a manual computation on 7 query heads and 2 combined kv heads per device;
- the engine's whole K-step decode program, its params and pool split over the mesh, lowers for TPU with the
  kernel per device (the engine no longer falls back to the XLA path or raises under tp > 1), also with
  data-parallel replicas (data 2 x tensor 2, data 4 x tensor 1);
- the Pallas GPU kernel ('pallas_gpu', Pallas interpret mode here) in the same `shard_map`: a decode step equals the
  one-device XLA path, and the decode program with it lowers for CUDA at tp 4, each device's kernel on its slice.
The TPU device kind is stubbed for the Mosaic lowering as in tests/rollout/test_paged_attention.py."""

import json
import os
import subprocess
import sys
import textwrap

import pytest

from tests.cheap_compile import CHEAP_COMPILE_FLAGS

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SCRIPT = textwrap.dedent(
    """
    import json, re
    import jax, jax.numpy as jnp, numpy as np
    from flax import nnx
    from jax._src.pallas.mosaic import tpu_info
    from jax.experimental.pallas.ops.tpu import ragged_paged_attention as rpa
    from jax.sharding import NamedSharding, PartitionSpec as P
    from jaxrl_post.models import ModelConfig, init_model
    from jaxrl_post.rollout import SamplingParams
    from jaxrl_post.rollout.paged import forward, programs
    from jaxrl_post.rollout.paged.attention import paged_attention
    from jaxrl_post.rollout.paged.kv_pool import pool_sharding
    from jaxrl_post.runtime.sharding import make_mesh, shard_params

    mesh = make_mesh(1, 1, 4, jax.devices())
    seen = []

    def reference_kernel(q, kv, lens, tables, cu, num, *, num_kv_pages_per_block, num_queries_per_block,
                         vmem_limit_bytes, **kw):
        seen.append([list(q.shape), list(kv.shape)])

        def host(q, kv, lens, tables, cu, num):  # the reference returns the real queries only: zero padding
            out = np.asarray(rpa.ref_ragged_paged_attention(q, kv, lens, tables, cu, num, **kw))
            return np.concatenate([out, np.zeros((q.shape[0] - out.shape[0], *out.shape[1:]), out.dtype)])

        return jax.pure_callback(host, jax.ShapeDtypeStruct(q.shape, q.dtype), q, kv, lens, tables, cu, num)

    rng = np.random.default_rng(1)
    kv = jnp.asarray(rng.standard_normal((3, 12, 4, 8, 8)), jnp.float32)  # 3 layers, 12 pages of 4, N 4, K 8
    tables = jnp.asarray([[3, 5, 7], [2, 4, 0], [11, 0, 0], [0, 0, 0]], jnp.int32)  # the 4th slot idle
    lens, cu = jnp.asarray([10, 6, 3, 0], jnp.int32), jnp.asarray([0, 4, 5, 6, 6], jnp.int32)
    q = jnp.asarray(rng.standard_normal((8, 8, 8)), jnp.float32)  # 6 real queries + 2 padding, H 8 (2 per kv head)
    num = jnp.array([3], jnp.int32)
    kv_split = jax.device_put(kv, NamedSharding(mesh, P(None, None, None, "tensor")))
    errors = []
    for window, softcap in ((None, None), (3, 30.0)):
        def run(impl, q, kv):
            return paged_attention(q, kv, lens, tables, cu, num, sm_scale=0.35, sliding_window=window,
                                   soft_cap=softcap, impl=impl, layer=jnp.int32(2))
        want = np.asarray(jax.jit(run, static_argnums=0)("xla", q, kv))
        real, rpa.ragged_paged_attention = rpa.ragged_paged_attention, reference_kernel
        with jax.set_mesh(mesh):
            got = np.asarray(jax.jit(run, static_argnums=0)("pallas_tpu", q, kv_split))
        rpa.ragged_paged_attention = real
        errors.append(float(np.abs(got[:6] - want[:6]).max()))

    # the GPU kernel in interpret mode, one decode query per sequence, its heads and pool slice per device
    def decode_run(impl, q, kv):
        return paged_attention(q, kv, lens, tables, jnp.arange(5, dtype=jnp.int32), num, sm_scale=0.35,
                               soft_cap=30.0, impl=impl, layer=jnp.int32(2), decode=True)
    want = np.asarray(jax.jit(decode_run, static_argnums=0)("xla", q[:4], kv))
    with jax.set_mesh(mesh):
        got = np.asarray(jax.jit(decode_run, static_argnums=0)("pallas_gpu_interpret", q[:4], kv_split))
    gpu_error = float(np.abs(got - want).max())

    tpu_info.get_device_kind = lambda: "TPU v5p"
    tpu_info.get_num_device_cores = lambda: 1
    s, pps, ps = 64, 64, 16
    args = (
        jax.ShapeDtypeStruct((s, 28, 128), jnp.bfloat16),
        jax.ShapeDtypeStruct((28, 512, ps, 8, 128), jnp.bfloat16),
        jax.ShapeDtypeStruct((s,), jnp.int32),
        jax.ShapeDtypeStruct((s, pps), jnp.int32),
        jax.ShapeDtypeStruct((s + 1,), jnp.int32),
        jax.ShapeDtypeStruct((1,), jnp.int32),
    )
    step = lambda q, kv, *a: paged_attention(q, kv, *a, sm_scale=128**-0.5, impl="pallas_tpu", layer=jnp.int32(5))
    with jax.set_mesh(mesh):
        attn = jax.jit(step).trace(*args).lower(lowering_platforms=("tpu",)).as_text()

    cfg = ModelConfig(vocab_size=96, hidden_size=256, intermediate_size=128, num_layers=2, num_heads=8,
                      num_kv_heads=4, head_dim=128, max_position_embeddings=256)
    params = SamplingParams(max_new_tokens=8, top_p=0.9, eos_token_ids=(4,))

    def decode_hlo(data, tp, impl="pallas_tpu", platform="tpu"):  # the engine's decode program of `data` replicas
        m = make_mesh(data, 1, tp, jax.devices())
        model = init_model(cfg, seed=0, dtype="bfloat16")
        nnx.update(model, shard_params(nnx.state(model), m))
        graphdef, state = nnx.split(model)
        graphdefs, layers = forward.stack_layers(model)
        s, pps = 8, 4
        rep = lambda *shape: NamedSharding(m, P("data", *(None,) * (len(shape) - 1)))
        sds = lambda shape, dt: jax.ShapeDtypeStruct(shape, dt, sharding=rep(*shape))
        pool = jax.ShapeDtypeStruct((data, 2, 33, ps, 8, 128), jnp.bfloat16, sharding=pool_sharding(m, replicas=True))
        args = (graphdef, state, graphdefs, layers, pool, sds((data, s, 96), jnp.float32))
        args += tuple(sds((data, s), jnp.int32) for _ in range(5)) + (sds((data, s), jnp.bool_),)
        args += (sds((data, s, pps), jnp.int32), jax.random.key(0))
        with jax.set_mesh(m):
            prog = programs.decode.trace(*args, impl=impl, params=params, steps=4)
            return prog.lower(lowering_platforms=(platform,)).as_text()

    prog, prog_d2t2, prog_d4t1 = decode_hlo(1, 4), decode_hlo(2, 2), decode_hlo(4, 1)
    gpu = [ln for ln in decode_hlo(1, 4, "pallas_gpu", "cuda").splitlines() if "@__gpu$xla.gpu.triton" in ln]

    print("RESULT" + json.dumps({
        "errors": errors, "seen": seen, "gpu_error": gpu_error,
        "gpu_prog": {"calls": len(gpu), "local_pool": bool(gpu) and "tensor<66x16x2x128xbf16>" in gpu[0]},
        "attn": {"kernel": "ragged_paged_attention" in attn, "manual": "manual_computation" in attn,
                 "local_q": "tensor<64x7x128xbf16>" in attn, "local_pool": "tensor<14336x16x2x128xbf16>" in attn},
        "prog": {"kernel": "ragged_paged_attention" in prog, "manual": "manual_computation" in prog,
                 "local_pool": "tensor<66x16x2x128xbf16>" in prog},
        "prog_d2t2": {"kernel": "ragged_paged_attention" in prog_d2t2, "local_pool": "tensor<66x16x4x128xbf16>" in
                      prog_d2t2},
        "prog_d4t1": {"kernel": "ragged_paged_attention" in prog_d4t1, "local_pool": "tensor<66x16x8x128xbf16>" in
                      prog_d4t1},
    }))
    """
)


@pytest.fixture(scope="module")
def tp_run():
    flags = "--xla_force_host_platform_device_count=4 " + CHEAP_COMPILE_FLAGS
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=flags, PYTHONPATH=REPO)
    out = subprocess.run([sys.executable, "-c", SCRIPT], cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.split("RESULT", 1)[1])


@pytest.mark.slow  # one subprocess for the three checks: 4 fake devices, 2 TPU lowerings (~20-40 s on 2 cores)
def test_sharded_kernel_equals_the_xla_path_under_the_kernels_reference(tp_run):
    assert max(tp_run["errors"]) < 1e-5, tp_run["errors"]
    # per device: 8 queries of 8 / 4 heads; the 3 layers' 12 pages as one pool, 2 * 4 / 4 combined heads
    assert tp_run["seen"] and all(s == [[8, 2, 8], [36, 4, 2, 8]] for s in tp_run["seen"]), tp_run["seen"]


@pytest.mark.slow
def test_sharded_gpu_kernel_equals_the_xla_path_and_lowers_for_cuda(tp_run):
    """The Pallas GPU kernel (interpret mode) in the same shard_map: one decode query per sequence, float32, a
    soft-cap, a layer offset: equals the one-device XLA path; the engine's decode program with it lowers for CUDA
    on tp 4 with one Triton call per layer-scan body on each device's 2 combined kv heads of the merged pool."""
    assert tp_run["gpu_error"] < 1e-5, tp_run["gpu_error"]
    assert tp_run["gpu_prog"]["calls"] == 1 and tp_run["gpu_prog"]["local_pool"], tp_run["gpu_prog"]


@pytest.mark.slow
def test_sharded_kernel_lowers_for_tpu_at_qwen2_7b_heads_with_tp_4(tp_run):
    assert tp_run["attn"] == {"kernel": True, "manual": True, "local_q": True, "local_pool": True}


@pytest.mark.slow
def test_whole_sharded_decode_program_lowers_for_tpu_with_the_kernel(tp_run):
    assert tp_run["prog"] == {"kernel": True, "manual": True, "local_pool": True}
    # data-parallel replicas (rollout/paged/replicas.py): 2 x tensor 2 (the kernel's shard_map over 'tensor' nested
    # in the replicas' over 'data': each device's kernel sees its replica's 2 layers x 33 pages, 4 combined heads),
    # and 4 x tensor 1 (each replica a one-device body: the whole pool of its replica, 8 combined heads)
    assert tp_run["prog_d2t2"] == {"kernel": True, "local_pool": True}
    assert tp_run["prog_d4t1"] == {"kernel": True, "local_pool": True}
