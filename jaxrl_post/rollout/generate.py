"""Batched generation: one jitted prefill writing the KV cache, then a jitted decode loop.

Decode = ``lax.while_loop`` over ``lax.scan`` chunks of single-token steps; the loop stops after the
chunk in which every row has produced an EOS, or at ``max_new_tokens``. Finished rows are compacted
away: once at most half of the rows are unfinished the loop goes on at half the batch (cache, logits
and row ids gathered; ``compaction_sizes``), so an RL batch whose longest response is 4x the mean does
not pay for every row until the longest ends. Each row samples with its own key (its row id), so the
tokens do not depend on where it sits. Rows share cache slot indices
but keep their own positions (the decoder counts each row's valid cache slots), so a left-padded batch
continues every row from its own prompt length.

KV cache: per layer, split into segments of ``cache_segment_len`` slots (``Transformer.init_cache``);
attention skips (``lax.cond``) every segment that holds no visible key yet, so a decode step reads about
the slots written so far rather than the whole cache. The prompt bucket's filler columns sit after the
prompt (masked out), and the first response token is written right after the real prompt, over them.

Compile once: prompt length P and batch size B are padded up to buckets (default: powers of two, the
batch a multiple of the data-parallel size), and the jitted functions are module-level with the model's
``GraphDef``, the bucketed cache length and the (seed-free) ``SamplingParams`` as static arguments, so
every ``Generator`` / ``generate_sequences`` call with the same model structure and buckets reuses one
compiled prefill and one compiled decode. ``TRACE_COUNTS`` counts traces (tests assert on it).

Sharded: pass a ``Mesh`` (axes ``('data', 'fsdp', 'tensor')``); the batch goes over ``('data',
'fsdp')``, the cache per ``sharding.cache_shardings``, and params stay where the caller put them
(``sharding.shard_params``, or a model created/loaded with ``mesh=``).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxrl_post.protocol import DataProto
from jaxrl_post.rollout.sampling import SamplingParams, get_response_mask, is_eos, sample_tokens

TRACE_COUNTS = {"prefill": 0, "decode": 0}


def _next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def bucket_size(n: int, buckets: Sequence[int] | None, *, minimum: int = 1, multiple_of: int = 1) -> int:
    """Smallest bucket >= n.

    ``buckets`` None -> the next power of two >= max(n, minimum); otherwise the smallest listed size
    >= n (ValueError if n exceeds them all). The result is rounded up to a multiple of ``multiple_of``.
    """
    if buckets is None:
        size = _next_pow2(max(n, minimum))
    else:
        fits = sorted(b for b in buckets if b >= n)
        if not fits:
            raise ValueError(f"size {n} exceeds the largest configured bucket {max(buckets)}")
        size = fits[0]
    return -(-size // multiple_of) * multiple_of


def _constrain_cache(cache, mesh):
    if mesh is None:
        return cache
    from jaxrl_post.sharding import cache_shardings

    sh = cache_shardings(cache, mesh)
    k, v, mask = jax.lax.with_sharding_constraint((cache.k, cache.v, cache.mask), (sh.k, sh.v, sh.mask))
    return cache.replace(k=k, v=v, mask=mask)  # index untouched (a static 0 stays static)


def _constrain_batch(x, mesh):
    if mesh is None:
        return x
    from jaxrl_post.sharding import batch_sharding

    return jax.lax.with_sharding_constraint(x, batch_sharding(mesh, x.ndim))


@functools.partial(jax.jit, static_argnames=("graphdef", "max_len", "segment_len", "cache_dtype", "mesh"))
def _prefill(graphdef, state, input_ids, attention_mask, prompt_len, *, max_len, segment_len, cache_dtype, mesh):
    """Prompts [B, P_pad] (left-padded to width prompt_len, then filler columns with mask 0) ->
    (next-token logits [B, V] float32 at column prompt_len - 1, cache with S = max_len slots and
    index = prompt_len, so decoding overwrites the filler slots)."""
    TRACE_COUNTS["prefill"] += 1
    model = nnx.merge(graphdef, state)
    cache = model.init_cache(input_ids.shape[0], max_len, dtype=cache_dtype, segment_len=segment_len)
    h, cache = model.hidden_states(input_ids, attention_mask, cache=_constrain_cache(cache, mesh))
    h_last = jax.lax.dynamic_slice_in_dim(h, prompt_len - 1, 1, axis=1)
    logits = model.logits_from_hidden(h_last)[:, 0]
    return _constrain_batch(logits, mesh), _constrain_cache(cache.replace(index=prompt_len), mesh)


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


@functools.partial(
    jax.jit,
    static_argnames=("graphdef", "params", "num_steps", "chunk", "sizes", "groups", "mesh"),
    donate_argnames=("cache", "logits"),
)
def _decode(graphdef, state, cache, logits, row_done, key, *, params, num_steps, chunk, sizes, groups, mesh):
    """Sample ``num_steps`` tokens (rounded up to whole chunks, early exit when all rows are done).

    cache: KVCache after prefill (donated); logits [B, V] float32 of the first response token (donated);
    row_done [B] bool (True for batch-bucket filler rows); key: base key of this call.
    Compaction: the loop runs at batch ``sizes[0] = B`` until at most ``sizes[1]`` rows (per group of
    ``groups``) are unfinished, then keeps those rows (plus finished ones to fill; ``_compact``) and goes
    on at ``sizes[1]``, and so on, so rows that are done stop costing compute. Row ``b`` samples with
    ``fold_in(fold_in(key, t), b)`` wherever it sits, so the tokens do not depend on ``sizes``.
    Returns tokens [B, n] int32 (pad after a row's first EOS), log_probs [B, n] float32 (0 there),
    sampling thresholds [B, n] float32 (`sample_tokens`; -inf there), stage_end [len(sizes)] int32 (steps
    run when each size's loop ended; n = num_steps rounded up to a multiple of chunk), the cache and
    logits at the end of the first (full-batch) stage.
    """
    TRACE_COUNTS["decode"] += 1
    model = nnx.merge(graphdef, state)
    batch = logits.shape[0]
    n_alloc = -(-num_steps // chunk) * chunk
    pad = jnp.int32(params.pad_token_id)

    def step(carry, _):
        (cache, logits, done, rows), t, outs = carry
        tok, lp, th = sample_tokens(logits, jax.random.fold_in(key, t), params, row_ids=rows)
        tok = jnp.where(done, pad, tok)
        lp = jnp.where(done, 0.0, lp)
        th = jnp.where(done, -jnp.inf, th)
        outs = tuple(o.at[rows, t].set(x) for o, x in zip(outs, (tok, lp, th), strict=True))
        done = done | is_eos(tok, params.eos_token_ids)
        new_logits, cache = model(tok[:, None], jnp.ones((tok.shape[0], 1), jnp.int32), cache=cache)
        new_logits = _constrain_batch(new_logits[:, 0], mesh)
        return ((_constrain_cache(cache, mesh), new_logits, done, rows), t + 1, outs), None

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
    rows = _constrain_batch(jnp.arange(batch, dtype=jnp.int32), mesh)
    state_ = (cache, logits, row_done, rows)
    t, stage_end = jnp.int32(0), []
    for i, size in enumerate(sizes):
        if i:
            cache, logits, done, rows = state_
            rows_state = _compact((cache.k, cache.v, cache.mask, logits, done, rows), done, size, groups)
            k, v, mask, logits, done, rows = rows_state
            cache = _constrain_cache(cache.replace(k=k, v=v, mask=mask), mesh)
            state_ = (cache, _constrain_batch(logits, mesh), _constrain_batch(done, mesh), _constrain_batch(rows, mesh))
        nxt = sizes[i + 1] // groups if i + 1 < len(sizes) else 0
        state_, t, outs = run_until((state_, t, outs), nxt)
        if i == 0:
            first = state_
        stage_end.append(t)
    # The cache/logits at the end of the full-batch stage are returned (and dropped by the caller) so the
    # donated input buffers alias them: XLA then updates the cache in place instead of copying it.
    return outs[0], outs[1], outs[2], jnp.stack(stage_end), first[0], first[1]


def _left_padded(mask: np.ndarray) -> bool:
    m = mask.astype(bool)
    return bool(np.all(m[:, 1:] >= m[:, :-1]))


def kv_cache_dtype(model, cache_dtype=None, mesh=None) -> str:
    """KV cache dtype a ``Generator`` uses: ``cache_dtype`` if given, else the model's compute dtype, or
    float32 when that is a 16-bit float and the devices (``mesh``'s, else the default backend's) are CPUs
    (see ``Generator.cache_dtype``)."""
    if cache_dtype is not None:
        return jnp.dtype(cache_dtype).name
    dtype = jnp.dtype(getattr(model, "dtype", jnp.float32))
    platform = mesh.devices.flat[0].platform if mesh is not None else jax.default_backend()
    if platform == "cpu" and dtype.itemsize == 2 and jnp.issubdtype(dtype, jnp.floating):
        return "float32"
    return dtype.name


@dataclasses.dataclass
class Generator:
    """Reusable sampler for one model structure; compiled functions are cached per bucketed shape.

    Args:
      model: a ``jaxrl_post.models.Transformer`` (any nnx module with the decoder's cache API).
        Its current parameters are read at every call (``nnx.split``), so in-place updates are seen.
      mesh: optional ``Mesh`` with axes ('data','fsdp','tensor'); the batch is sharded over
        ('data','fsdp'). Params must already be placed on this mesh.
      prompt_buckets / batch_buckets: allowed padded sizes (None = powers of two; prompt >= 16).
      decode_chunk: decode steps per ``lax.scan`` chunk (the early-exit check runs between chunks).
      cache_dtype: KV cache dtype. None (default): the model's compute dtype, except float32 for a
        16-bit compute dtype on CPU (``kv_cache_dtype``): XLA:CPU widens a 16-bit dynamic-update-slice to
        float32 over the whole buffer, so every decode step would copy every cache segment, while float32
        slots are written in place and attention reads them without a copy (bf16 values stored exactly).
      min_prompt_bucket: smallest padded prompt length when ``prompt_buckets`` is None.
      cache_segment_len: KV cache slots per segment (``Transformer.init_cache``); attention skips
        segments holding no token yet, so a decode step reads ~the slots written so far. None = about an
        eighth of the cache, a multiple of 16.
      compact_min_rows: decode compacts finished rows away: once at most half of the rows (per batch
        shard) are unfinished, it keeps those and goes on at half the batch, down to this many rows
        (``compaction_sizes``; each size is one more decode body in the compiled program). None or >=
        the batch: no compaction. Samples do not depend on it (per-row keys).
    """

    model: nnx.Module
    mesh: jax.sharding.Mesh | None = None
    prompt_buckets: Sequence[int] | None = None
    batch_buckets: Sequence[int] | None = None
    decode_chunk: int = 16
    cache_dtype: str | None = None
    min_prompt_bucket: int = 16
    cache_segment_len: int | None = None
    compact_min_rows: int | None = 8
    last_decode_stats: dict | None = dataclasses.field(default=None, init=False, repr=False)

    def _batch_multiple(self) -> int:
        if self.mesh is None:
            return 1
        shape = dict(self.mesh.shape)
        return shape.get("data", 1) * shape.get("fsdp", 1)

    def __call__(self, prompts: DataProto, params: SamplingParams, *, seed: int | None = None) -> DataProto:
        return self.generate(prompts, params, seed=seed)

    def generate(
        self, prompts: DataProto, params: SamplingParams, *, seed: int | None = None, process_local: bool = False
    ) -> DataProto:
        """Generate ``params.max_new_tokens`` tokens for each left-padded prompt.

        Args:
          prompts: DataProto with ``input_ids [B, P]`` int and ``attention_mask [B, P]`` (left-padded,
            1 = real token); ``position_ids`` optional (else ``clip(cumsum(mask) - 1, 0)``).
            Non-tensor data and meta_info are carried over.
          params: sampling parameters (R = ``max_new_tokens``).
          seed: overrides ``params.seed`` (e.g. seed + step in a training loop).
          process_local: multi-process runs: ``prompts`` are this process's rows of the global batch
            (``distributed.local_rows``; every process holds as many) and the result is this process's rows.
            Otherwise every process passes the same global batch and gets the whole result.
        Returns:
          DataProto (numpy arrays) with ``prompts [B, P] int32``, ``responses [B, R] int32`` (pad after
          the first EOS), ``input_ids [B, P+R]``, ``attention_mask [B, P+R] int32`` (prompt mask ++
          response_mask), ``position_ids [B, P+R] int32`` (response positions continue from the last
          prompt position, verl style), ``response_mask [B, R] int32``, ``rollout_log_probs [B, R]
          float32`` (= ``logprobs_from_logits(logits, responses, temperature)`` of the training path, or
          the truncated distribution's with ``params.truncated_log_probs``; 0 where masked),
          ``sampling_logit_threshold [B, R] float32`` (smallest kept tempered logit of each step, -inf
          where nothing was truncated or masked), ``truncated [B] bool`` (no EOS within R).
        Raises:
          ValueError: prompts are not left-padded, a row has no real token, or a size exceeds the buckets.
        """
        ids = np.asarray(jax.device_get(prompts.batch["input_ids"])).astype(np.int32)
        mask = np.asarray(jax.device_get(prompts.batch["attention_mask"])).astype(np.int32)
        if ids.ndim != 2 or ids.shape != mask.shape:
            raise ValueError(f"input_ids {ids.shape} and attention_mask {mask.shape} must both be [B, P]")
        if not _left_padded(mask):
            raise ValueError("prompts must be left-padded (attention_mask 0...0 1...1 in every row)")
        if not np.all(mask.sum(axis=1) > 0):
            raise ValueError("every prompt needs at least one real token")
        b, p = ids.shape
        r = params.max_new_tokens
        nproc = jax.process_count() if (process_local and self.mesh is not None) else 1
        b_pad = bucket_size(b * nproc, self.batch_buckets, multiple_of=math.lcm(self._batch_multiple(), nproc)) // nproc
        p_pad = bucket_size(p, self.prompt_buckets, minimum=self.min_prompt_bucket)

        pid = np.full((b_pad, p_pad), params.pad_token_id, np.int32)
        pmask = np.zeros((b_pad, p_pad), np.int32)
        # Prompts fill columns [0, p); the bucket's filler columns [p, p_pad) are masked out and the first
        # response token goes to slot p, so decoding overwrites them (attention never reads unused slots).
        pid[:b, :p], pmask[:b, :p] = ids, mask
        pid[b:], pmask[b:] = pid[0], pmask[0]  # filler rows: copies of row 0, marked done
        row_done = np.arange(b_pad) >= b

        chunk = max(1, min(self.decode_chunk, r))
        n_alloc = -(-r // chunk) * chunk
        static = dataclasses.replace(params, seed=0)
        key = jax.random.key(params.seed if seed is None else seed)

        graphdef, state = nnx.split(self.model)
        arrays = (pid, pmask, row_done)
        if nproc > 1:
            from jaxrl_post.distributed import global_from_local, local_rows

            own = local_rows(self.mesh, b_pad * nproc)
            if (own.start, own.stop) != (jax.process_index() * b_pad, (jax.process_index() + 1) * b_pad):
                raise ValueError(
                    f"process-local rollout needs each process to hold rows [i*{b_pad}, (i+1)*{b_pad}) of the "
                    f"batch; process {jax.process_index()} holds {own} (a mesh axis other than the batch spans "
                    "processes?)"
                )
            arrays = tuple(global_from_local(a, self.mesh) for a in arrays)
        elif self.mesh is not None:
            from jaxrl_post.sharding import shard_batch

            arrays = shard_batch(arrays, self.mesh)
        else:
            arrays = tuple(jnp.asarray(a) for a in arrays)
        pid_d, pmask_d, done_d = arrays
        max_len = p_pad + n_alloc
        seg = self.cache_segment_len or max(16, -(-max_len // 128) * 16)  # ~8 segments, multiple of 16
        from jaxrl_post.sharding import InMesh

        logits, cache = InMesh(_prefill, self.mesh)(
            graphdef,
            state,
            pid_d,
            pmask_d,
            jnp.int32(p),
            max_len=max_len,
            segment_len=min(seg, max_len),
            cache_dtype=kv_cache_dtype(self.model, self.cache_dtype, self.mesh),
            mesh=self.mesh,
        )
        groups = self._batch_multiple() if self.mesh is not None else 1
        sizes = compaction_sizes(b_pad * nproc, groups, self.compact_min_rows or b_pad * nproc)
        tokens, logps, thresholds, stage_end, _, _ = InMesh(_decode, self.mesh)(
            graphdef,
            state,
            cache,
            logits,
            done_d,
            key,
            params=static,
            num_steps=r,
            chunk=chunk,
            sizes=sizes,
            groups=groups,
            mesh=self.mesh,
        )
        from jaxrl_post.distributed import local_part, to_host

        host = local_part if nproc > 1 else to_host
        self.last_decode_stats = {"sizes": sizes, "stage_end_step": [int(x) for x in to_host(stage_end)]}
        tokens, logps, thresholds = (host(x)[:b, :r] for x in (tokens, logps, thresholds))
        return _assemble(prompts, ids, mask, tokens, logps, thresholds, params)


def _assemble(prompts: DataProto, ids, mask, tokens, logps, thresholds, params: SamplingParams) -> DataProto:
    """Host-side output assembly (numpy, cheap): masks, positions, concatenation."""
    r = tokens.shape[1]
    response_mask = np.asarray(get_response_mask(tokens, params.eos_token_ids)).astype(np.int32)
    tokens = np.where(response_mask.astype(bool), tokens, params.pad_token_id).astype(np.int32)
    logps = np.where(response_mask.astype(bool), logps, 0.0).astype(np.float32)
    thresholds = np.where(response_mask.astype(bool), thresholds, -np.inf).astype(np.float32)
    truncated = ~np.any(np.asarray(is_eos(tokens, params.eos_token_ids)) & response_mask.astype(bool), axis=1)
    if "position_ids" in prompts.batch:
        ppos = np.asarray(jax.device_get(prompts.batch["position_ids"])).astype(np.int32)
    else:
        ppos = np.maximum(np.cumsum(mask, axis=1) - 1, 0).astype(np.int32)
    rpos = ppos[:, -1:] + np.arange(1, r + 1, dtype=np.int32)[None]
    batch = {
        "prompts": ids,
        "responses": tokens,
        "input_ids": np.concatenate([ids, tokens], axis=1),
        "attention_mask": np.concatenate([mask, response_mask], axis=1),
        "position_ids": np.concatenate([ppos, rpos], axis=1),
        "response_mask": response_mask,
        "rollout_log_probs": logps,
        "sampling_logit_threshold": thresholds,
        "truncated": truncated,
    }
    return DataProto(batch, dict(prompts.non_tensor_batch), dict(prompts.meta_info))


def generate_sequences(
    model: nnx.Module,
    prompts: DataProto,
    params: SamplingParams,
    *,
    mesh: jax.sharding.Mesh | None = None,
    seed: int | None = None,
) -> DataProto:
    """Functional entry point: ``Generator(model, mesh=mesh).generate(prompts, params, seed=seed)``.

    Compiled functions are shared across calls (module-level jit cache keyed by the model's GraphDef
    and the bucketed shapes), so calling this every training step does not recompile. See
    ``Generator.generate`` for shapes, dtypes and errors.
    """
    return Generator(model, mesh=mesh).generate(prompts, params, seed=seed)
