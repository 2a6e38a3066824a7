"""The one update core: forward and optimizer-step builders written once, for any batch layout.

A *layout* says how a batch is laid out in memory and how a model scores it; everything else (which outputs a
forward returns, the actor / critic losses, micro-batch accumulation into one gradient, the non-finite guard,
the optimizer step, the metrics) is written here once:

* padded (`steps.padded_layout`, `model.use_remove_padding=False`): `[B, T]` rows, micro-batches are strided row
  slices, accumulated with `lax.scan`;
* packed (`packed_steps.PACKED`, the default): `packing.pack_batch` rows of real tokens with per-sequence `[M, R]`
  fields gathered per micro-batch; only micro-batches holding tokens run (`lax.fori_loop`, traced trip count).

A `Layout` provides (shape letters: M mini-batch rows, R response length, K top-k; a micro-batch's rows are `m`):

* `head(model, mb)`: what the LM head / log-softmax starts from (the padded response logits `[m, R, V]`, the
  packed slot hidden states `[Q, D]`), computed once per micro-batch and shared by the next three;
* `log_probs(model, mb, head, temperature, entropy) -> (log_probs [m, R] float32, entropy [m, R] | None)`;
* `gather_log_probs(model, mb, head, ids [m, R, K], temperature) -> [m, R, K] float32` (top-k distillation);
* `teacher_topk(model, mb, head, k, temperature) -> (log_probs [m, R, K] float32, ids [m, R, K] int32)`;
* `values(critic, mb) -> [m, R] float32`;
* `forward(per_micro, batch, trail, with_tokens=False) -> tuple of [M, R, ...]`: `per_micro(mb)` over the
  micro-batches, results put back at the mini-batch's rows; `with_tokens`: `per_micro` returns `(outputs, token
  field)` (a per-token field of the micro-batch's rows, e.g. its MoE routes) and the token fields come last, in
  the layout's token layout (`[M, T, ...]`, packed `[n, rows, L, ...]`);
* `accumulate(loss_fn, params, batch, keys) -> (loss, aux, grads)`: the sums over micro-batches of
  `value_and_grad(loss_fn)(params, mb, counts)`, `counts = core_algos.global_batch_info(loss_mask [M, R])` of the
  whole mini-batch, so the summed loss and gradient equal those of the un-split mini-batch. `mb` carries the
  micro-batch's model inputs and its `[m, R]` response fields (`UpdateKeys.response`) under their batch-key names.

Public helpers shared with the SFT / DPO / reward-model steps: `merge_model`, `apply_update`, `micro_at`,
`n_used`, `sum_over_used`.

Sources: verl `dp_actor.DataParallelPPOActor.{compute_log_prob,update_policy}` and
`dp_critic.DataParallelPPOCritic.{compute_values,update_critic}` (padded and `use_remove_padding`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from functools import partial
from typing import Any, Protocol

import jax
import jax.extend.core as jax_core
import jax.numpy as jnp
import optax
from flax import nnx

from jaxrl_post.engine.nonfinite import apply_if_finite
from jaxrl_post.models.lora import set_lora_enabled


@dataclasses.dataclass(frozen=True)
class UpdateKeys:
    """The batch keys an update reads (tuples from `batch_keys.py`): `padded`, every input of the padded layout;
    `response`, the `[M, R]` per-response fields (the packed layout gathers them per micro-batch)."""

    padded: tuple[str, ...]
    response: tuple[str, ...]


class Layout(Protocol):
    """How a batch is laid out and scored (module docstring)."""

    name: str

    def head(self, model, mb, with_moe: bool = False): ...  # with_moe: (head, moe.MoEOutput | None)
    def log_probs(self, model, mb, head, temperature: float, entropy: str): ...
    def gather_log_probs(self, model, mb, head, ids, temperature: float) -> jax.Array: ...
    def teacher_topk(self, model, mb, head, k: int, temperature: float): ...
    def values(self, critic, mb) -> jax.Array: ...
    def forward(self, per_micro: Callable, batch, trail, with_tokens: bool = False) -> tuple: ...
    def accumulate(self, loss_fn: Callable, params, batch, keys: UpdateKeys): ...


# ------------------------------------------------------------------------------------------ shared helpers


def merge_model(graphdef: nnx.GraphDef, params, frozen, rest) -> nnx.Module:
    """The module of `params` (+ a LoRA model's frozen base params `frozen`, None without LoRA) and `rest`."""
    return nnx.merge(graphdef, params, rest) if frozen is None else nnx.merge(graphdef, params, frozen, rest)


def apply_update(
    tx: optax.GradientTransformation, params, opt_state, grads, loss: jax.Array, metrics: dict[str, jax.Array]
) -> tuple[Any, Any, dict[str, jax.Array]]:
    """One optimizer step, skipped (params / state bitwise unchanged) when `loss` or the gradients are not finite
    (`nonfinite.apply_if_finite`). Returns `(params, opt_state, metrics)` with `grad_norm` (before clipping) and
    `update_skipped` (1.0 = skipped) `[] float32` added to `metrics`."""
    params, opt_state, grad_norm, finite = apply_if_finite(tx, params, opt_state, grads, loss)
    return params, opt_state, dict(metrics, grad_norm=grad_norm, update_skipped=1.0 - finite.astype(jnp.float32))


def micro_at(batch: dict[str, jax.Array], i: jax.Array) -> dict[str, jax.Array]:
    """Micro-batch `i` (a traced int) of arrays with a leading `[n_micro]` dim."""
    return jax.tree.map(lambda x: jax.lax.dynamic_index_in_dim(x, i, keepdims=False), batch)


def n_used(mask: jax.Array) -> jax.Array:
    """How many of the `[n_micro, ...]` micro-batches have a nonzero `mask` entry (int32 scalar); the layouts fill
    micro-batches in order, so they are a prefix."""
    return jnp.sum(jnp.any(mask != 0, axis=tuple(range(1, mask.ndim))).astype(jnp.int32))


def sum_over_used(value_at: Callable[[jax.Array], Any], n: jax.Array) -> Any:
    """The sum over `i < n` (`n` traced) of the pytree `value_at(i)` (float arrays), as a `lax.fori_loop`: a
    while loop, so micro-batches past `n` cost nothing while every shape stays static (no `lax.cond`: on XLA:CPU
    its branches each keep their own gradient buffers). `value_at` is traced once: its jaxpr gives the carry's
    shapes and is the loop body (tracing it again for the shapes doubled an update's trace time)."""
    closed, shapes = jax.make_jaxpr(value_at, return_shape=True)(jnp.int32(0))
    run, treedef = jax_core.jaxpr_as_fun(closed), jax.tree.structure(shapes)

    def body(i, carry):
        out = jax.tree.unflatten(treedef, run(jnp.asarray(i, jnp.int32)))
        return jax.tree.map(jnp.add, carry, out)

    init = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)
    return jax.lax.fori_loop(0, n, body, init)


def _traced(on_trace):
    if on_trace is not None:
        on_trace()


# ------------------------------------------------------------------------------------------ forward


def make_log_prob_fn(
    layout: Layout,
    graphdef: nnx.GraphDef,
    rest: nnx.State,
    *,
    temperature: float,
    with_entropy: bool,
    adapters: bool = True,
    on_trace: Callable[[], None] | None = None,
    topk: int = 0,
    record_routes: bool = False,
) -> Callable:
    """Pure `fn(params, batch, frozen=None) -> (log_probs [M, R] float32, entropy [M, R] float32 | None)` of
    `batch` in `layout`, under `logits / temperature`; with `topk` K > 0 also `(topk_log_probs [M, R, K] float32,
    topk_ids [M, R, K] int32)`, the teacher's K most likely tokens per position. `frozen`: a LoRA model's base
    params; `adapters=False` runs it with its adapters off (the reference of a LoRA actor). `record_routes` (an
    MoE model; `actor.router_replay.mode='R2'`): also, last, the experts every token was routed to,
    `routed_experts` uint8/int16 in the layout's token layout (`Layout.forward` with_tokens)."""
    mode = "loss" if with_entropy else "none"
    n = 2 if with_entropy else 1

    def per_micro(model, mb):
        head, moe = layout.head(model, mb, with_moe=True) if record_routes else (layout.head(model, mb), None)
        lp, ent = layout.log_probs(model, mb, head, temperature, mode)
        out = (lp, ent) if with_entropy else (lp,)
        out = out + (layout.teacher_topk(model, mb, head, topk, temperature) if topk else ())
        return (out, moe.routed_experts) if record_routes else out

    trail = (((), jnp.float32),) * n + ((((topk,), jnp.float32), ((topk,), jnp.int32)) if topk else ())

    def fn(params, batch, frozen=None):
        _traced(on_trace)
        model = merge_model(graphdef, params, frozen, rest)
        if not adapters:
            set_lora_enabled(model, False)
        outs = layout.forward(partial(per_micro, model), batch, trail, with_tokens=record_routes)
        res = (outs[0], outs[1]) if with_entropy else (outs[0], None)
        res = res + tuple(outs[n : n + 2]) if topk else res
        return res + (outs[-1],) if record_routes else res

    return fn


def make_value_fn(
    layout: Layout, graphdef: nnx.GraphDef, rest: nnx.State, *, on_trace: Callable[[], None] | None = None
) -> Callable:
    """Pure `fn(params, batch) -> values [M, R] float32` of a critic on `batch` in `layout`."""

    def fn(params, batch):
        _traced(on_trace)
        critic = merge_model(graphdef, params, None, rest)
        return layout.forward(lambda mb: (layout.values(critic, mb),), batch, (((), jnp.float32),))[0]

    return fn


# ------------------------------------------------------------------------------------------ update


def make_update(
    layout: Layout,
    loss_fn: Callable,
    tx: optax.GradientTransformation,
    keys: UpdateKeys,
    *,
    report_loss: bool,
    on_trace: Callable[[], None] | None = None,
    check: Callable[[dict], None] | None = None,
) -> Callable:
    """Pure `fn(params, opt_state, batch, frozen=None) -> (params, opt_state, metrics)`: ONE optimizer step on a
    mini-batch in `layout`. `loss_fn(params, mb, counts, frozen) -> (loss [] float32, aux metrics)` per
    micro-batch (`Layout.accumulate`); metrics are the summed aux (+ `loss` when `report_loss`), `grad_norm` and
    `update_skipped` (`apply_update`). `check(batch)` runs at trace time (raise on missing inputs)."""

    def fn(params, opt_state, batch, frozen=None):
        _traced(on_trace)
        if check is not None:
            check(batch)
        loss, aux, grads = layout.accumulate(partial(loss_fn, frozen=frozen), params, batch, keys)
        return apply_update(tx, params, opt_state, grads, loss, dict(aux, loss=loss) if report_loss else aux)

    return fn
