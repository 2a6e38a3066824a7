"""A run's directory: its lock, checkpointer, resume, `metrics.jsonl` and `config.json`, and the saves after an error.

`RunDir` is composed into `RLTrainer` (trainer.py). `open(owner)` is called once, at the end of the trainer's
construction: it takes the directory's lock, finds what to resume from (`trainer.resume_mode`), moves an
earlier run's checkpoints aside, opens the checkpointer, resumes through `owner.load_checkpoint(root, step)`,
prepares `metrics.jsonl` and writes `config.json` / `config.yaml`. `restore` reads one checkpoint (the model
check first, then the arrays); what is saved is `train_state.state_dict`.

A run stopped by an error does not lose its completed steps where the state is provably that of the last
completed step N (`save_on_error_in_step` / `save_on_error_in_validation`): a `RewardFunctionError` in
the reward stage of step N+1, a `ToolError` of its rollout, or a `FilterGroupsError` of its dynamic sampling
(before any update; the RNG and the data position, which the step already advanced, are put back), or one in
the validation after step N. Then step N is checkpointed before the error propagates, with one line saying so.
Not after other errors: a `NonFiniteError` is raised after the updates ran (the critic may have been updated, the KL
controller, update counters and skip counters moved), and an error inside a jitted update may leave donated
params half-written; there the last scheduled checkpoint stays the one to resume from.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from typing import Any

from jaxrl_post.engine.run import checkpoint as ckpt
from jaxrl_post.engine.run.run_files import (
    config_to_dict,
    first_validation,
    has_metrics,
    is_lead_process,
    keep_previous_config,
    move_aside_old_checkpoints,
    prepare_metrics_file,
    read_run_config,
    resume_config_warning,
    save_run_config,
    sync,
)
from jaxrl_post.engine.run.run_lock import RunLock
from jaxrl_post.errors import FilterGroupsError
from jaxrl_post.rewards.manager import RewardFunctionError
from jaxrl_post.rollout.tools import ToolError

# the errors a run stops on with a checkpoint (the user fixes the cause and resumes); others pass untouched
SAVED_ON_ERROR = (RewardFunctionError, ToolError, FilterGroupsError)

# ModelConfig fields that decide the shapes / structure of the params: a checkpoint whose values differ
# cannot be restored into this model (the others, e.g. rope_theta or dtype, load fine)
SHAPE_KEYS = (
    "family",
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_layers",
    "num_heads",
    "num_kv_heads",
    "head_dim",
    "tie_word_embeddings",
    "qkv_bias",
    "qk_norm",
    "post_norms",
)
MODEL_HINT = (
    "pass the run's model config (--config.model.*) or --config.trainer.resume_mode=disable (the old run is "
    "moved aside)"
)


def check_model_matches(host: dict[str, Any], path: str, model_config, lora) -> None:
    """Raise `CheckpointError` naming the shape-deciding model fields (`SHAPE_KEYS`) whose values in the
    checkpoint's `host['model']` differ from `model_config` (no check when it has none), or a LoRA setting
    (`lora`: a `LoraConfig` or None) that differs from the checkpoint's."""
    saved = (host.get("model") or {}).get("config")
    if not saved:
        return
    cur = ckpt.model_metadata(model_config, None)["config"]
    bad = [k for k in SHAPE_KEYS if k in saved and saved.get(k) != cur.get(k)]
    saved_lora, cur_lora = host["model"].get("lora"), None if lora is None else lora.to_dict()
    if saved_lora != cur_lora:  # the actor params are the adapters (LoRA) or all weights: not interchangeable
        lora_keys = ("rank", "alpha", "target_modules")
        show = lambda d: "off (full fine-tuning)" if d is None else ", ".join(f"{k}={d[k]}" for k in lora_keys)
        raise ckpt.CheckpointError(
            f"the checkpoint's LoRA does not match the config: checkpoint {show(saved_lora)}, config "
            f"{show(cur_lora)} (checkpoint {path}); pass the run's model.lora_* keys or "
            "--config.trainer.resume_mode=disable (the old run is moved aside)"
        )
    if bad:
        what = "; ".join(f"{k}: checkpoint {saved.get(k)!r}, config {cur.get(k)!r}" for k in bad)
        raise ckpt.CheckpointError(
            f"the checkpoint's model does not match the config: {what} (checkpoint {path}); {MODEL_HINT}"
        )


class RunDir:
    """One run's directory (see the module docstring).

    Args:
      config: the job ConfigDict (`trainer.default_local_dir`, `resume_mode`, `resume_from_path`,
        `max_actor_ckpt_to_keep`, `async_save`).
      say: writes one console line (process 0).
      tracker: the run's `Tracking` (console + metrics.jsonl + loggers).

    Attributes set by `open`: `checkpointer`, `run_lock` (None off process 0), `resumed_from` (the step
    directory resumed from, or None), `checkpoint_config` (the config saved with it).
    """

    def __init__(self, config, say: Callable[[str], None], tracker):
        self.config = config
        self.workdir = config.trainer.default_local_dir
        self.say = say
        self.tracker = tracker
        self.checkpointer: ckpt.Checkpointer | None = None
        self.run_lock: RunLock | None = None
        self.resumed_from: str | None = None
        self.checkpoint_config: dict | None = None
        self.new_directory = True  # no run has logged metrics here before (set by `open`; the console legend)

    def open(self, owner) -> None:
        """Take the lock, resume (`owner.load_checkpoint(root, step)`), prepare `metrics.jsonl`, write the
        config files. `owner` also provides `global_steps` and `val_before_metrics` (read / set).

        Raises:
          RunDirBusyError: another live run holds the directory (nothing is moved).
          CheckpointError: the checkpoint to resume from cannot be read or does not match the config.
          OSError: an earlier run's `checkpoints/`, `metrics.jsonl` or `config.json` could not be moved aside.
        """
        if is_lead_process():  # hold the directory before anything in it is moved aside (run_lock.py)
            self.run_lock, notice = RunLock.acquire(self.workdir)
            if notice:
                self.say(notice)
        try:
            self._open_locked(owner)
        except BaseException:
            if self.run_lock is not None:
                self.run_lock.release()
            raise

    def _open_locked(self, owner) -> None:
        cfg = self.config
        found = ckpt.find_resume_checkpoint(cfg.trainer.resume_mode, self.workdir, cfg.trainer.resume_from_path)
        own_root = ckpt.checkpoint_dir(self.workdir)
        steps_on_disk = ckpt.list_complete_steps(own_root)
        notice = move_aside_old_checkpoints(own_root, found and found[0], steps_on_disk) if is_lead_process() else None
        sync("checkpoints")
        if notice:
            self.say(notice)
        # a save interrupted by a second Ctrl-C / kill: say which step was lost (orbax would drop it quietly)
        found_here = found is not None and os.path.abspath(found[0]) == os.path.abspath(own_root)
        notice = ckpt.report_unfinished(own_root, found[1] if found_here else None) if is_lead_process() else None
        sync("unfinished")
        if notice:
            self.say(notice)
        self.checkpointer = ckpt.Checkpointer(
            own_root, max_to_keep=cfg.trainer.max_actor_ckpt_to_keep, async_save=bool(cfg.trainer.async_save)
        )
        if found is not None:
            try:
                owner.load_checkpoint(*found)
            except BaseException:
                self.checkpointer.close()  # nothing pending: no orbax thread left to print at shutdown
                raise
        if found is not None and owner.val_before_metrics is None and is_lead_process():
            # checkpoints written before `host['val_before']` existed: the run's step-0 line of metrics.jsonl
            owner.val_before_metrics = first_validation(self.workdir)
        self.new_directory = not has_metrics(self.workdir)  # before an earlier run's file is moved aside
        # metrics.jsonl holds this run only: an earlier run's file is moved aside, a resumed one truncated
        resumed_step = owner.global_steps if found is not None else None
        notice = prepare_metrics_file(self.workdir, resumed_step) if is_lead_process() else None
        sync("metrics")
        if notice:
            self.say(notice)
        self.write_run_config(found and found[0])

    def write_run_config(self, resume_root: str | None) -> None:
        """Write `config.json` / `config.yaml` of this start; keep a differing previous `config.json` as
        `config.<stamp>.json`; when resuming, warn about keys that differ from the config the checkpoint was
        written with (`host['config']`; for older checkpoints the resumed run's `config.json`; see
        `run_files.resume_config_warning`). Raises OSError when a file cannot be moved or written."""
        new = config_to_dict(self.config)
        lines = []
        if is_lead_process():
            if resume_root is not None:
                old, source = self.checkpoint_config, "the config saved with it"
                if not old:
                    run_dir = os.path.dirname(resume_root.rstrip(os.sep))  # <run>/checkpoints -> <run>
                    old, source = read_run_config(run_dir), f"the run's {os.path.join(run_dir, 'config.json')}"
                warn = old and resume_config_warning(old, new, self.resumed_from, source=source)
                lines += [warn] if warn else []
            aside = keep_previous_config(self.workdir, new)
            if aside:
                lines.append(f"{os.path.join(self.workdir, 'config.json')} of the previous start kept as {aside}")
        sync("config")
        if is_lead_process():
            save_run_config(self.config, self.workdir)
        for line in lines:
            self.say(line)

    # ------------------------------------------------------------------------------------ checkpoints
    def open_checkpoint_dir(self, root: str) -> ckpt.Checkpointer:
        """The run's own checkpointer for its own `checkpoints/`, else a read-only one on `root`."""
        if os.path.abspath(root) == self.checkpointer.directory:
            return self.checkpointer
        return ckpt.Checkpointer(root, read_only=True)

    def restore(self, root: str, step: int, like: Callable[[set[str]], dict], *, model_config, lora) -> dict:
        """Read `<root>/global_step_<step>`: its host JSON and model check first (`check_model_matches`), then
        the arrays shaped as `like(items)` (`items`: the saved item names). Sets `resumed_from` and
        `checkpoint_config`; returns the restored tree (its `host` included).

        Raises:
          CheckpointError: the step cannot be read, or its model does not match this trainer's (the message
            names the differing model fields, e.g. `hidden_size: checkpoint 64, config 32`).
        """
        c = self.open_checkpoint_dir(root)
        host = c.read_host(step)
        items = set(host.get("items", []))
        check_model_matches(host, c.step_path(step), model_config, lora)  # before any array is read
        try:
            state = c.restore(step, like=like(items))
        except ckpt.CheckpointError as e:
            if "shape" not in str(e).lower():
                raise
            detail = str(e).split(". Truncating")[0]  # orbax's advice to pad/truncate does not apply here
            raise ckpt.CheckpointError(
                f"the checkpoint's model does not match the config: {c.step_path(step)} holds params of other "
                f"shapes ({detail}); {MODEL_HINT}"
            ) from e
        self.checkpoint_config = host.get("config")  # None in checkpoints written before it was saved
        self.resumed_from = c.step_path(step)
        return state

    # ------------------------------------------------------------------------------------ errors
    def save_after_error(self, where: str, step: int, save: Callable[[], bool]) -> None:
        """Checkpoint step `step` with `save()` (unless it exists or is 0) and wait for it; print one line. A
        failed save is reported in the line, not raised (the original error is the one to propagate)."""
        fix = "fix the cause and rerun the same command to resume"
        if step == 0:
            self.say(f"stopped by an error {where}; no step had completed, nothing to save")
            return
        path = self.checkpointer.step_path(step)
        try:
            started = save()  # False when the step is already saved
            self.checkpointer.wait_until_finished()
        except ckpt.CheckpointError as e:
            self.say(f"stopped by an error {where}; saving the checkpoint of step {step} failed too: {e}")
            return
        did = "saved to" if started else "is"
        self.say(f"stopped by an error {where}; checkpoint of step {step} {did} {path}; {fix}")

    @contextlib.contextmanager
    def save_on_error_in_step(self, step: int, marks: Callable[[], str], snapshot, restore, save):
        """Wrap step `step + 1` (`next(train_loader)` + `train_step`): on a `RewardFunctionError`, `ToolError` or
        `FilterGroupsError` raised before any update of the step (`marks()` unchanged: nothing but the RNG
        and the data position moved), `restore(snapshot)` puts both back, step `step` is checkpointed with
        `save()` and the error re-raised unchanged. Other errors pass untouched."""
        before = marks()
        try:
            yield
        except SAVED_ON_ERROR:
            where = f"in step {step + 1}"
            if marks() != before:  # a split async run's background producer: joined after the updates
                self.say(f"stopped by an error {where} after its updates began; nothing new was saved")
                raise
            restore(snapshot)
            self.save_after_error(where, step, save)
            raise

    @contextlib.contextmanager
    def save_on_error_in_validation(self, step: int, step_metrics: dict[str, float], save):
        """Wrap the validation after completed step `step`: on a `RewardFunctionError` or `ToolError`, log the
        step's training metrics (so `metrics.jsonl` has its line), checkpoint the step and re-raise. A resumed run
        continues with the next step; the failed validation is not redone."""
        try:
            yield
        except (RewardFunctionError, ToolError):
            self.tracker.log(step_metrics, step=step)
            self.save_after_error(f"in the validation after step {step}", step, save)
            raise
