"""Evaluate a checkpoint (or the base model alone) on the held-out set with the trainer's validation path.

Usage:
  python scripts/evaluate.py --config=configs/grpo.py                                  # base model
  python scripts/evaluate.py --config=configs/grpo.py --checkpoint=runs/grpo           # latest checkpoint
  python scripts/evaluate.py --config=configs/grpo.py:gsm8k --checkpoint=runs/grpo_gsm8k/checkpoints/global_step_3 \
      --config.rollout.val_kwargs.n=8 --config.rollout.val_kwargs.do_sample=True \
      --config.rollout.val_kwargs.temperature=1.0

Generation settings come from `rollout.val_kwargs` (greedy n=1 by default; n>1 sampled adds best@k,
pass@k, maj@k). `--checkpoint` is a run dir, its `checkpoints/` dir or a `global_step_<N>` dir; only the
actor params are read. Metrics (verl names, `val-core/{data_source}/reward/mean@{n}`, ...) are printed as
JSON and written to `--output`, by default beside the checkpoint: `<run dir>/eval_metrics.global_step_<N>.json`
(`<--workdir>/eval_metrics.json` with `--workdir`; for the base model
`<trainer.default_local_dir>/eval_metrics.base_model.json`); the last line says where. The evaluation's own
working directory (`--workdir`, default a temporary `jaxrl_eval_*` directory removed at the end, also after
a failure) keeps the run's directory untouched.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import tempfile

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

FLAGS = None


def _define_flags():
    """absl flags, defined only when run as a script (importing this module defines nothing)."""
    from absl import flags
    from ml_collections import config_flags

    config_flags.DEFINE_config_file("config", None, "Job config: path/to/config.py[:variant].", lock_config=False)
    flags.DEFINE_string("checkpoint", None, "Checkpoint to evaluate (default: the base model).")
    flags.DEFINE_integer("step", None, "Checkpoint step (default: the one --checkpoint names, else the latest).")
    flags.DEFINE_string("workdir", None, "Working dir of the evaluation (default: a temp dir, removed at the end).")
    flags.DEFINE_string(
        "output",
        None,
        "JSON file for the metrics (default: beside the checkpoint, <run dir>/eval_metrics.global_step_<N>.json).",
    )
    flags.mark_flag_as_required("config")
    return flags.FLAGS


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
    from jaxrl_post.trainer import checkpoint as ckpt
    from jaxrl_post.trainer.trainer import RLTrainer

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
    from jaxrl_post.trainer import checkpoint as ckpt

    if output:
        return output
    if workdir:
        return os.path.join(workdir, "eval_metrics.json")
    if checkpoint and step >= 0:
        root, _ = ckpt.find_resume_checkpoint("resume_path", ".", checkpoint, what="--checkpoint")
        run_dir = os.path.dirname(root) if os.path.basename(root) == ckpt.CHECKPOINT_SUBDIR else root
        return os.path.join(run_dir, f"eval_metrics.{ckpt.step_dir_name(step)}.json")
    return os.path.join(str(cfg.trainer.default_local_dir), "eval_metrics.base_model.json")


def main(argv) -> None:
    del argv
    from jaxrl_post.data.sources import MalformedRowError
    from jaxrl_post.log_noise import quiet_startup_noise
    from jaxrl_post.trainer.checkpoint import CheckpointError
    from jaxrl_post.trainer.config_check import ConfigError

    quiet_startup_noise()  # as the main job: no TPU-probe INFO line, no "PyTorch was not found"
    try:
        metrics = evaluate(FLAGS.config, FLAGS.checkpoint, step=FLAGS.step, workdir=FLAGS.workdir)
    except (CheckpointError, ConfigError, MalformedRowError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    step = int(metrics.get("eval/checkpoint_step", -1))
    out = metrics_path(FLAGS.config, FLAGS.checkpoint, step, workdir=FLAGS.workdir, output=FLAGS.output)
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w") as f:
        json.dump(metrics, f, indent=1, sort_keys=True)
    print(json.dumps({k: v for k, v in sorted(metrics.items()) if k.startswith(("val-core", "eval/"))}, indent=1))
    print(f"metrics written to {out}")


if __name__ == "__main__":
    from absl import app

    FLAGS = _define_flags()
    app.run(main)
