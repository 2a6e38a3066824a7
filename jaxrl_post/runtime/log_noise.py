"""Keep known start-up noise off the console of the main job, without hiding real warnings or errors.

Under absl (`app.run`), Python INFO records reach stderr, so libraries' routine INFO messages show up as if
they mattered. Dropped here, by logger and message, INFO level only (warnings and errors always pass):

- jax's backend probe: "Unable to initialize backend 'tpu': ... Failed to open libtpu.so" on every machine
  without a TPU (jax then uses the next platform; a real fallback problem is logged by jax as a WARNING).
- tensorboardX: "Summary name val-core/.../mean@1 is illegal; using ..._1 instead" on every validation log.
- matplotlib (imported by reasoning-gym, never used here): "Matplotlib is building the font cache; this may
  take a moment." (a WARNING, dropped by its exact text; matplotlib's other warnings pass).
- transformers without torch: "PyTorch was not found. Models won't be available ..." (a WARNING; the job
  uses transformers only for tokenizers and configs, and runs without torch on purpose).

Orbax's per-save INFO records are dropped by `quiet_orbax_info` (installed by `engine.run.checkpoint`).
JAX_PLATFORMS is deliberately not set:
the job cannot know whether a TPU/GPU is meant to be used, and the probe only costs this log line.
"""

from __future__ import annotations

import logging
import os

__all__ = ["quiet_orbax_info", "quiet_startup_noise"]

# logger name -> message prefixes dropped at INFO level and below
_NOISE: dict[str, tuple[str, ...]] = {
    "jax._src.xla_bridge": ("Unable to initialize backend",),
    "tensorboardX.summary": ("Summary name",),
}


# logger name -> messages dropped at any level below ERROR (known harmless warnings)
_NOISE_WARNINGS: dict[str, tuple[str, ...]] = {
    "matplotlib.font_manager": ("Matplotlib is building the font cache",),
    # printed when transformers is imported without torch, which is how the job runs (torch is test-only)
    "transformers": ("PyTorch was not found",),
}


class _DropNoise(logging.Filter):
    def __init__(self, prefixes: tuple[str, ...], below: int):
        super().__init__()
        self.prefixes = prefixes
        self.below = below

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno >= self.below:
            return True
        return not str(record.msg).startswith(self.prefixes)


def quiet_startup_noise() -> None:
    """Install the filters (idempotent)."""
    for table, below in ((_NOISE, logging.WARNING), (_NOISE_WARNINGS, logging.ERROR)):
        for name, prefixes in table.items():
            logger = logging.getLogger(name)
            if not any(isinstance(f, _DropNoise) for f in logger.filters):
                logger.addFilter(_DropNoise(prefixes, below))


class DropOrbaxInfo(logging.Filter):
    """Drops orbax's INFO/DEBUG records (dozens per save) from absl logging, and the two warnings every
    read-only open prints (scripts/evaluate.py, scripts/export_hf.py); other warnings and errors pass."""

    _READ_ONLY_NOISE = ("read_only=True, setting save_interval_steps", "Given directory is read only")

    def filter(self, record: logging.LogRecord) -> bool:
        if f"{os.sep}orbax{os.sep}" not in (record.pathname or ""):
            return True
        if record.levelno < logging.WARNING:
            return False
        return not any(s in record.getMessage() for s in self._READ_ONLY_NOISE)


def quiet_orbax_info() -> None:
    """Install `DropOrbaxInfo` on absl's logger once (orbax logs through absl)."""
    absl_logger = logging.getLogger("absl")
    if not any(isinstance(f, DropOrbaxInfo) for f in absl_logger.filters):
        absl_logger.addFilter(DropOrbaxInfo())
