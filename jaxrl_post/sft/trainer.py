"""`SupervisedTrainer`: SFT, DPO and reward-model training, one trainer over the shared engine and a task object.

    python -m jaxrl_post.main --config=configs/sft.py:gsm8k      (trainer_type 'sft': `SFTTrainer`)
    python -m jaxrl_post.main --config=configs/dpo.py            (trainer_type 'dpo': `DPOTrainer`)
    python -m jaxrl_post.main --config=configs/reward_model.py   (trainer_type 'reward_model': `RewardModelTrainer`)

The three public names build this one class with their task (`SFTTask` in sft_task.py, `DPOTask` in dpo.py,
`RewardModelTask` in reward_model.py; as Tunix's `DPOTrainer` is its `PeftTrainer` with another loss). A task gives
what differs, each a small piece:

  * `trainer_type`, `trainer_name`, `validate_config(cfg)` (one `ConfigError` naming every bad key);
  * data: `load_data(cfg, tokenizer, spec, key)`, `head(data, k)`, `pack_dataset(cfg, data, row_len)`;
  * built as `task_cls(config, tokenizer)` once the tokenizer is loaded;
  * the model: `build_model(mesh)` (a causal LM, or a `RewardModel`), `export(module, tokenizer,
    out_dir, workdir)` (a Hugging Face directory; returns the console line);
  * layout + loss: `build_steps(model, state, placement, data, say)` sets the jitted update on the
    `TrainedModel` (`set_update`) and builds the task's eval (and DPO's reference) fns; `train_batch(idx, plan,
    params, frozen) -> (batch, update args, input tokens)`; `validate(params, frozen)`; `compile_counts()`;
    `progress_postfix(metrics)`.

What the trainer does for all three (per step: the next `data.train_batch_size` examples or pairs, grain order,
bfd rows unpacked -> the task's batch on the mesh -> one jitted update, micro-batches accumulated inside -> metrics
`learning_rate`, `num_tokens`, `epoch`, the non-finite guard's -> console + metrics.jsonl): the data and its order
(`batches.SupervisedData`), the model, optimizer and jitted update (`engine.trained_model.TrainedModel`, state
`engine.train_state.OptimizedParams`), the mesh and jit helpers (`engine.placement.Placement`), the loop
(`engine.loop.fit`), the run directory, checkpoints and exact resume (`engine.run.run_dir.RunDir`: params, optimizer
state, step, data position, `num_tokens`), the non-finite guard, the HF export after the last step
(`<trainer.default_local_dir>/huggingface/`, a `model.path` for RL or another round) and the SIGINT/SIGTERM stop of
`main.py`. Multi-host: every process loads the same data and builds the same global batch, placed on the mesh
(rows over the batch axes, `batches.on_mesh`); process 0 alone logs and writes files.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Callable
from typing import Any

import jax

from jaxrl_post.engine import loop
from jaxrl_post.engine.nonfinite import NonFiniteGuard
from jaxrl_post.engine.placement import Placement
from jaxrl_post.engine.run import checkpoint as ckpt
from jaxrl_post.engine.run.run_dir import RunDir
from jaxrl_post.engine.run.run_files import config_to_dict
from jaxrl_post.engine.run.tracking import Tracking
from jaxrl_post.engine.train_state import place_like
from jaxrl_post.engine.trained_model import TrainedModel
from jaxrl_post.rl import builders, preflight
from jaxrl_post.runtime import distributed
from jaxrl_post.runtime.platform_defaults import log_resolved, resolve_config
from jaxrl_post.sft.batches import SFTBatches, SupervisedData
from jaxrl_post.sft.sft_task import SFTTask, validate_sft_config

__all__ = ["HF_EXPORT_SUBDIR", "SFTBatches", "SFTTrainer", "SupervisedTrainer", "validate_sft_config"]

HF_EXPORT_SUBDIR = "huggingface"  # <run dir>/huggingface/: the exported model (verl's checkpoint subdir name)


@dataclasses.dataclass
class SupervisedHost:
    """Host values a supervised step changes: `global_steps` (completed steps), `num_tokens` (TRL: input tokens
    trained on so far), the non-finite update `guard`, and the run's validation before training (`val_before`)."""

    guard: NonFiniteGuard
    global_steps: int = 0
    num_tokens: int = 0
    val_before: dict[str, float] | None = None


class SupervisedTrainer:
    """SFT, DPO or reward-model training driven by a job ConfigDict and a task class (module docstring).

    Args:
      task_cls: `SFTTask`, `DPOTask` or `RewardModelTask` (built here with the config).
      config: the job ConfigDict (validated first, by the task's `validate_config`). tracker: optional
        `Tracking` (default: console + jsonl in `trainer.default_local_dir`). console_write: optional callable
        for console lines (tests capture it).

    Raises:
      ConfigError: invalid config, an unusable working directory, a missing data file, fewer examples (pairs)
        than `data.train_batch_size`, a task's model-building refusal.
      MalformedRowError: a malformed row or an overlong example (file and row named), before the model loads.
      CheckpointError: the checkpoint to resume from cannot be read, does not match the config, or was written
        by another trainer type.
    """

    def __init__(
        self, task_cls, config, *, tracker: Tracking | None = None, console_write: Callable[[str], None] | None = None
    ):
        task_cls.validate_config(config)  # accepts "auto"; errors come before any other line
        resolved = resolve_config(config, log_line=False)  # "auto" values by platform (platform_defaults.py)
        self.config = cfg = config
        preflight.check_workdir(cfg)
        preflight.check_model_path(cfg)  # one line naming model.path, before anything loads

        # ---- data first (errors name file and row before the slow model load)
        self.tokenizer = builders.load_tokenizer(cfg.model.tokenizer_path or cfg.model.path)
        self.task = task = task_cls(cfg, self.tokenizer)
        self.data = data = SupervisedData.build(cfg, task, self.tokenizer)
        self.total_training_steps = int(
            cfg.trainer.total_training_steps or int(cfg.trainer.total_epochs) * data.loader.batches_per_epoch
        )

        log_resolved(resolved)  # after the run-directory, model-path and data checks (an error there is one line)
        # ---- devices, model (LoRA: adapters trained, base frozen), optimizer, jitted fns
        self.placement = Placement(builders.build_mesh(cfg), jax.device_count())  # commit / jit helpers, traces
        module = task.build_model(self.placement.mesh)
        optim_cfg = builders.optim_config(
            cfg.optim,
            grad_clip=float(cfg.optim.clip_grad),
            total_training_steps=self.total_training_steps,
            updates_per_step=1,
        )
        self.model, self.state = TrainedModel.build(module, self.placement, optim_cfg)
        say = console_write or (lambda line: print(line, flush=True))
        if not distributed.is_main():  # process 0 alone prints, logs and writes metrics files (as RLTrainer)
            say, tracker = (lambda line: None), tracker or distributed.NullTracker()
        task.build_steps(self.model, self.state, self.placement, data, say)

        # ---- host state, loggers, checkpoints / resume
        self.host = SupervisedHost(NonFiniteGuard(int(cfg.trainer.max_consecutive_nonfinite), "actor"))
        os.makedirs(cfg.trainer.default_local_dir, exist_ok=True)
        tracker = tracker or Tracking(
            cfg.trainer.default_local_dir,
            cfg.trainer.logger,
            int(cfg.trainer.print_every),
            console_write=console_write,
            project=cfg.trainer.project_name,
            experiment=cfg.trainer.experiment_name,
            config=config_to_dict(cfg),
        )
        self.run = RunDir(cfg, say, tracker)
        self.run.open(self)  # lock, resume (`load_checkpoint`), metrics.jsonl, config.json

    # ---- what the shared loop (engine/loop.py), main.py and the tests read
    global_steps = property(lambda self: self.host.global_steps, doc="Completed training steps.")
    workdir = property(lambda self: self.config.trainer.default_local_dir, doc="The run directory.")
    tracker = property(lambda self: self.run.tracker)
    checkpointer = property(lambda self: self.run.checkpointer)
    resumed_from = property(lambda self: self.run.resumed_from, doc="The step directory resumed from, or None.")

    @property
    def val_before_metrics(self) -> dict[str, float] | None:
        """The run's step-0 validation (kept on resume by the loop)."""
        return self.host.val_before

    @val_before_metrics.setter
    def val_before_metrics(self, value) -> None:
        self.host.val_before = value

    def _say(self, line: str) -> None:
        self.run.say(line)

    # ------------------------------------------------------------------------------------ steps
    def train_step(self) -> dict[str, float]:
        """One optimizer step on the next `data.train_batch_size` examples or pairs (bfd: packed rows); returns
        its metrics: the update's, the non-finite guard's, `learning_rate` (one update per step), `num_tokens`
        (input tokens so far), `epoch` and `timing_s/step`."""
        t0 = time.perf_counter()
        idx, plan = self.data.next_indices()
        batch, extra, n_tokens = self.task.train_batch(idx, plan, self.state.params, self.model.frozen_args())
        h = self.host
        lr = float(self.model.lr(h.global_steps))
        self.state, out = self.model.step(self.state, batch, *extra)
        m = {k: float(v) for k, v in jax.device_get(out).items()}
        h.global_steps += 1
        h.num_tokens += n_tokens
        m.update(h.guard.observe([m.pop("update_skipped")], step=h.global_steps))
        m.update(
            learning_rate=lr,
            num_tokens=float(h.num_tokens),
            epoch=h.global_steps / self.data.loader.batches_per_epoch,
        )
        m["timing_s/step"] = time.perf_counter() - t0
        return m

    def validate(self) -> dict[str, float]:
        """The task's held-out metrics (`val/loss`, ...) and `timing_s/testing`. Raises RuntimeError without
        validation data."""
        return self.task.validate(self.state.params, self.model.frozen_args())

    # ------------------------------------------------------------------------------------ loop
    def fit(self, max_steps: int | None = None, stop=None) -> dict[str, Any]:
        """Train to `total_training_steps`, validating before (`trainer.val_before_train`), every
        `trainer.test_freq` steps and after the last (`trainer.val_at_end`), checkpointing every
        `trainer.save_freq` steps and after the last; then export the model (`trainer.export_hf`).

        Args / returns / stop handling as `RLTrainer.fit` (`max_steps`: stop after that many steps of this
        call; `stop`: `interrupt.GracefulStop`, the step is checkpointed and the loop returns).
        Raises NonFiniteError (`trainer.max_consecutive_nonfinite` skipped updates in a row), CheckpointError.
        """
        result = loop.fit(self, max_steps, stop=stop, desc=self.task.trainer_type)
        if self.global_steps >= self.total_training_steps and self.config.trainer.export_hf:
            result["exported_to"] = self.export_hf()
        return result

    # ---- the hooks of the shared loop (engine/loop.py)
    def has_validation(self) -> bool:
        return self.data.val is not None

    def console_tags(self) -> set[str]:
        """Which lines of the console legend apply: this trainer's (`trainer_type`)."""
        return {self.task.trainer_type}

    def on_fit_start(self) -> None:
        rows = self.data.packed_rows
        packed = {} if rows is None else {"data/num_packed_rows": len(rows)}  # bfd
        self.tracker.log({**self.data.train.stats, **packed}, step=self.global_steps)

    def run_step(self) -> dict[str, float]:
        return self.train_step()

    def progress_postfix(self, metrics) -> dict[str, str]:
        return self.task.progress_postfix(metrics)

    def export_hf(self, out_dir: str | None = None) -> str:
        """Write the current model as a Hugging Face directory (default `<run dir>/huggingface/`; LoRA: merged
        weights; the reward model: `*ForSequenceClassification`) with the tokenizer; returns its path.
        `model.path=<run dir>` (or `reward_model.model.path`) then loads it."""
        out_dir = out_dir or os.path.join(self.workdir, HF_EXPORT_SUBDIR)
        self.sync_weights()
        self._say(self.task.export(self.model.module, self.tokenizer, out_dir, self.workdir))
        return out_dir

    def close(self) -> None:
        """Wait for a pending checkpoint save (raises `CheckpointError` if it failed), then close the loggers."""
        try:
            self.checkpointer.close()
        finally:
            self.tracker.close()

    # ------------------------------------------------------------------------------------ state
    def sync_weights(self) -> None:
        """The model's module holds the live params (export, evaluation)."""
        self.model.sync(self.state.params)

    def save_checkpoint(self) -> bool:
        """Start an (async) checkpoint of the current state as step `global_steps`; False if one exists."""
        return self.checkpointer.save(self.global_steps, self.state_dict())

    def load_checkpoint(self, root: str, step: int) -> None:
        """Restore `<root>/global_step_<step>` into this trainer. Raises CheckpointError (`RunDir.restore`)."""
        like = lambda items: {k: v for k, v in self.state_dict().items() if k != "host"}
        m = self.model
        self.load_state_dict(self.run.restore(root, step, like, model_config=m.module.config, lora=m.lora))
        n, total = self.global_steps, self.total_training_steps
        self._say(f"resumed from step {n}{f' of {total}' if n < total else ''} ({self.run.resumed_from})")

    def compile_counts(self) -> dict[str, int]:
        """Compiled executables per jitted function (1 each after any number of same-shaped steps)."""
        return {"update": self.model.update._cache_size(), **self.task.compile_counts()}

    def state_dict(self) -> dict[str, Any]:
        """Params (LoRA: the adapters), optimizer state, and host state: trainer type, step, data position,
        `num_tokens`, non-finite counters, model metadata (`scripts/export_hf.py` reads it), config. The keys are
        those of every earlier version: old checkpoints resume."""
        cfg, m, h = self.config, self.model, self.host
        base = ckpt.reference_pointer(
            model_path=None if cfg.model.random_init else cfg.model.path,
            random_init=bool(cfg.model.random_init),
            seed=int(cfg.trainer.seed),
        )
        return {
            "actor": {"params": self.state.params, "opt_state": self.state.opt_state},
            "host": {
                "trainer_type": self.task.trainer_type,
                "global_steps": h.global_steps,
                "num_tokens": h.num_tokens,
                "data_iter": self.data.loader.get_state(),
                "nonfinite": {"actor": h.guard.state_dict()},
                "model": ckpt.model_metadata(
                    m.module.config,
                    cfg.model.tokenizer_path or cfg.model.path,
                    lora=None if m.lora is None else m.lora.to_dict(),
                    base=base,
                ),
                "total_training_steps": self.total_training_steps,
                "config": config_to_dict(cfg),
            },
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Inverse of `state_dict` (arrays placed like the current ones). Raises CheckpointError for a
        checkpoint of another trainer type (an RL run's checkpoints hold other state)."""
        host, h = state["host"], self.host
        if host.get("trainer_type") != self.task.trainer_type:
            raise ckpt.CheckpointError(
                f"the checkpoint to resume from was not written by {self.task.trainer_name} (trainer_type "
                f"{host.get('trainer_type', 'rl')!r}); point "
                "trainer.default_local_dir at a new directory or pass --config.trainer.resume_mode=disable"
            )
        self.state = self.state.replace(
            params=place_like(state["actor"]["params"], self.state.params),
            opt_state=place_like(state["actor"]["opt_state"], self.state.opt_state),
        )
        h.global_steps = int(host["global_steps"])
        h.num_tokens = int(host["num_tokens"])
        self.data.loader.set_state(host["data_iter"])
        h.guard.load_state_dict((host.get("nonfinite") or {}).get("actor", {}))
        self.sync_weights()


def SFTTrainer(config, *, tracker: Tracking | None = None, console_write: Callable[[str], None] | None = None):
    """Supervised fine-tuning (configs/sft.py): `SupervisedTrainer` with `SFTTask`. Args and raises as
    `SupervisedTrainer`."""
    return SupervisedTrainer(SFTTask, config, tracker=tracker, console_write=console_write)
