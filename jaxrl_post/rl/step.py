"""One RL training step (verl's `RayPPOTrainer.fit()` loop body) over an `RLTrainer`'s roles and state: rollout +
reward -> old / reference / teacher log-probs, values -> rollout correction -> KL in reward, advantages -> critic
and actor updates -> weight sync -> metrics. The batch is one `DataProto` passed from stage to stage, each stage's
reads and writes checked against its contract (`rl/stages.py`, `batch/contracts.py`); each stage is a named timer
(`timing_s/<stage>`). The trainer's `train_step` calls `train_step` here. docs/architecture.md follows one step
file by file."""

from __future__ import annotations

from collections.abc import Callable

import jax
import numpy as np

from jaxrl_post.batch.arrays import as_non_tensor_array
from jaxrl_post.batch.contracts import StagedBatch
from jaxrl_post.batch.protocol import DataProto
from jaxrl_post.engine import steps
from jaxrl_post.engine.placement import to_numpy as _np
from jaxrl_post.rl import local_rows, updates
from jaxrl_post.rl.async_training.producer import rollout_probs_diff
from jaxrl_post.rl.dynamic_sampling import timer as _timer
from jaxrl_post.rl.roles.teacher import kl_to_teacher_metrics
from jaxrl_post.rl.stages import stage
from jaxrl_post.rl.validation_loop import write_rollout_generations
from jaxrl_post.runtime import distributed, row_stats


def train_step(trainer, prompts: DataProto, next_prompts: Callable[[], DataProto] | None = None) -> dict[str, float]:
    """Runs one PPO/GRPO iteration of `trainer` (an `RLTrainer`; its `state` and `host` advance) on a batch of
    `data.train_batch_size` prompts; returns its metrics.

    With `algorithm.filter_groups.enable` (DAPO dynamic sampling), further prompt batches come from
    `next_prompts()` (default: the training loader) until `data.train_batch_size` groups are kept
    (dynamic_sampling.py); raises `FilterGroupsError` after `max_num_gen_batches` generation batches.
    """
    cfg, g = trainer.config, trainer.geometry
    timing: dict[str, float] = {}
    gen_seed, shuffle_seed = next_seeds(trainer)
    metrics: dict[str, float] = {}
    local = trainer.placement.process_local_rows  # this process's rows only (rl/local_rows.py)
    distributed.reset_received_bytes()  # `perf/host_gather_bytes` of a multi-process step
    with _timer("step", timing):
        # -- rollout + reward (+ dynamic sampling: more generation batches until enough groups vary)
        more = next_prompts or (lambda: next(trainer.data.train_loader))
        # asynchronous: the step's groups from the queue (async_training/producer.py)
        kw = {} if trainer.async_rollout is None else {"step": trainer.host.global_steps}
        data = StagedBatch()  # one DataProto through the stages, each checked against its contract (stages.py)
        with stage(data, "rollout") as b:
            rolled, nt, reward_metrics, prompts, rng = trainer.rollout.collect(
                prompts, gen_seed, timing, trainer.reward_fn, trainer.state.rng, more, **kw
            )
            b.update(rolled)
            data.data.non_tensor_batch.update({k: as_non_tensor_array(k, v) for k, v in nt.items()})
        trainer.state = trainer.state.replace(rng=rng)
        metrics.update(reward_metrics)
        turn_rows = (nt, {k: b[k] for k in ("response_attention_mask", "loss_mask")})  # multi-turn metrics' input
        if trainer.async_rollout is None:  # async: after `finish_step` (the ahead batches' tool counts are the step's)
            metrics.update(trainer.rollout.multi_turn_metrics(*turn_rows))
            metrics.update(trainer.rollout.engine_metrics())
        baselines = b.get("reward_baselines")

        # b["loss_mask"]: the model's own tokens (rollout); train_mask: the tokens the updates train (minus
        # dropped truncated responses and rejected tokens; advantages keep the rollout's loss_mask)
        train_mask = _np(steps.compute_loss_mask(b["loss_mask"], b["truncated"], bool(cfg.actor.drop_truncated)))
        if cfg.actor.drop_truncated:
            dropped = {"actor/num_dropped_truncated": float(np.sum(b["truncated"]))}
            metrics.update(row_stats.allreduce_sums(dropped) if local else dropped)

        # -- old / reference / teacher log-probs, values
        actor_params = trainer.state.actor.params
        if not g.on_policy:
            with stage(data, "old_log_prob", timing) as b:
                b["old_log_probs"], routes = trainer.policy.old_log_probs(actor_params, b)
                if routes is not None:  # R2: the routes this forward chose, replayed by the update
                    b["routed_experts"] = routes
        if trainer.reference is not None:
            with stage(data, "ref", timing) as b:
                b["ref_log_prob"] = trainer.reference.log_probs(actor_params, b)  # LoRA: adapters off
        if trainer.teacher is not None:
            with stage(data, "teacher", timing) as b:
                b.update(trainer.teacher.forward(b))
            student = b["old_log_probs"] if "old_log_probs" in b else b["rollout_log_probs"]
            loss_mode = cfg.distillation.distillation_loss.loss_mode
            metrics.update(kl_to_teacher_metrics(student, b["teacher_log_prob"], train_mask, loss_mode))
        if trainer.critic is not None:
            with stage(data, "values", timing) as b:
                b["values"] = trainer.critic.values(trainer.state.critic.params, b)

        metrics.update(updates.moe_mismatch_metrics(trainer.policy, g, b, train_mask, local))  # MoE: replay
        if g.use_rollout_corr:  # IS weights / rejection mask from log(pi_old / pi_rollout), whole batch
            with stage(data, "rollout_correction") as b:
                weights, train_mask, corr_metrics = updates.rollout_correction(cfg, b, train_mask)
                if weights is not None:
                    b["rollout_is_weights"] = weights
            metrics.update(corr_metrics)
        elif trainer.async_rollout is not None:  # behaviour (rollout) vs proximal (recomputed) policy
            metrics.update(rollout_probs_diff(b, train_mask))

        # -- KL in reward, advantages
        kl_ctrl = trainer.host.kl_ctrl
        with stage(data, "adv", timing) as b:
            if local:  # this process's rows; batch statistics reduced across processes (local_rows.py)
                rewards, current_kl, adv, ret = local_rows.advantages(trainer, b, nt["uid"], baselines)
            else:
                _, index = np.unique(np.asarray(nt["uid"]), return_inverse=True)
                rewards, current_kl, adv, ret = trainer.advantage(
                    b["token_level_scores"],
                    b["loss_mask"],
                    index.astype(np.int32).reshape(-1),
                    np.float32(kl_ctrl.value),
                    b.get("old_log_probs"),
                    b.get("ref_log_prob"),
                    b.get("values"),
                    None if baselines is None else np.asarray(baselines, np.float32),
                )
            b["token_level_rewards"], b["advantages"], b["returns"] = _np(rewards), _np(adv), _np(ret)
            if cfg.algorithm.use_kl_in_reward:
                metrics["actor/reward_kl_penalty"] = float(current_kl)
                metrics["actor/reward_kl_penalty_coeff"] = float(kl_ctrl.value)
                kl_ctrl.update(float(current_kl), n_steps=g.batch_size)  # responses, as verl

        if cfg.trainer.get("rollout_data_dir"):  # verl: the scored training responses, <dir>/<step>.jsonl
            with _timer("dump_rollout_generations", timing):
                step_no = trainer.host.global_steps + 1
                write_rollout_generations(cfg.trainer.rollout_data_dir, data.data, trainer.reward_fn, step_no)

        # -- updates
        rng = np.random.default_rng(shuffle_seed)
        if trainer.critic is not None:
            with stage(data, "update_critic", timing) as b:
                args = (cfg, trainer.critic, g, trainer.state, trainer.host, b, train_mask, rng)
                trainer.state, out = updates.update_critic(*args)  # the state first: NonFiniteError below
                metrics.update(updates.critic_metrics(trainer.critic, trainer.host, out))
        if trainer.host.global_steps >= int(cfg.trainer.critic_warmup):
            with stage(data, "update_actor", timing) as b:
                args = (cfg, trainer.policy, g, trainer.state, trainer.host, b, train_mask, rng)
                trainer.state, out = updates.update_actor(*args)
                metrics.update(updates.actor_metrics(cfg, trainer.policy, trainer.host, out))
        if trainer.async_rollout is not None:  # the ahead generation done (split: its thread joined) before publish
            metrics.update(trainer.async_rollout.finish_step(timing))
            if trainer.async_rollout.owed is None:  # else its job failed: counts of the re-run job come later
                metrics.update(trainer.rollout.multi_turn_metrics(*turn_rows))
                metrics.update(trainer.rollout.engine_metrics())
        if trainer.host.global_steps >= int(cfg.trainer.critic_warmup):
            metrics.update(trainer.sync_weights(step=trainer.host.global_steps + 1, timing=timing))  # split: bytes
        b = data.finish()

    trainer.host.global_steps += 1
    model_config, n_devices, use_critic = (
        trainer.policy.model.config,
        trainer.placement.n_devices,
        trainer.critic is not None,
    )
    step = trainer.host.global_steps
    step_metrics = local_rows.step_metrics if local else updates.step_metrics
    metrics.update(step_metrics(cfg, g, model_config, n_devices, step, b, timing, prompts, use_critic))
    if jax.process_count() > 1:  # bytes this host received through host-side gathers in the step (docs/multihost.md)
        metrics["perf/host_gather_bytes"] = float(distributed.received_bytes())
    return metrics


def next_seeds(trainer) -> tuple[int, int]:
    """Two integer seeds (generation, mini-batch shuffle) split off the train state's RNG key, which advances."""
    rng, k_gen, k_shuffle = jax.random.split(trainer.state.rng, 3)
    trainer.state = trainer.state.replace(rng=rng)
    to_int = lambda k: int(jax.random.randint(k, (), 0, 2**31 - 1))
    return to_int(k_gen), to_int(k_shuffle)
