"""`rollout.tensor_model_parallel_size` colocated (issue 56 item 4), on 4 fake CPU devices in a subprocess (the device
count is fixed before jax is imported): tiny GRPO trained FSDP-only (fsdp=4) with the rollout on its own layout,
dense at tp=2 (fsdp=2 x tensor=2) and paged at tp=4 (one engine over 'tensor'), gives the default run's metrics
within 1e-5 relative for 2 steps (only the devices' reduction order differs); the rollout's weights have the
rollout layout (mesh and specs of `param_shardings` there, bytes per chip as reported), the copy is written by one
jitted program per role (compiled once over the steps, its outputs on the rollout mesh) while the actor keeps the
training layout."""

import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from tests.cheap_compile import CHEAP_COMPILE_FLAGS

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_TIME = ("timing_s/", "timing_per_token_ms/", "perf/time_per_step", "perf/throughput", "perf/mfu/")

SCRIPT = textwrap.dedent(
    """
    import json, sys
    import jax
    from configs import grpo
    from jaxrl_post.rl.trainer import RLTrainer
    from jaxrl_post.runtime.sharding import param_shardings

    def run(tp, engine, workdir):
        c = grpo.get_config("tiny")
        c.model.arch.num_kv_heads = 4  # tp=4 splits the kv heads too
        c.rollout.name = engine
        c.rollout.tensor_model_parallel_size = tp
        c.trainer.default_local_dir = workdir
        c.trainer.val_before_train = c.trainer.val_at_end = False
        c.trainer.save_freq = -1
        t = RLTrainer(c, console_write=lambda s: None)
        try:
            hist = t.fit()["history"]
            r = t.rollout
            mesh_of = lambda tree: sorted({str(dict(x.sharding.mesh.shape)) for x in jax.tree.leaves(tree)})
            out = {"hist": hist, "actor_mesh": mesh_of(t.state.actor.params)}
            if tp is not None:
                want = jax.tree.leaves(param_shardings(t.state.rollout, r.layout_mesh))
                got = jax.tree.leaves(t.state.rollout)
                held = {}
                for x in got:
                    for s in x.addressable_shards:
                        held[s.device.id] = held.get(s.device.id, 0) + s.data.nbytes
                out.update(
                    rollout_mesh=mesh_of(t.state.rollout),
                    same_specs=all(x.sharding.spec == w.spec for x, w in zip(got, want, strict=True)),
                    sharded_leaves=sum(any(a is not None for a in x.sharding.spec) for x in got),
                    bytes_per_chip=max(held.values()),
                    total_bytes=sum(x.nbytes for x in got),
                    compiles=[r._cast_first._cache_size(), r._cast_donating._cache_size()],
                    engine_mesh=str(dict(r.layout_mesh.shape)),
                )
                if engine == "paged":
                    out["pool"] = [r.generator.last_stats["pool_shard_shape"], r.generator.last_stats["pool_devices"]]
            return out
        finally:
            t.close()

    root = sys.argv[1]
    out = {"default": run(None, "dense", root + "/d"), "dense2": run(2, "dense", root + "/t2"),
           "paged4": run(4, "paged", root + "/p4")}
    print("RESULT" + json.dumps(out))
    """
)


@pytest.mark.slow  # three tiny trainers on 4 fake devices in a subprocess (~100 s on 2 loaded cores)
def test_rollout_tp_colocated_equals_the_training_layout(tmp_path):
    flags = "--xla_force_host_platform_device_count=4 " + CHEAP_COMPILE_FLAGS
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=flags, PYTHONPATH=REPO)
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(tmp_path)], cwd=REPO, env=env, capture_output=True, text=True, timeout=900
    )
    assert out.returncode == 0, out.stderr[-3000:]
    r = json.loads(out.stdout.split("RESULT", 1)[1])
    fsdp4 = [str({"data": 1, "fsdp": 4, "expert": 1, "tensor": 1})]
    base = r["default"]
    assert base["actor_mesh"] == fsdp4 and len(base["hist"]) == 2
    for name, tp in (("dense2", 2), ("paged4", 4)):
        run = r[name]
        layout = [str({"data": 1, "fsdp": 4 // tp, "expert": 1, "tensor": tp})]
        assert run["actor_mesh"] == fsdp4  # training keeps its layout
        assert run["rollout_mesh"] == layout and run["engine_mesh"] == layout[0]
        assert run["same_specs"] and run["sharded_leaves"] > 0
        assert run["compiles"] == [1, 1]  # one program for the first copy, one (donating) for every later sync
        assert len(run["hist"]) == 2
        for c, s in zip(base["hist"], run["hist"], strict=True):
            assert set(s) - set(c) == {"rollout/weights_bytes_per_chip"}
            assert s["rollout/weights_bytes_per_chip"] == run["bytes_per_chip"] < run["total_bytes"]
            keys = [k for k in c if not k.startswith(_TIME)]
            bad = [k for k in keys if not np.isclose(s[k], c[k], rtol=1e-5, atol=1e-7)]
            assert not bad, (name, {k: (s[k], c[k]) for k in bad})
    # the paged engine's pool: [L, pages, page, 2N / 4, K] on each of the 4 devices
    shape, devices = r["paged4"]["pool"]
    assert devices == 4 and shape[3] == 2 * 4 // 4
