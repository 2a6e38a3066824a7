"""Data-parallel replicas of the paged engine (issue 56; a subprocess with 4 fake CPU devices): on meshes data 2 x
tensor 2 and data 4 x tensor 1 the engine returns the tokens, masks and log-probs (1e-5, float32) of the same engine
on one device, with n = 3 samples per prompt and 24 sequences through 3 slots per replica (fewer slots than
sequences on every mesh); with a pool so small that sequences are preempted on the replicas too. Each device holds
its replica's pool (`[1, L, pages, page, 2N / tp, K]`), prompts are spread over the replicas by count (every
replica gets work), the compiled decode program has no collective across replicas (none at all at tensor 1; at
tensor 2 only within each replica's 2 devices), and a second call compiles nothing."""

import json
import os
import re
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from jaxrl_post.rollout.paged.replicas import assign_groups
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
    lens = [5, 9, 2, 12, 7, 3, 11, 6]
    ids, mask = np.zeros((8, 12), np.int32), np.zeros((8, 12), np.int32)
    for i, n in enumerate(lens):
        ids[i, 12 - n :], mask[i, 12 - n :] = rng.integers(7, 96, n), 1
    dp = DataProto.from_dict({"input_ids": ids, "attention_mask": mask})
    sp = SamplingParams(max_new_tokens=20, temperature=1.0, top_p=0.9, eos_token_ids=(4, 5, 6), seed=2)
    eng = dict(max_num_seqs=3, max_num_batched_tokens=16, page_size=4, steps_per_dispatch=4)
    b = lambda out: {k: np.asarray(v).tolist() for k, v in out.batch.items()}
    res = {"one": b(PagedGenerator(init_model(cfg, seed=3), **eng).generate(dp, sp, n=3))}

    hlo = []
    real_decode = programs.decode

    def recording(*args, **kw):  # the compiled decode program's text, from the arguments' shapes and shardings
        if not hlo:
            sds = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
            spec = lambda x: sds(x) if isinstance(x, jax.Array) else x
            hlo.append(real_decode.lower(*jax.tree.map(spec, args), **kw).compile().as_text())
        return real_decode(*args, **kw)

    programs.decode = recording
    for name, (data, tp) in {"d2t2": (2, 2), "d4t1": (4, 1)}.items():
        mesh = make_mesh(data, 1, tp, jax.devices())
        model = init_model(cfg, seed=3)
        nnx.update(model, shard_params(nnx.state(model), mesh))
        e = PagedGenerator(model, **eng, mesh=mesh)
        hlo.clear()
        out = e.generate(dp, sp, n=3)
        stats, traces = dict(e.last_stats), dict(programs.TRACE_COUNTS)
        again = e.generate(dp, sp, n=3)
        traces_again = dict(programs.TRACE_COUNTS)
        small = PagedGenerator(model, **eng, mesh=mesh, num_pages=12)  # 11 pages: ~1.4 longest sequences a replica
        tight = small.generate(dp, sp, n=3)
        fixed = PagedGenerator(model, **eng, mesh=mesh, replica_queue="static")  # prompts placed up front
        static = fixed.generate(dp, sp, n=3)
        res[name] = {"out": b(out), "again": b(again), "tight": b(tight), "static": b(static), "stats": stats,
                     "traces": traces, "traces_again": traces_again, "small_stats": dict(small.last_stats),
                     "static_stats": dict(fixed.last_stats), "hlo": hlo[0]}
    print("RESULT" + json.dumps(res))
    """
)


def _collective_groups(hlo: str) -> list[list[list[int]]]:
    """replica_groups of every collective (all-reduce, all-gather, reduce-scatter, all-to-all, collective-permute)
    in a compiled program's text."""
    out = []
    for line in hlo.splitlines():
        if re.search(r"\b(all-reduce|all-gather|reduce-scatter|all-to-all|collective-permute)(-start)?\(", line):
            m = re.search(r"replica_groups=\{(\{[^=]*?\})\}", line)
            groups = re.findall(r"\{([\d,]+)\}", m.group(1)) if m else ["?"]
            out.append([[int(x) for x in g.split(",")] if g != "?" else [-1] for g in groups])
    return out


@pytest.mark.slow  # five engines' compiles on 4 fake devices in a subprocess (~60 s on 2 cores)
def test_paged_engine_replicas_equal_one_device():
    flags = "--xla_force_host_platform_device_count=4 " + CHEAP_COMPILE_FLAGS
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=flags, PYTHONPATH=REPO)
    out = subprocess.run([sys.executable, "-c", SCRIPT], cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    r = json.loads(out.stdout.split("RESULT", 1)[1])
    one = r["one"]
    lens = np.asarray(one["response_attention_mask"]).sum(1)
    assert len(lens) == 24 and len(set(lens.tolist())) >= 4  # rows end at different steps
    for name, data, tp in (("d2t2", 2, 2), ("d4t1", 4, 1)):
        run = r[name]
        for got in (run["out"], run["again"], run["tight"], run["static"]):
            for k in ("responses", "input_ids", "attention_mask", "response_attention_mask", "truncated"):
                assert got[k] == one[k], (name, k)
            np.testing.assert_allclose(got["rollout_log_probs"], one["rollout_log_probs"], atol=1e-5, rtol=0)
        st = run["stats"]
        assert st["replicas"] == data and st["pool_devices"] == 4
        assert st["pool_shard_shape"] == [1, 2, st["num_pages"], 4, 2 * 4 // tp, 8]  # [1, L, pages, page, 2N/tp, K]
        fixed = run["static_stats"]
        assert fixed["replica_sequences"] == [24 // data] * data  # static: 8 prompts x 3 spread by count
        for s in (st, fixed, run["small_stats"]):  # every sequence finished somewhere; slot-steps add up
            assert sum(s["replica_sequences"]) == 24 and min(s["replica_sequences"]) > 0
            assert sum(s["replica_busy_slot_steps"]) == s["decode_slot_steps"]
            busy_idle = np.add(s["replica_busy_slot_steps"], s["replica_idle_slot_steps"])
            assert busy_idle.tolist() == [s["decode_dispatches"] * 4 * 3] * data  # K 4 x 3 slots per dispatch
        assert st["decode_dispatches"] <= fixed["decode_dispatches"]  # strictly fewer: test_paged_admission.py
        assert run["small_stats"]["preemptions"] > 0  # a replica ran short of pages and recomputed
        assert run["traces"] == run["traces_again"]  # the second call compiled nothing
        groups = _collective_groups(run["hlo"])
        if tp == 1:
            assert groups == [], name  # every replica on its own device: nothing crosses devices
        else:
            assert groups, name  # the heads' all-reduce within a replica
            replica_of = {dev: dev // tp for dev in range(4)}  # make_mesh's device order: data-major
            for gs in groups:
                for g in gs:
                    assert len({replica_of.get(d, -1) for d in g}) == 1, (name, gs)


def test_prompts_are_spread_by_count_then_tokens():
    assert assign_groups([30, 10, 10, 10, 5], 2) == [0, 1, 1, 0, 1]  # counts 3/2; ties to fewer tokens
    assert assign_groups([4, 4, 4], 4) == [0, 1, 2]
    assert assign_groups([7], 1) == [0]
