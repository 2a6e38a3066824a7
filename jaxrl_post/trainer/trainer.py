"""`RLTrainer`: verl's `RayPPOTrainer.fit()` dataflow as one host loop (the only impure orchestration).

Per training step (`train_step`):

    prompts -> repeat(rollout.n, interleave) -> generate (rollout.Generator)        timing_s/gen
    -> reward (RewardManager; score on the last valid response token)               timing_s/reward
    -> old log-probs (skipped when exactly on-policy)                               timing_s/old_log_prob
    -> reference log-probs (only when a KL term is on)                              timing_s/ref
    -> critic values (PPO)                                                           timing_s/values
    -> KL penalty in reward (fixed/adaptive controller) -> advantages                timing_s/adv
    -> critic update (epochs x mini-batches)                                         timing_s/update_critic
    -> actor update (after critic_warmup; epochs x shuffled mini-batches)            timing_s/update_actor
    -> metrics (verl names) -> console + metrics.jsonl

Jit boundaries (each built once here, compiled once per run): rollout's prefill/decode, `forward`
(`steps.make_log_prob_fn` / `make_value_fn`) and `update` (`steps.make_actor_update` / `make_critic_update`,
params and optimizer state donated).

"Exactly on-policy" (verl: `on_policy` in the actor): `actor.ppo_epochs == 1`, one mini-batch per step and
no KL-in-reward. Then the old log-probs equal the current ones, so the update uses
`stop_gradient(log_prob)` as old log-probs (ratio == 1) and the separate forward pass is skipped.

Checkpointable state (see `state_dict`): actor/critic params and optimizer states, global step, update
counters, RNG key, KL controller, data iterator position, non-finite skip counters; the reference params
only as a pointer (they are the initial actor, rebuilt the same way). Checkpoints (`checkpoint.py`,
orbax, async) are written every `trainer.save_freq` steps and after the last one, into
`<trainer.default_local_dir>/checkpoints/global_step_<N>`; `trainer.resume_mode` picks what to resume
from when the trainer is built. Resuming is exact: the same steps give bit-identical params and metrics.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxrl_post import core_algos
from jaxrl_post.protocol import DataProto
from jaxrl_post.trainer import builders, steps
from jaxrl_post.trainer import checkpoint as ckpt
from jaxrl_post.trainer import metrics as metrics_lib
from jaxrl_post.trainer.config_check import critic_enabled, kl_in_use, validate_config
from jaxrl_post.trainer.loggers import config_to_dict, save_run_config
from jaxrl_post.trainer.nonfinite import NonFiniteGuard
from jaxrl_post.trainer.progress import progress_bar
from jaxrl_post.trainer.run_files import is_lead_process, move_aside_old_checkpoints, prepare_metrics_file, sync
from jaxrl_post.trainer.tracking import Tracking

_FWD_KEYS = ("input_ids", "attention_mask", "position_ids", "responses")


@contextlib.contextmanager
def _timer(name: str, timing: dict[str, float]):
    t0 = time.perf_counter()
    yield
    timing[name] = timing.get(name, 0.0) + time.perf_counter() - t0


def _np(x) -> np.ndarray:
    return np.asarray(jax.device_get(x))


class RLTrainer:
    """PPO / GRPO trainer driven by a job ConfigDict (configs/grpo.py, configs/ppo.py).

    Args:
      config: the job ConfigDict (validated here, before anything is built).
      tracker: optional `Tracking` (default: console + jsonl in `trainer.default_local_dir`).
      console_write: optional callable for console lines (tests capture it).

    Raises:
      ConfigError: invalid config (names every bad key), before any model is loaded or compiled; also a
        data_source with no reward function (without `custom_reward_function.path`), and validation data
        that all occurs in the training data while validation is on (`builders.load_data_rows`).
      MalformedRowError: a malformed data row (file, row, problem), before the model is loaded.
      CheckpointError: the checkpoint to resume from cannot be read or does not match the config.
      OSError: an earlier run's `checkpoints/` or `metrics.jsonl` could not be moved aside (see
        `run_files.py`; nothing is deleted).
    """

    def __init__(self, config, *, tracker: Tracking | None = None, console_write: Callable[[str], None] | None = None):
        validate_config(config)
        self.config = cfg = config
        self.workdir = cfg.trainer.default_local_dir
        os.makedirs(self.workdir, exist_ok=True)
        self.trace_counts: dict[str, int] = {}

        # ---- data rows first: malformed rows, unknown data sources, ... fail before the (slow) model load
        data_rows = builders.load_data_rows(cfg)

        # ---- devices, model, tokenizer
        self.mesh = builders.build_mesh(cfg)
        self.actor_model, self.tokenizer = builders.build_actor_and_tokenizer(cfg, self.mesh)
        self.eos_token_ids, self.pad_token_id = builders.eos_and_pad(self.tokenizer)
        self.use_critic = critic_enabled(cfg)
        self.use_ref = kl_in_use(cfg)
        self.n_devices = jax.device_count()

        # ---- data, rewards
        self.train_loader, self.val_loader, self.data_stats = builders.build_dataloaders(
            cfg, data_rows, self.tokenizer, self.pad_token_id
        )
        self.reward_fn = builders.build_reward_manager(cfg, self.tokenizer)
        self.total_training_steps = int(
            cfg.trainer.total_training_steps or cfg.trainer.total_epochs * len(self.train_loader)
        )

        # ---- batch geometry
        self.batch_size = int(cfg.data.train_batch_size) * int(cfg.rollout.n)  # responses per step
        self.response_length = int(cfg.data.max_response_length)
        a = cfg.actor
        self.actor_mini = int(a.ppo_mini_batch_size) * int(cfg.rollout.n)  # responses (verl counts prompts)
        self.actor_updates_per_step = int(a.ppo_epochs) * (self.batch_size // self.actor_mini)
        self.on_policy = (
            int(a.ppo_epochs) == 1 and self.actor_mini == self.batch_size and not cfg.algorithm.use_kl_in_reward
        )

        # ---- actor: params / optimizer / jitted fns
        from jaxrl_post.rollout import Generator

        self.generator = Generator(self.actor_model, mesh=self.mesh if self.n_devices > 1 else None)
        graphdef, params, rest = steps.split_model(self.actor_model)
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

        # ---- reference: frozen copy of the initial actor params (only with a KL term)
        self.ref_params = None
        if self.use_ref:
            self.ref_params = builders.copy_tree(self.actor_params)
            self._ref_log_prob = jax.jit(
                steps.make_log_prob_fn(
                    graphdef,
                    rest,
                    micro_batch_size=int(cfg.ref.log_prob_micro_batch_size),
                    temperature=temperature,
                    with_entropy=False,
                    on_trace=self._tracer("ref"),
                )
            )

        # ---- critic
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

        # ---- algorithm state
        al = cfg.algorithm
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
        k = cfg.algorithm.kl_ctrl
        self.kl_ctrl = core_algos.get_kl_controller(k.type, k.kl_coef, k.target_kl, k.horizon)
        self.rng = jax.random.key(int(cfg.trainer.seed))
        self.global_steps = 0
        self.actor_update_count = 0
        self.critic_update_count = 0
        self.peak_flops = metrics_lib.device_peak_flops(override=cfg.trainer.device_peak_flops)
        self._say = console_write or (lambda line: print(line, flush=True))
        self.tracker = tracker or Tracking(
            self.workdir,
            cfg.trainer.logger,
            int(cfg.trainer.print_every),
            console_write=console_write,
            project=cfg.trainer.project_name,
            experiment=cfg.trainer.experiment_name,
            config=config_to_dict(cfg),
        )
        save_run_config(cfg, self.workdir)  # config.json + config.yaml

        # ---- non-finite update guards, checkpoints, resume
        max_nf = int(cfg.trainer.max_consecutive_nonfinite)
        self.actor_guard = NonFiniteGuard(max_nf, "actor")
        self.critic_guard = NonFiniteGuard(max_nf, "critic")
        self.ref_is_initial = True  # the reference never changes here: saved as a pointer, not as params
        self.resumed_from: str | None = None
        found = ckpt.find_resume_checkpoint(cfg.trainer.resume_mode, self.workdir, cfg.trainer.resume_from_path)
        own_root = ckpt.checkpoint_dir(self.workdir)
        steps_on_disk = ckpt.list_complete_steps(own_root)
        notice = move_aside_old_checkpoints(own_root, found and found[0], steps_on_disk) if is_lead_process() else None
        sync("checkpoints")
        if notice:
            self._say(notice)
        self.checkpointer = ckpt.Checkpointer(
            own_root, max_to_keep=cfg.trainer.max_actor_ckpt_to_keep, async_save=bool(cfg.trainer.async_save)
        )
        if found is not None:
            self.load_checkpoint(*found)
        # metrics.jsonl holds this run only: an earlier run's file is moved aside, a resumed one truncated
        resumed_step = self.global_steps if found is not None else None
        notice = prepare_metrics_file(self.workdir, resumed_step) if is_lead_process() else None
        sync("metrics")
        if notice:
            self._say(notice)

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

    def _forward(self, fn, params, batch: dict[str, np.ndarray], micro: int):
        """Run a jitted forward over the whole [B, ...] batch (padded to a multiple of `micro`)."""
        arrays, pad = builders.pad_rows({k: batch[k] for k in _FWD_KEYS}, micro)
        out = fn(params, self._put(arrays))
        out = jax.tree.map(lambda x: _np(x)[: arrays["input_ids"].shape[0] - pad], out)
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

    # ------------------------------------------------------------------------------------ one step
    def train_step(self, prompts: DataProto) -> dict[str, float]:
        """Runs one PPO/GRPO iteration on a batch of `data.train_batch_size` prompts; returns its metrics."""
        cfg = self.config
        timing: dict[str, float] = {}
        gen_seed, shuffle_seed = self._next_seeds()
        metrics: dict[str, float] = {}
        with _timer("step", timing):
            # -- rollout
            with _timer("gen", timing):
                batch = prompts.repeat(int(cfg.rollout.n), interleave=True)
                out = self.generator.generate(batch, self.sampling_params(validate=False, seed=gen_seed))
            b = {k: _np(v) for k, v in out.batch.items()}
            nt = out.non_tensor_batch

            # -- reward
            with _timer("reward", timing):
                scores, reward_metrics = self.reward_fn(out)
            b["token_level_scores"] = np.asarray(scores, np.float32)
            metrics.update(reward_metrics)
            baselines = None
            if cfg.algorithm.adv_estimator == "remax":
                with _timer("gen_max", timing):
                    greedy = self.generator.generate(prompts, self.sampling_params(validate=True))
                    base_scores, _ = self.reward_fn(greedy)
                    baselines = np.repeat(np.asarray(base_scores).sum(-1), int(cfg.rollout.n))

            b["loss_mask"] = _np(
                steps.compute_loss_mask(b["response_mask"], b["truncated"], bool(cfg.actor.drop_truncated))
            )
            if cfg.actor.drop_truncated:
                metrics["actor/num_dropped_truncated"] = float(np.sum(b["truncated"]))

            # -- old / reference log-probs, values
            if not self.on_policy:
                with _timer("old_log_prob", timing):
                    b["old_log_probs"] = self._forward(
                        self._old_log_prob, self.actor_params, b, int(cfg.rollout.log_prob_micro_batch_size)
                    )[0]
            if self.use_ref:
                with _timer("ref", timing):
                    b["ref_log_prob"] = self._forward(
                        self._ref_log_prob, self.ref_params, b, int(cfg.ref.log_prob_micro_batch_size)
                    )[0]
            if self.use_critic:
                with _timer("values", timing):
                    b["values"] = self._forward(
                        self._values, self.critic_params, b, int(cfg.critic.forward_micro_batch_size)
                    )

            # -- KL in reward, advantages
            with _timer("adv", timing):
                _, index = np.unique(np.asarray(nt["uid"]), return_inverse=True)
                rewards, current_kl, adv, ret = self._advantage(
                    b["token_level_scores"],
                    b["response_mask"],
                    index.astype(np.int32).reshape(-1),
                    np.float32(self.kl_ctrl.value),
                    b.get("old_log_probs"),
                    b.get("ref_log_prob"),
                    b.get("values"),
                    None if baselines is None else np.asarray(baselines, np.float32),
                )
                b["token_level_rewards"], b["advantages"], b["returns"] = _np(rewards), _np(adv), _np(ret)
                if cfg.algorithm.use_kl_in_reward:
                    metrics["actor/reward_kl_penalty"] = float(current_kl)
                    metrics["actor/reward_kl_penalty_coeff"] = float(self.kl_ctrl.value)
                    self.kl_ctrl.update(float(current_kl), n_steps=self.batch_size)  # responses, as verl

            # -- updates
            rng = np.random.default_rng(shuffle_seed)
            if self.use_critic:
                with _timer("update_critic", timing):
                    metrics.update(self._update_critic(b, rng))
            if self.global_steps >= int(cfg.trainer.critic_warmup):
                with _timer("update_actor", timing):
                    metrics.update(self._update_actor(b, rng))
                self._sync_rollout_weights()

        self.global_steps += 1
        metrics.update(self._step_metrics(b, timing, prompts))
        return metrics

    def _minibatches(self, n_rows: int, mini: int, epochs: int, shuffle: bool, rng: np.random.Generator):
        for _ in range(epochs):
            perm = rng.permutation(n_rows) if shuffle else np.arange(n_rows)
            for i in range(0, n_rows, mini):
                yield perm[i : i + mini]

    def _update_actor(self, b: dict[str, np.ndarray], rng) -> dict[str, float]:
        a = self.config.actor
        keys = ["input_ids", "attention_mask", "position_ids", "responses", "advantages", "rollout_log_probs"]
        keys += [] if self.on_policy else ["old_log_probs"]
        keys += ["ref_log_prob"] if a.use_kl_loss else []
        out = []
        for idx in self._minibatches(self.batch_size, self.actor_mini, int(a.ppo_epochs), bool(a.shuffle), rng):
            mb = {k: b[k][idx] for k in keys}
            mb["response_mask"] = b["loss_mask"][idx]
            lr = float(self.actor_lr(self.actor_update_count))
            self.actor_params, self.actor_opt_state, m = self._actor_update(
                self.actor_params, self.actor_opt_state, self._put(mb)
            )
            self.actor_update_count += 1
            out.append(dict(m, lr=lr))
        out = [jax.device_get(m) for m in out]
        guard = self.actor_guard.observe([m["update_skipped"] for m in out], step=self.global_steps + 1)
        red = metrics_lib.reduce_metrics(out)
        res = {f"actor/{k}": v for k, v in red.items() if k not in ("rollout_probs_diff_mean", "loss")}
        res.update(guard)
        if "rollout_probs_diff_mean" in red:
            res["training/rollout_probs_diff_mean"] = red["rollout_probs_diff_mean"]
        if a.use_kl_loss:
            res["actor/kl_coef"] = float(a.kl_loss_coef)
        return res

    def _update_critic(self, b: dict[str, np.ndarray], rng) -> dict[str, float]:
        c = self.config.critic
        keys = ["input_ids", "attention_mask", "position_ids", "responses", "values", "returns"]
        out = []
        for idx in self._minibatches(self.batch_size, self.critic_mini, int(c.ppo_epochs), bool(c.shuffle), rng):
            mb = {k: b[k][idx] for k in keys}
            mb["response_mask"] = b["loss_mask"][idx]
            lr = float(self.critic_lr(self.critic_update_count))
            self.critic_params, self.critic_opt_state, m = self._critic_update(
                self.critic_params, self.critic_opt_state, self._put(mb)
            )
            self.critic_update_count += 1
            out.append(dict(m, lr=lr))
        out = [jax.device_get(m) for m in out]
        guard = self.critic_guard.observe([m["update_skipped"] for m in out], step=self.global_steps + 1)
        red = metrics_lib.reduce_metrics(out)
        return dict({f"critic/{k}": v for k, v in red.items()}, **guard)

    def _step_metrics(self, b, timing, prompts: DataProto) -> dict[str, float]:
        cfg = self.config
        m = metrics_lib.compute_data_metrics(
            b,
            use_critic=self.use_critic,
            max_prompt_length=int(cfg.data.max_prompt_length),
            max_response_length=self.response_length,
        )
        n_prompt_tok = int(b["attention_mask"][:, : -self.response_length].sum())
        n_resp_tok = int(b["response_mask"].sum())
        m.update(metrics_lib.compute_timing_metrics(timing, n_prompt_tok, n_resp_tok))
        m.update(metrics_lib.compute_throughput_metrics(n_prompt_tok + n_resp_tok, timing["step"], self.n_devices))
        if "update_actor" in timing:
            seq_lens = b["attention_mask"].sum(-1)
            m["perf/mfu/actor"] = metrics_lib.compute_mfu(
                self.actor_model.config,
                seq_lens,
                int(cfg.actor.ppo_epochs),
                timing["update_actor"],
                self.n_devices,
                self.peak_flops,
            )
        m["training/global_step"] = float(self.global_steps)
        m["training/epoch"] = float(prompts.meta_info.get("epoch", 0))
        return m

    # ------------------------------------------------------------------------------------ validation
    def validate(self) -> dict[str, float]:
        """Generate on the held-out set with `rollout.val_kwargs` (greedy n=1 by default) and score it.

        Returns verl's validation metrics (`validation.process_validation_metrics`:
        `val-core/{data_source}/reward/mean@{n}`, best@k / maj@k / pass@k when n > 1; `acc` becomes the core
        variable when the reward function reports it), `val-aux/{data_source}/response_length/mean`,
        `val-aux/{data_source}/num_samples`, `timing_s/testing`. Shows a progress bar (prompts done) when
        `trainer.progress_bar`.

        Raises:
          ValueError: `data.val_files` is set but every prompt in it also occurs in the training data (the
            set was dropped because validation was off). RewardFunctionError: see `RewardManager.compute`.
        """
        if self.val_loader is None:
            if self.config.data.val_files:  # dropped by builders.load_data_rows (validation was off)
                raise ValueError(
                    "validate(): no validation set: every prompt of config.data.val_files also occurs in "
                    "config.data.train_files (allowed only while validation is off)"
                )
            return {}
        t0 = time.perf_counter()
        n = int(self.config.rollout.val_kwargs.n)
        params = self.sampling_params(validate=True, seed=int(self.config.trainer.seed))
        sources, scores, lengths, uids, preds = [], [], [], [], []
        extras: dict[str, list[np.ndarray]] = {}
        bs = self.val_loader.batch_size
        bar_kw = dict(total=self.val_loader.num_prompts, desc="validation", unit="prompt", leave=False)
        with progress_bar(bool(self.config.trainer.progress_bar), **bar_kw) as bar:
            for i, batch in enumerate(iter(self.val_loader)):
                if n > 1:
                    batch = batch.repeat(n, interleave=True)
                batch, pad = batch.pad_to_divisor(bs * n)  # fixed generate shape: one compile for every batch
                out = self.generator.generate(batch, params)
                out = out.unpad(pad) if pad else out
                res = self.reward_fn.compute(out)
                if n > 1:  # extracted final answers, for majority voting (maj@k)
                    from jaxrl_post.trainer.validation import extract_answer

                    texts, _ = self.reward_fn.decode_responses(out)
                    nt = out.non_tensor_batch
                    infos = nt["extra_info"] if "extra_info" in nt else [None] * len(texts)
                    preds += [
                        extract_answer(str(d), t, e if isinstance(e, dict) else None)
                        for d, t, e in zip(nt["data_source"], texts, infos)
                    ]
                scores.append(np.asarray(res.scores, np.float64))
                lengths.append(np.asarray(out.batch["response_mask"]).sum(-1))
                sources.append(np.asarray(out.non_tensor_batch["data_source"]))
                uids.append(np.asarray([f"{i}/{u}" for u in out.non_tensor_batch["uid"]]))
                for k, v in res.extra_infos.items():
                    if np.asarray(v).dtype.kind == "f":
                        extras.setdefault(k, []).append(np.asarray(v, np.float64))
                bar.update(len(res.scores) // n)
        scores, lengths = np.concatenate(scores), np.concatenate(lengths)
        sources, uids = np.concatenate(sources), np.concatenate(uids)
        from jaxrl_post.trainer.validation import process_validation_metrics

        infos = {"reward": scores}
        for k, v in extras.items():
            v = np.concatenate(v)
            if k != "reward" and v.size == scores.size:  # keys reported by every batch
                infos[k] = v
        out_m = process_validation_metrics(sources, uids, infos, preds if n > 1 else None)
        for ds in np.unique(sources):
            sel = sources == ds
            out_m[f"val-aux/{ds}/response_length/mean"] = float(lengths[sel].mean())
            out_m[f"val-aux/{ds}/num_samples"] = float(sel.sum())
        out_m["timing_s/testing"] = time.perf_counter() - t0
        return out_m

    # ------------------------------------------------------------------------------------ loop
    def fit(self, max_steps: int | None = None, *, stop=None) -> dict[str, Any]:
        """Train until `total_training_steps` (validating before/after as configured), checkpointing every
        `trainer.save_freq` steps and after the last step.

        Args:
          max_steps: stop after this many steps of this call even if training is not finished (a later
            trainer resumes from the last checkpoint; used to test exact resume).
          stop: optional `interrupt.GracefulStop` (anything with `defer()` and `requested`). After each
            completed step `stop.defer()` is called; when `stop.requested`, the loop checkpoints the step
            (even with `save_freq=-1`; a `test_freq` validation of that step is skipped, the final one is
            not: metrics are logged before the checkpoint, so a resumed run never misses a step's line)
            and returns early.

        Returns `{"val_before": metrics | None, "val_after": metrics | None, "last": last step metrics,
        "history": list of per-step metrics, "stopped_at": step | None}` (`stopped_at`: the step a stop
        request ended the loop after, its checkpoint started; `close()` waits for it).

        Raises:
          NonFiniteError: `trainer.max_consecutive_nonfinite` skipped updates in a row (no checkpoint of
            that step is written). CheckpointError: a checkpoint could not be written.
        """
        cfg = self.config
        result: dict[str, Any] = {"val_before": None, "val_after": None, "last": {}, "history": [], "stopped_at": None}
        if self.global_steps >= self.total_training_steps:
            self._say(
                f"training already finished at step {self.global_steps} of {self.total_training_steps}; to start "
                "over, pass --config.trainer.resume_mode=disable (the old run is moved aside)"
            )
            return result
        stop_at = (
            self.total_training_steps
            if max_steps is None
            else min(self.total_training_steps, self.global_steps + int(max_steps))
        )
        save_freq = int(cfg.trainer.save_freq)
        self.tracker.log(self.data_stats, step=self.global_steps)
        if cfg.trainer.val_before_train and self.val_loader is not None:
            result["val_before"] = self.validate()
            self.tracker.log(result["val_before"], step=self.global_steps)
        bar = None
        if cfg.trainer.progress_bar:
            from tqdm.auto import tqdm

            bar = tqdm(total=self.total_training_steps, initial=self.global_steps, desc="training", unit="step")
        try:
            while self.global_steps < stop_at:
                prompts = next(self.train_loader)
                m = self.train_step(prompts)
                if stop is not None:
                    stop.defer()  # a completed step exists: a signal now waits for the checkpoint below
                last = self.global_steps >= self.total_training_steps
                freq = int(cfg.trainer.test_freq)
                stopping = stop is not None and stop.requested  # a stop skips the mid-run validation
                if self.val_loader is not None and (
                    (last and cfg.trainer.val_at_end) or (freq > 0 and self.global_steps % freq == 0 and not stopping)
                ):
                    v = self.validate()
                    m.update(v)
                    if last:
                        result["val_after"] = v
                self.tracker.log(m, step=self.global_steps)
                result["history"].append(m)
                result["last"] = m
                if save_freq > 0 and (self.global_steps % save_freq == 0 or last):
                    self.save_checkpoint()
                if stop is not None and stop.requested:
                    self.save_checkpoint()  # no-op when this step was just saved
                    result["stopped_at"] = self.global_steps
                self.checkpointer.check_for_errors()  # a failed background save stops the run here
                if bar is not None:
                    bar.update(1)
                    bar.set_postfix(score=f"{m.get('critic/score/mean', float('nan')):.3f}")
                if result["stopped_at"] is not None:
                    break
        finally:
            if bar is not None:
                bar.close()
        return result

    def close(self) -> None:
        """Wait for a pending checkpoint save (raises `CheckpointError` if it failed), then release loggers
        and reward workers."""
        try:
            self.checkpointer.close()
        finally:
            self.tracker.close()
            self.reward_fn.close()

    # ------------------------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """Everything needed to resume exactly (pytrees of arrays + JSON-able host state; see checkpoint.py).

        The reference params are included only when they differ from the initial actor (never in this
        trainer); otherwise `host['reference']` points at how they are rebuilt.
        """
        cfg = self.config
        ref_saved = self.use_ref and not self.ref_is_initial
        return {
            "actor": {"params": self.actor_params, "opt_state": self.actor_opt_state},
            "critic": ({"params": self.critic_params, "opt_state": self.critic_opt_state} if self.use_critic else None),
            "ref": {"params": self.ref_params} if ref_saved else None,
            "rng": jax.random.key_data(self.rng),
            "host": {
                "global_steps": self.global_steps,
                "actor_update_count": self.actor_update_count,
                "critic_update_count": self.critic_update_count,
                "kl_ctrl": self.kl_ctrl.state_dict(),
                "data_iter": self.train_loader.get_state(),
                "nonfinite": {"actor": self.actor_guard.state_dict(), "critic": self.critic_guard.state_dict()},
                "reference": (
                    None
                    if not self.use_ref
                    else "saved"
                    if ref_saved
                    else ckpt.reference_pointer(
                        model_path=None if cfg.model.random_init else cfg.model.path,
                        random_init=bool(cfg.model.random_init),
                        seed=int(cfg.trainer.seed),
                    )
                ),
                "model": ckpt.model_metadata(self.actor_model.config, cfg.model.tokenizer_path or cfg.model.path),
                "total_training_steps": self.total_training_steps,
            },
        }

    def save_checkpoint(self) -> bool:
        """Start an (async) checkpoint of the current state as step `global_steps`; False if one exists."""
        return self.checkpointer.save(self.global_steps, self.state_dict())

    def _open_checkpoint_dir(self, root: str) -> ckpt.Checkpointer:
        if os.path.abspath(root) == self.checkpointer.directory:
            return self.checkpointer
        return ckpt.Checkpointer(root, read_only=True)

    def load_checkpoint(self, root: str, step: int) -> None:
        """Restore the full training state of `<root>/global_step_<step>` into this trainer (arrays go
        straight to the current shardings)."""
        c = self._open_checkpoint_dir(root)
        items = set(c.read_host(step).get("items", []))
        like = {k: v for k, v in self.state_dict().items() if k != "host"}
        if self.use_ref and "ref.params" in items:
            like["ref"] = {"params": self.ref_params}
        self.load_state_dict(c.restore(step, like=like))
        self.resumed_from = c.step_path(step)
        self._say(f"resumed from step {self.global_steps} of {self.total_training_steps} ({self.resumed_from})")

    def load_actor_params_from(self, root: str, step: int) -> None:
        """Load only the actor params of a checkpoint (evaluation / export); optimizer state untouched."""
        c = self._open_checkpoint_dir(root)
        got = c.restore(step, like={"actor": {"params": self.actor_params}})
        self.actor_params = jax.tree.map(
            lambda n, l: jax.device_put(n, l.sharding), got["actor"]["params"], self.actor_params
        )
        self._sync_rollout_weights()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Inverse of `state_dict` (arrays are placed like the current ones)."""
        place = lambda new, like: jax.tree.map(lambda n, l: jax.device_put(n, l.sharding), new, like)
        self.actor_params = place(state["actor"]["params"], self.actor_params)
        self.actor_opt_state = place(state["actor"]["opt_state"], self.actor_opt_state)
        if self.use_critic and state.get("critic") is not None:
            self.critic_params = place(state["critic"]["params"], self.critic_params)
            self.critic_opt_state = place(state["critic"]["opt_state"], self.critic_opt_state)
        self.rng = jax.random.wrap_key_data(jnp.asarray(state["rng"]))
        host = state["host"]
        self.global_steps = int(host["global_steps"])
        self.actor_update_count = int(host["actor_update_count"])
        self.critic_update_count = int(host["critic_update_count"])
        self.kl_ctrl.load_state_dict(host["kl_ctrl"])
        self.train_loader.set_state(host["data_iter"])
        nonfinite = host.get("nonfinite") or {}
        self.actor_guard.load_state_dict(nonfinite.get("actor", {}))
        self.critic_guard.load_state_dict(nonfinite.get("critic", {}))
        if state.get("ref") is not None and self.use_ref:
            self.ref_params = place(state["ref"]["params"], self.ref_params)
        self._sync_rollout_weights()


def summarize(result: dict[str, Any]) -> str:
    """Before/after validation numbers of a `fit()` result, as JSON text."""
    keep = lambda m: {k: v for k, v in (m or {}).items() if k.startswith("val-")}
    return json.dumps(
        {"val_before": keep(result.get("val_before")), "val_after": keep(result.get("val_after"))}, indent=1
    )
