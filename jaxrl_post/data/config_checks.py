"""Config checks of the RL trainer's data section (`data.*`): batch and length sizes, the data files or specs,
truncation and the reasoning-gym sizes. A section of `rl/config_check.py`'s table; reports through an
`errors.Checker`. Whether the batch sizes divide each other and the mesh is checked there (`rl/config_check.py`)."""

from __future__ import annotations

import os

from jaxrl_post.errors import Checker, pos_int

_SPEC_PREFIXES = ("reasoning_gym:", "reasoning_gym/", "hf:", "tfds:", "gsm8k:")


def check_data(c: Checker) -> None:
    """`data.train_batch_size`, `max_prompt_length`, `max_response_length` positive ints, `val_batch_size` and
    `max_val_samples` None or positive; `data.train_files` (required) and `val_files`: each comma-separated spec
    a data-source prefix (`reasoning_gym:`, `hf:`, `tfds:`) or an existing file (`gsm8k:<file>`);
    `data.truncation`; `data.reasoning_gym.size` / `val_size` positive."""
    cfg = c.cfg
    for key in ("data.train_batch_size", "data.max_prompt_length", "data.max_response_length"):
        c.check(key, pos_int, "must be a positive int")
    c.check("data.val_batch_size", lambda v: v is None or pos_int(v), "must be None or a positive int")
    c.check("data.max_val_samples", lambda v: v is None or pos_int(v), "must be None or a positive int")
    for key in ("data.train_files", "data.val_files"):
        val = cfg.data.get(key.removeprefix("data."))
        if not val:
            if key == "data.train_files":
                c.err(key, "required: a data file or spec (e.g. reasoning_gym:basic_arithmetic)")
            continue
        for spec in str(val).split(","):
            spec = spec.strip()
            path = spec[len("gsm8k:") :] if spec.startswith("gsm8k:") else spec
            if not spec.startswith(_SPEC_PREFIXES[:4]) and not os.path.exists(os.path.expanduser(path)):
                c.err(key, f"file not found: {path}")
    c.check("data.truncation", lambda v: v in ("error", "left", "right"), "valid: 'error', 'left', 'right'")
    c.check("data.reasoning_gym.size", pos_int, "must be a positive int")
    c.check("data.reasoning_gym.val_size", pos_int, "must be a positive int")
