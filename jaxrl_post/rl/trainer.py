"""`RLTrainer`: verl's `RayPPOTrainer.fit()` dataflow as one host loop (the only impure orchestration).

Per training step (`train_step`, the body in `step.py`), each stage a named timer (`timing_s/<stage>`): gen
(rollout.n responses per prompt) -> reward (the reward manager; DAPO's overlong shaping and dynamic sampling,
`dynamic_sampling.py`) -> old_log_prob (skipped when exactly on-policy) -> ref (a KL term on) -> teacher (on-policy
distillation) -> values (PPO) -> adv (KL in reward, the estimator: `advantage_fn.py`) -> update_critic ->
update_actor (after `critic_warmup`) -> metrics (verl's names) -> console + metrics.jsonl. docs/architecture.md
follows one step file by file.

"Exactly on-policy" (verl: `on_policy` in the actor): `actor.ppo_epochs == 1`, one mini-batch per step and
no KL-in-reward. Then the old log-probs equal the current ones, so the update uses
`stop_gradient(log_prob)` as old log-probs (ratio == 1) and the separate forward pass is skipped.

The trainer composes role objects (roles/), one device pytree `TrainState` and one `HostState`
(engine/train_state.py), a `Placement` (engine/placement.py) and a `RunDir` (engine/run/run_dir.py: lock,
checkpoints, resume, saves after an error); the update loops are functions in updates.py, the validation loop in
validation_loop.py. Checkpoints (see `state_dict`, `trainer_checkpoint.py`) hold actor/critic params and
optimizer states, counters, the RNG key, the KL controller, the data position and the non-finite counters (the
reference as a pointer, the teacher not at all); resuming is exact: the same steps give bit-identical params and
metrics.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable
from typing import Any

import jax

from jaxrl_post.algos import core_algos
from jaxrl_post.algos.config_checks import critic_enabled
from jaxrl_post.batch.protocol import DataProto
from jaxrl_post.engine import loop
from jaxrl_post.engine.nonfinite import NonFiniteGuard
from jaxrl_post.engine.placement import Placement
from jaxrl_post.engine.run.run_dir import RunDir
from jaxrl_post.engine.run.run_files import config_to_dict
from jaxrl_post.engine.run.tracking import Tracking
from jaxrl_post.engine.train_state import HostState, TrainState
from jaxrl_post.errors import ConfigError
from jaxrl_post.rl import (
    advantage_fn,
    builders,
    config_features,
    data_rows,
    preflight,
    reward_builders,
    step,
    trainer_checkpoint,
)
from jaxrl_post.rl import metrics as metrics_lib
from jaxrl_post.rl.async_training import AsyncSettings, async_mode
from jaxrl_post.rl.async_training.producer import AsyncRollout
from jaxrl_post.rl.config_check import kl_in_use, validate_config
from jaxrl_post.rl.dynamic_sampling import FilteredRollout
from jaxrl_post.rl.geometry import StepGeometry
from jaxrl_post.rl.roles import CriticRole, PolicyRole, ReferencePolicy, RolloutRole, TeacherRole
from jaxrl_post.rl.roles.teacher import check_teacher_path
from jaxrl_post.rl.validation_loop import run_validation
from jaxrl_post.runtime import distributed
from jaxrl_post.runtime.platform_defaults import log_resolved, resolve_config


@dataclasses.dataclass
class RunData:
    """The run's prompt data: `train_loader` (endless, resumable: `get_state` / `set_state`), `val_loader`
    (None without validation) and `stats` (the `data/*` numbers logged at the start)."""

    train_loader: Any
    val_loader: Any
    stats: dict[str, float]


class RLTrainer:
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
        that all occurs in the training data while validation is on (`data_rows.load_data_rows`), and a
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

        # ---- pre-flight, before the (slow) model load: a writable working directory (created only once the
        # model, data loaders and reward function are built, so a failed start leaves no empty directory),
        # then the data rows (malformed rows, unknown data sources, ...)
        preflight.check_workdir(cfg)
        rows = data_rows.load_data_rows(cfg)
        preflight.check_model_path(cfg)  # a missing model: one line now, not a traceback from the loader
        check_teacher_path(cfg)  # the same for a distillation teacher

        log_resolved(resolved)  # after the run-directory / model-path checks (an error there stays one line)
        # ---- devices, model, tokenizer
        train_mesh, rollout_mesh = builders.build_meshes(cfg)  # rollout_mesh: split placement, else None
        split = {} if rollout_mesh is None else {"n_devices": train_mesh.size, "sharded": True}
        self.placement = Placement(train_mesh, **split)
        mesh = self.placement.mesh
        actor_model, self.tokenizer = builders.build_actor_and_tokenizer(cfg, mesh)
        eos_token_ids, pad_token_id = builders.eos_and_pad(self.tokenizer)

        # ---- data, rewards
        train_loader, val_loader, data_stats = data_rows.build_dataloaders(cfg, rows, self.tokenizer, pad_token_id)
        self.data = RunData(train_loader, val_loader, data_stats)
        # multi-process: each process loads only its share of every global prompt batch (distributed.py)
        try:
            process_local = distributed.shard_loader(train_loader, mesh, int(cfg.rollout.n))
        except ValueError as e:  # shares that are not whole prompt groups, a tensor axis across processes
            raise ConfigError(str(e)) from e
        rm_scorer = reward_builders.build_rm_scorer(cfg, mesh, self.tokenizer)  # None without reward_model.enable
        self.reward_fn = reward_builders.build_reward_manager(
            cfg, self.tokenizer, rows.custom_reward_fn, rm_scorer=rm_scorer
        )
        peak_flops = metrics_lib.device_peak_flops(override=cfg.trainer.device_peak_flops)
        self.geometry = g = StepGeometry.from_config(cfg, len(train_loader), peak_flops)

        # ---- roles: the policy (params / optimizer / jitted fns), the rollout (sampling on the policy's
        # params or on a copy), the reference (only with a KL term), the teacher (on-policy distillation),
        # the critic (PPO); the arrays they train are `self.state`
        self.policy, actor = PolicyRole.build(cfg, actor_model, self.placement, g)
        is_async = async_mode(cfg) != "sync"  # the rollout's own weights, published every k steps (docs/async.md)
        args = (cfg, self.policy, self.placement, self.tokenizer, eos_token_ids, pad_token_id, process_local)
        rollout = RolloutRole(*args, is_async, rollout_mesh=rollout_mesh)
        self.rollout = FilteredRollout(cfg, rollout) if cfg.algorithm.filter_groups.enable else rollout
        if is_async:  # the producer and its queue, around the rollout (it filters groups itself: filtering.py)
            self.rollout = AsyncRollout(AsyncSettings.from_config(cfg), rollout)
            self.rollout.data_position = (train_loader.get_state, train_loader.set_state)
        self.reference = ReferencePolicy(cfg, self.policy, actor.params) if kl_in_use(cfg) else None
        self.teacher = TeacherRole.build(cfg, self.policy, self.placement, self.tokenizer)  # None: no distillation
        self.critic, critic = (None, None)
        if critic_enabled(cfg):
            self.critic, critic = CriticRole.build(cfg, self.policy, self.placement, g)
        self.advantage = advantage_fn.build_advantage_fn(cfg, self.placement)

        # ---- state: one device pytree, one host dataclass (train_state.py)
        self.state = TrainState(actor=actor, critic=critic, rollout=None, rng=jax.random.key(int(cfg.trainer.seed)))
        self.sync_weights(step=0)
        k, max_nf = cfg.algorithm.kl_ctrl, int(cfg.trainer.max_consecutive_nonfinite)
        self.host = HostState(
            kl_ctrl=core_algos.get_kl_controller(k.type, k.kl_coef, k.target_kl, k.horizon),
            actor_guard=NonFiniteGuard(max_nf, "actor"),
            critic_guard=NonFiniteGuard(max_nf, "critic"),
        )

        # ---- run directory: console, trackers, checkpoints, resume, metrics.jsonl, config.json + config.yaml
        say = console_write or (lambda line: print(line, flush=True))
        workdir = cfg.trainer.default_local_dir
        os.makedirs(workdir, exist_ok=True)
        if not distributed.is_main():  # process 0 alone prints, logs and writes metrics files
            say, tracker = (lambda line: None), tracker or distributed.NullTracker()
        tracker = tracker or Tracking(
            workdir,
            cfg.trainer.logger,
            int(cfg.trainer.print_every),
            console_write=console_write,
            project=cfg.trainer.project_name,
            experiment=cfg.trainer.experiment_name,
            config=config_to_dict(cfg),
        )
        self.run = RunDir(cfg, say, tracker)
        self.run.open(self)  # lock, resume (`load_checkpoint`), metrics.jsonl, config files

    # ---- what the shared loop (loop.py), main.py and evaluate.py read
    global_steps = property(lambda self: self.host.global_steps, doc="Completed training steps.")
    total_training_steps = property(lambda self: self.geometry.total_training_steps)
    tracker = property(lambda self: self.run.tracker)
    checkpointer = property(lambda self: self.run.checkpointer)
    resumed_from = property(lambda self: self.run.resumed_from)

    @property
    def async_rollout(self) -> AsyncRollout | None:
        """The asynchronous producer and queue (`async_training.mode` other than 'sync'), else None."""
        return self.rollout if isinstance(self.rollout, AsyncRollout) else None

    @property
    def val_before_metrics(self) -> dict[str, float] | None:
        """The run's validation before training (kept on resume: `host['val_before']`)."""
        return self.host.val_before

    @val_before_metrics.setter
    def val_before_metrics(self, value) -> None:
        self.host.val_before = value

    def _say(self, line: str) -> None:
        self.run.say(line)

    # ------------------------------------------------------------------------------------ one step
    def train_step(self, prompts: DataProto, next_prompts: Callable[[], DataProto] | None = None) -> dict[str, float]:
        """One PPO/GRPO iteration on a batch of `data.train_batch_size` prompts; returns its metrics (`step.train_step`:
        the stages, DAPO's further batches from `next_prompts`, `FilterGroupsError`). A step that fails waits for the
        asynchronous producer's background job first (`AsyncRollout.settle`): nothing runs behind the error."""
        try:
            return step.train_step(self, prompts, next_prompts)
        except BaseException:
            if self.async_rollout is not None:
                self.async_rollout.settle()
            raise

    def sync_weights(self, step: int | None = None, timing: dict[str, float] | None = None) -> dict[str, float]:
        """The actor's module and the rollout get the current actor params (`RolloutRole.sync`): after every
        actor update and restore. `step`: training steps the params have done; asynchronous training publishes
        them to the rollout only every `async_training.trigger_parameter_sync_step` steps (None: publish).

        Returns `RolloutRole.publish_metrics` ({} colocated); split placement: `timing['sync_rollout_weights']`."""
        ar = self.async_rollout  # a failed background job owes its generation first (trainer_checkpoint.py)
        publish = ar is None or ((step is None or ar.settings.publishes_after(step)) and ar.owed is None)
        new = self.rollout.sync(self.state.actor.params, self.state.rollout, publish=publish, timing=timing)
        self.state = self.state.replace(rollout=new)
        if ar is not None and publish:
            ar.publish(self.global_steps if step is None else step)
        return self.rollout.publish_metrics()

    @property
    def trace_counts(self) -> dict[str, int]:
        """Traces per jitted function (`Placement.trace_counts`)."""
        return self.placement.trace_counts

    def compile_counts(self) -> dict[str, int]:
        """Compiled executables per jitted function (1 each after any number of same-shaped steps)."""
        fns = {"update_actor": self.policy.trained.update, "old_log_prob": self.policy.old_log_prob_fn}
        fns["adv"] = self.advantage
        if self.reference is not None:
            fns["ref"] = self.reference.log_prob_fn
        if self.teacher is not None:
            fns["teacher"] = self.teacher.log_prob_fn
        if self.critic is not None:
            fns.update(update_critic=self.critic.trained.update, values=self.critic.values_fn)
        out = {k: f._cache_size() for k, f in fns.items()}
        if self.reward_fn.rm_scorer is not None:
            out["rm"] = self.reward_fn.rm_scorer.compile_count()
        return out

    # ------------------------------------------------------------------------------------ validation
    def validate(self) -> dict[str, float]:
        """Generate on the held-out set with `rollout.val_kwargs` (greedy n=1 by default) and score it.

        Returns verl's validation metrics (`validation.process_validation_metrics`:
        `val-core/{data_source}/reward/mean@{n}`, best@k / maj@k / pass@k when n > 1; `acc` becomes the core
        variable when the reward function reports it), `val-aux/{data_source}/response_length/mean`,
        `val-aux/{data_source}/num_samples`, `timing_s/testing`. Shows a progress bar (prompts done) when
        `trainer.progress_bar` (process 0). With `trainer.validation_data_dir` (verl), every scored response
        goes to `<dir>/<global_steps>.jsonl` (`validation_loop.write_generations`). Multi-process: each
        process generates and scores only its rows of every held-out batch; the results are gathered once, so
        every process returns the same metrics.

        Raises:
          ValueError: `data.val_files` is set but every prompt in it also occurs in the training data (the
            set was dropped because validation was off). RewardFunctionError: see `RewardManager.compute`.
        """
        if self.data.val_loader is None:
            if self.config.data.val_files:  # dropped by data_rows.load_data_rows (validation was off)
                raise ValueError(
                    "validate(): no validation set: every prompt of config.data.val_files also occurs in "
                    "config.data.train_files (allowed only while validation is off)"
                )
            return {}
        sampling_params = self.rollout.sampling_params(validate=True, seed=int(self.config.trainer.seed))
        local = self.rollout.process_local  # multi-process: each process scores its rows
        engine = self.rollout.engine  # multi-turn: the agent loop
        val = self.data.val_loader
        dump = self.config.trainer.get("validation_data_dir")
        return run_validation(
            self.config,
            val,
            engine,
            self.reward_fn,
            sampling_params,
            process_local=local,
            dump_path=dump,
            step=self.global_steps,
        )

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

    # ---- the hooks of the shared loop (engine/loop.py)
    def has_validation(self) -> bool:
        return self.data.val_loader is not None

    def console_tags(self) -> set[str]:
        return config_features.console_tags(self.config)  # the console legend's lines for this run

    def on_fit_start(self) -> None:
        warn = preflight.critic_warmup_warning(int(self.config.trainer.critic_warmup), self.total_training_steps)
        if warn:
            self._say(warn)
        self.tracker.log(self.data.stats, step=self.global_steps)

    def run_step(self) -> dict[str, float]:
        """One step on the next prompt batch; a reward failure before its updates: the RNG, the data position and
        the asynchronous queue put back (`trainer_checkpoint.step_snapshot`), step N saved, the error re-raised
        (`RunDir.save_on_error_in_step`); in the background job after them: step N + 1 saved with the job owed
        (`trainer_checkpoint.stop_after_job_failure`), paid first by the resumed run (`pay_owed_job`)."""
        trainer_checkpoint.pay_owed_job(self)
        with trainer_checkpoint.step_guard(self):
            metrics = self.train_step(next(self.data.train_loader))
        trainer_checkpoint.stop_after_job_failure(self, metrics)
        return metrics

    def validation_guard(self, metrics):
        """The step is logged and saved, then a reward failure re-raised (`RunDir.save_on_error_in_validation`)."""
        return self.run.save_on_error_in_validation(self.global_steps, metrics, self.save_checkpoint)

    @staticmethod
    def progress_postfix(metrics) -> dict[str, str]:
        return {"score": f"{metrics.get('critic/score/mean', float('nan')):.3f}"}

    # ------------------------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """Everything needed to resume exactly (`trainer_checkpoint.state_dict`)."""
        return trainer_checkpoint.state_dict(self)

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        """Inverse of `state_dict` (arrays are placed like the current ones)."""
        trainer_checkpoint.load_state_dict(self, saved)

    def save_checkpoint(self) -> bool:
        """Start an (async) checkpoint of the current state as step `global_steps`; False if one exists."""
        return self.run.checkpointer.save(self.global_steps, self.state_dict())

    def load_checkpoint(self, root: str, step: int) -> None:
        """Restore the full training state of `<root>/global_step_<step>` (`trainer_checkpoint.load_checkpoint`).
        Raises CheckpointError (see `RunDir.restore`)."""
        trainer_checkpoint.load_checkpoint(self, root, step)

    def load_actor_params_from(self, root: str, step: int) -> None:
        """Load only the actor params of a checkpoint (evaluation / export); optimizer state untouched."""
        trainer_checkpoint.load_actor_params_from(self, root, step)

    def close(self) -> None:
        """Wait for a pending checkpoint save (raises `CheckpointError` if it failed), then release loggers,
        reward workers, the agent loop's tools and the run directory's lock (`run_lock.py`)."""
        try:
            self.run.checkpointer.close()
        finally:
            self.run.tracker.close()
            self.reward_fn.close()
            self.rollout.close()
            if self.run.run_lock is not None:
                self.run.run_lock.release()  # the directory is free for the next run


def summarize(result: dict[str, Any]) -> str:
    """Before/after validation numbers of a `fit()` result, as JSON text; a side without validation (none
    before training, none at the end) is left out, not shown as `{}`."""
    keep = lambda m: {k: v for k, v in (m or {}).items() if k.startswith(("val-", "val/"))}
    out = {name: keep(result.get(name)) for name in ("val_before", "val_after")}
    return json.dumps({name: m for name, m in out.items() if m}, indent=1)
