"""Weights across processes (`rl/async_training/transfer.py`, issue 57 item 6): a training process (4 fake CPU
devices, params FSDP-sharded over them) publishes two policy versions through `jax.experimental.transfer`; a separate
rollout process (2 fake CPU devices, a tensor = 2 mesh; no `jax.distributed` between the two) pulls each into its own
mesh. Every leaf arrives bit for bit (version 2 = version 1 x 2, computed on each side independently), in the
rollout's layout (split over 'tensor' by the logical names), and the bytes offered are the params' bytes. A rollout
mesh larger than the training process's devices is refused before anything is offered."""

import json
import os
import subprocess
import sys
import textwrap

import pytest

from tests.cheap_compile import CHEAP_COMPILE_FLAGS

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

COMMON = """
import json, os, sys, time
import jax, numpy as np
from flax import nnx
from jaxrl_post.models import ModelConfig, init_model
from jaxrl_post.rl.async_training.transfer import WeightPublisher, WeightSubscriber
from jaxrl_post.runtime.sharding import make_mesh, shard_params

cfg = ModelConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=8, num_kv_heads=4,
                  head_dim=8, max_position_embeddings=256, eos_token_id=None, pad_token_id=0, bos_token_id=1)
root = sys.argv[1]

def wait_for(name):
    for _ in range(1200):
        if os.path.exists(os.path.join(root, name)):
            return open(os.path.join(root, name)).read()
        time.sleep(0.1)
    raise TimeoutError(name)

def touch(name, text=""):
    with open(os.path.join(root, name + ".tmp"), "w") as f:
        f.write(text)
    os.replace(os.path.join(root, name + ".tmp"), os.path.join(root, name))
"""

TRAINER = COMMON + textwrap.dedent(
    """
    params = shard_params(nnx.state(init_model(cfg, seed=3)), make_mesh(1, 4, 1, jax.devices()))
    try:
        WeightPublisher({"tensor": 8})
    except ValueError as e:
        refused = str(e)
    pub = WeightPublisher({"data": 1, "fsdp": 1, "expert": 1, "tensor": 2})
    touch("address", pub.address)
    sent = [pub.publish(1, params)]
    wait_for("pulled_1")
    sent.append(pub.publish(2, jax.tree.map(lambda x: x * 2, params)))
    wait_for("pulled_2")
    print("RESULT" + json.dumps({"sent": sent, "refused": refused, "devices": jax.device_count(),
                                 "staging": [d.id for d in pub.mesh.devices.flat]}))
    """
)

ROLLOUT = COMMON + textwrap.dedent(
    """
    want = nnx.state(init_model(cfg, seed=3))
    mesh = make_mesh(1, 1, 2, jax.devices())
    sub = WeightSubscriber(wait_for("address"), like=want, mesh=mesh)
    out = {"devices": jax.device_count()}
    for version, scale in ((1, 1), (2, 2)):
        got = sub.pull(version)
        pairs = list(zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True))
        out[f"equal_{version}"] = all(np.array_equal(np.asarray(g), np.asarray(w) * scale) for g, w in pairs)
        out[f"on_mesh_{version}"] = all(g.sharding.mesh == mesh for g, _ in pairs)
        touch(f"pulled_{version}")
    q = got["layers"][0]["attn"]["q_proj"]["kernel"].value
    out["q_spec"] = str(q.sharding.spec)
    out["q_shard_shape"] = list(q.addressable_shards[0].data.shape)
    out["q_shape"] = list(q.shape)
    out["param_bytes"] = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(want))
    print("RESULT" + json.dumps(out))
    """
)


def _start(script: str, root: str, n_devices: int) -> subprocess.Popen:
    flags = f"--xla_force_host_platform_device_count={n_devices} {CHEAP_COMPILE_FLAGS}"
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=flags, PYTHONPATH=REPO)
    return subprocess.Popen(
        [sys.executable, "-c", script, root],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _result(p: subprocess.Popen) -> dict:
    out, err = p.communicate(timeout=150)  # a layout mismatch hangs the pull: fail, not hang
    assert p.returncode == 0, err[-3000:]
    return json.loads(out.split("RESULT", 1)[1])


@pytest.mark.slow  # two processes (~15 s on 2 cores)
def test_weights_cross_from_a_training_process_to_a_rollout_process(tmp_path):
    trainer, rollout = _start(TRAINER, str(tmp_path), 4), _start(ROLLOUT, str(tmp_path), 2)
    try:
        r, t = _result(rollout), _result(trainer)
    finally:
        for p in (trainer, rollout):
            p.kill()
    assert (t["devices"], r["devices"]) == (4, 2)
    assert r["equal_1"] and r["equal_2"] and r["on_mesh_1"] and r["on_mesh_2"]
    # q_proj [embed, heads, head_dim]: 'heads' over tensor = 2 on the rollout mesh (fsdp 1): each device half the heads
    assert r["q_spec"] == "P('fsdp', 'tensor', None)"
    e, h, d = r["q_shape"]
    assert r["q_shard_shape"] == [e, h // 2, d]
    assert t["sent"] == [r["param_bytes"]] * 2  # float32 params, nothing cast or dropped
    assert t["staging"] == [0, 1]  # staged on the training process's first 2 devices
    assert "needs 8 devices to stage on, have 4" in t["refused"]
