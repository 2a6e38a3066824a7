"""The paged engine sharded over a 4-device tensor mesh (issue 56 item 4; a subprocess with 4 fake CPU devices) returns
the tokens, masks and log-probs (1e-5, float32) of the same engine on one device, with n = 3 samples per prompt and
15 sequences through 4 slots; its page pool is split over kv heads (each device holds 2N / 4 combined heads of every
page) and a second call compiles nothing. A mesh with an 'fsdp' axis, or a tensor size that does not divide the kv
heads, is refused (data-parallel replicas: test_paged_dp.py)."""

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
    import json
    import jax, numpy as np
    from flax import nnx
    from jaxrl_post.batch.protocol import DataProto
    from jaxrl_post.models import ModelConfig, init_model
    from jaxrl_post.rollout import SamplingParams
    from jaxrl_post.rollout.paged import programs
    from jaxrl_post.rollout.paged.engine import PagedGenerator
    from jaxrl_post.runtime.sharding import make_mesh, shard_params

    cfg = ModelConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=8,
                      num_kv_heads=4, head_dim=8, max_position_embeddings=256, eos_token_id=None, pad_token_id=0,
                      bos_token_id=1)
    rng = np.random.default_rng(0)
    ids, mask = np.zeros((5, 12), np.int32), np.zeros((5, 12), np.int32)
    for i, n in enumerate([5, 9, 2, 12, 7]):
        ids[i, 12 - n :], mask[i, 12 - n :] = rng.integers(7, 96, n), 1
    dp = DataProto.from_dict({"input_ids": ids, "attention_mask": mask})
    sp = SamplingParams(max_new_tokens=20, temperature=1.0, top_p=0.9, eos_token_ids=(4, 5, 6), seed=2)
    eng = dict(max_num_seqs=4, max_num_batched_tokens=16, page_size=4, steps_per_dispatch=4)
    one = PagedGenerator(init_model(cfg, seed=3), **eng).generate(dp, sp, n=3)

    mesh = make_mesh(1, 1, 4, jax.devices())
    model = init_model(cfg, seed=3)
    nnx.update(model, shard_params(nnx.state(model), mesh))
    e = PagedGenerator(model, **eng, mesh=mesh)
    tp = e.generate(dp, sp, n=3)
    stats, traces = dict(e.last_stats), dict(programs.TRACE_COUNTS)
    again = e.generate(dp, sp, n=3)
    refused = []
    for bad_mesh, bad_cfg in ((make_mesh(1, 2, 2, jax.devices()), cfg), (mesh, cfg.replace(num_kv_heads=2))):
        try:
            PagedGenerator(init_model(bad_cfg, seed=3), **eng, mesh=bad_mesh)
        except ValueError as err:
            refused.append(str(err))
    b = lambda out: {k: np.asarray(v).tolist() for k, v in out.batch.items()}
    print("RESULT" + json.dumps({
        "one": b(one), "tp": b(tp), "again": b(again), "stats": stats, "traces": traces,
        "traces_after": dict(programs.TRACE_COUNTS),
        "q_kernel_spec": str(model.layers[0].attn.q_proj.kernel.sharding.spec),
        "refused": refused,
    }))
    """
)


@pytest.mark.slow  # two engines' compiles on 4 fake devices in a subprocess (~30 s on 2 cores)
def test_paged_engine_on_a_tensor_mesh_equals_one_device():
    flags = "--xla_force_host_platform_device_count=4 " + CHEAP_COMPILE_FLAGS
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=flags, PYTHONPATH=REPO)
    out = subprocess.run([sys.executable, "-c", SCRIPT], cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    r = json.loads(out.stdout.split("RESULT", 1)[1])
    import numpy as np

    one, tp = r["one"], r["tp"]
    for k in ("responses", "input_ids", "attention_mask", "response_attention_mask", "truncated"):
        assert one[k] == tp[k] == r["again"][k], k
    lens = np.asarray(one["response_attention_mask"]).sum(1)
    assert len(lens) == 15 and len(set(lens.tolist())) >= 4  # rows end at different steps
    np.testing.assert_allclose(tp["rollout_log_probs"], one["rollout_log_probs"], atol=1e-5, rtol=0)
    assert "tensor" in r["q_kernel_spec"]  # the weights are split over the mesh, not replicated
    st = r["stats"]
    assert st["pool_devices"] == 4 and st["prefill_dispatches"] >= 5
    assert st["pool_shard_shape"] == [1, 2, st["num_pages"], 4, 2 * 4 // 4, 8]  # [1 replica, L, pages, page, 2N/tp, K]
    assert r["traces_after"] == r["traces"]  # the second call compiled nothing
    assert "'data' replicas of a 'tensor'-parallel engine only" in r["refused"][0]
    assert "does not divide the model's 2 kv heads" in r["refused"][1]
