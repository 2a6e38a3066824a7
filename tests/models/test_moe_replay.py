"""Mixture of experts (issue 58), routing and training: rollout routing replay (forced routes reproduce logits
and gradients bitwise, decode emits the full forward's routes, a bf16/f32 near-tie), routing metrics and the
load-balancing loss in the actor update, a tiny MoE GRPO step, and the MoE on a 2 x 2 x 2 fake-device mesh."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxrl_post.models.moe import MoE, load_balancing_loss, router_metrics
from tests.cheap_compile import CHEAP_COMPILE_FLAGS
from tests.models.test_moe import _batch, _random_model, _tiny_cfg

# ------------------------------------------------------------------------ rollout routing replay (R3)


def _loss_fn(model, ids, mask, routes):
    logits = model(ids, mask, routed_experts=routes)
    return jnp.sum(jnp.where(mask[..., None] > 0, jnp.sin(logits), 0.0))


_grads = jax.jit(nnx.grad(_loss_fn))
_forward_moe = jax.jit(lambda model, ids, mask, routes: model(ids, mask, routed_experts=routes, with_moe=True))


@pytest.mark.parametrize(
    "mode",
    [pytest.param("unrolled", marks=pytest.mark.slow), "scan_layers", pytest.param("remat", marks=pytest.mark.slow)],
)
def test_forced_routes_equal_to_emitted_reproduce_logits_and_gradients_bitwise(mode):
    """Replaying the routes a forward emitted gives bitwise the same logits and the same gradient of every param
    (the router's included, non-zero: the forced experts' probabilities are recomputed); routes have the
    `[B, T, M, k]` uint8 layout; with scan_layers the stacked MoE stats come out per layer."""
    cfg = _tiny_cfg(num_layers=4, mlp_only_layers=(2,))
    model = _random_model(cfg, seed=4)
    model.scan_layers, model.remat = mode == "scan_layers", mode == "remat"
    ids, mask = _batch(cfg.vocab_size, b=2, t=6)
    (logits, moe) = _forward_moe(model, ids, mask, None)
    assert moe.routed_experts.shape == (2, 6, 3, 2) and moe.routed_experts.dtype == jnp.uint8
    assert float(moe.num_tokens) == mask.sum() and np.asarray(moe.expert_load).sum(1).tolist() == [mask.sum() * 2] * 3
    replay, moe2 = _forward_moe(model, ids, mask, moe.routed_experts)
    np.testing.assert_array_equal(np.asarray(replay), np.asarray(logits))
    np.testing.assert_array_equal(np.asarray(moe2.routed_experts), np.asarray(moe.routed_experts))
    g_free = _grads(model, ids, mask, None)
    g_replay = _grads(model, ids, mask, moe.routed_experts)
    for (path, a), (_, b) in zip(nnx.to_flat_state(g_free), nnx.to_flat_state(g_replay)):
        np.testing.assert_array_equal(np.asarray(a[...]), np.asarray(b[...]), err_msg=str(path))
    router_grad = np.asarray(g_replay["layers"][0]["mlp"]["router"][...])
    assert np.abs(router_grad).max() > 1e-3
    other = np.asarray(moe.routed_experts).copy()
    other[..., 0] = (other[..., 0] + 1) % 4  # other experts: other logits
    other = np.where(other[..., :1] == other[..., 1:], (other + 2) % 4, other)
    forced, moe3 = _forward_moe(model, ids, mask, jnp.asarray(other))
    np.testing.assert_array_equal(np.asarray(moe3.routed_experts), other)
    assert np.abs(np.asarray(forced) - np.asarray(logits))[mask > 0].max() > 1e-2


_step = jax.jit(lambda model, ids, mask, cache: model(ids, mask, cache=cache, with_moe=True))


def test_decode_emits_the_routes_of_the_full_forward():
    """Prefill + one-token decode steps with a KV cache emit per (real) token the experts the cacheless
    (training) forward picks for it, so they can be replayed there."""
    cfg = _tiny_cfg()
    model = _random_model(cfg, seed=6)
    ids, mask = _batch(cfg.vocab_size, b=2, t=7)
    _, full = _forward_moe(model, ids, mask, None)
    cache = model.init_cache(2, 7)
    (_, cache), first = _step(model, ids[:, :5], mask[:, :5], cache)
    routes = [first.routed_experts]
    for t in (5, 6):
        (_, cache), step = _step(model, ids[:, t : t + 1], mask[:, t : t + 1], cache)
        routes.append(step.routed_experts)
    valid = mask.astype(bool)  # a padding token's attention differs with and without a cache: not compared
    np.testing.assert_array_equal(np.concatenate(routes, axis=1)[valid], np.asarray(full.routed_experts)[valid])


def _moe_input(model, ids, mask):
    """Layer 0's MoE input (its pre-MLP norm output) `[B, T, D]` in the model's compute dtype."""
    from jaxrl_post.models.decoder import positions_from_mask

    block = model.layers[0]
    x = jnp.take(model.embedding[...], ids, axis=0).astype(model.dtype)
    h, _ = block.attn(block.input_norm(x), positions_from_mask(jnp.asarray(mask)), jnp.asarray(mask) > 0, 0)
    return block.pre_mlp_norm(x + h)


def test_near_tie_bf16_rollout_flips_an_expert_without_replay_and_matches_with_it():
    """A router built so that one token's two experts nearly tie, on the side that bf16 hidden states (the
    rollout) and float32 ones (the trainer) see differently: without replay the float32 forward routes the
    token to the other expert and its log-probs move by O(1); replaying the rollout's routes gives the
    rollout's experts and log-probs within bf16 noise, and the router still gets a gradient."""
    cfg = _tiny_cfg(num_layers=1, num_experts=2, num_experts_per_tok=1, norm_topk_prob=False)
    f32, bf16 = _random_model(cfg, seed=7), _random_model(cfg, seed=7, dtype="bfloat16")
    ids, mask = _batch(cfg.vocab_size, b=2, t=6)
    x32 = np.asarray(_moe_input(f32, ids, mask)[0, -1], np.float64)
    x16 = np.asarray(_moe_input(bf16, ids, mask)[0, -1].astype(jnp.float32), np.float64)
    e = x16 - x32
    eta = 1e-3 * np.linalg.norm(x32)
    a, b = np.linalg.solve([[x32 @ x32, x32 @ e], [x16 @ x32, x16 @ e]], [eta, -eta])
    router = np.asarray(f32.layers[0].mlp.router[...]).copy()
    router[:, 1] = router[:, 0] + (a * x32 + b * e)  # logit_1 - logit_0 = +eta (float32), -eta (bf16)
    for m in (f32, bf16):
        m.layers[0].mlp.router.set_value(jnp.asarray(router))
    rollout_logits, rollout = _forward_moe(bf16, ids, mask, None)
    free_logits, free = _forward_moe(f32, ids, mask, None)
    replay_logits, replay = _forward_moe(f32, ids, mask, rollout.routed_experts)
    assert int(rollout.routed_experts[0, -1, 0, 0]) == 0 and int(free.routed_experts[0, -1, 0, 0]) == 1
    np.testing.assert_array_equal(np.asarray(replay.routed_experts), np.asarray(rollout.routed_experts))

    def logp(x):
        return np.asarray(jax.nn.log_softmax(x[0, -1]))

    gap_free = np.abs(logp(free_logits) - logp(rollout_logits)).max()
    gap_replay = np.abs(logp(replay_logits) - logp(rollout_logits)).max()
    assert gap_free > 0.3 and gap_replay < 0.1 * gap_free, (gap_free, gap_replay)
    grad = _grads(f32, ids, mask, rollout.routed_experts)["layers"][0]["mlp"]["router"][...]
    assert np.abs(np.asarray(grad)).max() > 1e-3


def test_router_metrics_and_aux_loss_by_hand():
    """Two layers, E = 2, k = 1, 4 tokens: layer 0 sends 3 tokens to expert 0, layer 1 balances 2 / 2."""
    from jaxrl_post.models.moe import MoEOutput

    moe = MoEOutput(
        routed_experts=jnp.zeros((1, 4, 2, 1), jnp.uint8),
        expert_load=jnp.asarray([[3.0, 1.0], [2.0, 2.0]]),
        router_prob_sum=jnp.asarray([[2.4, 1.6], [2.0, 2.0]]),
        router_entropy_sum=jnp.asarray([2.0, 2.772]),
        num_tokens=jnp.asarray(4.0),
    )
    # f = (5, 3) / 8, P = (4.4, 3.6) / 8, loss = 2 * (5 * 4.4 + 3 * 3.6) / 64
    np.testing.assert_allclose(float(load_balancing_loss(moe)), 2 * (5 * 4.4 + 3 * 3.6) / 64, rtol=1e-6)
    m = {k: float(v) for k, v in router_metrics(moe).items()}
    assert m["actor/moe/layer_0/expert_load_max"] == pytest.approx(1.5)
    assert m["actor/moe/layer_0/expert_load_min"] == pytest.approx(0.5)
    assert m["actor/moe/layer_1/expert_load_max"] == pytest.approx(1.0)
    assert m["actor/moe/layer_1/router_entropy"] == pytest.approx(0.693, abs=1e-3)
    assert m["actor/moe/aux_loss"] == pytest.approx(float(load_balancing_loss(moe)))


def test_routed_experts_of_the_wrong_shape_raise():
    cfg = _tiny_cfg()
    model = _random_model(cfg)
    ids, mask = _batch(cfg.vocab_size, b=2, t=5)
    with pytest.raises(ValueError, match=r"routed_experts has shape \(2, 5, 1, 2\), this model needs \(2, 5, 2, 2\)"):
        model(ids, mask, routed_experts=jnp.zeros((2, 5, 1, 2), jnp.uint8))
    dense = _random_model(_tiny_cfg(family="qwen3", num_experts=0, num_experts_per_tok=0, moe_intermediate_size=0))
    with pytest.raises(ValueError, match="routed_experts"):
        dense(ids, mask, routed_experts=jnp.zeros((2, 5, 1, 2), jnp.uint8))
    assert jax.eval_shape(lambda: dense(ids, mask, with_moe=True)[1]) is None


@pytest.mark.slow
def test_moe_tiny_grpo_step_runs_on_cpu(tmp_path):
    """`configs/grpo.py:moe_tiny` with the aux loss on: one GRPO step (rollout with a KV cache, old log-probs,
    reference, packed update) on a random 2-layer Qwen3-MoE; finite metrics with the routing ones, and the update
    moves the experts and the router."""
    import sys

    sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[2]))
    from configs import grpo
    from jaxrl_post.rl.trainer import RLTrainer

    c = grpo.get_config("moe_tiny")
    c.trainer.default_local_dir = str(tmp_path / "run")
    c.trainer.save_freq = -1
    c.trainer.total_training_steps = 1
    c.trainer.val_before_train = c.trainer.val_at_end = False
    c.model.arch.output_router_logits = True
    c.model.arch.router_aux_loss_coef = 0.01
    trainer = RLTrainer(c, console_write=lambda s: None)
    try:
        mlp = trainer.policy.model.layers[0].mlp
        assert isinstance(mlp, MoE) and mlp.num_experts == 4
        before = jax.tree.map(np.asarray, trainer.state.actor.params)
        hist = trainer.fit()["history"]
        assert all(np.isfinite(v) for v in hist[-1].values())
        assert hist[-1]["actor/moe/aux_loss"] >= 1.0 and hist[-1]["actor/moe/layer_1/expert_load_max"] >= 1.0
        after = jax.tree.map(np.asarray, trainer.state.actor.params)
        for key in ("router", "gate_proj", "down_proj"):
            diff = np.abs(after["layers"][0]["mlp"][key][...] - before["layers"][0]["mlp"][key][...]).max()
            assert diff > 0, key
    finally:
        trainer.close()


_MESH_SCRIPT = r"""
import json, sys
import jax, jax.numpy as jnp, numpy as np
from flax import nnx
from tests.models import test_moe as T
from jaxrl_post.models.hf_io import _get_variable, empty_model, load_state_dict_into, param_map
from jaxrl_post.runtime.sharding import make_mesh

cfg = T._tiny_cfg(num_layers=3, mlp_only_layers=(1,), vocab_size=64)
rng = np.random.RandomState(0)
shapes = empty_model(cfg)
tensors = [(n, to_hf(0.3 * rng.randn(*_get_variable(shapes, p).shape).astype(np.float32)))
           for n, (p, _, to_hf) in param_map(cfg).items()]
single = load_state_dict_into(empty_model(cfg), tensors)
mesh = make_mesh(data=2, fsdp=2, tensor=2)
sharded = load_state_dict_into(empty_model(cfg), tensors, mesh)
specs = {str(p): str(v.get_value().sharding.spec) for p, v in nnx.to_flat_state(nnx.state(sharded))
         if "mlp" in map(str, p) and p[1] == 0}
ids, mask = T._batch(cfg.vocab_size, b=4, t=8)

@jax.jit
def run(model, ids, mask):
    def loss(m):
        logits, moe = m(ids, mask, with_moe=True)
        return jnp.sum(jnp.where(mask[..., None] > 0, jnp.sin(logits), 0.0)), (logits, moe.routed_experts)
    (_, (logits, routes)), grads = nnx.value_and_grad(loss, has_aux=True)(model)
    return logits, routes, grads

outs = [run(m, ids, mask) for m in (single, sharded)]
logit_diff = float(np.abs(np.asarray(outs[0][0]) - np.asarray(outs[1][0])).max())
grad_diff = max(float(np.abs(np.asarray(a[...]) - np.asarray(b[...])).max())
                for (_, a), (_, b) in zip(nnx.to_flat_state(outs[0][2]), nnx.to_flat_state(outs[1][2])))
print("RESULT" + json.dumps(dict(specs=specs, logit_diff=logit_diff, grad_diff=grad_diff,
      routes_equal=bool((np.asarray(outs[0][1]) == np.asarray(outs[1][1])).all()))))
"""


@pytest.mark.slow
def test_moe_forward_and_gradients_on_a_2x2x2_mesh_equal_one_device():
    """On 8 fake CPU devices (data 2, fsdp 2, tensor 2) the expert weights are sharded like a dense MLP's
    (embed over fsdp, mlp over tensor; the expert dim over the expert axis, of size 1 here) and the MoE
    model's logits, routes and every gradient equal the one-device run's within float32 rounding."""
    import os
    import subprocess
    import sys

    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(
        os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=8 " + CHEAP_COMPILE_FLAGS
    )
    env["PYTHONPATH"] = repo + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run(
        [sys.executable, "-c", _MESH_SCRIPT], cwd=repo, env=env, capture_output=True, text=True, timeout=900
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.split("RESULT", 1)[1])
    assert out["specs"]["('layers', 0, 'mlp', 'gate_proj')"] == "P('expert', 'fsdp', 'tensor')"  # expert axis size 1
    assert out["specs"]["('layers', 0, 'mlp', 'router')"] == "P('fsdp', None)"
    assert out["routes_equal"]
    assert out["logit_diff"] < 1e-5 and out["grad_diff"] < 1e-4, out


@pytest.mark.slow
def test_actor_update_adds_the_aux_loss_and_logs_routing_metrics():
    """`ppo_update.make_actor_update` (padded layout) on an MoE actor: with `output_router_logits` the step's
    gradient is the policy loss's plus `router_aux_loss_coef` times the load-balancing loss's (checked on the
    router weights against `jax.grad` of that term alone); without it the routing metrics are logged and the aux
    loss is not trained."""
    import optax

    from jaxrl_post.engine import steps
    from jaxrl_post.rl import ppo_update

    rng = np.random.RandomState(0)
    b, p, r = 4, 5, 3
    ids = rng.randint(0, 61, (b, p + r)).astype(np.int32)
    batch = dict(
        input_ids=ids,
        attention_mask=np.ones((b, p + r), np.int32),
        position_ids=np.tile(np.arange(p + r, dtype=np.int32), (b, 1)),
        responses=ids[:, p:],
        loss_mask=np.ones((b, r), np.int32),
        advantages=rng.normal(size=(b, r)).astype(np.float32),
    )
    deltas, metrics = {}, {}
    for on in (False, True):
        model = _random_model(_tiny_cfg(output_router_logits=on, router_aux_loss_coef=0.5), seed=8)
        g, params, rest = steps.split_model(model)
        tx = optax.sgd(1.0)
        cfg = ppo_update.ActorLossConfig(on_policy=True)
        update = jax.jit(ppo_update.make_actor_update(steps.padded_layout(n_micro=1), g, rest, tx, cfg))
        new, _, metrics[on] = update(params, tx.init(params), batch)
        deltas[on] = np.asarray(new["layers"][0]["mlp"]["router"][...] - params["layers"][0]["mlp"]["router"][...])

    def aux(m):
        _, moe = m(batch["input_ids"], batch["attention_mask"], batch["position_ids"], with_moe=True)
        return load_balancing_loss(moe)

    value, grad = nnx.value_and_grad(aux)(model)
    expected = -0.5 * np.asarray(grad["layers"][0]["mlp"]["router"][...])
    np.testing.assert_allclose(deltas[True] - deltas[False], expected, atol=1e-5)
    assert np.abs(expected).max() > 1e-3
    for on in (False, True):
        assert float(metrics[on]["moe/aux_loss"]) == pytest.approx(float(value), rel=1e-5)
        assert 1.0 <= float(metrics[on]["moe/layer_1/expert_load_max"]) <= 4.0
        assert 0.0 < float(metrics[on]["moe/layer_0/router_entropy"]) <= np.log(4) + 1e-6
