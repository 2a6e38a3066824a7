"""Config checks of the model section (`model.*`): the attention backend, dtypes, the model to load and the
LoRA adapters (`models/lora.py`). Sections of `rl/config_check.py`'s table; they report through an
`errors.Checker`. Packing keys (`model.use_remove_padding`, ...) are the engine's (`engine/config_checks.py`)."""

from __future__ import annotations

import logging
import os
from typing import Any

from jaxrl_post.errors import Checker, is_int, is_num
from jaxrl_post.models.attention import ATTENTION_IMPLS
from jaxrl_post.models.grouped_matmul import MOE_IMPLS
from jaxrl_post.models.lora import parse_target_modules, read_adapter_config

_DTYPES = ("float32", "bfloat16", "float16")
DEFAULT_MODEL_PATH = "smollm2-135m-instruct"  # configs/base.py's model.path
log = logging.getLogger(__name__)


def check_model(c: Checker) -> None:
    """`model.attention_impl` and `model.moe_impl` known backends (their platform: `builders`), `model.dtype` ('auto'
    or a float dtype), `model.param_dtype`, and `model.path` naming a model unless `model.random_init`."""
    c.check("model.attention_impl", lambda v: v in ATTENTION_IMPLS, f"valid: {', '.join(map(repr, ATTENTION_IMPLS))}")
    c.check("model.moe_impl", lambda v: v in MOE_IMPLS, f"valid: {', '.join(map(repr, MOE_IMPLS))}")
    c.check("model.dtype", lambda v: v in _DTYPES + ("auto",), "valid: auto, float32, bfloat16, float16")
    c.check("model.param_dtype", lambda v: v in _DTYPES, "valid: float32, bfloat16, float16")
    if not c.cfg.model.random_init:
        c.check("model.path", lambda v: isinstance(v, str) and v, "must name a model (dir, .gguf, alias)")
    elif c.cfg.model.path not in (None, "", DEFAULT_MODEL_PATH):  # a path the user set, which random_init ignores
        log.warning(
            "config.model.path=%r is ignored: config.model.random_init=True builds random weights of model.preset=%r "
            "(set random_init=False to load the model)",
            c.cfg.model.path,
            c.cfg.model.preset,
        )


def lora_enabled(cfg: Any) -> bool:
    """Whether the actor trains LoRA adapters: `model.lora_rank > 0` or a `model.lora_adapter_path` (as verl)."""
    return int(cfg.model.lora_rank or 0) > 0 or bool(cfg.model.lora_adapter_path)


def check_lora(c: Checker) -> None:
    """model.lora_rank >= 0; with LoRA on: lora_alpha > 0, known target_modules, a readable PEFT adapter at
    lora_adapter_path whose r equals lora_rank (unless 0)."""
    cfg = c.cfg
    if not c.check("model.lora_rank", lambda v: is_int(v) and v >= 0, "must be an int >= 0 (0 = LoRA off)"):
        return
    if not lora_enabled(cfg):
        return

    c.check("model.lora_alpha", lambda v: is_num(v) and v > 0, "must be > 0 (updates are scaled by alpha / rank)")
    path = cfg.model.lora_adapter_path
    if not path:
        try:
            parse_target_modules(cfg.model.target_modules)
        except ValueError as e:
            c.err("model.target_modules", str(e))
        except TypeError:  # None or a number: not a list of names
            c.err("model.target_modules", "must be 'all-linear', a comma-separated string or a list of module names")
        return
    try:
        r = int(read_adapter_config(os.path.expanduser(path))["r"])
    except (OSError, ValueError, KeyError, NotImplementedError) as e:
        c.err("model.lora_adapter_path", f"{type(e).__name__}: {e}")
        return
    if cfg.model.lora_rank and int(cfg.model.lora_rank) != r:
        c.err("model.lora_rank", f"the adapter at model.lora_adapter_path has r={r}; set lora_rank={r} or 0")
