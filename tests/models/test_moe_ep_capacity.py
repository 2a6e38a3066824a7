"""A capacity factor under expert parallelism (`models/moe_ep.py`): dropped assignments are neither exchanged nor
computed, and the exchange buffers and grouped matmuls hold only the rows the capacity allows (`_buffer_rows`).
Results against one device on 8 fake CPU devices (expert 4 x tensor 2), in the subprocess pattern of
test_moe_ep.py; the compute saved from XLA's `cost_analysis` of the compiled programs."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from jaxrl_post.models.moe import expert_capacity
from jaxrl_post.models.moe_ep import _buffer_rows
from tests.cheap_compile import CHEAP_COMPILE_FLAGS


def test_buffer_rows_by_hand():
    """Per device, b = 2 rows of T = 8 tokens, k = 2, E = 8 experts over ep = 4 (2 local). Dropless: 2*8*2 = 32
    assignments to send, 4 * 32 = 128 receivable. Factor 0.5: C = ceil(0.5*8*2/8) = 1, at most 2*8*1 = 16 kept to
    send and 4*2*2*1 = 16 to receive. Factor 2: C = 4, send min(32, 64) = 32, receive min(128, 4*2*2*4 = 64) = 64."""
    assert _buffer_rows(2, 8, 2, 8, 4, None) == (32, 128)
    assert expert_capacity(8, 2, 8, 0.5) == 1 and _buffer_rows(2, 8, 2, 8, 4, 1) == (16, 16)
    assert expert_capacity(8, 2, 8, 2.0) == 4 and _buffer_rows(2, 8, 2, 8, 4, 4) == (32, 64)


_SCRIPT = r"""
import json
import jax, jax.numpy as jnp, numpy as np
from flax import nnx
from tests.models.test_gpt_oss import _tiny
from jaxrl_post.models.hf_io import _get_variable, empty_model, load_state_dict_into, param_map
from jaxrl_post.runtime.sharding import InMesh, make_mesh
from tests.models import test_moe as T

out = {}
mesh = make_mesh(data=1, fsdp=1, expert=4, tensor=2)
ids, mask = T._batch(64, b=4, t=8)
rng = np.random.RandomState(0)
base = _tiny(num_experts=8, num_layers=1, layer_types=None, vocab_size=64)
draws = [0.3 * rng.randn(*_get_variable(empty_model(base), p).shape).astype(np.float32)
         for p, _, _ in param_map(base).values()]

def models(cf):  # the same weights; a 1-layer GPT-OSS (sinks, biased experts, clamp 1.0), 8 experts top-2
    cfg = _tiny(num_experts=8, num_layers=1, layer_types=None, swiglu_limit=1.0, moe_capacity_factor=cf,
                vocab_size=64, eos_token_id=None, pad_token_id=0)
    tensors = [(n, to_hf(w)) for (n, (p, _, to_hf)), w in zip(param_map(cfg).items(), draws)]
    return load_state_dict_into(empty_model(cfg), tensors), load_state_dict_into(empty_model(cfg), tensors, mesh)

# every token forced to experts 0 and 1 (both on expert shard 0): at factor 2 (C = 4) each row keeps 4 + 4
# assignments, so shard 0 receives 4 senders x 8 = 32 rows, the receive buffer's bound exactly
routes = np.zeros((4, 8, 1, 2), np.int32)
routes[..., 1] = 1

def update(model, ids, mask, routes):
    def loss(m):
        logits, moe = m(ids, mask, routed_experts=routes, with_moe=True)
        return jnp.sum(jnp.where(mask[..., None] > 0, jnp.sin(logits), 0.0)), (logits, moe.dropped)
    (_, (logits, dropped)), grads = nnx.value_and_grad(loss, has_aux=True)(model)
    return logits, dropped, grads

single, sharded = models(2.0)
ref = jax.jit(update)(single, ids, mask, routes)
got = InMesh(jax.jit(update), mesh)(sharded, ids, mask, routes)
out["full_buffer"] = dict(
    dropped=float(ref[1].sum()), dropped_mesh=float(got[1].sum()),
    logit_diff=float(np.abs(np.asarray(ref[0]) - np.asarray(got[0])).max()),
    grad_diff={"/".join(map(str, p)): float(np.abs(np.asarray(a[...]) - np.asarray(b[...])).max())
               for (p, a), (_, b) in zip(nnx.to_flat_state(ref[2]), nnx.to_flat_state(got[2]))},
)

# 2 rows over 4 batch shards (replicated tokens, outputs summed over 'expert') with the router's drops
fwd = jax.jit(lambda m, i, k: m(i, k, with_moe=True))
single, sharded = models(0.5)
(few_ref, moe) = fwd(single, ids[:2], mask[:2])
with jax.set_mesh(mesh):
    few = fwd(sharded, ids[:2], mask[:2])[0]
few_diff = np.abs(np.asarray(few_ref) - np.asarray(few)).max()
out["few_rows"] = dict(dropped=float(moe.dropped.sum()), diff=float(few_diff))

# XLA's cost analysis of the compiled forward on the mesh (per device), dropless and under a factor
out["flops"] = {}
for cf in (None, 0.5, 2.0):
    model = models(cf)[1]
    with jax.set_mesh(mesh):
        compiled = jax.jit(lambda m, i, k: m(i, k)).lower(model, ids, mask).compile()
    cost = compiled.cost_analysis()
    out["flops"][str(cf)] = (cost[0] if isinstance(cost, list) else cost)["flops"]
print("RESULT" + json.dumps(out))
"""


@pytest.fixture(scope="module")
def run():
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(
        os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=8 " + CHEAP_COMPILE_FLAGS
    )
    env["PYTHONPATH"] = repo + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run([sys.executable, "-c", _SCRIPT], cwd=repo, env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.split("RESULT", 1)[1])


@pytest.mark.slow  # one subprocess compiling 7 programs on 8 fake devices
def test_capacity_on_expert_mesh_fills_the_receive_buffer_and_equals_one_device(run):
    """Forced routes send every token to experts 0 and 1 (one expert shard) at factor 2: the dropped count (half of
    the valid tokens' assignments) agrees, shard 0's receive buffer is exactly full, and the logits and every gradient
    (router, biases, fused gate_up, down, sinks) equal one device's within 1e-5 / 1e-4; 2 rows (replicated tokens)
    under factor 0.5 give one device's logits."""
    r = run["full_buffer"]
    assert r["dropped"] == r["dropped_mesh"] > 0
    assert r["logit_diff"] < 1e-5, r["logit_diff"]
    assert {"layers/0/mlp/router", "layers/0/mlp/gate_up_proj", "layers/0/mlp/down_proj_bias"} <= set(r["grad_diff"])
    assert max(r["grad_diff"].values()) < 1e-4, r["grad_diff"]
    assert run["few_rows"]["dropped"] > 0 and run["few_rows"]["diff"] < 1e-5, run["few_rows"]


@pytest.mark.slow
def test_capacity_factor_cuts_the_expert_parallel_flops(run):
    """XLA's FLOP count of the compiled forward on the expert mesh: factor 0.5 under half the dropless program's
    (one row of 8 tokens per device: 8 of the dropless 64 receivable rows; before, a factor computed its dropped rows
    and cost as much as dropless), and factor 2 below dropless too (32 of 64 rows)."""
    f = run["flops"]
    assert f["0.5"] < 0.5 * f["None"], f
    assert f["0.5"] < f["2.0"] < f["None"], f
