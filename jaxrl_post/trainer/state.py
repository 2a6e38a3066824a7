"""`RLTrainer`'s checkpointable state: `state_dict` / `load_state_dict`, checkpoint save / restore / resume.

`CheckpointMixin` is mixed into `RLTrainer` (trainer.py). What is saved (see `state_dict`): actor/critic
params and optimizer states (a LoRA actor's params are its adapters: the base is rebuilt from
`model.path`), global step, update counters, RNG key, KL controller, data iterator position, non-finite
skip counters, the run's validation before training (`val_before`, reported again by a resumed run
instead of validating the resumed params as if they were the base model); the reference params only as
a pointer (they are the initial actor, rebuilt the same way; with LoRA, the actor with its adapters off).
The on-disk format is in checkpoint.py, the step directories and resume rules in checkpoint_layout.py.

A run stopped by an error does not lose its completed steps where the state is provably that of the last
completed step N (`save_on_error_in_step` / `save_on_error_in_validation`): a `RewardFunctionError` in
the reward stage of step N+1, or a `FilterGroupsError` of its dynamic sampling (before any update; the RNG
and the data position, which the step already advanced, are put back), or one in the validation after
step N. Then step N is checkpointed before the error
propagates, with one line saying so. Not after other errors: a `NonFiniteError` is raised after the
updates ran (the critic may have been updated, the KL controller, update counters and skip counters
moved), and an error inside a jitted update may leave donated params half-written; there the last
scheduled checkpoint stays the one to resume from.
"""

from __future__ import annotations

import contextlib
import json
import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_post.rewards.manager import RewardFunctionError
from jaxrl_post.trainer import checkpoint as ckpt
from jaxrl_post.trainer.dynamic_sampling import FilterGroupsError
from jaxrl_post.trainer.loggers import config_to_dict, save_run_config
from jaxrl_post.trainer.run_files import (
    first_validation,
    is_lead_process,
    keep_previous_config,
    move_aside_old_checkpoints,
    prepare_metrics_file,
    read_run_config,
    resume_config_warning,
    sync,
)
from jaxrl_post.trainer.run_lock import RunLock

# ModelConfig fields that decide the shapes / structure of the params: a checkpoint whose values differ
# cannot be restored into this model (the others, e.g. rope_theta or dtype, load fine)
_SHAPE_KEYS = (
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
_MODEL_HINT = (
    "pass the run's model config (--config.model.*) or --config.trainer.resume_mode=disable (the old run is "
    "moved aside)"
)


class CheckpointMixin:
    """State (de)serialisation and checkpointing of `RLTrainer` (see the module docstring)."""

    def _open_run_dir(self) -> None:
        """Find what to resume from (`trainer.resume_mode`), move an earlier run's checkpoints aside, open the
        checkpointer, resume, prepare `metrics.jsonl` (this run only: an earlier run's file is moved
        aside, a resumed one truncated) and write `config.json` / `config.yaml` (a differing previous
        `config.json` is kept; a resumed run with a changed config prints one warning naming the keys).
        Called once, at the end of `__init__`. First takes the directory's lock (`run_lock.RunLock`,
        process 0; released by `close()`, at exit, or here when opening fails).

        Raises:
          RunDirBusyError: another live run holds the directory (nothing is moved).
          CheckpointError: the checkpoint to resume from cannot be read or does not match the config.
          OSError: an earlier run's `checkpoints/`, `metrics.jsonl` or `config.json` could not be moved aside.
        """
        self.run_lock = None
        if is_lead_process():  # hold the directory before anything in it is moved aside (run_lock.py)
            self.run_lock, notice = RunLock.acquire(self.workdir)
            if notice:
                self._say(notice)
        try:
            self._open_run_dir_locked()
        except BaseException:
            if self.run_lock is not None:
                self.run_lock.release()
            raise

    def _open_run_dir_locked(self) -> None:
        cfg = self.config
        self.resumed_from: str | None = None
        self._checkpoint_config: dict | None = None  # the config saved with the checkpoint resumed from
        self.val_before_metrics: dict[str, float] | None = None  # the run's step-0 validation (kept on resume)
        found = ckpt.find_resume_checkpoint(cfg.trainer.resume_mode, self.workdir, cfg.trainer.resume_from_path)
        own_root = ckpt.checkpoint_dir(self.workdir)
        steps_on_disk = ckpt.list_complete_steps(own_root)
        notice = move_aside_old_checkpoints(own_root, found and found[0], steps_on_disk) if is_lead_process() else None
        sync("checkpoints")
        if notice:
            self._say(notice)
        # a save interrupted by a second Ctrl-C / kill: say which step was lost (orbax would drop it quietly)
        found_here = found is not None and os.path.abspath(found[0]) == os.path.abspath(own_root)
        notice = ckpt.report_unfinished(own_root, found[1] if found_here else None) if is_lead_process() else None
        sync("unfinished")
        if notice:
            self._say(notice)
        self.checkpointer = ckpt.Checkpointer(
            own_root, max_to_keep=cfg.trainer.max_actor_ckpt_to_keep, async_save=bool(cfg.trainer.async_save)
        )
        if found is not None:
            try:
                self.load_checkpoint(*found)
            except BaseException:
                self.checkpointer.close()  # nothing pending: no orbax thread left to print at shutdown
                raise
        if found is not None and self.val_before_metrics is None and is_lead_process():
            # checkpoints written before `host['val_before']` existed: the run's step-0 line of metrics.jsonl
            self.val_before_metrics = first_validation(self.workdir)
        # metrics.jsonl holds this run only: an earlier run's file is moved aside, a resumed one truncated
        resumed_step = self.global_steps if found is not None else None
        notice = prepare_metrics_file(self.workdir, resumed_step) if is_lead_process() else None
        sync("metrics")
        if notice:
            self._say(notice)
        self._write_run_config(found and found[0])

    def _write_run_config(self, resume_root: str | None) -> None:
        """Write `config.json` / `config.yaml` of this start; keep a differing previous `config.json` as
        `config.<stamp>.json`; when resuming, warn about keys that differ from the config the checkpoint was
        written with (`host['config']`; for older checkpoints the resumed run's `config.json`; see
        `run_files.resume_config_warning`). Raises OSError when a file cannot be moved or written."""
        new = config_to_dict(self.config)
        lines = []
        if is_lead_process():
            if resume_root is not None:
                old, source = self._checkpoint_config, "the config saved with it"
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
            self._say(line)

    # ------------------------------------------------------------------------------------ errors
    def _untouched_marks(self) -> str:
        """What a training step changes once its updates begin (params change only with the counters)."""
        return json.dumps(
            [
                self.global_steps,
                self.actor_update_count,
                self.critic_update_count,
                self.kl_ctrl.state_dict(),
                self.actor_guard.state_dict(),
                self.critic_guard.state_dict(),
            ],
            sort_keys=True,
            default=str,
        )

    @contextlib.contextmanager
    def save_on_error_in_step(self):
        """Wrap `next(train_loader)` + `train_step`: on a `RewardFunctionError` or a `FilterGroupsError`
        (dynamic sampling gave too few groups) raised before any update of the step (nothing but the RNG and
        the data position moved; both are put back), checkpoint the last completed step, say so in one line,
        and re-raise the error unchanged. Other errors pass untouched."""
        marks, rng, data_state = self._untouched_marks(), self.rng, self.train_loader.get_state()
        try:
            yield
        except (RewardFunctionError, FilterGroupsError):
            where = f"in step {self.global_steps + 1}"
            if self._untouched_marks() != marks:  # cannot happen today (rewards come before the updates)
                self._say(f"stopped by an error {where} after its updates began; nothing new was saved")
                raise
            self.rng = rng
            self.train_loader.set_state(data_state)
            self._save_after_error(where)
            raise

    @contextlib.contextmanager
    def save_on_error_in_validation(self, step_metrics: dict[str, float]):
        """Wrap the validation after a completed step: on a `RewardFunctionError`, log the step's training
        metrics (so `metrics.jsonl` has its line), checkpoint the step and re-raise. A resumed run continues
        with the next step; the failed validation is not redone."""
        try:
            yield
        except RewardFunctionError:
            self.tracker.log(step_metrics, step=self.global_steps)
            self._save_after_error(f"in the validation after step {self.global_steps}")
            raise

    def _save_after_error(self, where: str) -> None:
        """Checkpoint step `global_steps` (unless it exists or is 0) and wait for it; print one line. A
        failed save is reported in the line, not raised (the original error is the one to propagate)."""
        n = self.global_steps
        fix = "fix the cause and rerun the same command to resume"
        if n == 0:
            self._say(f"stopped by an error {where}; no step had completed, nothing to save")
            return
        path = self.checkpointer.step_path(n)
        try:
            started = self.save_checkpoint()  # False when step n is already saved
            self.checkpointer.wait_until_finished()
        except ckpt.CheckpointError as e:
            self._say(f"stopped by an error {where}; saving the checkpoint of step {n} failed too: {e}")
            return
        did = "saved to" if started else "is"
        self._say(f"stopped by an error {where}; checkpoint of step {n} {did} {path}; {fix}")

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to resume exactly (pytrees of arrays + JSON-able host state; see checkpoint.py).

        The reference params are included only when they differ from the initial actor (never in this
        trainer); otherwise `host['reference']` points at how they are rebuilt.
        """
        cfg = self.config
        ref_saved = self.use_ref and not self.ref_is_initial
        return {
            "actor": {"params": self.actor_params, "opt_state": self.actor_opt_state},
            "critic": ({"params": self.critic_params, "opt_state": self.critic_opt_state} if self.use_critic else None),
            "ref": {"params": self.ref_params} if ref_saved else None,
            "rng": np.asarray(jax.random.key_data(self.rng)),  # host value: the same on every process
            "host": {
                "global_steps": self.global_steps,
                "actor_update_count": self.actor_update_count,
                "critic_update_count": self.critic_update_count,
                "kl_ctrl": self.kl_ctrl.state_dict(),
                "data_iter": self.train_loader.get_state(),
                "nonfinite": {"actor": self.actor_guard.state_dict(), "critic": self.critic_guard.state_dict()},
                "reference": (
                    None
                    if not self.use_ref
                    else "saved"
                    if ref_saved
                    else ckpt.reference_pointer(
                        model_path=None if cfg.model.random_init else cfg.model.path,
                        random_init=bool(cfg.model.random_init),
                        seed=int(cfg.trainer.seed),
                    )
                ),
                "model": ckpt.model_metadata(
                    self.actor_model.config,
                    cfg.model.tokenizer_path or cfg.model.path,
                    lora=None if self.lora is None else self.lora.to_dict(),
                    base=ckpt.reference_pointer(
                        model_path=None if cfg.model.random_init else cfg.model.path,
                        random_init=bool(cfg.model.random_init),
                        seed=int(cfg.trainer.seed),
                    ),
                ),
                "total_training_steps": self.total_training_steps,
                "val_before": getattr(self, "val_before_metrics", None),  # reported again by a resumed run
                "config": config_to_dict(cfg),  # what a resume with another config is compared with
            },
        }

    def save_checkpoint(self) -> bool:
        """Start an (async) checkpoint of the current state as step `global_steps`; False if one exists."""
        return self.checkpointer.save(self.global_steps, self.state_dict())

    def _open_checkpoint_dir(self, root: str) -> ckpt.Checkpointer:
        if os.path.abspath(root) == self.checkpointer.directory:
            return self.checkpointer
        return ckpt.Checkpointer(root, read_only=True)

    def load_checkpoint(self, root: str, step: int) -> None:
        """Restore the full training state of `<root>/global_step_<step>` into this trainer (arrays go
        straight to the current shardings).

        Raises:
          CheckpointError: the step cannot be read, or its model does not match this trainer's (the message
            names the differing model fields, e.g. `hidden_size: checkpoint 64, config 32`).
        """
        c = self._open_checkpoint_dir(root)
        host = c.read_host(step)
        items = set(host.get("items", []))
        self._check_model_matches(host, c.step_path(step))  # before any array is read
        like = {k: v for k, v in self.state_dict().items() if k != "host"}
        if self.use_ref and "ref.params" in items:
            like["ref"] = {"params": self.ref_params}
        try:
            state = c.restore(step, like=like)
        except ckpt.CheckpointError as e:
            if "shape" not in str(e).lower():
                raise
            detail = str(e).split(". Truncating")[0]  # orbax's advice to pad/truncate does not apply here
            raise ckpt.CheckpointError(
                f"the checkpoint's model does not match the config: {c.step_path(step)} holds params of other "
                f"shapes ({detail}); {_MODEL_HINT}"
            ) from e
        self.load_state_dict(state)
        self._checkpoint_config = host.get("config")  # None in checkpoints written before it was saved
        self.resumed_from = c.step_path(step)
        n, total = self.global_steps, self.total_training_steps
        self._say(f"resumed from step {n}{f' of {total}' if n < total else ''} ({self.resumed_from})")

    def _check_model_matches(self, host: dict[str, Any], path: str) -> None:
        """Raise `CheckpointError` naming the shape-deciding model fields (`_SHAPE_KEYS`) whose values in the
        checkpoint's `host['model']` differ from this trainer's model (no check when it has none)."""
        saved = (host.get("model") or {}).get("config")
        if not saved:
            return
        cur = ckpt.model_metadata(self.actor_model.config, None)["config"]
        bad = [k for k in _SHAPE_KEYS if k in saved and saved.get(k) != cur.get(k)]
        saved_lora, cur_lora = host["model"].get("lora"), None if self.lora is None else self.lora.to_dict()
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
                f"the checkpoint's model does not match the config: {what} (checkpoint {path}); {_MODEL_HINT}"
            )

    def load_actor_params_from(self, root: str, step: int) -> None:
        """Load only the actor params of a checkpoint (evaluation / export); optimizer state untouched."""
        c = self._open_checkpoint_dir(root)
        got = c.restore(step, like={"actor": {"params": self.actor_params}})
        self.actor_params = jax.tree.map(
            lambda n, l: jax.device_put(n, l.sharding), got["actor"]["params"], self.actor_params
        )
        self.sync_weights()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Inverse of `state_dict` (arrays are placed like the current ones)."""
        place = lambda new, like: jax.tree.map(lambda n, l: jax.device_put(n, l.sharding), new, like)
        self.actor_params = place(state["actor"]["params"], self.actor_params)
        self.actor_opt_state = place(state["actor"]["opt_state"], self.actor_opt_state)
        if self.use_critic and state.get("critic") is not None:
            self.critic_params = place(state["critic"]["params"], self.critic_params)
            self.critic_opt_state = place(state["critic"]["opt_state"], self.critic_opt_state)
        self.rng = jax.random.wrap_key_data(jnp.asarray(state["rng"]))
        host = state["host"]
        self.global_steps = int(host["global_steps"])
        self.actor_update_count = int(host["actor_update_count"])
        self.critic_update_count = int(host["critic_update_count"])
        self.kl_ctrl.load_state_dict(host["kl_ctrl"])
        self.train_loader.set_state(host["data_iter"])
        nonfinite = host.get("nonfinite") or {}
        self.actor_guard.load_state_dict(nonfinite.get("actor", {}))
        self.critic_guard.load_state_dict(nonfinite.get("critic", {}))
        self.val_before_metrics = host.get("val_before")
        if state.get("ref") is not None and self.use_ref:
            self.ref_params = place(state["ref"]["params"], self.ref_params)
        self.sync_weights()
