"""The rollout role (verl's rollout worker): the model that samples, its generator / agent loop, and one
generation batch of a training step (generate + reward).

The rollout model is the actor itself when `rollout.dtype` (None = `model.dtype`) equals both the compute and
the param dtype (one copy of the weights; a LoRA actor samples with its adapters), else an abstract model with
weights and compute in `rollout.dtype`, filled by `sync` (verl: the rollout engine's own weights). A LoRA
actor's copy has no adapters: it holds the merged kernels `W + (alpha / r) A . B`
(`models.lora.merged_state`). The copy's arrays are `TrainState.rollout` (train_state.py). Under the split
placement (`rollout.n_gpus_per_node` > 0) the copy lives on the rollout's own mesh: cast (if needed) on the
training mesh, then published there by one batched `jax.device_put` (`async_training.placement.publish_weights`).
`rollout.tensor_model_parallel_size` = tp gives the rollout a layout of its own: the split placement's rollout mesh
has 'tensor' = tp; colocated, the copy lives on the training devices laid out (n / tp, 1, 1, tp)
(`builders.colocated_rollout_mesh`), written from the training layout by one jitted program (cast and LoRA merge in
it, `out_shardings` the rollout layout's, the previous copy donated).

Every rollout answers `collect(prompts, seed, timing, reward_fn, rng, next_prompts)`;
`dynamic_sampling.FilteredRollout` wraps one with DAPO's group filter.
"""

from __future__ import annotations

import logging

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxrl_post.algos.registry import adv_estimator_needs
from jaxrl_post.batch.protocol import DataProto
from jaxrl_post.engine.placement import Placement, to_numpy
from jaxrl_post.errors import ConfigError
from jaxrl_post.models.hf_io import empty_model
from jaxrl_post.models.lora import merged_state
from jaxrl_post.rl import local_rows, reward_builders
from jaxrl_post.rl.async_training.placement import publish_weights
from jaxrl_post.rl.builders import apply_moe_impl, check_rollout_heads, colocated_rollout_mesh
from jaxrl_post.rl.dynamic_sampling import score_everywhere, timer
from jaxrl_post.rollout import Generator, SamplingParams
from jaxrl_post.rollout.agent_loop import rollout_metrics
from jaxrl_post.rollout.paged.from_config import paged_generator_from_config
from jaxrl_post.runtime import platform_defaults
from jaxrl_post.runtime.distributed import gather_reward, gather_rows
from jaxrl_post.runtime.row_stats import reduce_reward
from jaxrl_post.runtime.sharding import bytes_per_device, param_shardings

log = logging.getLogger(__name__)


ENGINE_COUNTS = ("prefix_cache_queries", "prefix_cache_hits", "preemptions", "evictions")  # paged `last_stats`


class RolloutRole:
    """The sampling model and engine of a run (see the module docstring).

    Args:
      cfg: the job ConfigDict (`rollout.*`, `data.max_response_length`, `algorithm.adv_estimator`).
      policy: the `PolicyRole` whose params the rollout samples with.
      placement: the run's `Placement`.
      tokenizer, eos_token_ids, pad_token_id: the actor's tokenizer and its stop / pad ids.
      process_local: multi-process runs where each process holds only its share of every prompt batch; with
        `trainer.distributed.process_local_rows` (`keep_rows`) the scored rows stay there too and the placement's
        forwards and updates take this process's rows (`Placement.process_local_rows`, rl/local_rows.py).
      separate_copy: the rollout samples with its own copy of the weights even when dtypes agree (asynchronous
        training: the rollout's weights are published every `trigger_parameter_sync_step` steps, `sync(publish=)`).
      rollout_mesh: the split placement's rollout mesh (`builders.build_meshes`): the rollout samples there with its
        own copy of the weights; None: colocated on `placement.mesh`.

    Attributes: `model` (the sampling nnx module), `copy` (True: a separate copy in `rollout.dtype`),
    `rollout_mesh` (split placement, else None), `layout_mesh` (the mesh the rollout samples on when it has a layout
    of its own: the split placement's, or the colocated one of `rollout.tensor_model_parallel_size`; else None),
    `published_bytes` (bytes of the last publication to the rollout mesh: the `async/publish_bytes` metric; 0
    colocated), `weights_bytes_per_chip` (the most bytes of the rollout copy one device holds, with a
    `layout_mesh`),
    `generator` (`rollout.Generator`, or `PagedGenerator` under `rollout.name='paged'`), `agent_loop`
    (multi-turn `AgentLoop`, None: single-turn).
    """

    def __init__(
        self,
        cfg,
        policy,
        placement: Placement,
        tokenizer,
        eos_token_ids,
        pad_token_id,
        process_local: bool,
        separate_copy: bool = False,
        rollout_mesh=None,
    ):

        self.config, self.policy = cfg, policy
        self.eos_token_ids, self.pad_token_id = eos_token_ids, pad_token_id
        self.process_local = bool(process_local)
        self.keep_rows = self.process_local and local_rows.enabled(cfg)  # no gather of the scored rows
        placement.process_local_rows = self.keep_rows  # the rows handed out are what every forward / update gets
        rdt = jnp.dtype(cfg.rollout.dtype or platform_defaults.resolve("model.dtype", cfg.model.dtype))
        m = policy.model
        self.rollout_mesh, self.published_bytes = rollout_mesh, 0
        self.tp, self.weights_bytes_per_chip = cfg.rollout.get("tensor_model_parallel_size"), 0
        self.layout_mesh = rollout_mesh if rollout_mesh is not None else colocated_rollout_mesh(cfg, placement.mesh)
        relayout = rollout_mesh is None and self.layout_mesh is not None  # colocated, a layout of its own
        # split placement without a cast: the actor's params go to the rollout mesh as they are
        self._publish_direct = rollout_mesh is not None and policy.lora is None and rdt == m.param_dtype
        self.copy = separate_copy or relayout or rollout_mesh is not None or not (rdt == m.dtype == m.param_dtype)
        if self.copy:
            self.model = empty_model(m.config, dtype=rdt, param_dtype=rdt)
            apply_moe_impl(cfg, self.model)  # the actor's MoE grouped matmul (model.moe_impl)
            if self.tp is not None:  # one line per bad key (heads, then any dim the rollout layout splits)
                check_rollout_heads(cfg, m.config)
                try:
                    param_shardings(nnx.state(self.model, nnx.Param), self.layout_mesh)
                except ValueError as e:
                    raise ConfigError(f"config.rollout.tensor_model_parallel_size={self.tp}: {e}") from None
            # a same-dtype `astype` would hand back the actor's own (later donated) buffers: copy instead
            own = separate_copy or relayout
            one = (lambda x: jnp.copy(x) if x.dtype == rdt else x.astype(rdt)) if own else None
            one = one or (lambda x: x.astype(rdt))
            cast = lambda p: jax.tree.map(one, p)
            if policy.lora is not None:  # fn(adapters, frozen base) -> merged params, shardings of the base
                g, r = policy.graphdef, policy.rest
                to_rollout = lambda p, f: cast(merged_state(nnx.merge(g, p, f, r)))
                out = jax.tree.map(lambda x: x.sharding, policy.frozen) if placement.sharded else None
            else:
                to_rollout, out = (lambda p, f: cast(p)), None
            self._to_rollout = to_rollout
            if relayout:  # its out_shardings are the rollout layout's, of the cast's output: built at the first sync
                self._cast_first = self._cast_donating = None
            else:
                self._cast_first = jax.jit(to_rollout, out_shardings=out)
                self._cast_donating = jax.jit(
                    lambda p, f, old: to_rollout(p, f), donate_argnums=(2,), out_shardings=out
                )
        else:
            self.model = m
        if cfg.rollout.name == "paged":  # docs/paged_rollout.md; on layout_mesh: data replicas x tensor
            r3 = policy.router_replay == "R3"  # `routed_experts`, replayed by the actor
            mesh = self.layout_mesh if self.tp is not None else None
            longest = int(cfg.data.max_prompt_length) + int(cfg.data.max_response_length)
            kw = dict(return_routed_experts=r3, mesh=mesh, max_seq_len=longest)
            self.generator = paged_generator_from_config(self.model, cfg.rollout, **kw)
        else:
            self.generator = Generator(
                self.model,
                mesh=placement.active_mesh if self.layout_mesh is None else self.layout_mesh,
                cache_segment_len=platform_defaults.cache_segment_len(),  # one segment off CPU (no per-segment cond)
                return_routed_experts=policy.router_replay == "R3",  # `routed_experts`, replayed by the actor
            )
        self.agent_loop = reward_builders.build_agent_loop(cfg, self.generator, tokenizer)  # None: single-turn
        self._multi_turn_stats: list[dict] = []  # agent-loop counts of each generation batch of the step
        self._engine_counts: dict[str, float] = {}  # paged engine: `ENGINE_COUNTS` summed over the step's batches

    @property
    def engine(self):
        """What generates: the multi-turn agent loop, else the single-turn generator."""
        return self.generator if self.agent_loop is None else self.agent_loop

    def sync(self, actor_params, rollout_params, publish: bool = True, timing: dict[str, float] | None = None):
        """The one place where actor and rollout meet, after every actor update and restore: the actor's
        module gets `actor_params`; the rollout model gets them too -- shared buffers when dtypes agree
        (returns None), else cast to `rollout.dtype` by one jitted program (shardings kept; the previous copy
        `rollout_params` is donated to it; LoRA: the adapters merged into the frozen base kernels first; with
        `rollout.tensor_model_parallel_size` colocated, the same program writes the rollout layout).
        Split placement: the params (cast first when `rollout.dtype` differs or LoRA is on) go to the rollout mesh
        in one `jax.device_put` (`publish_weights`; `published_bytes` set), the previous copy is dropped; the
        seconds until it is there are added to `timing['sync_rollout_weights']` (verl's timer name).
        Returns the new rollout copy (`TrainState.rollout`). `publish=False` (asynchronous training between weight
        publications): the actor's module only; the rollout keeps `rollout_params`."""
        self.policy.sync_model(actor_params)  # the actor module always holds the live params
        if not publish:
            self.published_bytes = 0
            return rollout_params
        if not self.copy:
            return None
        frozen = self.policy.frozen
        if self.rollout_mesh is not None:  # split placement: cast on the training mesh, then one device_put
            with timer("sync_rollout_weights", {} if timing is None else timing):
                src = actor_params if self._publish_direct else self._cast_first(actor_params, frozen)
                new, self.published_bytes = publish_weights(src, self.rollout_mesh)
                jax.block_until_ready(new)
            nnx.update(self.model, new)
            self._measure(new, "split placement: published by one device_put")
            return new
        if self._cast_first is None:
            self._relayout_programs(actor_params, frozen)
        if rollout_params is None:
            new = self._cast_first(actor_params, frozen)
        else:
            new = self._cast_donating(actor_params, frozen, rollout_params)
        nnx.update(self.model, new)
        if self.layout_mesh is not None:
            self._measure(new, "colocated: resharded from the training mesh by one jitted program")
        return new

    def _relayout_programs(self, actor_params, frozen) -> None:
        """The colocated relayout's two jitted programs (first sync; then every sync, the previous copy donated):
        cast / LoRA merge and reshard in one, `out_shardings` the rollout layout's (`param_shardings` of the cast's
        output on `layout_mesh`)."""
        to_rollout = self._to_rollout
        out = param_shardings(jax.eval_shape(to_rollout, actor_params, frozen), self.layout_mesh)
        self._cast_first = jax.jit(to_rollout, out_shardings=out)
        self._cast_donating = jax.jit(lambda p, f, old: to_rollout(p, f), donate_argnums=(2,), out_shardings=out)

    def _measure(self, new, how: str) -> None:
        """Set `weights_bytes_per_chip` from the new copy; log the rollout layout at the first sync."""
        first = not self.weights_bytes_per_chip
        self.weights_bytes_per_chip = bytes_per_device(new)
        if first:
            shape = " x ".join(f"{k}={v}" for k, v in self.layout_mesh.shape.items())
            log.info(
                "rollout layout: rollout.tensor_model_parallel_size=%s -> mesh %s over %d devices (%s); weights "
                "%.3f MB per chip",
                self.tp,
                shape,
                self.layout_mesh.size,
                how,
                self.weights_bytes_per_chip / 1e6,
            )

    def publish_metrics(self) -> dict[str, float]:
        """{} colocated on the training layout; split placement: `async/publish_bytes`, the bytes the last `sync`
        moved to the rollout mesh (0 when it did not publish); with a layout of its own (split, or
        `rollout.tensor_model_parallel_size`): `rollout/weights_bytes_per_chip`, the most bytes of the rollout's
        weights one device holds."""
        out = {} if self.rollout_mesh is None else {"async/publish_bytes": float(self.published_bytes)}
        if self.layout_mesh is not None:
            out["rollout/weights_bytes_per_chip"] = float(self.weights_bytes_per_chip)
        return out

    def publish_copy(self, rollout_params) -> None:
        """The rollout model samples with `rollout_params` (a restored copy; asynchronous training)."""
        nnx.update(self.model, rollout_params)

    def sampling_params(self, *, validate: bool, seed: int = 0):
        """`rollout.SamplingParams` of a training step (`rollout.*`) or of validation (`rollout.val_kwargs`)."""

        r = self.config.rollout
        src = r.val_kwargs if validate else r
        do_sample = bool(src.do_sample)
        return SamplingParams(
            max_new_tokens=int(self.config.data.max_response_length),
            temperature=float(src.temperature) if do_sample else 0.0,
            top_k=int(src.top_k),
            top_p=float(src.top_p),
            min_p=0.0 if validate else float(r.min_p),
            do_sample=do_sample,
            eos_token_ids=self.eos_token_ids,
            pad_token_id=self.pad_token_id,
            seed=int(seed),
            truncated_log_probs=bool(r.sampling_mask_replay) and not validate,
        )

    def generate_and_score(self, prompts, seed: int, timing: dict[str, float], reward_fn):
        """Generate `rollout.n` responses per prompt and score them with `reward_fn` (`RewardManager`).

        Returns `(b, nt, reward_output)`: `b` the host arrays of the batch (`[B, ...]`, B = prompts x n,
        with `token_level_scores [B, R]`, and `reward_baselines [B]`, the scores of one greedy response per
        prompt, when the estimator declares that input, as ReMax), `nt` its non-tensor batch.
        Raises RewardFunctionError (see `RewardManager.compute`).
        """
        n = int(self.config.rollout.n)
        local = self.process_local  # multi-process: `prompts` are this process's share
        engine = self.engine
        with timer("gen", timing):
            params = self.sampling_params(validate=False, seed=seed)
            out = engine.generate(prompts, params, process_local=local, n=n)  # interleaved; one prefill each
        self._count_engine_stats()
        return self.score_generated(prompts, out, timing, reward_fn)

    def score_generated(self, prompts, out, timing: dict[str, float], reward_fn):
        """The scoring half of `generate_and_score` on a generated batch `out` of `prompts` (asynchronous
        training scores a batch that partial rollout generated in several calls). Same returns and raises."""

        n = int(self.config.rollout.n)
        local = self.process_local
        engine = self.engine
        if self.agent_loop is not None:
            self._multi_turn_stats.append(dict(self.agent_loop.last_stats))
        b = {k: to_numpy(v) for k, v in out.batch.items()}
        if not self.config.rollout.sampling_mask_replay:  # the forwards score the full softmax
            b.pop("sampling_logit_threshold", None)
        with timer("reward", timing):
            res = score_everywhere(reward_fn, out, local)  # this process's rows only
        b["token_level_scores"] = np.asarray(res.token_level_scores, np.float32)
        if "reward_baselines" in adv_estimator_needs(self.config.algorithm.adv_estimator):
            with timer("gen_max", timing):
                greedy = engine.generate(prompts, self.sampling_params(validate=True), process_local=local)
                base = reward_fn.compute(greedy).token_level_scores.sum(-1)
                b["reward_baselines"] = np.repeat(np.asarray(base, np.float32), n)
        nt = dict(out.non_tensor_batch)
        if self.keep_rows:  # this process's rows; the reward metrics of all rows
            res = reduce_reward(res)
        elif local:  # every process continues with the same global batch
            b, nt, res = gather_rows(b), gather_rows(nt), gather_reward(res)
        return b, nt, res

    def collect(self, prompts, seed: int, timing: dict[str, float], reward_fn, rng, next_prompts):
        """One step's scored training batch: `(b, nt, reward_metrics, prompts, rng)` (one generation batch;
        `rng` and `prompts` returned unchanged, `next_prompts` unused: see `FilteredRollout.collect`)."""
        b, nt, res = self.generate_and_score(prompts, seed, timing, reward_fn)
        return b, nt, res.metrics, prompts, rng

    def multi_turn_metrics(self, nt, b) -> dict[str, float]:
        """The multi-turn metrics of a step's training batch (`agent_loop.rollout_metrics`: `num_turns/*`,
        `tool_calls/mean`, `response/observation_fraction`) with the tool error counts summed over the step's
        generation batches (`tool/errors`, `tool/format_errors`, `tool/timeouts`); {} when single-turn. Resets
        the counts."""
        if self.agent_loop is None:
            return {}

        stats = self._multi_turn_stats
        total = {k: sum(s.get(k, 0) for s in stats) for k in ("tool_errors", "tool_format_errors", "tool_timeouts")}
        self._multi_turn_stats = []
        batch = {k: b[k] for k in ("response_attention_mask", "loss_mask")}
        return rollout_metrics(DataProto(batch, {k: nt[k] for k in ("num_turns", "tool_calls")}), total)

    def _count_engine_stats(self) -> None:
        """Add the last generation call's paged-engine counts (`last_stats`; a multi-turn session's as the agent
        loop's `paged/*`) to the step's: prefix-cache tokens looked up and hit, preemptions, and (multi-turn) kept
        trajectories' pages evicted."""
        loop = self.agent_loop
        stats = (loop.last_stats if loop is not None else getattr(self.generator, "last_stats", None)) or {}
        for k in ENGINE_COUNTS:
            v = stats.get(k if loop is None else f"paged/{k}")
            if v is not None:
                self._engine_counts[k] = self._engine_counts.get(k, 0.0) + float(v)

    def engine_metrics(self) -> dict[str, float]:
        """The paged engine's counts over the step's generation batches that `generate_and_score` ran (partial
        rollout's resumed calls are not counted); {} without them (the dense engine); the prefix-cache keys only with
        prefix caching on. `rollout/prefix_cache_queries`
        (context tokens looked up in the prefix cache, vLLM's `prefix_cache_queries`), `rollout/prefix_cache_hits`
        (tokens not prefilled: pages shared by content), `rollout/prefix_cache_hit_rate` (hits / queries),
        `rollout/num_preemptions` (sequences preempted for pages, vLLM's `num_preemptions`) and, multi-turn,
        `rollout/num_evictions` (kept trajectories whose pages were evicted between turns: each re-prefills its
        context). Resets the counts."""
        c, self._engine_counts = self._engine_counts, {}
        out = {f"rollout/num_{k}": c[k] for k in ("preemptions", "evictions") if k in c}
        if c.get("prefix_cache_queries"):  # prefix caching on
            out.update({f"rollout/{k}": c.get(k, 0.0) for k in ("prefix_cache_queries", "prefix_cache_hits")})
            out["rollout/prefix_cache_hit_rate"] = c.get("prefix_cache_hits", 0.0) / c["prefix_cache_queries"]
        return out

    def close(self) -> None:
        """Stop the agent loop's tool workers (multi-turn)."""
        if self.agent_loop is not None:
            self.agent_loop.close()
