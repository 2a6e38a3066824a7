"""Config checks of the data files, the reward sources and the run directory (`data.*`, `reward_model.*`,
`custom_reward_function.*`, `trainer.resume_*`, `trainer.logger`, `model.dtype` / `path`): called by
`config_check.validate_config` with its `check` / `err` helpers, like the feature checks in `config_features`."""

from __future__ import annotations

import importlib.util
import os

from jaxrl_post.engine.run.tracking import parse_logger_names
from jaxrl_post.rl.config_features import check_dapo, check_reward_model_scoring

RESUME_MODES = ("auto", "disable", "resume_path")
_SPEC_PREFIXES = ("reasoning_gym:", "reasoning_gym/", "hf:", "tfds:", "gsm8k:")


def check_data_rewards_and_run(cfg, check, err, is_int, is_num) -> None:
    """`data.*` files and sizes, the reward manager and its sources (custom function, remote service, judge, reward
    model), resume, run directory, loggers and model dtypes / path. Appends through `err` / `check`."""
    pos_int = lambda v: is_int(v) and v > 0
    for key in ("data.train_files", "data.val_files"):
        val = cfg.data.get(key.removeprefix("data."))
        if not val:
            if key == "data.train_files":
                err(key, "required: a data file or spec (e.g. reasoning_gym:basic_arithmetic)")
            continue
        for spec in str(val).split(","):
            spec = spec.strip()
            path = spec[len("gsm8k:") :] if spec.startswith("gsm8k:") else spec
            if not spec.startswith(_SPEC_PREFIXES[:4]) and not os.path.exists(os.path.expanduser(path)):
                err(key, f"file not found: {path}")
    check("data.truncation", lambda v: v in ("error", "left", "right"), "valid: 'error', 'left', 'right'")
    check("data.reasoning_gym.size", pos_int, "must be a positive int")
    check("data.reasoning_gym.val_size", pos_int, "must be a positive int")
    check("reward_model.reward_manager", lambda v: v == "naive", "only 'naive' is implemented")
    check("reward_model.num_workers", lambda v: is_int(v) and v >= 0, "must be an int >= 0")
    check("reward_model.timeout_s", lambda v: is_num(v) and v > 0, "must be > 0")
    check("reward_model.max_error_fraction", lambda v: is_num(v) and 0 <= v <= 1, "must be in [0, 1] (1 = never stop)")
    check_dapo(cfg, check, err, is_int, is_num)
    check_remote_reward(cfg, check, err, is_int, is_num)
    check_reward_model_scoring(cfg, check, err, is_int, is_num)
    path = cfg.custom_reward_function.path
    if path and not os.path.exists(path):
        err("custom_reward_function.path", "file not found")
    check("trainer.resume_mode", lambda v: v in RESUME_MODES, f"valid: {list(RESUME_MODES)}")
    if cfg.trainer.resume_mode == "resume_path":
        rp = cfg.trainer.resume_from_path
        if not rp:
            err("trainer.resume_from_path", "required when trainer.resume_mode='resume_path'")
        elif not os.path.exists(os.path.expanduser(rp)):
            err("trainer.resume_from_path", f"not found: {rp}")
    check("trainer.default_local_dir", lambda v: isinstance(v, str) and v, "must be a non-empty path")
    try:
        logger_names = parse_logger_names(cfg.trainer.logger)
    except ValueError as e:
        err("trainer.logger", str(e))
        logger_names = ()
    if "wandb" in logger_names:
        if importlib.util.find_spec("wandb") is None:
            err("trainer.logger", "'wandb' needs the wandb package: pip install wandb (or drop it from the list)")
    dtypes = ("float32", "bfloat16", "float16")
    check("model.dtype", lambda v: v in dtypes + ("auto",), "valid: auto, float32, bfloat16, float16")
    check("model.param_dtype", lambda v: v in dtypes, "valid: float32, bfloat16, float16")
    check(
        "rollout.dtype", lambda v: v is None or v in dtypes, "valid: None (= model.dtype), float32, bfloat16, float16"
    )
    if not cfg.model.random_init:
        check("model.path", lambda v: isinstance(v, str) and v, "must name a model (dir, .gguf, alias)")


def check_remote_reward(cfg, check, err, is_int, is_num) -> None:
    """`reward_model.remote.*` (the remote reward service) and `reward_model.judge.*` (the generative judge):
    only read when `remote.url` / `judge.path` is set."""
    check_judge(cfg, check, err, is_int, is_num)
    rr = cfg.reward_model.get("remote")
    if rr is None or not rr.get("url"):
        return
    check(
        "reward_model.remote.url",
        lambda v: isinstance(v, str) and v.startswith(("http://", "https://")),
        "must be an http:// or https:// URL",
    )
    if rr.get("url") and cfg.reward_model.get("judge") is not None and cfg.reward_model.judge.path:
        err("reward_model.remote.url", "set together with reward_model.judge.path: pick one reward source")
    if cfg.custom_reward_function.path:
        err(
            "reward_model.remote.url",
            "set together with custom_reward_function.path: the service scores every response, so the local "
            "function would be ignored; serve it instead (scripts/serve_reward.py --reward_fn PATH:NAME) or unset one",
        )
    check("reward_model.remote.batch_size", lambda v: is_int(v) and v >= 1, "must be an int >= 1")
    check("reward_model.remote.max_concurrency", lambda v: is_int(v) and v >= 1, "must be an int >= 1")
    check("reward_model.remote.timeout_s", lambda v: is_num(v) and v > 0, "must be > 0")
    check("reward_model.remote.max_retries", lambda v: is_int(v) and v >= 0, "must be an int >= 0")
    check("reward_model.remote.backoff_s", lambda v: is_num(v) and v >= 0, "must be >= 0")
    check("reward_model.remote.backoff_max_s", lambda v: is_num(v) and v >= 0, "must be >= 0")
    check(
        "reward_model.remote.max_error_fraction", lambda v: is_num(v) and 0 <= v <= 1, "must be in [0, 1] (1 = never)"
    )


def check_judge(cfg, check, err, is_int, is_num) -> None:
    """`reward_model.judge.*`, when `judge.path` is set."""
    jc = cfg.reward_model.get("judge")
    if jc is None or not jc.get("path"):
        return
    if cfg.custom_reward_function.path:
        err(
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
            err("reward_model.judge.prompt_template", "needs {response}; only {question} {response} {ground_truth}")
    for key in ("max_new_tokens", "max_prompt_length", "batch_size"):
        check(f"reward_model.judge.{key}", lambda v: is_int(v) and v >= 1, "must be an int >= 1")
    check("reward_model.judge.dtype", lambda v: v in ("float32", "bfloat16", "float16"), "float32|bfloat16|float16")
    if not (is_num(jc.min_score) and is_num(jc.max_score) and jc.max_score > jc.min_score):
        err("reward_model.judge.max_score", f"must be > reward_model.judge.min_score ({jc.min_score})")
    elif jc.normalize and jc.max_score <= 0:
        err("reward_model.judge.max_score", "must be > 0 with reward_model.judge.normalize")
