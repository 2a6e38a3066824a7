"""`rollout.tensor_model_parallel_size` (issue 56 item 4), on 4 fake CPU devices in a subprocess (the device count is
fixed before jax is imported): tiny GRPO trained FSDP-only (fsdp=4) with the rollout on its own layout -- colocated,
dense at tp=2 (data=2 x tensor=2: two replicas), paged at tp=4 (one engine over 'tensor'), paged at tp=2 (two
data-parallel engine replicas of 2 devices) and LoRA at dense tp=2 (the adapters merged inside the reshard program);
split, paged at tp=1 on the first 2 devices (two one-device replicas) -- gives the default run's
metrics (LoRA: the default LoRA run's) within 1e-5 relative for 2 steps (only the devices' reduction order differs).
The rollout's weights have the rollout layout (mesh and specs of `param_shardings` there, bytes per chip as reported
and as counted by hand), the colocated copy is written by one jitted program (compiled once over the steps, its
outputs on the rollout mesh) while the actor keeps the training layout; the paged pools are split over kv heads,
one per replica."""

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
# what a paged rollout adds to a step's metrics (single-turn, prefix caching on by default)
PAGED_KEYS = {
    "rollout/num_preemptions",
    "rollout/prefix_cache_queries",
    "rollout/prefix_cache_hits",
    "rollout/prefix_cache_hit_rate",
}

SCRIPT = textwrap.dedent(
    """
    import json, sys
    import jax
    from configs import grpo
    from jaxrl_post.rl.trainer import RLTrainer
    from jaxrl_post.runtime.sharding import param_shardings

    def run(tp, engine, workdir, split=0, lora=False):
        c = grpo.get_config("tiny")
        c.model.arch.num_kv_heads = 4  # tp=4 splits the kv heads too
        c.rollout.name = engine
        c.rollout.tensor_model_parallel_size = tp
        c.rollout.n_gpus_per_node = split
        if lora:  # the rollout copy holds the merged kernels, merged inside the reshard program
            c.model.lora_rank, c.model.lora_alpha = 4, 8.0
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
                    compiles=None if split else [r._cast_first._cache_size(), r._cast_donating._cache_size()],
                    engine_mesh=str(dict(r.layout_mesh.shape)),
                )
                if engine == "paged":
                    st = r.generator.last_stats
                    out.update(pool=[st["pool_shard_shape"], st["pool_devices"]], replicas=st["replicas"])
            return out
        finally:
            t.close()

    root = sys.argv[1]
    out = {"default": run(None, "dense", root + "/d"), "dense2": run(2, "dense", root + "/t2"),
           "paged4": run(4, "paged", root + "/p4"), "paged2": run(2, "paged", root + "/p2"),
           "split_paged1": run(1, "paged", root + "/s1", split=2),
           "lora_default": run(None, "dense", root + "/ld", lora=True),
           "lora_dense2": run(2, "dense", root + "/l2", lora=True)}
    print("RESULT" + json.dumps(out))
    """
)


@pytest.mark.slow  # seven tiny trainers on 4 fake devices in a subprocess (~250 s on 2 loaded cores)
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
    split_keys = {"async/publish_bytes", "timing_s/sync_rollout_weights", "timing_per_token_ms/sync_rollout_weights"}
    runs = (("dense2", 2, 4), ("paged4", 4, 4), ("paged2", 2, 4), ("split_paged1", 1, 2), ("lora_dense2", 2, 4))
    for name, tp, devices in runs:
        run, base = r[name], r["lora_default" if name.startswith("lora") else "default"]
        layout = [str({"data": devices // tp, "fsdp": 1, "expert": 1, "tensor": tp})]
        split = name.startswith("split")
        assert run["actor_mesh"] == ([str({"data": 1, "fsdp": 2, "expert": 1, "tensor": 1})] if split else fsdp4)
        assert run["rollout_mesh"] == layout and run["engine_mesh"] == layout[0]
        assert run["same_specs"] and run["sharded_leaves"] > 0
        # by hand: every float32 kernel split tp ways, the 5 RMSNorm scales [64] (2 per layer + the final) whole
        norms = 5 * 64 * 4
        assert run["total_bytes"] == 361_728 and run["bytes_per_chip"] == (run["total_bytes"] - norms) // tp + norms
        # one program for the first copy, one (donating) for every later sync
        assert run["compiles"] == (None if split else [1, 1])
        assert len(run["hist"]) == 2
        for c, s in zip(base["hist"], run["hist"], strict=True):
            paged = PAGED_KEYS if "paged" in name else set()  # the engine's pool and prefix-cache counts
            assert set(s) - set(c) == {"rollout/weights_bytes_per_chip"} | (split_keys if split else set()) | paged
            assert s["rollout/weights_bytes_per_chip"] == run["bytes_per_chip"]
            assert run["bytes_per_chip"] < run["total_bytes"] or tp == 1
            keys = [k for k in c if not k.startswith(_TIME)]
            bad = [k for k in keys if not np.isclose(s[k], c[k], rtol=1e-5, atol=1e-7)]
            assert not bad, (name, {k: (s[k], c[k]) for k in bad})
    # the paged engine's pools: [1 replica, L, pages, page, 2N / tp, K] on each device, one replica per data index
    for name, tp, devices in (("paged4", 4, 4), ("paged2", 2, 4), ("split_paged1", 1, 2)):
        shape, on = r[name]["pool"]
        assert on == devices and shape[0] == 1 and shape[4] == 2 * 4 // tp, name
        assert r[name]["replicas"] == devices // tp
