"""SFT batch layout (host, numpy) and the jitted SFT `update` / `evaluate` functions.

Layout (`layout_batch`): the examples of one global batch go into `n_micro` micro-batches of `rows` rows of
`row_len` tokens, `[n_micro, rows, row_len] int32` each: `input_ids`, `segment_ids` (1, 2, ... per
example in a row; 0 = padding), `positions` (0, 1, ... per example), `labels` (the next token of the same
example; 0 where there is none) and `loss_mask` (1 where `labels` is trained: the next token is an
assistant / completion token). Unpacked (`pack=False`): one example per row, in order. Packed: first-fit
decreasing, many examples per row (or rows packed once over the dataset, best-fit decreasing, and given as
`plan`: `data.packing_strategy='bfd'`); attention is masked per segment (`Transformer.hidden_states(segment_ids)`),
so every example sees exactly the tokens it would see alone.

Loss (`make_sft_update`): token-level NLL of the `loss_mask` tokens, aggregated "token-mean" over the number
of loss tokens of the WHOLE global batch (TRL `SFTTrainer` with `num_items_in_batch`; verl
`loss_agg_mode='token-mean'`): each micro-batch adds `sum(nll) / N_global`, so micro-batching and packing
never change the loss or the gradient (float roundoff only). Micro-batches are accumulated inside one jitted
update by a `lax.fori_loop` whose trip count is the number of micro-batches that hold tokens (packing fills
them first; trailing empty ones cost nothing, shapes and compiles stay fixed). Only the loss tokens go
through the LM head (`Transformer.token_stats_from_hidden`: chunked, fused log-softmax, no `[Q, V]` logits).

Metrics (TRL names): `loss`, `mean_token_accuracy` (argmax == label over the loss tokens), `grad_norm`
(before clipping), `num_loss_tokens`, `update_skipped` (non-finite loss or gradients: no update).

Sources: TRL `SFTTrainer.compute_loss` (sum of -log p over completion tokens / num_items_in_batch) and its
`mean_token_accuracy`; verl `FSDPSFTTrainer._compute_loss_and_backward` (shifted labels, loss mask).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from jaxrl_post.engine.row_packer import pack_rows
from jaxrl_post.engine.update_core import apply_update, merge_model, micro_at, n_used, sum_over_used

LAYOUT_KEYS = ("input_ids", "segment_ids", "positions", "labels", "loss_mask")
PACKING_STRATEGIES = ("per_step", "bfd")  # `data.packing_strategy` (SFT): the step's examples | the dataset's


# ------------------------------------------------------------------------------------------ host layout


def micro_geometry(batch_size: int, micro_batch_size: int) -> tuple[int, int]:
    """(n_micro, rows per micro-batch) of a global batch: `batch_size / micro_batch_size` micro-batches of
    `micro_batch_size` rows. Raises ValueError when it does not divide."""
    if batch_size < 1 or micro_batch_size < 1 or batch_size % micro_batch_size:
        raise ValueError(
            f"data.train_batch_size ({batch_size}) must be a positive multiple of data.micro_batch_size "
            f"({micro_batch_size})"
        )
    return batch_size // micro_batch_size, micro_batch_size


def layout_batch(
    input_ids: Sequence[np.ndarray],
    loss_mask: Sequence[np.ndarray],
    *,
    n_micro: int,
    rows: int,
    row_len: int,
    pack: bool,
    plan: Sequence[Sequence[int]] | None = None,
) -> dict[str, np.ndarray]:
    """The `[n_micro, rows, row_len] int32` arrays of `LAYOUT_KEYS` for examples `input_ids[i]`, `loss_mask[i]`
    (`[T_i]`, `loss_mask[i][t] = 1`: token t is trained; empty examples are left out).

    `plan` (optional): the example indices of each row, already packed (best fit decreasing over the dataset:
    `SFTTask.pack_dataset`); without it the examples are packed here (`pack`: first-fit decreasing,
    `row_packer.pack_rows`) or one per row.

    Raises ValueError when an example is longer than `row_len`, a planned row overflows, or the examples need
    more than `n_micro * rows` rows (unpacked: more examples than rows).
    """
    lengths = [len(x) for x in input_ids]
    if lengths and max(lengths) > row_len:
        raise ValueError(f"an example of {max(lengths)} tokens does not fit a row of {row_len}")
    if plan is None and pack:
        plan = pack_rows(lengths, row_len, skip_empty=True).rows()
    elif plan is None:
        plan = [[i] for i in range(len(lengths)) if lengths[i] > 0]
    if len(plan) > n_micro * rows:
        raise ValueError(f"{len(plan)} rows needed, the batch layout has {n_micro * rows}")
    shape = (n_micro * rows, row_len)
    out = {k: np.zeros(shape, np.int32) for k in LAYOUT_KEYS}
    for r, members in enumerate(plan):
        if sum(lengths[i] for i in members) > row_len:
            raise ValueError(f"row {r} of the plan holds {sum(lengths[i] for i in members)} tokens > {row_len}")
        at = 0
        for s, i in enumerate(members, start=1):
            ids, m, t = np.asarray(input_ids[i]), np.asarray(loss_mask[i]), lengths[i]
            sl = slice(at, at + t)
            out["input_ids"][r, sl] = ids
            out["segment_ids"][r, sl] = s
            out["positions"][r, sl] = np.arange(t)
            out["labels"][r, at : at + t - 1] = ids[1:]
            out["loss_mask"][r, at : at + t - 1] = m[1:]
            at += t
    return {k: v.reshape(n_micro, rows, row_len) for k, v in out.items()}


# ------------------------------------------------------------------------------------------ jitted


def _argmax_hits(model, h: jax.Array, labels: jax.Array, n_valid: jax.Array, chunk: int) -> jax.Array:
    """Number of the first `n_valid` slots whose argmax token is the label (`[] float32`, no gradient); the LM
    head runs in chunks of `chunk` slots over the used ones only."""
    h = jax.lax.stop_gradient(h)
    q = h.shape[0]
    q_pad = -(-q // chunk) * chunk
    hp = jnp.pad(h, ((0, q_pad - q), (0, 0)))
    lab = jnp.pad(labels, (0, q_pad - q))

    def body(i, acc):
        hc = jax.lax.dynamic_slice_in_dim(hp, i * chunk, chunk)
        pred = jnp.argmax(model.logits_from_hidden(hc[None])[0], axis=-1)
        valid = i * chunk + jnp.arange(chunk) < n_valid
        hit = (pred == jax.lax.dynamic_slice_in_dim(lab, i * chunk, chunk)) & valid
        return acc + jnp.sum(hit.astype(jnp.float32))

    n_chunks = (n_valid + chunk - 1) // chunk
    return jax.lax.stop_gradient(jax.lax.fori_loop(0, n_chunks, body, jnp.zeros((), jnp.float32)))


def micro_stats(model, mb: dict[str, jax.Array], chunk: int = 512) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(sum of -log p(label) over the loss tokens, argmax hits, loss tokens), `[] float32` each, of one
    micro-batch `[rows, L]` (`LAYOUT_KEYS`). Only the loss tokens go through the LM head (chunked)."""
    seg = mb["segment_ids"]
    h = model.hidden_states(mb["input_ids"], seg != 0, mb["positions"], segment_ids=seg)
    flat = mb["loss_mask"].reshape(-1)
    q = flat.shape[0]
    n = jnp.sum(flat)
    (slot,) = jnp.nonzero(flat, size=q, fill_value=0)  # loss-token positions first, in order
    hq = h.reshape(q, h.shape[-1])[slot]
    labels = mb["labels"].reshape(-1)[slot]
    lp, _ = model.token_stats_from_hidden(hq, labels, n, 1.0, "none", chunk=chunk)
    hits = _argmax_hits(model, hq, labels, n, chunk)
    return -jnp.sum(lp), hits, n.astype(jnp.float32)


def _n_used(batch) -> jax.Array:
    """Micro-batches holding tokens (a prefix: the layout fills them in order), int32 scalar."""
    return n_used(batch["segment_ids"])


def _micro(batch, i):
    return micro_at({k: batch[k] for k in LAYOUT_KEYS}, i)


def make_sft_grads(graphdef: nnx.GraphDef, rest: nnx.State, *, chunk: int = 512) -> Callable:
    """Pure `fn(params, batch, frozen=None) -> (loss, hits, num_loss_tokens, grads)`: the token-mean NLL `[]
    float32` of a `layout_batch` batch (sum over its loss tokens of -log p(label) / max(N, 1), N = the loss
    tokens of the WHOLE batch), argmax hits `[] float32`, N, and d loss / d params (like `params`), accumulated
    over the used micro-batches. `frozen`: a LoRA model's base params (`steps.split_lora_model`)."""

    def loss_fn(params, mb, denom, frozen):
        model = merge_model(graphdef, params, frozen, rest)
        nll, hits, _ = micro_stats(model, mb, chunk)
        return nll / denom, hits

    grad_fn = jax.value_and_grad(loss_fn, has_aux=True)

    def fn(params, batch, frozen=None):
        n_total = jnp.sum(batch["loss_mask"]).astype(jnp.float32)
        denom = jnp.maximum(n_total, 1.0)

        def grads_at(i):
            (loss, hits), grads = grad_fn(params, _micro(batch, i), denom, frozen)
            return grads, loss, hits

        grads, loss, hits = sum_over_used(grads_at, _n_used(batch))
        return loss, hits, n_total, grads

    return fn


def make_sft_update(
    graphdef: nnx.GraphDef,
    rest: nnx.State,
    tx: optax.GradientTransformation,
    *,
    chunk: int = 512,
    on_trace: Callable[[], None] | None = None,
) -> Callable:
    """Pure `fn(params, opt_state, batch, frozen=None) -> (params, opt_state, metrics)`: one SFT optimizer step
    on a global batch laid out by `layout_batch` (`[n_micro, rows, L] int32` arrays); wrap with `jax.jit`.

    `params`: all params, or a LoRA model's adapters with its frozen base as `frozen`
    (`steps.split_lora_model`). Loss and gradients: `make_sft_grads`. A non-finite loss or gradient leaves
    params and optimizer state unchanged (`update_skipped` = 1). Metrics (`[] float32`): loss,
    mean_token_accuracy, grad_norm (before clipping), num_loss_tokens, update_skipped.
    """
    grads_fn = make_sft_grads(graphdef, rest, chunk=chunk)

    def fn(params, opt_state, batch, frozen=None):
        if on_trace is not None:
            on_trace()
        loss, hits, n_total, grads = grads_fn(params, batch, frozen)
        metrics = {"loss": loss, "mean_token_accuracy": hits / jnp.maximum(n_total, 1.0), "num_loss_tokens": n_total}
        return apply_update(tx, params, opt_state, grads, loss, metrics)

    return fn


def make_sft_eval(
    graphdef: nnx.GraphDef, rest: nnx.State, *, chunk: int = 512, on_trace: Callable[[], None] | None = None
) -> Callable:
    """Pure `fn(params, batch, frozen=None) -> (nll_sum, hits, num_loss_tokens)`, `[] float32` each, summed over
    the batch's micro-batches (no gradient); the caller sums batches and divides (val/loss = nll / tokens)."""

    def fn(params, batch, frozen=None):
        if on_trace is not None:
            on_trace()
        model = merge_model(graphdef, params, frozen, rest)

        def body(i, acc):
            return tuple(a + b for a, b in zip(acc, micro_stats(model, _micro(batch, i), chunk)))

        zero = jnp.zeros((), jnp.float32)
        return jax.lax.fori_loop(0, _n_used(batch), body, (zero, zero, zero))

    return fn
