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

import json
import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from jaxrl_post.evaluate import evaluate, metrics_path

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


def main(argv) -> None:
    del argv
    from jaxrl_post.data.sources import MalformedRowError
    from jaxrl_post.engine.run.checkpoint import CheckpointError
    from jaxrl_post.errors import ConfigError
    from jaxrl_post.runtime.log_noise import quiet_startup_noise

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
