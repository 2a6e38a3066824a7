"""Host-side sequence packing (numpy, pure): train on real tokens with static shapes.

A mini-batch of M sequences (left-padded prompt `[P]` + right-padded response `[R]`, T = P + R) is
packed, first-fit-decreasing (`row_packer.pack_rows`), into rows of `row_len` tokens: every sequence keeps only
its real tokens (prompt + response, contiguous) as one *segment* of a row, with its own positions (0, 1, ... as in the
unpadded sequence) and a segment id (1, 2, ... per row; 0 = padding). Rows are grouped into `n_micro`
micro-batches of `rows` rows each. Only the response tokens are scored, so each micro-batch also lists
its response tokens in `slots` *slots* (the LM head and log-softmax run on those slots only).

Static shapes (one compile per `PackSpec`): per token `[n_micro, rows, row_len]`, per slot
`[n_micro, slots]`, per sequence `[n_micro, seqs, R]`. The packer fills micro-batches in order, so the
trailing ones are empty when the real tokens fit in fewer; the jitted steps loop over the used ones only
(compute scales with the real tokens, shapes never change).

Slots sharded with their rows (`PackSpec.shards` G > 1, the mesh's data * fsdp: `placement.pack_spec`): the rows
of a micro-batch are split into G contiguous shards over the devices, and the slots into G blocks of Q / G, block
j holding only response tokens of shard j's rows with a shard-local `slot_pos [n, G, Q / G]`, so every device
gathers its own hidden states and runs the LM head on Q / G slots instead of all Q (`packed_steps`). G = 1 is
the plain layout.

Capacity guarantee (`make_pack_spec` defaults): with `row_len >= P + R`, `slots >= rows * R`,
`seqs >= rows` and `n_micro = ceil(M / rows)`, every mini-batch fits: a micro-batch that refuses a
sequence already holds >= `rows` sequences (each sequence fits alone in a fresh row and in R slots).

Shared prompts (`PackSpec.share_prompts`, config `model.pack_shared_prompts`): sequences whose real prompt
tokens (and positions) are equal, e.g. the `rollout.n` samples of one GRPO prompt, share one copy of the prompt
per row: a row *chunk* holds the prompt once, then responses of it, each attending to the prompt and to
itself. Segment ids then encode `chunk << SUB_BITS | sub` (sub 0 = the prompt, j = the chunk's j-th
response; see `Transformer.hidden_states`). The forward and backward are the same function of the
parameters as with one prompt copy per sequence (each response sees the same prompt keys and values; the
prompt's gradient is the sum over its responses), so losses and gradients agree to float roundoff, on
fewer tokens: in a GRPO batch of 8 samples per prompt the prompt tokens are computed once per row instead of
8 times. (Prefix sharing as in "Prefix Grouper", Liu et al. 2025; verl packs one copy per sequence.)

Source: MaxText-style packing (segment ids + per-segment positions); verl `use_remove_padding` (unpad)
and `use_dynamic_bsz` (token-budget micro-batches, `rearrange_micro_batches`).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from jaxrl_post.engine.row_packer import GroupLimit, pack_rows

# the packed layout back to the batch's, re-exported where they were
# Shared-prompt segment ids: `chunk << SUB_BITS | sub` (sub 0 = the chunk prompt, j >= 1 = its j-th response)
from jaxrl_post.models.decoder import SEGMENT_SUB_BITS as SUB_BITS


@dataclasses.dataclass(frozen=True)
class PackSpec:
    """Static geometry of a packed mini-batch (all counts per micro-batch unless said).

    n_micro: micro-batches (an upper bound: empty ones are skipped); rows: rows per micro-batch;
    row_len: tokens per row; seqs: sequence slots per micro-batch; slots: response-token slots per
    micro-batch; response_length: R; share_prompts: one prompt copy per row chunk for sequences with equal
    prompts (see the module docstring; the shapes do not change); shards: the row-axis shards (data * fsdp of
    the mesh). With `shards > 1` the slots are laid out in `shards` blocks of `slots // shards`, block j holding
    only response tokens of the rows of shard j (rows `[j * rows // shards, (j + 1) * rows // shards)` of a
    micro-batch, as `Placement.put_packed` splits them), so the LM head runs where its hidden states are
    (`pack_batch`); needs `rows % shards == 0` and `slots % shards == 0` (`make_pack_spec` ensures both).
    """

    n_micro: int
    rows: int
    row_len: int
    seqs: int
    slots: int
    response_length: int
    share_prompts: bool = False
    shards: int = 1

    @property
    def block_rows(self) -> int:
        """Rows of one shard of a micro-batch."""
        return self.rows // self.shards

    @property
    def block_slots(self) -> int:
        """Slots of one shard's block."""
        return self.slots // self.shards


def make_pack_spec(
    n_seqs: int,
    rows: int,
    prompt_length: int,
    response_length: int,
    *,
    row_len: int | None = None,
    n_micro: int | None = None,
    share_prompts: bool = False,
    shards: int = 1,
) -> PackSpec:
    """A `PackSpec` that always fits `n_seqs` sequences of `prompt_length + response_length` tokens.

    With T = P + R and k = row_len // T (whole max-length sequences per row): defaults `row_len = T`,
    `n_micro = ceil(n_seqs / (rows * k))` (the padded micro-batch count when `rows * k` = the padded
    micro-batch size), `slots = rows * k * R` (the LM-head positions of that padded micro-batch, so the packed
    LM head never costs more per micro-batch; a micro-batch is also closed when its responses fill the
    slots), `seqs = n_seqs`. Guarantee: a full row holds >= k sequences, so a micro-batch that refuses a
    sequence holds >= rows * k of them. `share_prompts`: see `PackSpec`; then `slots = rows * row_len` (a
    micro-batch of shared prompts is mostly response tokens, so the padded micro-batch's slot count would
    close it half empty); a shared plan that does not fit falls back to one prompt copy per sequence.
    `shards`: the devices the row axis is split over (data * fsdp; `PackSpec.shards`): kept when it divides
    `rows` (slots are then rounded up to a multiple of it: per-shard blocks), else 1 (one block, today's layout).
    The capacity guarantee holds per block (a block that refuses a sequence holds >= rows * k / shards of them).
    Raises ValueError when `rows < 1`, `shards < 1` or `row_len < T` (a sequence could not fit).
    """
    t = int(prompt_length) + int(response_length)
    row_len = t if row_len is None else int(row_len)
    if rows < 1:
        raise ValueError(f"rows per micro-batch must be >= 1, got {rows}")
    if row_len < t:
        raise ValueError(f"row_len {row_len} < max sequence length P + R = {t}: a sequence may not fit a row")
    if shards < 1:
        raise ValueError(f"shards must be >= 1, got {shards}")
    shards = int(shards) if int(rows) % int(shards) == 0 else 1  # rows not divisible: one block (today's layout)
    per_micro = int(rows) * (row_len // t)
    n_micro = -(-int(n_seqs) // per_micro) if n_micro is None else int(n_micro)
    slots = int(rows) * row_len if share_prompts else per_micro * int(response_length)
    return PackSpec(
        n_micro=n_micro,
        rows=int(rows),
        row_len=row_len,
        seqs=int(n_seqs),
        slots=-(-slots // shards) * shards,
        response_length=int(response_length),
        share_prompts=bool(share_prompts),
        shards=shards,
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
    has a sequence slot and whose slot block (the micro-batch's, or with `spec.shards > 1` its row's shard's:
    `PackSpec`) still has `resp_lens[i]` response slots; otherwise into a new row of the first micro-batch
    with a free row and room (`row_packer.pack_rows` over the `n_micro * rows` rows, with those two group
    limits). The first slot is global (block * block_slots + slot in the block). Pure function of the lengths.
    Raises ValueError when a sequence is longer than a row or the mini-batch does not fit the spec.
    """
    seq_lens, resp_lens = np.asarray(seq_lens, np.int64), np.asarray(resp_lens, np.int64)
    _check_shards(spec)
    if np.any(seq_lens > spec.row_len) or np.any(resp_lens > spec.block_slots):
        raise ValueError(f"a sequence is longer than a row ({spec.row_len} tokens) or a block's slots")
    limits = (GroupLimit(spec.rows, spec.seqs), GroupLimit(spec.block_rows, spec.block_slots, resp_lens))
    try:
        plan = pack_rows(seq_lens, spec.row_len, max_rows=spec.n_micro * spec.rows, limits=limits)
    except ValueError as e:  # the lengths fit a row (checked above): the rows or limits are too few
        raise ValueError(f"mini-batch of {len(seq_lens)} sequences does not fit {spec}") from e
    row, (seq_slot, in_block) = plan.row, plan.starts
    first = (row // spec.block_rows % spec.shards) * spec.block_slots + in_block
    return np.stack([row // spec.rows, row % spec.rows, plan.offset, seq_slot, first], 1).reshape(-1, 5)


def _check_shards(spec: PackSpec) -> None:
    if spec.shards < 1 or spec.rows % spec.shards or spec.slots % spec.shards:
        raise ValueError(f"{spec}: shards must be >= 1 and divide rows and slots (make_pack_spec)")


def _first_slot(spec: PackSpec, block: int, used: int) -> int:
    """Global slot index of slot `used` of slot block `block` (= micro * shards + shard)."""
    return (int(block) % spec.shards) * spec.block_slots + int(used)


def prompt_groups(ids: np.ndarray, positions: np.ndarray | None, p_len: np.ndarray, p: int) -> np.ndarray:
    """`[M] int64` group of each sequence: equal for sequences whose real prompt tokens (the last `p_len[i]`
    of the first `p` columns) and their positions are equal; groups are numbered by first appearance."""
    groups, seen = np.zeros(len(p_len), np.int64), {}
    for i, n in enumerate(p_len):
        lo = p - int(n)
        key = ids[i, lo:p].tobytes() + (b"" if positions is None else positions[i, lo:p].tobytes())
        groups[i] = seen.setdefault(key, len(seen))
    return groups


def plan_shared_packing(p_len: np.ndarray, r_len: np.ndarray, groups: np.ndarray, spec: PackSpec) -> np.ndarray:
    """First-fit-decreasing placement with one prompt copy per row chunk: `[M, 7] int64` rows (micro, row,
    prompt offset, response offset, seq slot, first slot, sub), sub = 1 for the response that opens a chunk
    (and writes its prompt), 2, 3, ... for the responses that join it.

    Groups go largest first (prompt + all responses), their responses longest first. A response joins its
    group's chunk when that chunk ends its row and the row and micro-batch have room (cost: its response
    tokens); otherwise it opens a chunk (prompt + response) in the first row with room, as `plan_packing`.
    Raises ValueError when the mini-batch does not fit the spec (`pack_batch` then uses `plan_packing`).
    """
    p_len, r_len = np.asarray(p_len, np.int64), np.asarray(r_len, np.int64)
    _check_shards(spec)
    n_rows = spec.n_micro * spec.rows
    row_used = np.zeros(n_rows, np.int64)
    row_micro = np.arange(n_rows) // spec.rows
    row_block = np.arange(n_rows) // spec.block_rows  # micro * shards + shard (slot blocks, see PackSpec)
    row_last = np.full(n_rows, -1, np.int64)  # group of the chunk that ends each row
    row_chunk_start = np.zeros(n_rows, np.int64)  # prompt offset of that chunk
    row_chunk_subs = np.zeros(n_rows, np.int64)  # responses in that chunk
    slots_used = np.zeros(spec.n_micro * spec.shards, np.int64)  # per slot block
    seqs_used = np.zeros(spec.n_micro, np.int64)
    place = np.zeros((len(p_len), 7), np.int64)
    total = {g: int(p_len[groups == g][0] + r_len[groups == g].sum()) for g in np.unique(groups)}
    order = sorted(range(len(p_len)), key=lambda j: (-total[int(groups[j])], int(groups[j]), -r_len[j], j))
    for i in order:
        g, n_p, r = int(groups[i]), int(p_len[i]), int(r_len[i])
        row_ok = (slots_used[row_block] + r <= spec.block_slots) & (seqs_used[row_micro] < spec.seqs)
        join = (row_last == g) & (row_used + r <= spec.row_len) & row_ok
        if join.any():
            row = int(np.argmax(join))
            row_chunk_subs[row] += 1
            prompt_off, resp_off = row_chunk_start[row], row_used[row]
        else:
            fits = (row_used > 0) & (row_used + n_p + r <= spec.row_len) & row_ok
            if not fits.any():
                fits = (row_used == 0) & row_ok & (n_p + r <= spec.row_len)
                if not fits.any():
                    raise ValueError(f"mini-batch of {len(p_len)} sequences does not fit {spec} with shared prompts")
            row = int(np.argmax(fits))
            prompt_off, resp_off = row_used[row], row_used[row] + n_p
            row_last[row], row_chunk_start[row], row_chunk_subs[row] = g, prompt_off, 1
        k, b = row_micro[row], row_block[row]
        first = _first_slot(spec, b, slots_used[b])
        place[i] = (k, row % spec.rows, prompt_off, resp_off, seqs_used[k], first, row_chunk_subs[row])
        row_used[row] = resp_off + r
        slots_used[b] += r
        seqs_used[k] += 1
    return place


def plan_batch(batch: dict[str, np.ndarray], spec: PackSpec) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """`(place [M, 7] int64, prompt lengths [M], response lengths [M])` of `pack_batch`: `plan_shared_packing`'s
    rows (one-copy-per-sequence plans as sub 0 with the prompt at offset, the response right after it)."""
    ids, pos_ids, place = np.asarray(batch["input_ids"]), batch.get("position_ids"), None
    m, p = ids.shape[0], ids.shape[1] - spec.response_length
    p_len, r_len = _lengths(batch["attention_mask"], spec.response_length)
    if spec.share_prompts:
        groups = prompt_groups(ids, None if pos_ids is None else np.asarray(pos_ids), p_len, p)
        if len(np.unique(groups)) < m:  # some prompt is shared
            try:
                place = plan_shared_packing(p_len, r_len, groups, spec)
            except ValueError:  # does not fit with shared prompts: one copy per sequence (docstring)
                pass
    if place is None:  # one prompt copy per sequence: (micro, row, offset, seq slot, first slot) -> shared layout
        flat = plan_packing(p_len + r_len, r_len, spec)
        place = np.stack([flat[:, 0], flat[:, 1], flat[:, 2], flat[:, 2] + p_len, flat[:, 3], flat[:, 4]], 1)
        place = np.concatenate([place, np.zeros((m, 1), np.int64)], 1)  # sub 0: own segment, prompt included
    return place, p_len, r_len


def pack_batch(batch: dict[str, np.ndarray], spec: PackSpec, plan=None) -> dict[str, np.ndarray]:
    """Pack a mini-batch for the packed forward / update steps (`engine/packed_steps.py`).

    Args:
      batch: `input_ids`, `attention_mask` `[M, T]` (left-padded prompts, right-padded responses, T = P + R),
        optional `position_ids [M, T]` (default: 0, 1, ... over the real tokens), `responses [M, R]`.
        Per-sequence fields (advantages, old log-probs, ...) stay `[M, R]`: the steps gather them on device
        with `seq_index`.
      spec: the static geometry (`make_pack_spec`); `spec.share_prompts`: one prompt copy per row chunk for
        sequences with equal prompts (`plan_shared_packing`; falls back to `plan_packing` when it does not
        fit).
      plan: `plan_batch(batch, spec)` when already computed.
    Returns numpy arrays (n = n_micro, S = spec.seqs, Q = spec.slots, L = row_len):
      `input_ids`, `segment_ids`, `positions` `[n, rows, L] int32` (segment 0 = padding; with shared prompts
      `chunk << SUB_BITS | sub`, chunk >= 1, see the module docstring);
      `slot_pos [n, Q] int32`: flat index (row * L + col) of the hidden state that predicts each slot's token
      (the token before it; a shared prompt's last token for every response's first token); with
      `spec.shards` G > 1, `[n, G, Q / G] int32`: block j holds the slots `[j * Q / G, (j + 1) * Q / G)` (the
      global slot numbering of every other per-slot array), all of them response tokens of shard j's rows,
      and the index is shard-local ((row - j * rows / G) * L + col), so the steps gather and run the LM
      head on each shard's own rows (`packed_steps`); unused slots point at index 0 of their shard;
      `slot_tokens [n, Q] int32`: that response token;
      `seq_slot [n, S, R] int32`: the slot of response token r of sequence slot s, -1 where there is none
      (response padding, empty sequence slot); `seq_index [n, S] int32`: the mini-batch row held by each
      sequence slot, -1 = empty; with `sampling_logit_threshold [M, R]` in `batch`, also `slot_threshold
      [n, Q] float32` (-inf in unused slots).
    Raises ValueError (see `plan_packing`, and when real tokens are not contiguous).
    """
    ids = np.asarray(batch["input_ids"])
    r_max = spec.response_length
    p = ids.shape[1] - r_max
    place, p_len, r_len = plan_batch(batch, spec) if plan is None else plan
    pos_ids = None if batch.get("position_ids") is None else np.asarray(batch["position_ids"])
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
    responses = np.asarray(batch["responses"])
    thresholds = batch.get("sampling_logit_threshold")
    if thresholds is not None:  # rollout.sampling_mask_replay: each slot's sampling threshold
        out["slot_threshold"] = np.full((n, Q), -np.inf, np.float32)
    n_chunks = np.zeros((n, rows), np.int32)
    for i in np.lexsort((place[:, 3], place[:, 1], place[:, 0])):  # row order: a chunk's opener first
        k, row, p_off, r_off, s, q, sub = (int(v) for v in place[i])
        pl, rl = int(p_len[i]), int(r_len[i])
        pos = np.arange(pl + rl) if pos_ids is None else pos_ids[i, p - pl : p + rl]
        if sub <= 1:  # the sequence writes its prompt: a new segment (sub 0) or chunk (sub 1)
            n_chunks[k, row] += 1
        base = n_chunks[k, row] << (SUB_BITS if sub else 0)  # plain segments: ids 1, 2, ... (sub 0)
        if sub <= 1:
            out["input_ids"][k, row, p_off : p_off + pl] = ids[i, p - pl : p]
            out["segment_ids"][k, row, p_off : p_off + pl] = base
            out["positions"][k, row, p_off : p_off + pl] = pos[:pl]
        out["input_ids"][k, row, r_off : r_off + rl] = ids[i, p : p + rl]
        out["segment_ids"][k, row, r_off : r_off + rl] = base | sub
        out["positions"][k, row, r_off : r_off + rl] = pos[pl:]
        # hidden state predicting response token 0: the prompt's last token; then the response's own tokens
        local_row = row % spec.block_rows  # = row with one shard
        cols = np.concatenate([[p_off + pl - 1], r_off + np.arange(rl - 1)]) if rl else np.zeros(0, int)
        first = local_row * L + cols
        out["slot_pos"][k, q : q + rl] = first
        out["slot_tokens"][k, q : q + rl] = responses[i, :rl]
        out["seq_slot"][k, s, :rl] = q + np.arange(rl)
        out["seq_index"][k, s] = i
        if thresholds is not None:
            out["slot_threshold"][k, q : q + rl] = thresholds[i, :rl]
    if spec.shards > 1:
        out["slot_pos"] = out["slot_pos"].reshape(n, spec.shards, spec.block_slots)
    return out
