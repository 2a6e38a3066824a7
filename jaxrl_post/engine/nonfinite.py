"""Skipping optimizer updates with a non-finite loss or gradients, and stopping after too many in a row.

* `apply_if_finite` (pure, jit-able): one optax step whose result is selected with `jnp.where`: when the
  loss or the global gradient norm is NaN/inf, the returned params and optimizer state are the inputs,
  bit for bit (also under buffer donation), and `finite` is False.
* `NonFiniteGuard` (host): counts skipped updates (total and consecutive) and raises `NonFiniteError`
  after `trainer.max_consecutive_nonfinite` consecutive skips, before anything else is written, so the
  last checkpoint stays the last good one.

Why not `optax.apply_if_finite`: it checks only the gradients (not the loss), and a skipped step still
goes through `optax.apply_updates(params, zeros)`, which turns -0.0 params into +0.0 (not bitwise
untouched); its skip counters live inside the optimizer state, so "optimizer state untouched" would not
hold either. The select below leaves both exactly as they were.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import jax
import jax.numpy as jnp
import optax


class NonFiniteError(FloatingPointError):
    """Too many consecutive optimizer updates had a non-finite loss or gradients."""


def apply_if_finite(
    tx: optax.GradientTransformation, params: Any, opt_state: Any, grads: Any, loss: jax.Array
) -> tuple[Any, Any, jax.Array, jax.Array]:
    """`tx` step on `params`, or no change at all when `loss` or any gradient is not finite.

    Args:
      tx: the optimizer. params / opt_state / grads: matching pytrees (grads like params).
      loss: scalar float32 loss of this update.

    Returns:
      `(params, opt_state, grad_norm [] float32, finite [] bool)`; `grad_norm` is the pre-clipping global
      norm (NaN/inf when the gradients are not finite).
    """
    grad_norm = optax.tree.norm(grads)
    finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
    # zero the gradients first so the discarded branch cannot produce NaN-dependent work or signals
    safe_grads = jax.tree.map(lambda g: jnp.where(finite, g, jnp.zeros_like(g)), grads)
    updates, new_opt_state = tx.update(safe_grads, opt_state, params)
    new_params = optax.apply_updates(params, updates)
    keep = lambda new, old: jax.tree.map(lambda n, o: jnp.where(finite, n, o), new, old)
    return keep(new_params, params), keep(new_opt_state, opt_state), grad_norm, finite


class NonFiniteGuard:
    """Host-side count of skipped (non-finite) optimizer updates.

    Args:
      max_consecutive: raise after this many skipped updates in a row (<= 0: never raise).
      name: which model's updates ('actor', 'critic'), for the message and metrics.
    """

    def __init__(self, max_consecutive: int, name: str = "actor"):
        self.max_consecutive = int(max_consecutive)
        self.name = name
        self.consecutive = 0
        self.total = 0

    def observe(self, skipped: Iterable[Any], *, step: int | None = None) -> dict[str, float]:
        """Record the skip flags of updates in the order they ran (bools or 0/1 floats).

        Returns metrics `{name}/num_nonfinite_skipped` (this call), `{name}/nonfinite_skipped_total`.

        Raises:
          NonFiniteError: `max_consecutive` consecutive updates were skipped (message names the setting).
        """
        n_now = 0
        for s in skipped:
            if float(s) > 0.5:
                n_now += 1
                self.total += 1
                self.consecutive += 1
                if 0 < self.max_consecutive <= self.consecutive:
                    at = "" if step is None else f" (at training step {step})"
                    raise NonFiniteError(
                        f"{self.consecutive} consecutive {self.name} optimizer updates had a non-finite loss or "
                        f"non-finite gradients{at}; each was skipped (params and optimizer state untouched), and "
                        f"trainer.max_consecutive_nonfinite={self.max_consecutive} stops the run here. The last "
                        f"saved checkpoint is unaffected. Lower the learning rate, check the data/rewards, or raise "
                        f"the limit."
                    )
            else:
                self.consecutive = 0
        return {
            f"{self.name}/num_nonfinite_skipped": float(n_now),
            f"{self.name}/nonfinite_skipped_total": float(self.total),
        }

    def state_dict(self) -> dict[str, int]:
        return {"consecutive": self.consecutive, "total": self.total}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.consecutive = int(state.get("consecutive", 0))
        self.total = int(state.get("total", 0))
