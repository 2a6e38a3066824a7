"""Config checks of asynchronous training (`async_training.*`, docs/async.md) and of the split placement
(`rollout.n_gpus_per_node`, `rollout.nnodes`: verl fully-async's names). Sections of `rl/config_check.py`'s table;
they report through an `errors.Checker`. `settings.AsyncSettings` reads the same keys once they pass."""

from __future__ import annotations

import jax

from jaxrl_post.errors import Checker, is_int
from jaxrl_post.rl.async_training.settings import MODES


def check_async(c: Checker) -> None:
    """`async_training.*` (asynchronous training, docs/async.md; the placement keys: `check_placement`)."""
    cfg = c.cfg
    if cfg.get("async_training") is None:
        return
    if not c.check("async_training.mode", lambda v: v in MODES, f"valid: {list(MODES)}"):
        return
    a = cfg.async_training
    c.check("async_training.partial_rollout_dispatches", lambda v: is_int(v) and v >= 1, "must be an int >= 1")
    if a.mode == "sync":
        return
    c.check("async_training.partial_rollout", lambda v: isinstance(v, bool), "must be a bool")
    c.check("async_training.background_producer", lambda v: isinstance(v, bool), "must be a bool")
    if a.mode == "fully_async":
        ok = c.check("async_training.staleness_threshold", lambda v: is_int(v) and v >= 0, "must be an int >= 0")
        ok &= c.check(
            "async_training.trigger_parameter_sync_step", lambda v: is_int(v) and v >= 1, "must be an int >= 1"
        )
        tb = cfg.data.train_batch_size
        c.check(
            "async_training.require_batches",
            lambda v: is_int(v) and v >= 1 and is_int(tb) and tb % v == 0,
            f"must be an int >= 1 dividing data.train_batch_size={tb}",
        )
        least = (int(a.trigger_parameter_sync_step) - 1 + int(a.partial_rollout is True)) if ok else 0
        if ok and a.staleness_threshold < least:
            c.err(
                "async_training.staleness_threshold",
                f"must be >= trigger_parameter_sync_step - 1 (+ 1 with partial_rollout) = {least}: the rollout's "
                "weights would be older than that when their groups train",
            )
        if a.partial_rollout is True and cfg.rollout.name != "paged":
            c.err("async_training.partial_rollout", "needs rollout.name='paged' (stop and resume at a dispatch)")
        if a.partial_rollout is True and cfg.rollout.multi_turn.enable:
            c.err(
                "async_training.partial_rollout",
                "is not supported with rollout.multi_turn.enable (the agent loop does not stop inside a turn)",
            )


def check_placement(c: Checker) -> None:
    """`rollout.n_gpus_per_node`, `rollout.nnodes` (verl fully-async's names): the split placement, the first
    `n_gpus_per_node` devices a rollout mesh of their own, the rest the training mesh (docs/async.md), in one
    process (`c.devices`: the run's devices and processes). Whether `trainer.mesh` fits the training devices is
    checked with the batch arithmetic (`rl/config_check.py`)."""
    cfg = c.cfg
    if not c.check("rollout.n_gpus_per_node", lambda v: is_int(v) and v >= 0, "must be an int >= 0 (0 = colocated)"):
        return
    nodes_ok = c.check("rollout.nnodes", lambda v: is_int(v) and v >= 1, "must be an int >= 1")
    n = cfg.rollout.n_gpus_per_node
    if n == 0:
        return
    n_devices, n_processes = c.devices.total, c.devices.processes
    if n >= n_devices:
        msg = f"must be < the run's {n_devices} devices: the rest form the training mesh"
        if jax.default_backend() == "cpu":  # a CPU user trying the split placement: fake devices are one flag away
            msg += f"; on a CPU, XLA_FLAGS=--xla_force_host_platform_device_count={n + 1} (set before the run) "
            msg += "gives more"
        c.err("rollout.n_gpus_per_node", msg)
    if nodes_ok and cfg.rollout.nnodes != 1:
        c.err(
            "rollout.nnodes",
            "must be 1: the split placement divides one process's devices (rollout hosts of their "
            "own are not built yet)",
        )
    if n_processes > 1:
        c.err("rollout.n_gpus_per_node", f"the split placement runs in one process for now, the run has {n_processes}")
    if cfg.rollout.name == "paged" and n != 1 and cfg.rollout.get("tensor_model_parallel_size") is None:
        c.err(
            "rollout.name",
            f"'paged' runs on one device unless rollout.tensor_model_parallel_size shards it: with the split "
            f"placement it needs rollout.n_gpus_per_node=1, not {n}, or that key = a tp dividing {n} ({n} / tp "
            "data-parallel engine replicas); or use 'dense'",
        )
