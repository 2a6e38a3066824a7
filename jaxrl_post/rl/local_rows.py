"""Process-local rows (`trainer.distributed.process_local_rows`, docs/multihost.md): each process of a multi-process
run keeps its own rows of the step's scored batch (its prompts' whole groups, `distributed.shard_loader`) instead of
gathering the whole batch (`distributed.gather_rows`), and the step exchanges only statistics.

What changes against the gathered path (`step.py` calls the helpers here only when `enabled`):
- the log-prob / value forwards and the updates get global arrays built from every process's rows
  (`Placement.process_local_rows`: `distributed.global_from_local`) and return this process's rows;
- advantages: the same jitted estimator on global arrays built from the local rows (`advantages`): group
  statistics (GRPO, RLOO, ...) stay inside each process's devices' groups, batch statistics (REINFORCE++ / GAE
  whitening) are reductions XLA partitions across processes (small all-reduces; not counted in
  `perf/host_gather_bytes`, which counts host-side gathers only);
- mini-batches: each process splits its own rows (`updates.minibatches` over its rows, mini-batches of
  `mini / processes` rows, the same seed on every process), so mini-batch i is the union of every process's i-th
  block, as verl's data-parallel actor splits each rank's chunk (`ppo_mini_batch_size` per rank). With one
  mini-batch per epoch the update sees the same rows as the gathered path (summed in another order); with several,
  other rows meet in a mini-batch than on one process, so runs are equal only in distribution, and resuming onto
  another process count changes the shuffle;
- metrics: `critic/*`, `response_length/*`, `prompt_length/*`, `reward/*`, token counts and dropped responses from
  per-process moments (`row_stats`), exchanged in one small all-gather each;
- an MoE actor: the replayed routes (`routed_experts`) are a batch key like the others, so they stay local; the
  mismatch metrics (`updates.moe_mismatch_metrics`) run on global arrays;
- still gathered (objects, once): validation (`validation_loop`), the reward's error messages and extra keys.

Not supported (config_errors names them): packing (`model.use_remove_padding`), dynamic sampling, asynchronous
training, multi-turn, distillation, rollout correction, `trainer.rollout_data_dir`, ReMax's greedy baselines.
"""

from __future__ import annotations

import jax
import numpy as np

from jaxrl_post.rl import metrics as metrics_lib
from jaxrl_post.runtime import row_stats
from jaxrl_post.runtime.distributed import global_from_local


def requested(cfg) -> bool:
    """Whether the config asks for process-local rows."""
    d = cfg.trainer.get("distributed")
    return bool(d is not None and d.get("process_local_rows"))


def enabled(cfg) -> bool:
    """Process-local rows in this run: requested and more than one process."""
    return requested(cfg) and jax.process_count() > 1


def config_errors(cfg) -> list[str]:
    """`config.<key>...: <problem>` lines for settings process-local rows do not support (none when off)."""
    if not requested(cfg):
        return []
    bad = {
        "model.use_remove_padding": cfg.model.use_remove_padding,
        "algorithm.filter_groups.enable": cfg.algorithm.filter_groups.enable,
        "async_training.mode": cfg.async_training.mode != "sync",
        "rollout.multi_turn.enable": cfg.rollout.multi_turn.enable,
        "distillation.enabled": cfg.distillation.enabled,
        "algorithm.rollout_correction.rollout_is": cfg.algorithm.rollout_correction.rollout_is is not None,
        "algorithm.rollout_correction.rollout_rs": cfg.algorithm.rollout_correction.rollout_rs is not None,
        "trainer.rollout_data_dir": bool(cfg.trainer.get("rollout_data_dir")),
        "algorithm.adv_estimator": cfg.algorithm.adv_estimator == "remax",
    }
    out = [
        f"config.trainer.distributed.process_local_rows=True: not supported with config.{k} set as it is "
        "(turn one of them off; docs/multihost.md)"
        for k, on in bad.items()
        if on
    ]
    n, p = int(cfg.rollout.n), jax.process_count()
    for key in ("actor.ppo_mini_batch_size", "critic.ppo_mini_batch_size"):
        mini = cfg[key.split(".")[0]].ppo_mini_batch_size
        if p > 1 and isinstance(mini, int) and (mini * n) % p:
            out.append(
                f"config.{key}={mini}: x rollout.n={n} responses must split evenly over the {p} processes "
                "(process-local rows: each process supplies its share of every mini-batch)"
            )
    return out


def check(c) -> None:
    """The `trainer.distributed.process_local_rows` section of `rl.config_check.validate_config`."""
    c.errors += config_errors(c.cfg)


def group_index(uids, n_rows: int) -> np.ndarray:
    """Group ids `[n_rows] int32` of this process's rows, distinct from every other process's (offset by
    process index x rows): the advantage estimator's `index` over the global array."""
    _, index = np.unique(np.asarray(uids), return_inverse=True)
    return (index.reshape(-1) + jax.process_index() * n_rows).astype(np.int32)


def advantages(trainer, b, uids, baselines):
    """The `adv` stage on this process's rows: `(token_level_rewards, current_kl, advantages, returns)`, the
    arrays this process's rows `[B / processes, R] float32`, `current_kl` a float (see the module docstring)."""
    mesh, place = trainer.placement.mesh, trainer.placement
    put = lambda x: None if x is None else global_from_local(np.asarray(x), mesh)
    n = b["loss_mask"].shape[0]
    rewards, kl, adv, ret = trainer.advantage(
        put(b["token_level_scores"]),
        put(b["loss_mask"]),
        put(group_index(uids, n)),
        np.float32(trainer.host.kl_ctrl.value),
        put(b.get("old_log_probs")),
        put(b.get("ref_log_prob")),
        put(b.get("values")),
        put(None if baselines is None else np.asarray(baselines, np.float32)),
    )
    own = lambda x: place._own_rows(x, n * jax.process_count())
    return own(rewards), float(np.asarray(kl.addressable_data(0))), own(adv), own(ret)


def step_metrics(cfg, geometry, model_config, n_devices: int, step: int, b, timing, prompts, use_critic: bool):
    """`updates.step_metrics` from this process's rows: data metrics from every process's moments, token counts
    summed, `perf/mfu/actor` from the summed FLOPs of all sequences."""
    r = geometry.response_length
    kw = dict(use_critic=use_critic, max_prompt_length=int(cfg.data.max_prompt_length), max_response_length=r)
    local = metrics_lib.data_metric_moments(b, **kw)
    seq_lens = b["attention_mask"].sum(-1)
    flops = sum(metrics_lib.transformer_flops_per_sequence(model_config, int(t), training=True) for t in seq_lens)
    local["_prompt_tokens"] = row_stats.moments([float(b["attention_mask"][:, :-r].sum())])
    local["_response_tokens"] = row_stats.moments([float(b["response_attention_mask"].sum())])
    local["_flops"] = row_stats.moments([flops])
    total = row_stats.allreduce_moments(local)
    m = metrics_lib.data_metrics_from_moments(total, use_critic)
    n_prompt_tok, n_resp_tok = int(total["_prompt_tokens"][1]), int(total["_response_tokens"][1])
    m.update(metrics_lib.compute_timing_metrics(timing, n_prompt_tok, n_resp_tok))
    m.update(metrics_lib.compute_throughput_metrics(n_prompt_tok + n_resp_tok, timing["step"], n_devices))
    if "update_actor" in timing:
        seconds = max(timing["update_actor"], 1e-9)
        m["perf/mfu/actor"] = float(
            total["_flops"][1] * int(cfg.actor.ppo_epochs) / seconds / (geometry.peak_flops * max(n_devices, 1))
        )
    m["training/global_step"] = float(step)
    m["training/epoch"] = float(prompts.meta_info.get("epoch", 0))
    return m
