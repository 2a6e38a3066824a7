"""Config checks of the reward sources (`reward_model.*`, `custom_reward_function.*`): the reward manager and
its worker pool, DAPO's overlong-response penalty, the generative judge (`judge.py`), the remote reward service
(`remote.py`), reward-model scoring (`rm_scorer.py`) and the custom reward function's file. A section of
`rl/config_check.py`'s table; reports through an `errors.Checker`. Whether a remote service answers is checked
later, before the first step (`rl/preflight.py`)."""

from __future__ import annotations

import os

from jaxrl_post.errors import Checker, is_int, is_num


def check_rewards(c: Checker) -> None:
    """`reward_model.reward_manager` ('naive'), `num_workers`, `timeout_s`, `max_error_fraction`;
    `reward_model.overlong_buffer.*`; the judge and the remote service (`check_remote_reward`); reward-model
    scoring (`check_reward_model_scoring`); `custom_reward_function.path` exists."""
    cfg = c.cfg
    c.check("reward_model.reward_manager", lambda v: v == "naive", "only 'naive' is implemented")
    c.check("reward_model.num_workers", lambda v: is_int(v) and v >= 0, "must be an int >= 0")
    c.check("reward_model.timeout_s", lambda v: is_num(v) and v > 0, "must be > 0")
    c.check(
        "reward_model.max_error_fraction", lambda v: is_num(v) and 0 <= v <= 1, "must be in [0, 1] (1 = never stop)"
    )
    check_overlong_buffer(c)
    check_remote_reward(c)
    check_reward_model_scoring(c)
    path = cfg.custom_reward_function.path
    if path and not os.path.exists(path):
        c.err("custom_reward_function.path", "file not found")


def check_overlong_buffer(c: Checker) -> None:
    """`reward_model.overlong_buffer.*` (DAPO's soft overlong punishment, `algos/reward_shaping.py`): `enable` and
    `log` bools; when enabled, `len` in (0, data.max_response_length] and `penalty_factor` >= 0."""
    c.check("reward_model.overlong_buffer.enable", lambda v: isinstance(v, bool), "must be a bool")
    c.check("reward_model.overlong_buffer.log", lambda v: isinstance(v, bool), "must be a bool")
    if c.cfg.reward_model.overlong_buffer.enable is True:
        lmax = c.cfg.data.max_response_length
        c.check(
            "reward_model.overlong_buffer.len",
            lambda v: is_int(v) and 0 < v <= lmax,
            f"must be an int in (0, data.max_response_length={lmax}] when reward_model.overlong_buffer.enable",
        )
        c.check("reward_model.overlong_buffer.penalty_factor", lambda v: is_num(v) and v >= 0, "must be >= 0")


def check_remote_reward(c: Checker) -> None:
    """`reward_model.remote.*` (the remote reward service) and `reward_model.judge.*` (the generative judge):
    only read when `remote.url` / `judge.path` is set."""
    cfg = c.cfg
    check_judge(c)
    rr = cfg.reward_model.get("remote")
    if rr is None or not rr.get("url"):
        return
    c.check(
        "reward_model.remote.url",
        lambda v: isinstance(v, str) and v.startswith(("http://", "https://")),
        "must be an http:// or https:// URL",
    )
    if rr.get("url") and cfg.reward_model.get("judge") is not None and cfg.reward_model.judge.path:
        c.err("reward_model.remote.url", "set together with reward_model.judge.path: pick one reward source")
    if cfg.custom_reward_function.path:
        c.err(
            "reward_model.remote.url",
            "set together with custom_reward_function.path: the service scores every response, so the local "
            "function would be ignored; serve it instead (scripts/serve_reward.py --reward_fn PATH:NAME) or unset one",
        )
    c.check("reward_model.remote.batch_size", lambda v: is_int(v) and v >= 1, "must be an int >= 1")
    c.check("reward_model.remote.max_concurrency", lambda v: is_int(v) and v >= 1, "must be an int >= 1")
    c.check("reward_model.remote.timeout_s", lambda v: is_num(v) and v > 0, "must be > 0")
    c.check("reward_model.remote.max_retries", lambda v: is_int(v) and v >= 0, "must be an int >= 0")
    c.check("reward_model.remote.backoff_s", lambda v: is_num(v) and v >= 0, "must be >= 0")
    c.check("reward_model.remote.backoff_max_s", lambda v: is_num(v) and v >= 0, "must be >= 0")
    c.check(
        "reward_model.remote.max_error_fraction", lambda v: is_num(v) and 0 <= v <= 1, "must be in [0, 1] (1 = never)"
    )


def check_judge(c: Checker) -> None:
    """`reward_model.judge.*`, when `judge.path` is set."""
    cfg = c.cfg
    jc = cfg.reward_model.get("judge")
    if jc is None or not jc.get("path"):
        return
    if cfg.custom_reward_function.path:
        c.err(
            "reward_model.judge.path",
            "set together with custom_reward_function.path: the judge scores every response; unset one",
        )
    tpl = jc.prompt_template
    if tpl is not None:
        try:
            ok = "{response}" in tpl and tpl.format(question="", response="", ground_truth="") is not None
        except (KeyError, IndexError, ValueError):
            ok = False
        if not ok:
            c.err("reward_model.judge.prompt_template", "needs {response}; only {question} {response} {ground_truth}")
    for key in ("max_new_tokens", "max_prompt_length", "batch_size"):
        c.check(f"reward_model.judge.{key}", lambda v: is_int(v) and v >= 1, "must be an int >= 1")
    c.check("reward_model.judge.dtype", lambda v: v in ("float32", "bfloat16", "float16"), "float32|bfloat16|float16")
    if not (is_num(jc.min_score) and is_num(jc.max_score) and jc.max_score > jc.min_score):
        c.err("reward_model.judge.max_score", f"must be > reward_model.judge.min_score ({jc.min_score})")
    elif jc.normalize and jc.max_score <= 0:
        c.err("reward_model.judge.max_score", "must be > 0 with reward_model.judge.normalize")


def check_reward_model_scoring(c: Checker) -> None:
    """`reward_model.enable` and its keys (reward-model scoring in the RL loop, `rewards/rm_scorer.py`)."""
    rm = c.cfg.reward_model
    c.check("reward_model.enable", lambda v: isinstance(v, bool), "must be a bool")
    if rm.enable is not True:
        return
    path = rm.model.path
    if not path:
        c.err("reward_model.model.path", "required with reward_model.enable: an HF *ForSequenceClassification dir")
    elif not os.path.isdir(os.path.expanduser(path)):
        c.err("reward_model.model.path", f"not a directory: {path}")
    c.check(
        "reward_model.model.dtype",
        lambda v: v is None or v in ("float32", "bfloat16", "float16"),
        "valid: None (= model.dtype), float32, bfloat16, float16",
    )
    c.check("reward_model.micro_batch_size_per_gpu", lambda v: is_int(v) and v >= 1, "must be an int >= 1")
    c.check("reward_model.max_length", lambda v: v is None or (is_int(v) and v >= 1), "must be None or an int >= 1")
