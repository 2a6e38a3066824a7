"""Expert parallelism (`models/moe_ep.py`) on 8 fake CPU devices, mesh data 1 x fsdp 1 x expert 4 x tensor 2.

One subprocess (the fake device count must be set before jax starts) runs every check and prints a JSON line;
the tests below read it. Reference: the same model, same weights, on one device (the single-program dispatch
of `MoE.experts`)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.cheap_compile import CHEAP_COMPILE_FLAGS

pytestmark = pytest.mark.slow  # one subprocess compiling 5 programs: ~60 s on 2 loaded cores

_SCRIPT = r"""
import json, re
import jax, jax.numpy as jnp, numpy as np
from flax import nnx
from jax.sharding import PartitionSpec as P
from tests.models import test_moe as T
from jaxrl_post.batch.protocol import DataProto
from jax._src.pallas.mosaic import tpu_info
from jaxrl_post.models import moe_ep
from jaxrl_post.models.moe import set_moe_impl
from jaxrl_post.models.hf_io import _get_variable, empty_model, load_state_dict_into, param_map
from jaxrl_post.rollout import Generator, SamplingParams
from jaxrl_post.runtime.sharding import InMesh, make_mesh

out = {}
# -- padded_ragged_all_to_all on the example of jax.lax.ragged_all_to_all's docstring (2 devices)
mesh2 = make_mesh(data=1, fsdp=1, expert=2, tensor=1, devices=jax.devices()[:2])
args = [np.array(a, np.int32) for a in ([1, 2, 2, 3, 4, 0], [0] * 8, [0, 1, 0, 1], [1, 2, 1, 1], [0, 0, 1, 2],
                                        [1, 1, 2, 1])]
f = jax.shard_map(lambda *a: moe_ep.padded_ragged_all_to_all(*a, axis_name="expert"), mesh=mesh2,
                  in_specs=(P("expert"),) * 6, out_specs=P("expert"))
out["a2a"] = np.asarray(jax.jit(f)(*args)).tolist()

# -- a 1-layer Qwen3-MoE, 8 experts top-2, on the mesh and on one device
cfg = T._tiny_cfg(num_layers=1, vocab_size=64, num_experts=8, eos_token_id=None, pad_token_id=0)
rng = np.random.RandomState(0)
tensors = [(n, to_hf(0.3 * rng.randn(*_get_variable(empty_model(cfg), p).shape).astype(np.float32)))
           for n, (p, _, to_hf) in param_map(cfg).items()]
single = load_state_dict_into(empty_model(cfg), tensors)
mesh = make_mesh(data=1, fsdp=1, expert=4, tensor=2)
sharded = load_state_dict_into(empty_model(cfg), tensors, mesh)
out["spec"] = str(sharded.layers[0].mlp.gate_proj.get_value().sharding.spec)
ids, mask = T._batch(cfg.vocab_size, b=4, t=8)

def update(model, ids, mask):  # loss + grad of every parameter
    def loss(m):
        logits, moe = m(ids, mask, with_moe=True)
        return jnp.sum(jnp.where(mask[..., None] > 0, jnp.sin(logits), 0.0)), (logits, moe.routed_experts)
    (_, (logits, routes)), grads = nnx.value_and_grad(loss, has_aux=True)(model)
    return logits, routes, grads

ref = jax.jit(update)(single, ids, mask)
step = InMesh(jax.jit(update), mesh)
got = step(sharded, ids, mask)
out["routes_equal"] = bool((np.asarray(ref[1]) == np.asarray(got[1])).all())
out["logit_diff"] = float(np.abs(np.asarray(ref[0]) - np.asarray(got[0])).max())
out["grad_diff"] = {"/".join(map(str, p)): float(np.abs(np.asarray(a[...]) - np.asarray(b[...])).max())
                    for (p, a), (_, b) in zip(nnx.to_flat_state(ref[2]), nnx.to_flat_state(got[2]))}

E, D, F = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
def collectives(hlo):
    gathers = re.findall(r"= \w+\[([\d,]*)\]\S* all-gather(?:-start)?\(", hlo)
    return dict(all_to_all=len(re.findall(r" all-to-all\(", hlo)),
                expert_gathers=[g for g in gathers if g.split(",")[0] == str(E) and len(g.split(",")) == 3])

with jax.set_mesh(mesh):
    out["update_hlo"] = collectives(step.lower(sharded, ids, mask).compile().as_text())

# -- decode: one cached token step's HLO, and greedy generation equal to one device's
def decode_step(model, tok, mask, cache):
    logits, cache = model(tok, mask, cache=cache)
    return logits, cache

cache = sharded.init_cache(4, 16)
with jax.set_mesh(mesh):
    _, cache = jax.jit(decode_step)(sharded, ids, mask, cache)
    hlo = jax.jit(decode_step).lower(sharded, ids[:, -1:], mask[:, -1:], cache).compile().as_text()
out["decode_hlo"] = collectives(hlo)
dp = DataProto.from_dict({"input_ids": ids, "attention_mask": mask})
params = SamplingParams(max_new_tokens=4, do_sample=False)
a = Generator(single, compact_min_rows=None, decode_chunk=4).generate(dp, params).batch
b = Generator(sharded, mesh=mesh, compact_min_rows=None, decode_chunk=4).generate(dp, params).batch
out["greedy_equal"] = bool((a["responses"] == b["responses"]).all())
out["rollout_logp_diff"] = float(np.abs(a["rollout_log_probs"] - b["rollout_log_probs"]).max())

# -- rows that do not divide over the batch axes (2 rows, 4 shards): replicated tokens, psum over experts
few = jax.jit(lambda m, i, k: m(i, k))
few_ref = np.asarray(few(single, ids[:2], mask[:2]))  # one device, no mesh
with jax.set_mesh(mesh):
    out["few_rows_diff"] = float(np.abs(few_ref - np.asarray(few(sharded, ids[:2], mask[:2]))).max())

# -- the Pallas megablox gmm (interpret mode) as the grouped matmul inside the shard_map
mb = load_state_dict_into(empty_model(cfg), tensors, mesh)
set_moe_impl(mb, "megablox", interpret=True)
got = step(mb, ids, mask)
out["megablox_logit_diff"] = float(np.abs(np.asarray(ref[0]) - np.asarray(got[0])).max())
out["megablox_grad_diff"] = max(float(np.abs(np.asarray(a[...]) - np.asarray(b[...])).max())
                                for (_, a), (_, b) in zip(nnx.to_flat_state(ref[2]), nnx.to_flat_state(got[2])))

# -- Qwen2-MoE (a shared expert with its sigmoid gate) under a capacity factor of 0.5: drops before the exchange
from tests.models.test_moe_families import _tiny
cfg2 = _tiny("qwen2_moe", num_layers=1, mlp_only_layers=(), num_experts=8, vocab_size=64, moe_capacity_factor=0.5,
             eos_token_id=None, pad_token_id=0)
tensors2 = [(n, to_hf(0.3 * rng.randn(*_get_variable(empty_model(cfg2), p).shape).astype(np.float32)))
            for n, (p, _, to_hf) in param_map(cfg2).items()]
single2 = load_state_dict_into(empty_model(cfg2), tensors2)
ref2 = jax.jit(update)(single2, ids, mask)
got2 = step(load_state_dict_into(empty_model(cfg2), tensors2, mesh), ids, mask)
out["shared_cf"] = dict(
    routes_equal=bool((np.asarray(ref2[1]) == np.asarray(got2[1])).all()),
    logit_diff=float(np.abs(np.asarray(ref2[0]) - np.asarray(got2[0])).max()),
    grad_diff={"/".join(map(str, p)): float(np.abs(np.asarray(a[...]) - np.asarray(b[...])).max())
               for (p, a), (_, b) in zip(nnx.to_flat_state(ref2[2]), nnx.to_flat_state(got2[2]))},
    dropped=float(jax.jit(lambda m: m(ids, mask, with_moe=True)[1].dropped.sum())(single2)),
)

# -- the ragged collective, lowered for TPU and GPU (XLA:CPU cannot compile it); on TPU also with megablox
moe_ep.ragged_all_to_all_supported = lambda platform=None: True
jax.clear_caches()  # the exchange is chosen at trace time: no cached trace of the padded one
out["ragged"] = {}
for platform in ("tpu", "cuda"):
    with jax.set_mesh(mesh):
        text = jax.jit(update).trace(sharded, ids, mask).lower(lowering_platforms=(platform,)).as_text()
    out["ragged"][platform] = text.count("custom_call @ragged_all_to_all")
tpu_info.get_device_kind, tpu_info.get_num_device_cores = (lambda: "TPU v5p"), (lambda: 1)  # Mosaic asks
set_moe_impl(mb, "megablox", interpret=False)
with jax.set_mesh(mesh):
    text = jax.jit(update).trace(mb, ids, mask).lower(lowering_platforms=("tpu",)).as_text()
out["megablox_tpu"] = [text.count("custom_call @ragged_all_to_all"), len(re.findall(r"call @gmm(_\d+)?\(", text)),
                       len(re.findall(r"call @tgmm(_\d+)?\(", text))]
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


def test_padded_all_to_all_has_ragged_all_to_all_semantics(ep_run):
    """The CPU stand-in for `jax.lax.ragged_all_to_all` gives the result of that function's documented
    example: device 0 receives [1, 3] at 0..1, device 1 receives [2, 2] then [4] (output stays 0 elsewhere)."""
    assert ep_run["a2a"] == [1, 3, 0, 0, 2, 2, 4, 0]


def test_expert_weights_split_over_the_expert_axis(ep_run):
    """gate_proj `[E, D, F]`: experts over 'expert', D over 'fsdp' (size 1 here), F over 'tensor'."""
    assert ep_run["spec"] == "P('expert', 'fsdp', 'tensor')"


def test_update_on_expert_mesh_equals_one_device(ep_run):
    """Loss + grad through the all-to-all dispatch (forward and backward): logits, routes and the gradient of
    every parameter (router and experts included) equal the one-device program's within float32 rounding."""
    assert ep_run["routes_equal"]
    assert ep_run["logit_diff"] < 1e-5, ep_run["logit_diff"]
    assert set(ep_run["grad_diff"]) >= {"layers/0/mlp/router", "layers/0/mlp/gate_proj", "layers/0/mlp/down_proj"}
    assert max(ep_run["grad_diff"].values()) < 1e-4, ep_run["grad_diff"]


def test_update_and_decode_hlo_exchange_tokens_and_never_gather_experts(ep_run):
    """The compiled update and decode-step programs have all-to-alls (the token exchange) and no all-gather
    whose result is an `[E, ., .]` array (all experts on one device)."""
    for key in ("update_hlo", "decode_hlo"):
        assert ep_run[key]["all_to_all"] >= 2, (key, ep_run[key])
        assert ep_run[key]["expert_gathers"] == [], (key, ep_run[key])


def test_greedy_decode_on_expert_mesh_equals_one_device(ep_run):
    """`Generator` on the expert mesh (prefill + cached decode through the dispatch): the same greedy tokens and
    rollout log-probs as on one device; a batch that does not divide over the batch axes (replicated tokens,
    outputs summed over 'expert') gives the one-device logits too."""
    assert ep_run["greedy_equal"]
    assert ep_run["rollout_logp_diff"] < 1e-5
    assert ep_run["few_rows_diff"] < 1e-5


def test_shared_expert_and_capacity_factor_on_expert_mesh_equal_one_device(ep_run):
    """Qwen2-MoE (shared expert + sigmoid gate) with `moe_capacity_factor` 0.5, which drops assignments: on the expert
    mesh (drops zero-weighted before the exchange) the logits and every gradient, the shared expert's included,
    equal one device's (dropped assignments in no group of the grouped matmuls) within 1e-5 / 1e-4."""
    r = ep_run["shared_cf"]
    assert r["dropped"] > 0 and r["routes_equal"]
    assert r["logit_diff"] < 1e-5, r["logit_diff"]
    assert {"layers/0/mlp/shared_expert/gate_proj/kernel", "layers/0/mlp/shared_expert_gate"} <= set(r["grad_diff"])
    assert max(r["grad_diff"].values()) < 1e-4, r["grad_diff"]


def test_ragged_all_to_all_lowers_for_tpu_and_gpu(ep_run):
    """With the ragged collective (TPU / GPU): two `ragged_all_to_all` per MoE layer forward (dispatch, combine)
    and their transposes in the backward."""
    assert ep_run["ragged"] == {"tpu": 4, "cuda": 4}


def test_megablox_in_the_expert_parallel_dispatch_equals_one_device(ep_run):
    """`model.moe_impl='megablox'` (Pallas interpret mode) inside the shard_map: the receive buffer's padding rows
    after the last group give 0, logits and every gradient equal one device's ragged_dot within 1e-5 / 1e-4."""
    assert ep_run["megablox_logit_diff"] < 1e-5
    assert ep_run["megablox_grad_diff"] < 1e-4


def test_megablox_expert_parallel_update_lowers_for_tpu(ep_run):
    """The update on the expert mesh with megablox lowers for TPU: 4 ragged all-to-alls, 6 gmm kernels (3 forward,
    3 lhs gradient) and 3 tgmm (weight gradients) for the one MoE layer (dims below 128 lanes padded up to them)."""
    assert ep_run["megablox_tpu"] == [4, 6, 3]
