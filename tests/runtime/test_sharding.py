"""Sharding: rules table, mesh construction, and sharded == single-device forward on 8 fake CPU devices."""

import json
import os
import subprocess
import sys
import textwrap

import jax
import pytest
from jax.sharding import PartitionSpec as P

from jaxrl_post.runtime import sharding
from tests.cheap_compile import CHEAP_COMPILE_FLAGS

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_logical_rules_and_specs():
    assert sharding.MESH_AXES == ("data", "fsdp", "expert", "tensor")
    assert sharding.logical_to_mesh_spec(("embed", "heads", "head_dim")) == P("fsdp", "tensor", None)
    assert sharding.logical_to_mesh_spec(("batch", None)) == P(("data", "fsdp", "expert"), None)
    assert sharding.logical_to_mesh_spec(("expert", "embed", "mlp")) == P("expert", "fsdp", "tensor")
    assert sharding.logical_to_mesh_spec(None) == P()
    with pytest.raises(KeyError, match="no rule"):
        sharding.logical_to_mesh_spec(("nonsense",))


def test_make_mesh_single_device_and_errors():
    mesh = sharding.make_mesh()
    assert mesh.axis_names == sharding.MESH_AXES and mesh.devices.size == jax.device_count()
    with pytest.raises(ValueError, match="needs 2 devices"):
        sharding.make_mesh(data=2, fsdp=1, tensor=1, devices=jax.devices()[:1])
    with pytest.raises(ValueError, match="at most one"):
        sharding.make_mesh(data=-1, fsdp=-1)
    with pytest.raises(ValueError, match=r"mesh data=1 x fsdp=1 x expert=2 x tensor=1 needs 2 devices"):
        sharding.make_mesh(fsdp=1, expert=2, devices=jax.devices()[:1])


def test_shard_params_and_param_shardings_single_device():
    from flax import nnx

    from jaxrl_post.models import ModelConfig, Transformer

    cfg = ModelConfig(
        vocab_size=16, hidden_size=8, intermediate_size=12, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=4
    )
    mesh = sharding.make_mesh()
    abstract = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0)))
    specs = sharding.param_shardings(nnx.state(abstract), mesh)
    assert specs["layers"][0]["mlp"]["down_proj"]["kernel"].get_value().spec == P("tensor", "fsdp")
    state = jax.tree.map(lambda x: jax.numpy.zeros(x.shape, x.dtype), nnx.state(abstract))
    placed = sharding.shard_params(state, mesh)
    assert placed["embedding"][...].sharding.spec == P("tensor", "fsdp")


_SCRIPT = textwrap.dedent(r"""
    import json, os, sys, tempfile
    import jax, jax.numpy as jnp, numpy as np
    from flax import nnx
    from jax.sharding import PartitionSpec as P
    from jaxrl_post.runtime import sharding
    from jaxrl_post.models import ModelConfig, init_model, save_pretrained, CriticModel
    from jaxrl_post.models.hf_io import load_hf_dir

    assert jax.device_count() == 8
    mesh = sharding.make_mesh(data=2, fsdp=2, tensor=2)
    cfg = ModelConfig(family="gemma2", vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=2,
                      num_heads=4, num_kv_heads=2, head_dim=8, norm_offset=1.0, embed_scale=True,
                      post_norms=True, hidden_act="gelu_pytorch_tanh", tie_word_embeddings=False,
                      sliding_window=3, layer_types=("sliding_attention", "full_attention"),
                      attn_logit_softcap=5.0, final_logit_softcap=10.0)
    out = {}
    model = init_model(cfg, seed=0, mesh=mesh)
    q = model.layers[0].attn.q_proj.kernel[...]
    out["q_spec"] = str(q.sharding.spec)
    out["q_shard_shape"] = list(q.addressable_shards[0].data.shape)
    out["emb_spec"] = str(model.embedding[...].sharding.spec)

    # single-device reference with the same values
    graphdef, state = nnx.split(model)
    single = nnx.merge(graphdef, jax.device_put(jax.device_get(state), jax.devices()[0]))
    rng = np.random.RandomState(0)
    ids = rng.randint(0, 64, (8, 10)).astype(np.int32)
    mask = np.ones((8, 10), np.int32); mask[0, :3] = 0; mask[5, :6] = 0
    fwd = jax.jit(lambda m, i, a: m(i, a))
    ref = np.asarray(fwd(single, ids, mask))
    with jax.set_mesh(mesh):
        got_arr = fwd(model, sharding.shard_batch(ids, mesh), sharding.shard_batch(mask, mesh))
    out["logits_spec"] = str(got_arr.sharding.spec)
    valid = mask.astype(bool)
    out["fwd_diff"] = float(np.abs(np.asarray(got_arr) - ref)[valid].max())
    out["scale"] = float(np.abs(ref).max())

    # KV cache on the mesh: prefill + one decode step
    def run_cache(m, cache_sh):
        cache = m.init_cache(8, 12)
        if cache_sh is not None:
            cache = jax.device_put(cache, cache_sh)
        step = jax.jit(lambda m, c, i, a: m(i, a, cache=c))
        l1, cache = step(m, cache, ids[:, :9], mask[:, :9])
        l2, cache = step(m, cache, ids[:, 9:], mask[:, 9:])
        return np.concatenate([np.asarray(l1), np.asarray(l2)], 1)
    with jax.set_mesh(mesh):
        cached = run_cache(model, sharding.cache_shardings(model.init_cache(8, 12), mesh))
    out["cache_diff"] = float(np.abs(cached - ref)[valid].max())

    # HF dir loaded straight onto the mesh
    d = tempfile.mkdtemp()
    save_pretrained(single, None, d)
    loaded = load_hf_dir(d, mesh=mesh)
    out["loaded_q_spec"] = str(loaded.layers[0].attn.q_proj.kernel[...].sharding.spec)
    with jax.set_mesh(mesh):
        out["loaded_diff"] = float(np.abs(np.asarray(fwd(loaded, ids, mask)) - ref)[valid].max())

    # LoRA adapters on the mesh: A/B sharded by their kernels' logical names; sharded == single device
    from jaxrl_post.models.lora import LoRAConfig, apply_lora, iter_projections
    apply_lora(loaded, LoRAConfig(4, 8.0), seed=1)
    for *_, lin in iter_projections(loaded):
        lin.lora_b.set_value(lin.lora_b[...] + 0.05)
    attn = loaded.layers[0].attn
    lora_vars = (attn.q_proj.lora_a, attn.q_proj.lora_b, attn.o_proj.lora_a, attn.o_proj.lora_b)
    out["lora_specs"] = [str(p[...].sharding.spec) for p in lora_vars]
    lg, ls = nnx.split(loaded)
    lref = np.asarray(fwd(nnx.merge(lg, jax.device_put(jax.device_get(ls), jax.devices()[0])), ids, mask))
    with jax.set_mesh(mesh):
        out["lora_diff"] = float(np.abs(np.asarray(fwd(loaded, ids, mask)) - lref)[valid].max())
    out["lora_effect"] = float(np.abs(lref - ref)[valid].max())

    # critic on the mesh
    critic = CriticModel.from_actor(model)
    critic.value_head[...] = jnp.ones_like(critic.value_head[...])
    with jax.set_mesh(mesh):
        v = jax.jit(lambda c, i, a: c(i, a))(critic, sharding.shard_batch(ids, mesh), sharding.shard_batch(mask, mesh))
    h = jax.jit(lambda m, i, a: m.hidden_states(i, a))(single, ids, mask)
    out["critic_diff"] = float(np.abs(np.asarray(v) - np.asarray(h).sum(-1)).max())

    # divisibility errors name param, dim and axis
    try:
        init_model(cfg.replace(num_kv_heads=1), mesh=mesh)
        out["div_error"] = None
    except ValueError as e:
        out["div_error"] = str(e)
    try:
        sharding.shard_batch(np.zeros((6, 2)), mesh)
        out["batch_error"] = None
    except ValueError as e:
        out["batch_error"] = str(e)
    print("RESULT " + json.dumps(out))
""")


@pytest.fixture(scope="module")
def fake8():
    env = dict(
        os.environ,
        XLA_FLAGS="--xla_force_host_platform_device_count=8 " + CHEAP_COMPILE_FLAGS,
        JAX_PLATFORMS="cpu",
        PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""),
    )
    proc = subprocess.run([sys.executable, "-c", _SCRIPT], env=env, capture_output=True, text=True, timeout=900)
    lines = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-4000:]
    return json.loads(lines[-1][len("RESULT ") :])


@pytest.mark.slow
def test_sharded_params_created_on_mesh(fake8):
    assert fake8["q_spec"] == str(P("fsdp", "tensor", None))
    assert fake8["q_shard_shape"] == [16, 2, 8]  # [D/fsdp, H/tensor, K]
    assert fake8["emb_spec"] == str(P("tensor", "fsdp"))
    assert fake8["loaded_q_spec"] == fake8["q_spec"]
    assert fake8["logits_spec"].startswith(str(P(("data", "fsdp")))[:-1])
    # LoRA A/B follow their kernel's logical names (q: [D, H, K] -> A [D, r], B [r, H, K]; o: [H, K, D])
    assert fake8["lora_specs"] == [
        str(P("fsdp", None)),
        str(P(None, "tensor", None)),
        str(P("tensor", None, None)),
        str(P(None, "fsdp")),
    ]


@pytest.mark.slow  # the `fake8` fixture: a subprocess on 8 fake devices (94 s on 2 shared, loaded cores)
def test_sharded_forward_matches_single_device(fake8):
    tol = 1e-5 * max(1.0, fake8["scale"])
    assert fake8["fwd_diff"] <= tol
    assert fake8["cache_diff"] <= tol
    assert fake8["loaded_diff"] <= tol
    assert fake8["critic_diff"] <= 1e-4
    assert fake8["lora_diff"] <= tol < fake8["lora_effect"]


@pytest.mark.slow  # the `fake8` fixture: a subprocess on 8 fake devices
def test_divisibility_errors_are_explicit(fake8):
    msg = fake8["div_error"]
    assert msg is not None and "layers.0.attn.k_proj.kernel" in msg and "dim 1 (size 1)" in msg and "'tensor'" in msg
    assert fake8["batch_error"] is not None and "divisible by data*fsdp*expert=4" in fake8["batch_error"]
