"""Evaluate a checkpoint (or the base model) on the held-out set with the trainer's validation path (the
library half of `scripts/evaluate.py`; see `jaxrl_post.api`)."""

from __future__ import annotations

import contextlib
import os
import tempfile

from jaxrl_post.engine.run import checkpoint as ckpt
from jaxrl_post.errors import ConfigError
from jaxrl_post.rl.trainer import RLTrainer


def evaluate(cfg, checkpoint: str | None = None, *, step: int | None = None, workdir: str | None = None) -> dict:
    """Build the trainer from `cfg` (no training), load the actor params of `checkpoint` if given, and
    return `validate()`'s metrics plus `eval/checkpoint_step` (-1 for the base model).

    The trainer's working directory is `workdir`, or (None) a temporary `jaxrl_eval_*` directory removed
    on return, also when this raises.

    Raises:
      CheckpointError: nothing complete at `checkpoint` (the message says what to pass), or `step` is not
        one of its complete steps.
      ValueError: `data.val_files` is empty. ConfigError / MalformedRowError: see `RLTrainer`.
    """
    with contextlib.ExitStack() as stack:
        if workdir is None:
            workdir = stack.enter_context(tempfile.TemporaryDirectory(prefix="jaxrl_eval_"))
        return _evaluate(cfg, checkpoint, step, workdir)


def _evaluate(cfg, checkpoint: str | None, step: int | None, workdir: str) -> dict:

    if cfg.get("trainer_type", "rl") != "rl":
        raise ConfigError(
            f"config.trainer_type={cfg.trainer_type!r}: evaluate runs the RL validation (sampled answers scored by "
            "the reward); SFT, DPO and reward-model runs report val/loss (and their metrics) in metrics.jsonl"
        )
    cfg = cfg.copy_and_resolve_references()
    cfg.trainer.default_local_dir = workdir
    cfg.trainer.resume_mode = "disable"
    cfg.trainer.logger = ("jsonl",)
    cfg.trainer.progress_bar = False
    if not cfg.data.val_files:
        raise ValueError("config.data.val_files is empty: nothing to evaluate on")
    loaded = -1
    if checkpoint:  # resolved before the model is built, so a wrong path fails at once
        root, found = ckpt.find_resume_checkpoint("resume_path", ".", checkpoint, what="--checkpoint")
        loaded = found if step is None else int(step)
        if loaded not in ckpt.list_complete_steps(root):
            raise ckpt.CheckpointError(
                f"--step={loaded}: no complete checkpoint of that step in {root} "
                f"(complete steps: {ckpt.list_complete_steps(root)})"
            )
    trainer = RLTrainer(cfg)
    try:
        if checkpoint:
            trainer.load_actor_params_from(root, loaded)
        metrics = trainer.validate()
        metrics["eval/checkpoint_step"] = float(loaded)
        trainer.tracker.log(metrics, step=max(loaded, 0))
    finally:
        trainer.close()
    return metrics


def metrics_path(
    cfg, checkpoint: str | None, step: int, *, workdir: str | None = None, output: str | None = None
) -> str:
    """Where the metrics JSON goes: `output`; else `<workdir>/eval_metrics.json`; else beside the checkpoint,
    `<run dir>/eval_metrics.global_step_<step>.json` (the run dir holds `checkpoints/`; a checkpoint root
    named otherwise gets the file itself); else (base model, `step` -1)
    `<trainer.default_local_dir>/eval_metrics.base_model.json`. Never the current directory by default.

    Raises:
      CheckpointError: nothing complete at `checkpoint`.
    """

    if output:
        return output
    if workdir:
        return os.path.join(workdir, "eval_metrics.json")
    if checkpoint and step >= 0:
        root, _ = ckpt.find_resume_checkpoint("resume_path", ".", checkpoint, what="--checkpoint")
        run_dir = os.path.dirname(root) if os.path.basename(root) == ckpt.CHECKPOINT_SUBDIR else root
        return os.path.join(run_dir, f"eval_metrics.{ckpt.step_dir_name(step)}.json")
    return os.path.join(str(cfg.trainer.default_local_dir), "eval_metrics.base_model.json")
