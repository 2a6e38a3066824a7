"""GPT-OSS's experts (router bias, fused interleaved gate/up with biases, clamped SwiGLU) beyond the one-device
ragged_dot path: a capacity factor and the megablox kernel (Pallas interpret mode) on one device against numpy, and
the expert-parallel dispatch (`models/moe_ep.py`) on 8 fake CPU devices (expert 4 x tensor 2: the fused `[E, D, 2F]`
and its biases split over 'tensor') against one device, in the same subprocess pattern as test_moe_ep.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tests.cheap_compile import CHEAP_COMPILE_FLAGS
from tests.models.test_gpt_oss import _tiny
from tests.models.test_grouped_matmul import _set_impl
from tests.models.test_moe import _random_model
from tests.models.test_moe_families import _keep_reference

LIMIT = 1.0  # the clamp bites on the 0.3-scale weights (|gate|, |up| up to ~3)


def _numpy_layer(layer, x, mask, cf):
    """GPT-OSS's MoE layer in float64 numpy (HF `GptOssMLP`): router logits + bias, softmax, top-k renormalized,
    the capacity factor's drops (`_keep_reference`), per kept assignment `(clip(up) + 1) * g * sigmoid(1.702 g)`
    with g = min(gate, limit) from the interleaved `x @ gate_up + b`, then `@ down + b`. Returns (y, top-k)."""
    p = {n: np.asarray(getattr(layer, n)[...], np.float64) for n in layer.expert_params()}
    b, t, d = x.shape
    xf = x.reshape(b * t, d).astype(np.float64)
    logits = xf @ np.asarray(layer.router[...], np.float64) + np.asarray(layer.router_bias[...], np.float64)
    prob = np.exp(logits - logits.max(-1, keepdims=True))
    prob /= prob.sum(-1, keepdims=True)
    k, e_num = layer.top_k, layer.num_experts
    top = np.argsort(-prob, axis=-1, kind="stable")[:, :k]
    w = np.take_along_axis(prob, top, -1)
    w /= w.sum(-1, keepdims=True)
    keep = np.ones_like(top, bool) if cf is None else _keep_reference(top.reshape(b, t, k), mask, e_num, cf)
    keep = keep.reshape(b * t, k)
    y = np.zeros_like(xf)
    for n in range(b * t):
        for s, e in enumerate(top[n]):
            if keep[n, s]:
                gu = xf[n] @ p["gate_up_proj"][e] + p["gate_up_proj_bias"][e]
                g, u = np.minimum(gu[0::2], LIMIT), np.clip(gu[1::2], -LIMIT, LIMIT)
                h = (u + 1) * g / (1 + np.exp(-1.702 * g))
                y[n] += w[n, s] * (h @ p["down_proj"][e] + p["down_proj_bias"][e])
    return y.reshape(b, t, d), top, keep


@pytest.mark.slow  # megablox in interpret mode, forward and backward: ~15 s on 2 loaded cores
def test_gpt_oss_layer_capacity_factor_and_megablox_against_numpy():
    """One GPT-OSS MoE layer (8 experts, top-2) on 3 x 9 tokens with left padding: under `moe_capacity_factor` 0.5
    (drops: 0 < dropped < all) and dropless, ragged_dot and megablox outputs equal the numpy layer within 1e-5;
    megablox's gradients (router, router bias, fused gate_up and both biases, down, input) equal ragged_dot's."""
    rng = np.random.RandomState(3)
    x = jnp.asarray(rng.randn(3, 9, 32), jnp.float32)
    mask = np.ones((3, 9), bool)
    mask[1, :4] = False
    for cf in (0.5, None):
        layer = _random_model(_tiny(num_experts=8, swiglu_limit=LIMIT, moe_capacity_factor=cf), seed=2).layers[0].mlp
        ref, top, keep = _numpy_layer(layer, np.asarray(x), mask, cf)
        if cf is not None:
            assert 0 < (~keep).sum() < keep.size
        grads = {}
        for impl in ("ragged_dot", "megablox"):
            _set_impl(layer, impl)
            graphdef, state = nnx.split(layer)

            def loss(state, x, graphdef=graphdef):
                y, (experts, *_) = nnx.merge(graphdef, state)(x, jnp.asarray(mask))
                return jnp.sum(y * jnp.cos(y)), (y, experts)

            (_, (y, experts)), grads[impl] = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(state, x)
            np.testing.assert_array_equal(np.asarray(experts).reshape(-1, 2), top)
            np.testing.assert_allclose(np.asarray(y), ref, rtol=1e-5, atol=1e-5, err_msg=f"{impl} cf={cf}")
        (g_mb, gx_mb), (g_rd, gx_rd) = grads["megablox"], grads["ragged_dot"]
        np.testing.assert_allclose(np.asarray(gx_mb), np.asarray(gx_rd), rtol=1e-5, atol=1e-5)
        flat, ref_flat = nnx.to_flat_state(g_mb), dict(nnx.to_flat_state(g_rd))
        assert {p[0] for p, _ in flat} >= {"router", "router_bias", "gate_up_proj", "gate_up_proj_bias", "down_proj"}
        for path, v in flat:
            assert np.abs(np.asarray(v[...])).max() > 0, path
            np.testing.assert_allclose(np.asarray(v[...]), np.asarray(ref_flat[path][...]), rtol=1e-5, atol=1e-5)


_SCRIPT = r"""
import json, re
import jax, jax.numpy as jnp, numpy as np
from flax import nnx
from tests.models.test_gpt_oss import _tiny
from tests.models.test_gpt_oss_ep import LIMIT
from jaxrl_post.models.moe import set_moe_impl
from jaxrl_post.models.hf_io import _get_variable, empty_model, load_state_dict_into, param_map
from jaxrl_post.runtime.sharding import InMesh, make_mesh
from tests.models import test_moe as T

out = {}
mesh = make_mesh(data=1, fsdp=1, expert=4, tensor=2)
ids, mask = T._batch(64, b=4, t=8)

def update(model, ids, mask):  # loss + grad of every parameter
    def loss(m):
        logits, moe = m(ids, mask, with_moe=True)
        return jnp.sum(jnp.where(mask[..., None] > 0, jnp.sin(logits), 0.0)), (logits, moe.routed_experts)
    (_, (logits, routes)), grads = nnx.value_and_grad(loss, has_aux=True)(model)
    return logits, routes, grads

def compare(ref, got):
    return dict(
        routes_equal=bool((np.asarray(ref[1]) == np.asarray(got[1])).all()),
        logit_diff=float(np.abs(np.asarray(ref[0]) - np.asarray(got[0])).max()),
        grad_diff={"/".join(map(str, p)): float(np.abs(np.asarray(a[...]) - np.asarray(b[...])).max())
                   for (p, a), (_, b) in zip(nnx.to_flat_state(ref[2]), nnx.to_flat_state(got[2]))},
    )

rng = np.random.RandomState(0)
step = InMesh(jax.jit(update), mesh)
for name, cf in (("dropless", None), ("capacity", 0.5)):
    cfg = _tiny(num_experts=8, swiglu_limit=LIMIT, moe_capacity_factor=cf, vocab_size=64,
               eos_token_id=None, pad_token_id=0)
    tensors = [(n, to_hf(0.3 * rng.randn(*_get_variable(empty_model(cfg), p).shape).astype(np.float32)))
               for n, (p, _, to_hf) in param_map(cfg).items()]
    single = load_state_dict_into(empty_model(cfg), tensors)
    sharded = load_state_dict_into(empty_model(cfg), tensors, mesh)
    ref = jax.jit(update)(single, ids, mask)
    out[name] = compare(ref, step(sharded, ids, mask))
    out[name]["dropped"] = float(jax.jit(lambda m: m(ids, mask, with_moe=True)[1].dropped.sum())(single)) if cf else 0
    if cf is None:
        mlp = sharded.layers[0].mlp
        out["spec"] = {n: str(getattr(mlp, n).get_value().sharding.spec) for n in mlp.expert_params()}
        E = cfg.num_experts
        with jax.set_mesh(mesh):
            hlo = step.lower(sharded, ids, mask).compile().as_text()
        gathers = re.findall(r"= \w+\[([\d,]*)\]\S* all-gather(?:-start)?\(", hlo)
        out["hlo"] = dict(all_to_all=len(re.findall(r" all-to-all\(", hlo)),
                          expert_gathers=[g for g in gathers if g.split(",")[0] == str(E) and len(g.split(",")) >= 2])
        few = jax.jit(lambda m, i, k: m(i, k))  # 2 rows, 4 batch shards: replicated tokens, psum over 'expert'
        few_ref = np.asarray(few(single, ids[:2], mask[:2]))
        with jax.set_mesh(mesh):
            out["few_rows_diff"] = float(np.abs(few_ref - np.asarray(few(sharded, ids[:2], mask[:2]))).max())
        set_moe_impl(sharded, "megablox", interpret=True)
        out["megablox"] = compare(ref, step(sharded, ids, mask))
print("RESULT" + json.dumps(out))
"""


@pytest.fixture(scope="module")
def ep_run():
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(
        os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=8 " + CHEAP_COMPILE_FLAGS
    )
    env["PYTHONPATH"] = repo + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run([sys.executable, "-c", _SCRIPT], cwd=repo, env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.split("RESULT", 1)[1])


def _assert_equal_one_device(r):
    assert r["routes_equal"]
    assert r["logit_diff"] < 1e-5, r["logit_diff"]
    want = {f"layers/0/mlp/{n}" for n in ("router", "router_bias", "gate_up_proj", "gate_up_proj_bias", "down_proj")}
    assert want | {"layers/0/mlp/down_proj_bias", "layers/0/attn/sinks"} <= set(r["grad_diff"])
    assert max(r["grad_diff"].values()) < 1e-4, r["grad_diff"]


@pytest.mark.slow  # one subprocess compiling 5 programs on 8 fake devices: ~60 s on 2 loaded cores
def test_gpt_oss_update_on_expert_mesh_equals_one_device(ep_run):
    """2-layer GPT-OSS (sliding + full, sinks, 8 experts top-2, clamp 1.0) on expert 4 x tensor 2: the fused gate_up
    `[E, D, 2F]` and its bias split over 'expert' and 'tensor' (F pairs stay whole), the down bias over 'expert'
    only (added on one 'tensor' shard); logits, routes and every gradient equal one device's within 1e-5 / 1e-4;
    the compiled update has all-to-alls and no all-gather of an `[E, ...]` expert array; 2 rows (replicated
    tokens, summed over 'expert') give one device's logits."""
    _assert_equal_one_device(ep_run["dropless"])
    assert ep_run["spec"] == {
        "gate_up_proj": "P('expert', 'fsdp', 'tensor')",
        "gate_up_proj_bias": "P('expert', 'tensor')",
        "down_proj": "P('expert', 'tensor', 'fsdp')",
        "down_proj_bias": "P('expert', 'fsdp')",
    }
    assert ep_run["hlo"]["all_to_all"] >= 2 and ep_run["hlo"]["expert_gathers"] == [], ep_run["hlo"]
    assert ep_run["few_rows_diff"] < 1e-5


@pytest.mark.slow
def test_gpt_oss_megablox_and_capacity_factor_on_expert_mesh_equal_one_device(ep_run):
    """On the same mesh: megablox (Pallas interpret mode) as the grouped matmul inside the shard_map, and a capacity
    factor of 0.5 (assignments dropped before the exchange): logits, routes and every gradient equal one device's
    ragged_dot within 1e-5 / 1e-4."""
    _assert_equal_one_device(ep_run["megablox"])
    assert ep_run["capacity"]["dropped"] > 0
    _assert_equal_one_device(ep_run["capacity"])
