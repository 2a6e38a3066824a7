"""`RLTrainer`'s state: one device pytree (`TrainState`) and one host dataclass (`HostState`).

`TrainState` holds every array a step changes: the actor's params and optimizer state, the critic's (PPO; None
otherwise), the rollout's copy of the actor params (only when `rollout.dtype` differs from the actor's, else
None: the rollout samples with the actor's own buffers) and the RNG key. It is a `flax.struct` pytree: updates
return a new one (`state.replace(actor=...)`); the jitted updates donate the old arrays.

`HostState` holds the host values a step changes: the step and update counters, the KL controller
(`kl.get_kl_controller`; its coefficient is a Python float updated on the host), the non-finite update guards
and the run's validation before training (`val_before`). The data loader's position lives in the loader
(`get_state` / `set_state`); it is saved with the host values as `host['data_iter']`.

`state_dict` / `load_state_dict` map both to the checkpoint tree of `checkpoint.py`: items `actor`,
`critic`, `ref`, `rng` and the host JSON (`global_steps`, `actor_update_count`, `critic_update_count`,
`kl_ctrl`, `data_iter`, `nonfinite`, `val_before`, ...). The names on disk are those of every earlier
version: old checkpoints resume.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jaxrl_post.engine.nonfinite import NonFiniteGuard


@struct.dataclass
class OptimizedParams:
    """One trained role's arrays: `params` (pytree of the role's trainable leaves; LoRA: the adapters) and the
    optax `opt_state` sharded like them."""

    params: Any
    opt_state: Any


@struct.dataclass
class TrainState:
    """Every device array a training step changes (see the module docstring).

    Fields:
      actor: `OptimizedParams` of the policy.
      critic: `OptimizedParams` of the value model (PPO), else None.
      rollout: the rollout's params in `rollout.dtype` (`RolloutRole.sync`), None when it shares the actor's.
      rng: the run's `jax.random.key` (typed key array, shape `()`): generation and shuffle seeds.
    """

    actor: OptimizedParams
    critic: OptimizedParams | None
    rollout: Any
    rng: jax.Array


@dataclasses.dataclass
class HostState:
    """Host values a training step changes (see the module docstring). `global_steps`: completed steps;
    `*_update_count`: optimizer steps taken (the LR schedule's position)."""

    kl_ctrl: Any
    actor_guard: NonFiniteGuard
    critic_guard: NonFiniteGuard
    global_steps: int = 0
    actor_update_count: int = 0
    critic_update_count: int = 0
    val_before: dict[str, float] | None = None

    def marks(self) -> str:
        """What a training step changes once its updates begin, as one comparable string (params change only
        with the counters)."""
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


def state_dict(
    state: TrainState,
    host: HostState,
    *,
    data_iter: Any,
    ref: Any = None,
    meta: dict[str, Any],
    total_training_steps: int,
    config: dict[str, Any],
) -> dict[str, Any]:
    """The checkpoint tree of `state` / `host` (checkpoint.py): pytrees of arrays + JSON-able host values.

    Args:
      data_iter: the training loader's position (`loader.get_state()`), saved as `host['data_iter']`.
      ref: the reference params when they must be saved (they differ from the initial actor), else None.
      meta: the host keys that describe the run's models (`reference`, `model`; checkpoint.py).
      total_training_steps: the run's length; config: the job config as a dict (compared on resume).
    """
    critic = state.critic
    return {
        "actor": {"params": state.actor.params, "opt_state": state.actor.opt_state},
        "critic": None if critic is None else {"params": critic.params, "opt_state": critic.opt_state},
        "ref": None if ref is None else {"params": ref},
        "rng": np.asarray(jax.random.key_data(state.rng)),  # host value: the same on every process
        "host": {
            "global_steps": host.global_steps,
            "actor_update_count": host.actor_update_count,
            "critic_update_count": host.critic_update_count,
            "kl_ctrl": host.kl_ctrl.state_dict(),
            "data_iter": data_iter,
            "nonfinite": {"actor": host.actor_guard.state_dict(), "critic": host.critic_guard.state_dict()},
            **meta,
            "total_training_steps": total_training_steps,
            "val_before": host.val_before,  # reported again by a resumed run
            "config": config,  # what a resume with another config is compared with
        },
    }


def place_like(new, like):
    """`new`'s leaves placed with the shardings of `like`'s (a restored tree onto the live one)."""
    return jax.tree.map(lambda n, l: jax.device_put(n, l.sharding), new, like)


def load_state_dict(saved: dict[str, Any], state: TrainState, host: HostState) -> TrainState:
    """Inverse of `state_dict`: a new `TrainState` with the saved arrays placed like `state`'s; `host`'s
    counters, KL controller, guards and `val_before` set in place. The data position
    (`saved['host']['data_iter']`) and a saved reference are left to the caller."""
    actor = OptimizedParams(
        place_like(saved["actor"]["params"], state.actor.params),
        place_like(saved["actor"]["opt_state"], state.actor.opt_state),
    )
    critic = state.critic
    if critic is not None and saved.get("critic") is not None:
        critic = OptimizedParams(
            place_like(saved["critic"]["params"], critic.params),
            place_like(saved["critic"]["opt_state"], critic.opt_state),
        )
    h = saved["host"]
    host.global_steps = int(h["global_steps"])
    host.actor_update_count = int(h["actor_update_count"])
    host.critic_update_count = int(h["critic_update_count"])
    host.kl_ctrl.load_state_dict(h["kl_ctrl"])
    nonfinite = h.get("nonfinite") or {}
    host.actor_guard.load_state_dict(nonfinite.get("actor", {}))
    host.critic_guard.load_state_dict(nonfinite.get("critic", {}))
    host.val_before = h.get("val_before")
    rng = jax.random.wrap_key_data(jnp.asarray(saved["rng"]))
    return state.replace(actor=actor, critic=critic, rng=rng)
