"""Top-k forward-KL on-policy distillation (verl `forward_kl_topk` / `forward_kl_topk_tail`): the loss by hand
(numpy) with mask holes, the tail bucket and `log_prob_min_clamp`; the teacher's top-k ids / log-probs against
its own log_softmax (packed == padded); the student's log-probs at those ids inside the actor update against a
dense reference (packed == padded); a tiny end-to-end run through the RL trainer (packed, the default)."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_post.algos import core_algos, distillation, distillation_topk
from jaxrl_post.engine import steps, update_core
from jaxrl_post.rl import losses, ppo_update
from tests.rl.test_opd import _forward, _own_forward, _peaked_model, _rollout_batch

# ----------------------------------------------------------------------------------------- the math by hand
# B = 2 responses of R = 3 tokens, K = 3; mask holes at (0, 2) and (1, 0) hold garbage that must not count
TQ = np.log(
    np.array(
        [
            [[0.5, 0.3, 0.1], [0.9, 0.05, 1e-6], [0.2, 0.2, 0.2]],
            [[0.7, 0.2, 0.05], [0.6, 0.3, 0.0999], [0.4, 0.3, 2e-7]],
        ],
        np.float64,
    )
)  # teacher top-k log-probs (sorted, mass <= 1)
SQ = np.log(
    np.array(
        [
            [[0.2, 0.4, 0.2], [0.5, 0.1, 1e-7], [1e-9, 1e-9, 1e-9]],
            [[0.3, 0.3, 0.3], [0.2, 0.2, 0.3], [0.1, 0.5, 1e-8]],
        ],
        np.float64,
    )
)  # student log-probs at the same ids
MASK = np.array([[1, 1, 0], [0, 1, 1]], np.int32)


def _np_fkl(s, q, clamp=None):
    if clamp is not None:
        s, q = np.maximum(s, clamp), np.maximum(q, clamp)
    return (np.exp(q) * (q - s)).sum(-1)


def _np_tail(x):
    return np.concatenate([x, np.log(1.0 - np.exp(x).sum(-1, keepdims=True))], -1)


@pytest.mark.parametrize("mode", ["forward_kl_topk", "forward_kl_topk_tail"])
@pytest.mark.parametrize("clamp", [None, -10.0])
def test_topk_losses_by_hand(mode, clamp):
    s, q = SQ, TQ
    if mode.endswith("_tail"):
        s, q = _np_tail(s), _np_tail(q)  # the tail bucket from the unclamped log-probs
    want = _np_fkl(s, q, clamp)
    got = np.asarray(distillation_topk.compute_topk_distillation_losses(SQ, TQ, mode, clamp))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    # the clamp matters at (0, 1, 2): teacher 1e-6 (-13.8) and student 1e-7 (-16.1) both -> -10
    if clamp is not None:
        assert abs(got[0, 1] - _np_fkl(s, q)[0, 1]) > 1e-6
    if mode.endswith("_tail"):  # the coarse-grained KL of two distributions: >= 0
        assert (got[MASK > 0] >= -1e-6).all()

    c = distillation.DistillationLossConfig(loss_mode=mode, log_prob_min_clamp=clamp, loss_max_clamp=1.0)
    s32, q32 = jnp.asarray(SQ, jnp.float32), jnp.asarray(TQ, jnp.float32)
    for agg in ("token-mean", "seq-mean-token-mean"):
        counts = core_algos.global_batch_info(jnp.asarray(MASK))

        def f(x, agg=agg, counts=counts):
            return distillation_topk.distillation_loss_topk(c, x, q32, jnp.asarray(MASK), agg, **counts)

        (loss, m), g = jax.value_and_grad(f, has_aux=True)(s32)
        d = np.clip(want, -1.0, 1.0)
        if agg == "token-mean":
            ref = d[MASK > 0].mean()
        else:
            ref = np.mean([d[i][MASK[i] > 0].mean() for i in range(2)])
        assert float(loss) == pytest.approx(ref, rel=1e-5)
        assert float(m["teacher_mass"]) == pytest.approx(np.exp(TQ).sum(-1)[MASK > 0].mean(), rel=1e-5)
        assert float(m["student_mass"]) == pytest.approx(np.exp(SQ).sum(-1)[MASK > 0].mean(), rel=1e-5)
        assert float(m["abs_loss"]) == pytest.approx(np.abs(want)[MASK > 0].mean(), rel=1e-5)
        g = np.asarray(g)
        assert (g[MASK == 0] == 0).all()  # holes get no gradient
        if mode == "forward_kl_topk" and agg == "token-mean":
            # d D / d s_k = -exp(q_k) where s_k is above the clamp and |D| < loss_max_clamp
            live = (np.abs(want) < 1.0)[..., None] & (MASK > 0)[..., None]
            if clamp is not None:
                live = live & (clamp < SQ)
            want_g = np.where(live, -np.exp(np.maximum(TQ, clamp or -np.inf)) / MASK.sum(), 0.0)
            np.testing.assert_allclose(g, want_g, rtol=1e-4, atol=1e-7)


def test_tail_of_a_full_vocabulary_is_the_exact_forward_kl():
    """With the tail bucket, K = V - 1 covers everything but one token: the loss is the full forward KL."""
    rng = np.random.default_rng(0)
    t_lp = jax.nn.log_softmax(jnp.asarray(rng.normal(size=(2, 3, 7)) * 2, jnp.float32))
    s_lp = jax.nn.log_softmax(jnp.asarray(rng.normal(size=(2, 3, 7)) * 2, jnp.float32))
    q, ids = jax.lax.top_k(t_lp, 6)
    s = jnp.take_along_axis(s_lp, ids, -1)
    got = np.asarray(distillation_topk.compute_topk_distillation_losses(s, q, "forward_kl_topk_tail"))
    tp, sp = np.exp(np.asarray(t_lp, np.float64)), np.asarray(s_lp, np.float64)
    want = (tp * (np.log(tp) - sp)).sum(-1)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


# ----------------------------------------------------------------------------------------- the teacher forward
@pytest.mark.slow  # ~30 s on a loaded 2-core CPU: one jit of the teacher forward + 4 eager reference forwards
def test_teacher_topk_equals_top_k_of_its_own_log_softmax(monkeypatch):
    """The teacher's padded forward with topk = K: ids and log-probs of the K largest entries of its own
    log_softmax (one unpadded sequence at a time, float64 numpy), at every existing response position."""
    model = _peaked_model()
    g, params, rest = steps.split_model(model)
    b = _rollout_batch(n=4)
    k = 5
    fn = jax.jit(
        update_core.make_log_prob_fn(
            steps.padded_layout(micro_batch_size=2), g, rest, temperature=1.0, with_entropy=False, topk=k
        )
    )
    lp, ent, t_lp, t_ids = fn(params, {kk: jnp.asarray(v) for kk, v in b.items()})
    assert ent is None and t_lp.shape == (4, 5, k) and t_ids.dtype == jnp.int32 and t_lp.dtype == jnp.float32
    full = _own_full_log_softmax(model, b)  # [B, R, V] float64, 0 at padding
    mask = b["attention_mask"][:, -5:] > 0
    want_ids = np.argsort(-full, axis=-1)[..., :k]
    np.testing.assert_array_equal(np.asarray(t_ids)[mask], want_ids[mask])
    want_lp = np.take_along_axis(full, want_ids, -1)
    np.testing.assert_allclose(np.asarray(t_lp)[mask], want_lp[mask], rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(np.asarray(lp)[mask], _own_forward(model, b)[mask], rtol=1e-4, atol=1e-4)

    # packed (2 micro-batches, several sequences per row) == padded, at every existing response position
    from jaxrl_post.engine import packed_steps, packing

    monkeypatch.setattr(packed_steps, "TOPK_HEAD_CHUNK", 3)  # 10 slots: 4 chunks, the last one padded
    spec = packing.make_pack_spec(4, rows=1, prompt_length=6, response_length=5, row_len=22, n_micro=2)
    pk = dict(b, **packing.pack_batch(b, spec))
    pfn = jax.jit(
        update_core.make_log_prob_fn(packed_steps.PACKED, g, rest, temperature=1.0, with_entropy=False, topk=k)
    )
    _, _, p_lp, p_ids = pfn(params, {kk: jnp.asarray(v) for kk, v in pk.items()})
    np.testing.assert_array_equal(np.asarray(p_ids)[mask], np.asarray(t_ids)[mask])
    np.testing.assert_allclose(np.asarray(p_lp)[mask], np.asarray(t_lp)[mask], rtol=1e-5, atol=1e-5)


def _own_full_log_softmax(model, b, temperature=1.0):
    """`[B, R, V]` float64 log_softmax(logits / T) at every existing response position, one sequence at a time."""
    p = b["input_ids"].shape[1] - b["responses"].shape[1]
    n, r = b["responses"].shape
    out = np.zeros((n, r, model.config.vocab_size))
    for i in range(n):
        keep = b["attention_mask"][i] > 0
        ids = b["input_ids"][i][keep][None]
        logits = np.asarray(_forward(model, ids, np.ones_like(ids)), np.float64)[0] / temperature
        lsm = logits - logits.max(-1, keepdims=True)
        lsm = lsm - np.log(np.exp(lsm).sum(-1, keepdims=True))
        n_p, n_r = int(keep[:p].sum()), int(keep[p:].sum())
        out[i, :n_r] = lsm[n_p - 1 : n_p - 1 + n_r]
    return out


# ----------------------------------------------------------------------------------------- the student update
@pytest.mark.slow  # ~20 s: one jit of the actor update (forward + backward) + 4 eager reference forwards
def test_student_topk_log_probs_in_the_padded_update_equal_a_dense_reference(monkeypatch):
    """The padded actor update (2 micro-batches, temperature 0.7): its `distillation/loss` and `student_mass`
    equal numpy on the student's dense log_softmax gathered at the teacher's ids; the packed update (chunked
    head) gives the same."""
    student = _peaked_model(seed=5)
    g, params, rest = steps.split_model(student)
    b = _rollout_batch(n=4)
    rng = np.random.default_rng(1)
    k, temp = 4, 0.7
    ids = np.stack([rng.permutation(128)[:k] for _ in range(4 * 5)]).reshape(4, 5, k).astype(np.int32)
    t_lp = np.log(rng.dirichlet(np.ones(k + 2), (4, 5))[..., :k]).astype(np.float32)
    mask = (b["attention_mask"][:, -5:] > 0).astype(np.int32)
    mask[0, 0] = 0  # a hole inside a response
    d = distillation.DistillationLossConfig(loss_mode="forward_kl_topk", use_task_rewards=False, topk=k)
    c = ppo_update.ActorLossConfig(temperature=temp, on_policy=True, distillation=d)
    import optax

    fn = jax.jit(ppo_update.make_actor_update(steps.padded_layout(n_micro=2), g, rest, optax.sgd(0.0), c))
    batch = dict(b, loss_mask=mask, advantages=np.zeros((4, 5), np.float32))
    batch.update(teacher_topk_ids=ids, teacher_topk_log_probs=t_lp)
    _, _, m = fn(params, optax.sgd(0.0).init(params), {kk: jnp.asarray(v) for kk, v in batch.items()})
    s_dense = np.take_along_axis(_own_full_log_softmax(student, b, temp), ids, -1)
    want = _np_fkl(s_dense, t_lp.astype(np.float64))[mask > 0].mean()
    assert float(m["distillation/loss"]) == pytest.approx(want, rel=1e-4)
    assert float(m["loss"]) == pytest.approx(want, rel=1e-4)  # use_task_rewards=False: the distillation alone
    assert float(m["distillation/student_mass"]) == pytest.approx(np.exp(s_dense).sum(-1)[mask > 0].mean(), rel=1e-4)

    # the packed update (2 micro-batches) on the same sequences: the same loss and masses
    from jaxrl_post.engine import packed_steps, packing

    monkeypatch.setattr(packed_steps, "TOPK_HEAD_CHUNK", 3)  # 10 slots: 4 chunks, the last one padded
    spec = packing.make_pack_spec(4, rows=1, prompt_length=6, response_length=5, row_len=22, n_micro=2)
    pk = dict(batch, **packing.pack_batch(batch, spec))
    pfn = jax.jit(ppo_update.make_actor_update(packed_steps.PACKED, g, rest, optax.sgd(0.0), c))
    _, _, pm = pfn(params, optax.sgd(0.0).init(params), {kk: jnp.asarray(v) for kk, v in pk.items()})
    for key in ("distillation/loss", "distillation/student_mass", "distillation/teacher_mass", "loss"):
        assert float(pm[key]) == pytest.approx(float(m[key]), rel=1e-4), key


def test_actor_loss_routes_topk_inputs():
    """`losses.actor_loss` with a top-k mode reads the `[b, R, K]` inputs (no `teacher_log_prob`)."""
    d = distillation.DistillationLossConfig(
        loss_mode="forward_kl_topk_tail", use_task_rewards=True, distillation_loss_coef=2.0
    )
    c = ppo_update.ActorLossConfig(on_policy=True, distillation=d)
    lp = jnp.asarray(SQ[..., 0], jnp.float32)
    mb = dict(
        loss_mask=jnp.asarray(MASK),
        advantages=jnp.zeros((2, 3), jnp.float32),
        student_topk_log_probs=jnp.asarray(SQ, jnp.float32),
        teacher_topk_log_probs=jnp.asarray(TQ, jnp.float32),
    )
    counts = core_algos.global_batch_info(jnp.asarray(MASK))
    loss, m = losses.actor_loss(c, lp, jnp.zeros((2, 3)), mb, counts)
    want = _np_fkl(_np_tail(SQ), _np_tail(TQ))[MASK > 0].mean()
    assert float(m["distillation/loss"]) == pytest.approx(want, rel=1e-5)
    assert float(loss) == pytest.approx(2.0 * want, rel=1e-5)  # zero advantages: task pg loss 0


# ----------------------------------------------------------------------------------------- end to end
@pytest.mark.slow  # ~70 s on a loaded 2-core CPU: trainer compiles (rollout, teacher, update) + 3 steps
def test_tiny_topk_opd_run(tmp_path):
    """`configs/opd.py:tiny_topk` (forward_kl_topk, K = 8, packed) for 3 steps through the RL trainer: finite
    distillation metrics every step, teacher masses in (0, 1], one compile of the teacher and the update."""
    from configs import opd
    from jaxrl_post.rl.trainer import RLTrainer

    c = opd.get_config("tiny_topk")
    c.trainer.default_local_dir = str(tmp_path / "run")
    c.trainer.total_training_steps = 3
    trainer = RLTrainer(c, console_write=lambda line: None)
    trainer.fit()
    with open(tmp_path / "run" / "metrics.jsonl") as f:
        rows = [r for r in map(json.loads, f) if "actor/distillation/loss" in r]
    assert len(rows) == 3
    keys = ("loss", "student_mass", "teacher_mass", "abs_loss", "reverse_kl", "teacher_log_prob")
    for r in rows:
        for k in keys:
            assert np.isfinite(r[f"actor/distillation/{k}"]), (k, r)
        assert 0 < r["actor/distillation/teacher_mass"] <= 1.0 + 1e-5
        assert 0 < r["actor/distillation/student_mass"] <= 1.0 + 1e-5
    print({k: [round(r[f"actor/distillation/{k}"], 4) for r in rows] for k in keys})
    counts = trainer.compile_counts()
    assert counts["teacher"] == 1 and counts["update_actor"] == 1, counts
