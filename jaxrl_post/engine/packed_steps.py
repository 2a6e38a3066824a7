"""The packed (padding-free) layout of the `forward` and `update` jit boundaries (`PACKED`, an `update_core`
layout) and the public packed factories; the losses, accumulation, guard and optimizer step are `update_core`'s.

Inputs come from `packing.pack_batch` (static `PackSpec` shapes, n = micro-batches, S = sequence slots,
Q = response slots, L = row_len) plus the usual per-sequence fields, unpacked, `[M, R]`:

* per token `input_ids`, `segment_ids`, `positions` `[n, rows, L] int32`: the decoder runs on packed rows
  with attention masked per segment (`Transformer.hidden_states(segment_ids=...)`);
* `slot_pos`, `slot_tokens` `[n, Q] int32`: only the hidden states that predict a response token go
  through the LM head / log-softmax (float32) or the value head. With G = `PackSpec.shards` > 1 (the rows are
  split over G = data * fsdp devices) `slot_pos` is `[n, G, Q / G]`: block j's slots are hidden states of
  shard j's rows, indexed shard-locally, so the gather and the LM head run per shard (`_hidden_at_slots`,
  `_block_head`) and XLA keeps them on the device holding those rows: each computes Q / G slots, not Q;
* `seq_slot [n, S, R]`, `seq_index [n, S]` int32: scatter slot results into `[S, R]` per-sequence arrays
  and gather the `[M, R]` fields (advantages, old log-probs, ...) of the same sequences.

The losses are `losses.actor_loss` / `losses.critic_loss` on those `[S, R]` arrays with the mini-batch's
`core_algos.global_batch_info` counts (computed from the unpacked `[M, R]` mask), so packed and padded
updates agree in every `loss_agg_mode` (empty sequence slots have an all-zero mask and contribute 0).
Micro-batches with no tokens (the packer fills micro-batches in order, so they are a suffix) are never run:
the loops over micro-batches are `lax.fori_loop`s with a traced trip count, so compute scales with the real
tokens while every shape, hence every compile, stays fixed.

A LoRA actor (`steps.split_lora_model`) passes its frozen base params as the trailing `frozen` argument of
every fn, exactly as the padded steps do; gradients and optimizer state cover the adapters only.

Source: verl `dp_actor` / `dp_critic` with `use_remove_padding` (unpad + varlen attention) and
`use_dynamic_bsz`; MaxText packing (segment ids, per-segment positions).
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from jaxrl_post.algos import core_algos, functional
from jaxrl_post.algos.distillation_topk import gather_log_probs, teacher_topk
from jaxrl_post.batch.keys import OPTIONAL_PACK_KEYS, PACK_KEYS, REPLAY_KEYS
from jaxrl_post.engine import update_core
from jaxrl_post.runtime.sharding import constrain


def _hidden_at_slots(backbone, mb, with_moe: bool = False):
    """Final hidden states at the micro-batch's response slots, `[Q, D]`. With per-shard slot blocks
    (`slot_pos [G, Q / G]`) each block is gathered from its own shard's rows (`[G, rows / G * L, D]`, the
    shard dim constrained to the batch axes), so no device gathers another's hidden states.
    with_moe: `(h, moe.MoEOutput | None)` (the routing of every real token of the packed rows). The packed
    `routed_experts [rows, L, M, k]`, when in `mb`, are forced as the MoE routes (routing replay)."""
    seg = mb["segment_ids"]
    routes = mb.get("routed_experts")
    h = backbone.hidden_states(
        mb["input_ids"], seg != 0, mb["positions"], segment_ids=seg, routed_experts=routes, with_moe=with_moe
    )
    h, moe = h if with_moe else (h, None)
    sp = mb["slot_pos"]
    if sp.ndim == 1:
        out = h.reshape(-1, h.shape[-1])[sp]
    else:
        g, qb = sp.shape
        hs = constrain(h.reshape(g, -1, h.shape[-1]), ("batch", None, None))
        out = constrain(jax.vmap(lambda hb, ib: hb[ib])(hs, sp), ("batch", None, None))  # [G, Q / G, D]
        out = out.reshape(g * qb, h.shape[-1])
    return (out, moe) if with_moe else out


# Slots per LM-head chunk in the per-block head. The vmapped blocks' [chunk, V] float32 temporaries are what
# grows: at Qwen2.5-7B LoRA shapes on fsdp=8 (scripts/memory_plan.py, docs/performance.md) 512 left 1.1 GB more
# update temps per device than 256 and 128 (equal); 256 slots x 3584 x 152k stays compute-bound on TPU / GPU.
BLOCK_HEAD_CHUNK = 256


def _blocks(mb) -> int:
    """Slot blocks G of the micro-batch (1: `slot_pos [Q]`, else `slot_pos [G, Q / G]`)."""
    sp = mb["slot_pos"]
    return 1 if sp.ndim == 1 else sp.shape[0]


def _block_head(model, mb, h, temperature, entropy):
    """`token_stats_from_hidden` per slot block: `(log_probs [Q], entropy [Q] | None)` float32, as the flat head
    on the used slots, with `h [Q, D]` viewed as `[G, Q / G, D]` (shard dim constrained to the batch axes) and
    the chunked head vmapped over the blocks. Each block's used slots are a prefix of it (the packer fills
    blocks in order); the head runs on the longest prefix and slots past their block's are zeroed (inputs and
    outputs), so they give 0 and no gradient."""
    g = _blocks(mb)
    q, d = h.shape
    qb = q // g
    hb = constrain(h.reshape(g, qb, d), ("batch", None, None))
    slot = mb["seq_slot"]
    used = jnp.zeros((g,), jnp.int32).at[jnp.where(slot >= 0, slot // qb, g)].add(1, mode="drop")
    valid = jnp.arange(qb)[None, :] < used[:, None]  # [G, Q / G]
    hb = jnp.where(valid[..., None], hb, jnp.zeros((), hb.dtype))
    labels = mb["slot_tokens"].reshape(g, qb)
    n_valid = jnp.max(used)

    def stats(hh, ll):
        return model.token_stats_from_hidden(
            hh, ll, n_valid, temperature, entropy, chunk=BLOCK_HEAD_CHUNK, in_loop_with=n_valid
        )

    lp, ent = jax.vmap(stats)(hb, labels)
    flat = lambda x: jnp.where(valid, x, 0.0).reshape(q)
    return flat(lp), None if ent is None else flat(ent)


def to_seq(x_q: jax.Array, seq_slot: jax.Array) -> jax.Array:
    """Slot values `[Q]` -> per-sequence `[S, R]` (0 where `seq_slot < 0`)."""
    return jnp.where(seq_slot >= 0, x_q[jnp.maximum(seq_slot, 0)], 0.0)


def gather_seq(x: jax.Array, seq_index: jax.Array) -> jax.Array:
    """Rows `[M, ...]` of the sequences in a micro-batch's slots -> `[S, ...]` (zeros in empty slots)."""
    valid = (seq_index >= 0).reshape(seq_index.shape + (1,) * (x.ndim - 1))
    return jnp.where(valid, x[jnp.maximum(seq_index, 0)], jnp.zeros((), x.dtype))


def to_seq_k(x_q: jax.Array, seq_slot: jax.Array) -> jax.Array:
    """Slot rows `[Q, K]` -> per-sequence `[S, R, K]` (0 where `seq_slot < 0`)."""
    return jnp.where((seq_slot >= 0)[..., None], x_q[jnp.maximum(seq_slot, 0)], jnp.zeros((), x_q.dtype))


def to_slots_k(x_seq: jax.Array, seq_slot: jax.Array, n_slots: int) -> jax.Array:
    """Per-sequence `[S, R, K]` -> slot rows `[Q, K]` (inverse of `to_seq_k`; unused slots 0)."""
    idx = jnp.where(seq_slot >= 0, seq_slot, n_slots)  # entries without a slot go out of range: dropped
    out = jnp.zeros((n_slots,) + x_seq.shape[2:], x_seq.dtype)
    return out.at[idx].set(x_seq, mode="drop")


TOPK_HEAD_CHUNK = 512  # slots per chunk of the top-k distillation head (the `[chunk, V]` float32 temporaries)


def _chunked_head(model, h: jax.Array, fn: Callable, extra: jax.Array | None):
    """`fn(logits [c, V] float32, extra [c, ...]) -> pytree of [c, ...]` over the slots in chunks of
    `TOPK_HEAD_CHUNK`: only one chunk's logits are live, and under a gradient each chunk's logits are recomputed
    (checkpoint). All Q slots are computed (unused ones give values that `to_seq_k` drops)."""
    q = h.shape[0]
    c = min(TOPK_HEAD_CHUNK, q)
    n = -(-q // c)
    pad = n * c - q
    hp = jnp.pad(h, ((0, pad), (0, 0))).reshape(n, c, h.shape[-1])
    ep = None if extra is None else jnp.pad(extra, ((0, pad),) + ((0, 0),) * (extra.ndim - 1))
    ep = None if ep is None else ep.reshape((n, c) + extra.shape[1:])

    @jax.checkpoint
    def one(args):
        hc, ec = args
        return fn(model.logits_from_hidden(hc[None])[0], ec)

    out = jax.lax.map(one, (hp, ep))
    return jax.tree.map(lambda x: x.reshape((n * c,) + x.shape[2:])[:q], out)


def packed_teacher_topk(model, mb, k: int, temperature: float = 1.0, h=None):
    """The teacher's top-k per response position of one packed micro-batch: `(log_probs [S, R, K] float32,
    ids [S, R, K] int32)` (`distillation_topk.teacher_topk`, chunked over the slots; 0 where no token)."""
    h = _hidden_at_slots(model, mb) if h is None else h
    lp, ids = _chunked_head(model, h, lambda logits, _: teacher_topk(logits, k, temperature), None)
    return to_seq_k(lp, mb["seq_slot"]), to_seq_k(ids, mb["seq_slot"])


def packed_gather_log_probs(model, mb, ids_seq: jax.Array, temperature: float, h=None) -> jax.Array:
    """The student's log-probs at `ids_seq [S, R, K]` (the teacher's top-k ids of the micro-batch's
    sequences): `[S, R, K] float32`, differentiable, chunked over the slots (no `[Q, V]` array)."""
    h = _hidden_at_slots(model, mb) if h is None else h
    ids_q = to_slots_k(ids_seq.astype(jnp.int32), mb["seq_slot"], h.shape[0])
    lp = _chunked_head(model, h, lambda logits, ids: gather_log_probs(logits, ids, temperature), ids_q)
    return to_seq_k(lp, mb["seq_slot"])


def packed_log_probs(model, mb, temperature: float, entropy: str, h=None):
    """log pi of the response tokens `[S, R] float32` (+ entropy `[S, R]` or None) of one packed micro-batch.

    entropy: a `functional.token_log_probs` mode. Padding / empty entries are 0. The LM head and the float32
    log-softmax run on the used response slots only, in chunks and without a `[Q, V]` logits array
    (`Transformer.token_stats_from_hidden`); with sampling-mask replay (`slot_threshold`), on all `Q` slots
    through the full logits. `h`: the micro-batch's slot hidden states `[Q, D]` when already computed.
    """
    h = _hidden_at_slots(model, mb) if h is None else h
    th = mb.get("slot_threshold")
    g = _blocks(mb)
    if th is None and g > 1:  # per shard's slot block (module docstring)
        lp, ent = _block_head(model, mb, h, temperature, entropy)
    elif th is None:  # fused chunked head over the used slots only (a prefix: the packer fills slots in order)
        n_used = jnp.sum((mb["seq_slot"] >= 0).astype(jnp.int32))
        lp, ent = model.token_stats_from_hidden(h, mb["slot_tokens"], n_used, temperature, entropy)
    else:  # sampling-mask replay needs the full logits: [G, Q / G, V] float32 (G = 1: today's [1, Q, V])
        q = h.shape[0]
        hb = h.reshape(g, q // g, h.shape[-1])
        logits = model.logits_from_hidden(hb if g == 1 else constrain(hb, ("batch", None, None)))
        rs = lambda x: x.reshape(g, q // g)
        lp, ent = functional.token_log_probs(logits, rs(mb["slot_tokens"]), temperature, entropy, rs(th))
        lp, ent = lp.reshape(q), None if ent is None else ent.reshape(q)
    seq = lambda x: to_seq(x, mb["seq_slot"])
    return seq(lp), None if ent is None else seq(ent)


def packed_values(critic, mb) -> jax.Array:
    """Critic values of the states before each response token, `[S, R] float32` (verl values[:, -R-1:-1])."""
    h = _hidden_at_slots(critic.backbone, mb).astype(jnp.float32)
    w = critic.value_head[...]
    if _blocks(mb) > 1:  # slots sharded with their rows: gather the FSDP-sharded head here, not hoisted (see above)
        w, _ = jax.lax.optimization_barrier((w, h))
    v = (h @ w)[:, 0] + critic.value_bias[...][0]
    return to_seq(v, mb["seq_slot"])


def _n_used(pack) -> jax.Array:
    """Micro-batches holding tokens (int32 scalar); the packer fills them first, so they are a prefix."""
    return update_core.n_used(pack["segment_ids"])


# ------------------------------------------------------------------------------------------ layout


class PackedLayout:
    """The packed batch layout of `update_core` (module docstring): micro-batches are the packer's `[n, ...]`
    rows, only those holding tokens run (`lax.fori_loop` with a traced trip count); the `[M, R]` response fields
    are gathered per micro-batch into `[S, R]` by sequence index, and results scattered back to `[M, R]`."""

    name = "packed"

    def head(self, model, mb, with_moe=False):
        return _hidden_at_slots(model, mb, with_moe)

    def log_probs(self, model, mb, head, temperature, entropy):
        return packed_log_probs(model, mb, temperature, entropy, head)

    def gather_log_probs(self, model, mb, head, ids, temperature):
        return packed_gather_log_probs(model, mb, ids, temperature, head)

    def teacher_topk(self, model, mb, head, k, temperature):
        return packed_teacher_topk(model, mb, k, temperature, head)

    def values(self, critic, mb):
        return packed_values(critic, mb)

    def forward(self, per_micro, batch, trail, with_tokens=False):
        """`per_micro(mb)` -> per-sequence `[S, R, ...]` outputs, scattered back to the mini-batch rows
        (`seq_index`); rows never packed stay 0. `trail`: per output `(trailing shape, dtype)`. `with_tokens`:
        `per_micro` returns `(outputs, token field [rows, L, ...])`, collected last as `[n, rows, L, ...]`
        (`token_fields.unpack_tokens` gives `[M, T, ...]`; micro-batches never run stay 0)."""
        pack = {k: batch[k] for k in PACK_KEYS + OPTIONAL_PACK_KEYS + REPLAY_KEYS if k in batch}
        m, r = batch["responses"].shape
        init = tuple(jnp.zeros((m + 1, r) + tuple(shape), dtype) for shape, dtype in trail)
        if with_tokens:
            tok = jax.eval_shape(lambda: per_micro(update_core.micro_at(pack, jnp.int32(0)))[1])
            init = (init, jnp.zeros((pack["input_ids"].shape[0], *tok.shape), tok.dtype))

        def body(i, outs):  # a while loop over the used micro-batches only (dynamic trip count)
            mb = update_core.micro_at(pack, i)
            idx = jnp.where(mb["seq_index"] >= 0, mb["seq_index"], m)  # empty slots -> spare row m
            if not with_tokens:
                return tuple(o.at[idx].set(v) for o, v in zip(outs, per_micro(mb)))
            new, tok = per_micro(mb)
            return tuple(o.at[idx].set(v) for o, v in zip(outs[0], new)), outs[1].at[i].set(tok)

        outs = jax.lax.fori_loop(0, _n_used(pack), body, init)
        if with_tokens:
            return (*(o[:m] for o in outs[0]), outs[1])
        return tuple(o[:m] for o in outs)

    def accumulate(self, loss_fn, params, batch, keys: update_core.UpdateKeys):
        pack = {k: batch[k] for k in PACK_KEYS + OPTIONAL_PACK_KEYS + REPLAY_KEYS if k in batch}
        seqs = {k: batch[k] for k in keys.response if k in batch}
        counts = core_algos.global_batch_info(seqs["loss_mask"])
        grad_fn = jax.value_and_grad(loss_fn, has_aux=True)

        def grads_at(i):
            mb = update_core.micro_at(pack, i)
            mb = dict(mb, **{k: gather_seq(v, mb["seq_index"]) for k, v in seqs.items()})
            (loss, aux), grads = grad_fn(params, mb, counts)
            return grads, loss, aux

        grads, loss, aux = update_core.sum_over_used(grads_at, _n_used(pack))
        return loss, aux, grads


PACKED = PackedLayout()
