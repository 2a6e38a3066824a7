"""The PPO/GRPO actor and critic updates: the RL losses (`losses.py`) on the engine's update core, for any layout.

`make_actor_update(layout, ...)` / `make_critic_update(layout, ...)` are `update_core.make_update` with the
actor loss (policy loss, plus the KL loss, minus the entropy bonus, plus distillation, each when on) or the
clipped value loss; the layout is `steps.padded_layout(n_micro=...)` (padded `[M, T]` rows) or
`packed_steps.PACKED` (rows of real tokens), and the same loss, aggregation and metrics come out of both.

Actor batch (mini-batch, M rows, padded layout; the packed layout holds the same fields packed):
`input_ids`, `attention_mask`, `position_ids` `[M, T]`; `responses`, `loss_mask` (the tokens to train) `[M, R]`;
`advantages [M, R] float32`; `old_log_probs [M, R]` unless `loss_cfg.on_policy`; `ref_log_prob [M, R]` when
`use_kl_loss`; `teacher_log_prob [M, R]` with `loss_cfg.distillation` (a top-k mode: `teacher_topk_log_probs`,
`teacher_topk_ids` `[M, R, K]` instead); optional `rollout_log_probs [M, R]` (the
`training/rollout_probs_diff_*` diagnostics). Metrics (float32 scalars, verl names without the `actor/` prefix):
pg_loss, pg_clipfrac, pg_clipfrac_lower, ppo_kl, entropy, kl_loss, grad_norm, update_skipped (+
rollout_probs_diff_mean/max, `distillation/*`). Critic batch: the model inputs, `responses`, `loss_mask`,
`values`, `returns` `[M, R]`; metrics vf_loss, vf_clipfrac, vpred_mean, grad_norm, update_skipped.

Source: verl `dp_actor.DataParallelPPOActor.update_policy`, `dp_critic.DataParallelPPOCritic.update_critic`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import optax
from flax import nnx

from jaxrl_post.algos import functional
from jaxrl_post.algos.distillation import DistillationLossConfig
from jaxrl_post.batch.keys import ACTOR_RESPONSE_KEYS, ACTOR_UPDATE_KEYS, CRITIC_RESPONSE_KEYS, CRITIC_UPDATE_KEYS
from jaxrl_post.engine.update_core import Layout, UpdateKeys, make_update, merge_model
from jaxrl_post.rl import losses

ACTOR_KEYS = UpdateKeys(ACTOR_UPDATE_KEYS, ACTOR_RESPONSE_KEYS)
CRITIC_KEYS = UpdateKeys(CRITIC_UPDATE_KEYS, CRITIC_RESPONSE_KEYS)


@dataclasses.dataclass(frozen=True)
class ActorLossConfig:
    """Static settings of the actor loss (hashable: part of the jitted function's closure)."""

    loss_mode: str = "vanilla"  # registry.POLICY_LOSSES key
    loss_agg_mode: str = "token-mean"
    clip_ratio_low: float = 0.2
    clip_ratio_high: float = 0.2
    clip_ratio_c: float = 3.0
    entropy_coeff: float = 0.0
    use_kl_loss: bool = False
    kl_loss_coef: float = 0.001
    kl_loss_type: str = "low_var_kl"
    temperature: float = 1.0  # rollout temperature: logits / T, as the sampler
    on_policy: bool = False  # old log-probs = stop_gradient(current): exactly on-policy single update
    policy_loss_params: tuple[tuple[str, float], ...] = ()  # actor.policy_loss.* hyper-parameters (name, value)
    distillation: DistillationLossConfig | None = None  # on-policy distillation term (needs teacher_log_prob)


@dataclasses.dataclass(frozen=True)
class CriticLossConfig:
    cliprange_value: float = 0.5
    loss_agg_mode: str = "token-mean"


def make_actor_update(
    layout: Layout,
    graphdef: nnx.GraphDef,
    rest: nnx.State,
    tx: optax.GradientTransformation,
    loss_cfg,
    *,
    on_trace: Callable[[], None] | None = None,
) -> Callable:
    """`make_update` with the PPO/GRPO actor loss (`losses.actor_loss` under `loss_cfg`, an `ActorLossConfig`);
    batch and metrics as documented below. Raises ValueError at trace time when top-k distillation lacks
    `teacher_topk_ids`."""
    c = loss_cfg
    ent_mode = functional.entropy_mode(c.entropy_coeff)
    topk = c.distillation is not None and c.distillation.is_topk

    def loss_fn(params, mb, counts, frozen=None):
        model = merge_model(graphdef, params, frozen, rest)
        moe = bool(model.config.moe_layers)  # MoE: routing metrics (+ HF's aux loss when output_router_logits)
        head, moe = layout.head(model, mb, with_moe=True) if moe else (layout.head(model, mb), None)
        log_prob, entropy = layout.log_probs(model, mb, head, c.temperature, ent_mode)
        if topk:  # the student's log-probs at the teacher's top-k ids, from the same head
            s_topk = layout.gather_log_probs(model, mb, head, mb["teacher_topk_ids"], c.temperature)
            mb = dict(mb, student_topk_log_probs=s_topk)
        loss, metrics = losses.actor_loss(c, log_prob, entropy, mb, counts)
        return (loss, metrics) if moe is None else losses.add_moe_terms(model.config, loss, metrics, moe, mb, counts)

    def check(batch):
        if topk and "teacher_topk_ids" not in batch:
            raise ValueError("top-k distillation: the actor update needs teacher_topk_ids / teacher_topk_log_probs")

    return make_update(layout, loss_fn, tx, ACTOR_KEYS, report_loss=True, on_trace=on_trace, check=check)


def make_critic_update(
    layout: Layout,
    graphdef: nnx.GraphDef,
    rest: nnx.State,
    tx: optax.GradientTransformation,
    loss_cfg,
    *,
    on_trace: Callable[[], None] | None = None,
) -> Callable:
    """Pure `fn(params, opt_state, batch) -> (params, opt_state, metrics)`: `make_update` with the clipped value
    loss (`losses.critic_loss` under `loss_cfg`, a `CriticLossConfig`); metrics: vf_loss, vf_clipfrac,
    vpred_mean, grad_norm, update_skipped."""

    def loss_fn(params, mb, counts, frozen=None):
        critic = merge_model(graphdef, params, frozen, rest)
        return losses.critic_loss(loss_cfg, layout.values(critic, mb), mb, counts)

    update = make_update(layout, loss_fn, tx, CRITIC_KEYS, report_loss=False, on_trace=on_trace)
    return lambda params, opt_state, batch: update(params, opt_state, batch)
