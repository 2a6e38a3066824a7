"""Split placement on fake CPU devices (a subprocess: the device count is fixed before jax is imported): the
rollout and training meshes hold disjoint devices, the weights published from one to the other are equal bit for bit
with the bytes reported, and the model's forward on the rollout mesh equals the training mesh's within 1e-5; every
leaf published lands on all of the rollout mesh's devices and none other. The subprocesses compile with
tests/cheap_compile.py's flags (both sides of every comparison run in the same process)."""

import json
import os
import subprocess
import sys
import textwrap

import pytest

from tests.cheap_compile import CHEAP_COMPILE_FLAGS

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def _env(n_devices: int) -> dict:
    flags = f"--xla_force_host_platform_device_count={n_devices} {CHEAP_COMPILE_FLAGS}"
    return dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=flags, PYTHONPATH=REPO)


SCRIPT = textwrap.dedent(
    """
    import json
    import jax, jax.numpy as jnp, numpy as np
    from flax import nnx
    from jaxrl_post.models import ModelConfig, init_model
    from jaxrl_post.rl.async_training.placement import publish_weights, split_meshes
    from jaxrl_post.runtime.sharding import shard_params

    cfg = ModelConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                      num_kv_heads=2, head_dim=16, max_position_embeddings=64, pad_token_id=0, bos_token_id=1)
    model = init_model(cfg, seed=3)
    graphdef, state = nnx.split(model)
    rollout_mesh, train_mesh = split_meshes(jax.devices(), 4, tensor=2)
    train = shard_params(state, train_mesh)
    pub, nbytes = publish_weights(train, rollout_mesh)
    devs = lambda t: {d.id for x in jax.tree.leaves(t) for d in x.sharding.device_set}
    ids = np.random.default_rng(0).integers(2, 96, (4, 12)).astype(np.int32)
    mask = np.ones_like(ids)
    fwd = jax.jit(lambda s, i, m: nnx.merge(graphdef, s)(i, m))
    a = np.asarray(fwd(train, ids, mask))
    b = np.asarray(fwd(pub, ids, mask))
    pairs = zip(jax.tree.leaves(train), jax.tree.leaves(pub))
    equal = all(np.array_equal(np.asarray(x), np.asarray(y)) for x, y in pairs)
    print(json.dumps({
        "train_devices": sorted(devs(train)), "rollout_devices": sorted(devs(pub)), "equal": equal,
        "bytes": nbytes, "want_bytes": int(sum(np.asarray(x).nbytes for x in jax.tree.leaves(state))),
        "max_rel": float(np.max(np.abs(a - b)) / np.max(np.abs(a))),
    }))
    """
)


@pytest.mark.slow  # a subprocess with 8 fake devices (~15 s)
def test_split_meshes_publish_weights_and_forward_equal():
    env = _env(8)
    out = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert r["rollout_devices"] == [0, 1, 2, 3] and r["train_devices"] == [4, 5, 6, 7]
    assert r["equal"] and r["bytes"] == r["want_bytes"] > 0
    assert r["max_rel"] <= 1e-5


PUBLISH = textwrap.dedent(
    """
    import json
    import jax, numpy as np
    from flax import nnx
    from jaxrl_post.models import ModelConfig, init_model
    from jaxrl_post.rl.async_training.placement import publish_weights, split_meshes
    from jaxrl_post.runtime.sharding import shard_params

    cfg = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2,
                      num_kv_heads=1, head_dim=16, max_position_embeddings=32, pad_token_id=0, bos_token_id=1)
    _, state = nnx.split(init_model(cfg, seed=1))
    host = [np.asarray(x) for x in jax.tree.leaves(state)]
    rollout_mesh, train_mesh = split_meshes(jax.devices(), 2)
    train = shard_params(state, train_mesh)
    pub, nbytes = publish_weights(train, rollout_mesh)
    leaves = jax.tree.leaves(pub)
    print(json.dumps({
        "devices": [sorted(d.id for d in x.sharding.device_set) for x in leaves],
        "train": sorted({d.id for x in jax.tree.leaves(train) for d in x.sharding.device_set}),
        "equal": all(np.array_equal(h, np.asarray(x)) for h, x in zip(host, leaves, strict=True)),
        "bytes": nbytes, "want_bytes": int(sum(h.nbytes for h in host)), "n": len(host),
    }))
    """
)


def test_publish_weights_moves_every_leaf_to_the_rollout_devices():
    """4 fake devices: 0-1 the rollout mesh, 2-3 the training mesh (each fsdp 2: the kernels split over both)."""
    env = _env(4)
    out = subprocess.run([sys.executable, "-c", PUBLISH], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert r["train"] == [2, 3]
    assert r["n"] > 5 and r["devices"] == [[0, 1]] * r["n"]  # every leaf, and only on the rollout's devices
    assert r["equal"] and r["bytes"] == r["want_bytes"] > 0
