"""The training loop every trainer shares: steps, validation cadence, checkpoints, a clean stop, progress.

`fit(trainer, ...)` is verl's `fit()` outer loop without the step itself. A trainer plugs in by providing:

  * `config` (reads `trainer.save_freq`, `test_freq`, `val_before_train`, `val_at_end`, `progress_bar`),
    `global_steps`, `total_training_steps`, `tracker` (`log(metrics, step)`), `checkpointer`
    (`check_for_errors()`), `save_checkpoint()`, `_say(line)`;
  * `has_validation() -> bool` and `validate() -> metrics`;
  * `run_step() -> metrics`: read the next batch and run one training step (advances `global_steps`);
  * optional `on_fit_start()` (one-time lines and metrics before the first step), `validation_guard(metrics)`
    (a context manager around a validation after a step; e.g. log and save the step if it fails),
    `progress_postfix(metrics) -> dict`, `resumed_from` (the checkpoint a run resumed from, or None) and
    `val_before_metrics` (the step-0 validation kept with the run's checkpoints).

`rl/trainer.py` `RLTrainer` and `sft/trainer.py` `SupervisedTrainer` (SFT, DPO, reward model) both run on it.
"""

from __future__ import annotations

import contextlib
from typing import Any

from jaxrl_post.engine.progress import progress_bar
from jaxrl_post.engine.run.tracking import console_legend
from jaxrl_post.runtime import distributed


def _val_before(trainer, result: dict[str, Any]) -> None:
    """Validate before the first step, once per run: a resumed run keeps the original run's step-0
    validation (its params are not the base model's) instead of validating again."""
    if getattr(trainer, "resumed_from", None) is None:
        result["val_before"] = trainer.validate()
        trainer.tracker.log(result["val_before"], step=trainer.global_steps)
        # checkpointed with the run (host['val_before']): a resumed run reports it, not a re-run
        trainer.val_before_metrics = {k: float(v) for k, v in result["val_before"].items() if k.startswith("val")}
        return
    result["val_before"] = getattr(trainer, "val_before_metrics", None)
    trainer._say(
        f"resumed at step {trainer.global_steps}: not validating before training again; val_before is "
        + (
            "the original run's validation at step 0"
            if result["val_before"]
            else "unknown (the original run's step-0 validation was not saved)"
        )
    )


def print_legend(trainer) -> bool:
    """Print the console legend of the metrics this trainer logs (`trainer.console_tags()`), once per run
    directory: only when the console logger is on and no run logged metrics in the directory before
    (`RunDir.new_directory`). Returns whether it printed."""
    run = getattr(trainer, "run", None)
    if run is None or not run.new_directory or "console" not in getattr(trainer.tracker, "backends", {}):
        return False
    trainer._say(console_legend(trainer.console_tags()))
    return True


def fit(trainer, max_steps: int | None = None, *, stop=None, desc: str = "training") -> dict[str, Any]:
    """Train `trainer` until `total_training_steps`, validating before/after/every `test_freq` steps as
    configured, checkpointing every `trainer.save_freq` steps and after the last step.

    Args:
      trainer: see the module docstring for what it provides.
      max_steps: stop after this many steps of this call even if training is not finished (a later
        trainer resumes from the last checkpoint; used to test exact resume).
      stop: optional `interrupt.GracefulStop` (anything with `defer()` and `requested`). After each
        completed step `stop.defer()` is called; when `stop.requested`, the loop checkpoints the step
        (even with `save_freq=-1`; a `test_freq` validation of that step is skipped, the final one is
        not: metrics are logged before the checkpoint, so a resumed run never misses a step's line)
        and returns early.
      desc: the progress bar's label.

    Returns `{"val_before": metrics | None, "val_after": metrics | None, "last": last step metrics,
    "history": list of per-step metrics, "stopped_at": step | None}` (`stopped_at`: the step a stop
    request ended the loop after, its checkpoint started).

    Raises whatever the trainer's step, validation or checkpointing raises (after its own guards ran).
    """
    cfg = trainer.config
    result: dict[str, Any] = {"val_before": None, "val_after": None, "last": {}, "history": [], "stopped_at": None}
    if trainer.global_steps >= trainer.total_training_steps:
        trainer._say(
            f"training already finished at step {trainer.global_steps} (total_training_steps="
            f"{trainer.total_training_steps}); to train further, raise --config.trainer.total_training_steps; to "
            "start over, pass --config.trainer.resume_mode=disable (the old run is moved aside)"
        )
        return result
    stop_at = trainer.total_training_steps
    if max_steps is not None:
        stop_at = min(stop_at, trainer.global_steps + int(max_steps))
    save_freq, freq = int(cfg.trainer.save_freq), int(cfg.trainer.test_freq)
    print_legend(trainer)  # what score | loss | ... on the step lines mean
    if hasattr(trainer, "on_fit_start"):
        trainer.on_fit_start()
    if cfg.trainer.val_before_train and trainer.has_validation():
        _val_before(trainer, result)
    guard = getattr(trainer, "validation_guard", lambda m: contextlib.nullcontext())
    postfix = getattr(trainer, "progress_postfix", lambda m: {})
    bar = progress_bar(
        bool(cfg.trainer.progress_bar) and distributed.is_main(),
        total=trainer.total_training_steps,
        initial=trainer.global_steps,
        desc=desc,
        unit="step",
    )
    try:
        while trainer.global_steps < stop_at:
            m = trainer.run_step()
            if stop is not None:
                stop.defer()  # a completed step exists: a signal now waits for the checkpoint below
            last = trainer.global_steps >= trainer.total_training_steps
            stopping = stop is not None and stop.requested  # a stop skips the mid-run validation
            if trainer.has_validation() and (
                (last and cfg.trainer.val_at_end) or (freq > 0 and trainer.global_steps % freq == 0 and not stopping)
            ):
                with guard(m):  # e.g. the step is logged and saved, then the error re-raised
                    v = trainer.validate()
                m.update(v)
                if last:
                    result["val_after"] = v
            trainer.tracker.log(m, step=trainer.global_steps)
            result["history"].append(m)
            result["last"] = m
            if save_freq > 0 and (trainer.global_steps % save_freq == 0 or last):
                trainer.save_checkpoint()
            if stop is not None and stop.requested:
                trainer.save_checkpoint()  # no-op when this step was just saved
                result["stopped_at"] = trainer.global_steps
            trainer.checkpointer.check_for_errors()  # a failed background save stops the run here
            bar.update(1)
            bar.set_postfix(**postfix(m))
            if result["stopped_at"] is not None:
                break
    finally:
        bar.close()
    return result
