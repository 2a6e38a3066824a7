"""Packed slots in per-shard blocks (`PackSpec.shards`, issue 37 item 3): the packer's layout (hand case) and,
on 8 fake CPU devices ((data 1, fsdp 4, tensor 2) mesh, placed as the trainer does), packed log-probs / entropy
(also with shared prompts and with sampling-mask replay), the teacher's top-k, critic values and the actor update
with per-shard slot blocks equal the padded single-device ones."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from jaxrl_post.engine.packing import PackSpec, make_pack_spec, pack_batch, plan_packing
from tests.cheap_compile import CHEAP_COMPILE_FLAGS

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _batch(p_lens, r_lens, p, r, seed=0, vocab=50):
    rng = np.random.default_rng(seed)
    p_lens, r_lens = np.asarray(p_lens), np.asarray(r_lens)
    m = len(p_lens)
    ids = rng.integers(3, vocab, (m, p + r)).astype(np.int32)
    am = np.concatenate([np.arange(p)[None] >= p - p_lens[:, None], np.arange(r)[None] < r_lens[:, None]], 1)
    ids = ids * am
    return dict(input_ids=ids, attention_mask=am.astype(np.int32), responses=ids[:, p:].copy())


def test_sharded_slot_layout_hand_case():
    """rows 4 of 8 tokens in 2 shards (rows 0-1, 2-3), 8 slots (blocks of 4), 2 micro-batches. Sequences
    (prompt, response): 0 (4, 4), 1 (1, 3), 2 (3, 1), 3 (2, 2); FFD order 0, 1, 2, 3.
    * 0 -> micro 0 row 0, slots 0-3: block 0 is full;
    * 1 -> not row 1 (block 0 full) but row 2 (shard 1), slots 4-6 (one block: it would take row 1);
    * 2 -> row 2 after 1 (offset 4), slot 7; block 1 is full;
    * 3 -> micro 0 has no block with 2 free slots: micro 1 row 0, slots 0-1.
    slot_pos is shard-local: row 2 is shard 1's local row 0."""
    b = _batch([4, 1, 3, 2], [4, 3, 1, 2], p=4, r=4)
    spec = PackSpec(n_micro=2, rows=4, row_len=8, seqs=4, slots=8, response_length=4, shards=2)
    place = plan_packing(np.array([8, 4, 4, 4]), np.array([4, 3, 1, 2]), spec)
    assert place[:, [0, 1, 2, 4]].tolist() == [[0, 0, 0, 0], [0, 2, 0, 4], [0, 2, 4, 7], [1, 0, 0, 0]]
    one = PackSpec(n_micro=2, rows=4, row_len=8, seqs=4, slots=8, response_length=4)  # one block: 1 -> row 1
    assert plan_packing(np.array([8, 4, 4, 4]), np.array([4, 3, 1, 2]), one)[1, 1] == 1

    pk = pack_batch(b, spec)
    assert pk["slot_pos"].shape == (2, 2, 4)
    # micro 0: block 0 = seq 0 at row 0 cols 3..6; block 1 = seq 1 (row 2 = local 0, cols 0..2), seq 2 (col 6)
    assert pk["slot_pos"][0].tolist() == [[3, 4, 5, 6], [0, 1, 2, 6]]
    assert pk["slot_pos"][1].tolist() == [[1, 2, 0, 0], [0, 0, 0, 0]]  # seq 3 at row 0 cols 1, 2; rest unused
    assert pk["seq_slot"][0, :, 0].tolist() == [0, 4, 7, -1] and pk["seq_slot"][1, 0, :2].tolist() == [0, 1]
    # every used slot's hidden state lies in its block's shard and predicts the slot's token
    flat = pk["input_ids"].reshape(2, 2, 2 * 8)  # [micro, shard, local rows * L]
    for k in range(2):
        for s in range(4):
            i = pk["seq_index"][k, s]
            if i < 0:
                continue
            for r_i, q in enumerate(pk["seq_slot"][k, s]):
                if q < 0:
                    continue
                j, ql = divmod(int(q), 4)
                pos = pk["slot_pos"][k, j, ql]
                assert pk["slot_tokens"][k, q] == b["responses"][i, r_i]
                assert flat[k, j, pos + 1] == b["responses"][i, r_i]  # the next token in the same shard's rows


def test_make_pack_spec_shards_and_one_shard_layout_unchanged():
    """shards kept when they divide rows (slots a multiple), else 1; shards = 1 gives the `[n, Q]` layout."""
    spec = make_pack_spec(16, rows=8, prompt_length=8, response_length=8, shards=4)
    assert (spec.shards, spec.slots, spec.block_rows, spec.block_slots) == (4, 64, 2, 16)
    assert make_pack_spec(16, rows=6, prompt_length=8, response_length=8, shards=4).shards == 1
    with pytest.raises(ValueError, match="shards"):
        make_pack_spec(16, rows=8, prompt_length=8, response_length=8, shards=0)
    with pytest.raises(ValueError, match="shards"):
        plan_packing(np.array([4]), np.array([2]), PackSpec(1, 3, 8, 4, 8, 4, shards=2))
    rng = np.random.default_rng(3)
    b = _batch(rng.integers(1, 6, 12), rng.integers(1, 5, 12), p=5, r=4, seed=3)
    base = pack_batch(b, make_pack_spec(12, rows=4, prompt_length=5, response_length=4))
    again = pack_batch(b, make_pack_spec(12, rows=4, prompt_length=5, response_length=4, shards=1))
    assert base["slot_pos"].ndim == 2 and set(base) == set(again)
    for k in base:
        np.testing.assert_array_equal(base[k], again[k])


_SCRIPT = textwrap.dedent(
    """
    import json
    import jax, jax.numpy as jnp, numpy as np, optax
    from flax import nnx
    from jaxrl_post.models import ModelConfig, init_model
    from jaxrl_post.runtime.sharding import InMesh, make_mesh
    from jaxrl_post.engine import packed_steps, packing, steps, update_core
    from jaxrl_post.rl import ppo_update
    from jaxrl_post.engine.placement import Placement
    PAD8, PK = steps.padded_layout(micro_batch_size=8), packed_steps.PACKED  # the forwards' two layouts

    assert jax.device_count() == 8
    mesh = make_mesh(data=1, fsdp=4, tensor=2)
    cfg = ModelConfig(family="llama", vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=1,
                      num_heads=4, num_kv_heads=2, head_dim=8, tie_word_embeddings=False)
    model = init_model(cfg, seed=0, mesh=mesh)
    graphdef, state = nnx.split(model)
    rng = np.random.RandomState(0)
    state = jax.tree.map(lambda x: jax.device_put(jnp.asarray(0.15 * rng.randn(*x.shape), x.dtype), x.sharding),
                         state)
    model = nnx.merge(graphdef, state)
    graphdef, params, rest = steps.split_model(model)
    single = jax.device_put(jax.device_get(params), jax.devices()[0])
    rest1 = jax.device_put(jax.device_get(rest), jax.devices()[0])

    m, p, r = 16, 6, 5
    rng = np.random.default_rng(0)
    p_len, r_len = rng.integers(1, p + 1, m), rng.integers(1, r + 1, m)
    am = np.concatenate([np.arange(p)[None] >= p - p_len[:, None], np.arange(r)[None] < r_len[:, None]], 1)
    ids = (rng.integers(3, 64, (m, p + r)) * am).astype(np.int32)
    lm = am[:, p:].astype(np.int32)
    b = dict(input_ids=ids, attention_mask=am.astype(np.int32), responses=ids[:, p:].copy(), loss_mask=lm,
             position_ids=np.maximum(np.cumsum(am, 1) - 1, 0).astype(np.int32),
             advantages=rng.normal(size=(m, r)).astype(np.float32),
             old_log_probs=(rng.normal(size=(m, r)) * 0.3 - 4.0).astype(np.float32),
             sampling_logit_threshold=np.zeros((m, r), np.float32))
    placer = Placement(mesh, n_devices=8)
    spec = packing.make_pack_spec(m, 8, p, r, shards=4)  # 8 rows of one sequence, 4 shards of 2 rows
    out = {"shards": spec.shards}
    pk = placer.put_packed(placer.pack(b, spec))
    out["slot_pos_shape"] = list(pk["slot_pos"].shape)
    out["slot_pos_spec"] = str(pk["slot_pos"].sharding.spec)
    mask = am[:, p:]

    fwd = update_core.make_log_prob_fn(PAD8, graphdef, rest1, temperature=0.7, with_entropy=True)
    keys = ("input_ids", "attention_mask", "position_ids", "responses")
    lp0, ent0 = jax.jit(fwd)(single, {k: b[k] for k in keys})
    fwd_pk = InMesh(jax.jit(update_core.make_log_prob_fn(PK, graphdef, rest, temperature=0.7, with_entropy=True)), mesh)
    fwd_keys = packed_steps.PACK_KEYS + ("responses",)
    lp1, ent1 = fwd_pk(params, {k: pk[k] for k in fwd_keys})
    diff = lambda x, y: float(np.abs(np.asarray(x) - np.asarray(y))[mask].max())
    out["lp_diff"], out["ent_diff"] = diff(lp0, lp1), diff(ent0, ent1)
    out["lp_pad_zero"] = bool(np.all(np.asarray(lp1)[~mask] == 0))
    out["lp_scale"] = float(np.abs(np.asarray(lp0)[mask]).max())

    # sampling-mask replay (slot_threshold): the full-logits head per block, vs the padded one
    fwd_t = update_core.make_log_prob_fn(PAD8, graphdef, rest1, temperature=0.7, with_entropy=False)
    lp0t, _ = jax.jit(fwd_t)(single, {k: b[k] for k in keys + ("sampling_logit_threshold",)})
    fwd_pkt = update_core.make_log_prob_fn(PK, graphdef, rest, temperature=0.7, with_entropy=False)
    fwd_pkt = InMesh(jax.jit(fwd_pkt), mesh)
    lp1t, _ = fwd_pkt(params, {k: pk[k] for k in fwd_keys + ("slot_threshold",)})
    out["lp_replay_diff"] = diff(lp0t, lp1t)
    out["replay_changes"] = diff(lp0t, lp0)

    # the top-k distillation teacher head (chunked over the flat slots): same top-k log-probs and ids
    fk = update_core.make_log_prob_fn(PAD8, graphdef, rest1, temperature=1.0, with_entropy=False, topk=3)
    k0 = jax.jit(fk)(single, {k: b[k] for k in keys})
    fk1 = update_core.make_log_prob_fn(PK, graphdef, rest, temperature=1.0, with_entropy=False, topk=3)
    k1 = InMesh(jax.jit(fk1), mesh)(params, {k: pk[k] for k in fwd_keys})
    out["topk_lp_diff"] = float(np.abs(np.asarray(k0[2]) - np.asarray(k1[2]))[mask].max())
    out["topk_ids_equal"] = bool(np.array_equal(np.asarray(k0[3])[mask], np.asarray(k1[3])[mask]))

    # shared prompts (4 samples per prompt) in per-shard blocks: the same log-probs
    bs = dict(b, input_ids=b["input_ids"].copy(), attention_mask=b["attention_mask"].copy(),
              position_ids=b["position_ids"].copy())
    for k in ("input_ids", "attention_mask", "position_ids"):
        bs[k][:, :p] = np.repeat(bs[k][::4, :p], 4, 0)
    lp0s, _ = jax.jit(fwd)(single, {k: bs[k] for k in keys})
    spec_s = packing.make_pack_spec(m, 8, p, r, shards=4, share_prompts=True)
    pks = placer.put_packed(placer.pack({k: bs[k] for k in keys}, spec_s))
    out["shared_segments"] = int(np.asarray(pks["segment_ids"]).max())
    lp1s, _ = fwd_pk(params, {k: pks[k] for k in fwd_keys})
    mask_s = bs["attention_mask"][:, p:].astype(bool)
    out["shared_lp_diff"] = float(np.abs(np.asarray(lp0s) - np.asarray(lp1s))[mask_s].max())

    # critic values (value head per block)
    from jaxrl_post.models import CriticModel
    critic = CriticModel.from_actor(model, nnx.Rngs(1))
    cg, cp, cr = steps.split_model(critic)
    from jaxrl_post.runtime.sharding import shard_params
    cp = placer.commit(shard_params(cp, mesh))
    cp["value_head"][...] = jax.device_put(jnp.asarray(np.random.RandomState(1).randn(32, 1) * 0.3, jnp.float32),
                                           cp["value_head"][...].sharding)
    cp1 = jax.device_put(jax.device_get(cp), jax.devices()[0])
    cr1 = jax.device_put(jax.device_get(cr), jax.devices()[0])
    v0 = jax.jit(update_core.make_value_fn(PAD8, cg, cr1))(cp1, {k: b[k] for k in keys})
    v1 = InMesh(jax.jit(update_core.make_value_fn(PK, cg, cr)), mesh)(cp, {k: pk[k] for k in fwd_keys})
    out["value_diff"] = diff(v0, v1)
    out["value_scale"] = float(np.abs(np.asarray(v0)[mask]).max())

    # actor update (sgd 1.0: new params = params - grads), padded single device vs packed per-shard blocks
    tx = optax.sgd(1.0)
    lcfg = ppo_update.ActorLossConfig(loss_agg_mode="token-mean", entropy_coeff=0.01, temperature=0.7)
    upd0 = jax.jit(ppo_update.make_actor_update(steps.padded_layout(n_micro=2), graphdef, rest1, tx, lcfg))
    ukeys = keys + ("loss_mask", "advantages", "old_log_probs")
    new0, _, met0 = upd0(single, tx.init(single), {k: b[k] for k in ukeys})
    upd1 = InMesh(jax.jit(ppo_update.make_actor_update(packed_steps.PACKED, graphdef, rest, tx, lcfg)), mesh)
    pk_u = {k: v for k, v in pk.items() if k != "slot_threshold"}
    new1, _, met1 = upd1(params, tx.init(params), pk_u)
    out["param_diff"] = max(float(np.abs(np.asarray(x) - np.asarray(y)).max())
                            for x, y in zip(jax.tree.leaves(new0), jax.tree.leaves(new1)))
    out["grad_norm"] = [float(met0["grad_norm"]), float(met1["grad_norm"])]
    out["loss"] = [float(met0["pg_loss"]), float(met1["pg_loss"])]
    print("RESULT " + json.dumps(out), flush=True)
    """
)


@pytest.fixture(scope="module")
def fake8():
    env = dict(
        os.environ,
        XLA_FLAGS="--xla_force_host_platform_device_count=8 " + CHEAP_COMPILE_FLAGS,
        JAX_PLATFORMS="cpu",
        PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""),
    )
    proc = subprocess.run([sys.executable, "-c", _SCRIPT], env=env, capture_output=True, text=True, timeout=900)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-4000:]
    return json.loads(lines[-1][len("RESULT ") :])


@pytest.mark.slow  # a subprocess on 8 fake devices compiling 3 padded and 3 packed programs
def test_sharded_slot_blocks_log_probs_and_update_equal_padded_single_device(fake8):
    assert fake8["shards"] == 4 and fake8["slot_pos_shape"] == [2, 4, 10]  # n_micro 2, Q = 8 * 5 = 40
    batch_axes = ("data", "fsdp", "expert")  # rows over the batch axes; a trailing None (replicated) is the same spec
    assert fake8["slot_pos_spec"] in (str(P(None, batch_axes)), str(P(None, batch_axes, None)))
    assert fake8["lp_scale"] > 1.0  # O(1) log-probs: the tolerances below are not vacuous
    assert fake8["lp_diff"] <= 1e-5 and fake8["ent_diff"] <= 1e-5 and fake8["lp_pad_zero"]
    assert fake8["lp_replay_diff"] <= 1e-5 < fake8["replay_changes"]  # the threshold mask does change them
    assert fake8["topk_lp_diff"] <= 1e-5 and fake8["topk_ids_equal"]
    assert fake8["shared_segments"] >= 1 << 8 and fake8["shared_lp_diff"] <= 1e-5  # shared chunks were built
    assert fake8["value_diff"] <= 1e-5 * max(1.0, fake8["value_scale"]) and fake8["value_scale"] > 0.1
    assert fake8["param_diff"] <= 1e-5
    assert fake8["grad_norm"][0] > 0.1
    np.testing.assert_allclose(fake8["grad_norm"][1], fake8["grad_norm"][0], rtol=1e-5)
    np.testing.assert_allclose(fake8["loss"][1], fake8["loss"][0], rtol=1e-5, atol=1e-6)
