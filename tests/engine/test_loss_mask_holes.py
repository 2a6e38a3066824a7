"""`loss_mask` holes: response tokens that exist (attended to, in `response_attention_mask`) but are not trained
(`loss_mask` 0), as tool outputs are in a multi-turn rollout. Every consumer is checked against a hand/numpy
computation that uses the mask it means, and against the same batch with garbage written into the holes:
actor loss (policy loss, KL in loss, entropy; padded and packed, micro-batched), critic loss, KL in reward,
GAE / returns, GRPO, rollout correction, reward decoding and score placement, and the length metrics.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from jaxrl_post.algos import core_algos
from jaxrl_post.algos.rollout_corr import compute_rollout_correction_and_rejection_mask
from jaxrl_post.batch.protocol import DataProto
from jaxrl_post.engine import packed_steps, packing, steps
from jaxrl_post.rewards.manager import RewardManager
from jaxrl_post.rl import advantage_fn, ppo_update
from jaxrl_post.rl import metrics as metrics_lib

P, R, B, V = 4, 7, 6, 50


def _model():
    from jaxrl_post.models import ModelConfig, init_model

    cfg = ModelConfig(
        vocab_size=V,
        hidden_size=32,
        intermediate_size=64,
        num_layers=1,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        tie_word_embeddings=True,
    )
    return init_model(cfg, seed=5)


def _batch(seed=0):
    """B trajectories: prompt (left-padded), then model tokens, a 2-3 token tool observation (hole), model tokens."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(3, V, (B, P + R)).astype(np.int32)
    pmask = np.ones((B, P), np.int32)
    pmask[:2, :1] = 0
    lens = np.array([7, 6, 7, 5, 7, 3])
    exists = (np.arange(R)[None] < lens[:, None]).astype(np.int32)
    loss_mask = exists.copy()
    loss_mask[0, 2:4] = 0  # tool tokens between two model turns
    loss_mask[1, 1:4] = 0
    loss_mask[2, 3:5] = 0
    loss_mask[4, 1:3] = 0
    # row 3 and 5: single-turn (no hole)
    am = np.concatenate([pmask, exists], 1)
    ids = ids * am
    return dict(
        input_ids=ids,
        attention_mask=am,
        position_ids=np.maximum(np.cumsum(am, 1) - 1, 0).astype(np.int32),
        responses=ids[:, P:].copy(),
        response_attention_mask=exists,
        loss_mask=loss_mask,
        advantages=rng.normal(size=(B, R)).astype(np.float32),
        old_log_probs=(rng.normal(size=(B, R)) * 0.3 - 3.9).astype(np.float32),
        ref_log_prob=(rng.normal(size=(B, R)) * 0.3 - 3.9).astype(np.float32),
        rollout_log_probs=(rng.normal(size=(B, R)) * 0.3 - 3.9).astype(np.float32),
        values=rng.normal(size=(B, R)).astype(np.float32),
        returns=rng.normal(size=(B, R)).astype(np.float32),
    )


def _garbage_in_holes(b, keys, seed=1):
    """A copy of `b` with large random values at the holes (existing, untrained tokens) of `keys`."""
    rng = np.random.default_rng(seed)
    hole = (b["attention_mask"][:, P:] != 0) & (b["loss_mask"] == 0)
    assert hole.sum() >= 8
    out = {k: v.copy() for k, v in b.items()}
    for k in keys:
        out[k] = np.where(hole, rng.normal(size=hole.shape) * 50, out[k]).astype(out[k].dtype)
    return out


def _max_diff(a, b):
    return max(float(jnp.max(jnp.abs(x - y))) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


_ACTOR_KEYS = ("advantages", "old_log_probs", "ref_log_prob", "rollout_log_probs")


@pytest.mark.slow
def test_actor_update_trains_only_loss_mask_tokens():
    mode = "seq-mean-token-mean"  # its per-sequence counts come from the loss mask too
    model = _model()
    graphdef, params, rest = steps.split_model(model)
    b = _batch()
    cfg = ppo_update.ActorLossConfig(
        loss_agg_mode=mode, entropy_coeff=0.01, use_kl_loss=True, kl_loss_coef=0.1, kl_loss_type="low_var_kl"
    )
    tx = optax.sgd(1.0)  # new params = params - grads
    keys = ("input_ids", "attention_mask", "position_ids", "responses", "loss_mask", *_ACTOR_KEYS)
    mb = {k: b[k] for k in keys}
    padded = jax.jit(ppo_update.make_actor_update(steps.padded_layout(n_micro=2), graphdef, rest, tx, cfg))
    got = padded(params, tx.init(params), mb)

    # the loss written out with the loss mask (holes attended to in the forward, absent from every term)
    def reference(prm):
        m = nnx.merge(graphdef, prm, rest)
        logits = m(b["input_ids"], b["attention_mask"], positions=b["position_ids"])[:, P - 1 : P + R - 1]
        logp_all = jax.nn.log_softmax(logits, -1)
        logp = jnp.take_along_axis(logp_all, b["responses"][..., None], -1)[..., 0]
        ent = -jnp.sum(jnp.exp(logp_all) * logp_all, -1)
        mask = jnp.asarray(b["loss_mask"], jnp.float32)
        ratio = jnp.exp(logp - b["old_log_probs"])
        adv = b["advantages"]
        pg = jnp.maximum(-adv * ratio, -adv * jnp.clip(ratio, 0.8, 1.2))
        pg = jnp.where(adv < 0, jnp.minimum(pg, -adv * 3.0), pg)
        d = b["ref_log_prob"] - logp
        kl = jnp.clip(jnp.exp(d) - d - 1, -10, 10)
        if mode == "token-mean":
            agg = lambda x: jnp.sum(x * mask) / jnp.sum(mask)
        else:
            agg = lambda x: jnp.mean(jnp.sum(x * mask, -1) / jnp.sum(mask, -1))  # every row has model tokens
        diff = jnp.abs(jnp.exp(logp) - jnp.exp(b["rollout_log_probs"]))
        return agg(pg) - 0.01 * agg(ent) + 0.1 * agg(kl), (agg(ent), jnp.sum(diff * mask) / jnp.sum(mask))

    (loss, (ent, probs_diff)), grads = jax.jit(jax.value_and_grad(reference, has_aux=True))(params)
    np.testing.assert_allclose(got[2]["loss"], loss, rtol=1e-5)
    np.testing.assert_allclose(got[2]["entropy"], ent, rtol=1e-5)
    np.testing.assert_allclose(got[2]["rollout_probs_diff_mean"], probs_diff, rtol=1e-5)
    assert _max_diff(got[0], jax.tree.map(lambda p, g: p - g, params, grads)) <= 2e-6

    # garbage in the holes changes nothing; the packed layout gives the same update
    dirty = _garbage_in_holes(mb, _ACTOR_KEYS)
    again = padded(params, tx.init(params), dirty)
    assert _max_diff(again[0], got[0]) == 0
    spec = packing.make_pack_spec(B, rows=3, prompt_length=P, response_length=R, row_len=2 * (P + R), n_micro=1)
    pk = dict(dirty, **packing.pack_batch(dirty, spec))
    packed = jax.jit(ppo_update.make_actor_update(packed_steps.PACKED, graphdef, rest, tx, cfg))(
        params, tx.init(params), pk
    )
    assert _max_diff(packed[0], got[0]) <= 1e-5
    np.testing.assert_allclose(packed[2]["loss"], loss, rtol=1e-5)


@pytest.mark.slow
def test_critic_update_fits_values_only_on_loss_mask_tokens():
    from jaxrl_post.models import CriticModel

    critic = CriticModel.from_actor(_model(), nnx.Rngs(1))
    graphdef, params, rest = steps.split_model(critic)
    params["value_head"][...] = jnp.full(params["value_head"][...].shape, 0.05, jnp.float32)
    b = _batch(seed=2)
    keys = ("input_ids", "attention_mask", "position_ids", "responses", "loss_mask", "values", "returns")
    mb = {k: b[k] for k in keys}
    tx = optax.sgd(1.0)
    cfg = ppo_update.CriticLossConfig(cliprange_value=0.5, loss_agg_mode="token-mean")
    fn = jax.jit(ppo_update.make_critic_update(steps.padded_layout(n_micro=2), graphdef, rest, tx, cfg))
    got = fn(params, tx.init(params), mb)

    def reference(prm):
        v = nnx.merge(graphdef, prm, rest)(b["input_ids"], b["attention_mask"], positions=b["position_ids"])
        v = v[:, P - 1 : P + R - 1]
        clipped = jnp.clip(v, b["values"] - 0.5, b["values"] + 0.5)
        loss = jnp.maximum((v - b["returns"]) ** 2, (clipped - b["returns"]) ** 2)
        mask = jnp.asarray(b["loss_mask"], jnp.float32)
        return 0.5 * jnp.sum(loss * mask) / jnp.sum(mask)

    vf_loss, grads = jax.value_and_grad(reference)(params)
    np.testing.assert_allclose(got[2]["vf_loss"], vf_loss, rtol=1e-5)
    assert _max_diff(got[0], jax.tree.map(lambda p, g: p - g, params, grads)) <= 2e-6
    again = fn(params, tx.init(params), _garbage_in_holes(mb, ("values", "returns")))
    assert _max_diff(again[0], got[0]) == 0


def _gae_by_hand(rewards, values, mask, gamma, lam):
    """GAE over the model's tokens only: a model token bootstraps from the next *model* token's value."""
    adv = np.zeros_like(rewards, np.float64)
    for i in range(rewards.shape[0]):
        nextv = last = 0.0
        for t in reversed(range(rewards.shape[1])):
            if not mask[i, t]:
                continue
            delta = rewards[i, t] + gamma * nextv - values[i, t]
            last = delta + gamma * lam * last
            nextv = values[i, t]
            adv[i, t] = last
    return adv, np.where(mask != 0, adv + values, 0.0)


def test_kl_in_reward_and_gae_skip_the_holes():
    b = _batch(seed=3)
    mask = b["loss_mask"]
    scores = np.zeros((B, R), np.float32)
    last = R - 1 - np.argmax(mask[:, ::-1], 1)
    scores[np.arange(B), last] = np.arange(B, dtype=np.float32) - 2.0
    fn = jax.jit(
        advantage_fn.make_advantage_fn(
            adv_estimator="gae",
            gamma=0.9,
            lam=0.8,
            norm_adv_by_std_in_grpo=True,
            use_kl_in_reward=True,
            kl_penalty="kl",
        )
    )
    index = np.repeat(np.arange(B // 2), 2).astype(np.int32)
    args = (np.float32(0.1), b["old_log_probs"], b["ref_log_prob"], b["values"], None)
    rewards, kl, adv, ret = (np.asarray(x) for x in fn(scores, mask, index, *args))
    # KL in reward: k1 on model tokens only; current_kl is the per-sequence mean over model tokens
    k1 = (b["old_log_probs"] - b["ref_log_prob"]).astype(np.float64)
    want_rewards = np.where(mask != 0, scores - 0.1 * k1, 0.0)
    np.testing.assert_allclose(rewards, want_rewards, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(kl, np.mean((k1 * mask).sum(1) / mask.sum(1)), rtol=1e-5)
    raw, want_ret = _gae_by_hand(want_rewards, b["values"].astype(np.float64), mask, 0.9, 0.8)
    np.testing.assert_allclose(ret, want_ret, rtol=1e-5, atol=1e-5)
    sel = raw[mask != 0]
    whitened = (raw - sel.mean()) / np.sqrt(sel.var(ddof=1) + 1e-8)
    np.testing.assert_allclose(adv, np.where(mask != 0, whitened, 0.0), rtol=1e-4, atol=1e-5)
    # garbage in the holes (log-probs, values) changes nothing
    dirty = _garbage_in_holes(b, ("old_log_probs", "ref_log_prob", "values"))
    args2 = (np.float32(0.1), dirty["old_log_probs"], dirty["ref_log_prob"], dirty["values"], None)
    for x, y in zip(fn(scores, mask, index, *args2), (rewards, kl, adv, ret)):
        np.testing.assert_array_equal(np.asarray(x), y)

    # GRPO: the outcome advantage is broadcast to the model's tokens only
    grpo = jax.jit(
        advantage_fn.make_advantage_fn(
            adv_estimator="grpo",
            gamma=1.0,
            lam=1.0,
            norm_adv_by_std_in_grpo=True,
            use_kl_in_reward=False,
            kl_penalty="kl",
        )
    )
    _, _, gadv, _ = grpo(scores, mask, index, np.float32(0.0), None, None, None, None)
    s = scores.sum(1).reshape(-1, 2)
    per_seq = ((s - s.mean(1, keepdims=True)) / (s.std(1, ddof=1, keepdims=True) + 1e-6)).reshape(-1)
    np.testing.assert_allclose(np.asarray(gadv), per_seq[:, None] * (mask != 0), rtol=1e-5, atol=1e-6)


def test_rollout_correction_reads_only_model_tokens():
    b = _batch(seed=4)
    kw = dict(rollout_is="token", rollout_is_threshold=2.0, rollout_rs="token_k1", rollout_rs_threshold="0.7_1.3")
    # one compiled program for both calls (eager, its ~40 metric ops dispatch one by one: ~20 s on a loaded CPU)
    corr = jax.jit(lambda old, rollout, mask: compute_rollout_correction_and_rejection_mask(old, rollout, mask, **kw))
    w, keep, m = corr(b["old_log_probs"], b["rollout_log_probs"], b["loss_mask"])
    dirty = _garbage_in_holes(b, ("old_log_probs", "rollout_log_probs"))
    w2, keep2, m2 = corr(dirty["old_log_probs"], dirty["rollout_log_probs"], b["loss_mask"])
    model = b["loss_mask"] != 0
    np.testing.assert_array_equal(np.asarray(w)[model], np.asarray(w2)[model])
    np.testing.assert_array_equal(np.asarray(keep), np.asarray(keep2))
    assert not np.asarray(keep)[~model].any()  # a hole is never trained, rejected or not
    for k in m:
        np.testing.assert_array_equal(np.asarray(m[k]), np.asarray(m2[k]), err_msg=k)
    # by hand: token IS weight = min(exp(old - rollout), threshold) on model tokens
    ratio = np.exp(b["old_log_probs"] - b["rollout_log_probs"])
    np.testing.assert_allclose(np.asarray(w)[model], np.minimum(ratio, 2.0)[model], rtol=1e-5)


class _Tok:
    def batch_decode(self, lists, skip_special_tokens=True):
        return ["".join(chr(97 + (t % 26)) for t in ids) for ids in lists]


def test_reward_decodes_every_token_and_scores_the_last_model_token():
    b = _batch(seed=5)
    b["loss_mask"][2, 6] = 0  # row 2 ends with an observation token: the score goes on its last model token
    data = DataProto.from_dict(
        tensors={k: b[k] for k in ("responses", "response_attention_mask", "loss_mask")},
        non_tensors={"data_source": np.array(["t"] * B, object), "ground_truth": np.array(["x"] * B, object)},
    )
    seen = []

    def score(source, text, gt, info):
        seen.append(text)
        return float(len(text))

    rm = RewardManager(score, _Tok(), num_workers=0)
    try:
        out = rm.compute(data)
    finally:
        rm.close()
    lens = b["response_attention_mask"].sum(1)
    assert [len(t) for t in seen] == lens.tolist()  # tool tokens are part of the decoded trajectory
    last_model = R - 1 - np.argmax(b["loss_mask"][:, ::-1], 1)
    assert last_model[2] == 5 and lens[2] == 7
    want = np.zeros((B, R), np.float32)
    want[np.arange(B), last_model] = lens
    np.testing.assert_array_equal(np.asarray(out.token_level_scores), want)


def test_length_metrics_count_existing_tokens_and_statistics_model_tokens():
    b = _batch(seed=6)
    b["token_level_scores"] = b["token_level_rewards"] = np.zeros((B, R), np.float32)
    m = metrics_lib.compute_data_metrics(b, use_critic=True, max_response_length=R)
    lens = b["response_attention_mask"].sum(1)
    assert m["response_length/mean"] == pytest.approx(lens.mean())
    assert m["response_length/max"] == 7 and m["response_length/min"] == 3
    model = b["loss_mask"] != 0
    assert m["critic/advantages/max"] == pytest.approx(b["advantages"][model].max())
    assert m["critic/advantages/min"] == pytest.approx(b["advantages"][model].min())
    assert m["critic/values/mean"] == pytest.approx(b["values"][model].mean(), rel=1e-5)
    assert m["critic/returns/mean"] == pytest.approx(b["returns"][model].mean(), rel=1e-5)


def test_single_turn_rollout_masks_agree():
    """The single-turn generator: every existing response token is the model's (loss_mask ==
    response_attention_mask), and attention_mask's response part is response_attention_mask."""
    from jaxrl_post.rollout import Generator, SamplingParams

    model = _model()
    ids = np.random.default_rng(0).integers(3, V, (4, P)).astype(np.int32)
    prompts = DataProto.from_dict({"input_ids": ids, "attention_mask": np.ones_like(ids)})
    params = SamplingParams(max_new_tokens=6, temperature=1.0, eos_token_ids=tuple(range(3, 20)), pad_token_id=0)
    out = Generator(model).generate(prompts, params, seed=1).batch
    np.testing.assert_array_equal(out["loss_mask"], out["response_attention_mask"])
    np.testing.assert_array_equal(out["attention_mask"][:, P:], out["response_attention_mask"])
    assert 0 < out["response_attention_mask"].sum() < out["response_attention_mask"].size  # some EOS, some not
    assert "response_mask" not in out  # one name per meaning
    assert core_algos.masked_sum(jnp.ones((4, 6)), out["loss_mask"]) == out["loss_mask"].sum()
