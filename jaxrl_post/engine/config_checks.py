"""Config checks of what the engine builds from a config: sequence packing (`model.use_remove_padding`,
`model.seqs_per_packed_row`, `model.pack_shared_prompts`: `engine/packing.py`) and a role's optimizer
(`<role>.optim.*`: `engine/steps.py` `make_optimizer`). `check_packing` is a section of `rl/config_check.py`'s
table; `check_optim` is called by the sections of the roles that train (`rl/roles/config_checks.py`). Both report
through an `errors.Checker`."""

from __future__ import annotations

from jaxrl_post.errors import Checker, is_int, is_num, nonneg, pos_int

WARMUP_STYLES = ("constant", "cosine")


def check_packing(c: Checker) -> None:
    """`model.use_remove_padding` and `model.pack_shared_prompts` bools, `model.seqs_per_packed_row` a positive int.
    (A dynamic batch size's needs are checked with the batch arithmetic, `rl/config_check.py`.)"""
    c.check("model.use_remove_padding", lambda v: isinstance(v, bool), "must be a bool")
    c.check("model.seqs_per_packed_row", pos_int, "must be a positive int")
    c.check("model.pack_shared_prompts", lambda v: isinstance(v, bool), "must be a bool")


def check_optim(c: Checker, role: str) -> None:
    """`<role>.optim.*` (verl's names): `lr`, `weight_decay` >= 0; `lr_warmup_steps` >= -1;
    `lr_warmup_steps_ratio`, `min_lr_ratio` in [0, 1]; `warmup_style`; `betas` two numbers in [0, 1); `eps` > 0.

    Args:
      c: the checker.
      role: the config section holding `optim` ('actor', 'critic').
    """
    p = f"{role}.optim"
    c.check(f"{p}.lr", nonneg, "must be >= 0")
    c.check(f"{p}.lr_warmup_steps", lambda v: is_int(v) and v >= -1, "must be an int >= -1")
    c.check(f"{p}.lr_warmup_steps_ratio", lambda v: is_num(v) and 0 <= v <= 1, "must be in [0, 1]")
    c.check(f"{p}.warmup_style", lambda v: v in WARMUP_STYLES, f"valid: {list(WARMUP_STYLES)}")
    c.check(f"{p}.min_lr_ratio", lambda v: is_num(v) and 0 <= v <= 1, "must be in [0, 1]")
    c.check(f"{p}.weight_decay", nonneg, "must be >= 0")
    c.check(
        f"{p}.betas",
        lambda v: len(v) == 2 and all(is_num(b) and 0 <= b < 1 for b in v),
        "must be two numbers in [0, 1)",
    )
    c.check(f"{p}.eps", lambda v: is_num(v) and v > 0, "must be > 0")
