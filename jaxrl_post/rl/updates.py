"""`RLTrainer`'s mini-batch update loops (actor, critic), rollout correction and the metrics of one step.

Functions over (config, role, state, batch): each update loop takes the `TrainState` and `HostState`
(train_state.py) and returns the new `TrainState` with its metrics, advancing the host's update counters and
non-finite guards. The batch `b` is the step's host batch: numpy arrays with B = `geometry.batch_size` rows
(responses), token fields [B, T] and response fields [B, response_length].
"""

from __future__ import annotations

from collections.abc import Iterator

import jax
import numpy as np

from jaxrl_post.algos.rollout_corr import (
    compute_rollout_correction_and_rejection_mask,
    compute_rollout_probs_diff_metrics,
)
from jaxrl_post.batch.keys import ACTOR_UPDATE_KEYS, CRITIC_UPDATE_KEYS
from jaxrl_post.batch.protocol import DataProto
from jaxrl_post.engine.train_state import HostState, TrainState
from jaxrl_post.rl import metrics as metrics_lib
from jaxrl_post.rl.geometry import StepGeometry
from jaxrl_post.runtime import row_stats
from jaxrl_post.runtime.distributed import global_from_local, to_host


def minibatches(n_rows: int, mini: int, epochs: int, shuffle: bool, rng: np.random.Generator) -> Iterator[np.ndarray]:
    """Row indices of each mini-batch: `epochs` passes over `n_rows` rows in chunks of `mini` (a fresh
    permutation per epoch when `shuffle`)."""
    for _ in range(epochs):
        perm = rng.permutation(n_rows) if shuffle else np.arange(n_rows)
        for i in range(0, n_rows, mini):
            yield perm[i : i + mini]


def own_rows(placement, n_rows: int, mini: int) -> tuple[int, int]:
    """`(rows, mini-batch rows)` this process splits into mini-batches: the step's with the global batch, this
    process's share of each with process-local rows (`Placement.process_local_rows`, rl/local_rows.py)."""
    if not placement.process_local_rows:
        return n_rows, mini
    p = jax.process_count()
    return n_rows // p, mini // p


def update_actor(
    cfg, policy, geometry: StepGeometry, state: TrainState, host: HostState, b: dict[str, np.ndarray], train_mask, rng
) -> tuple[TrainState, list]:
    """Actor updates (`policy.update`) over shuffled mini-batches of `b`, training the tokens of
    `train_mask [B, R]`; `rng` (`np.random.Generator`) shuffles. Returns the new state (the old one's arrays
    are donated) and the updates' device metrics with their update counts, for `actor_metrics`."""
    a = cfg.actor
    skip = {"loss_mask"} | ({"old_log_probs"} if geometry.on_policy else set())
    skip |= set() if a.use_kl_loss else {"ref_log_prob"}  # KL in reward only: the update does not need it
    keys = [k for k in ACTOR_UPDATE_KEYS if k in b and k not in skip]
    actor, out = state.actor, []
    rows, mini = own_rows(policy.placement, geometry.batch_size, geometry.actor_mini)
    for idx in minibatches(rows, mini, int(a.ppo_epochs), bool(a.shuffle), rng):
        mb = {k: b[k][idx] for k in keys}
        mb["loss_mask"] = train_mask[idx]
        actor, m = policy.update(actor, mb)
        out.append((m, host.actor_update_count))
        host.actor_update_count += 1
    # no host sync inside the loop (the next mini-batch is packed while the device runs this one)
    return state.replace(actor=actor), out


def actor_metrics(cfg, policy, host: HostState, pending: list) -> dict[str, float]:
    """The `actor/*` metrics of `update_actor`'s updates (`pending`; the first host sync of the loop).
    Raises NonFiniteError after `trainer.max_consecutive_nonfinite` skipped updates in a row."""
    a = cfg.actor
    out = [dict(jax.device_get(m), lr=float(policy.lr(n))) for m, n in pending]
    guard = host.actor_guard.observe([m["update_skipped"] for m in out], step=host.global_steps + 1)
    red = metrics_lib.reduce_metrics(out)
    res = {f"actor/{k}": v for k, v in red.items() if k not in ("rollout_probs_diff_mean", "loss")}
    res.update(guard)
    if "rollout_probs_diff_mean" in red:
        res["training/rollout_probs_diff_mean"] = red["rollout_probs_diff_mean"]
    if a.use_kl_loss:
        res["actor/kl_coef"] = float(a.kl_loss_coef)
    return res


def rollout_correction(cfg, b: dict[str, np.ndarray], train_mask: np.ndarray):
    """verl's rollout correction on the whole batch (`rollout_corr.compute_rollout_correction_and_rejection_mask`)
    from `b["old_log_probs"]` and `b["rollout_log_probs"]` (read only). Returns `(weights, train_mask, metrics)`:
    `weights [B, R] float32` or None (IS off), the caller's `b["rollout_is_weights"]`, which multiplies the
    per-token policy loss after clipping; `train_mask [B, R] int32` without the rejected tokens (actor and critic
    losses, every `loss_agg_mode` normaliser; advantages keep the rollout's `loss_mask`); the `rollout_corr/*` and
    `training/rollout_probs_diff_*` metrics."""

    rc = cfg.algorithm.rollout_correction
    if not np.any(train_mask):
        return None, train_mask, {}
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
    weights = None if weights is None else np.asarray(weights, np.float32)
    return weights, np.asarray(mask).astype(np.int32), {k: float(v) for k, v in jax.device_get(metrics).items()}


def moe_mismatch_metrics(
    policy, geometry: StepGeometry, b: dict[str, np.ndarray], train_mask, local: bool = False
) -> dict[str, float]:
    """An MoE actor's rollout / trainer mismatch (routing replay, docs/moe.md): verl's
    `training/rollout_probs_diff_{max,mean,std}` and `training/rollout_actor_probs_pearson_corr` of the old-log-prob
    forward against the sampler's log-probs over `train_mask`, every step with an old-log-prob forward (rollout
    correction logs the same keys itself). {} for a dense actor, without old log-probs or without a token.
    `local`: `b` and `train_mask` are this process's rows (rl/local_rows.py): the same function on global arrays
    built from every process's rows, its reductions across processes (the rows never gathered)."""
    moe = bool(policy.model.config.moe_layers)
    if not moe or geometry.use_rollout_corr or "old_log_probs" not in b:
        return {}
    if local:
        tokens = row_stats.allreduce_sums({"n": float(np.sum(train_mask))})["n"]
        if not tokens:
            return {}
        put = lambda x: global_from_local(np.asarray(x), policy.placement.mesh)
        out = _probs_diff(put(b["old_log_probs"]), put(b["rollout_log_probs"]), put(train_mask))
        return {k: float(to_host(v)) for k, v in out.items()}
    if not np.any(train_mask):
        return {}
    out = compute_rollout_probs_diff_metrics(b["old_log_probs"], b["rollout_log_probs"], train_mask)
    return {k: float(v) for k, v in jax.device_get(out).items()}


_probs_diff = jax.jit(compute_rollout_probs_diff_metrics)  # process-local rows: one program over the global arrays


def update_critic(
    cfg, critic, geometry: StepGeometry, state: TrainState, host: HostState, b: dict[str, np.ndarray], train_mask, rng
) -> tuple[TrainState, list]:
    """Critic updates (`critic.update`) over shuffled mini-batches of `b`, fitting values on the tokens of
    `train_mask`. Returns the new state (the old one's arrays are donated) and the device metrics with their
    update counts, for `critic_metrics`."""
    c = cfg.critic
    keys = [k for k in CRITIC_UPDATE_KEYS if k != "loss_mask"]
    params, out = state.critic, []
    rows, mini = own_rows(critic.placement, geometry.batch_size, critic.mini)
    for idx in minibatches(rows, mini, int(c.ppo_epochs), bool(c.shuffle), rng):
        mb = {k: b[k][idx] for k in keys}
        mb["loss_mask"] = train_mask[idx]
        params, m = critic.update(params, mb)
        out.append((m, host.critic_update_count))
        host.critic_update_count += 1
    # no host sync inside the loop (the next mini-batch is packed while the device runs this one)
    return state.replace(critic=params), out


def critic_metrics(critic, host: HostState, pending: list) -> dict[str, float]:
    """The `critic/*` metrics of `update_critic`'s updates. Raises NonFiniteError (see `actor_metrics`)."""
    out = [dict(jax.device_get(m), lr=float(critic.lr(n))) for m, n in pending]
    guard = host.critic_guard.observe([m["update_skipped"] for m in out], step=host.global_steps + 1)
    red = metrics_lib.reduce_metrics(out)
    return dict({f"critic/{k}": v for k, v in red.items()}, **guard)


def step_metrics(
    cfg,
    geometry: StepGeometry,
    model_config,
    n_devices: int,
    step: int,
    b,
    timing,
    prompts: DataProto,
    use_critic: bool,
) -> dict[str, float]:
    """verl's data, timing, throughput and MFU metrics of one step (after `step` completed steps)."""
    r = geometry.response_length
    m = metrics_lib.compute_data_metrics(
        b, use_critic=use_critic, max_prompt_length=int(cfg.data.max_prompt_length), max_response_length=r
    )
    n_prompt_tok = int(b["attention_mask"][:, :-r].sum())
    n_resp_tok = int(b["response_attention_mask"].sum())
    m.update(metrics_lib.compute_timing_metrics(timing, n_prompt_tok, n_resp_tok))
    m.update(metrics_lib.compute_throughput_metrics(n_prompt_tok + n_resp_tok, timing["step"], n_devices))
    if "update_actor" in timing:
        seq_lens = b["attention_mask"].sum(-1)
        m["perf/mfu/actor"] = metrics_lib.compute_mfu(
            model_config, seq_lens, int(cfg.actor.ppo_epochs), timing["update_actor"], n_devices, geometry.peak_flops
        )
    m["training/global_step"] = float(step)
    m["training/epoch"] = float(prompts.meta_info.get("epoch", 0))
    return m
