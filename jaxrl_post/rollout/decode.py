"""The sampler's jitted programs: prefill (prompts -> KV cache + first logits) and the decode loop.

Decode = ``lax.while_loop`` over ``lax.scan`` chunks of single-token steps, run at a sequence of batch
sizes (``compaction_sizes``): when at most the next size of rows is unfinished, the unfinished rows (and
finished ones to fill) are gathered into the smaller batch (``_compact``, shard by shard). Every row samples
with its own key (its original row id), so the tokens do not depend on where a row sits. The host-side
driver is ``jaxrl_post.rollout.generate.Generator``; ``TRACE_COUNTS`` counts traces (tests assert on it).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from jaxrl_post.models.moe import routes_dtype
from jaxrl_post.rollout.sampling import is_eos, sample_tokens
from jaxrl_post.runtime.sharding import batch_sharding, cache_shardings

TRACE_COUNTS = {"prefill": 0, "decode": 0}


def _constrain_cache(cache, mesh):
    if mesh is None:
        return cache

    sh = cache_shardings(cache, mesh)
    k, v, mask = jax.lax.with_sharding_constraint((cache.k, cache.v, cache.mask), (sh.k, sh.v, sh.mask))
    return cache.replace(k=k, v=v, mask=mask)  # index untouched (a static 0 stays static)


def _constrain_batch(x, mesh):
    if mesh is None:
        return x

    return jax.lax.with_sharding_constraint(x, batch_sharding(mesh, x.ndim))


@functools.partial(
    jax.jit, static_argnames=("graphdef", "max_len", "segment_len", "cache_dtype", "mesh", "repeat", "routes")
)
def _prefill(
    graphdef,
    state,
    input_ids,
    attention_mask,
    prompt_len,
    *,
    max_len,
    segment_len,
    cache_dtype,
    mesh,
    repeat=1,
    routes=False,
):
    """Prompts [B, P_pad] (left-padded to width prompt_len, then filler columns with mask 0) ->
    (next-token logits [B * repeat, V] float32 at column prompt_len - 1, cache of B * repeat rows with
    S = max_len slots and index = prompt_len, so decoding overwrites the filler slots). ``repeat`` > 1: each
    prompt's logits and cache rows are copied ``repeat`` times, interleaved (its samples share the prefill).
    ``routes`` (an MoE model, routing replay): also the experts of every prompt column, `[B * repeat, P_pad, M,
    k]` uint8/int16 (`moe.MoEOutput.routed_experts`), as a third output."""
    TRACE_COUNTS["prefill"] += 1
    model = nnx.merge(graphdef, state)
    cache = model.init_cache(input_ids.shape[0], max_len, dtype=cache_dtype, segment_len=segment_len)
    out = model.hidden_states(input_ids, attention_mask, cache=_constrain_cache(cache, mesh), with_moe=routes)
    (h, cache), moe = out if routes else (out, None)
    h_last = jax.lax.dynamic_slice_in_dim(h, prompt_len - 1, 1, axis=1)
    logits = model.logits_from_hidden(h_last)[:, 0]
    experts = () if moe is None else (moe.routed_experts,)
    if repeat > 1:
        rep = lambda x: jnp.repeat(x, repeat, axis=0)
        k, v, mask, logits, experts = jax.tree.map(rep, (cache.k, cache.v, cache.mask, logits, experts))
        cache = cache.replace(k=k, v=v, mask=mask)
    out = (_constrain_batch(logits, mesh), _constrain_cache(cache.replace(index=prompt_len), mesh))
    return out + tuple(_constrain_batch(x, mesh) for x in experts)


def compaction_sizes(batch: int, groups: int = 1, min_rows: int = 8) -> tuple[int, ...]:
    """Batch sizes the decode loop runs at: ``batch``, then halved while every one of the ``groups`` equal
    row groups (the batch shards) halves evenly and the size stays >= ``min_rows`` (and >= ``groups``).

    ``compaction_sizes(64) == (64, 32, 16, 8)``; ``min_rows >= batch`` -> ``(batch,)`` (no compaction).
    """
    sizes = [batch]
    while sizes[-1] % (2 * groups) == 0 and sizes[-1] // 2 >= max(min_rows, groups):
        sizes.append(sizes[-1] // 2)
    return tuple(sizes)


def _compact(tree, done, size: int, groups: int):
    """Keep ``size`` rows, the unfinished ones first, of every array in ``tree`` (leading axis = batch).

    Rows move only within their group (``groups`` equal blocks of the batch = its shards), so a sharded
    batch is compacted shard by shard without moving data between devices. Stable: rows keep their order.
    """
    keep = size // groups
    order = jnp.argsort(done.reshape(groups, -1), axis=1, stable=True)[:, :keep]  # unfinished (False) first

    def take(x):
        xg = x.reshape(groups, -1, *x.shape[1:])
        return jax.vmap(lambda a, i: jnp.take(a, i, axis=0))(xg, order).reshape(size, *x.shape[1:])

    return jax.tree.map(take, tree)


def _put_rows(full, cache, rows):
    """``full`` (a cache of every row) with rows ``rows`` [b] replaced by ``cache``'s (b rows, in order)."""
    put = lambda f, c: f.at[rows].set(c)
    k, v, mask = jax.tree.map(put, (full.k, full.v, full.mask), (cache.k, cache.v, cache.mask))
    index = full.index if jnp.ndim(full.index) == 0 else put(full.index, cache.index)
    return full.replace(k=k, v=v, mask=mask, index=index)


@functools.partial(
    jax.jit,
    static_argnames=("graphdef", "params", "num_steps", "chunk", "sizes", "groups", "mesh", "keep_cache", "routes"),
    donate_argnames=("cache", "logits"),
)
def _decode(
    graphdef,
    state,
    cache,
    logits,
    row_done,
    key,
    limit=None,
    row_ids=None,
    *,
    params,
    num_steps,
    chunk,
    sizes,
    groups,
    mesh,
    keep_cache=False,
    routes=False,
):
    """Sample ``num_steps`` tokens (rounded up to whole chunks, early exit when all rows are done).

    cache: KVCache after prefill (donated); logits [B, V] float32 of the first response token (donated);
    row_done [B] bool (True for batch-bucket filler rows); key: base key of this call.
    Compaction: the loop runs at batch ``sizes[0] = B`` until at most ``sizes[1]`` rows (per group of
    ``groups``) are unfinished, then keeps those rows (plus finished ones to fill; ``_compact``) and goes
    on at ``sizes[1]``, and so on, so rows that are done stop costing compute. Row ``b`` samples with
    ``fold_in(fold_in(key, t), row_ids[b])`` wherever it sits, so the tokens do not depend on ``sizes``.
    row_ids: [B] int32 or None (= ``arange(B)``): each row's sample id, the index of the row in the batch without
    the bucket's filler rows (a multi-process batch holds each process's filler rows after its own rows, so
    there a row's place is not its id; `Generator.generate`).
    Returns tokens [B, n] int32 (pad after a row's first EOS), log_probs [B, n] float32 (0 there),
    sampling thresholds [B, n] float32 (`sample_tokens`; -inf there), stage_end [len(sizes)] int32 (steps
    run when each size's loop ended; n = num_steps rounded up to a multiple of chunk), the cache and
    logits at the end of the first (full-batch) stage; with ``routes`` (an MoE model, routing replay) also the
    experts each sampled token was routed to when it was fed back, `[B, n, M, k]` uint8/int16
    (`moe.MoEOutput.routed_experts`; those of the pad fed after a row's EOS there).
    Multi-turn (`rollout.turn_cache`): limit [B] int32 or None: row b is done after limit[b] tokens (its
    remaining response budget); keep_cache: the returned cache is every row's at the end (rows compacted away
    are written back to their place as each stage ends), in the input's row order, for the next turn.
    """
    TRACE_COUNTS["decode"] += 1
    model = nnx.merge(graphdef, state)
    batch = logits.shape[0]
    n_alloc = -(-num_steps // chunk) * chunk
    pad = jnp.int32(params.pad_token_id)

    def step(carry, _):
        (cache, logits, done, rows, ids), t, outs = carry
        tok, lp, th = sample_tokens(logits, jax.random.fold_in(key, t), params, row_ids=ids)
        tok = jnp.where(done, pad, tok)
        lp = jnp.where(done, 0.0, lp)
        done = done | is_eos(tok, params.eos_token_ids)
        if limit is not None:
            done = done | (t + 1 >= limit[rows])
        out = model(tok[:, None], jnp.ones((tok.shape[0], 1), jnp.int32), cache=cache, with_moe=routes)
        (new_logits, cache), moe = out if routes else (out, None)
        new = (tok, lp, th) + (() if moe is None else (moe.routed_experts[:, 0],))  # the token's experts
        outs = tuple(o.at[rows, t].set(x) for o, x in zip(outs, new, strict=True))
        new_logits = _constrain_batch(new_logits[:, 0], mesh)
        return ((_constrain_cache(cache, mesh), new_logits, done, rows, ids), t + 1, outs), None

    def body(carry):
        return jax.lax.scan(step, carry, None, length=chunk)[0]

    def run_until(carry, max_unfinished):
        def cond(carry):
            done, t = carry[0][2], carry[1]
            unfinished = jnp.sum(~done.reshape(groups, -1), axis=1)
            return (t < num_steps) & (jnp.max(unfinished) > max_unfinished)

        return jax.lax.while_loop(cond, body, carry)

    outs = (
        _constrain_batch(jnp.full((batch, n_alloc), pad, jnp.int32), mesh),
        _constrain_batch(jnp.zeros((batch, n_alloc), jnp.float32), mesh),
        _constrain_batch(jnp.full((batch, n_alloc), -jnp.inf, jnp.float32), mesh),
    )
    if routes:  # [B, n, M, k] expert ids of each fed token (routing replay)
        cfg = model.config
        shape = (batch, n_alloc, len(cfg.moe_layers), cfg.num_experts_per_tok)
        outs += (_constrain_batch(jnp.zeros(shape, routes_dtype(cfg.num_experts)), mesh),)
    rows = _constrain_batch(jnp.arange(batch, dtype=jnp.int32), mesh)
    ids = rows if row_ids is None else _constrain_batch(row_ids.astype(jnp.int32), mesh)
    carry, stage_end = ((cache, logits, row_done, rows, ids), jnp.int32(0), outs), []
    full = None  # keep_cache: every row's cache, updated from the running rows as each stage ends
    for i, size in enumerate(sizes):
        if i:
            (cache, logits, done, rows, ids), t, outs = carry
            if keep_cache and i > 1:  # after the first stage `full` is that stage's cache itself
                full = _put_rows(full, cache, rows)
            k, v, mask, logits, done, rows, ids = _compact(
                (cache.k, cache.v, cache.mask, logits, done, rows, ids), done, size, groups
            )
            if jnp.ndim(cache.index) == 1:  # a per-row write slot (multi-turn) moves with its row
                cache = cache.replace(index=_compact(cache.index, carry[0][2], size, groups))
            cache = _constrain_cache(cache.replace(k=k, v=v, mask=mask), mesh)
            carry = ((cache, *(_constrain_batch(x, mesh) for x in (logits, done, rows, ids))), t, outs)
        carry = run_until(carry, sizes[i + 1] // groups if i + 1 < len(sizes) else 0)
        if i == 0:
            first_cache, first_logits = carry[0][:2]
            full = first_cache
        stage_end.append(carry[1])
    if keep_cache and len(sizes) > 1:
        first_cache = _put_rows(full, carry[0][0], carry[0][3])
    # The cache/logits at the end of the full-batch stage are returned (and dropped by the caller) so the
    # donated input buffers alias them: XLA then updates the cache in place instead of copying it.
    outs = carry[2]
    return outs[0], outs[1], outs[2], jnp.stack(stage_end), first_cache, first_logits, *outs[3:]
