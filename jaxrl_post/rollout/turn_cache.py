"""The KV cache of a multi-turn rollout, kept between turns: each turn prefills only the appended tokens.

`AgentLoop(enable_prefix_caching=True)` (vLLM's / verl's name) rolls a batch of trajectories out turn by turn
on one `TurnCache`. The first turn prefills the prompts (left-padded to P); every later turn prefills only
what the environment appended since (observation + the template's suffix + the next assistant header) onto
the cache the previous turn left, then decodes. Rows sit at different lengths, so the cache has a per-row
write slot (`KVCache.index` [B] int32): a row's appended tokens, right-padded to the turn's chunk width, go to
its own next slots, and its next write slot is set right after its last real token (the chunk's padding
slots and the tokens decoded after a row's end of turn are overwritten later and never visible: a query
sees only slots before its own). Rows that are done leave: before each turn the running rows are gathered,
in order, to the front of a batch of the next power of two >= their number; row j of a turn samples with
the key of row j, as `Generator.generate` on the running rows does, so fixed-seed samples equal those of the
full re-prefill (`AgentLoop(enable_prefix_caching=False)`).

Compiles: one `_extend` per (batch bucket, chunk bucket: powers of two >= 16) and one `_decode` per batch
bucket; the cache length S = P_pad + R (rounded up to the decode chunk) is fixed for the whole call. Single
device only (`Generator.mesh` None). Counters: `TRACE_COUNTS['extend']`.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxrl_post.rollout.decode import _decode, compaction_sizes
from jaxrl_post.rollout.generate import MIN_CACHE_SEGMENT, bucket_size, kv_cache_dtype
from jaxrl_post.rollout.sampling import SamplingParams, get_response_mask

__all__ = ["TurnCache", "TRACE_COUNTS"]

TRACE_COUNTS = {"extend": 0, "gather": 0}


@functools.partial(jax.jit, static_argnames=("graphdef",), donate_argnames=("cache",))
def _extend(graphdef, state, cache, input_ids, attention_mask, index, lengths):
    """Append one chunk per row: input_ids / attention_mask [B, T] (row b's tokens in columns [0, lengths[b]),
    padding after it masked out) written at slots index[b] + [0, T) ([B] int32). Returns (next-token logits
    [B, V] float32 at column lengths[b] - 1, the cache with index = index + lengths)."""
    TRACE_COUNTS["extend"] += 1
    model = nnx.merge(graphdef, state)
    h, cache = model.hidden_states(input_ids, attention_mask, cache=cache.replace(index=index))
    last = jnp.clip(lengths - 1, 0, input_ids.shape[1] - 1)
    h_last = jnp.take_along_axis(h, last[:, None, None], axis=1)
    return model.logits_from_hidden(h_last)[:, 0], cache.replace(index=index + lengths)


@jax.jit
def _gather(cache, rows):
    """The cache's rows `rows` [b] int32, in that order (a smaller or equal batch)."""
    TRACE_COUNTS["gather"] += 1
    take = lambda x: jnp.take(x, rows, axis=0)
    k, v, mask, index = jax.tree.map(take, (cache.k, cache.v, cache.mask, cache.index))
    return cache.replace(k=k, v=v, mask=mask, index=index)


class TurnCache:
    """A batch's KV cache between the turns of one `AgentLoop.generate` call.

    Args:
      generator: the rollout `Generator` (its model, decode chunk, cache dtype, segment length and compaction).
      prompt_len: P, the width of the left-padded prompts.
      max_new_tokens: R, the response budget over all turns (the cache holds P_pad + R slots).

    Raises ValueError: the generator has a mesh (sharded rollouts re-prefill every turn).
    """

    def __init__(self, generator, prompt_len: int, max_new_tokens: int):
        if generator.mesh is not None:
            raise ValueError("TurnCache runs on one device (Generator.mesh must be None)")
        self.gen = generator
        self.p, self.r = int(prompt_len), int(max_new_tokens)
        self.p_pad = bucket_size(self.p, generator.prompt_buckets, minimum=generator.min_prompt_bucket)
        self.chunk = max(1, min(generator.decode_chunk, self.r))
        self.max_len = self.p_pad + -(-self.r // self.chunk) * self.chunk
        self.cache = None
        self.order: list[int] = []  # trajectory id of each cache row (then filler rows, if any)
        self.index: dict[int, int] = {}  # trajectory id -> its next write slot
        self.prefill_tokens = 0  # real tokens prefilled (distinct prompts + appended tokens)
        self.rows0 = 0  # the first turn's batch bucket

    def turn(self, rows, appended, limits, params: SamplingParams, seed: int):
        """One turn of the running trajectories.

        Args:
          rows: trajectory ids of the running rows, in the order of the re-prefill path (row j samples as row j).
          appended: per row, the token ids added since the row's last turn (the first turn: its prompt, at most
            P tokens, left-padded to P here); every list non-empty.
          limits: per row, the most tokens it may generate this turn (its remaining budget, >= 1).
          params: `SamplingParams` (max_new_tokens is ignored: the call's R bounds a turn).
          seed: the turn's sampling seed.
        Returns: (tokens [A, n] int32, exists [A, n] bool: up to and including the first EOS, at most
          limits[j] tokens, log_probs [A, n] float32) for the A = len(rows) rows; n >= every limit.
        """
        gen = self.gen
        a = len(rows)
        if not a or not all(appended):
            raise ValueError("TurnCache.turn needs at least one row and appended tokens for every row")
        # batch buckets: powers of two, at least the decode's compaction floor (fewer programs to compile for
        # the last few running rows), at most the first turn's
        b = bucket_size(a, None, minimum=min(gen.compact_min_rows or 1, self.rows0 or a))
        self.rows0 = self.rows0 or b
        graphdef, state = nnx.split(gen.model)
        if self.cache is None:
            logits, cache, index, lengths = self._prefill_prompts(graphdef, state, rows, appended, b, params)
        else:
            width = bucket_size(max(len(x) for x in appended), None, minimum=16)
            where = {t: i for i, t in enumerate(self.order)}  # the running rows' cache rows (filler rows: none)
            take = [where[t] for t in rows] + [where[rows[0]]] * (b - a)
            if take != list(range(self.cache.mask.shape[0])):
                self.cache = _gather(self.cache, jnp.asarray(take, jnp.int32))
            self.order = list(rows)
            ids = np.full((b, width), params.pad_token_id, np.int32)
            mask = np.zeros((b, width), np.int32)
            lengths = np.zeros((b,), np.int32)
            for j, x in enumerate(appended):
                ids[j, : len(x)], mask[j, : len(x)], lengths[j] = x, 1, len(x)
                self.prefill_tokens += len(x)
            index = np.asarray([self.index[t] for t in rows] + [0] * (b - a), np.int32)
            logits, cache = _extend(graphdef, state, self.cache, *map(jnp.asarray, (ids, mask, index, lengths)))
        limit = np.zeros((b,), np.int32)
        limit[:a] = limits
        done = np.arange(b) >= a
        sizes = compaction_sizes(b, 1, gen.compact_min_rows or b)
        tokens, logps, _, _, self.cache, _ = _decode(
            graphdef,
            state,
            cache,
            logits,
            jnp.asarray(done),
            jax.random.key(seed),
            jnp.asarray(limit),
            params=dataclasses.replace(params, seed=0, max_new_tokens=self.r),
            num_steps=self.r,
            chunk=self.chunk,
            sizes=sizes,
            groups=1,
            mesh=None,
            keep_cache=True,
        )
        tokens, logps = np.asarray(tokens)[:a], np.asarray(logps)[:a]
        exists = np.asarray(get_response_mask(tokens, params.eos_token_ids)).astype(bool)
        exists &= np.arange(tokens.shape[1])[None] < limit[:a, None]
        for j, t in enumerate(rows):
            self.index[t] = int(index[j] + lengths[j] + exists[j].sum())
        return tokens, exists, logps

    def _prefill_prompts(self, graphdef, state, rows, prompts, b: int, params: SamplingParams):
        """The first turn's prefill: each distinct prompt once (the `rollout.n` samples of a prompt share it, as
        `Generator.generate` prefills a prompt once for its n rows), left-padded to P, at the batch bucket of the
        distinct prompts; then its cache rows and next-token logits are copied to the rows that start from it
        (and filler rows up to `b`, copies of row 0). Returns (logits [b, V] float32, cache of b rows, index
        [b] int32 zeros, lengths [b] int32 = P)."""
        gen = self.gen
        first_of: dict[tuple[int, ...], int] = {}
        src = [first_of.setdefault(tuple(x), len(first_of)) for x in prompts]
        u = bucket_size(len(first_of), None)
        ids = np.full((u, self.p_pad), params.pad_token_id, np.int32)
        mask = np.zeros((u, self.p_pad), np.int32)
        for x, i in first_of.items():  # left-padded to P: the row's first P slots, real tokens last
            ids[i, self.p - len(x) : self.p], mask[i, self.p - len(x) : self.p] = x, 1
            self.prefill_tokens += len(x)
        dtype = kv_cache_dtype(gen.model, gen.cache_dtype)
        cache = gen.model.init_cache(u, self.max_len, dtype=dtype, **self._seg())
        cache = cache.replace(index=jnp.zeros((u,), jnp.int32))
        zeros, lengths = np.zeros((u,), np.int32), np.full((u,), self.p, np.int32)
        logits, cache = _extend(graphdef, state, cache, *map(jnp.asarray, (ids, mask, zeros, lengths)))
        take = src + [0] * (b - len(src))
        if take != list(range(u)):
            take = jnp.asarray(take, jnp.int32)
            cache, logits = _gather(cache, take), jnp.take(logits, take, axis=0)
        self.order = list(rows)
        self.index = dict.fromkeys(rows, 0)
        return logits, cache, np.zeros((b,), np.int32), np.full((b,), self.p, np.int32)

    def _seg(self) -> dict:
        seg = self.gen.cache_segment_len or max(MIN_CACHE_SEGMENT, -(-self.max_len // 128) * 16)
        return {"segment_len": min(seg, self.max_len)}
