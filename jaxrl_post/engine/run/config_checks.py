"""Config checks of the run (`trainer.*` keys of the loop and the run directory): run length, cadences,
checkpoints kept, the non-finite guard, resume, the working directory and the loggers. A section of
`rl/config_check.py`'s table; reports through an `errors.Checker`."""

from __future__ import annotations

import importlib.util
import os

from jaxrl_post.engine.run.checkpoint_layout import RESUME_MODES
from jaxrl_post.engine.run.tracking import parse_logger_names
from jaxrl_post.errors import Checker, is_int, pos_int


def check_trainer_run(c: Checker) -> None:
    """`trainer.total_epochs` / `total_training_steps`, `print_every`, `test_freq` / `save_freq` (-1 = off),
    `max_actor_ckpt_to_keep`, `max_consecutive_nonfinite`, `async_save`, `resume_mode` (and `resume_from_path`
    when 'resume_path'), `default_local_dir`, `logger` (wandb installed when named)."""
    cfg = c.cfg
    c.check("trainer.total_epochs", pos_int, "must be a positive int")
    c.check("trainer.total_training_steps", lambda v: v is None or pos_int(v), "must be None or a positive int")
    c.check("trainer.print_every", pos_int, "must be a positive int")
    c.check("trainer.test_freq", lambda v: is_int(v) and (v == -1 or v > 0), "must be -1 (off) or > 0")
    c.check("trainer.save_freq", lambda v: is_int(v) and (v == -1 or v > 0), "must be -1 (off) or > 0")
    c.check("trainer.max_actor_ckpt_to_keep", lambda v: v is None or pos_int(v), "must be None or a positive int")
    c.check("trainer.max_consecutive_nonfinite", lambda v: is_int(v) and v >= 0, "must be an int >= 0 (0 = never stop)")
    c.check("trainer.async_save", lambda v: isinstance(v, bool), "must be a bool")
    c.check("trainer.resume_mode", lambda v: v in RESUME_MODES, f"valid: {list(RESUME_MODES)}")
    if cfg.trainer.resume_mode == "resume_path":
        rp = cfg.trainer.resume_from_path
        if not rp:
            c.err("trainer.resume_from_path", "required when trainer.resume_mode='resume_path'")
        elif not os.path.exists(os.path.expanduser(rp)):
            c.err("trainer.resume_from_path", f"not found: {rp}")
    c.check("trainer.default_local_dir", lambda v: isinstance(v, str) and v, "must be a non-empty path")
    try:
        logger_names = parse_logger_names(cfg.trainer.logger)
    except ValueError as e:
        c.err("trainer.logger", str(e))
        logger_names = ()
    if "wandb" in logger_names:
        if importlib.util.find_spec("wandb") is None:
            c.err("trainer.logger", "'wandb' needs the wandb package: pip install wandb (or drop it from the list)")
