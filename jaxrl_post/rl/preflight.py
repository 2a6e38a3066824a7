"""Pre-flight checks that turn a user's mistake into one `ConfigError` naming the config key (`main` prints it
as one `error: ...` line): the working directory, reasoning-gym task names, too few / too long prompts, the
custom reward function. Used by `builders.py`.
"""

from __future__ import annotations

import os
import tempfile
from typing import Any

from jaxrl_post.engine.run.run_lock import check_not_busy
from jaxrl_post.errors import ConfigError
from jaxrl_post.models.hf_io import check_causal_lm_dir
from jaxrl_post.models.resolve import _HUB_GGUF_RE, _HUB_ID_RE, check_model_files, resolve_model_path
from jaxrl_post.rewards import load_custom_reward_fn
from jaxrl_post.rewards.remote import retry_delay
from jaxrl_post.runtime import distributed

__all__ = [
    "critic_warmup_warning",
    "check_model_path",
    "check_remote_reward",
    "check_reasoning_gym_task",
    "check_workdir",
    "load_custom_reward",
    "not_enough_prompts_message",
]


def check_workdir(cfg: Any) -> None:
    """Check that `trainer.default_local_dir` can be created and written, and that no other live run holds
    it (`run_lock.check_not_busy`, process 0 only). Nothing is left behind: a probe directory is created
    and removed in the nearest existing directory (a file system such as /proc refuses it).

    Raises:
      ConfigError: naming `trainer.default_local_dir` when it, or the nearest existing directory above it,
        is a regular file, or that directory is not writable (read-only directory or file system), or
        cannot hold a directory (a pseudo file system such as /proc or /sys).
      RunDirBusyError: another live run holds the directory (its `run.lock`).
    """
    given = cfg.trainer.default_local_dir
    key = f"config.trainer.default_local_dir={given!r}"
    path = os.path.abspath(str(given))
    existing = path
    while not os.path.exists(existing) and os.path.dirname(existing) != existing:
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        what = "is a file" if existing == path else f"is under {existing}, which is a file"
        raise ConfigError(f"{key}: the run's working directory {what}, not a directory; choose another path")
    if not os.access(existing, os.W_OK | os.X_OK):
        where = "" if existing == path else f" ({existing}, where it would be created)"
        raise ConfigError(
            f"{key}: the run's working directory{where} is not writable; choose a writable path "
            "(--config.trainer.default_local_dir=runs/my_run)"
        )
    try:  # os.access says yes for root on /proc, /sys; creating a directory there still fails
        os.rmdir(tempfile.mkdtemp(prefix=".jaxrl_post_probe_", dir=existing))
    except OSError as e:
        raise ConfigError(
            f"{key}: the file system at {existing} cannot hold the run's working directory (creating a directory "
            f"there failed: {e.strerror or e}); choose a path on a normal disk "
            "(--config.trainer.default_local_dir=runs/my_run)"
        ) from e
    if os.path.isdir(path):
        if distributed.is_main():
            check_not_busy(path)


def check_model_path(cfg: Any) -> None:
    """Check, before anything is loaded, that `model.path` names a model that exists (a local HF directory,
    a .gguf file or an installed alias; `models.resolve_model_path`) unless `model.random_init`. A Hugging
    Face hub id (`org/name`) that is not a local path is left to the loader (checking it needs the hub).

    Raises:
      ConfigError: naming `model.path` (missing path, a directory that is not a checkpoint, a file that is
        not a .gguf, a corrupt or truncated model file (`models.resolve.check_model_files`), an alias whose
        package is not installed, a reward model's *ForSequenceClassification directory except for the
        reward-model trainer, or no model.path at all).
    """
    if cfg.model.random_init:
        return

    given = cfg.model.path
    key = f"config.model.path={given!r}"
    if not given:
        raise ConfigError(f"{key}: no model given; set --config.model.path=<HF directory | .gguf file | alias>")
    name = os.path.expanduser(str(given))
    if not os.path.exists(name) and (_HUB_ID_RE.match(name) or _HUB_GGUF_RE.match(name)):
        return
    try:
        kind, local = resolve_model_path(name)
        check_model_files(kind, local)  # a corrupt or truncated file, named
        if kind == "hf_dir" and cfg.get("trainer_type", "rl") != "reward_model":  # a reward model may start from one
            check_causal_lm_dir(local)
    except (FileNotFoundError, ValueError) as e:
        raise ConfigError(f"{key}: {e}") from e


def check_remote_reward(cfg: Any) -> None:
    """Check, before the model is loaded, that the remote reward service of `reward_model.remote.url` accepts
    TCP connections (a wrong host or port, or a server not started, is found here, not at the first reward).
    Tries `max_retries + 1` times, `timeout_s` each, with the client's backoff (a server still starting gets
    that long). The path and the protocol are checked by the first request (an HTTP 4xx stops the run then):
    a generic service need not answer anything but its scoring endpoint.

    Raises:
      ConfigError: naming `reward_model.remote.url`, the host and port, and the last connection error.
    """
    import socket
    import time
    from urllib.parse import urlsplit

    rr = cfg.reward_model.remote
    if not rr.url:
        return
    key = f"config.reward_model.remote.url={rr.url!r}"
    try:
        parts = urlsplit(str(rr.url))
        host, port = parts.hostname, parts.port or (443 if parts.scheme == "https" else 80)
    except ValueError as e:  # a port that is not a number
        raise ConfigError(f"{key}: not a valid URL ({e})") from e
    if parts.scheme not in ("http", "https") or not host:
        raise ConfigError(f"{key}: not an http:// or https:// URL with a host")
    tries = int(rr.max_retries) + 1
    for k in range(tries):
        if k:
            time.sleep(retry_delay(k - 1, rr.backoff_s, rr.backoff_max_s))
        try:
            socket.create_connection((host, port), timeout=float(rr.timeout_s)).close()
            return
        except OSError as e:
            error = e.strerror or str(e) or type(e).__name__
    raise ConfigError(
        f"{key}: cannot connect to {host}:{port} ({error}; {tries} attempts); start the reward service first "
        "(python scripts/serve_reward.py --reward_fn FILE.py --port PORT) or fix the URL"
    )


def critic_warmup_warning(critic_warmup: int, total_training_steps: int) -> str | None:
    """The warning printed when `trainer.critic_warmup >= total_training_steps` (the actor would never be
    updated: only steps from `critic_warmup` on update it), else None."""
    if int(critic_warmup) < int(total_training_steps):
        return None
    return (
        f"warning: trainer.critic_warmup={critic_warmup} >= total_training_steps={total_training_steps}: the actor "
        "never updates (only the critic trains); lower --config.trainer.critic_warmup"
    )


def check_reasoning_gym_task(key: str, spec: str, one: str) -> None:
    """Raises ConfigError when `one` is 'reasoning_gym:<task>' with a task reasoning-gym does not register."""
    if not one.startswith(("reasoning_gym:", "reasoning_gym/")):
        return
    import difflib

    from reasoning_gym.factory import DATASETS

    task = one.split(":", 1)[1] if ":" in one else one.split("/", 1)[1]
    if task in DATASETS:
        return
    names = sorted(DATASETS)
    close = difflib.get_close_matches(task, names, n=3)
    hint = f"did you mean {close}? " if close else ""
    raise ConfigError(
        f"config.{key}={spec!r}: reasoning-gym has no task {task!r}; {hint}valid tasks ({len(names)}) include "
        f"{names[:8]} (all: python -c 'import reasoning_gym.factory as f; print(sorted(f.DATASETS))')"
    )


def not_enough_prompts_message(cfg: Any, files_key: str, spec: Any, e) -> str:
    """ConfigError text for a `pipeline.NotEnoughPromptsError`: names the key to change and a value."""
    lengths = sorted(e.lengths)
    longest, median = (lengths[-1], lengths[len(lengths) // 2]) if lengths else (0, 0)
    where = f"config.{files_key}={spec!r}"
    if e.num_kept == 0 and e.num_rows:
        return (
            f"config.data.max_prompt_length={e.max_prompt_length}: all {e.num_rows} prompts of {where} are longer "
            f"(longest {longest}, median {median} tokens) and are dropped (data.filter_overlong_prompts=True); "
            f"set --config.data.max_prompt_length={longest} (the longest prompt) or more"
        )
    filtered = (
        f" after dropping {e.num_filtered} longer than data.max_prompt_length={e.max_prompt_length}"
        if e.num_filtered
        else ""
    )
    return (
        f"config.data.train_batch_size={e.batch_size}: only {e.num_kept} prompts of {where} are left{filtered}, "
        f"fewer than one batch; set --config.data.train_batch_size={e.num_kept} or less, or use more data"
    )


def load_custom_reward(cfg: Any):
    """`rewards.load_custom_reward_fn` of `custom_reward_function.path/name` (None when no path is set).

    Raises:
      ConfigError: naming `custom_reward_function.path` (file missing, or it fails to import: the error
        text, e.g. a SyntaxError's file and line, is kept) or `custom_reward_function.name` (no such
        callable in the file: lists the file's callables).
    """

    crf = cfg.custom_reward_function
    try:
        return load_custom_reward_fn(crf.path, crf.name)
    except (FileNotFoundError, ImportError) as e:
        raise ConfigError(f"config.custom_reward_function.path={crf.path!r}: {e}") from e
    except (AttributeError, TypeError) as e:
        raise ConfigError(f"config.custom_reward_function.name={crf.name!r}: {e}") from e
