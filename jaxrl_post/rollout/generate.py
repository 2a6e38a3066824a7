"""Batched generation: one jitted prefill writing the KV cache, then a jitted decode loop.

Decode = ``lax.while_loop`` over ``lax.scan`` chunks of single-token steps; the loop stops after the
chunk in which every row has produced an EOS, or at ``max_new_tokens``. Finished rows are compacted
away: once at most half of the rows are unfinished the loop goes on at half the batch (cache, logits
and row ids gathered; ``compaction_sizes``), so an RL batch whose longest response is 4x the mean does
not pay for every row until the longest ends. Each row samples with its own key (its row id), so the
tokens do not depend on where it sits. Rows share cache slot indices but keep their own positions (the
decoder counts each row's valid cache slots), so a left-padded batch continues every row from its own
prompt length. The jitted programs live in ``jaxrl_post.rollout.decode``.

KV cache: per layer, split into segments of ``cache_segment_len`` slots (``Transformer.init_cache``);
attention skips (``lax.cond``) every segment that holds no visible key yet, so a decode step reads about
the slots written so far rather than the whole cache (long caches only: by default a segment holds
at least ``MIN_CACHE_SEGMENT`` slots). The prompt bucket's filler columns sit after the
prompt (masked out), and the first response token is written right after the real prompt, over them.

Compile once: prompt length P and batch size B are padded up to buckets (default: powers of two, the
batch a multiple of the data-parallel size), and the jitted functions are module-level with the model's
``GraphDef``, the bucketed cache length and the (seed-free) ``SamplingParams`` as static arguments, so
every ``Generator`` / ``generate_sequences`` call with the same model structure and buckets reuses one
compiled prefill and one compiled decode (one decode body per compaction size inside it).

Sharded: pass a ``Mesh`` (axes ``('data', 'fsdp', 'expert', 'tensor')``); the batch goes over ``('data',
'fsdp')``, the cache per ``sharding.cache_shardings``, and params stay where the caller put them
(``sharding.shard_params``, or a model created/loaded with ``mesh=``).
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxrl_post.batch.protocol import DataProto
from jaxrl_post.rollout.decode import _decode, _prefill, compaction_sizes
from jaxrl_post.rollout.sampling import SamplingParams, get_response_mask, is_eos
from jaxrl_post.runtime.distributed import global_from_local, local_part, local_rows, to_host
from jaxrl_post.runtime.sharding import InMesh, batch_shards, shard_batch

MIN_CACHE_SEGMENT = 128  # default KV cache segment length is never shorter (see Generator.cache_segment_len)
log = logging.getLogger(__name__)
# /proc/cpuinfo flags (x86 `flags`, Arm `Features`) of instructions that multiply 16-bit floats natively
_NATIVE_16BIT = {"bfloat16": ("amx_bf16", "avx512_bf16", "bf16"), "float16": ("amx_fp16", "avx512_fp16", "fphp")}


def cpu_flags(cpuinfo: str = "/proc/cpuinfo") -> set[str] | None:
    """The instruction-set flags of the first CPU in ``cpuinfo`` (x86 ``flags``, Arm ``Features``), or None
    when there is no readable file or no such line (e.g. macOS)."""
    try:
        with open(cpuinfo) as f:
            for line in f:
                key, _, val = line.partition(":")
                if key.strip() in ("flags", "Features"):
                    return set(val.split())
    except OSError:
        pass
    return None


def cpu_has_native_16bit_matmul(dtype, cpuinfo: str = "/proc/cpuinfo") -> bool | None:
    """Whether this CPU multiplies ``dtype`` (bfloat16 / float16) natively: True when ``cpuinfo`` lists
    AMX, AVX512-BF16/FP16 or Arm's BF16/FP16 instructions, False when it lists none of them, None when
    unknown (no readable ``cpuinfo``, e.g. macOS, or a dtype that is not 16-bit). Without them XLA:CPU
    converts every 16-bit matmul to float32 work: measured on an AVX2-only AMD EPYC (2 cores), a bfloat16
    2048^2 matmul ran at 75-89 GFLOP/s against 119-137 for float32, and a SmolLM2 bf16 rollout (batch 32) at
    0.76-1.08x the float32 one in three back-to-back pairs (on a CPU with AMX: 338-384 against 178-205
    GFLOP/s, the bf16 rollout 1.3-1.5x faster)."""
    wanted = _NATIVE_16BIT.get(jnp.dtype(dtype).name)
    listed = cpu_flags(cpuinfo) if wanted else None
    return None if listed is None else any(fl in listed for fl in wanted)


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


def _left_padded(mask: np.ndarray) -> bool:
    m = mask.astype(bool)
    return bool(np.all(m[:, 1:] >= m[:, :-1]))


def check_prompts(prompts, n) -> tuple[np.ndarray, np.ndarray, int]:
    """`(input_ids [B, P] int32, attention_mask [B, P] int32, n)` of a prompt batch, checked for every rollout
    engine. Raises ValueError: `n` not an integer >= 1, shapes that differ, prompts not left-padded, or a row
    without a real token."""
    if isinstance(n, bool) or not float(n).is_integer() or int(n) < 1:
        raise ValueError(f"n (responses per prompt) must be an integer >= 1, got {n!r}")
    n = int(n)
    ids = np.asarray(jax.device_get(prompts.batch["input_ids"])).astype(np.int32)
    mask = np.asarray(jax.device_get(prompts.batch["attention_mask"])).astype(np.int32)
    if ids.ndim != 2 or ids.shape != mask.shape:
        raise ValueError(f"input_ids {ids.shape} and attention_mask {mask.shape} must both be [B, P]")
    if not _left_padded(mask):
        raise ValueError("prompts must be left-padded (attention_mask 0...0 1...1 in every row)")
    if not np.all(mask.sum(axis=1) > 0):
        raise ValueError("every prompt needs at least one real token")
    return ids, mask, n


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
      mesh: optional ``Mesh`` with axes ('data','fsdp','expert','tensor'); the batch is sharded over
        ('data','fsdp','expert'). Params must already be placed on this mesh.
      prompt_buckets: allowed padded prompt lengths (None = powers of two, >= 16).
      batch_buckets: allowed padded batch sizes (None = powers of two).
      decode_chunk: decode steps per ``lax.scan`` chunk (the early-exit check runs between chunks).
      cache_dtype: KV cache dtype. None (default): the model's compute dtype, except float32 for a
        16-bit compute dtype on CPU (``kv_cache_dtype``): XLA:CPU widens a 16-bit dynamic-update-slice to
        float32 over the whole buffer, so every decode step would copy every cache segment, while float32
        slots are written in place and attention reads them without a copy (bf16 values stored exactly).
      min_prompt_bucket: smallest padded prompt length when ``prompt_buckets`` is None.
      cache_segment_len: KV cache slots per segment (``Transformer.init_cache``); attention skips
        segments holding no token yet, so a decode step reads ~the slots written so far. None: an eighth
        of the cache (a multiple of 16) but at least ``MIN_CACHE_SEGMENT`` slots, so caches of up to 128
        slots have one segment. Each segment costs compile time and a masked slot write per decode step
        and layer, which outweigh the skipped reads on short caches (SmolLM2, cache of 112 slots, 3
        compaction stages: first call 53 s with 16-slot segments, 19 s with one, same decode speed).
      compact_min_rows: decode compacts finished rows away: once at most half of the rows (per batch
        shard) are unfinished, it keeps those and goes on at half the batch, down to this many rows
        (``compaction_sizes``; each size is one more decode body in the compiled program). None or >=
        the batch: no compaction. Samples do not depend on it (per-row keys).
      return_routed_experts: an MoE model's routing replay (`actor.router_replay.mode='R3'`): the result also holds
        `routed_experts [B, P + R, M, k]` uint8/int16, the experts of every prompt token (prefill) and response
        token (the decode step that fed it). Off (the default): not computed, nothing changes. Raises
        ValueError on a model without MoE layers.
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
    return_routed_experts: bool = False
    last_decode_stats: dict | None = dataclasses.field(default=None, init=False, repr=False)

    def __post_init__(self):
        if self.return_routed_experts and not getattr(getattr(self.model, "config", None), "moe_layers", ()):
            raise ValueError("return_routed_experts needs a model with MoE layers (routing replay)")
        dtype = jnp.dtype(getattr(self.model, "dtype", jnp.float32))
        platform = self.mesh.devices.flat[0].platform if self.mesh is not None else jax.default_backend()
        if platform == "cpu" and dtype.itemsize == 2 and cpu_has_native_16bit_matmul(dtype) is False:
            log.warning(
                "rollout in %s on a CPU without native %s matmuls (no AMX / AVX512-%s in /proc/cpuinfo): "
                "XLA converts them to float32 work, so this rollout is no faster than a float32 one, often slower "
                "(rollout.dtype=float32)",
                dtype.name,
                dtype.name,
                "BF16" if dtype == jnp.bfloat16 else "FP16",
            )

    def _batch_multiple(self) -> int:
        if self.mesh is None:
            return 1

        return batch_shards(self.mesh)

    def __call__(self, prompts: DataProto, params: SamplingParams, *, seed: int | None = None) -> DataProto:
        return self.generate(prompts, params, seed=seed)

    def generate(
        self,
        prompts: DataProto,
        params: SamplingParams,
        *,
        seed: int | None = None,
        process_local: bool = False,
        n: int = 1,
    ) -> DataProto:
        """Generate ``n`` responses of ``params.max_new_tokens`` tokens for each left-padded prompt.

        Args:
          prompts: DataProto with ``input_ids [B, P]`` int and ``attention_mask [B, P]`` (left-padded,
            1 = real token); ``position_ids`` optional (else ``clip(cumsum(mask) - 1, 0)``).
            Non-tensor data and meta_info are carried over.
          params: sampling parameters (R = ``max_new_tokens``).
          seed: overrides ``params.seed`` (e.g. seed + step in a training loop).
          process_local: multi-process runs: ``prompts`` are this process's rows of the global batch
            (``distributed.local_rows``; every process holds as many) and the result is this process's rows.
            Otherwise every process passes the same global batch and gets the whole result.
          n: responses per prompt (verl ``rollout.n``, vLLM ``SamplingParams.n``). The result has ``B * n``
            rows in ``prompts.repeat(n, interleave=True)`` order (row ``i * n + j`` = sample j of prompt i) and
            equals generating from that repeated batch, but each prompt is prefilled once and its n rows
            decode from copies of its KV cache (vLLM's prefix caching of the shared prompt): the prefill
            costs 1/n. ``batch_buckets`` pad the prompt count; the decode runs at that size times n.
            Below, B counts output rows.
        Returns:
          DataProto (numpy arrays) with ``prompts [B, P] int32``, ``responses [B, R] int32`` (pad after
          the first EOS), ``input_ids [B, P+R]``, ``attention_mask [B, P+R] int32`` (prompt mask ++
          response_attention_mask), ``position_ids [B, P+R] int32`` (response positions continue from the
          last prompt position, verl style), ``response_attention_mask [B, R] int32`` (the response tokens
          that exist: up to and including the first EOS), ``loss_mask [B, R] int32`` (the tokens to train:
          the model's own tokens; single-turn, every existing token, so equal to
          ``response_attention_mask``), ``rollout_log_probs [B, R] float32`` (=
          ``logprobs_from_logits(logits, responses, temperature)`` of the training path, or the truncated
          distribution's with ``params.truncated_log_probs``; 0 where masked),
          ``sampling_logit_threshold [B, R] float32`` (smallest kept tempered logit of each step, -inf
          where nothing was truncated or masked), ``truncated [B] bool`` (no EOS within R); with
          ``return_routed_experts`` also ``routed_experts [B, P+R, M, k]`` uint8/int16 (each token's experts in
          the M MoE layers, rows aligned with ``input_ids``; 0 at padding and after a row's first EOS).
        Raises:
          ValueError: prompts are not left-padded, a row has no real token, a size exceeds the buckets, or
            ``n`` is not an integer >= 1.
        """
        ids, mask, n = check_prompts(prompts, n)
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
        row_done = np.repeat(np.arange(b_pad) >= b, n)  # decode rows: prompt i's samples are rows i*n..i*n+n-1

        chunk = max(1, min(self.decode_chunk, r))
        n_alloc = -(-r // chunk) * chunk
        static = dataclasses.replace(params, seed=0)
        key = jax.random.key(params.seed if seed is None else seed)

        graphdef, state = nnx.split(self.model)
        arrays, row_ids = (pid, pmask, row_done), None
        if nproc > 1:
            # each process's filler rows follow its own rows, so a row's place in the global batch is not its
            # place in the batch one process would build: its sample id is (real rows of all processes first)
            i = jax.process_index()
            prompt_id = np.concatenate([i * b + np.arange(b), nproc * b + i * (b_pad - b) + np.arange(b_pad - b)])
            row_ids = (prompt_id[:, None] * n + np.arange(n)).reshape(-1).astype(np.int32)
            arrays = (*arrays, row_ids)

            own = local_rows(self.mesh, b_pad * nproc)
            if (own.start, own.stop) != (jax.process_index() * b_pad, (jax.process_index() + 1) * b_pad):
                raise ValueError(
                    f"process-local rollout needs each process to hold rows [i*{b_pad}, (i+1)*{b_pad}) of the "
                    f"batch; process {jax.process_index()} holds {own} (a mesh axis other than the batch spans "
                    "processes?)"
                )
            *arrays, row_ids = (global_from_local(a, self.mesh) for a in arrays)
        elif self.mesh is not None:
            arrays = shard_batch(arrays, self.mesh)
        else:
            arrays = tuple(jnp.asarray(a) for a in arrays)
        pid_d, pmask_d, done_d = arrays
        max_len = p_pad + n_alloc
        seg = self.cache_segment_len or max(MIN_CACHE_SEGMENT, -(-max_len // 128) * 16)

        routes = bool(self.return_routed_experts)
        logits, cache, *prompt_routes = InMesh(_prefill, self.mesh)(
            graphdef,
            state,
            pid_d,
            pmask_d,
            jnp.int32(p),
            max_len=max_len,
            segment_len=min(seg, max_len),
            cache_dtype=kv_cache_dtype(self.model, self.cache_dtype, self.mesh),
            mesh=self.mesh,
            repeat=n,
            routes=routes,
        )
        groups = self._batch_multiple() if self.mesh is not None else 1
        sizes = compaction_sizes(b_pad * n * nproc, groups, self.compact_min_rows or b_pad * n * nproc)
        tokens, logps, thresholds, stage_end, _, _, *response_routes = InMesh(_decode, self.mesh)(
            graphdef,
            state,
            cache,
            logits,
            done_d,
            key,
            row_ids=row_ids,
            params=static,
            num_steps=r,
            chunk=chunk,
            sizes=sizes,
            groups=groups,
            mesh=self.mesh,
            routes=routes,
        )

        host = local_part if nproc > 1 else to_host
        self.last_decode_stats = {"sizes": sizes, "stage_end_step": [int(x) for x in to_host(stage_end)]}
        tokens, logps, thresholds = (host(x)[: b * n, :r] for x in (tokens, logps, thresholds))
        if n > 1:
            prompts, ids, mask = prompts.repeat(n, interleave=True), np.repeat(ids, n, 0), np.repeat(mask, n, 0)
        out = _assemble(prompts, ids, mask, tokens, logps, thresholds, params)
        if routes:  # process-local like the tokens: this process's rows only
            prompt_part, response_part = host(prompt_routes[0])[: b * n, :p], host(response_routes[0])[: b * n, :r]
            exists = out.batch["attention_mask"].astype(bool)[:, :, None, None]
            routed = np.concatenate([prompt_part, response_part], 1)
            out.batch["routed_experts"] = np.where(exists, routed, 0).astype(routed.dtype)
        return out


def _assemble(prompts: DataProto, ids, mask, tokens, logps, thresholds, params: SamplingParams) -> DataProto:
    """Host-side output assembly (numpy, cheap): masks, positions, concatenation."""
    r = tokens.shape[1]
    exists = np.asarray(get_response_mask(tokens, params.eos_token_ids)).astype(np.int32)
    tokens = np.where(exists.astype(bool), tokens, params.pad_token_id).astype(np.int32)
    logps = np.where(exists.astype(bool), logps, 0.0).astype(np.float32)
    thresholds = np.where(exists.astype(bool), thresholds, -np.inf).astype(np.float32)
    truncated = ~np.any(np.asarray(is_eos(tokens, params.eos_token_ids)) & exists.astype(bool), axis=1)
    if "position_ids" in prompts.batch:
        ppos = np.asarray(jax.device_get(prompts.batch["position_ids"])).astype(np.int32)
    else:
        ppos = np.maximum(np.cumsum(mask, axis=1) - 1, 0).astype(np.int32)
    rpos = ppos[:, -1:] + np.arange(1, r + 1, dtype=np.int32)[None]
    batch = {
        "prompts": ids,
        "responses": tokens,
        "input_ids": np.concatenate([ids, tokens], axis=1),
        "attention_mask": np.concatenate([mask, exists], axis=1),
        "position_ids": np.concatenate([ppos, rpos], axis=1),
        "response_attention_mask": exists,
        "loss_mask": exists.copy(),  # single-turn: the model wrote every existing token
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
