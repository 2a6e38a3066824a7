"""Rollout correction as verl does it (``algorithm.rollout_correction.*``): truncated importance sampling (TIS)
and rejection sampling (RS) between the rollout (sampler) policy and the training policy.

With ``l = old_log_prob - rollout_log_prob = log(pi_train / pi_rollout)`` per token (``[B, R]``):
* IS weights, ``rollout_is``: ``token``: ``exp(clip(l_t, +-20))``; ``sequence``: ``exp(clip(sum_t l_t, +-20))``
  on every token of the row; then ``min(w, rollout_is_threshold)`` (no lower truncation), 0 outside the mask,
  stop-gradient, optionally divided by their batch mean. They multiply the per-token policy loss.
* Rejection, ``rollout_rs`` (comma-separated options, all must pass): ``k1 = -l``, ``k2 = l^2 / 2``,
  ``k3 = exp(l) - 1 - l`` (``l`` clipped to +-20) per token (``token_k*``) or summed / averaged / maxed per row
  (``seq_{sum,mean,max}_k*``); ``k1`` keeps ``log(lower) <= stat <= log(upper)`` (i.e. 1/ratio in [lower, upper],
  verl's code; its docs say ratio, the same for the usual lower = 1/upper), ``k2``/``k3`` keep ``stat <= upper``.
  Rejected tokens leave the response mask.

Pure ``jnp``, float32, jit-compatible (``rollout_is``, ``rollout_rs``, ``rollout_rs_threshold`` and
``rollout_is_batch_normalize`` static; ``rollout_is_threshold`` may be traced). Masks are 0/1 of any dtype; masked
values never leak. Metrics are float32 scalars named as verl's. One deliberate difference: rows without any valid
token (batch padding; verl has none) are left out of every per-row statistic instead of counting as 0-length rows.

Source: verl ``trainer/ppo/rollout_corr_helper.py`` and ``utils/debug/metrics.py`` at volcengine/verl@b178a3c
(2026-01-29); Liu et al. 2025, "When Speed Kills Stability: Demystifying RL Collapse from the Training-Inference
Mismatch" (https://richardli.xyz/rl-collapse); Yao et al. 2025 (https://fengyao.notion.site/off-policy-rl).
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp

from jaxrl_post.algos.functional import _F32, _f32, _nonzero, masked_mean, masked_sum

SAFETY_BOUND = 20.0  # log-space clamp before exp: weights stay within [exp(-20), exp(20)]
ROLLOUT_IS_LEVELS = ("token", "sequence")
_RS_AGGS = ("token", "seq_sum", "seq_mean")
ROLLOUT_RS_OPTIONS = (*(f"{a}_k{i}" for a in _RS_AGGS for i in (1, 2, 3)), "seq_max_k2", "seq_max_k3")
Metrics = dict[str, jax.Array]


def parse_rollout_rs(rollout_rs: str, rollout_rs_threshold: str | float | None) -> list[tuple[str, Any, float]]:
    """Host-side parse of ``rollout_rs`` (comma-separated :data:`ROLLOUT_RS_OPTIONS`, duplicates dropped) and
    ``rollout_rs_threshold`` (a number or comma-separated string: one entry per option, or one shared): ``k1``
    takes ``"lower_upper"`` (one number u: lower = 1/u), ``k2``/``k3`` one upper bound (lower None). Raises
    ValueError for unknown/empty options, a missing, malformed, non-finite or <= 0 bound, a wrong entry count, or
    ``lower > upper`` (ours: verl would reject everything). Source: verl ``_parse_rollout_rs_thresholds``.
    """
    options = list(dict.fromkeys(o.strip() for o in str(rollout_rs).split(",") if o.strip()))
    bad = [o for o in options if o not in ROLLOUT_RS_OPTIONS]
    if bad or not options or not isinstance(rollout_rs, str):
        raise ValueError(f"unknown rollout_rs option(s) {bad}; valid: {list(ROLLOUT_RS_OPTIONS)}")
    if isinstance(rollout_rs_threshold, bool) or not isinstance(rollout_rs_threshold, (int, float, str)):
        raise ValueError(
            f"rollout_rs_threshold is required with rollout_rs: a number or a string, not {rollout_rs_threshold!r}"
        )
    specs = [t.strip() for t in str(rollout_rs_threshold).split(",") if t.strip()]
    if len(specs) not in (1, len(options)):
        raise ValueError(f"rollout_rs_threshold needs 1 or {len(options)} entries (one per option), got {len(specs)}")
    out = []
    for opt, spec in zip(options, specs * len(options) if len(specs) == 1 else specs):
        k1, where = opt.endswith("k1"), f"rollout_rs_threshold {spec!r} for {opt}"
        if "_" in spec and not k1:
            raise ValueError(f"{where}: k2/k3 options take one upper bound, no '_'")
        try:
            bounds = [float(b) for b in spec.split("_", 1)]
        except ValueError:
            raise ValueError(f"{where} is not a number (or 'lower_upper')") from None
        if not all(math.isfinite(b) and b > 0 for b in bounds):
            raise ValueError(f"{where}: bounds must be finite and > 0")
        upper = bounds[-1]
        lower = (bounds[0] if len(bounds) == 2 else 1.0 / upper) if k1 else None
        if k1 and lower > upper:
            raise ValueError(f"{where}: lower {lower} > upper {upper}")
        out.append((opt, lower, upper))
    return out


def _check(response_mask: Any, *arrays: Any) -> None:
    """Host-side checks (verl's): matching shapes, and at least one valid token (skipped for tracers)."""
    shape = jnp.shape(response_mask)
    for a in arrays:
        if a is not None and jnp.shape(a) != shape:
            raise ValueError(f"log-prob shape {jnp.shape(a)} does not match response_mask shape {shape}")
    if not isinstance(response_mask, jax.core.Tracer) and not bool(jnp.any(jnp.asarray(response_mask) != 0)):
        raise ValueError("response_mask must contain at least one valid token")


def _max(x: jax.Array, where: jax.Array, axis: int | None = None) -> jax.Array:
    """Max of ``x`` over ``where``; 0 where nothing is selected."""
    return jnp.where(jnp.any(where, axis), jnp.max(jnp.where(where, x, -jnp.inf), axis), 0.0)


def _min(x: jax.Array, where: jax.Array, axis: int | None = None) -> jax.Array:
    return -_max(-x, where, axis)


def _mean(x: jax.Array, where: jax.Array) -> jax.Array:
    """Mean of ``x`` (bools count as 0/1) over the ``where`` entries: tokens ``[B, R]`` or valid rows ``[B]``."""
    return jnp.sum(jnp.where(where, _f32(x), 0.0)) / _nonzero(jnp.sum(where.astype(_F32)))


def _seq_summary(p: str, v: jax.Array, rows: jax.Array, ideal: float, hi: Any, lo: Any) -> Metrics:
    """``{p}_seq_{mean,std,max,min,max_deviation,fraction_high,fraction_low}`` of ``v [B]`` over valid rows."""
    n, mean = jnp.sum(rows.astype(_F32)), _mean(v, rows)
    var = jnp.sum(jnp.where(rows, jnp.square(v - mean), 0.0)) / jnp.maximum(n - 1.0, 1.0)
    out = {f"{p}_seq_mean": mean, f"{p}_seq_std": jnp.where(n > 1, jnp.sqrt(var), 0.0)}
    out |= {f"{p}_seq_max": _max(v, rows), f"{p}_seq_min": _min(v, rows)}
    out |= {f"{p}_seq_max_deviation": _max(jnp.abs(v - ideal), rows), f"{p}_seq_fraction_high": _mean(v > hi, rows)}
    return out | ({} if lo is None else {f"{p}_seq_fraction_low": _mean(v < lo, rows)})


def _clamped_std(x: jax.Array, m: jax.Array, lo: Any, hi: Any) -> jax.Array:
    """verl's ``*_std``: ``sqrt(max(E[c^2] - E[c]^2, 0))``, ``c = clip(x, lo, hi)``, over the mask (0 if <= 1 token)."""
    c = jnp.clip(x, lo, hi)
    var = masked_mean(jnp.square(c), m) - jnp.square(masked_mean(c, m))
    return jnp.where(jnp.sum(m) > 1, jnp.sqrt(jnp.maximum(var, 0.0)), 0.0)


def compute_rollout_correction_weights(
    log_ratio: jax.Array,
    response_mask: jax.Array,
    rollout_is: str = "token",
    rollout_is_threshold: float | jax.Array = 2.0,
    rollout_is_batch_normalize: bool = False,
) -> tuple[jax.Array, Metrics]:
    """Truncated IS weights ``[B, R] float32`` (stop-gradient, 0 outside the mask) and their metrics.

    ``log_ratio = old_log_prob - rollout_log_prob`` ``[B, R]``; ``rollout_is`` token | sequence (static);
    ``rollout_is_threshold`` C truncates from above (1/C is the metrics' lower reference);
    ``rollout_is_batch_normalize`` (static) divides the truncated weights by their mean over valid tokens (token)
    or rows (sequence) when that mean > 1e-8. Metrics (unprefixed; on the safety-bounded weights before
    truncation): ``rollout_is_{mean,max,min,std,eff_sample_size,ratio_fraction_high,ratio_fraction_low}``,
    ``rollout_is_seq_{mean,std,max,min,max_deviation,fraction_high,fraction_low}`` and, when normalizing,
    ``rollout_is_batch_norm_factor``. Raises ValueError for an unknown level or C <= 0.
    Source: verl ``compute_rollout_correction_weights`` + ``compute_is_metrics``.
    """
    if rollout_is not in ROLLOUT_IS_LEVELS:
        raise ValueError(f"Invalid rollout_is {rollout_is!r}; valid: {list(ROLLOUT_IS_LEVELS)}")
    if isinstance(rollout_is_threshold, (int, float)) and not rollout_is_threshold > 0:
        raise ValueError(f"rollout_is_threshold must be > 0, got {rollout_is_threshold}")
    valid = jnp.asarray(response_mask) != 0
    m, rows = valid.astype(_F32), jnp.any(valid, -1)
    lr = jnp.where(valid, _f32(log_ratio), 0.0)
    hi, lo = _f32(rollout_is_threshold), _f32(1.0 / rollout_is_threshold)
    if rollout_is == "token":
        w = jnp.where(valid, jnp.exp(jnp.clip(lr, -SAFETY_BOUND, SAFETY_BOUND)), 0.0)
        metrics = {"rollout_is_max": _max(w, valid), "rollout_is_min": _min(w, valid)}
        metrics |= {"rollout_is_ratio_fraction_high": _mean(w > hi, valid)}
        metrics |= {"rollout_is_ratio_fraction_low": _mean(w < lo, valid)}
    else:  # max/min/fractions from the unclamped log sums
        s = masked_sum(lr, m, axis=-1)
        w = jnp.where(valid, jnp.exp(jnp.clip(s, -SAFETY_BOUND, SAFETY_BOUND))[:, None], 0.0)
        metrics = {"rollout_is_max": jnp.exp(jnp.minimum(_max(s, rows), SAFETY_BOUND))}
        metrics |= {"rollout_is_min": jnp.exp(_min(s, rows))}
        metrics |= {"rollout_is_ratio_fraction_high": _mean(s > jnp.log(hi), rows)}
        metrics |= {"rollout_is_ratio_fraction_low": _mean(s < jnp.log(lo), rows)}
    wc = jnp.clip(w, lo, hi)
    metrics["rollout_is_mean"] = masked_mean(w, m)
    metrics["rollout_is_std"] = _clamped_std(w, m, lo, hi)
    metrics["rollout_is_eff_sample_size"] = 1.0 / masked_mean(jnp.square(wc / (masked_mean(wc, m) + 1e-8)), m)
    metrics |= _seq_summary("rollout_is", masked_mean(w, m, axis=-1), rows, 1.0, hi, lo)

    w = jax.lax.stop_gradient(jnp.minimum(w, hi))  # TIS; padding stays 0
    if rollout_is_batch_normalize:
        mean = masked_mean(w, m) if rollout_is == "token" else _mean(masked_mean(w, m, axis=-1), rows)
        factor = jnp.where(mean > 1e-8, mean, 1.0)
        w, metrics["rollout_is_batch_norm_factor"] = w / factor, factor
    return w, metrics


def compute_rollout_rejection_mask(
    log_ratio: jax.Array,
    response_mask: jax.Array,
    rollout_rs: str = "token_k1",
    rollout_rs_threshold: str | float | None = None,
) -> tuple[jax.Array, Metrics]:
    """Response mask with rejected tokens/rows set to 0 (input dtype), and the RS metrics.

    ``log_ratio``, ``response_mask`` ``[B, R]``; ``rollout_rs``, ``rollout_rs_threshold`` static (see
    :func:`parse_rollout_rs`). Metrics per option o, ``rollout_rs_{o}_``: ``mean`` (over tokens), ``max``, ``min``,
    ``fraction_high``, ``fraction_low`` (over tokens or rows; k1 vs the log bounds, k2/k3 vs upper and 0),
    ``std`` (clipped to the bounds), ``seq_{mean,std,max,min,max_deviation,fraction_high}`` (+
    ``seq_fraction_low`` for k1), ``masked_fraction`` (tokens), ``seq_masked_fraction`` (rows losing a token);
    all options together: ``rollout_rs_masked_fraction``, ``rollout_rs_seq_masked_fraction``.
    Source: verl ``compute_rollout_rejection_mask`` + ``compute_rs_metrics``.
    """
    specs = parse_rollout_rs(rollout_rs, rollout_rs_threshold)
    valid = jnp.asarray(response_mask) != 0
    m, rows = valid.astype(_F32), jnp.any(valid, -1)
    lr = jnp.clip(jnp.where(valid, _f32(log_ratio), 0.0), -SAFETY_BOUND, SAFETY_BOUND)
    stats = {"k1": -lr, "k2": 0.5 * jnp.square(lr), "k3": jnp.exp(lr) - 1.0 - lr}
    seq_aggs = {"sum": masked_sum, "mean": masked_mean, "max": lambda k, m, axis: _max(k, m != 0, axis)}
    keep_all = jnp.ones(valid.shape, bool)
    metrics: Metrics = {}
    for opt, lower, upper in specs:
        k1, token_level, p = opt.endswith("k1"), opt.startswith("token"), f"rollout_rs_{opt}"
        k = stats[opt[-2:]]
        hi, lo = (math.log(upper), math.log(lower)) if k1 else (upper, 0.0)
        if token_level:
            stat, seq = k, masked_mean(k, m, -1)
        else:
            seq = seq_aggs[opt.split("_")[1]](k, m, -1)
            stat = jnp.broadcast_to(seq[:, None], k.shape)
        keep = (stat >= lo) & (stat <= hi) if k1 else stat <= hi
        keep_all = keep_all & keep
        src, sel = (stat, valid) if token_level else (seq, rows)  # max/min/fractions: per token or per row
        metrics |= {f"{p}_mean": masked_mean(stat, m), f"{p}_max": _max(src, sel), f"{p}_min": _min(src, sel)}
        metrics[f"{p}_fraction_high"] = _mean(src > hi, sel)
        metrics[f"{p}_fraction_low"] = _mean(src < lo, sel) if k1 else _f32(0.0)
        metrics[f"{p}_std"] = _clamped_std(stat, m, lo, hi)
        metrics |= _seq_summary(p, seq, rows, 0.0, hi, lo if k1 else None)
        metrics[f"{p}_masked_fraction"] = _mean(~keep, valid)
        metrics[f"{p}_seq_masked_fraction"] = _mean(jnp.any(~keep & valid, -1), rows)
    metrics["rollout_rs_masked_fraction"] = _mean(~keep_all, valid)
    metrics["rollout_rs_seq_masked_fraction"] = _mean(jnp.any(~keep_all & valid, -1), rows)
    mask = jnp.asarray(response_mask)
    return jnp.where(keep_all, mask, jnp.zeros_like(mask)), metrics


def compute_offpolicy_metrics(
    old_log_prob: jax.Array, rollout_log_prob: jax.Array | None, response_mask: jax.Array
) -> Metrics:
    """Off-policy diagnostics (unprefixed). ``l = old - rollout`` per token, ``lp_*`` per-row mean log-probs,
    ``d = lp_rollout - lp_train``: ``training_ppl = mean_rows exp(-lp_train)``, ``training_log_ppl``,
    ``rollout_ppl``, ``rollout_log_ppl``, ``kl = mean_tok(-l)`` (KL(rollout || train)), ``k3_kl = mean_tok(e^l - l
    - 1)``, ``log_ppl_diff = mean_rows d``, ``log_ppl_abs_diff``, ``log_ppl_diff_max``/``_min``, ``ppl_ratio =
    mean_rows e^d``, ``chi2_token = mean_tok e^(2 clip(l)) - 1``, ``chi2_seq = mean_rows e^(2 clip(sum_t l)) - 1``
    (only the first two without rollout log-probs). Source: verl ``compute_offpolicy_metrics``.
    """
    valid = jnp.asarray(response_mask) != 0
    m, rows = valid.astype(_F32), jnp.any(valid, -1)
    lp_train = masked_mean(old_log_prob, m, -1)
    out = {"training_ppl": _mean(jnp.exp(-lp_train), rows), "training_log_ppl": _mean(-lp_train, rows)}
    if rollout_log_prob is None:
        return out
    lp_roll = masked_mean(rollout_log_prob, m, -1)
    lr = jnp.where(valid, _f32(old_log_prob) - _f32(rollout_log_prob), 0.0)
    d = lp_roll - lp_train
    lr_safe = jnp.clip(lr, -SAFETY_BOUND, SAFETY_BOUND)
    chi2_seq = jnp.exp(2.0 * jnp.clip(masked_sum(lr, m, -1), -SAFETY_BOUND, SAFETY_BOUND))
    out |= {"kl": masked_mean(-lr, m), "k3_kl": masked_mean(jnp.exp(lr) - lr - 1.0, m)}
    out |= {"rollout_ppl": _mean(jnp.exp(-lp_roll), rows), "rollout_log_ppl": _mean(-lp_roll, rows)}
    out |= {"log_ppl_diff": _mean(d, rows), "log_ppl_abs_diff": _mean(jnp.abs(d), rows)}
    out |= {"log_ppl_diff_max": _max(d, rows), "log_ppl_diff_min": _min(d, rows), "ppl_ratio": _mean(jnp.exp(d), rows)}
    out["chi2_token"] = masked_mean(jnp.square(jnp.exp(lr_safe)), m) - 1.0
    out["chi2_seq"] = _mean(chi2_seq, rows) - 1.0
    return out


def compute_rollout_probs_diff_metrics(
    old_log_prob: jax.Array, rollout_log_prob: jax.Array, response_mask: jax.Array
) -> Metrics:
    """verl's ``training/*`` metrics on probabilities over valid tokens: ``rollout_probs_diff_{max,mean,std}`` of
    ``|exp(old) - exp(rollout)|`` (std unbiased), ``rollout_actor_probs_pearson_corr`` (clipped to [-1, 1]; NaN for
    one token or constant probabilities, as torch), ``rollout_probs_diff_valid`` = 1.
    Source: verl ``utils/debug/metrics.calculate_debug_metrics``.
    """
    valid = jnp.asarray(response_mask) != 0
    m, n = valid.astype(_F32), jnp.sum(valid.astype(_F32))
    pt = jnp.where(valid, jnp.exp(_f32(old_log_prob)), 0.0)
    pr = jnp.where(valid, jnp.exp(_f32(rollout_log_prob)), 0.0)
    diff = jnp.abs(pt - pr)
    cen = lambda x: jnp.where(valid, x - masked_mean(x, m), 0.0)
    dev = lambda a, b: jnp.sum(cen(a) * cen(b)) / (n - 1.0)
    corr = dev(pt, pr) / (jnp.sqrt(dev(pt, pt)) * jnp.sqrt(dev(pr, pr)))
    out = {"valid": _f32(1.0), "max": _max(diff, valid), "mean": masked_mean(diff, m), "std": jnp.sqrt(dev(diff, diff))}
    out = {f"training/rollout_probs_diff_{k}": v for k, v in out.items()}
    return out | {"training/rollout_actor_probs_pearson_corr": jnp.clip(corr, -1.0, 1.0)}


def compute_rollout_corr_metrics_from_logprobs(
    log_prob: jax.Array, rollout_log_prob: jax.Array, response_mask: jax.Array
) -> Metrics:
    """``rollout_corr/*`` off-policy metrics of the current policy vs the rollout (verl: per actor micro-batch)."""
    metrics = compute_offpolicy_metrics(log_prob, rollout_log_prob, response_mask)
    return {f"rollout_corr/{k}": v for k, v in metrics.items()}


def compute_rollout_correction_and_rejection_mask(
    old_log_prob: jax.Array,
    rollout_log_prob: jax.Array,
    response_mask: jax.Array,
    rollout_is: str | None = None,
    rollout_is_threshold: float | jax.Array | None = 2.0,
    rollout_is_batch_normalize: bool = False,
    rollout_rs: str | None = None,
    rollout_rs_threshold: str | float | None = None,
) -> tuple[jax.Array | None, jax.Array, Metrics]:
    """The entry point, for one whole training batch: IS weights, rejection mask and every metric.

    Args: ``old_log_prob`` ``[B, R] float32`` (training policy, pi_old), ``rollout_log_prob`` ``[B, R] float32``
    (recorded by the sampler), ``response_mask`` ``[B, R]`` 0/1; ``rollout_is`` None | token | sequence
    (weights are None when it or ``rollout_is_threshold`` is None); ``rollout_rs`` None or options (see
    :func:`parse_rollout_rs`); the rest as :func:`compute_rollout_correction_weights`.
    Returns ``(rollout_is_weights [B, R] float32 | None, response_mask [B, R] after rejection (input dtype),
    metrics)``: ``rollout_corr/<name>`` (IS, RS, and off-policy metrics on the input mask) plus
    ``training/rollout_probs_diff_*``, float32 scalars. Raises ValueError for mismatched shapes, a mask without
    valid tokens (checked outside jit only), or bad settings (see the functions above).
    Source: verl ``compute_rollout_correction_and_rejection_mask`` (+ ``calculate_debug_metrics``).
    """
    _check(response_mask, old_log_prob, rollout_log_prob)
    log_ratio = _f32(old_log_prob) - _f32(rollout_log_prob)
    weights, metrics = None, {}
    if rollout_is is not None and rollout_is_threshold is not None:
        weights, is_metrics = compute_rollout_correction_weights(
            log_ratio, response_mask, rollout_is, rollout_is_threshold, rollout_is_batch_normalize
        )
        metrics |= is_metrics
    new_mask = jnp.asarray(response_mask)
    if rollout_rs is not None:
        new_mask, rs_metrics = compute_rollout_rejection_mask(
            log_ratio, response_mask, rollout_rs, rollout_rs_threshold
        )
        metrics |= rs_metrics
    metrics |= compute_offpolicy_metrics(old_log_prob, rollout_log_prob, response_mask)
    out = {f"rollout_corr/{k}": _f32(v) for k, v in metrics.items()}
    out |= compute_rollout_probs_diff_metrics(old_log_prob, rollout_log_prob, response_mask)
    return weights, new_mask, out
