"""`RLTrainer`'s checkpointable state: `state_dict` / `load_state_dict`, checkpoint save / restore / resume.

`CheckpointMixin` is mixed into `RLTrainer` (trainer.py). What is saved (see `state_dict`): actor/critic
params and optimizer states, global step, update counters, RNG key, KL controller, data iterator
position, non-finite skip counters; the reference params only as a pointer (they are the initial actor,
rebuilt the same way). The on-disk format and the resume rules are in checkpoint.py.
"""

from __future__ import annotations

import os
from typing import Any

import jax
import jax.numpy as jnp

from jaxrl_post.trainer import checkpoint as ckpt
from jaxrl_post.trainer.run_files import is_lead_process, move_aside_old_checkpoints, prepare_metrics_file, sync


class CheckpointMixin:
    """State (de)serialisation and checkpointing of `RLTrainer` (see the module docstring)."""

    def _open_run_dir(self) -> None:
        """Find what to resume from (`trainer.resume_mode`), move an earlier run's checkpoints aside, open the
        checkpointer, resume, and prepare `metrics.jsonl` (this run only: an earlier run's file is moved
        aside, a resumed one truncated). Called once, at the end of `__init__`.

        Raises:
          CheckpointError: the checkpoint to resume from cannot be read or does not match the config.
          OSError: an earlier run's `checkpoints/` or `metrics.jsonl` could not be moved aside.
        """
        cfg = self.config
        self.resumed_from: str | None = None
        found = ckpt.find_resume_checkpoint(cfg.trainer.resume_mode, self.workdir, cfg.trainer.resume_from_path)
        own_root = ckpt.checkpoint_dir(self.workdir)
        steps_on_disk = ckpt.list_complete_steps(own_root)
        notice = move_aside_old_checkpoints(own_root, found and found[0], steps_on_disk) if is_lead_process() else None
        sync("checkpoints")
        if notice:
            self._say(notice)
        self.checkpointer = ckpt.Checkpointer(
            own_root, max_to_keep=cfg.trainer.max_actor_ckpt_to_keep, async_save=bool(cfg.trainer.async_save)
        )
        if found is not None:
            self.load_checkpoint(*found)
        # metrics.jsonl holds this run only: an earlier run's file is moved aside, a resumed one truncated
        resumed_step = self.global_steps if found is not None else None
        notice = prepare_metrics_file(self.workdir, resumed_step) if is_lead_process() else None
        sync("metrics")
        if notice:
            self._say(notice)

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
            "rng": jax.random.key_data(self.rng),
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
                "model": ckpt.model_metadata(self.actor_model.config, cfg.model.tokenizer_path or cfg.model.path),
                "total_training_steps": self.total_training_steps,
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
        straight to the current shardings)."""
        c = self._open_checkpoint_dir(root)
        items = set(c.read_host(step).get("items", []))
        like = {k: v for k, v in self.state_dict().items() if k != "host"}
        if self.use_ref and "ref.params" in items:
            like["ref"] = {"params": self.ref_params}
        self.load_state_dict(c.restore(step, like=like))
        self.resumed_from = c.step_path(step)
        self._say(f"resumed from step {self.global_steps} of {self.total_training_steps} ({self.resumed_from})")

    def load_actor_params_from(self, root: str, step: int) -> None:
        """Load only the actor params of a checkpoint (evaluation / export); optimizer state untouched."""
        c = self._open_checkpoint_dir(root)
        got = c.restore(step, like={"actor": {"params": self.actor_params}})
        self.actor_params = jax.tree.map(
            lambda n, l: jax.device_put(n, l.sharding), got["actor"]["params"], self.actor_params
        )
        self._sync_rollout_weights()

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
        if state.get("ref") is not None and self.use_ref:
            self.ref_params = place(state["ref"]["params"], self.ref_params)
        self._sync_rollout_weights()
