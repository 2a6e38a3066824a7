"""The critic role (verl's critic worker, PPO): a value model initialised from the actor, held as a `TrainedModel`
(`engine/trained_model.py`: layout, optimizer, the jitted `ppo_update.make_critic_update` on the padded or packed
layout), and its jitted value fn (`update_core.make_value_fn` on the same layout). The arrays it
trains are `TrainState.critic` (train_state.py)."""

from __future__ import annotations

import jax
import numpy as np
from flax import nnx

from jaxrl_post.engine import packed_steps, steps, update_core
from jaxrl_post.engine.placement import Placement
from jaxrl_post.engine.train_state import OptimizedParams
from jaxrl_post.engine.trained_model import TrainedModel
from jaxrl_post.models import CriticModel
from jaxrl_post.rl import builders, ppo_update
from jaxrl_post.rl.geometry import StepGeometry
from jaxrl_post.runtime.sharding import shard_params


class CriticRole:
    """The value model (see the module docstring). Build with `CriticRole.build`.

    Attributes: `trained` (`TrainedModel`; read through `graphdef` / `rest` / `tx` / `lr`; `trained.update` is
    the jitted update), `mini` (responses per critic mini-batch), `spec` / `values_spec` (pack specs of the update
    and the value forward; None when padded), `values_fn`.
    """

    @classmethod
    def build(cls, cfg, policy, placement: Placement, geometry: StepGeometry) -> tuple[CriticRole, OptimizedParams]:
        """The role and its initial arrays: `CriticModel.from_actor(policy.model)` (seed `trainer.seed + 1`),
        params in fresh buffers (the actor's are donated) and a fresh optimizer state."""

        self = cls()
        self.placement = placement
        c = cfg.critic
        critic = CriticModel.from_actor(policy.model, nnx.Rngs(int(cfg.trainer.seed) + 1))
        cg, cp, cr = steps.split_model(critic)
        if placement.sharded:
            cp = shard_params(cp, placement.mesh)
        own = builders.copy_tree(cp)  # own buffers: actor params are donated
        del critic, cp
        self.mini = int(c.ppo_mini_batch_size) * int(cfg.rollout.n)  # responses per critic update
        self.optim_cfg = builders.optim_config(
            c.optim,
            grad_clip=c.grad_clip,
            total_training_steps=geometry.total_training_steps,
            updates_per_step=int(c.ppo_epochs) * (geometry.batch_size // self.mini),
        )
        offload = bool(c.fsdp_config.optimizer_offload)  # the state in host memory between updates
        # no module kept (its initial buffers are freed; the critic is never exported), no frozen base
        self.trained, state = TrainedModel.from_split(
            None, cg, own, cr, None, placement, self.optim_cfg, offload=offload
        )
        loss_cfg = ppo_update.CriticLossConfig(float(c.cliprange_value), c.loss_agg_mode)
        self.spec = policy.pack_spec("critic", self.mini, int(c.ppo_micro_batch_size))
        self.values_micro = int(c.forward_micro_batch_size)
        self.values_spec = policy.pack_spec("values", geometry.batch_size, self.values_micro)
        if self.spec is not None:
            layout = values_layout = packed_steps.PACKED
        else:
            layout = steps.padded_layout(n_micro=self.mini // int(c.ppo_micro_batch_size))
            values_layout = steps.padded_layout(micro_batch_size=self.values_micro)
        values = update_core.make_value_fn(values_layout, cg, cr, on_trace=placement.tracer("values"))
        t = self.trained
        update = ppo_update.make_critic_update(
            layout, cg, cr, t.tx, loss_cfg, on_trace=placement.tracer("update_critic")
        )
        t.set_update(update, placement, state)
        self.values_fn = jax.jit(values)
        return self, state

    # the value model's layout and optimizer (`engine/trained_model.py`)
    graphdef = property(lambda self: self.trained.graphdef)
    rest = property(lambda self: self.trained.rest)
    tx = property(lambda self: self.trained.tx)
    lr = property(lambda self: self.trained.lr)

    def values(self, params, batch: dict[str, np.ndarray]) -> np.ndarray:
        """`values [B, R] float32` of the batch's response tokens (host numpy)."""
        return self.placement.forward(self.values_fn, params, batch, self.values_micro, self.values_spec)

    def update(self, critic: OptimizedParams, minibatch: dict[str, np.ndarray]):
        """One optimizer step on a host mini-batch (`CRITIC_UPDATE_KEYS`): `(OptimizedParams, device
        metrics)`. Donates `critic`."""
        put = self.placement.put_minibatch(minibatch, self.spec)
        return self.trained.step(critic, put)
