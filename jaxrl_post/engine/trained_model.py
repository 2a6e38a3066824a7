"""One trained model: the nnx module split into trained / frozen / other state, its optimizer and its jitted update.

`TrainedModel.build(module, placement, optim_cfg)` splits the module (`steps.split_model`; with LoRA
`steps.split_lora_model`: the adapters train, the base params are frozen and passed to every jitted fn as its
trailing `frozen` argument), commits the trained params to their shardings, builds the optax optimizer and LR
schedule (`steps.make_optimizer`, `steps.make_lr_schedule`) and a fresh optimizer state sharded like the params.
It returns the model and its arrays, a `train_state.OptimizedParams` the trainer keeps as its state.
`set_update(fn, state)` jits a pure `fn(params, opt_state, batch, *extra) -> (params, opt_state, metrics)` once
(params and optimizer state donated, `Placement.jit_update`); `step(state, batch, *extra)` runs it.

Every trained model holds one: the supervised trainers (sft/trainer.py: SFT, DPO, reward model) and the RL
policy and critic roles (rl/roles/policy.py, rl/roles/critic.py); the arrays live in the trainer's `state`, never
here, so a checkpoint restore replaces them in one place.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import optax
from flax import nnx

from jaxrl_post.engine import steps
from jaxrl_post.engine.placement import Placement
from jaxrl_post.engine.train_state import OptimizedParams
from jaxrl_post.models.lora import lora_config_of
from jaxrl_post.runtime.sharding import init_opt_state


class TrainedModel:
    """A trained module's layout, optimizer and jitted update (see the module docstring).

    Attributes: `module` (the nnx module; holds the live params after `sync`; None when the caller keeps none),
    `lora` (`LoraConfig`, or None: full fine-tuning), `graphdef` / `rest` (`nnx.split`), `frozen` (a LoRA model's
    base params, else None), `tx` / `lr` (optax optimizer and its schedule of the update count), `update` (the
    jitted update, None before `set_update`).
    """

    def __init__(self, module: nnx.Module, graphdef, rest, frozen, tx: optax.GradientTransformation, lr):
        self.module = module
        self.lora = None if module is None else lora_config_of(module)
        self.graphdef, self.rest, self.frozen = graphdef, rest, frozen
        self.tx, self.lr = tx, lr
        self.update: Callable | None = None

    @classmethod
    def build(
        cls, module: nnx.Module, placement: Placement, optim_cfg, *, offload: bool = False
    ) -> tuple[TrainedModel, OptimizedParams]:
        """The model and its initial arrays: the trained params (LoRA: the adapters) committed to their
        shardings and a fresh optimizer state (`optim_cfg`: `steps.OptimConfig`) sharded like them (`offload`:
        in host memory between updates, `sharding.init_opt_state`)."""
        if lora_config_of(module) is not None:
            graphdef, params, frozen, rest = steps.split_lora_model(module)
            frozen = placement.commit(frozen)
        else:
            graphdef, params, rest = steps.split_model(module)
            frozen = None
        return cls.from_split(module, graphdef, params, rest, frozen, placement, optim_cfg, offload=offload)

    @classmethod
    def from_split(
        cls, module, graphdef, params, rest, frozen, placement: Placement, optim_cfg, *, offload: bool = False
    ) -> tuple[TrainedModel, OptimizedParams]:
        """`build` from an already split module (a caller that places or copies the params first, e.g. the
        critic's fresh buffers): commits `params`, builds the optimizer, schedule and optimizer state."""
        params = placement.commit(params)
        tx = steps.make_optimizer(optim_cfg)
        lr = steps.make_lr_schedule(optim_cfg)
        opt_state = placement.commit(init_opt_state(tx, params, placement.opt_mesh(), offload=offload))
        return cls(module, graphdef, rest, frozen, tx, lr), OptimizedParams(params, opt_state)

    def frozen_args(self) -> tuple:
        """The trailing `frozen` argument of every jitted fn of this model: `(frozen,)` with LoRA, else `()`."""
        return () if self.frozen is None else (self.frozen,)

    def set_update(self, fn: Callable, placement: Placement, state: OptimizedParams) -> None:
        """Jit the pure update `fn(params, opt_state, batch, *extra) -> (params, opt_state, metrics)` once,
        params and optimizer state donated and their shardings pinned (`Placement.jit_update`)."""
        self.update = placement.jit_update(fn, state.params, state.opt_state)

    def step(self, state: OptimizedParams, batch, *extra) -> tuple[OptimizedParams, dict[str, Any]]:
        """One jitted update of `state` on `batch` (`extra`: the update's trailing arguments); returns the new
        state (the old arrays are donated) and the update's metrics as device arrays."""
        params, opt_state, out = self.update(state.params, state.opt_state, batch, *extra)
        return OptimizedParams(params, opt_state), out

    def sync(self, params) -> None:
        """Write `params` (and a LoRA model's frozen base) into `module` (export, evaluation)."""
        nnx.update(self.module, params)
        if self.frozen is not None:
            nnx.update(self.module, self.frozen)
