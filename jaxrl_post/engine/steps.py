"""The `forward` and `update` jit boundaries of the trainer (the third, `generate`, lives in rollout/).

Everything here is a pure function of (graphdef, state, batch). The trainer builds each jitted function
once (`jax.jit` with explicit shardings and donated params/optimizer state) and calls it every step with
same-shaped arrays, so each compiles exactly once per run.

* the padded layout (`PaddedLayout`, `padded_layout(...)`): `[B, T]` rows, micro-batched with `lax.map` (forward) or
  `lax.scan` (update), so only one micro-batch's `[mb, R, V]` logits are live. A mini-batch `[M, ...]` is viewed
  as `[mb, n_micro, ...]` (micro-batch k = rows k, k + n_micro, ...; each device keeps its rows); every micro loss
  is aggregated with the *mini-batch's* token / sequence counts (`core_algos.global_batch_info`), so the summed
  loss and gradient equal those of the un-split mini-batch (`agg_loss` docstring).
* the shared per-micro-batch math: response log-probs / logits / values, the loss mask, the optimizer and its LR
  schedule, splitting a model into trained / frozen / other state.

The forwards and updates are built once, for any layout, in `update_core.py` (`make_log_prob_fn(layout, ...)`,
`make_value_fn`, `make_update`; the RL losses in `rl/ppo_update.py`); this file owns the padded layout
(`model.use_remove_padding=False`); the default packed layout, on rows of real tokens with the same losses, is
`packed_steps.PACKED`.

Shape letters: B batch (responses), M mini-batch, mb micro-batch, P prompt, R response, T = P + R, V vocab.
Sources: verl `dp_actor.DataParallelPPOActor.{compute_log_prob,update_policy}`,
`dp_critic.DataParallelPPOCritic.{compute_values,update_critic}`.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from jaxrl_post.algos import core_algos, functional
from jaxrl_post.algos.distillation_topk import gather_log_probs, teacher_topk
from jaxrl_post.batch.keys import FORWARD_KEYS, REPLAY_KEYS
from jaxrl_post.engine import update_core

# ------------------------------------------------------------------------------------------ configs


@dataclasses.dataclass(frozen=True)
class OptimConfig:
    """AdamW + linear warmup + constant/cosine schedule + clip_by_global_norm (verl `actor.optim`).

    `total_steps` and `warmup_steps` count *training* steps, as verl's scheduler (stepped once per training
    step); each training step makes `updates_per_step` optimizer updates (epochs x mini-batches), all with
    the same learning rate.
    """

    lr: float = 1e-6
    total_steps: int = 1  # training steps of the whole run (for the cosine decay)
    warmup_steps: int = 0  # training steps of linear warmup
    updates_per_step: int = 1  # optimizer updates per training step
    warmup_style: str = "constant"  # 'constant' | 'cosine'
    min_lr_ratio: float = 0.0
    weight_decay: float = 0.01
    b1: float = 0.9
    b2: float = 0.999
    eps: float = 1e-8
    grad_clip: float = 1.0


def make_lr_schedule(cfg: OptimConfig) -> optax.Schedule:
    """lr as a function of the optimizer update count.

    With s = count // updates_per_step (the training step): `lr * (s + 1) / warmup_steps` while
    s < warmup_steps, then constant `lr` or a cosine decay from `lr` to `min_lr_ratio * lr` at total_steps.
    """
    warm = max(int(cfg.warmup_steps), 0)
    if cfg.warmup_style == "cosine":
        after = optax.cosine_decay_schedule(cfg.lr, max(int(cfg.total_steps) - warm, 1), alpha=cfg.min_lr_ratio)
    elif cfg.warmup_style == "constant":
        after = optax.constant_schedule(cfg.lr)
    else:
        raise ValueError(f"warmup_style must be 'constant' or 'cosine', got {cfg.warmup_style!r}")
    per = max(int(cfg.updates_per_step), 1)

    def schedule(count):
        s = jnp.asarray(count) // per
        if warm == 0:
            return after(s)
        return jnp.where(s < warm, cfg.lr * (s + 1.0) / warm, after(jnp.maximum(s - warm, 0)))

    return schedule


def make_optimizer(cfg: OptimConfig) -> optax.GradientTransformation:
    """`clip_by_global_norm(grad_clip)` then AdamW with the schedule of `make_lr_schedule`."""
    return optax.chain(
        optax.clip_by_global_norm(cfg.grad_clip),
        optax.adamw(make_lr_schedule(cfg), b1=cfg.b1, b2=cfg.b2, eps=cfg.eps, weight_decay=cfg.weight_decay),
    )


# ------------------------------------------------------------------------------------------ helpers


def split_model(model: nnx.Module) -> tuple[nnx.GraphDef, nnx.State, nnx.State]:
    """`(graphdef, params, rest)`: trainable `nnx.Param` state and everything else (usually empty)."""
    return nnx.split(model, nnx.Param, ...)


def split_lora_model(model: nnx.Module) -> tuple[nnx.GraphDef, nnx.State, nnx.State, nnx.State]:
    """`(graphdef, adapters, frozen, rest)` of a model with LoRA: the trainable `nnx.LoRAParam` (A/B) state, the
    frozen base `nnx.Param`s (passed to the jitted fns as their `frozen` argument, never closed over: a
    closure would bake the weights into the executable as constants) and everything else."""
    return nnx.split(model, nnx.LoRAParam, nnx.Param, ...)


def to_micro(x: jax.Array, n_micro: int) -> jax.Array:
    """`[M, ...] -> [n_micro, M // n_micro, ...]` with micro-batch k = rows k, k + n_micro, ...

    Row r goes to micro-batch r % n_micro at position r // n_micro, so a leading dim sharded in
    contiguous blocks over devices stays sharded on the micro-batch dim (no data movement).
    """
    m = x.shape[0]
    y = x.reshape((m // n_micro, n_micro) + x.shape[1:])
    return jnp.swapaxes(y, 0, 1)


def from_micro(y: jax.Array) -> jax.Array:
    """Inverse of `to_micro`: `[n_micro, mb, ...] -> [n_micro * mb, ...]`."""
    x = jnp.swapaxes(y, 0, 1)
    return x.reshape((x.shape[0] * x.shape[1],) + x.shape[2:])


def response_log_probs(
    model: nnx.Module, batch: dict[str, jax.Array], temperature: float, with_entropy: bool | str
) -> tuple[jax.Array, jax.Array | None]:
    """log pi(responses) `[b, R] float32` (+ entropy `[b, R] float32` or None) under `logits / temperature`.

    Only the R + 1 last positions go through the LM head: logits at T-R-1 .. T-2 score response tokens.
    with_entropy: False / True (= 'loss'), or a `functional.token_log_probs` mode ('none', 'metric', 'loss').
    """
    return _log_probs_of_logits(response_logits(model, batch), batch, temperature, with_entropy)


def response_logits(model: nnx.Module, batch: dict[str, jax.Array], with_moe: bool = False):
    """The logits that score the response tokens, `[b, R, V]` (model dtype): only the R + 1 last positions go
    through the LM head; position t predicts `responses[:, t]`. with_moe: `(logits, moe.MoEOutput | None)`.
    `batch["routed_experts"]` `[b, T, M, k]`, when present, are forced as the MoE routes (routing replay)."""
    r = batch["responses"].shape[1]
    ids, mask, pos = batch["input_ids"], batch["attention_mask"], batch.get("position_ids")
    routes = batch.get("routed_experts")
    out = model(ids, mask, positions=pos, logits_to_keep=r + 1, routed_experts=routes, with_moe=with_moe)
    return (out[0][:, :-1], out[1]) if with_moe else out[:, :-1]


def _log_probs_of_logits(logits, batch, temperature: float, with_entropy: bool | str):
    mode = {False: "none", True: "loss"}.get(with_entropy, with_entropy)
    return functional.token_log_probs(
        logits, batch["responses"], temperature, mode, batch.get("sampling_logit_threshold")
    )


def response_values(critic: nnx.Module, batch: dict[str, jax.Array]) -> jax.Array:
    """Critic values of the states before each response token, `[b, R] float32` (verl: values[:, -R-1:-1])."""
    r = batch["responses"].shape[1]
    values = critic(batch["input_ids"], batch["attention_mask"], positions=batch.get("position_ids"))
    t = values.shape[1]
    return values[:, t - r - 1 : t - 1].astype(jnp.float32)


def compute_loss_mask(loss_mask, truncated, drop_truncated: bool):
    """The tokens the update trains, `[B, R] int32`: the rollout's `loss_mask` (the model's own tokens), with
    every token of truncated responses (no EOS within R, `truncated [B] bool`) removed when `drop_truncated`
    -- they leave numerator and denominator of every `loss_agg_mode`."""
    mask = jnp.asarray(loss_mask).astype(jnp.int32)
    if not drop_truncated:
        return mask
    return mask * (~jnp.asarray(truncated, bool))[:, None].astype(jnp.int32)


# ------------------------------------------------------------------------------------------ layout


@dataclasses.dataclass(frozen=True)
class PaddedLayout:
    """The padded batch layout of `update_core` (`model.use_remove_padding=False`): `[M, T]` token rows, `[M, R]`
    response fields; the micro-batches are `to_micro` row slices, `n_micro` of them (or of `micro_batch_size`
    rows), mapped with `lax.map` (forward) or scanned with `lax.scan` (update)."""

    n_micro: int | None = None
    micro_batch_size: int | None = None
    name: str = "padded"

    def _micro(self, batch: dict[str, jax.Array]) -> dict[str, jax.Array]:
        rows = batch["input_ids"].shape[0]
        n = self.n_micro if self.n_micro is not None else rows // self.micro_batch_size
        return jax.tree.map(lambda x: to_micro(x, n), batch)

    def head(self, model, mb, with_moe=False):
        return response_logits(model, mb, with_moe)

    def log_probs(self, model, mb, head, temperature, entropy):
        return _log_probs_of_logits(head, mb, temperature, entropy)

    def gather_log_probs(self, model, mb, head, ids, temperature):
        return gather_log_probs(head, ids, temperature)

    def teacher_topk(self, model, mb, head, k, temperature):
        return teacher_topk(head, k, temperature)

    def values(self, critic, mb):
        return response_values(critic, mb)

    def forward(self, per_micro, batch, trail, with_tokens=False):
        micro = self._micro({k: batch[k] for k in (*FORWARD_KEYS, *REPLAY_KEYS) if k in batch})
        outs = jax.lax.map(per_micro, micro)
        outs = (*outs[0], outs[1]) if with_tokens else outs  # the token field: `[n_micro, mb, T, ...]` too
        return tuple(from_micro(o) for o in outs)

    def accumulate(self, loss_fn, params, batch, keys: update_core.UpdateKeys):
        batch = {k: batch[k] for k in keys.padded if k in batch}
        counts = core_algos.global_batch_info(batch["loss_mask"])
        grad_fn = jax.value_and_grad(loss_fn, has_aux=True)

        def body(carry, mb):
            grads, loss = carry
            (l, a), g = grad_fn(params, mb, counts)
            return (jax.tree.map(jnp.add, grads, g), loss + l), a

        init = (jax.tree.map(jnp.zeros_like, params), jnp.zeros((), jnp.float32))
        (grads, loss), aux = jax.lax.scan(body, init, self._micro(batch))
        return loss, jax.tree.map(lambda x: jnp.sum(x, axis=0), aux), grads


def padded_layout(*, n_micro: int | None = None, micro_batch_size: int | None = None) -> PaddedLayout:
    """The padded layout with `n_micro` micro-batches per mini-batch (updates) or micro-batches of
    `micro_batch_size` rows (forwards; the batch rows must be a multiple)."""
    return PaddedLayout(n_micro=n_micro, micro_batch_size=micro_batch_size)
