"""`RLTrainer`: verl's `RayPPOTrainer.fit()` dataflow as one host loop (the only impure orchestration).

Per training step (`train_step`):

    prompts -> generate rollout.n each, interleaved, one prefill per prompt           timing_s/gen
    -> reward (RewardManager; score on the last valid response token; with           timing_s/reward
       reward_model.enable the frozen reward model scores each trajectory first: rm_scores)
       [DAPO overlong shaping (reward_model.overlong_buffer) inside the RewardManager; DAPO dynamic sampling
       (algorithm.filter_groups, dynamic_sampling.py): drop groups whose metric does not vary, generate and
       score further prompt batches until data.train_batch_size groups are kept]
    -> old log-probs (skipped when exactly on-policy)                               timing_s/old_log_prob
    -> reference log-probs (only when a KL term is on)                              timing_s/ref
    -> teacher log-probs (on-policy distillation, teacher.py)                        timing_s/teacher
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

Where the code lives: construction of the roles (actor / reference / critic / advantage fn) and the jit
helpers in roles.py, the mini-batch update loops and step metrics in updates.py, state and checkpoints in
state.py, the validation loop in validation_loop.py; this module holds the host loop (`train_step`, `fit`).

Checkpointable state (see `state_dict`): actor/critic params and optimizer states, global step, update
counters, RNG key, KL controller, data iterator position, non-finite skip counters; the reference params
only as a pointer (they are the initial actor, rebuilt the same way); the distillation teacher not at all
(frozen, rebuilt from `distillation.teacher_models.teacher_model`). Checkpoints (`checkpoint.py`,
orbax, async) are written every `trainer.save_freq` steps and after the last one, into
`<trainer.default_local_dir>/checkpoints/global_step_<N>`; `trainer.resume_mode` picks what to resume
from when the trainer is built. Resuming is exact: the same steps give bit-identical params and metrics.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from jaxrl_post import core_algos, distributed
from jaxrl_post.models.lora import lora_config_of
from jaxrl_post.platform_defaults import log_resolved, resolve_config
from jaxrl_post.protocol import DataProto
from jaxrl_post.trainer import builders, loop, preflight, steps
from jaxrl_post.trainer import metrics as metrics_lib
from jaxrl_post.trainer.config_check import ConfigError, critic_enabled, kl_in_use, validate_config
from jaxrl_post.trainer.dynamic_sampling import RolloutMixin
from jaxrl_post.trainer.dynamic_sampling import timer as _timer
from jaxrl_post.trainer.loggers import config_to_dict
from jaxrl_post.trainer.nonfinite import NonFiniteGuard
from jaxrl_post.trainer.roles import RolesMixin
from jaxrl_post.trainer.roles import to_numpy as _np
from jaxrl_post.trainer.state import CheckpointMixin
from jaxrl_post.trainer.teacher import TeacherMixin, check_teacher_path, kl_to_teacher_metrics
from jaxrl_post.trainer.tracking import Tracking, console_legend
from jaxrl_post.trainer.updates import UpdatesMixin
from jaxrl_post.trainer.validation_loop import run_validation


class RLTrainer(RolesMixin, TeacherMixin, RolloutMixin, UpdatesMixin, CheckpointMixin):
    """PPO / GRPO / DAPO trainer driven by a job ConfigDict (configs/grpo.py, configs/ppo.py, configs/dapo.py).

    Args:
      config: the job ConfigDict (validated here, before anything is built).
      tracker: optional `Tracking` (default: console + jsonl in `trainer.default_local_dir`).
      console_write: optional callable for console lines (tests capture it).

    Raises:
      ConfigError: invalid config (names every bad key), before any model is loaded or compiled; also an
        unusable `trainer.default_local_dir` (`preflight.check_workdir`) or one another live run holds
        (`run_lock.RunDirBusyError`), a missing `model.path` (`preflight.check_model_path`), a
        data_source with no reward function (without `custom_reward_function.path`), and validation data
        that all occurs in the training data while validation is on (`builders.load_data_rows`), and a
        distillation teacher that does not exist (`teacher.check_teacher_path`), whose tokenizer differs from
        the student's or whose vocabulary is smaller (`teacher.build_teacher`).
      MalformedRowError: a malformed data row (file, row, problem), before the model is loaded.
      CheckpointError: the checkpoint to resume from cannot be read or does not match the config.
      OSError: an earlier run's `checkpoints/` or `metrics.jsonl` could not be moved aside (see
        `run_files.py`; nothing is deleted).
    """

    def __init__(self, config, *, tracker: Tracking | None = None, console_write: Callable[[str], None] | None = None):
        validate_config(config)  # accepts "auto"; errors come before any other line
        resolved = resolve_config(config, log_line=False)  # "auto" values by platform (platform_defaults.py)
        self.config = cfg = config
        self.workdir = cfg.trainer.default_local_dir
        self.trace_counts: dict[str, int] = {}

        # ---- pre-flight, before the (slow) model load: a writable working directory (created only once the
        # model, data loaders and reward function are built, so a failed start leaves no empty directory),
        # then the data rows (malformed rows, unknown data sources, ...)
        preflight.check_workdir(cfg)
        data_rows = builders.load_data_rows(cfg)
        preflight.check_model_path(cfg)  # a missing model: one line now, not a traceback from the loader
        check_teacher_path(cfg)  # the same for a distillation teacher

        log_resolved(resolved)  # after the run-directory / model-path checks (an error there stays one line)
        # ---- devices, model, tokenizer
        self.mesh = builders.build_mesh(cfg)
        self.actor_model, self.tokenizer = builders.build_actor_and_tokenizer(cfg, self.mesh)
        self.lora = lora_config_of(self.actor_model)  # None: full fine-tuning
        self.eos_token_ids, self.pad_token_id = builders.eos_and_pad(self.tokenizer)
        self.use_critic = critic_enabled(cfg)
        self.use_ref = kl_in_use(cfg)
        self.n_devices = jax.device_count()

        # ---- data, rewards
        self.train_loader, self.val_loader, self.data_stats = builders.build_dataloaders(
            cfg, data_rows, self.tokenizer, self.pad_token_id
        )
        # multi-process: each process loads only its share of every global prompt batch (distributed.py)
        try:
            self.process_local = distributed.shard_loader(self.train_loader, self.mesh, int(cfg.rollout.n))
        except ValueError as e:  # shares that are not whole prompt groups, a tensor axis across processes
            raise ConfigError(str(e)) from e
        self.rm_scorer = builders.build_rm_scorer(cfg, self.mesh, self.tokenizer)  # None without reward_model.enable
        self.reward_fn = builders.build_reward_manager(
            cfg, self.tokenizer, data_rows.custom_reward_fn, rm_scorer=self.rm_scorer
        )
        self.total_training_steps = int(
            cfg.trainer.total_training_steps or cfg.trainer.total_epochs * len(self.train_loader)
        )

        # ---- batch geometry
        self.batch_size = int(cfg.data.train_batch_size) * int(cfg.rollout.n)  # responses per step
        self.response_length = int(cfg.data.max_response_length)
        a = cfg.actor
        self.actor_mini = int(a.ppo_mini_batch_size) * int(cfg.rollout.n)  # responses (verl counts prompts)
        self.actor_updates_per_step = int(a.ppo_epochs) * (self.batch_size // self.actor_mini)
        rc = cfg.algorithm.rollout_correction
        self.use_rollout_corr = rc.rollout_is is not None or rc.rollout_rs is not None  # needs old log-probs
        self.on_policy = (
            int(a.ppo_epochs) == 1
            and self.actor_mini == self.batch_size
            and not cfg.algorithm.use_kl_in_reward
            and not self.use_rollout_corr
        )

        # ---- roles: actor (params / optimizer / jitted fns), reference (only with a KL term), critic (PPO)
        self._build_actor()
        self._build_reference()
        self._build_teacher()  # on-policy distillation (distillation.enabled), else nothing
        self._build_critic()

        # ---- algorithm state
        self._build_advantage()
        k = cfg.algorithm.kl_ctrl
        self.kl_ctrl = core_algos.get_kl_controller(k.type, k.kl_coef, k.target_kl, k.horizon)
        self.rng = jax.random.key(int(cfg.trainer.seed))
        self.global_steps = 0
        self.actor_update_count = 0
        self.critic_update_count = 0
        self.peak_flops = metrics_lib.device_peak_flops(override=cfg.trainer.device_peak_flops)
        self._say = console_write or (lambda line: print(line, flush=True))
        os.makedirs(self.workdir, exist_ok=True)
        if not distributed.is_main():  # process 0 alone prints, logs and writes metrics files
            self._say, tracker = (lambda line: None), tracker or distributed.NullTracker()
        self.tracker = tracker or Tracking(
            self.workdir,
            cfg.trainer.logger,
            int(cfg.trainer.print_every),
            console_write=console_write,
            project=cfg.trainer.project_name,
            experiment=cfg.trainer.experiment_name,
            config=config_to_dict(cfg),
        )
        # ---- non-finite update guards, checkpoints, resume
        max_nf = int(cfg.trainer.max_consecutive_nonfinite)
        self.actor_guard = NonFiniteGuard(max_nf, "actor")
        self.critic_guard = NonFiniteGuard(max_nf, "critic")
        self.ref_is_initial = True  # the reference never changes here: saved as a pointer, not as params
        self._open_run_dir()  # checkpoints, resume, metrics.jsonl, config.json + config.yaml

    # ------------------------------------------------------------------------------------ one step
    def train_step(self, prompts: DataProto, next_prompts: Callable[[], DataProto] | None = None) -> dict[str, float]:
        """Runs one PPO/GRPO iteration on a batch of `data.train_batch_size` prompts; returns its metrics.

        With `algorithm.filter_groups.enable` (DAPO dynamic sampling), further prompt batches come from
        `next_prompts()` (default: the training loader) until `data.train_batch_size` groups are kept
        (dynamic_sampling.py); raises `FilterGroupsError` after `max_num_gen_batches` generation batches.
        """
        cfg = self.config
        timing: dict[str, float] = {}
        gen_seed, shuffle_seed = self._next_seeds()
        metrics: dict[str, float] = {}
        with _timer("step", timing):
            # -- rollout + reward (+ dynamic sampling: more generation batches until enough groups vary)
            if cfg.algorithm.filter_groups.enable:
                more = next_prompts or (lambda: next(self.train_loader))
                b, nt, reward_metrics, prompts = self._collect_filtered_batch(prompts, gen_seed, timing, more)
            else:
                b, nt, res = self._generate_and_score(prompts, gen_seed, timing)
                reward_metrics = res.metrics
            metrics.update(reward_metrics)
            metrics.update(self.multi_turn_metrics(nt, b))
            baselines = b.get("reward_baselines")

            # b["loss_mask"]: the model's own tokens (rollout); train_mask: the tokens the updates train (minus
            # dropped truncated responses and rejected tokens; advantages keep the rollout's loss_mask)
            train_mask = _np(steps.compute_loss_mask(b["loss_mask"], b["truncated"], bool(cfg.actor.drop_truncated)))
            if cfg.actor.drop_truncated:
                metrics["actor/num_dropped_truncated"] = float(np.sum(b["truncated"]))

            # -- old / reference log-probs, values
            if not self.on_policy:
                with _timer("old_log_prob", timing):
                    micro = int(cfg.rollout.log_prob_micro_batch_size)
                    b["old_log_probs"] = self._forward(
                        self._old_log_prob, self.actor_params, b, micro, self.old_log_prob_spec, self.actor_frozen
                    )[0]
            if self.use_ref:
                with _timer("ref", timing):
                    # LoRA: the actor's model with the adapters off (ref_params None)
                    ref = self.actor_params if self.ref_params is None else self.ref_params
                    micro = int(cfg.ref.log_prob_micro_batch_size)
                    b["ref_log_prob"] = self._forward(
                        self._ref_log_prob, ref, b, micro, self.ref_spec, self.actor_frozen
                    )[0]
            if self.teacher_params is not None:
                with _timer("teacher", timing):
                    b.update(self._teacher_forward(b))
                student = b["old_log_probs"] if "old_log_probs" in b else b["rollout_log_probs"]
                loss_mode = cfg.distillation.distillation_loss.loss_mode
                metrics.update(kl_to_teacher_metrics(student, b["teacher_log_prob"], train_mask, loss_mode))
            if self.use_critic:
                with _timer("values", timing):
                    b["values"] = self._forward(
                        self._values, self.critic_params, b, int(cfg.critic.forward_micro_batch_size), self.values_spec
                    )

            if self.use_rollout_corr:  # IS weights / rejection mask from log(pi_old / pi_rollout), whole batch
                train_mask, corr_metrics = self._rollout_correction(b, train_mask)
                metrics.update(corr_metrics)

            # -- KL in reward, advantages
            with _timer("adv", timing):
                _, index = np.unique(np.asarray(nt["uid"]), return_inverse=True)
                rewards, current_kl, adv, ret = self._advantage(
                    b["token_level_scores"],
                    b["loss_mask"],
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
                    metrics.update(self._update_critic(b, train_mask, rng))
            if self.global_steps >= int(cfg.trainer.critic_warmup):
                with _timer("update_actor", timing):
                    metrics.update(self._update_actor(b, train_mask, rng))
                self.sync_weights()

        self.global_steps += 1
        metrics.update(self._step_metrics(b, timing, prompts))
        return metrics

    # ------------------------------------------------------------------------------------ validation
    def validate(self) -> dict[str, float]:
        """Generate on the held-out set with `rollout.val_kwargs` (greedy n=1 by default) and score it.

        Returns verl's validation metrics (`validation.process_validation_metrics`:
        `val-core/{data_source}/reward/mean@{n}`, best@k / maj@k / pass@k when n > 1; `acc` becomes the core
        variable when the reward function reports it), `val-aux/{data_source}/response_length/mean`,
        `val-aux/{data_source}/num_samples`, `timing_s/testing`. Shows a progress bar (prompts done) when
        `trainer.progress_bar` (process 0). Multi-process: each process generates and scores only its rows
        of every held-out batch; the results are gathered once, so every process returns the same metrics.

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
        sampling_params = self.sampling_params(validate=True, seed=int(self.config.trainer.seed))
        local = bool(getattr(self, "process_local", False))  # multi-process: each process scores its rows
        engine = self.agent_loop if self.agent_loop is not None else self.generator  # multi-turn: the agent loop
        val = self.val_loader
        return run_validation(self.config, val, engine, self.reward_fn, sampling_params, process_local=local)

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

        `val_before` is the validation before the first step; a resumed run does not validate before training
        again (its params are not the base model's) but returns the original run's step-0 validation (saved
        in the checkpoint, `host['val_before']`, or read from metrics.jsonl; None when neither has it).

        Returns `{"val_before": metrics | None, "val_after": metrics | None, "last": last step metrics,
        "history": list of per-step metrics, "stopped_at": step | None}` (`stopped_at`: the step a stop
        request ended the loop after, its checkpoint started; `close()` waits for it).

        Raises:
          NonFiniteError: `trainer.max_consecutive_nonfinite` skipped updates in a row (no checkpoint of
            that step is written). CheckpointError: a checkpoint could not be written.
          FilterGroupsError: dynamic sampling (`algorithm.filter_groups`) reached `max_num_gen_batches`;
            handled as a RewardFunctionError in the reward stage (below).
          RewardFunctionError: a reward function failed (`RewardManager.compute`). Raised after the last
            completed step N was checkpointed (unless saved already or N == 0) and one line printed: in the
            reward stage of step N+1 the RNG and data position are first put back to their values before
            that step, so resuming repeats exactly the run that would have happened; in the validation
            after step N, that step's metrics are logged first (see state.py).
        """
        return loop.fit(self, max_steps, stop=stop)

    # ---- the hooks of the shared loop (trainer/loop.py)
    def has_validation(self) -> bool:
        return self.val_loader is not None

    def on_fit_start(self) -> None:
        if "console" in getattr(self.tracker, "backends", {}):
            self._say(console_legend())  # once per run: what score | reward | ... on each step line mean
        warn = preflight.critic_warmup_warning(int(self.config.trainer.critic_warmup), self.total_training_steps)
        if warn:
            self._say(warn)
        self.tracker.log(self.data_stats, step=self.global_steps)

    def run_step(self) -> dict[str, float]:
        with self.save_on_error_in_step():  # a reward failure: step N saved, then re-raised
            return self.train_step(next(self.train_loader))

    def validation_guard(self, metrics):
        return self.save_on_error_in_validation(metrics)  # the step is logged and saved, then re-raised

    @staticmethod
    def progress_postfix(metrics) -> dict[str, str]:
        return {"score": f"{metrics.get('critic/score/mean', float('nan')):.3f}"}

    def close(self) -> None:
        """Wait for a pending checkpoint save (raises `CheckpointError` if it failed), then release loggers,
        reward workers and the run directory's lock (`run_lock.py`)."""
        try:
            self.checkpointer.close()
        finally:
            self.tracker.close()
            self.reward_fn.close()
            if getattr(self, "agent_loop", None) is not None:
                self.agent_loop.close()
            if getattr(self, "run_lock", None) is not None:
                self.run_lock.release()  # the directory is free for the next run


def summarize(result: dict[str, Any]) -> str:
    """Before/after validation numbers of a `fit()` result, as JSON text."""
    keep = lambda m: {k: v for k, v in (m or {}).items() if k.startswith(("val-", "val/"))}
    return json.dumps(
        {"val_before": keep(result.get("val_before")), "val_after": keep(result.get("val_after"))}, indent=1
    )
