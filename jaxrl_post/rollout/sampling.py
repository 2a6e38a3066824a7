"""Sampling parameters, logits processors and the per-step token sampler.

Processor order follows Hugging Face ``generate`` / vLLM: temperature -> top-k -> top-p -> min-p.
Every processor maps logits ``[..., V] float32`` to logits of the same shape where removed entries are
``-inf``; they compose and can be applied to any leading shape.

Log-probabilities: ``sample_tokens`` returns the log-prob of the sampled token under the *tempered,
unfiltered* distribution ``log_softmax(logits / temperature)``. That is exactly what the training path
computes (``core_algos.logprobs_from_logits(logits, labels, temperature)``, verl's convention), so rollout
and training log-probs agree. top-k/top-p/min-p only restrict *which* tokens may be drawn; they do not
enter the recorded log-prob (verl/vLLM record the same quantity). Greedy decoding records
``log_softmax(logits)`` (temperature 1).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

NEG_INF = -jnp.inf


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How to generate responses (vLLM/verl names).

    Attributes:
      max_new_tokens: R, number of response tokens to generate (response length of the output).
      temperature: softmax temperature; 0 means greedy.
      top_k: keep the k most likely tokens; ``-1`` (or 0, or >= V) disables.
      top_p: nucleus sampling; keep the smallest set of tokens whose cumulative probability reaches
        ``top_p`` (the token that crosses it is kept). 1.0 disables.
      min_p: keep tokens with ``prob >= min_p * max_prob``. 0.0 disables.
      do_sample: False forces greedy decoding (as does ``temperature == 0``).
      eos_token_ids: token ids that end a response (several allowed; empty = never stop early).
      pad_token_id: written into response positions after the first EOS.
      seed: base seed of the ``jax.random`` key; same seed + same prompts -> same samples.
      top_p_candidates: exactness-preserving speed knob for top-p without top-k: the sampler first looks
        at the ``top_p_candidates`` most likely tokens (``lax.top_k``) and only falls back to a bisection
        over the whole vocabulary (``lax.cond``, same kept set) for a step in which those candidates hold
        less than ``top_p`` of the probability mass in some row.
      truncated_log_probs: return the log-prob of each token under the distribution it was drawn from
        (tempered, truncated by top-k/top-p/min-p, renormalized) instead of the tempered full softmax;
        training scores the same way with the sampling thresholds (``rollout.sampling_mask_replay``).
    """

    max_new_tokens: int
    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    min_p: float = 0.0
    do_sample: bool = True
    eos_token_ids: tuple[int, ...] = ()
    pad_token_id: int = 0
    seed: int = 0
    top_p_candidates: int = 256
    truncated_log_probs: bool = False

    def __post_init__(self):
        if isinstance(self.eos_token_ids, int):
            object.__setattr__(self, "eos_token_ids", (int(self.eos_token_ids),))
        else:
            object.__setattr__(self, "eos_token_ids", tuple(int(t) for t in self.eos_token_ids))
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.top_p_candidates < 1:
            raise ValueError(f"top_p_candidates must be >= 1, got {self.top_p_candidates}")

    @property
    def greedy(self) -> bool:
        """True when decoding is argmax (``do_sample=False`` or ``temperature == 0``)."""
        return (not self.do_sample) or self.temperature == 0.0


# ----------------------------------------------------------------------------------------------------
# Logits processors: logits [..., V] -> logits [..., V], removed entries = -inf.
# ----------------------------------------------------------------------------------------------------


def apply_temperature(logits: jax.Array, temperature: float) -> jax.Array:
    """``logits / temperature`` in float32. ``[..., V] -> [..., V] float32``.

    Raises ValueError for ``temperature <= 0`` (greedy is handled by the sampler, not by scaling).
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0 to scale logits, got {temperature}")
    return logits.astype(jnp.float32) / jnp.float32(temperature)


def _top_k_values(x: jax.Array, k: int) -> jax.Array:
    """``lax.top_k(x, k)`` values ``[B, k]``, descending.

    The optimization barrier keeps XLA:CPU on its fast TopK kernel: without it, top_k followed by a
    slice of its last column was rewritten into a full sort of the vocabulary (~100x slower).
    """
    return jax.lax.optimization_barrier(jax.lax.top_k(x, k)[0])


def apply_top_k(logits: jax.Array, k: int) -> jax.Array:
    """Keep the ``k`` largest logits per row, set the rest to ``-inf``. ``[..., V] -> [..., V]``.

    ``k <= 0`` or ``k >= V`` returns the logits unchanged. Entries tied with the k-th largest value are
    all kept (same as Hugging Face ``TopKLogitsWarper``). Uses ``lax.top_k`` (no full sort).
    """
    vocab = logits.shape[-1]
    if k is None or k <= 0 or k >= vocab:
        return logits
    kth = _top_k_values(logits, k)[..., -1:]
    return jnp.where(logits < kth, NEG_INF, logits)


def _top_p_keep_sorted(sorted_logits: jax.Array, log_norm: jax.Array, p: float) -> jax.Array:
    """Keep-mask over descending-sorted logits ``[..., C]`` for nucleus ``p``.

    ``log_norm [..., 1]`` is the log-partition of the *whole* distribution (so a candidate prefix
    ``C < V`` gives the same answer as the full sort whenever the prefix holds >= p of the mass).
    A sorted token is kept iff the probability mass strictly before it is < p: the smallest prefix whose
    cumulative probability reaches p, including the crossing token; the top token is always kept.
    """
    probs = jnp.exp(sorted_logits - log_norm)
    mass_before = jnp.cumsum(probs, axis=-1) - probs
    keep = mass_before < p
    return keep.at[..., 0].set(True)


def apply_top_p(logits: jax.Array, p: float) -> jax.Array:
    """Nucleus filter: keep the smallest set of tokens whose cumulative probability reaches ``p``.

    ``[..., V] -> [..., V]``; the token whose probability crosses ``p`` is kept, at least one token is
    always kept, ``p >= 1`` returns the logits unchanged. Probabilities are ``softmax(logits)`` (apply
    temperature first). Example: probs ``[0.4, 0.3, 0.2, 0.1]``, p=0.8 keeps the first three.
    This public helper sorts the full vocabulary; the sampler avoids that (see ``sample_tokens``).
    Tokens tied with the last kept logit are kept too.
    """
    if p >= 1.0:
        return logits
    logits = logits.astype(jnp.float32)
    sorted_logits = -jnp.sort(-logits, axis=-1)
    log_norm = jax.nn.logsumexp(logits, axis=-1, keepdims=True)
    keep = _top_p_keep_sorted(sorted_logits, log_norm, p)
    cutoff = jnp.min(jnp.where(keep, sorted_logits, jnp.inf), axis=-1, keepdims=True)
    return jnp.where(logits < cutoff, NEG_INF, logits)


def apply_min_p(logits: jax.Array, min_p: float) -> jax.Array:
    """Min-p filter: keep tokens with ``prob >= min_p * max_prob`` (Nguyen et al. 2024, "min-p sampling").

    ``[..., V] -> [..., V]``; in logit space: ``logit >= max_logit + log(min_p)`` (no softmax, no sort).
    ``min_p <= 0`` returns the logits unchanged.
    """
    if min_p is None or min_p <= 0.0:
        return logits
    max_logit = jnp.max(logits, axis=-1, keepdims=True)
    return jnp.where(logits < max_logit + jnp.float32(np.log(min_p)), NEG_INF, logits)


def filter_logits(logits: jax.Array, params: SamplingParams) -> jax.Array:
    """Reference composition temperature -> top-k -> top-p -> min-p over the full vocabulary.

    ``[..., V] -> [..., V] float32``; the distribution ``sample_tokens`` draws from is
    ``softmax(filter_logits(logits, params))`` (for non-greedy params).
    """
    x = apply_temperature(logits, params.temperature)
    x = apply_top_k(x, params.top_k)
    x = apply_top_p(x, params.top_p)
    return apply_min_p(x, params.min_p)


# ----------------------------------------------------------------------------------------------------
# Response mask.
# ----------------------------------------------------------------------------------------------------


def is_eos(token_ids: jax.Array, eos_token_ids: Sequence[int] | int) -> jax.Array:
    """Bool array, True where ``token_ids`` is any of ``eos_token_ids`` (same shape as token_ids)."""
    if isinstance(eos_token_ids, (int, np.integer)):
        eos_token_ids = (int(eos_token_ids),)
    eos_token_ids = tuple(int(t) for t in eos_token_ids)
    out = jnp.zeros(jnp.shape(token_ids), dtype=bool)
    for t in eos_token_ids:
        out = out | (token_ids == t)
    return out


def get_response_mask(response_ids: jax.Array, eos_token_ids: Sequence[int] | int) -> jax.Array:
    """1 for response tokens up to and including the first EOS, 0 after (verl ``get_response_mask``).

    Args:
      response_ids: ``[B, R]`` int token ids.
      eos_token_ids: one id or several; an empty tuple means no EOS (all ones).
    Returns:
      ``[B, R] int32``. Correct when the pad id equals an EOS id: only the first EOS counts, so the
      trailing pads (also EOS) are masked out; a row without EOS is all ones.
    """
    eos = is_eos(response_ids, eos_token_ids).astype(jnp.int32)
    eos_before = jnp.cumsum(eos, axis=-1) - eos
    return (eos_before == 0).astype(jnp.int32)


# ----------------------------------------------------------------------------------------------------
# Per-step sampler used inside the decode loop.
#
# CPU cost notes (B=32, V=49152, measured): Gumbel-max `jax.random.categorical` ~180 ms/step (it needs B*V
# random numbers), a full `jnp.sort` ~900 ms, `jnp.argmax` ~13 ms, `lax.top_k(256)` ~16 ms, one fused pass
# over the logits ~2-4 ms. So the sampler draws ONE uniform per row and inverts the CDF (two-level: block
# sums, then inside one block), finds top-p thresholds by bisection instead of sorting, and computes
# argmax with two plain reductions.
# ----------------------------------------------------------------------------------------------------

_CDF_BLOCK = 256
_BISECT_STEPS = 32


def _row_uniforms(key: jax.Array, row_ids: jax.Array) -> jax.Array:
    """One U[0, 1) per row from ``fold_in(key, row_id)`` -> ``[B] float32`` (independent of the batch layout).
    ``key`` is one key, or ``[B]`` keys, one per row (rows at different steps: the paged engine)."""
    if jnp.ndim(key):
        keys = jax.vmap(jax.random.fold_in)(key, row_ids.astype(jnp.uint32))
    else:
        keys = jax.vmap(lambda i: jax.random.fold_in(key, i))(row_ids.astype(jnp.uint32))
    return jax.vmap(lambda k: jax.random.uniform(k, (), jnp.float32))(keys)


def _first_last_positive(w: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Index of the first and last entry > 0 along the last axis (``[..., C]`` -> two ``[...]`` int32)."""
    c = w.shape[-1]
    idx = jnp.arange(c, dtype=jnp.int32)
    pos = w > 0
    first = jnp.min(jnp.where(pos, idx, c - 1), axis=-1)
    last = jnp.max(jnp.where(pos, idx, 0), axis=-1)
    return first, last


def _invert_cdf(w: jax.Array, target: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Index j with ``cumsum(w)[j-1] <= target < cumsum(w)[j]`` and the remainder ``target - cumsum[j-1]``.

    w ``[B, C]`` >= 0 with a positive entry per row, target ``[B]`` in ``[0, sum(w))``. Float rounding can
    push the count past the ends; it is clamped to the first/last positive entry, so a zero-weight
    (filtered) index is never returned.
    """
    c = jnp.cumsum(w, axis=-1)
    j = jnp.sum(c <= target[:, None], axis=-1).astype(jnp.int32)
    first, last = _first_last_positive(w)
    j = jnp.clip(j, first, last)
    before = jnp.take_along_axis(c - w, j[:, None], axis=-1)[:, 0]
    return j, target - before


def sample_from_weights(w: jax.Array, u: jax.Array) -> jax.Array:
    """Draw index j with probability ``w_j / sum(w)`` by inverting the CDF at ``u * sum(w)``.

    Args: w ``[B, C]`` float32 >= 0 (at least one positive per row); u ``[B]`` uniforms in [0, 1).
    Returns ``[B] int32``. For ``C > 256`` the inversion is two-level (sums of 256-wide blocks, then
    within the chosen block), so the cost is one pass over ``w`` plus O(C / 256 + 256) per row.
    """
    b, c = w.shape
    w = w.astype(jnp.float32)
    if c <= _CDF_BLOCK:
        return _invert_cdf(w, u * jnp.sum(w, axis=-1))[0]
    nb = -(-c // _CDF_BLOCK)
    if nb * _CDF_BLOCK != c:
        w = jnp.pad(w, ((0, 0), (0, nb * _CDF_BLOCK - c)))
    blocks = w.reshape(b, nb, _CDF_BLOCK)
    sums = jnp.sum(blocks, axis=-1)
    block, rest = _invert_cdf(sums, u * jnp.sum(sums, axis=-1))
    inner = jnp.take_along_axis(blocks, block[:, None, None], axis=1)[:, 0]
    j, _ = _invert_cdf(inner, jnp.maximum(rest, 0.0))
    return block * _CDF_BLOCK + j


def argmax_last(x: jax.Array) -> jax.Array:
    """``jnp.argmax(x, -1)`` (first index among ties) as two plain reductions (faster on XLA:CPU).

    ``[..., V]`` -> ``[...] int32``.
    """
    v = x.shape[-1]
    m = jnp.max(x, axis=-1, keepdims=True)
    return jnp.min(jnp.where(x == m, jnp.arange(v, dtype=jnp.int32), v), axis=-1).astype(jnp.int32)


def _top_p_mask_bisect(probs: jax.Array, p: float) -> jax.Array:
    """Top-p keep-mask over unsorted probabilities ``[B, V]`` without sorting.

    Kept = ``{i : mass of tokens with larger prob < p}`` = ``{i : probs_i >= tau}``; tau is found by
    bisection over the float32 bit patterns of the probabilities (monotone for non-negative floats), 32
    steps of one masked sum each. Same set as a full sort (tokens tied at the threshold are all kept).
    """
    bits = jax.lax.bitcast_convert_type(probs, jnp.int32)
    b = probs.shape[0]
    lo = jnp.full((b, 1), -1, jnp.int32)  # mass above lo >= p
    hi = jnp.max(bits, axis=-1, keepdims=True)  # mass above hi == 0 < p

    def body(_, lohi):
        lo, hi = lohi
        mid = lo + (hi - lo) // 2
        above = jnp.sum(jnp.where(bits > mid, probs, 0.0), axis=-1, keepdims=True)
        small = above < p
        return jnp.where(small, lo, mid), jnp.where(small, mid, hi)

    lo, hi = jax.lax.fori_loop(0, _BISECT_STEPS, body, (lo, hi))
    return bits >= hi


def sample_tokens(
    logits: jax.Array, key: jax.Array, params: SamplingParams, row_ids: jax.Array | None = None
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Draw one token per row; return it, its log-prob and the sampling threshold.

    Args:
      logits: ``[B, V]`` float logits of the next token.
      key: a ``jax.random`` key for this step, or ``[B]`` keys (one per row); row ``b`` draws its uniform from
        ``fold_in(key, row_ids[b])`` (``fold_in(key[b], row_ids[b])``).
      params: static sampling parameters.
      row_ids: ``[B]`` int32 ids of the rows (default ``arange(B)``), so a row draws the same numbers
        wherever it sits in the batch (the decode loop compacts finished rows away).
    Returns:
      ``tokens [B] int32`` drawn from ``softmax(filter_logits(logits, params))`` (argmax when greedy);
      ``log_probs [B] float32 = log_softmax(logits / temperature)[token]`` (temperature 1 when
      greedy), i.e. the training path's ``logprobs_from_logits`` value -- or, with
      ``params.truncated_log_probs``, the log-prob under the truncated distribution sampled from;
      ``threshold [B] float32``: the smallest kept tempered logit (the kept set is exactly
      ``{v : logits[v] / temperature >= threshold}``), ``-inf`` when nothing is truncated or greedy.

    Every filter is a per-row threshold on the tempered logits, so the kept set is ``{x >= tau}``
    (tokens tied at a threshold are all kept, like ``apply_top_k``/``apply_top_p``): top-k's tau is the
    k-th largest value (``lax.top_k`` values only); top-p is evaluated on the sorted top-k values (or,
    without top-k, on the ``top_p_candidates`` largest values when they hold >= top_p of the mass in
    every row, else by bisection over the whole vocabulary under ``lax.cond``); min-p's tau is
    ``max + log(min_p)``. One masked pass over the logits then feeds the inverse-CDF draw.
    """
    logits = logits.astype(jnp.float32)
    batch, vocab = logits.shape
    if params.greedy:
        tokens = argmax_last(logits)
        lse = jax.nn.logsumexp(logits, axis=-1)
        no_threshold = jnp.full((batch,), -jnp.inf, jnp.float32)
        return tokens, jnp.take_along_axis(logits, tokens[:, None], axis=-1)[:, 0] - lse, no_threshold

    scaled = logits / jnp.float32(params.temperature)
    log_norm = jax.nn.logsumexp(scaled, axis=-1, keepdims=True)
    x_max = jnp.max(scaled, axis=-1, keepdims=True)
    u = _row_uniforms(key, jnp.arange(batch, dtype=jnp.int32) if row_ids is None else row_ids)
    use_top_k = 0 < params.top_k < vocab
    tau = jnp.full((batch, 1), -jnp.inf, jnp.float32)

    def sorted_top_p_tau(vals, norm):
        keep = _top_p_keep_sorted(vals, norm, params.top_p)
        return jnp.min(jnp.where(keep, vals, jnp.inf), axis=-1, keepdims=True)

    keep_mask = None
    if use_top_k:
        vals = _top_k_values(scaled, params.top_k)
        tau = vals[:, -1:]
        if params.top_p < 1.0:  # top-p after top-k sees the distribution renormalized over the survivors
            vals = jnp.where(vals >= tau, vals, NEG_INF)
            tau = jnp.maximum(tau, sorted_top_p_tau(vals, jax.nn.logsumexp(vals, axis=-1, keepdims=True)))
    elif params.top_p < 1.0:
        n_cand = min(params.top_p_candidates, vocab)
        vals = _top_k_values(scaled, n_cand)
        if n_cand == vocab:
            tau = sorted_top_p_tau(vals, log_norm)
        else:
            # The nucleus lies inside the candidates iff they hold >= top_p of the mass (the first token
            # past them then has mass_before >= top_p); otherwise bisect over the whole vocabulary.
            covered = jnp.all(jnp.sum(jnp.exp(vals - log_norm), axis=-1) >= params.top_p)
            keep_mask = jax.lax.cond(
                covered,
                lambda: scaled >= sorted_top_p_tau(vals, log_norm),
                lambda: _top_p_mask_bisect(jnp.exp(scaled - log_norm), params.top_p),
            )
    if params.min_p > 0.0:
        tau = jnp.maximum(tau, x_max + jnp.float32(np.log(params.min_p)))
    keep = scaled >= tau
    if keep_mask is not None:
        keep &= keep_mask
    tokens = sample_from_weights(jnp.where(keep, jnp.exp(scaled - x_max), 0.0), u)
    truncating = use_top_k or params.top_p < 1.0 or params.min_p > 0.0
    threshold = jnp.full((batch,), -jnp.inf, jnp.float32)
    if truncating:
        threshold = jnp.min(jnp.where(keep, scaled, jnp.inf), axis=-1)
    if params.truncated_log_probs and truncating:
        log_norm = jax.nn.logsumexp(jnp.where(keep, scaled, -jnp.inf), axis=-1, keepdims=True)
    logp = jnp.take_along_axis(scaled, tokens[:, None], axis=-1)[:, 0] - log_norm[:, 0]
    return tokens, logp, threshold
