"""The paged engine's jitted programs: a ragged prefill chunk, `K` decode steps of the running slots (`lax.scan`),
and the small moves between them (first logits into slots, forked pages). Module-level with static graphdefs and
shapes, so every call with the same model structure and engine shapes reuses one compiled program each.
`TRACE_COUNTS` counts traces (tests assert compile-once on it).

Every program runs all data-parallel replicas of the engine at once: its per-replica arguments and outputs have a
leading replica dim `[D, ...]` (D = 1 on one device or a tensor-only mesh), and a one-replica body runs per replica
(`replicas.replica_map`: a `shard_map` over 'data' on a mesh with D > 1). Called under a tensor-parallel mesh
(`jax.set_mesh`), the pool keeps its split over kv heads (`kv_pool.constrain_pool`) and the logits stay replicated
within a replica, so a program's outputs have the layout of its inputs (compile once); without a mesh the
constraints are no-ops."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from jaxrl_post.rollout.paged import forward
from jaxrl_post.rollout.paged.kv_pool import POOL_AXES, constrain_pool, token_slots
from jaxrl_post.rollout.paged.replicas import replica_map
from jaxrl_post.rollout.sampling import is_eos, sample_tokens
from jaxrl_post.runtime.sharding import constrain

TRACE_COUNTS = {"prefill": 0, "decode": 0}


@functools.partial(jax.jit, static_argnames=("graphdef", "graphdefs", "impl", "routes"), donate_argnames=("kv",))
def prefill(graphdef, state, graphdefs, layers, kv, rag: forward.Ragged, last, *, impl, routes=False):
    """One ragged prefill chunk per replica: `rag` (tokens `[D, 1, T]`, every field with a leading replica dim),
    pools `kv [D, L, ...]`. Returns (pools with the chunks' keys/values written, logits `[D, S, V] float32` at flat
    token indices `last [D, S] int32`); with `routes` (an MoE model, routing replay) also the chunks' experts
    `[D, T, M, k]` uint8/int16 (`forward.hidden_states`)."""
    TRACE_COUNTS["prefill"] += 1

    def body(state, layers, kv, rag, last):
        model = nnx.merge(graphdef, state)
        h, kv, *experts = forward.hidden_states(model, graphdefs, layers, kv, rag, impl, with_routes=routes)
        h_last = jnp.take(h[0], last, axis=0)[:, None]  # [S, 1, D]
        logits = _replicated(model.logits_from_hidden(h_last)[:, 0])
        return (constrain_pool(kv), logits, *(e[0] for e in experts))

    return replica_map(body, (state, layers), (kv, rag, last), out_names=(POOL_AXES,))


def _replicated(logits):
    """`logits [S, V]` replicated under an ambient mesh (no-op without one)."""
    return constrain(logits, (None, None))


@functools.partial(jax.jit, donate_argnames=("logits",))
def place_logits(logits, new, src, dst):
    """Per replica: `logits [D, S, V]` with rows `dst [D, S] int32` set to `new[src]` (`dst` = S: dropped)."""
    body = lambda lg, nw, s, d: (_replicated(lg.at[d].set(nw[s], mode="drop")),)
    return replica_map(body, (), (logits, new, src, dst))[0]


@functools.partial(jax.jit, donate_argnames=("kv",))
def copy_pages(kv, src, dst):
    """Per replica: pools `[D, L, P, ...]` with pages `dst [D, C]` set to pages `src [D, C]` in every layer ((0, 0)
    pads: a no-op)."""
    body = lambda kv, s, d: (constrain_pool(kv.at[:, d].set(kv[:, s])),)
    return replica_map(body, (), (kv, src, dst), out_names=(POOL_AXES,))[0]


@functools.partial(
    jax.jit,
    static_argnames=("graphdef", "graphdefs", "impl", "params", "steps", "routes"),
    donate_argnames=("kv", "logits"),
)
def decode(
    graphdef,
    state,
    graphdefs,
    layers,
    kv,
    logits,
    idx,
    pos,
    t,
    rows,
    limit,
    done,
    tables,
    key,
    *,
    impl,
    params,
    steps,
    routes=False,
):
    """`steps` decode steps of a batch of `B` of each replica's `S` slots (B a compiled decode batch size,
    `dispatch.decode_batch_sizes`): every argument but the weights and `key` has a leading replica dim `[D]`
    (pools `kv [D, L, ...]`). Per slot: logits `[D, S, V] float32` of its next token. Per batch entry: idx
    `[D, B] int32` (its slot; S: padding), pos `[D, B] int32` (its next token's position), t `[D, B] int32`
    (tokens it has generated), rows `[D, B] int32` (sampling ids), limit `[D, B] int32`, done `[D, B] bool` (padding
    or finished), tables `[D, B, pages_per_seq] int32`. Each step samples with `fold_in(fold_in(key, t), row)` per
    entry (the dense `Generator`'s key of that row and step, whatever replica or entry runs it), records the token,
    then runs it through the model. Returns (pools, logits `[D, S, V]` (the entries' slots updated), tokens
    `[D, B, steps] int32`, log_probs, thresholds `[D, B, steps] float32`, emitted `[D, B, steps] bool`, done
    `[D, B] bool`); with `routes` (an MoE model, routing replay) also the experts each token was routed to when it
    was fed, `[D, B, steps, M, k]` uint8/int16."""
    TRACE_COUNTS["decode"] += 1
    pad = jnp.int32(params.pad_token_id)

    def body(state, layers, key, kv, slot_logits, idx, pos, t, rows, limit, done, tables):
        model = nnx.merge(graphdef, state)
        s, ps = idx.shape[0], kv.shape[2]
        logits = jnp.take(slot_logits, idx, axis=0, mode="clip")  # [B, V]; padding reads a slot it never writes

        def step(carry, _):
            kv, logits, pos, t, done = carry
            keys = jax.vmap(lambda i: jax.random.fold_in(key, i))(t)
            tok, lp, th = sample_tokens(logits, keys, params, row_ids=rows)
            emitted = ~done
            tok, lp = jnp.where(done, pad, tok), jnp.where(done, 0.0, lp)
            rag = forward.Ragged(
                tokens=tok[:, None],
                positions=pos[:, None],
                slots=jnp.where(emitted, token_slots(pos, tables, ps), 0),
                kv_lens=pos + 1,
                page_indices=tables,
                cu_q_lens=jnp.arange(s + 1, dtype=jnp.int32),
                num_seqs=jnp.array([s], jnp.int32),
                token_mask=emitted[:, None],
                decode=True,
            )
            h, kv, *experts = forward.hidden_states(model, graphdefs, layers, kv, rag, impl, with_routes=routes)
            new_done = done | is_eos(tok, params.eos_token_ids) | (t + 1 >= limit)
            step_ = emitted.astype(jnp.int32)
            out = (tok, lp, th, emitted, *(e[:, 0] for e in experts))
            kv, logits = constrain_pool(kv), _replicated(model.logits_from_hidden(h)[:, 0])
            return (kv, logits, pos + step_, t + step_, new_done), out

        (kv, logits, _, _, done), outs = jax.lax.scan(step, (kv, logits, pos, t, done), None, length=steps)
        tokens, lps, ths, emitted = (o.T for o in outs[:4])
        logits = _replicated(slot_logits.at[idx].set(logits, mode="drop"))
        return (kv, logits, tokens, lps, ths, emitted, done, *(jnp.swapaxes(e, 0, 1) for e in outs[4:]))

    mapped = (kv, logits, idx, pos, t, rows, limit, done, tables)
    return replica_map(body, (state, layers, key), mapped, out_names=(POOL_AXES,))
