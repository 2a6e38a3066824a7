"""MoE rollout routing replay in the RL loop (issue 58 item 4, `actor.router_replay.mode`): the dense rollout's
`routed_experts`, the batch key through the padded and packed layouts into the actor's forwards (R3) and out of
the old-log-prob forward (R2), a bf16 rollout's near-tie scored in float32 with and without replay, router
gradients under replay, the config checks, and a tiny MoE GRPO step with R3."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_post.algos.rollout_corr import compute_rollout_probs_diff_metrics
from jaxrl_post.batch.keys import FORWARD_KEYS, REPLAY_KEYS
from jaxrl_post.batch.protocol import DataProto
from jaxrl_post.engine import packed_steps, packing, steps, update_core
from jaxrl_post.engine.placement import Placement
from jaxrl_post.errors import ConfigError
from jaxrl_post.rollout.generate import Generator
from jaxrl_post.rollout.sampling import SamplingParams
from tests.models.test_moe import _batch, _random_model, _tiny_cfg

ALL_KEYS = (*FORWARD_KEYS, *REPLAY_KEYS)


def _rollout(model, *, b=2, p=6, r=5, n=2, seed=1, greedy=False, prompts=None):
    """The dense Generator's batch (numpy) with `routed_experts`, on `b` random prompts x `n` samples."""
    ids, mask = _batch(model.config.vocab_size, b=b, t=p) if prompts is None else prompts
    gen = Generator(model, return_routed_experts=True, min_prompt_bucket=8)
    sp = SamplingParams(
        max_new_tokens=r, temperature=0.0 if greedy else 1.0, do_sample=not greedy, eos_token_ids=(0,), seed=seed
    )
    return dict(gen.generate(DataProto({"input_ids": ids, "attention_mask": mask}), sp, n=n).batch)


def _other_experts(routes, num_experts):
    """Each token's experts moved to other ones (a bijection per slot, so top-k ids stay distinct)."""
    return ((routes.astype(np.int32) + 1) % num_experts).astype(routes.dtype)


@pytest.fixture(scope="module")
def moe_rollout():
    """(a random tiny MoE, 2 MoE layers of 4 experts, top-2; its rollout of 2 prompts x 2 samples, 5 tokens)."""
    model = _random_model(_tiny_cfg(), seed=3)
    return model, _rollout(model, n=2)


def test_decode_routes_are_the_routes_forced_in_the_training_forwards_bitwise(moe_rollout):
    """The dense rollout emits `routed_experts [B, P + R, M, k]` (prefill + every decode step) equal, on every real
    token, to the experts the float32 training forward picks; passed through the old-log-prob forward of either
    layout (packed: shared prompts, 2 rows per micro-batch; padded) as forced routes they come back out of its MoE
    layers bit for bit (R2's recorded routes), other forced experts come back as those and move the log-probs."""
    model, b = moe_rollout
    cfg = model.config
    routes, valid = b["routed_experts"], b["attention_mask"].astype(bool)
    assert routes.shape == (4, 11, 2, 2) and routes.dtype == np.uint8 and not routes[~valid].any()
    _, moe = model(b["input_ids"], b["attention_mask"], b["position_ids"], with_moe=True)
    np.testing.assert_array_equal(np.asarray(moe.routed_experts)[valid], routes[valid])

    g, params, rest = steps.split_model(model)
    placement = Placement(None, n_devices=1)
    spec = packing.make_pack_spec(4, 2, 6, 5, share_prompts=True)
    fns = {
        "packed": (jax.jit(update_core.make_log_prob_fn(packed_steps.PACKED, g, rest, **_KW)), spec),
        "padded": (
            jax.jit(update_core.make_log_prob_fn(steps.padded_layout(micro_batch_size=2), g, rest, **_KW)),
            None,
        ),
    }
    other = dict(b, routed_experts=_other_experts(routes, cfg.num_experts))
    for name, (fn, sp) in fns.items():
        run = lambda batch, fn=fn, sp=sp: placement.forward(fn, params, batch, 2, sp, keys=ALL_KEYS, token_output=True)
        lp, _, replayed = run(b)
        np.testing.assert_array_equal(replayed[valid], routes[valid], err_msg=name)
        lp_other, _, forced = run(other)
        np.testing.assert_array_equal(forced[valid], other["routed_experts"][valid], err_msg=name)
        resp = b["response_attention_mask"].astype(bool)
        assert np.abs(lp_other - lp)[resp].max() > 1e-2, name
        np.testing.assert_allclose(lp[resp], b["rollout_log_probs"][resp], atol=2e-5, err_msg=name)


_KW = dict(temperature=1.0, with_entropy=False, record_routes=True)


def _near_tie_models():
    """A 1-layer MoE (E = 2, k = 1) in float32 and bfloat16 whose router is built so that row 0's last prompt token
    goes to expert 0 under the bf16 hidden state and to expert 1 under the float32 one (logit gap +-1e-3 |x|), as
    `tests/models/test_moe_replay.py`; the bf16 model also scores the rollout (Generator, prefill)."""
    from tests.models.test_moe_replay import _moe_input

    cfg = _tiny_cfg(num_layers=1, num_experts=2, num_experts_per_tok=1, norm_topk_prob=False)
    f32, bf16 = _random_model(cfg, seed=7), _random_model(cfg, seed=7, dtype="bfloat16")
    ids, mask = _batch(cfg.vocab_size, b=2, t=6)
    x32 = np.asarray(_moe_input(f32, ids, mask)[0, -1], np.float64)
    x16 = np.asarray(_moe_input(bf16, ids, mask)[0, -1].astype(jnp.float32), np.float64)
    e = x16 - x32
    eta = 1e-3 * np.linalg.norm(x32)
    a, c = np.linalg.solve([[x32 @ x32, x32 @ e], [x16 @ x32, x16 @ e]], [eta, -eta])
    router = np.asarray(f32.layers[0].mlp.router[...]).copy()
    router[:, 1] = router[:, 0] + (a * x32 + c * e)
    for m in (f32, bf16):
        m.layers[0].mlp.router.set_value(jnp.asarray(router))
    return f32, bf16, (ids, mask)


@pytest.mark.slow  # a bf16 Generator and a packed forward compiled: ~60 s on a loaded 2-core CPU
def test_r3_bf16_rollout_scored_in_float32_matches_unless_a_near_tie_flips_without_replay():
    """A bf16 rollout (Generator, greedy) whose last prompt token of prompt 0 nearly ties between two experts, scored
    by the float32 old-log-prob forward (packed): without replay that token takes the other expert and the first
    response token's probability moves (`training/rollout_probs_diff_max` > 0.05); with R3 (the rollout's routes
    forced) the mismatch is the float32 reference routing's, i.e. that of the tokens where both route alike
    (bf16 rounding only, < 0.01 here)."""
    f32, bf16, prompts = _near_tie_models()
    b = _rollout(bf16, greedy=True, prompts=prompts, n=2, r=4)
    assert b["routed_experts"][0, 5, 0, 0] == 0  # prompt 0's last token, rolled out in bf16: expert 0
    g, params, rest = steps.split_model(f32)
    fn = jax.jit(update_core.make_log_prob_fn(packed_steps.PACKED, g, rest, **_KW))
    spec = packing.make_pack_spec(4, 2, 6, 4, share_prompts=True)
    placement, mask = Placement(None, n_devices=1), b["response_attention_mask"]
    free_lp, _, free_routes = placement.forward(fn, params, b, 2, spec, token_output=True)  # R2 / no replay
    r3_lp, _, r3_routes = placement.forward(fn, params, b, 2, spec, keys=ALL_KEYS, token_output=True)
    assert (free_routes[:2, 5, 0, 0] == 1).all() and (r3_routes[:2, 5, 0, 0] == 0).all()  # the float32 router flips

    def diff_max(lp, m):
        out = compute_rollout_probs_diff_metrics(lp, b["rollout_log_probs"], m)
        return float(out["training/rollout_probs_diff_max"])

    alike = mask.copy()
    alike[:2, 0] = 0  # the tokens whose routes agree in float32 and bf16: all but prompt 0's first response token
    reference, free, r3 = diff_max(free_lp, alike), diff_max(free_lp, mask), diff_max(r3_lp, mask)
    print(f"diff_max: reference {reference:.2e}, no replay {free:.2e}, R3 {r3:.2e}")
    assert free > 0.05 and free > 20 * reference, (free, reference)
    assert r3 < 0.01 and r3 <= 2 * reference + 1e-3, (r3, reference)


@pytest.mark.slow  # a padded actor update compile on top of the rollout: ~45 s on a loaded 2-core CPU
def test_actor_update_with_forced_routes_moves_the_router(moe_rollout):
    """The padded actor update (`ppo_update.make_actor_update`) with `routed_experts` in the mini-batch: the forced
    experts are used (other routes, other update) and the router still gets a non-zero update either way."""
    import optax

    from jaxrl_post.rl import ppo_update

    model, b = moe_rollout
    cfg = model.config
    rng = np.random.RandomState(0)
    mb = {k: b[k] for k in ("input_ids", "attention_mask", "position_ids", "responses", "routed_experts")}
    mb["loss_mask"] = b["response_attention_mask"]
    mb["advantages"] = rng.normal(size=b["responses"].shape).astype(np.float32)
    g, params, rest = steps.split_model(model)
    tx = optax.sgd(1.0)
    loss_cfg = ppo_update.ActorLossConfig(on_policy=True)
    update = jax.jit(ppo_update.make_actor_update(steps.padded_layout(n_micro=2), g, rest, tx, loss_cfg))
    deltas = []
    for routes in (b["routed_experts"], _other_experts(b["routed_experts"], cfg.num_experts)):
        new, _, metrics = update(params, tx.init(params), dict(mb, routed_experts=routes))
        deltas.append(np.asarray(new["layers"][1]["mlp"]["router"][...] - params["layers"][1]["mlp"]["router"][...]))
        assert np.isfinite(float(metrics["loss"]))
    assert np.abs(deltas[0]).max() > 1e-4 and np.abs(deltas[1]).max() > 1e-4
    assert np.abs(deltas[0] - deltas[1]).max() > 1e-4


def test_router_replay_config_errors():
    """One `error:`-style line per bad setting: an unknown mode, R3 with the multi-turn rollout (it does not record
    routes; the paged engine does: accepted), replay on a dense model, R2 without an old-log-prob forward."""
    from configs import grpo
    from jaxrl_post.rl.config_check import validate_config
    from jaxrl_post.rl.config_features import router_replay_mode

    c = grpo.get_config("moe_tiny")
    c.actor.router_replay.mode = "R4"
    with pytest.raises(ConfigError, match=r"config.actor.router_replay.mode='R4': valid: \('disabled', 'R2', 'R3'\)"):
        validate_config(c, n_devices=1)
    c.actor.router_replay.mode, c.rollout.name = "R3", "paged"
    validate_config(c, n_devices=1)  # the paged engine records the routes too (tests/rollout/test_paged_moe.py)
    c.rollout.name, c.rollout.multi_turn.enable = "dense", True
    with pytest.raises(ConfigError, match="'R3' is not supported with rollout.multi_turn.enable"):
        validate_config(c, n_devices=1)
    dense = _tiny_cfg(family="qwen3", num_experts=0, num_experts_per_tok=0, moe_intermediate_size=0)
    with pytest.raises(ConfigError, match="mode='R3': the model has no MoE layers"):
        router_replay_mode(c, dense, on_policy=False)
    c.actor.router_replay.mode = "R2"
    with pytest.raises(ConfigError, match="'R2': this run is exactly on-policy"):
        router_replay_mode(c, _tiny_cfg(), on_policy=True)
    assert router_replay_mode(c, _tiny_cfg(), on_policy=False) == "R2"
    c.actor.router_replay.mode = "disabled"
    assert router_replay_mode(c, dense, on_policy=True) == "disabled"
    with pytest.raises(ValueError, match="return_routed_experts needs a model with MoE layers"):
        Generator(_random_model(dense), return_routed_experts=True)


@pytest.mark.slow
@pytest.mark.parametrize("mode,engine", [("R3", "dense"), ("R2", "dense"), ("R3", "paged")])
def test_moe_tiny_grpo_step_with_router_replay(tmp_path, mode, engine):
    """`configs/grpo.py:moe_tiny` with `actor.router_replay.mode`: one GRPO step (the rollout records the routes
    (R3; the dense `Generator` or the paged engine, `rollout.name`) or the old-log-prob forward does (R2); packed
    old-log-prob forward and 2 packed updates replay them) logs the rollout / trainer mismatch
    (`training/rollout_probs_diff_*`, float32 both sides: near 0) and moves the router."""
    import sys

    sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[2]))
    from configs import grpo
    from jaxrl_post.rl.trainer import RLTrainer

    c = grpo.get_config("moe_tiny")
    c.trainer.default_local_dir = str(tmp_path / "run")
    c.trainer.save_freq = -1
    c.trainer.total_training_steps = 1
    c.trainer.val_before_train = c.trainer.val_at_end = False
    c.actor.router_replay.mode, c.rollout.name = mode, engine
    trainer = RLTrainer(c, console_write=lambda s: None)
    try:
        assert trainer.policy.router_replay == mode
        gen = trainer.rollout.generator
        assert (type(gen).__name__ == "PagedGenerator") == (engine == "paged")
        assert gen.return_routed_experts == (mode == "R3")
        before = np.asarray(trainer.state.actor.params["layers"][0]["mlp"]["router"][...])
        hist = trainer.fit()["history"]
        m = hist[-1]
        assert all(np.isfinite(v) for k, v in m.items() if "pearson" not in k)
        # float32 rollout and trainer, routes replayed: equal up to float32 rounding (measured 9e-9 with R3)
        assert 0 <= m["training/rollout_probs_diff_max"] < 1e-4
        assert m["training/rollout_actor_probs_pearson_corr"] > 0.99
        after = np.asarray(trainer.state.actor.params["layers"][0]["mlp"]["router"][...])
        assert np.abs(after - before).max() > 0
    finally:
        trainer.close()
