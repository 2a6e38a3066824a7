"""The split placement wired into the trainer (`rollout.n_gpus_per_node` > 0) on 2 and on 8 fake CPU devices (a
subprocess each: the device count is fixed before jax is imported). At staleness 0 (the synchronous loop, partial
rollout off) a split run's metrics equal the colocated run's within 1e-5 relative (only the devices' reduction order
differs); the actor trains on the training devices, the rollout's copy lives on the rollout devices, and each step
publishes the params' bytes."""

import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from tests.cheap_compile import CHEAP_COMPILE_FLAGS

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
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

    def run(n_rollout, workdir, lora, engine="dense"):
        c = grpo.get_config("tiny")
        c.rollout.name = engine
        if lora:
            c.model.lora_rank, c.model.lora_alpha = 4, 8.0
        c.trainer.default_local_dir = workdir
        c.trainer.val_before_train = c.trainer.val_at_end = False
        c.trainer.save_freq = -1
        c.trainer.mesh.tensor = 2 if jax.device_count() == 8 else 1  # tiny's micro-batch of 4 over <= 4 shards
        c.rollout.n_gpus_per_node = n_rollout
        t = RLTrainer(c, console_write=lambda s: None)
        try:
            hist = t.fit()["history"]
            devs = lambda tree: sorted({d.id for x in jax.tree.leaves(tree) for d in x.sharding.device_set})
            # what the rollout samples with: the params, or with LoRA the base with the adapters merged in
            params = jax.tree.leaves(t.state.actor.params if t.policy.frozen is None else t.policy.frozen)
            return {
                "hist": hist,
                "actor": devs(t.state.actor.params),
                "rollout": None if t.state.rollout is None else devs(t.state.rollout),
                "param_bytes": sum(x.size * x.dtype.itemsize for x in params),
            }
        finally:
            t.close()

    root, n, lora, engines = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "lora", sys.argv[4].split(",")
    out = {"colocated": run(0, root + "/colocated", lora), "split": [run(n, root + "/" + e, lora, e) for e in engines]}
    print("RESULT" + json.dumps(out))
    """
)


def _run(tmp_path, n_devices: int, n_rollout: int, lora: bool, engines: str) -> dict:
    # the cheap XLA:CPU code generation (tests/cheap_compile.py), as the session's other subprocesses: both sides of
    # the equality (colocated, split) run in this process under the same flags
    flags = f"--xla_force_host_platform_device_count={n_devices} {CHEAP_COMPILE_FLAGS}"
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=flags, PYTHONPATH=REPO)
    cmd = [sys.executable, "-c", SCRIPT, str(tmp_path), str(n_rollout), "lora" if lora else "full", engines]
    out = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.split("RESULT", 1)[1])


@pytest.mark.slow  # 2-3 tiny trainers in a subprocess per case (45-95 s each on 2 cores, minutes when loaded)
@pytest.mark.parametrize(
    "n_devices, n_rollout, lora, engines",
    [(2, 1, False, "dense,paged"), (8, 4, False, "dense"), (2, 1, True, "dense")],
)
def test_split_placement_at_staleness_zero_equals_colocated(tmp_path, n_devices, n_rollout, lora, engines):
    """The colocated run is dense (the paged engine runs on one device: colocated only on a 1-device run); the
    paged engine on the split's one rollout device samples what the dense one does. LoRA: the colocated rollout
    samples with the adapters, the split one with them merged into its copy."""
    r = _run(tmp_path, n_devices, n_rollout, lora, engines)
    col = r["colocated"]
    assert col["actor"] == list(range(n_devices)) and col["rollout"] is None
    assert len(r["split"]) == len(engines.split(","))
    for split, engine in zip(r["split"], engines.split(","), strict=True):
        assert split["actor"] == list(range(n_rollout, n_devices))
        assert split["rollout"] == list(range(n_rollout))
        assert len(col["hist"]) == len(split["hist"]) == 2
        for c, s in zip(col["hist"], split["hist"], strict=True):
            keys = [k for k in c if not k.startswith(_TIME)]
            new = {"async/publish_bytes", "timing_s/sync_rollout_weights", "timing_per_token_ms/sync_rollout_weights"}
            new.add("rollout/weights_bytes_per_chip")  # the rollout mesh's copy on its fullest device
            if engine == "paged":  # its pool and prefix-cache counts (docs/paged_rollout.md)
                new |= PAGED_KEYS
            assert set(s) - set(c) == new
            bad = [k for k in keys if not np.isclose(s[k], c[k], rtol=1e-5, atol=1e-7)]
            assert not bad, {k: (s[k], c[k]) for k in bad}
            assert s["async/publish_bytes"] == split["param_bytes"] > 0  # float32 params (LoRA: merged), no cast
            assert s["timing_s/sync_rollout_weights"] > 0
            # the rollout mesh is all 'fsdp': the params split over its devices (norms and indivisible dims whole)
            assert split["param_bytes"] / n_rollout <= s["rollout/weights_bytes_per_chip"] <= split["param_bytes"]
