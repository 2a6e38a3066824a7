"""Trainer / main job tests: config validation, micro-batch accumulation, tiny GRPO and PPO runs end to
end (in-process), compile-once, and the README main-job command (reduced) in a subprocess."""

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

from configs import grpo, ppo
from jaxrl_post.algos import core_algos
from jaxrl_post.config import UnknownConfigKeyError, check_override_keys
from jaxrl_post.engine import steps
from jaxrl_post.errors import ConfigError
from jaxrl_post.rl import ppo_update
from jaxrl_post.rl.config_check import validate_config
from tests.cheap_compile import CHEAP_COMPILE_FLAGS

# verl metric names the issue requires every step (PPO adds critic/values/*, critic/vf_*).
REQUIRED_METRICS = [
    *(f"critic/{k}/{s}" for k in ("score", "rewards", "advantages", "returns") for s in ("mean", "max", "min")),
    "actor/pg_loss",
    "actor/pg_clipfrac",
    "actor/pg_clipfrac_lower",
    "actor/ppo_kl",
    "actor/entropy",
    "actor/grad_norm",
    "actor/lr",
    *(f"response_length/{s}" for s in ("mean", "max", "min", "clip_ratio")),
    *(f"prompt_length/{s}" for s in ("mean", "max", "min", "clip_ratio")),
    *(f"timing_s/{k}" for k in ("gen", "reward", "adv", "update_actor", "step")),
    "perf/total_num_tokens",
    "perf/time_per_step",
    "perf/throughput",
    "perf/mfu/actor",
]


def _tiny(module, tmp_path, name):
    c = module.get_config("tiny")
    c.trainer.default_local_dir = str(tmp_path / name)
    return c


def _read_jsonl(path):
    with open(path) as f:
        return [json.loads(line) for line in f]


# ----------------------------------------------------------------------------------------- config checks
def test_config_validation_names_the_key(tmp_path):
    for mod, var in [(grpo, None), (grpo, "gsm8k"), (grpo, "lora"), (grpo, "tiny"), (ppo, None), (ppo, "tiny")]:
        if var == "gsm8k" and not os.path.exists(grpo.GSM8K_DIR):
            continue
        validate_config(mod.get_config(var), n_devices=1)

    cases = [
        ("actor.ppo_mini_batch_size", 3, "actor.ppo_mini_batch_size"),  # 4 prompts per step % 3 prompts
        ("actor.ppo_mini_batch_size", 8, "actor.ppo_mini_batch_size"),  # 8 prompts > the 4 of a step
        ("actor.ppo_micro_batch_size", 3, "actor.ppo_micro_batch_size"),  # 2 prompts x 4 = 8 responses % 3
        ("algorithm.adv_estimator", "nope", "algorithm.adv_estimator"),
        ("actor.policy_loss.loss_mode", "nope", "actor.policy_loss.loss_mode"),
        ("actor.loss_agg_mode", "mean", "actor.loss_agg_mode"),
        ("actor.kl_loss_type", "kl2", "actor.kl_loss_type"),
        ("algorithm.kl_ctrl.type", "pid", "algorithm.kl_ctrl.type"),
        ("rollout.n", 1, "rollout.n"),  # grpo needs groups
        ("rollout.top_p", 0.0, "rollout.top_p"),
        ("actor.optim.warmup_style", "linear", "actor.optim.warmup_style"),
        ("model.param_dtype", "fp32", "model.param_dtype"),
        ("rollout.dtype", "bf16", "rollout.dtype"),
        ("data.train_files", str(tmp_path / "missing.jsonl"), "data.train_files"),
    ]
    for key, value, expect in cases:
        c = grpo.get_config("tiny")
        node = c
        *parents, leaf = key.split(".")
        for p in parents:
            node = node[p]
        node[leaf] = value
        with pytest.raises(ConfigError, match=expect.replace(".", r"\.")):
            validate_config(c, n_devices=1)

    # mini-batch vs the mesh's data-parallel size (8 devices, data*fsdp = 8: micro-batch 4 is not divisible)
    c = grpo.get_config("tiny")
    with pytest.raises(ConfigError, match=r"actor\.ppo_micro_batch_size.*data-parallel"):
        validate_config(c, n_devices=8)
    # the critic's mini-batch also counts prompts (ppo tiny: 4 prompts per step)
    c = ppo.get_config("tiny")
    c.critic.ppo_mini_batch_size = 3
    with pytest.raises(ConfigError, match=r"critic\.ppo_mini_batch_size=3: data\.train_batch_size = 4 prompts"):
        validate_config(c, n_devices=1)
    # gae without a critic
    c = grpo.get_config("tiny")
    c.algorithm.adv_estimator = "gae"
    with pytest.raises(ConfigError, match=r"critic\.enable"):
        validate_config(c, n_devices=1)
    # several problems are reported together
    c = grpo.get_config("tiny")
    c.actor.loss_agg_mode = "x"
    c.algorithm.kl_ctrl.type = "y"
    with pytest.raises(ConfigError) as e:
        validate_config(c, n_devices=1)
    assert "actor.loss_agg_mode" in str(e.value) and "algorithm.kl_ctrl.type" in str(e.value)


def test_invalid_config_fails_before_building(tmp_path):
    """The trainer validates before loading a model: a bad key wins over an unloadable model path."""
    from jaxrl_post.rl.trainer import RLTrainer

    c = _tiny(grpo, tmp_path, "bad")
    c.model.random_init = False
    c.model.path = str(tmp_path / "no_such_model")
    c.actor.ppo_mini_batch_size = 5
    with pytest.raises(ConfigError, match=r"actor\.ppo_mini_batch_size"):
        RLTrainer(c)


def test_unknown_override_key_is_named():
    cfg = os.path.join(REPO, "configs", "grpo.py")
    with pytest.raises(UnknownConfigKeyError, match=r"config\.actor\.ppo_mini_batchsize.*ppo_mini_batch_size"):
        check_override_keys(["prog", f"--config={cfg}:tiny", "--config.actor.ppo_mini_batchsize=4"])
    check_override_keys(["prog", f"--config={cfg}:tiny", "--config.actor.ppo_mini_batch_size=4"])
    # space form of --config, and absl's `--flag value` form, are fine
    check_override_keys(["prog", "--config", f"{cfg}:tiny", "--verbosity", "1", "--config.rollout.n=2"])
    with pytest.raises(UnknownConfigKeyError, match=r"config\.rollout\.nn.*did you mean config\.rollout\.n\b"):
        check_override_keys(["prog", "--config", f"{cfg}:tiny", "--config.rollout.nn=2"])
    # verl's full key names point at ours
    with pytest.raises(UnknownConfigKeyError, match=r"did you mean config\.actor\.ppo_mini_batch_size \(verl's"):
        check_override_keys(["prog", f"--config={cfg}:tiny", "--config.actor_rollout_ref.actor.ppo_mini_batch_size=2"])


@pytest.mark.parametrize(
    "arg,hint",
    [
        ("rollout.n=2", "did you mean --config.rollout.n=2?"),  # Hydra style, as verl's command lines
        ("actor_rollout_ref.rollout.n=2", "did you mean --config.rollout.n=2?"),
        ("data.train_batch_size=8", "did you mean --config.data.train_batch_size=8?"),
        ("stray", "overrides are written --config.KEY=VALUE"),
    ],
)
def test_positional_overrides_are_refused_not_ignored(arg, hint):
    """absl ignores positional arguments; a verl user's `rollout.n=2` must not silently train with the default."""
    cfg = os.path.join(REPO, "configs", "grpo.py")
    with pytest.raises(UnknownConfigKeyError, match=f"unexpected argument '{arg}'") as e:
        check_override_keys(["prog", f"--config={cfg}:tiny", arg])
    assert hint in str(e.value)


def test_missing_config_file_is_named():
    with pytest.raises(FileNotFoundError, match=r"config file not found: nope\.py"):
        check_override_keys(["prog", "--config=nope.py:tiny"])


# ----------------------------------------------------------------------------------------- update math
def _tiny_model(vocab=64):
    from jaxrl_post.models import ModelConfig, init_model

    cfg = ModelConfig(
        vocab_size=vocab,
        hidden_size=32,
        intermediate_size=64,
        num_layers=1,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        tie_word_embeddings=True,
    )
    return init_model(cfg, seed=3)


def _rollout_batch(b=8, p=5, r=6, vocab=64, seed=0):
    rng = np.random.default_rng(seed)
    ids = rng.integers(3, vocab, (b, p + r)).astype(np.int32)
    prompt_mask = np.ones((b, p), np.int32)
    prompt_mask[:3, :2] = 0  # left padding
    lens = rng.integers(1, r + 1, b)
    lens[0] = r
    resp_mask = (np.arange(r)[None] < lens[:, None]).astype(np.int32)
    mask = np.concatenate([prompt_mask, resp_mask], 1)
    pos = np.maximum(np.cumsum(mask, 1) - 1, 0).astype(np.int32)
    return dict(
        input_ids=ids,
        attention_mask=mask,
        position_ids=pos,
        responses=ids[:, p:],
        loss_mask=resp_mask,
        advantages=rng.normal(size=(b, r)).astype(np.float32),
        old_log_probs=(rng.normal(size=(b, r)) * 0.3 - 4.2).astype(np.float32),
        ref_log_prob=(rng.normal(size=(b, r)) * 0.3 - 4.2).astype(np.float32),
        values=rng.normal(size=(b, r)).astype(np.float32),
        returns=rng.normal(size=(b, r)).astype(np.float32),
    )


def _max_diff(a, b):
    return max(float(jnp.max(jnp.abs(x - y))) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


# token-mean normalises by the mini-batch's tokens, seq-mean-token-mean by its sequences (the other two
# modes use the same counts; agg_loss itself is tested for all modes in test_core_algos).
@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
@pytest.mark.slow
def test_micro_batch_accumulation_equals_full_batch(mode):
    model = _tiny_model()
    graphdef, params, rest = steps.split_model(model)
    batch = _rollout_batch()
    tx = optax.sgd(1.0)  # the update IS the gradient: compares gradients, not Adam's normalisation
    loss_cfg = ppo_update.ActorLossConfig(
        loss_agg_mode=mode,
        clip_ratio_low=0.2,
        clip_ratio_high=0.28,
        entropy_coeff=0.01,
        use_kl_loss=True,
        kl_loss_coef=0.1,
        kl_loss_type="low_var_kl",
        temperature=0.7,
    )
    outs = {}
    for n_micro in (1, 4):
        fn = jax.jit(ppo_update.make_actor_update(steps.padded_layout(n_micro=n_micro), graphdef, rest, tx, loss_cfg))
        new_params, _, metrics = fn(params, tx.init(params), batch)
        outs[n_micro] = (new_params, jax.device_get(metrics))
    for n_micro in (4,):
        assert _max_diff(outs[n_micro][0], outs[1][0]) <= 1e-6
        for k, v in outs[1][1].items():
            np.testing.assert_allclose(outs[n_micro][1][k], v, atol=1e-6, err_msg=k)

    # The un-split loss itself, written out independently (log_softmax of logits / T at P-1..T-2).
    p, r, t = 5, 6, 0.7

    def reference_loss(prm):
        from flax import nnx

        m = nnx.merge(graphdef, prm, rest)
        logits = m(batch["input_ids"], batch["attention_mask"], positions=batch["position_ids"])
        logits = logits[:, p - 1 : p + r - 1] / t
        logp_all = jax.nn.log_softmax(logits, -1)
        logp = jnp.take_along_axis(logp_all, batch["responses"][..., None], -1)[..., 0]
        ent = -jnp.sum(jnp.exp(logp_all) * logp_all, -1)
        mask = batch["loss_mask"].astype(jnp.float32)
        ratio = jnp.exp(logp - batch["old_log_probs"])
        adv = batch["advantages"]
        pg = jnp.maximum(-adv * ratio, -adv * jnp.clip(ratio, 0.8, 1.28))
        pg = jnp.where(adv < 0, jnp.minimum(pg, -adv * 3.0), pg)
        d = batch["ref_log_prob"] - logp
        kl = jnp.clip(jnp.exp(d) - d - 1, -10, 10)

        def agg(x):
            n_seq = jnp.sum(mask.sum(-1) > 0)
            if mode == "token-mean":
                return jnp.sum(x * mask) / jnp.sum(mask)
            if mode == "seq-mean-token-sum":
                return jnp.sum(x * mask) / n_seq
            if mode == "seq-mean-token-mean":
                return jnp.sum(jnp.sum(x * mask, -1) / jnp.maximum(mask.sum(-1), 1)) / n_seq
            return jnp.sum(jnp.sum(x * mask, -1) / r) / n_seq

        return agg(pg) - 0.01 * agg(ent) + 0.1 * agg(kl)

    ref_grads = jax.jit(jax.grad(reference_loss))(params)
    expected = jax.tree.map(lambda a, g: a - g, params, ref_grads)
    assert _max_diff(outs[1][0], expected) <= 2e-6
    np.testing.assert_allclose(outs[1][1]["loss"], jax.jit(reference_loss)(params), rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_critic_micro_batch_accumulation_and_on_policy_ratio():
    from flax import nnx

    from jaxrl_post.models import CriticModel

    critic = CriticModel.from_actor(_tiny_model(), nnx.Rngs(1))
    graphdef, params, rest = steps.split_model(critic)
    # a non-zero head so the value gradient reaches the backbone
    params["value_head"][...] = jnp.full(params["value_head"][...].shape, 0.05, jnp.float32)
    batch = _rollout_batch(seed=1)
    tx = optax.sgd(1.0)
    cfg = ppo_update.CriticLossConfig(cliprange_value=0.5, loss_agg_mode="token-mean")
    res = [
        jax.jit(ppo_update.make_critic_update(steps.padded_layout(n_micro=n), graphdef, rest, tx, cfg))(
            params, tx.init(params), batch
        )
        for n in (1, 4)
    ]
    assert _max_diff(res[0][0], res[1][0]) <= 1e-6
    np.testing.assert_allclose(res[0][2]["vf_loss"], res[1][2]["vf_loss"], rtol=1e-6)

    # on-policy: old log-probs = stop_gradient(current) -> ratio 1, no clipping, zero ppo_kl
    g2, p2, r2 = steps.split_model(_tiny_model())
    fn = jax.jit(
        ppo_update.make_actor_update(
            steps.padded_layout(n_micro=2), g2, r2, tx, ppo_update.ActorLossConfig(on_policy=True)
        )
    )
    b = {k: v for k, v in _rollout_batch().items() if k != "old_log_probs"}
    _, _, m = fn(p2, tx.init(p2), b)
    assert float(m["ppo_kl"]) == 0.0 and float(m["pg_clipfrac"]) == 0.0
    mask = b["loss_mask"]
    np.testing.assert_allclose(m["pg_loss"], -(b["advantages"] * mask).sum() / mask.sum(), rtol=1e-5)


def test_drop_truncated_removes_tokens_from_numerator_and_denominator():
    mask = np.array([[1, 1, 1], [1, 1, 0], [1, 0, 0]], np.int32)
    truncated = np.array([True, False, False])
    np.testing.assert_array_equal(steps.compute_loss_mask(mask, truncated, False), mask)
    lm = steps.compute_loss_mask(mask, truncated, True)
    np.testing.assert_array_equal(lm, [[0, 0, 0], [1, 1, 0], [1, 0, 0]])
    loss = np.array([[9.0, 9.0, 9.0], [1.0, 2.0, 7.0], [3.0, 5.0, 5.0]], np.float32)
    # token-mean over the 3 kept tokens only; seq-mean over the 2 kept sequences only
    np.testing.assert_allclose(core_algos.agg_loss(loss, lm, "token-mean"), (1 + 2 + 3) / 3, rtol=1e-6)
    np.testing.assert_allclose(core_algos.agg_loss(loss, lm, "seq-mean-token-sum"), (3 + 3) / 2, rtol=1e-6)


def test_lr_schedule_warmup_and_cosine():
    f = steps.make_lr_schedule(
        steps.OptimConfig(
            lr=1.0, total_steps=6, warmup_steps=2, warmup_style="cosine", min_lr_ratio=0.1, updates_per_step=2
        )
    )
    lrs = [float(f(i)) for i in range(12)]
    # two optimizer updates per training step share one lr; warmup (s+1)/2; cosine over the 4 later steps
    expected_steps = [0.5, 1.0] + [0.1 + 0.9 * 0.5 * (1 + np.cos(np.pi * k / 4)) for k in range(4)]
    np.testing.assert_allclose(lrs, np.repeat(expected_steps, 2), rtol=1e-6)


# ----------------------------------------------------------------------------------------- end to end
def _check_common(history, trainer, workdir):
    for m in history:
        for k in REQUIRED_METRICS:
            assert k in m, k
        for k, v in m.items():
            assert np.isfinite(v), (k, v)
    lines = _read_jsonl(os.path.join(workdir, "metrics.jsonl"))
    steps_logged = [line["step"] for line in lines if "critic/score/mean" in line]
    assert steps_logged == [1, 2]
    val_lines = [line for line in lines if any(k.startswith("val-core/") for k in line)]
    assert [line["step"] for line in val_lines] == [0, 2]
    key = "val-core/reasoning_gym/basic_arithmetic/reward/mean@1"
    assert all(key in line for line in val_lines)
    # compile once: every jitted forward/update has exactly one executable after two steps...
    assert set(trainer.compile_counts().values()) == {1}, trainer.compile_counts()
    assert set(trainer.trace_counts.values()) == {1}, trainer.trace_counts


def _assert_third_step_compiles_nothing(trainer):
    from jaxrl_post.rollout import TRACE_COUNTS

    before = (dict(trainer.trace_counts), dict(TRACE_COUNTS), trainer.compile_counts())
    trainer.train_step(next(trainer.data.train_loader))
    assert (dict(trainer.trace_counts), dict(TRACE_COUNTS), trainer.compile_counts()) == before


@pytest.mark.slow
def test_grpo_tiny_two_steps_end_to_end(tmp_path):
    from jaxrl_post.rl.trainer import RLTrainer

    c = _tiny(grpo, tmp_path, "grpo")
    lines = []
    trainer = RLTrainer(c, console_write=lines.append)
    assert not trainer.geometry.on_policy and trainer.reference is not None and trainer.critic is None
    init_params = jax.tree.map(np.asarray, trainer.state.actor.params)
    try:
        result = trainer.fit()
        hist = result["history"]
        assert len(hist) == 2 and trainer.global_steps == 2
        _check_common(hist, trainer, c.trainer.default_local_dir)
        for m in hist:
            assert "actor/kl_loss" in m and "timing_s/old_log_prob" in m and "timing_s/ref" in m
            assert m["actor/lr"] == pytest.approx(1e-3)
            assert m["response_length/max"] <= 12
        # 16 responses with a toy reward that varies inside groups -> non-zero GRPO advantages
        assert hist[0]["critic/advantages/max"] > 0 > hist[0]["critic/advantages/min"]
        # params moved; the reference stayed the initial actor; the rollout model sees the new params
        assert _max_diff(trainer.state.actor.params, init_params) > 0
        assert _max_diff(trainer.reference.params, init_params) == 0
        from flax import nnx

        assert _max_diff(nnx.state(trainer.policy.model, nnx.Param), trainer.state.actor.params) == 0
        assert any(line.startswith("step 2 | score=") for line in lines)
        assert os.path.exists(os.path.join(c.trainer.default_local_dir, "config.json"))
        _assert_third_step_compiles_nothing(trainer)
    finally:
        trainer.close()


@pytest.mark.slow
def test_ppo_tiny_two_steps_end_to_end(tmp_path):
    from jaxrl_post.rl.trainer import RLTrainer

    c = _tiny(ppo, tmp_path, "ppo")
    trainer = RLTrainer(c)
    assert trainer.critic is not None and trainer.reference is not None
    init_actor = jax.tree.map(np.asarray, trainer.state.actor.params)
    init_critic = jax.tree.map(np.asarray, trainer.state.critic.params)
    try:
        result = trainer.fit()
        h1, h2 = result["history"]
        # critic_warmup=1: step 1 trains only the critic
        assert "actor/pg_loss" not in h1 and "critic/vf_loss" in h1
        with pytest.raises(AssertionError):
            _check_common([h1], trainer, c.trainer.default_local_dir)
        _check_common([h2], trainer, c.trainer.default_local_dir)
        for m in (h1, h2):
            for k in (
                "critic/vf_loss",
                "critic/vf_clipfrac",
                "critic/grad_norm",
                "critic/lr",
                "critic/values/mean",
                "critic/vf_explained_var",
                "actor/reward_kl_penalty",
                "actor/reward_kl_penalty_coeff",
                "timing_s/values",
                "timing_s/update_critic",
            ):
                assert k in m, k
        assert _max_diff(trainer.state.critic.params, init_critic) > 0
        assert _max_diff(trainer.state.actor.params, init_actor) > 0
        _assert_third_step_compiles_nothing(trainer)
        # the actor moved in step 2, so step 3's KL-in-reward is non-zero and the adaptive beta moved
        assert trainer.host.kl_ctrl.value != pytest.approx(0.01, abs=0)
    finally:
        trainer.close()


@pytest.mark.slow
def test_verl_mini_batch_sizes_count_prompts(tmp_path):
    """A verl-style config: train_batch_size=4 prompts, rollout.n=8, ppo_mini_batch_size=2 prompts -> each
    training step makes 2 actor and 2 critic optimizer steps of 2 * 8 = 16 responses; the adaptive KL
    controller advances by the step's 32 responses (verl: `n_steps=batch_size` after `repeat`)."""
    from jaxrl_post.rl.trainer import RLTrainer

    c = _tiny(ppo, tmp_path, "verl_geometry")
    c.data.train_batch_size = 4
    c.rollout.n = 8
    c.actor.ppo_mini_batch_size = 2
    c.critic.ppo_mini_batch_size = 2
    c.trainer.critic_warmup = 0
    c.algorithm.kl_ctrl.horizon = 1000
    trainer = RLTrainer(c)
    seen = {"actor": [], "critic": []}

    def spy(role, fn):
        def wrapped(params, opt_state, mb):
            from jaxrl_post.engine.packed_steps import PACK_KEYS

            rows = {k: v.shape[0] for k, v in mb.items() if k not in PACK_KEYS}  # [M, R] fields
            if "seq_index" in mb:  # packed (model.use_remove_padding): sequences placed in the plan
                rows["packed_sequences"] = int(np.sum(np.asarray(mb["seq_index"]) >= 0))
            seen[role].append(rows)
            return fn(params, opt_state, mb)

        return wrapped

    trainer.policy.trained.update = spy("actor", trainer.policy.trained.update)
    trainer.critic.trained.update = spy("critic", trainer.critic.trained.update)
    try:
        m = trainer.train_step(next(trainer.data.train_loader))
        for role in ("actor", "critic"):
            assert len(seen[role]) == 2, seen[role]
            assert all(set(rows.values()) == {16} for rows in seen[role]), seen[role]
        assert (trainer.host.actor_update_count, trainer.host.critic_update_count) == (2, 2)
        assert not trainer.geometry.on_policy and "timing_s/old_log_prob" in m  # 2 mini-batches: old log-probs needed
        kl, target = m["actor/reward_kl_penalty"], c.algorithm.kl_ctrl.target_kl
        err = min(max(kl / target - 1.0, -0.2), 0.2)
        assert trainer.host.kl_ctrl.value == pytest.approx(0.01 * (1.0 + err * 32 / 1000), rel=1e-12)
    finally:
        trainer.close()


@pytest.mark.slow
def test_main_job_command_reduced(tmp_path):
    """README: `python -m jaxrl_post.main --config=configs/grpo.py ...`, reduced to the tiny config."""
    workdir = tmp_path / "main_run"
    env = dict(os.environ, JAX_PLATFORMS="cpu", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    cmd = [
        sys.executable,
        "-m",
        "jaxrl_post.main",
        "--config=configs/grpo.py:tiny",
        "--config.trainer.total_training_steps=1",
        f"--config.trainer.default_local_dir={workdir}",
        "--config.trainer.val_before_train=False",
        "--config.trainer.val_at_end=False",
        "--config.actor.ppo_mini_batch_size=4",  # prompts: the whole step (16 responses)
        "--config.actor.use_kl_loss=False",
        "--config.actor.optim.lr=1e-4",
    ]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = _read_jsonl(workdir / "metrics.jsonl")
    step1 = [line for line in lines if line["step"] == 1 and "critic/score/mean" in line]
    assert len(step1) == 1
    m = step1[0]
    assert m["actor/lr"] == pytest.approx(1e-4)
    assert "timing_s/old_log_prob" not in m and "timing_s/ref" not in m  # on-policy, no KL: skipped
    assert "step 1 | score=" in proc.stdout
    cfg = json.loads((workdir / "config.json").read_text())
    assert cfg["trainer"]["total_training_steps"] == 1

    bad = subprocess.run(
        cmd[:4] + ["--config.actor.clip_ratio_hihg=0.3"], cwd=REPO, env=env, capture_output=True, text=True, timeout=120
    )
    assert bad.returncode != 0 and "config.actor.clip_ratio_hihg" in bad.stderr
    assert "config.actor.clip_ratio_high" in bad.stderr  # suggestion


_MESH_SCRIPT = r"""
import json, os, sys
sys.path.insert(0, os.getcwd())
from configs import ppo
from jaxrl_post.rl.trainer import RLTrainer

def main():
  import jax
  assert jax.device_count() == 8
  c = ppo.get_config('tiny')
  c.trainer.default_local_dir = sys.argv[1]
  c.trainer.mesh.data, c.trainer.mesh.fsdp, c.trainer.mesh.tensor = 2, 2, 2
  c.trainer.val_before_train = False
  trainer = RLTrainer(c)
  emb = trainer.state.actor.params['embedding'][...]
  result = trainer.fit()
  out = {'spec': str(emb.sharding.spec), 'counts': trainer.compile_counts(), 'last': result['last']}
  trainer.close()
  print('RESULT' + json.dumps(out))

if __name__ == '__main__':
  main()
"""


@pytest.mark.slow
def test_tiny_ppo_on_8_fake_devices(tmp_path):
    """The same loop on a ('data', 'fsdp', 'tensor') = (2, 2, 2) mesh of 8 fake CPU devices."""
    script = tmp_path / "mesh_run.py"
    script.write_text(_MESH_SCRIPT)
    env = dict(
        os.environ,
        JAX_PLATFORMS="cpu",
        XLA_FLAGS="--xla_force_host_platform_device_count=8 " + CHEAP_COMPILE_FLAGS,
    )
    proc = subprocess.run(
        [sys.executable, str(script), str(tmp_path / "run")],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.split("RESULT", 1)[1])
    assert out["spec"] == "P('tensor', 'fsdp')"  # vocab over tensor, embed over fsdp
    assert set(out["counts"].values()) == {1}, out["counts"]
    last = out["last"]
    for k in ("actor/pg_loss", "critic/vf_loss", "critic/score/mean", "actor/grad_norm"):
        assert np.isfinite(last[k]), k
