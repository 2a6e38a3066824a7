"""Precision policy: float32 master weights and optimizer state (`model.param_dtype`), compute in
`model.dtype` inside the jitted forward, and the rollout copy in `rollout.dtype` refreshed by `sync_weights`."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from configs import grpo
from jaxrl_post.engine import steps
from jaxrl_post.models import ModelConfig, init_model
from jaxrl_post.rl import builders, ppo_update


def _bits_changed(new, old, dtype):
    """Fraction of elements whose value, stored in `dtype`, differs."""
    n = sum(
        int(jnp.sum(a.astype(dtype) != b.astype(dtype))) for a, b in zip(jax.tree.leaves(new), jax.tree.leaves(old))
    )
    return n / sum(a.size for a in jax.tree.leaves(new))


@pytest.mark.slow
def test_update_below_bf16_resolution_changes_only_f32_master_weights():
    """An AdamW step of ~lr per element is below half a bfloat16 ulp for |w| >~ 2**8 * lr: bf16-stored params
    (almost) do not move, f32 master weights do -- and with bf16 compute both runs see the same forward."""
    cfg = ModelConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=1, num_heads=4, num_kv_heads=2, head_dim=8
    )
    rng = np.random.default_rng(0)
    b, p, r = 4, 5, 6
    ids = rng.integers(3, 64, (b, p + r)).astype(np.int32)
    batch = dict(
        input_ids=ids,
        attention_mask=np.ones((b, p + r), np.int32),
        position_ids=np.tile(np.arange(p + r, dtype=np.int32), (b, 1)),
        responses=ids[:, p:],
        loss_mask=np.ones((b, r), np.int32),
        advantages=rng.normal(size=(b, r)).astype(np.float32),
    )
    lr = 2e-6  # bf16 has 8 significant bits: the step is below half an ulp for |w| > ~5e-4
    changed = {}
    for param_dtype in ("float32", "bfloat16"):
        model = init_model(cfg, seed=1, dtype="bfloat16", param_dtype=param_dtype)
        g, params, rest = steps.split_model(model)
        assert {x.dtype for x in jax.tree.leaves(params)} == {jnp.dtype(param_dtype)}
        tx = steps.make_optimizer(steps.OptimConfig(lr=lr, weight_decay=0.0))
        opt = tx.init(params)
        # AdamW moments live in the param dtype: float32 with float32 masters
        assert {x.dtype for x in jax.tree.leaves(opt) if x.ndim} == {jnp.dtype(param_dtype)}
        update = jax.jit(
            ppo_update.make_actor_update(
                steps.padded_layout(n_micro=1), g, rest, tx, ppo_update.ActorLossConfig(on_policy=True)
            )
        )
        new, _, m = update(params, opt, batch)
        assert m["update_skipped"] == 0 and m["grad_norm"] > 0
        changed[param_dtype] = (_bits_changed(new, params, param_dtype), _bits_changed(new, params, jnp.bfloat16))
    f32_master, f32_as_bf16 = changed["float32"]
    bf16_master, _ = changed["bfloat16"]
    assert f32_master > 0.85  # every master weight with a gradient moved (unused embedding rows have none) ...
    assert f32_as_bf16 < 0.1  # ... although most of them round to the same bfloat16 value
    assert bf16_master < 0.1  # bf16 storage loses those updates
    assert f32_master > 10 * bf16_master


@pytest.mark.slow
def test_bf16_compute_f32_master_tiny_grpo_trains_with_a_bf16_rollout_copy(tmp_path):
    """Tiny GRPO with `model.dtype=bfloat16` (f32 masters): the rollout runs on a bfloat16 copy kept equal to
    the cast actor params by `sync_weights`, whose forward equals the actor's bf16-compute forward bitwise;
    the toy reward rises as in float32 (same seed: f32 0.127 -> 0.191 mean of the first/last 3 steps)."""
    from jaxrl_post.rl.trainer import RLTrainer

    c = grpo.get_config("tiny")
    c.trainer.default_local_dir = str(tmp_path / "bf16")
    c.trainer.save_freq = -1
    c.trainer.total_training_steps = 12
    c.trainer.val_before_train = c.trainer.val_at_end = False
    c.model.dtype = "bfloat16"
    trainer = RLTrainer(c, console_write=lambda s: None)
    try:
        assert trainer.rollout.copy and trainer.rollout.generator.model is trainer.rollout.model
        hist = trainer.fit()["history"]
        assert {x.dtype for x in jax.tree.leaves(trainer.state.actor.params)} == {jnp.dtype("float32")}
        rollout = jax.tree.leaves(trainer.state.rollout)
        assert {x.dtype for x in rollout} == {jnp.dtype("bfloat16")}
        for a, r in zip(jax.tree.leaves(trainer.state.actor.params), rollout):  # refreshed after the last update
            np.testing.assert_array_equal(np.asarray(a.astype(jnp.bfloat16)), np.asarray(r))
        ids = jnp.asarray(np.random.default_rng(0).integers(3, 100, (2, 9)), jnp.int32)
        mask = jnp.ones((2, 9), jnp.int32)
        fwd = nnx.jit(lambda m: m(ids, mask))
        np.testing.assert_array_equal(np.asarray(fwd(trainer.rollout.model)), np.asarray(fwd(trainer.policy.model)))
        # the frozen reference (KL loss on) is held in bf16, norm scales as stored
        assert trainer.reference is not None and {
            (x.ndim >= 2, x.dtype.name) for x in jax.tree.leaves(trainer.reference.params)
        } == {
            (True, "bfloat16"),
            (False, "float32"),
        }
        score = [m["critic/score/mean"] for m in hist]
        assert all(np.isfinite(list(m.values())).all() for m in hist)
        assert np.mean(score[-3:]) > np.mean(score[:3]) + 0.04, score
    finally:
        trainer.close()


@pytest.mark.parametrize("packed", [True, False], ids=["packed", "padded"])
@pytest.mark.slow
def test_sampling_mask_replay_old_log_probs_equal_rollout_log_probs(tmp_path, packed):
    """`rollout.sampling_mask_replay` with top-k + top-p: the actor's old log-probs (packed and padded
    forwards) equal the sampler's truncated log-probs, so the first update's ratio is 1; without the
    thresholds the same forward gives the full-softmax log-probs, off by -log(kept mass)."""
    from jaxrl_post.rl.trainer import RLTrainer

    c = grpo.get_config("tiny")
    c.trainer.default_local_dir = str(tmp_path / "replay")
    c.trainer.save_freq = -1
    c.rollout.top_k, c.rollout.top_p, c.rollout.sampling_mask_replay = 20, 0.7, True
    c.model.use_remove_padding = packed
    trainer = RLTrainer(c, console_write=lambda s: None)
    try:
        b, _, _ = trainer.rollout.generate_and_score(next(trainer.data.train_loader), 5, {}, trainer.reward_fn)
        mask = b["response_attention_mask"].astype(bool)
        assert np.isfinite(b["sampling_logit_threshold"][mask]).all()
        fwd = lambda batch: trainer.placement.forward(
            trainer.policy.old_log_prob_fn, trainer.state.actor.params, batch, 8, trainer.policy.old_log_prob_spec
        )[0]
        old = fwd(b)
        np.testing.assert_allclose(old[mask], b["rollout_log_probs"][mask], atol=2e-5)
        full = fwd({k: v for k, v in b.items() if k != "sampling_logit_threshold"})
        assert np.max(b["rollout_log_probs"][mask] - full[mask]) > 0.05
    finally:
        trainer.close()


_X86_AVX2 = "processor\t: 0\nvendor_id\t: AuthenticAMD\nflags\t\t: fpu sse2 avx avx2 fma f16c\n\nprocessor\t: 1\n"
_X86_AMX = "flags\t\t: fpu avx2 avx512f avx512_bf16 avx512_fp16 amx_bf16 amx_tile\n"
_ARM_BF16 = "processor\t: 0\nFeatures\t: fp asimd evtstrm aes crc32 bf16 i8mm\n"


@pytest.mark.parametrize(
    "text, dtype, want",
    [
        (_X86_AVX2, "bfloat16", False),
        (_X86_AVX2, "float16", False),  # f16c converts, it does not multiply
        (_X86_AMX, "bfloat16", True),
        (_X86_AMX, "float16", True),
        ("flags\t\t: avx2 avx512f avx512_bf16\n", "bfloat16", True),
        (_ARM_BF16, "bfloat16", True),
        (_ARM_BF16, "float16", False),
        (_X86_AVX2, "float32", None),  # not a 16-bit dtype
        ("processor\t: 0\n", "bfloat16", None),  # no flags line: unknown
        (None, "bfloat16", None),  # no /proc/cpuinfo (macOS): unknown
    ],
)
def test_cpu_has_native_16bit_matmul_reads_the_cpu_flags(tmp_path, text, dtype, want):
    from jaxrl_post.rollout import cpu_has_native_16bit_matmul

    path = tmp_path / "cpuinfo"
    if text is not None:
        path.write_text(text)
    assert cpu_has_native_16bit_matmul(jnp.dtype(dtype), str(path)) is want


def test_generator_warns_of_a_16bit_rollout_on_a_cpu_without_16bit_matmuls(tmp_path, monkeypatch, caplog):
    """A bf16 rollout on an AVX2-only CPU runs no faster than float32 (README, mixed precision): say so once,
    when the Generator is built; nothing for float32 or on a CPU with AMX."""
    from types import SimpleNamespace

    from jaxrl_post.rollout import Generator, generate

    probe = generate.cpu_has_native_16bit_matmul
    for name, text in (("avx2", _X86_AVX2), ("amx", _X86_AMX)):
        (tmp_path / name).write_text(text)

    def built(cpu, dtype):
        monkeypatch.setattr(generate, "cpu_has_native_16bit_matmul", lambda d: probe(d, str(tmp_path / cpu)))
        caplog.clear()
        with caplog.at_level("WARNING", logger=generate.__name__):
            Generator(SimpleNamespace(dtype=jnp.dtype(dtype)))
        return [r.getMessage() for r in caplog.records]

    (msg,) = built("avx2", "bfloat16")
    assert "without native bfloat16 matmuls" in msg and "rollout.dtype=float32" in msg
    assert built("avx2", "float32") == []
    assert built("amx", "bfloat16") == []


@pytest.mark.parametrize("family", ["llama", "gemma2"])
def test_reference_params_in_compute_dtype_give_bitwise_equal_log_probs(family):
    """`builders.reference_params`: matrices in bf16 (half the bytes of f32 masters), norm scales kept; the
    bf16-compute forward on them equals the forward on the f32 masters bitwise (gemma2: `1 + w` norms)."""
    kw = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2)
    if family == "gemma2":
        kw.update(family="gemma2", norm_offset=1.0, post_norms=True, qkv_bias=True, tie_word_embeddings=True)
    cfg = ModelConfig(head_dim=8, **kw)
    model = init_model(cfg, seed=3, dtype="bfloat16", param_dtype="float32")
    g, params, rest = steps.split_model(model)
    rng = np.random.default_rng(0)  # norm scales and biases off their init values, so keeping them matters
    params = jax.tree.map(lambda x: x + jnp.asarray(0.01 * rng.normal(size=x.shape), x.dtype), params)
    ref = builders.reference_params(params, model.dtype)
    leaves, ref_leaves = jax.tree.leaves(params), jax.tree.leaves(ref)
    assert {(x.ndim, y.dtype.name) for x, y in zip(leaves, ref_leaves)} >= {(2, "bfloat16"), (1, "float32")}
    assert all(y.dtype == (jnp.bfloat16 if x.ndim >= 2 else jnp.float32) for x, y in zip(leaves, ref_leaves))
    assert sum(y.nbytes for y in ref_leaves) < 0.51 * sum(x.nbytes for x in leaves) + 4 * 32 * 20
    ids = jnp.asarray(rng.integers(3, 64, (2, 9)), jnp.int32)
    fwd = jax.jit(lambda p: nnx.merge(g, p, rest)(ids, jnp.ones((2, 9), bool)))
    np.testing.assert_array_equal(np.asarray(fwd(ref)), np.asarray(fwd(params)))


def test_no_kl_term_builds_no_reference(tmp_path):
    """Without a KL term (`kl_in_use` False) no reference params or ref log-prob fn exist."""
    from jaxrl_post.rl.trainer import RLTrainer

    c = grpo.get_config("tiny")
    c.trainer.default_local_dir = str(tmp_path / "nokl")
    c.actor.use_kl_loss = False
    c.algorithm.use_kl_in_reward = False
    trainer = RLTrainer(c, console_write=lambda s: None)
    try:
        assert trainer.reference is None  # no reference role: no params, no log-prob fn
        assert "ref" not in trainer.compile_counts()
    finally:
        trainer.close()
