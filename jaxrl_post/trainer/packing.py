"""Host-side sequence packing (numpy, pure): train on real tokens with static shapes.

A mini-batch of M sequences (left-padded prompt `[P]` + right-padded response `[R]`, T = P + R) is
packed, first-fit-decreasing, into rows of `row_len` tokens: every sequence keeps only its real tokens
(prompt + response, contiguous) as one *segment* of a row, with its own positions (0, 1, ... as in the
unpadded sequence) and a segment id (1, 2, ... per row; 0 = padding). Rows are grouped into `n_micro`
micro-batches of `rows` rows each. Only the response tokens are scored, so each micro-batch also lists
its response tokens in `slots` *slots* (the LM head and log-softmax run on those slots only).

Static shapes (one compile per `PackSpec`): per token `[n_micro, rows, row_len]`, per slot
`[n_micro, slots]`, per sequence `[n_micro, seqs, R]`. The packer fills micro-batches in order, so the
trailing ones are empty when the real tokens fit in fewer; the jitted steps loop over the used ones only
(compute scales with the real tokens, shapes never change).

Capacity guarantee (`make_pack_spec` defaults): with `row_len >= P + R`, `slots >= rows * R`,
`seqs >= rows` and `n_micro = ceil(M / rows)`, every mini-batch fits: a micro-batch that refuses a
sequence already holds >= `rows` sequences (each sequence fits alone in a fresh row and in R slots).

Source: MaxText-style packing (segment ids + per-segment positions); verl `use_remove_padding` (unpad)
and `use_dynamic_bsz` (token-budget micro-batches, `rearrange_micro_batches`).
"""

from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass(frozen=True)
class PackSpec:
    """Static geometry of a packed mini-batch (all counts per micro-batch unless said).

    n_micro: micro-batches (an upper bound: empty ones are skipped); rows: rows per micro-batch;
    row_len: tokens per row; seqs: sequence slots per micro-batch; slots: response-token slots per
    micro-batch; response_length: R.
    """

    n_micro: int
    rows: int
    row_len: int
    seqs: int
    slots: int
    response_length: int


def make_pack_spec(
    n_seqs: int,
    rows: int,
    prompt_length: int,
    response_length: int,
    *,
    row_len: int | None = None,
    n_micro: int | None = None,
) -> PackSpec:
    """A `PackSpec` that always fits `n_seqs` sequences of `prompt_length + response_length` tokens.

    With T = P + R and k = row_len // T (whole max-length sequences per row): defaults `row_len = T`,
    `n_micro = ceil(n_seqs / (rows * k))` (the padded micro-batch count when `rows * k` = the padded
    micro-batch size), `slots = rows * k * R` (the LM-head positions of that padded micro-batch, so the packed
    LM head never costs more per micro-batch; a micro-batch is also closed when its responses fill the
    slots), `seqs = n_seqs`. Guarantee: a full row holds >= k sequences, so a micro-batch that refuses a
    sequence holds >= rows * k of them.
    Raises ValueError when `rows < 1` or `row_len < T` (a sequence could not fit).
    """
    t = int(prompt_length) + int(response_length)
    row_len = t if row_len is None else int(row_len)
    if rows < 1:
        raise ValueError(f"rows per micro-batch must be >= 1, got {rows}")
    if row_len < t:
        raise ValueError(f"row_len {row_len} < max sequence length P + R = {t}: a sequence may not fit a row")
    per_micro = int(rows) * (row_len // t)
    n_micro = -(-int(n_seqs) // per_micro) if n_micro is None else int(n_micro)
    return PackSpec(
        n_micro=n_micro,
        rows=int(rows),
        row_len=row_len,
        seqs=int(n_seqs),
        slots=per_micro * int(response_length),
        response_length=int(response_length),
    )


def micro_geometry(
    *,
    micro_batch_size: int,
    use_dynamic_bsz: bool,
    max_token_len_per_gpu: int | None,
    seq_len: int,
    seqs_per_row: int,
    dp: int,
    n_seqs: int,
) -> tuple[int, int]:
    """(rows per packed micro-batch (global, a multiple of `dp`), row_len): how verl's keys map to packing.

    Rows hold `k = seqs_per_row` max-length sequences (`row_len = k * seq_len`, seq_len = P + R): longer
    rows pack tighter (a sequence longer than half a row leaves the rest of a one-sequence row empty), but
    attention over a row costs `row_len^2` (masked across segments, not skipped).
    * `use_dynamic_bsz` False: `ceil(micro_batch_size / k)` rows, the token budget (and memory bound) of the
      padded micro-batch of `micro_batch_size` responses; a packed micro-batch holds as many sequences as
      fit (verl packs a fixed number of sequences per micro-batch instead).
    * `use_dynamic_bsz` True: `dp * (max_token_len_per_gpu // row_len)` rows: at most
      `max_token_len_per_gpu` tokens per device per micro-batch (verl `ppo_max_token_len_per_gpu`); k is
      lowered to fit one row per device.
    Rows are capped at what `n_seqs` sequences need. Raises ValueError when `max_token_len_per_gpu <
    seq_len` (verl also requires it to hold the longest sequence) or `seqs_per_row < 1`.
    """
    k = int(seqs_per_row)
    if k < 1:
        raise ValueError(f"seqs_per_row must be >= 1, got {seqs_per_row}")
    if use_dynamic_bsz:
        if max_token_len_per_gpu is None or int(max_token_len_per_gpu) < seq_len:
            raise ValueError(
                f"max_token_len_per_gpu = {max_token_len_per_gpu} must be >= max_prompt_length + "
                f"max_response_length = {seq_len} (one whole sequence per device)"
            )
        k = min(k, int(max_token_len_per_gpu) // seq_len)
        rows = dp * (int(max_token_len_per_gpu) // (k * seq_len))
    else:
        rows = -(-int(micro_batch_size) // k)
    rows = -(-rows // dp) * dp
    return min(rows, -(-int(n_seqs) // (k * dp)) * dp), k * seq_len


def _lengths(attention_mask: np.ndarray, response_length: int) -> tuple[np.ndarray, np.ndarray]:
    """(prompt real tokens [M], response real tokens [M]); checks that the real tokens are contiguous."""
    am = np.asarray(attention_mask) != 0
    r = response_length
    p_len = am[:, :-r].sum(1)
    r_len = am[:, -r:].sum(1)
    p = am.shape[1] - r
    prompt_ok = np.all(am[:, :-r] == (np.arange(p)[None] >= p - p_len[:, None]))
    resp_ok = np.all(am[:, -r:] == (np.arange(r)[None] < r_len[:, None]))
    if not (prompt_ok and resp_ok):
        raise ValueError("packing needs left-padded prompts and right-padded responses (contiguous real tokens)")
    if np.any(p_len < 1):
        raise ValueError("packing needs >= 1 prompt token per sequence (it predicts the first response token)")
    return p_len.astype(np.int64), r_len.astype(np.int64)


def plan_packing(seq_lens: np.ndarray, resp_lens: np.ndarray, spec: PackSpec) -> np.ndarray:
    """First-fit-decreasing placement: `[M, 5] int64` rows (micro, row, offset, seq slot, first slot).

    Sequences (longest first, ties by index) go into the first row with room whose micro-batch still
    has `resp_lens[i]` response slots and a sequence slot; otherwise into a new row of the first
    micro-batch with a free row and room. Pure function of the lengths.
    Raises ValueError when a sequence is longer than a row or the mini-batch does not fit the spec.
    """
    seq_lens, resp_lens = np.asarray(seq_lens, np.int64), np.asarray(resp_lens, np.int64)
    n_rows = spec.n_micro * spec.rows
    if np.any(seq_lens > spec.row_len) or np.any(resp_lens > spec.slots):
        raise ValueError(f"a sequence is longer than a row ({spec.row_len} tokens) or a micro-batch's slots")
    row_used = np.zeros(n_rows, np.int64)
    row_open = np.zeros(n_rows, bool)
    row_micro = np.arange(n_rows) // spec.rows
    slots_used = np.zeros(spec.n_micro, np.int64)
    seqs_used = np.zeros(spec.n_micro, np.int64)
    place = np.zeros((len(seq_lens), 5), np.int64)
    for i in sorted(range(len(seq_lens)), key=lambda j: (-seq_lens[j], j)):
        n, r = seq_lens[i], resp_lens[i]
        micro_ok = (slots_used + r <= spec.slots) & (seqs_used < spec.seqs)
        fits = row_open & (row_used + n <= spec.row_len) & micro_ok[row_micro]
        if not fits.any():
            fits = ~row_open & micro_ok[row_micro]
            if not fits.any():
                raise ValueError(f"mini-batch of {len(seq_lens)} sequences does not fit {spec}")
        row = int(np.argmax(fits))
        k = row_micro[row]
        place[i] = (k, row % spec.rows, row_used[row], seqs_used[k], slots_used[k])
        row_open[row] = True
        row_used[row] += n
        slots_used[k] += r
        seqs_used[k] += 1
    return place


def pack_batch(batch: dict[str, np.ndarray], spec: PackSpec) -> dict[str, np.ndarray]:
    """Pack a mini-batch for the packed forward / update steps (`trainer/packed_steps.py`).

    Args:
      batch: `input_ids`, `attention_mask` `[M, T]` (left-padded prompts, right-padded responses, T = P + R),
        optional `position_ids [M, T]` (default: 0, 1, ... over the real tokens), `responses [M, R]`.
        Per-sequence fields (advantages, old log-probs, ...) stay `[M, R]`: the steps gather them on device
        with `seq_index`.
      spec: the static geometry (`make_pack_spec`).
    Returns numpy arrays (n = n_micro, S = spec.seqs, Q = spec.slots, L = row_len):
      `input_ids`, `segment_ids`, `positions` `[n, rows, L] int32` (segment 0 = padding);
      `slot_pos [n, Q] int32`: flat index (row * L + col) of the hidden state that predicts each slot's token
      (the token before it); `slot_tokens [n, Q] int32`: that response token;
      `seq_slot [n, S, R] int32`: the slot of response token r of sequence slot s, -1 where there is none
      (response padding, empty sequence slot); `seq_index [n, S] int32`: the mini-batch row held by each
      sequence slot, -1 = empty; with `sampling_logit_threshold [M, R]` in `batch`, also `slot_threshold
      [n, Q] float32` (-inf in unused slots).
    Raises ValueError (see `plan_packing`, and when real tokens are not contiguous).
    """
    ids = np.asarray(batch["input_ids"])
    m, t = ids.shape
    r_max = spec.response_length
    p_len, r_len = _lengths(batch["attention_mask"], r_max)
    place = plan_packing(p_len + r_len, r_len, spec)
    n, rows, L, S, Q = spec.n_micro, spec.rows, spec.row_len, spec.seqs, spec.slots
    out = {
        "input_ids": np.zeros((n, rows, L), np.int32),
        "segment_ids": np.zeros((n, rows, L), np.int32),
        "positions": np.zeros((n, rows, L), np.int32),
        "slot_pos": np.zeros((n, Q), np.int32),
        "slot_tokens": np.zeros((n, Q), np.int32),
        "seq_slot": np.full((n, S, r_max), -1, np.int32),
        "seq_index": np.full((n, S), -1, np.int32),
    }
    pos_ids = batch.get("position_ids")
    responses = np.asarray(batch["responses"])
    thresholds = batch.get("sampling_logit_threshold")
    if thresholds is not None:  # rollout.sampling_mask_replay: each slot's sampling threshold
        out["slot_threshold"] = np.full((n, Q), -np.inf, np.float32)
    n_segs = np.zeros((n, rows), np.int32)
    p = t - r_max
    for i in range(m):
        k, row, off, s, q = (int(v) for v in place[i])
        lo, hi = p - int(p_len[i]), p + int(r_len[i])  # real tokens: [lo, hi)
        length = hi - lo
        n_segs[k, row] += 1
        out["input_ids"][k, row, off : off + length] = ids[i, lo:hi]
        out["segment_ids"][k, row, off : off + length] = n_segs[k, row]
        out["positions"][k, row, off : off + length] = (
            np.arange(length) if pos_ids is None else np.asarray(pos_ids)[i, lo:hi]
        )
        rl = int(r_len[i])
        first = row * L + off + int(p_len[i]) - 1  # hidden state predicting response token 0
        out["slot_pos"][k, q : q + rl] = first + np.arange(rl)
        out["slot_tokens"][k, q : q + rl] = responses[i, :rl]
        out["seq_slot"][k, s, :rl] = q + np.arange(rl)
        out["seq_index"][k, s] = i
        if thresholds is not None:
            out["slot_threshold"][k, q : q + rl] = thresholds[i, :rl]
    return out


def unpack_seq(x: np.ndarray, seq_index: np.ndarray, n_seqs: int) -> np.ndarray:
    """Inverse of the per-sequence layout: `[n_micro, S, ...]` -> `[n_seqs, ...]` (rows never packed: 0)."""
    x, idx = np.asarray(x), np.asarray(seq_index)
    out = np.zeros((n_seqs,) + x.shape[2:], x.dtype)
    valid = idx >= 0
    out[idx[valid]] = x[valid]
    return out


def packed_token_count(packed: dict[str, np.ndarray]) -> int:
    """Real tokens in a packed mini-batch."""
    return int(np.count_nonzero(packed["segment_ids"]))
