"""DPO batch layout (host, numpy) and the jitted DPO `update` / `evaluate` / reference log-prob functions.

Layout (`layout_pairs`): the B pairs of one global batch go into `n_micro` micro-batches. Per micro-batch:

* tokens `[rows, row_len] int32`: `input_ids`, `segment_ids`, `positions`;
* slots `[S] int32` (S = rows * row_len): the scored completion tokens, first `sum(slot_mask)` of them used:
  `slot_index` (flat index `row * row_len + col` of the hidden state that predicts the token), `slot_label` (the
  token), `slot_seq` (its sequence: `q` = chosen of the micro-batch's pair q, `Q + q` = its rejected), `slot_mask`;
* pairs `[Q]`: `pair_mask` (1 = a pair), `pair_index` (its index in the input list, -1 = none), and
  `ref_logps [2Q] float32` (precomputed reference log-probs, chosen then rejected; zeros when computed per step).

Unpacked (`pack=False`, TRL's layout): Q = `pairs_per_micro` pairs per micro-batch, `rows = 2Q` rows of
`row_len` tokens: row q = prompt + chosen of pair q, row Q + q = prompt + rejected. Packed with shared prompts
(`pack=True`): rows of `row_len` tokens (the trainer uses 2 * max_length, so any pair fits one row) hold whole
pairs, first-fit decreasing, each as one chunk `prompt | chosen | rejected` with segment ids `chunk << 16 | sub`
(sub 0 prompt, 1 chosen, 2 rejected; `models.decoder.segment_mask`): both completions attend to the one prompt
copy and to themselves, positions continue from the prompt in each, so every completion token sees exactly the
context it has unpacked; the last prompt token's hidden state predicts the first token of both completions (two
slots, one hidden state). The prompt is computed once per pair instead of twice.

Loss (`make_dpo_grads`, TRL `DPOTrainer._compute_loss`): sequence log-probs `logps` = sum over the completion
tokens of log p(token | prefix); log-ratios `chosen_logratios = logps_c - ref_logps_c` (same for rejected),
`delta = chosen_logratios - rejected_logratios`; per pair, with beta and label smoothing eps:

* ``sigmoid`` (DPO, Rafailov et al. 2023): `-(1 - eps) logsigmoid(beta delta) - eps logsigmoid(-beta delta)`
  (eps > 0: conservative DPO, cDPO (Mitchell 2023; TRL < 1.0's sigmoid); eps = 0: TRL 1.16's sigmoid);
* ``robust`` (Robust DPO, Chowdhury et al. 2024; TRL 'robust'):
  `(-(1 - eps) logsigmoid(beta delta) + eps logsigmoid(-beta delta)) / (1 - 2 eps)`;
* ``ipo`` (Azar et al. 2023; TRL 'ipo'): `(chosen_logratios / C - rejected_logratios / R - 1 / (2 beta))^2`,
  C, R the completion lengths (TRL normalizes IPO per token).

The loss is the mean over the B pairs of the global batch: each micro-batch adds `sum(per_pair) / B`, so
micro-batching and packing do not change it (float roundoff). Metrics (TRL names, means over pairs):
`rewards/chosen` = beta * chosen_logratios, `rewards/rejected`, `rewards/accuracies` (chosen reward >
rejected reward), `rewards/margins`, `logps/chosen`, `logps/rejected`; plus `grad_norm`, `update_skipped`.

Reference log-probs: per step, inside the update (a frozen copy's params, or a LoRA model with its adapters off:
`ref_params=None`), or precomputed once per dataset (`make_ref_logps`, then `precomputed=True`).
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
from jaxrl_post.models.decoder import SEGMENT_SUB_BITS
from jaxrl_post.models.lora import set_lora_enabled

LOSS_TYPES = ("sigmoid", "ipo", "robust")
TOKEN_KEYS = ("input_ids", "segment_ids", "positions")
SLOT_KEYS = ("slot_index", "slot_label", "slot_seq", "slot_mask")
PAIR_KEYS = ("pair_mask", "pair_index")
LAYOUT_KEYS = TOKEN_KEYS + SLOT_KEYS + PAIR_KEYS + ("ref_logps",)
METRIC_KEYS = (
    "rewards/chosen",
    "rewards/rejected",
    "rewards/accuracies",
    "rewards/margins",
    "logps/chosen",
    "logps/rejected",
)


# ------------------------------------------------------------------------------------------ host layout
def layout_pairs(
    pairs: Sequence,
    *,
    n_micro: int,
    pairs_per_micro: int,
    row_len: int,
    pack: bool,
    ref_logps: np.ndarray | None = None,
    plan: Sequence[Sequence[int]] | None = None,
    pair_slots: int | None = None,
) -> dict[str, np.ndarray]:
    """The arrays of `LAYOUT_KEYS` (module docstring), each with a leading `[n_micro]` dim, for `pairs`
    (`data.preference.PreferencePair`, at most `n_micro * pairs_per_micro`). Unpacked: micro-batch k holds pairs
    k * Q ... (Q = pairs_per_micro), rows of `row_len` tokens; packed: `pairs_per_micro` rows of `row_len` tokens
    per micro-batch, Q = `n_micro * pairs_per_micro` pair slots. `ref_logps [len(pairs), 2] float32`: precomputed
    reference log-probs (chosen, rejected) of each pair.

    `plan` (packed only; `data.packing_strategy='bfd'`): the rows already packed, each a list of indices into
    `pairs` (rows fill micro-batches in order, `pairs_per_micro` rows each; any number of pairs); then Q =
    `pair_slots` (at least the pairs of any micro-batch).

    Raises ValueError when a sequence (unpacked) or a pair (packed) does not fit a row, or the pairs do not fit.
    """
    m = int(pairs_per_micro)
    if plan is None and len(pairs) > n_micro * m:
        raise ValueError(f"{len(pairs)} pairs for a layout of {n_micro} x {m}")
    if plan is not None and not pack:
        raise ValueError("a packing plan needs the packed layout (pack=True)")
    if pack:
        rows, q_cap = m, n_micro * m if pair_slots is None else int(pair_slots)
        need = [len(x.prompt_ids) + len(x.chosen_ids) + len(x.rejected_ids) for x in pairs]
    else:
        rows, q_cap = 2 * m, m
        need = [len(x.prompt_ids) + max(len(x.chosen_ids), len(x.rejected_ids)) for x in pairs]
    if need and max(need) > row_len:
        raise ValueError(f"a {'pair' if pack else 'sequence'} of {max(need)} tokens does not fit a row of {row_len}")
    if pack:
        if plan is None:
            plan = pack_rows(need, row_len).rows()
        elif sorted(i for row in plan for i in row) != list(range(len(pairs))):
            raise ValueError("the packing plan must place every pair exactly once")
        elif plan and max(sum(need[i] for i in row) for row in plan) > row_len:
            raise ValueError(f"a planned row holds more than row_len={row_len} tokens")
        if len(plan) > n_micro * rows:
            raise ValueError(f"{len(plan)} rows needed, the layout has {n_micro * rows}")
        micro_of_row = [r // rows for r in range(len(plan))]
        per_micro = np.bincount(np.repeat(micro_of_row, [len(row) for row in plan]), minlength=1)
        if per_micro.max(initial=0) > q_cap:
            raise ValueError(f"{per_micro.max()} pairs in one micro-batch, the layout has {q_cap} pair slots")
    else:
        plan = [[i] for i in range(len(pairs))]
        micro_of_row = [i // m for i in range(len(pairs))]
    s_cap = rows * row_len
    out = {k: np.zeros((n_micro, rows, row_len), np.int32) for k in TOKEN_KEYS}
    out.update({k: np.zeros((n_micro, s_cap), np.int32) for k in SLOT_KEYS})
    out["pair_mask"] = np.zeros((n_micro, q_cap), np.int32)
    out["pair_index"] = np.full((n_micro, q_cap), -1, np.int32)
    out["ref_logps"] = np.zeros((n_micro, 2 * q_cap), np.float32)
    n_slots = np.zeros(n_micro, np.int64)
    n_pairs = np.zeros(n_micro, np.int64)

    def put(k, r, at, ids, seg, pos0):
        t = len(ids)
        out["input_ids"][k, r, at : at + t] = ids
        out["segment_ids"][k, r, at : at + t] = seg
        out["positions"][k, r, at : at + t] = pos0 + np.arange(t)

    def slots(k, first_hidden, hidden_rest_start, ids, seq):
        """Completion `ids` predicted from `first_hidden` then from the hidden states of ids[:-1]."""
        t = len(ids)
        idx = np.concatenate([[first_hidden], hidden_rest_start + np.arange(t - 1)])
        lo = n_slots[k]
        out["slot_index"][k, lo : lo + t] = idx
        out["slot_label"][k, lo : lo + t] = ids
        out["slot_seq"][k, lo : lo + t] = seq
        out["slot_mask"][k, lo : lo + t] = 1
        n_slots[k] += t

    for r_global, members in enumerate(plan):
        k = micro_of_row[r_global]
        at = 0
        for chunk, i in enumerate(members, start=1):
            x = pairs[i]
            p, ch, rj = x.prompt_ids, x.chosen_ids, x.rejected_ids
            q = n_pairs[k]
            n_pairs[k] += 1
            out["pair_mask"][k, q] = 1
            out["pair_index"][k, q] = i
            if ref_logps is not None:
                out["ref_logps"][k, q], out["ref_logps"][k, q_cap + q] = ref_logps[i]
            if pack:
                r = r_global % rows
                base = r * row_len + at
                put(k, r, at, p, chunk << SEGMENT_SUB_BITS, 0)
                put(k, r, at + len(p), ch, chunk << SEGMENT_SUB_BITS | 1, len(p))
                put(k, r, at + len(p) + len(ch), rj, chunk << SEGMENT_SUB_BITS | 2, len(p))
                last_prompt = base + len(p) - 1
                slots(k, last_prompt, base + len(p), ch, q)
                slots(k, last_prompt, base + len(p) + len(ch), rj, q_cap + q)
                at += len(p) + len(ch) + len(rj)
            else:
                for r, comp, seq in ((q, ch, q), (m + q, rj, q_cap + q)):
                    put(k, r, 0, np.concatenate([p, comp]), 1, 0)
                    base = r * row_len
                    slots(k, base + len(p) - 1, base + len(p), comp, seq)
    return out


# ------------------------------------------------------------------------------------------ jitted
_micro = micro_at


def _n_used(batch) -> jax.Array:
    """Micro-batches holding pairs (a prefix: the layout fills them in order), int32 scalar."""
    return n_used(batch["pair_mask"])


def sequence_logps(model, mb: dict[str, jax.Array], chunk: int = 512) -> tuple[jax.Array, jax.Array]:
    """(sum of log p over each sequence's completion tokens, completion tokens per sequence), `[2Q] float32`
    each, of one micro-batch of `layout_pairs` (sequence q = chosen of pair q, Q + q = its rejected). Only
    the completion slots go through the LM head (chunked, no `[slots, V]` logits)."""
    seg = mb["segment_ids"]
    h = model.hidden_states(mb["input_ids"], seg != 0, mb["positions"], segment_ids=seg)
    hq = h.reshape(-1, h.shape[-1])[mb["slot_index"]]
    n = jnp.sum(mb["slot_mask"])
    lp, _ = model.token_stats_from_hidden(hq, mb["slot_label"], n, 1.0, "none", chunk=chunk)
    w = mb["slot_mask"].astype(jnp.float32)
    n_seq = 2 * mb["pair_mask"].shape[0]
    logps = jax.ops.segment_sum(lp * w, mb["slot_seq"], num_segments=n_seq)
    counts = jax.ops.segment_sum(w, mb["slot_seq"], num_segments=n_seq)
    return logps, counts


def dpo_pair_losses(
    logps, ref_logps, counts, *, beta: float, loss_type: str, label_smoothing: float
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Per-pair loss `[Q] float32` and per-pair metric values (`METRIC_KEYS`, `[Q]` each) from `logps`,
    `ref_logps`, `counts` `[2Q]` (chosen then rejected). Formulas: the module docstring. Raises ValueError for
    an unknown `loss_type`."""
    q = logps.shape[0] // 2
    chosen, rejected = logps[:q], logps[q:]
    chosen_lr, rejected_lr = chosen - ref_logps[:q], rejected - ref_logps[q:]
    delta = chosen_lr - rejected_lr
    eps = float(label_smoothing)
    if loss_type == "sigmoid":
        loss = -(1.0 - eps) * jax.nn.log_sigmoid(beta * delta) - eps * jax.nn.log_sigmoid(-beta * delta)
    elif loss_type == "robust":
        clean = -(1.0 - eps) * jax.nn.log_sigmoid(beta * delta)
        flipped = -eps * jax.nn.log_sigmoid(-beta * delta)
        loss = (clean - flipped) / (1.0 - 2.0 * eps)
    elif loss_type == "ipo":
        avg = chosen_lr / jnp.maximum(counts[:q], 1.0) - rejected_lr / jnp.maximum(counts[q:], 1.0)
        loss = (avg - 1.0 / (2.0 * beta)) ** 2
    else:
        raise ValueError(f"dpo loss_type must be one of {LOSS_TYPES}, got {loss_type!r}")
    rc, rr = jax.lax.stop_gradient(beta * chosen_lr), jax.lax.stop_gradient(beta * rejected_lr)
    metrics = {
        "rewards/chosen": rc,
        "rewards/rejected": rr,
        "rewards/accuracies": (rc > rr).astype(jnp.float32),
        "rewards/margins": rc - rr,
        "logps/chosen": jax.lax.stop_gradient(chosen),
        "logps/rejected": jax.lax.stop_gradient(rejected),
    }
    return loss, metrics


def _models(graphdef, rest, params, frozen, ref_params):
    """(policy, reference) modules: the reference is a frozen copy (`ref_params`), or with `ref_params=None`
    the same LoRA weights with the adapters off."""
    policy = merge_model(graphdef, params, frozen, rest)
    if ref_params is None:
        ref = set_lora_enabled(merge_model(graphdef, jax.lax.stop_gradient(params), frozen, rest), False)
    else:
        ref = merge_model(graphdef, ref_params, None, rest)
    return policy, ref


def make_dpo_grads(
    graphdef: nnx.GraphDef,
    rest: nnx.State,
    *,
    beta: float,
    loss_type: str,
    label_smoothing: float = 0.0,
    precomputed: bool = False,
    chunk: int = 512,
) -> Callable:
    """Pure `fn(params, batch, ref_params=None, frozen=None) -> (loss, metrics, grads)`: the DPO loss `[] float32`
    of a `layout_pairs` batch (mean over its pairs), the `METRIC_KEYS` means `[] float32` and d loss / d params,
    accumulated over the used micro-batches. Reference log-probs: `batch['ref_logps']` when `precomputed`, else
    a forward of the reference (`ref_params`, or a LoRA model's adapters off when None) per micro-batch.
    `frozen`: a LoRA model's base params (`steps.split_lora_model`)."""
    if loss_type not in LOSS_TYPES:
        raise ValueError(f"dpo loss_type must be one of {LOSS_TYPES}, got {loss_type!r}")

    def loss_fn(params, mb, n_pairs, ref_params, frozen):
        policy, ref = _models(graphdef, rest, params, frozen, ref_params)
        logps, counts = sequence_logps(policy, mb, chunk)
        if precomputed:
            ref_logps = mb["ref_logps"]
        else:
            ref_logps = jax.lax.stop_gradient(sequence_logps(ref, mb, chunk)[0])
        per_pair, m = dpo_pair_losses(
            logps, ref_logps, counts, beta=beta, loss_type=loss_type, label_smoothing=label_smoothing
        )
        w = mb["pair_mask"].astype(jnp.float32)
        sums = {k: jnp.sum(v * w) / n_pairs for k, v in m.items()}
        return jnp.sum(per_pair * w) / n_pairs, sums

    grad_fn = jax.value_and_grad(loss_fn, has_aux=True)

    def fn(params, batch, ref_params=None, frozen=None):
        n_pairs = jnp.maximum(jnp.sum(batch["pair_mask"]).astype(jnp.float32), 1.0)

        def grads_at(i):
            (loss, sums), grads = grad_fn(params, _micro(batch, i), n_pairs, ref_params, frozen)
            return grads, loss, sums

        grads, loss, sums = sum_over_used(grads_at, _n_used(batch))
        return loss, sums, grads

    return fn


def make_dpo_update(
    graphdef: nnx.GraphDef,
    rest: nnx.State,
    tx: optax.GradientTransformation,
    *,
    on_trace: Callable[[], None] | None = None,
    **loss_kw,
) -> Callable:
    """Pure `fn(params, opt_state, batch, ref_params=None, frozen=None) -> (params, opt_state, metrics)`: one DPO
    optimizer step (loss and gradients: `make_dpo_grads(**loss_kw)`); wrap with `jax.jit`. A non-finite loss or
    gradient leaves params and optimizer state unchanged (`update_skipped` = 1). Metrics (`[] float32`): loss,
    `METRIC_KEYS`, grad_norm (before clipping), update_skipped."""
    grads_fn = make_dpo_grads(graphdef, rest, **loss_kw)

    def fn(params, opt_state, batch, ref_params=None, frozen=None):
        if on_trace is not None:
            on_trace()
        loss, sums, grads = grads_fn(params, batch, ref_params, frozen)
        return apply_update(tx, params, opt_state, grads, loss, {"loss": loss, **sums})

    return fn


def make_dpo_eval(
    graphdef: nnx.GraphDef, rest: nnx.State, *, on_trace: Callable[[], None] | None = None, **loss_kw
) -> Callable:
    """Pure `fn(params, batch, ref_params=None, frozen=None) -> (loss, metrics)` of `make_dpo_grads(**loss_kw)`
    without the gradient (means over the batch's pairs, `[] float32`)."""
    loss_kw = dict(loss_kw)
    precomputed, chunk = loss_kw.pop("precomputed", False), loss_kw.pop("chunk", 512)

    def fn(params, batch, ref_params=None, frozen=None):
        if on_trace is not None:
            on_trace()
        policy, ref = _models(graphdef, rest, params, frozen, ref_params)
        n_pairs = jnp.maximum(jnp.sum(batch["pair_mask"]).astype(jnp.float32), 1.0)

        def body(i, carry):
            loss, sums = carry
            mb = _micro(batch, i)
            logps, counts = sequence_logps(policy, mb, chunk)
            ref_logps = mb["ref_logps"] if precomputed else sequence_logps(ref, mb, chunk)[0]
            per_pair, m = dpo_pair_losses(logps, ref_logps, counts, **loss_kw)
            w = mb["pair_mask"].astype(jnp.float32)
            return loss + jnp.sum(per_pair * w) / n_pairs, {k: sums[k] + jnp.sum(m[k] * w) / n_pairs for k in sums}

        zero = jnp.zeros((), jnp.float32)
        return jax.lax.fori_loop(0, _n_used(batch), body, (zero, dict.fromkeys(METRIC_KEYS, zero)))

    return fn


def make_ref_logps(
    graphdef: nnx.GraphDef, rest: nnx.State, *, chunk: int = 512, on_trace: Callable[[], None] | None = None
) -> Callable:
    """Pure `fn(params, batch, ref_params=None, frozen=None) -> [n_micro, 2Q] float32`: the reference's sequence
    log-probs of every pair slot of a `layout_pairs` batch (0 for empty slots); `ref_params=None`: the LoRA
    model `params` + `frozen` with its adapters off. For precomputing once per dataset."""

    def fn(params, batch, ref_params=None, frozen=None):
        if on_trace is not None:
            on_trace()
        _, ref = _models(graphdef, rest, params, frozen, ref_params)
        return jax.lax.map(lambda mb: sequence_logps(ref, mb, chunk)[0], batch)

    return fn
