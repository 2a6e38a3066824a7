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

from jaxrl_post.trainer import builders, steps

_FWD_KEYS = ("input_ids", "attention_mask", "position_ids", "responses")


def to_numpy(x) -> np.ndarray:
    """A (possibly sharded) device array as one host numpy array."""
    return np.asarray(jax.device_get(x))


class RolesMixin:
    """Actor / reference / critic / advantage construction, jit helpers and rollout helpers of `RLTrainer`."""

    # ------------------------------------------------------------------------------------ construction
    def _build_actor(self) -> None:
        """Actor: params (one copy, shared with the rollout `Generator`), optimizer, jitted update and
        old-log-prob fns. With LoRA (`self.lora`) the trained params are the adapters; the frozen base
        weights (`actor_frozen`) are an argument of every jitted actor fn and the rollout runs with the
        adapters (its model holds the same buffers)."""
        from jaxrl_post.rollout import Generator

        cfg, a = self.config, self.config.actor
        self.generator = Generator(self.actor_model, mesh=self.mesh if self.n_devices > 1 else None)
        if self.lora is not None:
            graphdef, params, frozen, rest = steps.split_lora_model(self.actor_model)
            self.actor_frozen = self._commit(frozen)
            nnx.update(self.actor_model, self.actor_frozen)
        else:
            graphdef, params, rest = steps.split_model(self.actor_model)
            self.actor_frozen = None
        self.actor_graphdef, self.actor_rest = graphdef, rest
        self.actor_params = self._commit(params)
        nnx.update(self.actor_model, self.actor_params)  # one copy of the weights, shared with the rollout
        self.actor_optim_cfg = builders.optim_config(
            a.optim,
            grad_clip=a.grad_clip,
            total_training_steps=self.total_training_steps,
            updates_per_step=self.actor_updates_per_step,
        )
        self.actor_tx = steps.make_optimizer(self.actor_optim_cfg)
        self.actor_lr = steps.make_lr_schedule(self.actor_optim_cfg)
        self.actor_opt_state = self._commit(jax.jit(self.actor_tx.init)(self.actor_params))
        self.actor_loss_cfg = builders.actor_loss_config(cfg, self.on_policy)
        temperature = self.actor_loss_cfg.temperature
        self._actor_update = self._jit_update(
            steps.make_actor_update(
                graphdef,
                rest,
                self.actor_tx,
                self.actor_loss_cfg,
                n_micro=self.actor_mini // int(a.ppo_micro_batch_size),
                on_trace=self._tracer("update_actor"),
            ),
            self.actor_params,
            self.actor_opt_state,
        )
        self._old_log_prob = jax.jit(
            steps.make_log_prob_fn(
                graphdef,
                rest,
                micro_batch_size=int(cfg.rollout.log_prob_micro_batch_size),
                temperature=temperature,
                with_entropy=False,
                on_trace=self._tracer("old_log_prob"),
            )
        )

    def _build_reference(self) -> None:
        """Reference (only with a KL term): a frozen copy of the initial actor params and its log-prob fn; with
        LoRA no copy at all: the actor's own model with its adapters off (`ref_params` stays None)."""
        cfg = self.config
        self.ref_params = None
        if self.use_ref:
            if self.lora is None:
                self.ref_params = builders.copy_tree(self.actor_params)
            self._ref_log_prob = jax.jit(
                steps.make_log_prob_fn(
                    self.actor_graphdef,
                    self.actor_rest,
                    micro_batch_size=int(cfg.ref.log_prob_micro_batch_size),
                    temperature=self.actor_loss_cfg.temperature,
                    with_entropy=False,
                    adapters=self.lora is None,
                    on_trace=self._tracer("ref"),
                )
            )

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
            self.critic_opt_state = self._commit(jax.jit(self.critic_tx.init)(self.critic_params))
            self._critic_update = self._jit_update(
                steps.make_critic_update(
                    cg,
                    cr,
                    self.critic_tx,
                    steps.CriticLossConfig(float(c.cliprange_value), c.loss_agg_mode),
                    n_micro=self.critic_mini // int(c.ppo_micro_batch_size),
                    on_trace=self._tracer("update_critic"),
                ),
                self.critic_params,
                self.critic_opt_state,
            )
            self._values = jax.jit(
                steps.make_value_fn(
                    cg, cr, micro_batch_size=int(c.forward_micro_batch_size), on_trace=self._tracer("values")
                )
            )

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

    def _jit_update(self, fn, params, opt_state):
        """jit with donated params/opt state and their shardings pinned on the way out."""
        shard = lambda t: jax.tree.map(lambda x: x.sharding, t)
        return jax.jit(fn, donate_argnums=(0, 1), out_shardings=(shard(params), shard(opt_state), None))

    def _put(self, tree: dict[str, np.ndarray]) -> dict[str, jax.Array]:
        if self.n_devices > 1:
            from jaxrl_post.sharding import shard_batch

            return shard_batch(tree, self.mesh)
        return {k: jnp.asarray(v) for k, v in tree.items()}

    def _forward(self, fn, params, batch: dict[str, np.ndarray], micro: int, frozen=None):
        """Run a jitted forward over the whole [B, ...] batch (padded to a multiple of `micro`); `frozen`: a
        LoRA actor's base params."""
        arrays, pad = builders.pad_rows({k: batch[k] for k in _FWD_KEYS}, micro)
        out = fn(params, self._put(arrays)) if frozen is None else fn(params, self._put(arrays), frozen)
        out = jax.tree.map(lambda x: to_numpy(x)[: arrays["input_ids"].shape[0] - pad], out)
        return out

    def compile_counts(self) -> dict[str, int]:
        """Compiled executables per jitted function (1 each after any number of same-shaped steps)."""
        fns = {"update_actor": self._actor_update, "old_log_prob": self._old_log_prob, "adv": self._advantage}
        if self.use_ref:
            fns["ref"] = self._ref_log_prob
        if self.use_critic:
            fns.update(update_critic=self._critic_update, values=self._values)
        return {k: f._cache_size() for k, f in fns.items()}

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
        )

    def _sync_rollout_weights(self) -> None:
        nnx.update(self.actor_model, self.actor_params)

    def _next_seeds(self) -> tuple[int, int]:
        self.rng, k_gen, k_shuffle = jax.random.split(self.rng, 3)
        to_int = lambda k: int(jax.random.randint(k, (), 0, 2**31 - 1))
        return to_int(k_gen), to_int(k_shuffle)
