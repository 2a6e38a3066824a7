"""`RLTrainer`'s mini-batch update loops (actor, critic) and the metrics of one training step.

`UpdatesMixin` is mixed into `RLTrainer` (trainer.py); its methods read the trainer's config, batch
geometry and jitted update fns, and advance its params, optimizer states and update counters. The batch
`b` is the step's host batch: numpy arrays with B = `batch_size` rows (responses), token fields [B, T] and
response fields [B, response_length].
"""

from __future__ import annotations

from collections.abc import Iterator

import jax
import numpy as np

from jaxrl_post.batch_keys import ACTOR_UPDATE_KEYS, CRITIC_UPDATE_KEYS
from jaxrl_post.protocol import DataProto
from jaxrl_post.trainer import metrics as metrics_lib


def minibatches(n_rows: int, mini: int, epochs: int, shuffle: bool, rng: np.random.Generator) -> Iterator[np.ndarray]:
    """Row indices of each mini-batch: `epochs` passes over `n_rows` rows in chunks of `mini` (a fresh
    permutation per epoch when `shuffle`)."""
    for _ in range(epochs):
        perm = rng.permutation(n_rows) if shuffle else np.arange(n_rows)
        for i in range(0, n_rows, mini):
            yield perm[i : i + mini]


class UpdatesMixin:
    """Actor/critic update loops and per-step metrics of `RLTrainer` (see the module docstring)."""

    def _update_actor(self, b: dict[str, np.ndarray], train_mask: np.ndarray, rng) -> dict[str, float]:
        """Actor updates over shuffled mini-batches of `b`, training the tokens of `train_mask [B, R]`."""
        a = self.config.actor
        skip = {"loss_mask"} | ({"old_log_probs"} if self.on_policy else set())
        skip |= set() if a.use_kl_loss else {"ref_log_prob"}  # KL in reward only: the update does not need it
        keys = [k for k in ACTOR_UPDATE_KEYS if k in b and k not in skip]
        out = []
        for idx in minibatches(self.batch_size, self.actor_mini, int(a.ppo_epochs), bool(a.shuffle), rng):
            mb = {k: b[k][idx] for k in keys}
            mb["loss_mask"] = train_mask[idx]
            put = self._put(mb) if self.actor_spec is None else self._put_packed(self._pack(mb, self.actor_spec))
            args = (self.actor_params, self.actor_opt_state, put)
            if self.actor_frozen is not None:  # LoRA: the adapters are trained, the base is an argument
                args += (self.actor_frozen,)
            self.actor_params, self.actor_opt_state, m = self._actor_update(*args)
            out.append((m, self.actor_update_count))
            self.actor_update_count += 1
        # no host sync inside the loop (the next mini-batch is packed while the device runs this one)
        out = [dict(jax.device_get(m), lr=float(self.actor_lr(n))) for m, n in out]
        guard = self.actor_guard.observe([m["update_skipped"] for m in out], step=self.global_steps + 1)
        red = metrics_lib.reduce_metrics(out)
        res = {f"actor/{k}": v for k, v in red.items() if k not in ("rollout_probs_diff_mean", "loss")}
        res.update(guard)
        if "rollout_probs_diff_mean" in red:
            res["training/rollout_probs_diff_mean"] = red["rollout_probs_diff_mean"]
        if a.use_kl_loss:
            res["actor/kl_coef"] = float(a.kl_loss_coef)
        return res

    def _rollout_correction(self, b: dict[str, np.ndarray], train_mask: np.ndarray) -> tuple[np.ndarray, dict]:
        """verl's rollout correction on the whole batch (`rollout_corr.compute_rollout_correction_and_rejection_mask`):
        `b["rollout_is_weights"] [B, R]` (IS on) multiplies the per-token policy loss after clipping; rejected
        tokens leave `train_mask` (actor and critic losses, every `loss_agg_mode` normaliser); advantages
        keep the rollout's `loss_mask`. Returns `(train_mask [B, R] int32, metrics)`: the `rollout_corr/*` and
        `training/rollout_probs_diff_*` metrics."""
        from jaxrl_post.rollout_corr import compute_rollout_correction_and_rejection_mask

        rc = self.config.algorithm.rollout_correction
        if not np.any(train_mask):
            return train_mask, {}
        weights, mask, metrics = compute_rollout_correction_and_rejection_mask(
            b["old_log_probs"],
            b["rollout_log_probs"],
            train_mask,
            rollout_is=rc.rollout_is,
            rollout_is_threshold=rc.rollout_is_threshold,
            rollout_is_batch_normalize=bool(rc.rollout_is_batch_normalize),
            rollout_rs=rc.rollout_rs,
            rollout_rs_threshold=rc.rollout_rs_threshold,
        )
        if weights is not None:
            b["rollout_is_weights"] = np.asarray(weights, np.float32)
        return np.asarray(mask).astype(np.int32), {k: float(v) for k, v in jax.device_get(metrics).items()}

    def _update_critic(self, b: dict[str, np.ndarray], train_mask: np.ndarray, rng) -> dict[str, float]:
        """Critic updates over shuffled mini-batches of `b`, fitting values on the tokens of `train_mask`."""
        c = self.config.critic
        keys = [k for k in CRITIC_UPDATE_KEYS if k != "loss_mask"]
        out = []
        for idx in minibatches(self.batch_size, self.critic_mini, int(c.ppo_epochs), bool(c.shuffle), rng):
            mb = {k: b[k][idx] for k in keys}
            mb["loss_mask"] = train_mask[idx]
            put = self._put(mb) if self.critic_spec is None else self._put_packed(self._pack(mb, self.critic_spec))
            self.critic_params, self.critic_opt_state, m = self._critic_update(
                self.critic_params, self.critic_opt_state, put
            )
            out.append((m, self.critic_update_count))
            self.critic_update_count += 1
        # no host sync inside the loop (the next mini-batch is packed while the device runs this one)
        out = [dict(jax.device_get(m), lr=float(self.critic_lr(n))) for m, n in out]
        guard = self.critic_guard.observe([m["update_skipped"] for m in out], step=self.global_steps + 1)
        red = metrics_lib.reduce_metrics(out)
        return dict({f"critic/{k}": v for k, v in red.items()}, **guard)

    def _step_metrics(self, b, timing, prompts: DataProto) -> dict[str, float]:
        cfg = self.config
        m = metrics_lib.compute_data_metrics(
            b,
            use_critic=self.use_critic,
            max_prompt_length=int(cfg.data.max_prompt_length),
            max_response_length=self.response_length,
        )
        n_prompt_tok = int(b["attention_mask"][:, : -self.response_length].sum())
        n_resp_tok = int(b["response_attention_mask"].sum())
        m.update(metrics_lib.compute_timing_metrics(timing, n_prompt_tok, n_resp_tok))
        m.update(metrics_lib.compute_throughput_metrics(n_prompt_tok + n_resp_tok, timing["step"], self.n_devices))
        if "update_actor" in timing:
            seq_lens = b["attention_mask"].sum(-1)
            m["perf/mfu/actor"] = metrics_lib.compute_mfu(
                self.actor_model.config,
                seq_lens,
                int(cfg.actor.ppo_epochs),
                timing["update_actor"],
                self.n_devices,
                self.peak_flops,
            )
        m["training/global_step"] = float(self.global_steps)
        m["training/epoch"] = float(prompts.meta_info.get("epoch", 0))
        return m
