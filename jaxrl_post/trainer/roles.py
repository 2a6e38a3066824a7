"""Construction of `RLTrainer`'s roles (actor, reference, critic, advantage fn) and the helpers that call them.

`RolesMixin` is mixed into `RLTrainer` (trainer.py). Each `_build_*` sets one role's attributes on the
trainer: params committed to their shardings, optimizer and LR schedule, and its jitted fns, each built
once here and compiled once per run: `forward` (`steps.make_log_prob_fn` / `make_value_fn`) and `update`
(`steps.make_actor_update` / `make_critic_update`, params and optimizer state donated). Every jitted fn
counts its traces in `trainer.trace_counts` (`compile_counts()` reads the compiled executables).
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxrl_post import platform_defaults
from jaxrl_post.batch_keys import FORWARD_KEYS, TOKEN_KEYS
from jaxrl_post.sharding import init_opt_state
from jaxrl_post.trainer import builders, packed_steps, packing, steps
from jaxrl_post.trainer.config_check import dynamic_bsz


def to_numpy(x) -> np.ndarray:
    """A (possibly sharded, possibly multi-process) device array as one host numpy array (every process)."""
    from jaxrl_post.distributed import to_host

    return to_host(x)


class RolesMixin:
    """Actor / reference / critic / advantage construction, jit helpers and rollout helpers of `RLTrainer`."""

    # ------------------------------------------------------------------------------------ construction
    def _build_actor(self) -> None:
        """Actor: params (master weights in `model.param_dtype`), optimizer, jitted update and old-log-prob
        fns; the rollout `Generator` on the actor itself or on a copy in `rollout.dtype` (`sync_weights`).
        With LoRA (`self.lora`) the trained params are the adapters; the frozen base weights (`actor_frozen`)
        are an argument of every jitted actor fn (padded and packed), and the rollout runs with the adapters
        (on the actor's own buffers) or on a copy holding the merged kernels."""
        cfg, a = self.config, self.config.actor
        if self.lora is not None:
            graphdef, params, frozen, rest = steps.split_lora_model(self.actor_model)
            self.actor_frozen = self._commit(frozen)
            nnx.update(self.actor_model, self.actor_frozen)
        else:
            graphdef, params, rest = steps.split_model(self.actor_model)
            self.actor_frozen = None
        self.actor_graphdef, self.actor_rest = graphdef, rest
        self.actor_params = self._commit(params)
        nnx.update(self.actor_model, self.actor_params)
        self._build_rollout()
        self.actor_optim_cfg = builders.optim_config(
            a.optim,
            grad_clip=a.grad_clip,
            total_training_steps=self.total_training_steps,
            updates_per_step=self.actor_updates_per_step,
        )
        self.actor_tx = steps.make_optimizer(self.actor_optim_cfg)
        self.actor_lr = steps.make_lr_schedule(self.actor_optim_cfg)
        self.actor_opt_state = self._commit(init_opt_state(self.actor_tx, self.actor_params, self._opt_mesh()))
        self.actor_loss_cfg = builders.actor_loss_config(cfg, self.on_policy)
        self.actor_spec = self._pack_spec("actor", self.actor_mini, int(a.ppo_micro_batch_size))
        self.old_log_prob_spec = self._pack_spec("rollout", self.batch_size, int(cfg.rollout.log_prob_micro_batch_size))
        if self.actor_spec is not None:
            update = packed_steps.make_packed_actor_update(
                graphdef, rest, self.actor_tx, self.actor_loss_cfg, on_trace=self._tracer("update_actor")
            )
        else:
            update = steps.make_actor_update(
                graphdef,
                rest,
                self.actor_tx,
                self.actor_loss_cfg,
                n_micro=self.actor_mini // int(a.ppo_micro_batch_size),
                on_trace=self._tracer("update_actor"),
            )
        self._actor_update = self._jit_update(update, self.actor_params, self.actor_opt_state)
        self._old_log_prob = jax.jit(
            self._log_prob_fn(self.old_log_prob_spec, int(cfg.rollout.log_prob_micro_batch_size), "old_log_prob")
        )

    def _log_prob_fn(self, spec, micro: int, name: str, adapters: bool = True):
        """Old / reference log-prob fn (not jitted): packed when `spec`, else padded micro-batches;
        `adapters=False`: a LoRA actor with its adapters off (the reference)."""
        kw = dict(temperature=self.actor_loss_cfg.temperature, with_entropy=False, adapters=adapters)
        g, r = self.actor_graphdef, self.actor_rest
        if spec is not None:
            return packed_steps.make_packed_log_prob_fn(g, r, **kw, on_trace=self._tracer(name))
        return steps.make_log_prob_fn(g, r, micro_batch_size=micro, **kw, on_trace=self._tracer(name))

    def _pack_spec(self, role: str, n_seqs: int, micro: int) -> packing.PackSpec | None:
        """Static packing geometry of one pass (None when `model.use_remove_padding` is off); see
        `packing.micro_geometry` for how `*.use_dynamic_bsz` / `*_max_token_len_per_gpu` map to rows. Shared
        prompts (`model.pack_shared_prompts`) only when `rollout.n > 1` and attention is not splash."""
        cfg = self.config
        if not cfg.model.use_remove_padding:
            return None
        p, r = int(cfg.data.max_prompt_length), self.response_length
        dyn, max_tok = dynamic_bsz(cfg, role)
        dp = int(np.prod([self.mesh.shape[a] for a in ("data", "fsdp") if a in self.mesh.shape]))
        rows, row_len = packing.micro_geometry(
            micro_batch_size=micro,
            use_dynamic_bsz=dyn,
            max_token_len_per_gpu=max_tok,
            seq_len=p + r,
            seqs_per_row=int(cfg.model.seqs_per_packed_row),
            dp=dp,
            n_seqs=n_seqs,
        )
        share = bool(cfg.model.pack_shared_prompts) and int(cfg.rollout.n) > 1  # only samples of a prompt repeat it
        share = share and self.actor_model.attention_impl != "splash"  # splash: equal segment ids only (logged)
        return packing.make_pack_spec(n_seqs, rows, p, r, row_len=row_len, share_prompts=share)

    def _build_reference(self) -> None:
        """Reference (only with a KL term, `config_check.kl_in_use`; else nothing is built): a frozen copy of
        the initial actor params in the compute dtype (`builders.reference_params`: it never trains; same
        log-probs bitwise) and its log-prob fn; with LoRA no copy at all: the actor's own model with its
        adapters off (`ref_params` stays None)."""
        cfg = self.config
        self.ref_params = None
        if self.use_ref:
            if self.lora is None:
                self.ref_params = builders.reference_params(self.actor_params, self.actor_model.dtype)
            micro = int(cfg.ref.log_prob_micro_batch_size)
            self.ref_spec = self._pack_spec("ref", self.batch_size, micro)
            self._ref_log_prob = jax.jit(self._log_prob_fn(self.ref_spec, micro, "ref", adapters=self.lora is None))

    def _build_critic(self) -> None:
        """Critic (PPO only): value model initialised from the actor, optimizer, jitted update and value fns."""
        cfg = self.config
        self.critic_params = self.critic_opt_state = None
        if self.use_critic:
            from jaxrl_post.models import CriticModel

            c = cfg.critic
            critic = CriticModel.from_actor(self.actor_model, nnx.Rngs(int(cfg.trainer.seed) + 1))
            cg, cp, cr = steps.split_model(critic)
            if self.n_devices > 1:
                from jaxrl_post.sharding import shard_params

                cp = shard_params(cp, self.mesh)
            self.critic_graphdef, self.critic_rest = cg, cr
            self.critic_params = self._commit(builders.copy_tree(cp))  # own buffers: actor params are donated
            del critic, cp
            self.critic_mini = int(c.ppo_mini_batch_size) * int(cfg.rollout.n)  # responses per critic update
            self.critic_optim_cfg = builders.optim_config(
                c.optim,
                grad_clip=c.grad_clip,
                total_training_steps=self.total_training_steps,
                updates_per_step=int(c.ppo_epochs) * (self.batch_size // self.critic_mini),
            )
            self.critic_tx = steps.make_optimizer(self.critic_optim_cfg)
            self.critic_lr = steps.make_lr_schedule(self.critic_optim_cfg)
            self.critic_opt_state = self._commit(init_opt_state(self.critic_tx, self.critic_params, self._opt_mesh()))
            loss_cfg = steps.CriticLossConfig(float(c.cliprange_value), c.loss_agg_mode)
            self.critic_spec = self._pack_spec("critic", self.critic_mini, int(c.ppo_micro_batch_size))
            self.values_spec = self._pack_spec("values", self.batch_size, int(c.forward_micro_batch_size))
            if self.critic_spec is not None:
                update = packed_steps.make_packed_critic_update(
                    cg, cr, self.critic_tx, loss_cfg, on_trace=self._tracer("update_critic")
                )
                values = packed_steps.make_packed_value_fn(cg, cr, on_trace=self._tracer("values"))
            else:
                update = steps.make_critic_update(
                    cg,
                    cr,
                    self.critic_tx,
                    loss_cfg,
                    n_micro=self.critic_mini // int(c.ppo_micro_batch_size),
                    on_trace=self._tracer("update_critic"),
                )
                values = steps.make_value_fn(
                    cg, cr, micro_batch_size=int(c.forward_micro_batch_size), on_trace=self._tracer("values")
                )
            self._critic_update = self._jit_update(update, self.critic_params, self.critic_opt_state)
            self._values = jax.jit(values)

    def _build_advantage(self) -> None:
        """Jitted KL-in-reward + advantage estimator (`algorithm.*`)."""
        al = self.config.algorithm
        self._advantage = jax.jit(
            steps.make_advantage_fn(
                adv_estimator=al.adv_estimator,
                gamma=float(al.gamma),
                lam=float(al.lam),
                norm_adv_by_std_in_grpo=bool(al.norm_adv_by_std_in_grpo),
                use_kl_in_reward=bool(al.use_kl_in_reward),
                kl_penalty=al.kl_penalty,
                on_trace=self._tracer("adv"),
            )
        )

    # ------------------------------------------------------------------------------------ jit helpers
    def _tracer(self, name: str) -> Callable[[], None]:
        def on_trace():
            self.trace_counts[name] = self.trace_counts.get(name, 0) + 1

        return on_trace

    def _commit(self, tree):
        """Commit every leaf to its sharding, so jit sees the same argument signature on every call
        (outputs of the donated update are committed; fresh arrays may not be -> a second compile).
        Leaves living on a single device (e.g. optimizer step counts) are replicated over the mesh."""
        from jax.sharding import NamedSharding, PartitionSpec

        replicated = NamedSharding(self.mesh, PartitionSpec())

        def one(x):
            if isinstance(x.sharding, NamedSharding) or self.n_devices == 1:
                return jax.device_put(x, x.sharding)
            return jax.device_put(x, replicated)

        return jax.tree.map(one, tree)

    def _opt_mesh(self):
        """The mesh optimizer states are sharded over like their params (None on one device)."""
        return self.mesh if self.n_devices > 1 else None

    def _jit_update(self, fn, params, opt_state):
        """jit with donated params/opt state and their shardings pinned on the way out."""
        from jaxrl_post.sharding import InMesh

        shard = lambda t: jax.tree.map(lambda x: x.sharding, t)
        jitted = jax.jit(fn, donate_argnums=(0, 1), out_shardings=(shard(params), shard(opt_state), None))
        return InMesh(jitted, self.mesh if self.n_devices > 1 else None)  # activation constraints take effect

    def _put(self, tree: dict[str, np.ndarray]) -> dict[str, jax.Array]:
        if self.n_devices > 1:
            from jaxrl_post.sharding import shard_batch

            return shard_batch(tree, self.mesh)
        return {k: jnp.asarray(v) for k, v in tree.items()}

    def _put_packed(self, tree: dict[str, np.ndarray]) -> dict[str, jax.Array]:
        """Place a packed mini-batch: packed rows `[n, rows, L]` split over ('data', 'fsdp') on the rows dim,
        the small packing plan (`[n, Q]`, `[n, S, ...]`) replicated, `[M, ...]` fields as `_put`."""
        if self.n_devices == 1:
            return {k: jnp.asarray(v) for k, v in tree.items()}
        from jax.sharding import NamedSharding, PartitionSpec

        from jaxrl_post.sharding import LOGICAL_AXIS_RULES

        rows = NamedSharding(self.mesh, PartitionSpec(None, LOGICAL_AXIS_RULES["batch"], None))
        plan = NamedSharding(self.mesh, PartitionSpec())
        out = self._put({k: v for k, v in tree.items() if k not in packed_steps.PACK_KEYS})
        for k in packed_steps.PACK_KEYS:
            sharding = rows if k in ("input_ids", "segment_ids", "positions") else plan
            out[k] = jax.device_put(tree[k], sharding)
        return out

    def _pack(self, mb: dict[str, np.ndarray], spec: packing.PackSpec) -> dict[str, np.ndarray]:
        """`[M, ...]` host mini-batch -> the packed step's input: packing plan + the `[M, R]` fields."""
        packed = packing.pack_batch(mb, spec)
        rest = {k: v for k, v in mb.items() if k not in TOKEN_KEYS}
        return dict(rest, **packed)

    def _forward(
        self, fn, params, batch: dict[str, np.ndarray], micro: int, spec: packing.PackSpec | None = None, frozen=None
    ):
        """Run a jitted forward over the whole [B, ...] batch: packed with `spec`, else padded to a multiple
        of `micro` rows (under the mesh, so activation constraints take effect). `frozen`: a LoRA actor's base
        params (the fn's trailing argument)."""
        from jaxrl_post.sharding import InMesh

        fn = InMesh(fn, self.mesh if self.n_devices > 1 else None)
        extra = () if frozen is None else (frozen,)
        if spec is not None:
            packed = self._put_packed(self._pack({k: batch[k] for k in FORWARD_KEYS if k in batch}, spec))
            return jax.tree.map(to_numpy, fn(params, packed, *extra))
        arrays, pad = builders.pad_rows({k: batch[k] for k in FORWARD_KEYS if k in batch}, micro)
        out = fn(params, self._put(arrays), *extra)
        out = jax.tree.map(lambda x: to_numpy(x)[: arrays["input_ids"].shape[0] - pad], out)
        return out

    def compile_counts(self) -> dict[str, int]:
        """Compiled executables per jitted function (1 each after any number of same-shaped steps)."""
        fns = {"update_actor": self._actor_update, "old_log_prob": self._old_log_prob, "adv": self._advantage}
        if self.use_ref:
            fns["ref"] = self._ref_log_prob
        if self.teacher_params is not None:
            fns["teacher"] = self._teacher_log_prob
        if self.use_critic:
            fns.update(update_critic=self._critic_update, values=self._values)
        out = {k: f._cache_size() for k, f in fns.items()}
        if getattr(self, "rm_scorer", None) is not None:
            out["rm"] = self.rm_scorer.compile_count()
        return out

    # ------------------------------------------------------------------------------------ rollout
    def sampling_params(self, *, validate: bool, seed: int = 0):
        from jaxrl_post.rollout import SamplingParams

        r = self.config.rollout
        src = r.val_kwargs if validate else r
        do_sample = bool(src.do_sample)
        return SamplingParams(
            max_new_tokens=self.response_length,
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

    def _build_rollout(self) -> None:
        """The rollout model: the actor itself when `rollout.dtype` (None = `model.dtype`) equals both the
        compute and the param dtype (one copy of the weights; a LoRA actor samples with its adapters), else an
        abstract model with weights and compute in `rollout.dtype`, filled by `sync_weights` (verl: the
        rollout engine's own weights). A LoRA actor's copy has no adapters: it holds the merged kernels
        `W + (alpha / r) A . B` (`models.lora.merged_state`)."""
        from jaxrl_post.models.hf_io import empty_model
        from jaxrl_post.models.lora import merged_state
        from jaxrl_post.rollout import Generator

        cfg = self.config
        rdt = jnp.dtype(cfg.rollout.dtype or platform_defaults.resolve("model.dtype", cfg.model.dtype))
        m = self.actor_model
        self.rollout_params = None
        self.rollout_copy = not (rdt == m.dtype == m.param_dtype)
        if self.rollout_copy:
            self.rollout_model = empty_model(m.config, dtype=rdt, param_dtype=rdt)
            cast = lambda p: jax.tree.map(lambda x: x.astype(rdt), p)
            if self.lora is not None:  # fn(adapters, frozen base) -> merged params, shardings of the base
                g, r = self.actor_graphdef, self.actor_rest
                to_rollout = lambda p, f: cast(merged_state(nnx.merge(g, p, f, r)))
                out = jax.tree.map(lambda x: x.sharding, self.actor_frozen) if self.n_devices > 1 else None
            else:
                to_rollout, out = (lambda p, f: cast(p)), None
            self._cast_first = jax.jit(to_rollout, out_shardings=out)
            self._cast_donating = jax.jit(lambda p, f, old: to_rollout(p, f), donate_argnums=(2,), out_shardings=out)
        else:
            self.rollout_model = m
        self.generator = Generator(
            self.rollout_model,
            mesh=self.mesh if self.n_devices > 1 else None,
            cache_segment_len=platform_defaults.cache_segment_len(),  # one segment off CPU (no per-segment cond)
        )
        self.agent_loop = builders.build_agent_loop(cfg, self.generator, self.tokenizer)  # None: single-turn
        self._multi_turn_stats = []
        self.sync_weights()

    def sync_weights(self) -> None:
        """The one place where actor and rollout meet, after every actor update and restore: the rollout
        model gets the current actor params -- shared buffers when dtypes agree, else cast to `rollout.dtype`
        by one jitted program (shardings kept; the previous rollout copy is donated to it; LoRA: the adapters
        merged into the frozen base kernels first)."""
        nnx.update(self.actor_model, self.actor_params)  # the actor module always holds the live params
        if not self.rollout_copy:
            return
        if self.rollout_params is None:
            self.rollout_params = self._cast_first(self.actor_params, self.actor_frozen)
        else:
            self.rollout_params = self._cast_donating(self.actor_params, self.actor_frozen, self.rollout_params)
        nnx.update(self.rollout_model, self.rollout_params)

    def _next_seeds(self) -> tuple[int, int]:
        self.rng, k_gen, k_shuffle = jax.random.split(self.rng, 3)
        to_int = lambda k: int(jax.random.randint(k, (), 0, 2**31 - 1))
        return to_int(k_gen), to_int(k_shuffle)
