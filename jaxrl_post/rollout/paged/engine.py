"""`PagedGenerator`: the paged, continuously batched rollout engine behind the dense `Generator`'s interface.

The host loop alternates dispatches: a prefill chunk when sequences wait for their prompt (`Scheduler`), else `K`
decode steps of the whole slot batch. Shapes are fixed per engine and prompt bucket (slots, pages, page-table
width, prefill budget), so each program compiles once. Samples use the dense `Generator`'s per-row keys
(`fold_in(fold_in(key, step), row)`, row `i * n + j` = sample j of prompt i), so on CPU float32 both engines give
the same tokens, and log-probs equal to float rounding (prefill and decode batch differently).

With a `mesh` ('data', 'fsdp', 'expert', 'tensor') = (D, 1, 1, tp) -- the rollout layout of
`rollout.tensor_model_parallel_size` -- the engine runs D data-parallel replicas of tp chips each (vLLM's data
parallelism): each replica has its own `max_num_seqs` slots, page pool (`num_pages` pages), page tables and host
`Scheduler`; prompts (with their `n` samples, which share prompt pages) wait in one queue that the replicas admit
from at every dispatch boundary (`admission.ReplicaSchedulers`), and every dispatch runs all replicas in
one SPMD program (`replicas.replica_map`; per-replica arrays `[D, ...]` on 'data'). A dispatch is a prefill when any
replica has prompt work (the others run an empty chunk), else a decode of every replica's slots. Within a replica
the weights are split over 'tensor' as placed (`sharding.param_shardings`), the pool over kv heads
(`kv_pool.POOL_AXES`), page tables, slots, logits and sampled tokens replicated; GSPMD partitions the per-head XLA
attention; the Pallas TPU kernel runs per device in a `shard_map` over 'tensor' on its heads' slice of the pool,
`attention.paged_attention`; with tensor = 1 each replica's body is a single-device program, all mesh axes manual.
Sampling keys depend on the row only, so a sequence's tokens do not depend on its replica.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxrl_post.batch.protocol import DataProto
from jaxrl_post.models.moe import routes_dtype
from jaxrl_post.rollout.generate import _assemble, check_prompts, kv_cache_dtype
from jaxrl_post.rollout.paged import forward, programs
from jaxrl_post.rollout.paged.admission import QUEUES, ReplicaSchedulers
from jaxrl_post.rollout.paged.attention import resolve_for_model
from jaxrl_post.rollout.paged.dispatch import (
    by_slot,
    decode_batch_sizes,
    decode_inputs,
    first_logits,
    padded_batch_size,
    page_copies,
    prefill_inputs,
)
from jaxrl_post.rollout.paged.kv_pool import init_replica_pools, pool_bytes, zeros_on
from jaxrl_post.rollout.paged.replicas import num_replicas
from jaxrl_post.rollout.paged.scheduler import Piece, Scheduler, Seq
from jaxrl_post.rollout.sampling import SamplingParams
from jaxrl_post.runtime.sharding import logical_to_mesh_spec

log = logging.getLogger(__name__)
_REP = ("replica", None, None)  # logits [D, S, V]: a replica's on its 'data' index, replicated within it


@dataclasses.dataclass
class PagedGenerator:
    """Paged rollout engine for one model, on one device or as data-parallel replicas of a tensor-parallel engine
    on a mesh (module docstring).

    Args:
      model: a `jaxrl_post.models.Transformer`; its params are read (and layers stacked) at each `generate` call
        and by `update_weights`.
      max_num_seqs: slots of the decode batch (vLLM / verl `max_num_seqs`).
      max_num_batched_tokens: prompt tokens per prefill dispatch (vLLM / verl; chunked prefill).
      page_size: tokens per page (vLLM `block_size`).
      num_pages: pages of the pool, the null page included (vLLM `num_gpu_blocks_override`); None: enough for
        every slot to hold a sequence of the longest prompt bucket plus `max_new_tokens` (no preemption).
      steps_per_dispatch: decode steps per dispatch (`K`, one `lax.scan`); the host retires and admits between.
      cache_dtype: pool dtype; None as `Generator` (`kv_cache_dtype`).
      attention_impl: "auto" (TPU: the Pallas TPU kernel, GPU: the Pallas GPU kernel for decode steps, else XLA;
        XLA for a model a kernel cannot run: `attention.resolve_for_model`), "xla", "pallas_tpu" or "pallas_gpu"
        (raises ValueError off its platform or for a model it cannot run).
      attention_interpret: run "pallas_gpu" in Pallas interpret mode (any platform; CPU tests).
      min_prompt_bucket: prompts are padded to a power of two >= this for the page-table width (compile once).
      max_model_len: longest prompt + response a page table holds (vLLM / verl `max_model_len`): the tables are
        `ceil(max_model_len / page_size)` pages wide, so the programs (and their memory) are the same for every
        batch size, prompt bucket and `max_new_tokens` up to it. None: the prompt bucket + `max_new_tokens`.
      scan_layers: run the layers as a `lax.scan` over params stacked once per call (compiles one layer); False:
        unrolled. None: scanned off CPU, unrolled on CPU, where the scan materializes each layer's slice of the
        stacked MLP kernels at every step (docs/paged_rollout.md#how-it-works).
      return_routed_experts: an MoE model's routing replay (`actor.router_replay.mode='R3'`), as `Generator`'s: the
        result also holds `routed_experts [B, P + R, M, k]` uint8/int16. A token's experts are those of the first
        forward that fed it (prefill for the prompt, shared by its `n` samples; the decode step for a response
        token), kept when a preempted or resumed sequence's context is prefilled again. Raises ValueError on a
        model without MoE layers.
      mesh: a mesh ('data', 'fsdp', 'expert', 'tensor') with 'fsdp' = 'expert' = 1, the model's params placed on
        it: 'data' replicas of a 'tensor'-parallel engine (module docstring; `max_num_seqs` and `num_pages` are per
        replica, as vLLM's engine arguments are per data-parallel rank); None: one device. Raises ValueError for
        'fsdp' or 'expert' > 1 or a 'tensor' size that does not divide the kv heads, or another `replica_queue`.
      replica_queue: "shared": replicas admit waiting prompt groups from one queue at every dispatch boundary;
        "static": prompts are assigned to replicas before the first dispatch (`rollout/paged/admission.py`).
      enable_prefix_caching: sequences of a call (and of a multi-turn session) share full context pages by content,
        so a prompt prefills only from its first token after a prefix already in the pool (vLLM's automatic prefix
        caching; `rollout/paged/prefix_cache.py`). Off with `return_routed_experts` (a reused page's tokens would
        have no experts recorded for the sequence that reuses it).
      cudagraph_capture_sizes: the decode batch sizes to compile (vLLM's name; here a jitted decode program each):
        a decode dispatch runs the running sequences (of the busiest replica) padded to the smallest size that
        holds them, so a few sequences in many slots compute few rows. None: powers of two from 8 and
        `max_num_seqs` (`dispatch.decode_batch_sizes`; raises ValueError for a size < 1).
    """

    model: nnx.Module
    max_num_seqs: int = 32
    max_num_batched_tokens: int = 512
    page_size: int = 16
    num_pages: int | None = None
    steps_per_dispatch: int = 16
    cache_dtype: str | None = None
    attention_impl: str = "auto"
    attention_interpret: bool = False
    min_prompt_bucket: int = 16
    scan_layers: bool | None = None
    max_model_len: int | None = None
    return_routed_experts: bool = False
    mesh: jax.sharding.Mesh | None = None
    replica_queue: str = "shared"
    enable_prefix_caching: bool = True
    cudagraph_capture_sizes: tuple[int, ...] | None = None
    last_stats: dict | None = dataclasses.field(default=None, init=False, repr=False)

    def __post_init__(self):
        if self.return_routed_experts and not getattr(getattr(self.model, "config", None), "moe_layers", ()):
            raise ValueError("return_routed_experts needs a model with MoE layers (routing replay)")
        self.impl = resolve_for_model(
            self.attention_impl,
            jax.default_backend(),
            getattr(self.model, "config", None),
            self.page_size,
            interpret=self.attention_interpret,
        )
        if self.mesh is not None:
            self._check_mesh()
        if self.replica_queue not in QUEUES:
            raise ValueError(f"PagedGenerator.replica_queue must be one of {QUEUES}, got {self.replica_queue!r}")
        if self.scan_layers is None:
            self.scan_layers = jax.default_backend() != "cpu"
        for name in ("max_num_seqs", "max_num_batched_tokens", "page_size", "steps_per_dispatch"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"PagedGenerator.{name} must be >= 1, got {getattr(self, name)}")
        self.decode_sizes = decode_batch_sizes(int(self.max_num_seqs), self.cudagraph_capture_sizes)
        self._weights_read = False
        self.weights_version = 0  # + 1 at every `update_weights`: pages shared by content are dropped on a change
        self.unfinished: list[Seq] = []  # sequences the last call stopped before they finished

    def _check_mesh(self) -> None:
        shape = dict(self.mesh.shape)
        if any(v > 1 for k, v in shape.items() if k not in ("data", "tensor")):
            raise ValueError(f"the paged engine runs 'data' replicas of a 'tensor'-parallel engine only: mesh {shape}")
        tp, n_kv = shape.get("tensor", 1), self.model.config.num_kv_heads
        if n_kv % tp:
            raise ValueError(f"the paged engine's tensor size {tp} does not divide the model's {n_kv} kv heads")

    @property
    def replicas(self) -> int:
        """Data-parallel replicas: the mesh's 'data' size (1 without a mesh)."""
        return num_replicas(self.mesh)

    def update_weights(self, model: nnx.Module | None = None) -> None:
        """Take `model`'s (or the current model's) params for the next dispatch: the layers are restacked once
        here, not per dispatch (weight swap between dispatches, asynchronous RL)."""
        if model is not None:
            self.model = model
        self._graphdef, self._state = nnx.split(self.model)
        self._graphdefs, self._stacked = forward.stack_layers(self.model) if self.scan_layers else (None, None)
        self._weights_read = True
        self.weights_version += 1

    @property
    def prefix_caching(self) -> bool:
        """Whether sequences share full context pages by content (`enable_prefix_caching`, not with routing
        replay)."""
        return bool(self.enable_prefix_caching) and not self.return_routed_experts

    def table_pages(self, prompt_len: int, max_new_tokens: int) -> int:
        """Pages per page table (the programs' `pages_per_seq`) for prompts of `prompt_len` tokens (left-padded
        width) and `max_new_tokens`. Raises ValueError when they exceed `max_model_len`."""
        if self.max_model_len is not None:
            if prompt_len + max_new_tokens > self.max_model_len:
                raise ValueError(
                    f"prompts of {prompt_len} tokens + {max_new_tokens} new tokens exceed the paged engine's "
                    f"max_model_len {self.max_model_len}"
                )
            return -(-int(self.max_model_len) // self.page_size)
        p_pad = 1 << max(self.min_prompt_bucket - 1, prompt_len - 1).bit_length()
        return -(-(p_pad + max_new_tokens) // self.page_size)

    def __call__(self, prompts: DataProto, params: SamplingParams, *, seed: int | None = None) -> DataProto:
        return self.generate(prompts, params, seed=seed)

    def generate(
        self,
        prompts: DataProto,
        params: SamplingParams,
        *,
        seed: int | None = None,
        n: int = 1,
        should_stop: Callable[[int], bool] | None = None,
        resume: list[Seq] | None = None,
        process_local: bool = False,
    ) -> DataProto:
        """`Generator.generate`'s contract (same keys, shapes, row order `i * n + j`; see it for the details).

        should_stop: called with the dispatch count after each dispatch; True stops at that boundary: the result
          then holds every sequence's tokens so far, and `self.unfinished` the unfinished `Seq`s (tokens,
          log-probs) to pass back as `resume` (with the same prompts, params and seed) to go on.
        resume: sequences a stopped call handed back; only those are generated further.
        process_local: as `Generator.generate`; this engine runs in one process (True with several: ValueError).
        Raises ValueError: prompts not left-padded / a row without a real token / bad `n`, a pool too small for
          one sequence, or several processes.
        """
        if process_local and jax.process_count() > 1:
            raise ValueError("the paged rollout engine runs in one process for now (rollout.name='dense')")
        with contextlib.nullcontext() if self.mesh is None else jax.set_mesh(self.mesh):
            return self._generate(prompts, params, seed, n, should_stop, resume)

    def _generate(self, prompts, params, seed, n, should_stop, resume) -> DataProto:
        ids, mask, n = check_prompts(prompts, n)
        b, p = ids.shape
        r = params.max_new_tokens
        if resume is None or not self._weights_read:
            self.update_weights()  # the model's current params, as `Generator` reads them at every call
        pps = self.table_pages(p, r)
        num_pages = self.num_pages or self.max_num_seqs * pps + 1
        cfg, d = self.model.config, self.replicas
        dtype = jnp.dtype(kv_cache_dtype(self.model, self.cache_dtype))
        rs = ReplicaSchedulers(
            d,
            num_pages,
            self.page_size,
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            steps_per_dispatch=self.steps_per_dispatch,
            queue=self.replica_queue,
            prefix_caching=self.prefix_caching,
        )
        if resume is None:
            seqs = [Seq(row=i * n + j, prompt=ids[i][mask[i] > 0], limit=r) for i in range(b) for j in range(n)]
            groups = [seqs[i * n : (i + 1) * n] for i in range(b)]
        else:
            seqs = list(resume)
            groups = [[s] for s in seqs]
        rs.add(groups)
        kv, logits = self.device_state(num_pages)
        key = jax.random.key(params.seed if seed is None else seed)
        static = dataclasses.replace(params, seed=0, max_new_tokens=1)  # slots carry their limits: one program
        stats = {"prefill_dispatches": 0, "decode_dispatches": 0, "decode_slot_steps": 0, "decode_row_steps": 0}
        stats["emitted"] = 0
        stats["prefill_tokens"] = dispatches = 0
        version = self.weights_version
        while not rs.idle:
            if self.weights_version != version:  # new weights mid-call: no page computed by the old ones is shared
                rs.drop_prefix_caches()
                version = self.weights_version
            pieces = rs.schedule_prefill()
            if any(pieces):  # replicas without prompt work run an empty chunk (one program for all replicas)
                kv, logits = self._prefill(kv, logits, rs.scheds, pieces, pps)
                stats["prefill_dispatches"] += 1
                stats["prefill_tokens"] += sum(pc.count for pcs in pieces for pc in pcs)
            else:
                kv, logits = self._decode(kv, logits, rs, pps, key, static, stats)
                stats["decode_dispatches"] += 1
            dispatches += 1
            if should_stop is not None and should_stop(dispatches) and not rs.idle:
                break
        stats.update(rs.stats())  # per replica: sequences finished, busy / idle slot-steps (before `stop`)
        self.unfinished = rs.stop()
        stats.update(
            num_pages=num_pages,
            pool_bytes=pool_bytes(cfg.num_layers, num_pages, self.page_size, cfg.num_kv_heads, cfg.head_dim, dtype),
            pool_shard_shape=tuple(kv.addressable_shards[0].data.shape),  # one device's share of the pools
            pool_devices=len(kv.sharding.device_set),
            replicas=d,
        )
        self.last_stats = stats
        return self._result(prompts, ids, mask, seqs, n, params)  # resumed: the rows not resumed are empty

    def device_state(self, num_pages: int):
        """Zeroed device state of a call: the replicas' page pools (`init_replica_pools`, `num_pages` pages each) and
        the carried next-token logits `[replicas, max_num_seqs, V] float32` (per replica on 'data', replicated
        within it, as the programs return them)."""
        cfg, dtype = self.model.config, jnp.dtype(kv_cache_dtype(self.model, self.cache_dtype))
        args = (num_pages, self.page_size, cfg.num_kv_heads, cfg.head_dim, dtype, self.mesh)
        kv = init_replica_pools(self.replicas, cfg.num_layers, *args)
        shape = (self.replicas, self.max_num_seqs, cfg.vocab_size)
        if self.mesh is None:
            return kv, jnp.zeros(shape, jnp.float32)
        return kv, zeros_on(shape, jnp.float32, jax.sharding.NamedSharding(self.mesh, logical_to_mesh_spec(_REP)))

    # ------------------------------------------------------------------ dispatches
    def _prefill(self, kv, logits, scheds: list[Scheduler], pieces: list[list[Piece]], pps: int):
        s_max = self.max_num_seqs
        ins = [prefill_inputs(sc, pc, self.max_num_batched_tokens, pps) for sc, pc in zip(scheds, pieces)]
        stacked = {k: jnp.asarray(np.stack([x[k] for x in ins])) for k in ins[0]}
        last = stacked.pop("last")
        kv, new, *routes = programs.prefill(
            self._graphdef,
            self._state,
            self._graphdefs,
            self._stacked,
            kv,
            forward.Ragged(**stacked),
            last,
            impl=self.impl,
            routes=self.return_routed_experts,
        )
        if routes:
            routes = np.asarray(jax.device_get(routes[0]))
            for rep, pcs in enumerate(pieces):
                for pc, lo in zip(pcs, np.concatenate([[0], np.cumsum([pc.count for pc in pcs])])):
                    _record_routes(pc.seq, pc.start, routes[rep, lo : lo + pc.count])
        done = [sc.prefill_done(pc) for sc, pc in zip(scheds, pieces)]
        if any(complete for complete, _ in done):
            moves = [first_logits(pc, complete, s_max) for pc, (complete, _) in zip(pieces, done)]
            src, dst = (jnp.asarray(np.stack(m)) for m in zip(*moves))
            logits = programs.place_logits(logits, new, src, dst)
        pairs = page_copies([copies for _, copies in done], s_max)
        if pairs is not None:
            kv = programs.copy_pages(kv, jnp.asarray(pairs[..., 0]), jnp.asarray(pairs[..., 1]))
        return kv, logits

    def _decode(self, kv, logits, rs: ReplicaSchedulers, pps: int, key, params, stats):
        scheds, seqs = rs.scheds, rs.schedule_decode()
        size = padded_batch_size(self.decode_sizes, max(len(ss) for ss in seqs))
        ins = [decode_inputs(sc, ss, pps, size) for sc, ss in zip(scheds, seqs)]
        kv, logits, *outs = programs.decode(
            self._graphdef,
            self._state,
            self._graphdefs,
            self._stacked,
            kv,
            logits,
            *(jnp.asarray(np.stack(a)) for a in zip(*ins)),
            key,
            impl=self.impl,
            params=params,
            steps=self.steps_per_dispatch,
            routes=self.return_routed_experts,
        )
        outs = [np.asarray(a) for a in jax.device_get(outs)]  # tokens, lps, ths, emitted, done[, routes]: [D, B, ...]
        s_max = self.max_num_seqs
        for rep, (sc, ss) in enumerate(zip(scheds, seqs)):
            host = [by_slot(o[rep], ins[rep][0], s_max) for o in outs]
            if self.return_routed_experts:  # before `decode_done` retires sequences (their slots are read here)
                for s in ss:
                    _record_routes(s, s.length, host[5][s.slot][host[3][s.slot]])
            stats["decode_slot_steps"] += len(ss) * self.steps_per_dispatch
            sc.decode_done(ss, *host[:5])
        stats["decode_row_steps"] += len(scheds) * size * self.steps_per_dispatch
        stats["emitted"] += int(outs[3].sum())
        return kv, logits

    # ------------------------------------------------------------------ output
    def _result(self, prompts, ids, mask, seqs, n, params):
        r, rows = params.max_new_tokens, len(ids) * n  # every row of the call, resumed or not
        tokens = np.full((rows, r), params.pad_token_id, np.int32)
        logps = np.zeros((rows, r), np.float32)
        ths = np.full((rows, r), -np.inf, np.float32)
        for s in seqs:
            k = len(s.tokens)
            tokens[s.row, :k], logps[s.row, :k], ths[s.row, :k] = s.tokens, s.log_probs, s.thresholds
        if n > 1:
            prompts, ids, mask = prompts.repeat(n, interleave=True), np.repeat(ids, n, 0), np.repeat(mask, n, 0)
        out = _assemble(prompts, ids, mask, tokens, logps, ths, params)
        for s in self.unfinished:  # stopped early: only the tokens it has exist (no EOS yet: truncated)
            for key in ("response_attention_mask", "loss_mask"):
                out.batch[key][s.row, len(s.tokens) :] = 0
            out.batch["attention_mask"][s.row, ids.shape[1] + len(s.tokens) :] = 0
        if self.return_routed_experts:
            out.batch["routed_experts"] = self._routed_experts(seqs, rows, ids.shape[1], r, out.batch["attention_mask"])
        return out

    def _routed_experts(self, seqs, rows: int, p: int, r: int, attention_mask) -> np.ndarray:
        """`[rows, p + r, M, k]` of the sequences' recorded experts, prompts left-padded as `input_ids`; 0 where
        `attention_mask [rows, p + r]` is 0 (padding, after EOS, not generated yet) and for context tokens not fed
        yet (a call stopped before a sequence's prefill)."""
        cfg = self.model.config
        m, k = len(cfg.moe_layers), cfg.num_experts_per_tok
        out = np.zeros((rows, p + r, m, k), np.dtype(routes_dtype(cfg.num_experts)))
        for s in seqs:
            got = np.concatenate(s.routes) if s.routes else np.zeros((0, m, k), out.dtype)
            n_p = len(s.prompt)
            out[s.row, p - n_p : p - n_p + min(len(got), n_p)] = got[:n_p]
            resp = got[n_p : n_p + len(s.tokens)]
            out[s.row, p : p + len(resp)] = resp
        return np.where(attention_mask.astype(bool)[:, :, None, None], out, 0).astype(out.dtype)


def _record_routes(seq: Seq, start: int, routes: np.ndarray) -> None:
    """Append the experts `routes [n, M, k]` of `seq`'s context tokens `[start, start + n)` that it has none of
    yet (a token keeps the experts of the first forward that fed it)."""
    have = sum(len(r) for r in seq.routes)
    if start <= have < start + len(routes):
        seq.routes.append(np.array(routes[have - start :]))
