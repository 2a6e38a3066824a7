"""The estimator / loss registries (issue 32): a toy advantage estimator registered in THIS file only trains a
tiny trainer (its declared inputs drive the trainer: the greedy baseline rollout, the group-size check),
declarations are validated at registration, lookups and the config check list the registered names, and the
trainer logs one line when a loss fixes its own aggregation."""

import logging
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

from configs import grpo
from jaxrl_post.algos import core_algos, registry
from jaxrl_post.algos.registry import register_adv_est, register_policy_loss
from jaxrl_post.errors import ConfigError
from jaxrl_post.rl import builders
from jaxrl_post.rl.config_check import validate_config
from jaxrl_post.rl.config_features import critic_enabled

TOY = "toy_greedy_sign"
SEEN = []  # (scores [B], baselines [B]) as the trainer passed them to the toy estimator


def toy_greedy_sign_advantage(token_level_rewards, response_mask, index, reward_baselines):
    """Toy: ``A_i = 0.5 * sign(s_i - b_i)`` (did the sample beat the greedy response of its prompt?)."""
    del index  # declared to make it group-based (rollout.n >= 2 checked), not used
    s = core_algos.masked_sum(token_level_rewards, response_mask, axis=-1)
    jax.debug.callback(lambda s_, b_: SEEN.append((np.asarray(s_), np.asarray(b_))), s, reward_baselines)
    a = 0.5 * jnp.sign(s - reward_baselines)
    out = jnp.where(response_mask != 0, a[:, None], 0.0)
    return out, out


@pytest.fixture
def toy_estimator():
    """Registers the toy estimator for one test, then removes it (other tests see the built-in set only)."""
    register_adv_est(TOY, needs=("index", "reward_baselines"))(toy_greedy_sign_advantage)
    SEEN.clear()
    yield TOY
    registry.ADV_ESTIMATOR_REGISTRY.remove(TOY)


def _tiny(tmp_path, adv_estimator):
    c = grpo.get_config("tiny")
    c.trainer.default_local_dir = str(tmp_path / "run")
    c.algorithm.adv_estimator = adv_estimator
    c.trainer.total_training_steps = 1
    c.actor.use_kl_loss = False  # no reference pass: keep the test small
    c.actor.ppo_mini_batch_size = c.data.train_batch_size  # one mini-batch: on-policy, no old log-prob pass
    return c


# slow: builds and runs a tiny trainer (rollout, greedy baseline rollout, update: ~4 compiles), 1-2.5 min here
@pytest.mark.slow
def test_toy_estimator_registered_in_a_test_file_trains_a_tiny_trainer(tmp_path, toy_estimator):
    from jaxrl_post.rl.trainer import RLTrainer

    c = _tiny(tmp_path, toy_estimator)
    validate_config(c, n_devices=1)
    assert not critic_enabled(c)  # it does not declare values
    c.rollout.n = 1
    with pytest.raises(ConfigError, match=rf"rollout\.n=1: algorithm\.adv_estimator='{TOY}' compares"):
        validate_config(c, n_devices=1)  # it declares index: group-based
    c.rollout.n = 4

    trainer = RLTrainer(c)
    try:
        (m,) = trainer.fit()["history"]
    finally:
        trainer.close()
    # the declared reward_baselines made the trainer score one greedy response per prompt (ReMax's path)
    assert "timing_s/gen_max" in m
    (s, b) = SEEN[-1]
    n = c.rollout.n
    assert s.shape == b.shape == (c.data.train_batch_size * n,)
    assert np.all(b.reshape(-1, n) == b.reshape(-1, n)[:, :1])  # one baseline per prompt, repeated n times
    want = 0.5 * np.sign(s - b)
    assert m["critic/advantages/max"] == pytest.approx(want.max())
    assert m["critic/advantages/min"] == pytest.approx(want.min())
    assert m["critic/advantages/max"] in (0.5, 0.0) and m["critic/advantages/min"] in (-0.5, 0.0)
    assert trainer.trace_counts["adv"] == 1 and np.isfinite(m["actor/pg_loss"])


def test_compute_advantage_dispatches_on_the_declaration(toy_estimator):
    rewards = jnp.array([[1.0, 0.0], [0.0, 0.0], [2.0, 1.0]])
    mask = jnp.array([[1, 1], [1, 0], [1, 1]])
    base = jnp.array([0.5, 0.5, 5.0])
    adv, ret = core_algos.compute_advantage(
        TOY, token_level_rewards=rewards, response_mask=mask, index=np.array([0, 0, 1]), reward_baselines=base
    )
    np.testing.assert_array_equal(adv, [[0.5, 0.5], [-0.5, 0.0], [-0.5, -0.5]])
    np.testing.assert_array_equal(ret, adv)
    with pytest.raises(ValueError, match=rf"adv_estimator '{TOY}' needs reward_baselines"):
        core_algos.compute_advantage(TOY, token_level_rewards=rewards, response_mask=mask, index=np.array([0, 0, 1]))
    with pytest.raises(ValueError, match=r"'gae' needs values"):
        core_algos.compute_advantage("gae", token_level_rewards=rewards, response_mask=mask)
    with pytest.raises(ValueError, match=rf"algorithm\.adv_estimator 'nope'.*{TOY}"):
        core_algos.get_adv_estimator_fn("nope")  # lists the registered names, the toy included


def test_declarations_are_checked_at_registration(toy_estimator):
    def est(token_level_rewards, response_mask, index):
        return token_level_rewards, token_level_rewards

    with pytest.raises(ValueError, match=r"unknown needs \['critic'\]"):
        register_adv_est("x", needs=("critic",))
    with pytest.raises(ValueError, match=r"has no parameter\(s\) \['values'\]"):
        register_adv_est("x", needs=("values",))(est)
    with pytest.raises(ValueError, match=rf"'{TOY}' is already registered"):
        register_adv_est(TOY, needs=("index",))(est)
    assert "x" not in core_algos.ADV_ESTIMATORS

    def loss(old_log_prob, log_prob, advantages, response_mask, *, loss_agg_mode, rollout_is_weights=None):
        return jnp.zeros(()), {}

    with pytest.raises(ValueError, match="loss_agg_mode 'mean'"):
        register_policy_loss("x", loss_agg_mode="mean")
    with pytest.raises(ValueError, match=r"has no parameter\(s\) \['tau'\]"):
        register_policy_loss("x", params=("tau",))(loss)
    with pytest.raises(ValueError, match="'vanilla' is already registered"):
        register_policy_loss("vanilla")(loss)
    assert "x" not in core_algos.POLICY_LOSSES


def test_config_check_reads_the_registries():
    c = grpo.get_config("tiny")
    c.actor.policy_loss.loss_mode = "ppo"
    c.algorithm.adv_estimator = "grpoo"
    with pytest.raises(ConfigError) as e:
        validate_config(c, n_devices=1)
    msg = str(e.value)
    assert f"valid: {sorted(core_algos.POLICY_LOSSES)}" in msg and "geo_mean" in msg
    assert f"valid: {sorted(core_algos.ADV_ESTIMATORS)}" in msg and "grpo_passk" in msg
    # group-based estimators (declaring index) need groups; values need a critic
    for name in core_algos.ADV_ESTIMATORS:
        c = grpo.get_config("tiny")
        c.algorithm.adv_estimator, c.rollout.n, c.critic.enable = name, 1, None
        needs = registry.adv_estimator_needs(name)
        assert critic_enabled(c) == ("values" in needs)
        with pytest.raises(ConfigError) as e:  # n=1 also breaks the tiny batch arithmetic: an error either way
            validate_config(c, n_devices=1)
        group_msg = f"rollout.n=1: algorithm.adv_estimator={name!r} compares responses within a group"
        assert (group_msg in str(e.value)) == ("index" in needs), (name, str(e.value))
    c = grpo.get_config("tiny")
    c.actor.policy_loss.clip_cov_ratio = 0.0
    c.actor.policy_loss.my_loss_param = "big"  # a new key (ConfigDict types the existing ones)
    with pytest.raises(ConfigError) as e:
        validate_config(c, n_devices=1)
    assert "actor.policy_loss.clip_cov_ratio=0.0: must be in (0, 1]" in str(e.value)
    assert "actor.policy_loss.my_loss_param='big': must be a finite number" in str(e.value)


def test_trainer_logs_one_line_when_a_loss_fixes_its_aggregation(caplog):
    c = grpo.get_config("tiny")
    c.actor.policy_loss.loss_mode = "gspo"
    c.actor.policy_loss.ppo_kl_coef = 0.7
    with caplog.at_level(logging.INFO, logger=builders.log.name):
        cfg = builders.actor_loss_config(c, on_policy=False)
    lines = [r.getMessage() for r in caplog.records if r.name == builders.log.name]
    assert len(lines) == 1 and "gspo" in lines[0] and "'seq-mean-token-mean'" in lines[0] and "'token-mean'" in lines[0]
    assert dict(cfg.policy_loss_params)["ppo_kl_coef"] == 0.7 and "loss_mode" not in dict(cfg.policy_loss_params)
    caplog.clear()
    for mode, agg in (("gspo", "seq-mean-token-mean"), ("vanilla", "token-mean")):
        c.actor.policy_loss.loss_mode, c.actor.loss_agg_mode = mode, agg
        with caplog.at_level(logging.INFO, logger=builders.log.name):
            builders.actor_loss_config(c, on_policy=False)
    assert not [r for r in caplog.records if r.name == builders.log.name]


@pytest.mark.slow  # a subprocess starting the package from scratch (27 s on 2 shared, loaded cores)
def test_a_new_loss_is_one_file_in_the_package(tmp_path):
    """Drop a file into a copy of jaxrl_post/algos/policy_losses/: the loss is registered, the config check accepts
    it and the docs generator lists it, with no other file edited."""
    import shutil
    import subprocess
    import textwrap

    shutil.copytree(
        os.path.join(REPO, "jaxrl_post"), tmp_path / "jaxrl_post", ignore=shutil.ignore_patterns("__pycache__")
    )
    (tmp_path / "jaxrl_post" / "algos" / "policy_losses" / "toy_loss.py").write_text(
        textwrap.dedent(
            '''
            """A toy loss."""
            from jaxrl_post.algos.policy_losses._common import finish
            from jaxrl_post.algos.registry import register_policy_loss

            @register_policy_loss("toy_neg_logp")
            def compute_policy_loss_toy(old_log_prob, log_prob, advantages, response_mask, *, clip_ratio_low=0.2,
                                        clip_ratio_high=0.2, clip_ratio_c=3.0, loss_agg_mode="token-mean",
                                        rollout_is_weights=None, **agg_kwargs):
                """Toy: -logp."""
                return finish(-log_prob, response_mask, loss_agg_mode, rollout_is_weights, agg_kwargs, 0.0, 0.0, 0.0)
            '''
        )
    )
    code = textwrap.dedent(
        f"""
        import sys
        sys.path[:0] = [{str(tmp_path)!r}, {REPO!r}]
        import jax.numpy as jnp
        import jaxrl_post
        assert jaxrl_post.__file__.startswith({str(tmp_path)!r}), jaxrl_post.__file__
        from configs import grpo
        from jaxrl_post.algos.core_algos import compute_policy_loss
        from jaxrl_post.rl.config_check import validate_config
        c = grpo.get_config("tiny")
        c.actor.policy_loss.loss_mode = "toy_neg_logp"
        validate_config(c, n_devices=1)
        loss, _ = compute_policy_loss(jnp.zeros((1, 2)), jnp.array([[-1.0, -3.0]]), jnp.ones((1, 2)),
                                      jnp.ones((1, 2)), loss_mode="toy_neg_logp")
        assert float(loss) == 2.0, loss
        import importlib.util
        spec = importlib.util.spec_from_file_location("gen", {os.path.join(REPO, "scripts", "gen_config_docs.py")!r})
        gen = importlib.util.module_from_spec(spec)
        sys.modules["gen"] = gen
        spec.loader.exec_module(gen)
        assert "toy_neg_logp" in gen.registry_names()["actor.policy_loss.loss_mode"]
        assert "toy_neg_logp" in gen.render_algorithm_tables()
        print("OK")
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert out.returncode == 0 and out.stdout.strip() == "OK", out.stderr[-3000:]
