"""Optional experiment-tracking backends for `tracking.Tracking`: TensorBoard and Weights & Biases
(the run config's files are `run_files.save_run_config`).

Each backend has `log(metrics: Mapping[str, scalar], step: int)` and `close()`.

* `tensorboard`: tensorboardX `SummaryWriter` writing event files to `<workdir>/tensorboard/`
  (`tensorboard --logdir <workdir>/tensorboard`). Non-numeric values are skipped.
* `wandb`: `wandb.init(project=trainer.project_name, name=trainer.experiment_name, config=...,
  dir=<workdir>)`. Needs the `wandb` package and a configuration (WANDB_API_KEY, a `wandb login`
  netrc entry, or WANDB_MODE=offline/disabled); otherwise a clear error before training starts.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import numpy as np


def _scalars(metrics: Mapping[str, Any]) -> dict[str, float]:
    out = {}
    for k, v in metrics.items():
        if isinstance(v, (str, bytes)) or v is None:
            continue
        try:
            out[k] = float(np.asarray(v))
        except (TypeError, ValueError):
            continue
    return out


class TensorBoardLogger:
    """Scalars to TensorBoard event files in `<workdir>/tensorboard` (tensorboardX)."""

    def __init__(self, workdir: str, **_: Any):
        try:
            from tensorboardX import SummaryWriter
        except ImportError as e:  # pragma: no cover - tensorboardX is a dependency
            raise ImportError(
                "trainer.logger includes 'tensorboard' but tensorboardX is not installed: pip install tensorboardX"
            ) from e
        self.logdir = os.path.join(workdir, "tensorboard")
        os.makedirs(self.logdir, exist_ok=True)
        self._writer = SummaryWriter(logdir=self.logdir)

    def log(self, metrics: Mapping[str, Any], step: int) -> None:
        for k, v in _scalars(metrics).items():
            self._writer.add_scalar(k, v, global_step=int(step))
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


def wandb_configured(env: Mapping[str, str] | None = None) -> bool:
    """True when wandb can run without prompting: an API key, offline/disabled mode, or a netrc login."""
    env = os.environ if env is None else env
    if env.get("WANDB_API_KEY") or env.get("WANDB_MODE", "").lower() in ("offline", "disabled", "dryrun"):
        return True
    netrc = os.path.expanduser(env.get("NETRC", "~/.netrc"))
    try:
        with open(netrc, encoding="utf-8") as f:
            return "api.wandb.ai" in f.read()
    except OSError:
        return False


class WandbLogger:
    """Metrics to Weights & Biases (`wandb.log(metrics, step=step)`).

    Raises:
      ImportError: `wandb` is not installed (message: how to install, or drop it from trainer.logger).
      RuntimeError: wandb is not configured (no API key / login / offline mode).
    """

    def __init__(
        self,
        workdir: str,
        *,
        project: str | None = None,
        experiment: str | None = None,
        config: Mapping[str, Any] | None = None,
        **_: Any,
    ):
        try:
            import wandb
        except ImportError as e:
            raise ImportError(
                "trainer.logger includes 'wandb' but the wandb package is not installed: "
                "`pip install wandb` (then `wandb login` or WANDB_MODE=offline), or remove 'wandb' "
                "from trainer.logger"
            ) from e
        if not wandb_configured():
            raise RuntimeError(
                "trainer.logger includes 'wandb' but wandb is not configured: run `wandb login`, "
                "set WANDB_API_KEY, or set WANDB_MODE=offline"
            )
        self._wandb = wandb
        self._run = wandb.init(project=project or "jaxrl_post", name=experiment, dir=workdir, config=dict(config or {}))

    def log(self, metrics: Mapping[str, Any], step: int) -> None:
        self._run.log(_scalars(metrics), step=int(step))

    def close(self) -> None:
        self._run.finish()
