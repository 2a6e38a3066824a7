"""Sequence packing: the host packer (hand cases), the decoder on packed rows (segment ids) vs each sequence
alone, and the packed actor / critic / log-prob steps vs the padded ones (loss, gradients, metrics)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from jaxrl_post.engine import packed_steps, packing, steps, update_core
from jaxrl_post.engine.packing import (
    PackSpec,
    make_pack_spec,
    micro_geometry,
    pack_batch,
    plan_packing,
    plan_shared_packing,
)
from jaxrl_post.engine.token_fields import unpack_seq
from jaxrl_post.models import CriticModel, ModelConfig, init_model
from jaxrl_post.rl import ppo_update


# ----------------------------------------------------------------------------------------- packer
def _spec(n_micro, rows, row_len, seqs=8, slots=100, r=4):
    return PackSpec(n_micro=n_micro, rows=rows, row_len=row_len, seqs=seqs, slots=slots, response_length=r)


def test_plan_everything_fits_one_micro_batch_first_fit_decreasing():
    # lengths 3, 5, 4, 2 into rows of 8: FFD order 5, 4, 3, 2 -> row0 [5, 3], row1 [4, 2]
    place = plan_packing(np.array([3, 5, 4, 2]), np.array([1, 1, 1, 1]), _spec(3, 2, 8))
    micro, row, off = place[:, 0], place[:, 1], place[:, 2]
    assert micro.tolist() == [0, 0, 0, 0]
    assert row.tolist() == [0, 0, 1, 1] and off.tolist() == [5, 0, 0, 4]
    assert sorted(place[:, 3].tolist()) == [0, 1, 2, 3]  # one sequence slot each


def test_plan_sequence_of_exactly_row_len_and_k_micro_batches():
    # 5 sequences of exactly row_len: one per row; rows=2 -> 3 micro-batches (the last half full)
    place = plan_packing(np.full(5, 6), np.full(5, 2), _spec(3, 2, 6))
    assert place[:, 0].tolist() == [0, 0, 1, 1, 2] and place[:, 2].tolist() == [0] * 5
    with pytest.raises(ValueError, match="does not fit"):
        plan_packing(np.full(7, 6), np.full(7, 2), _spec(3, 2, 6))
    with pytest.raises(ValueError, match="longer than a row"):
        plan_packing(np.array([7]), np.array([1]), _spec(3, 2, 6))
    # the response-slot budget closes a micro-batch too: 3 slots per micro-batch, responses of 2
    place = plan_packing(np.full(3, 3), np.full(3, 2), _spec(3, 2, 6, slots=3))
    assert place[:, 0].tolist() == [0, 1, 2]


def _batch(m=6, p=5, r=4, vocab=50, seed=0, p_lens=None, r_lens=None):
    rng = np.random.default_rng(seed)
    ids = rng.integers(3, vocab, (m, p + r)).astype(np.int32)
    p_lens = rng.integers(1, p + 1, m) if p_lens is None else np.asarray(p_lens)
    r_lens = rng.integers(1, r + 1, m) if r_lens is None else np.asarray(r_lens)
    am = np.concatenate(
        [(np.arange(p)[None] >= p - p_lens[:, None]), (np.arange(r)[None] < r_lens[:, None])], 1
    ).astype(np.int32)
    ids = ids * am  # padding id 0
    return dict(
        input_ids=ids,
        attention_mask=am,
        position_ids=np.maximum(np.cumsum(am, 1) - 1, 0).astype(np.int32),
        responses=ids[:, p:].copy(),
    )


def test_pack_batch_round_trip_and_empty_micro_batches():
    b = _batch(m=6, p=5, r=4, seed=1)
    spec = make_pack_spec(6, rows=2, prompt_length=5, response_length=4)  # 3 micro-batches, rows of 9
    assert (spec.n_micro, spec.row_len, spec.slots, spec.seqs) == (3, 9, 8, 6)
    pk = pack_batch(b, spec)
    am = b["attention_mask"].astype(bool)
    assert np.count_nonzero(pk["segment_ids"]) == am.sum()
    # every sequence's real tokens, in order, with positions 0.. in one segment of one row
    for k in range(3):
        for s in range(6):
            i = pk["seq_index"][k, s]
            if i < 0:
                continue
            real = b["input_ids"][i][am[i]]
            rows = [(j, pk["segment_ids"][k, j]) for j in range(2)]
            found = [
                pk["input_ids"][k, j][pk["segment_ids"][k, j] == g].tolist()
                for j, _ in rows
                for g in range(1, 10)
                if np.any(pk["segment_ids"][k, j] == g)
            ]
            assert real.tolist() in found
    # slots: the token after each predicting position is the response token itself; seq_slot inverts it
    flat = pk["input_ids"].reshape(3, -1)
    for k in range(3):
        for s in range(6):
            i = pk["seq_index"][k, s]
            if i < 0:
                assert np.all(pk["seq_slot"][k, s] == -1)
                continue
            n_r = am[i, 5:].sum()
            q = pk["seq_slot"][k, s, :n_r]
            assert np.all(pk["seq_slot"][k, s, n_r:] == -1)
            np.testing.assert_array_equal(pk["slot_tokens"][k, q], b["responses"][i, :n_r])
            np.testing.assert_array_equal(flat[k, pk["slot_pos"][k, q] + 1], b["responses"][i, :n_r])
    # unpack_seq inverts the sequence layout
    x = np.zeros((3, 6, 4), np.float32)
    for k in range(3):
        for s in range(6):
            if pk["seq_index"][k, s] >= 0:
                x[k, s] = pk["seq_index"][k, s] + 0.5
    np.testing.assert_array_equal(unpack_seq(x, pk["seq_index"], 6)[:, 0], np.arange(6) + 0.5)
    # short sequences: everything fits the first micro-batch, the other two are empty
    small = _batch(m=6, p=5, r=4, seed=2, p_lens=[1] * 6, r_lens=[1] * 6)
    pk = pack_batch(small, spec)
    assert np.any(pk["segment_ids"][0]) and not np.any(pk["segment_ids"][1:])
    assert np.all(pk["seq_index"][1:] == -1)


def test_micro_geometry_maps_verl_batch_keys_and_long_rows_always_fit():
    geo = lambda **kw: micro_geometry(**dict(dict(max_token_len_per_gpu=None, dp=1, n_seqs=64), **kw))
    # padded micro-batch of 8 responses of T = 184: 8 rows of 184, or 4 rows of 368 (same token budget)
    assert geo(micro_batch_size=8, use_dynamic_bsz=False, seq_len=184, seqs_per_row=1) == (8, 184)
    assert geo(micro_batch_size=8, use_dynamic_bsz=False, seq_len=184, seqs_per_row=2) == (4, 368)
    # dynamic: 1000 tokens per device on 2 devices -> 2 rows of 368 (k lowered to 1 if a row would not fit)
    assert geo(
        micro_batch_size=8, use_dynamic_bsz=True, max_token_len_per_gpu=1000, seq_len=184, seqs_per_row=2, dp=2
    ) == (
        4,
        368,
    )
    assert geo(micro_batch_size=8, use_dynamic_bsz=True, max_token_len_per_gpu=300, seq_len=184, seqs_per_row=2) == (
        1,
        184,
    )
    with pytest.raises(ValueError, match="max_token_len_per_gpu"):
        geo(micro_batch_size=8, use_dynamic_bsz=True, max_token_len_per_gpu=100, seq_len=184, seqs_per_row=1)
    # worst case for rows of 2 sequences: every sequence full length (2 per row) or just over a third of a row
    spec = make_pack_spec(12, rows=2, prompt_length=5, response_length=4, row_len=18)
    assert (spec.n_micro, spec.slots) == (3, 16)
    for n in (9, 7):
        b = _batch(m=12, p=5, r=4, seed=5, p_lens=[5] * 12, r_lens=[n - 5] * 12)
        assert np.count_nonzero(pack_batch(b, spec)["segment_ids"]) == 12 * n


def test_pack_batch_rejects_non_contiguous_tokens():
    b = _batch(m=2, seed=3)
    b["attention_mask"][0, -2:] = [0, 1]
    with pytest.raises(ValueError, match="contiguous"):
        pack_batch(b, make_pack_spec(2, rows=1, prompt_length=5, response_length=4))


# ----------------------------------------------------------------------------------------- decoder
def _cfg(family, num_layers=2):
    base = dict(
        family=family,
        vocab_size=53,
        hidden_size=32,
        intermediate_size=48,
        num_layers=num_layers,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        tie_word_embeddings=True,
    )
    if family == "gemma2":
        base.update(
            norm_offset=1.0,
            embed_scale=True,
            post_norms=True,
            hidden_act="gelu_pytorch_tanh",
            sliding_window=3,
            layer_types=("sliding_attention", "full_attention"),
            attn_logit_softcap=5.0,
            final_logit_softcap=10.0,
            query_pre_attn_scalar=6.0,
        )
    return ModelConfig(**base)


def _model(family, seed=0, num_layers=2):
    """Model with O(1) logits (random weights at scale 0.15; norms around their identity)."""
    cfg = _cfg(family, num_layers)
    model = init_model(cfg, seed=seed)
    graphdef, state = nnx.split(model)
    rng = np.random.RandomState(seed)
    leaves, tree = jax.tree.flatten(state)
    new = []
    for x in leaves:
        w = rng.randn(*x.shape).astype(np.float32)
        new.append(jnp.asarray((1.0 - cfg.norm_offset) + 0.1 * w if x.ndim == 1 else 0.15 * w))
    return nnx.merge(graphdef, jax.tree.unflatten(tree, new))


@pytest.mark.parametrize("family", ["llama", "gemma2"])
def test_packed_forward_matches_each_sequence_alone(family):
    model = _model(family)
    p, r = 6, 5
    b = _batch(m=5, p=p, r=r, vocab=53, seed=4, r_lens=[5, 1, 3, 5, 2])
    spec = make_pack_spec(5, rows=2, prompt_length=p, response_length=r, row_len=15)
    pk = pack_batch(b, spec)
    assert np.max(pk["segment_ids"]) >= 2  # several sequences share a row
    fwd = jax.jit(lambda i, s, q: model(i, s != 0, positions=q, segment_ids=s))
    n = spec.n_micro
    packed = fwd(
        pk["input_ids"].reshape(n * 2, -1), pk["segment_ids"].reshape(n * 2, -1), pk["positions"].reshape(n * 2, -1)
    )
    packed = np.asarray(packed).reshape(n, 2, spec.row_len, -1)
    single = jax.jit(lambda i, a, q: model(i, a, positions=q))
    checked = 0
    for i in range(5):
        one = {k: b[k][i : i + 1] for k in ("input_ids", "attention_mask", "position_ids")}
        alone = np.asarray(single(one["input_ids"], one["attention_mask"], one["position_ids"]))
        real = np.nonzero(b["attention_mask"][i])[0]
        (k,), (s,) = np.nonzero(pk["seq_index"] == i)
        q0 = pk["seq_slot"][k, s, 0]
        first = pk["slot_pos"][k, q0] - (p - real[0] - 1)  # flat index of the sequence's first token
        got = packed.reshape(n, -1, packed.shape[-1])[k, first : first + len(real)]
        np.testing.assert_allclose(got, alone[0, real], atol=1e-5, rtol=1e-5)
        checked += len(real)
    assert checked == b["attention_mask"].sum()


# ----------------------------------------------------------------------------------------- update steps
def _rollout(m=8, p=6, r=5, vocab=53, seed=0):
    b = _batch(m=m, p=p, r=r, vocab=vocab, seed=seed)
    rng = np.random.default_rng(seed + 10)
    rm = b["attention_mask"][:, p:].copy()
    rm[1] = 0  # a sequence with no loss tokens (e.g. a dropped truncated response)
    b.update(
        loss_mask=rm,
        advantages=rng.normal(size=(m, r)).astype(np.float32),
        old_log_probs=(rng.normal(size=(m, r)) * 0.3 - 3.9).astype(np.float32),
        ref_log_prob=(rng.normal(size=(m, r)) * 0.3 - 3.9).astype(np.float32),
        rollout_log_probs=(rng.normal(size=(m, r)) * 0.3 - 3.9).astype(np.float32),
        values=rng.normal(size=(m, r)).astype(np.float32),
        returns=rng.normal(size=(m, r)).astype(np.float32),
    )
    return b


def _packed(b, rows, p=6, r=5, **kw):
    spec = make_pack_spec(b["input_ids"].shape[0], rows=rows, prompt_length=p, response_length=r, **kw)
    return dict(b, **pack_batch(b, spec))


def _close(a, b, tol=1e-5):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), atol=tol, rtol=tol)


@pytest.mark.parametrize(
    "mode,entropy_coeff",
    [
        ("token-mean", 0.0),
        ("seq-mean-token-sum", 0.01),
        ("seq-mean-token-mean", 0.0),
        ("seq-mean-token-sum-norm", 0.01),
    ],
)
@pytest.mark.slow
def test_packed_actor_update_equals_padded(mode, entropy_coeff):
    model = _model("llama", seed=1, num_layers=1)
    graphdef, params, rest = steps.split_model(model)
    b = _rollout()
    tx = optax.sgd(1.0)  # new params = params - grads: compares gradients
    cfg = ppo_update.ActorLossConfig(
        loss_agg_mode=mode,
        clip_ratio_low=0.2,
        clip_ratio_high=0.28,
        entropy_coeff=entropy_coeff,
        use_kl_loss=True,
        kl_loss_coef=0.1,
        temperature=0.7,
    )
    padded = jax.jit(ppo_update.make_actor_update(steps.padded_layout(n_micro=4), graphdef, rest, tx, cfg))
    packed = jax.jit(ppo_update.make_actor_update(packed_steps.PACKED, graphdef, rest, tx, cfg))
    want = padded(params, tx.init(params), b)
    # rows of one max-length sequence (2 per micro-batch) or of two (1 per micro-batch): same token budget
    long_rows = mode in ("seq-mean-token-sum", "seq-mean-token-mean")
    pk = _packed(b, rows=1, row_len=22) if long_rows else _packed(b, rows=2)
    got = packed(params, tx.init(params), pk)
    _close(got[0], want[0])
    assert set(got[2]) == set(want[2])
    for k in want[2]:
        np.testing.assert_allclose(got[2][k], want[2][k], atol=1e-5, rtol=1e-5, err_msg=k)
    assert float(want[2]["grad_norm"]) > 0.1
    # the entropy metric (a stop_gradient side computation when entropy_coeff == 0), written out
    logits = model(b["input_ids"], b["attention_mask"], positions=b["position_ids"])[:, 5:-1] / 0.7
    logp = jax.nn.log_softmax(logits, -1)
    ent = -jnp.sum(jnp.exp(logp) * logp, -1)
    mask = jnp.asarray(b["loss_mask"], jnp.float32)
    n_seq = jnp.sum(mask.sum(-1) > 0)
    expected = {
        "token-mean": jnp.sum(ent * mask) / mask.sum(),
        "seq-mean-token-sum": jnp.sum(ent * mask) / n_seq,
        "seq-mean-token-mean": jnp.sum(jnp.sum(ent * mask, -1) / jnp.maximum(mask.sum(-1), 1)) / n_seq,
        "seq-mean-token-sum-norm": jnp.sum(ent * mask) / 5 / n_seq,
    }[mode]
    np.testing.assert_allclose(got[2]["entropy"], expected, rtol=1e-5)


@pytest.mark.slow
def test_packed_log_probs_values_and_critic_update_equal_padded():
    model = _model("gemma2", seed=2)
    graphdef, params, rest = steps.split_model(model)
    b = _rollout(seed=3)
    mask = b["attention_mask"][:, 6:].astype(bool)
    fwd_pad = jax.jit(
        update_core.make_log_prob_fn(
            steps.padded_layout(micro_batch_size=4), graphdef, rest, temperature=0.7, with_entropy=True
        )
    )
    fwd_pk = jax.jit(
        update_core.make_log_prob_fn(packed_steps.PACKED, graphdef, rest, temperature=0.7, with_entropy=True)
    )
    (lp0, ent0), (lp1, ent1) = fwd_pad(params, b), fwd_pk(params, _packed(b, rows=4))
    np.testing.assert_allclose(np.asarray(lp1)[mask], np.asarray(lp0)[mask], atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(ent1)[mask], np.asarray(ent0)[mask], atol=1e-5, rtol=1e-5)
    assert np.all(np.asarray(lp1)[~mask] == 0)

    critic = CriticModel.from_actor(model, nnx.Rngs(1))
    cg, cp, cr = steps.split_model(critic)
    cp["value_head"][...] = jnp.asarray(np.random.RandomState(0).randn(32, 1).astype(np.float32) * 0.3)
    v_pad = jax.jit(update_core.make_value_fn(steps.padded_layout(micro_batch_size=4), cg, cr))(cp, b)
    v_pk = jax.jit(update_core.make_value_fn(packed_steps.PACKED, cg, cr))(cp, _packed(b, rows=4))
    np.testing.assert_allclose(np.asarray(v_pk)[mask], np.asarray(v_pad)[mask], atol=1e-5, rtol=1e-5)
    tx = optax.sgd(1.0)
    for mode in ("token-mean", "seq-mean-token-mean"):
        lcfg = ppo_update.CriticLossConfig(cliprange_value=0.5, loss_agg_mode=mode)
        want = jax.jit(ppo_update.make_critic_update(steps.padded_layout(n_micro=2), cg, cr, tx, lcfg))(
            cp, tx.init(cp), b
        )
        got = jax.jit(ppo_update.make_critic_update(packed_steps.PACKED, cg, cr, tx, lcfg))(
            cp, tx.init(cp), _packed(b, rows=2)
        )
        _close(got[0], want[0])
        for k in want[2]:
            np.testing.assert_allclose(got[2][k], want[2][k], atol=1e-5, rtol=1e-5, err_msg=k)


def test_packed_update_compiles_once_and_runs_only_used_micro_batches():
    model = _model("llama", seed=1, num_layers=1)
    graphdef, params, rest = steps.split_model(model)
    tx = optax.sgd(1.0)
    traces = []
    fn = jax.jit(
        ppo_update.make_actor_update(
            packed_steps.PACKED, graphdef, rest, tx, ppo_update.ActorLossConfig(), on_trace=lambda: traces.append(1)
        )
    )
    for seed in range(3):  # different lengths -> different packings, same shapes
        b = _rollout(seed=seed)
        pk = _packed(b, rows=2)
        if seed == 2:  # short sequences: 3 of the 4 micro-batches are empty and skipped
            b = _rollout(seed=seed)
            b["attention_mask"][:, :5] = 0
            b["attention_mask"][:, 7:] = 0
            b["loss_mask"] = b["attention_mask"][:, 6:].copy()
            pk = _packed(b, rows=2)
            assert not np.any(pk["segment_ids"][1:])
        out = fn(params, tx.init(params), pk)
        assert np.isfinite(float(out[2]["loss"]))
    assert fn._cache_size() == 1 and len(traces) == 1


# ----------------------------------------------------------------------------------------- trainer
@pytest.mark.slow
def test_tiny_ppo_step_same_metrics_packed_and_padded(tmp_path):
    """One PPO step (critic + actor update, old/ref log-probs, values, KL loss) of the tiny config, packed
    (the default) and padded, from the same params and sampling seed: same rollout, so every loss / update
    metric agrees to float32 rounding: the paths sum in different orders (packed rows, slot gathers), measured
    worst 2e-6 relative (actor/ppo_kl, pg_loss), checked at 2e-5; params after the Adam step to 1e-5. Only
    step 1: from step 2 the rollouts may differ (different params) and near-zero means (advantages) have
    no meaningful relative error."""
    from configs import ppo
    from jaxrl_post.rl.trainer import RLTrainer

    results = {}
    for packed in (True, False):
        c = ppo.get_config("tiny")
        c.trainer.default_local_dir = str(tmp_path / f"packed_{packed}")
        c.model.use_remove_padding = packed
        c.trainer.critic_warmup = 0
        c.trainer.val_before_train = c.trainer.val_at_end = False
        c.trainer.save_freq = -1
        trainer = RLTrainer(c)
        assert (trainer.policy.spec is not None) == packed
        assert not packed or trainer.policy.spec.share_prompts  # the default, rollout.n = 4: shared prompts
        try:
            m = trainer.train_step(next(trainer.data.train_loader))
            results[packed] = (m, jax.tree.map(np.asarray, trainer.state.actor.params), trainer.compile_counts())
        finally:
            trainer.close()
    (mp, pp, cp), (mu, pu, cu) = results[True], results[False]
    assert set(cp.values()) == {1} and set(cu.values()) == {1}
    keys = [k for k in mu if k.startswith(("actor/", "critic/")) and "grad_norm" not in k]
    assert "actor/pg_loss" in keys and "critic/vf_loss" in keys and "actor/entropy" in keys
    for k in keys:
        np.testing.assert_allclose(mp[k], mu[k], rtol=2e-5, atol=1e-7, err_msg=k)
    for k in ("actor/grad_norm", "critic/grad_norm"):
        np.testing.assert_allclose(mp[k], mu[k], rtol=2e-5, err_msg=k)
    _close(pp, pu, tol=2e-5)  # reduction order differs; measured 1.03e-5 on 1 of 8192 elements (2026-12-06, CI flags)


# ----------------------------------------------------------------------------------------- shared prompts
@pytest.mark.parametrize("n, key, shared", [(8, True, True), (1, True, False), (8, False, False)])
def test_pack_spec_shares_prompts_only_with_several_samples(n, key, shared):
    """`model.pack_shared_prompts` (default on) takes effect only with `rollout.n > 1`: with one sample per prompt
    nothing repeats and the shared layout's slot count (rows * row_len) would only cost LM-head work."""
    from types import SimpleNamespace

    from configs import grpo
    from jaxrl_post.rl.roles.policy import pack_spec

    c = grpo.get_config()
    assert c.model.pack_shared_prompts  # the default
    c.rollout.n, c.model.pack_shared_prompts = n, key
    fake = SimpleNamespace(
        config=c,
        response_length=48,
        mesh=SimpleNamespace(shape={"data": 1, "fsdp": 1}),
        actor_model=SimpleNamespace(attention_impl="xla"),
    )
    spec = pack_spec(
        c,
        "actor",
        32,
        4,
        mesh=fake.mesh,
        response_length=fake.response_length,
        attention_impl=fake.actor_model.attention_impl,
    )
    assert spec.share_prompts == shared
    assert spec.slots == (2 * 208 if shared else 2 * 2 * 48)  # rows x row_len, or rows x k x R


def _grpo_batch(n_prompts=2, n=4, p=6, r=5, vocab=53, seed=0, r_lens=None):
    """GRPO-shaped: each prompt repeated n times (interleaved, as `rollout.n`), responses of their own."""
    b = _batch(m=n_prompts * n, p=p, r=r, vocab=vocab, seed=seed, r_lens=r_lens)
    src = np.repeat(np.arange(n_prompts), n)
    for k in ("input_ids", "attention_mask", "position_ids"):
        b[k][:, :p] = b[k][src * n, :p]
    am = b["attention_mask"]
    b["position_ids"] = np.maximum(np.cumsum(am, 1) - 1, 0).astype(np.int32)
    b["input_ids"] = b["input_ids"] * am
    b["responses"] = b["input_ids"][:, p:].copy()
    return b


def test_shared_prompt_packing_hand_case(monkeypatch):
    # 2 prompts of 3 tokens x 2 samples, responses of 2, 1, 3, 2 tokens; rows of 9, one micro-batch of 2 rows
    b = _batch(m=4, p=3, r=3, seed=5, p_lens=[3, 3, 3, 3], r_lens=[2, 1, 3, 2])
    b["input_ids"][1, :3] = b["input_ids"][0, :3]
    b["input_ids"][3, :3] = b["input_ids"][2, :3]
    b["responses"] = b["input_ids"][:, 3:].copy()
    spec = dataclasses.replace(_spec(1, 2, 9, seqs=4, slots=12, r=3), share_prompts=True)
    pk = pack_batch(b, spec)
    # group 1 (3 + 3 + 2 = 8 tokens) goes first: row 0 = its prompt, response 2, response 3 (longest first)
    assert pk["input_ids"][0, 0].tolist() == b["input_ids"][2, :3].tolist() + b["input_ids"][2, 3:6].tolist() + (
        b["input_ids"][3, 3:5].tolist() + [0]
    )
    one = 1 << 16
    assert pk["segment_ids"][0, 0].tolist() == [one] * 3 + [one | 1] * 3 + [one | 2] * 2 + [0]
    assert pk["positions"][0, 0].tolist() == [0, 1, 2, 3, 4, 5, 3, 4, 0]
    # group 0 (3 + 2 + 1 = 6 tokens) does not fit row 0's last token: row 1
    assert pk["segment_ids"][0, 1].tolist() == [one] * 3 + [one | 1] * 2 + [one | 2] + [0] * 3
    assert np.count_nonzero(pk["segment_ids"]) == 14  # 20 real tokens, 6 of them repeated prompt tokens
    # the first response token of every sequence is predicted by its prompt's last token
    flat = pk["input_ids"].reshape(1, -1)
    for s in range(4):
        i = pk["seq_index"][0, s]
        n_r = int(b["attention_mask"][i, 3:].sum())
        q = pk["seq_slot"][0, s, :n_r]
        np.testing.assert_array_equal(pk["slot_tokens"][0, q], b["responses"][i, :n_r])
        assert flat[0, pk["slot_pos"][0, q[0]]] == b["input_ids"][i, 2]
        np.testing.assert_array_equal(flat[0, pk["slot_pos"][0, q[1:]] + 1], b["responses"][i, 1:n_r])
    # sharing off, or prompts that differ: one copy per sequence, plain segment ids
    plain = pack_batch(b, _spec(1, 3, 9, seqs=4, slots=12, r=3))  # 20 tokens need a third row of 9
    assert np.count_nonzero(plain["segment_ids"]) == 20 and plain["segment_ids"].max() < one
    # a shared plan that does not fit falls back to the plain one (which always fits a make_pack_spec spec)
    with pytest.raises(ValueError, match="does not fit"):
        plan_shared_packing(np.full(4, 3), np.array([2, 1, 3, 2]), np.array([0, 0, 1, 1]), _spec(1, 1, 9, slots=12))
    roomy = make_pack_spec(4, rows=1, prompt_length=3, response_length=3, row_len=6, share_prompts=True)
    monkeypatch.setattr(packing, "plan_shared_packing", lambda *a: (_ for _ in ()).throw(ValueError("no fit")))
    for k, v in pack_batch(b, roomy).items():
        np.testing.assert_array_equal(v, pack_batch(b, dataclasses.replace(roomy, share_prompts=False))[k])


@pytest.mark.parametrize("family", ["llama", "gemma2"])
def test_shared_prompt_forward_matches_each_sequence_alone(family):
    # gemma2: a sliding window of 3 over positions (a response is not next to its prompt in the row)
    model = _model(family)
    p, r = 6, 5
    b = _grpo_batch(n_prompts=2, n=3, p=p, r=r, seed=6, r_lens=[5, 1, 3, 5, 2, 4])
    spec = make_pack_spec(6, rows=2, prompt_length=p, response_length=r, row_len=22, share_prompts=True)
    pk = pack_batch(b, spec)
    assert np.count_nonzero(pk["segment_ids"]) < b["attention_mask"].sum()  # prompts were shared
    n = spec.n_micro
    fwd = jax.jit(lambda i, s, q: model(i, s != 0, positions=q, segment_ids=s))
    logits = fwd(*(pk[k].reshape(n * 2, -1) for k in ("input_ids", "segment_ids", "positions")))
    logits = np.asarray(logits).reshape(n, -1, logits.shape[-1])
    single = jax.jit(lambda i, a, q: model(i, a, positions=q))
    for i in range(6):
        alone = np.asarray(single(*(b[k][i : i + 1] for k in ("input_ids", "attention_mask", "position_ids"))))
        n_r = int(b["attention_mask"][i, p:].sum())
        (k,), (s,) = np.nonzero(pk["seq_index"] == i)
        got = logits[k, pk["slot_pos"][k, pk["seq_slot"][k, s, :n_r]]]  # logits predicting each response token
        np.testing.assert_allclose(got, alone[0, p - 1 : p - 1 + n_r], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
@pytest.mark.slow
def test_shared_prompt_actor_update_log_probs_and_critic_equal_padded(mode):
    model = _model("llama", seed=1, num_layers=1)
    graphdef, params, rest = steps.split_model(model)
    b = dict(_rollout(), **_grpo_batch(seed=7))  # 2 prompts x 4, 8 rows
    b["loss_mask"] = b["attention_mask"][:, 6:].copy()
    tx = optax.sgd(1.0)
    cfg = ppo_update.ActorLossConfig(loss_agg_mode=mode, entropy_coeff=0.01, use_kl_loss=True, kl_loss_coef=0.1)
    want = jax.jit(ppo_update.make_actor_update(steps.padded_layout(n_micro=4), graphdef, rest, tx, cfg))(
        params, tx.init(params), b
    )
    pk = _packed(b, rows=2, share_prompts=True)
    assert np.count_nonzero(pk["segment_ids"]) < b["attention_mask"].sum()
    got = jax.jit(ppo_update.make_actor_update(packed_steps.PACKED, graphdef, rest, tx, cfg))(
        params, tx.init(params), pk
    )
    _close(got[0], want[0])
    for k in want[2]:
        np.testing.assert_allclose(got[2][k], want[2][k], atol=1e-5, rtol=1e-5, err_msg=k)
    assert float(want[2]["grad_norm"]) > 0.1
    if mode != "token-mean":
        return
    mask = b["attention_mask"][:, 6:].astype(bool)
    lp0, _ = jax.jit(
        update_core.make_log_prob_fn(
            steps.padded_layout(micro_batch_size=4), graphdef, rest, temperature=1.0, with_entropy=False
        )
    )(params, b)
    lp1, _ = jax.jit(
        update_core.make_log_prob_fn(packed_steps.PACKED, graphdef, rest, temperature=1.0, with_entropy=False)
    )(params, pk)
    np.testing.assert_allclose(np.asarray(lp1)[mask], np.asarray(lp0)[mask], atol=1e-5, rtol=1e-5)
    critic = CriticModel.from_actor(model, nnx.Rngs(1))
    cg, cp, cr = steps.split_model(critic)
    cp["value_head"][...] = jnp.asarray(np.random.RandomState(0).randn(32, 1).astype(np.float32) * 0.3)
    v_pad = jax.jit(update_core.make_value_fn(steps.padded_layout(micro_batch_size=4), cg, cr))(cp, b)
    v_pk = jax.jit(update_core.make_value_fn(packed_steps.PACKED, cg, cr))(cp, pk)
    np.testing.assert_allclose(np.asarray(v_pk)[mask], np.asarray(v_pad)[mask], atol=1e-5, rtol=1e-5)
