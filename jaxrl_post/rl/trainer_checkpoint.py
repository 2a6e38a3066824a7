"""An `RLTrainer`'s checkpoint state: what `state_dict` saves (`train_state.state_dict` plus the model and
reference metadata, and with asynchronous training the queue and the rollout's weights) and how a checkpoint is
restored into a built trainer; the guards around a step that fails (`step_guard`, `stop_after_job_failure`,
`pay_owed_job`). The trainer's methods of the same names call these."""

from __future__ import annotations

import functools
from typing import Any

from jaxrl_post.engine import train_state
from jaxrl_post.engine.run import checkpoint as ckpt
from jaxrl_post.engine.run.run_files import config_to_dict
from jaxrl_post.engine.train_state import OptimizedParams, place_like
from jaxrl_post.rl.async_training.producer import AsyncRollout


def state_dict(trainer) -> dict[str, Any]:
    """Everything needed to resume exactly (`train_state.state_dict`: pytrees of arrays + JSON-able host
    values). The reference params are included only when they differ from the initial actor (never in this
    trainer); otherwise `host['reference']` points at how they are rebuilt."""
    cfg, ref = trainer.config, trainer.reference
    ref_saved = ref is not None and not ref.is_initial
    base = ckpt.reference_pointer(
        model_path=None if cfg.model.random_init else cfg.model.path,
        random_init=bool(cfg.model.random_init),
        seed=int(cfg.trainer.seed),
    )
    lora = trainer.policy.lora
    meta = {
        "reference": None if ref is None else "saved" if ref_saved else base,
        "model": ckpt.model_metadata(
            trainer.policy.model.config,
            cfg.model.tokenizer_path or cfg.model.path,
            lora=None if lora is None else lora.to_dict(),
            base=base,
        ),
    }
    out = train_state.state_dict(
        trainer.state,
        trainer.host,
        data_iter=trainer.data.train_loader.get_state(),
        ref=ref.params if ref_saved else None,
        meta=meta,
        total_training_steps=trainer.total_training_steps,
        config=config_to_dict(cfg),
    )
    if trainer.async_rollout is not None:  # the queue, the batch in flight, the rollout's (older) weights
        trainer.async_rollout.add_to_checkpoint(out, trainer.state.rollout)
    return out


def load_state_dict(trainer, saved: dict[str, Any]) -> None:
    """Inverse of `state_dict` (arrays are placed like the current ones)."""
    trainer.state = train_state.load_state_dict(saved, trainer.state, trainer.host)
    trainer.data.train_loader.set_state(saved["host"]["data_iter"])
    if saved.get("ref") is not None and trainer.reference is not None:
        trainer.reference.params = place_like(saved["ref"]["params"], trainer.reference.params)
    ar = trainer.async_rollout
    rollout_params = None if ar is None else ar.restore_checkpoint(saved, trainer.state.rollout)
    if rollout_params is None:  # synchronous (or a synchronous run's checkpoint): publish the actor's
        trainer.sync_weights()
        return
    trainer.state = trainer.state.replace(rollout=rollout_params)  # the rollout keeps its saved version's weights
    trainer.policy.sync_model(trainer.state.actor.params)


def step_snapshot(trainer) -> tuple:
    """What a step moves before its updates: the RNG, the data position and the asynchronous producer's state (its
    queue, the batch in flight), for `restore_step_snapshot` after a reward failure (`RLTrainer.run_step`)."""
    ar = trainer.async_rollout
    return trainer.state.rng, trainer.data.train_loader.get_state(), None if ar is None else ar.snapshot()


def restore_step_snapshot(trainer, snapshot: tuple) -> None:
    """Put back what `step_snapshot` took: resuming after the error repeats the step exactly."""
    rng, data_iter, producer = snapshot
    trainer.state = trainer.state.replace(rng=rng)
    trainer.data.train_loader.set_state(data_iter)
    if producer is not None:
        trainer.async_rollout.restore(producer)


def step_guard(trainer):
    """`RunDir.save_on_error_in_step` around the trainer's next step, with `step_snapshot` / `restore_step_snapshot`."""
    restore = functools.partial(restore_step_snapshot, trainer)
    args = (trainer.global_steps, trainer.host.marks, step_snapshot(trainer), restore, trainer.save_checkpoint)
    return trainer.run.save_on_error_in_step(*args)


def stop_after_job_failure(trainer, metrics: dict[str, float]) -> None:
    """After a step whose background generation job failed with a reward, tool or filter error
    (`AsyncRollout.finish_step`: the updates ran, the job is owed, the weights not published): log the step's
    metrics (without the failed job's queue counts), checkpoint the step with the job owed and re-raise its error.
    Nothing else happens."""
    ar = trainer.async_rollout
    if ar is None or ar.job_error is None:
        return
    err, ar.job_error = ar.job_error, None
    trainer.tracker.log(metrics, step=trainer.global_steps)
    where = f"in the generation ahead (background thread) of step {trainer.global_steps}"
    trainer.run.save_after_error(where, trainer.global_steps, trainer.save_checkpoint)
    raise err


def pay_owed_job(trainer) -> None:
    """A run resumed from a step whose background job failed (`stop_after_job_failure`): that job's generation
    runs now, from the saved producer, data position and rollout weights (`AsyncRollout.pay_owed`), then the weights
    are published as the step would have done (`RLTrainer.sync_weights`)."""
    ar = trainer.async_rollout
    if ar is None or ar.owed is None:
        return
    ar.pay_owed(trainer.reward_fn, lambda: next(trainer.data.train_loader))
    if trainer.global_steps >= int(trainer.config.trainer.critic_warmup):
        trainer.sync_weights(step=trainer.global_steps)


def load_checkpoint(trainer, root: str, step: int) -> None:
    """Restore the full training state of `<root>/global_step_<step>` into this trainer (arrays go
    straight to the current shardings). Raises CheckpointError (see `RunDir.restore`)."""

    def like(items: set[str]) -> dict:
        out = {k: v for k, v in trainer.state_dict().items() if k not in ("host", "async")}
        if "rollout.params" not in items:  # a synchronous run's checkpoint
            out.pop("rollout", None)
        if "async.arrays" in items:  # the queue's arrays: their sizes are in the host JSON
            out["async"] = {"arrays": AsyncRollout.arrays_like(trainer.run.open_checkpoint_dir(root).read_host(step))}
        if trainer.reference is not None and "ref.params" in items:
            out["ref"] = {"params": trainer.reference.params}
        return out

    p = trainer.policy
    trainer.load_state_dict(trainer.run.restore(root, step, like, model_config=p.model.config, lora=p.lora))
    n, total = trainer.global_steps, trainer.total_training_steps
    trainer.run.say(f"resumed from step {n}{f' of {total}' if n < total else ''} ({trainer.run.resumed_from})")


def load_actor_params_from(trainer, root: str, step: int) -> None:
    """Load only the actor params of a checkpoint (evaluation / export); optimizer state untouched."""
    actor = trainer.state.actor
    got = trainer.run.open_checkpoint_dir(root).restore(step, like={"actor": {"params": actor.params}})
    params = place_like(got["actor"]["params"], actor.params)
    trainer.state = trainer.state.replace(actor=OptimizedParams(params, actor.opt_state))
    trainer.sync_weights()
