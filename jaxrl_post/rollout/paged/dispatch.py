"""Host-side inputs of one replica's dispatch (numpy), built from its `Scheduler`'s state; the engine stacks the
replicas' inputs on a leading replica dim (`replicas.py`). A replica with nothing to do gets inputs that change
nothing: an empty prefill chunk (no real token, every write on the null page) or a decode batch of idle slots."""

from __future__ import annotations

import numpy as np

from jaxrl_post.rollout.paged.scheduler import Piece, Scheduler, Seq


def prefill_inputs(sched: Scheduler, pieces: list[Piece], budget: int, pps: int) -> dict[str, np.ndarray]:
    """One replica's prefill chunk of `pieces` in a token budget of `budget`: tokens, positions, slots
    `[T] int32` (flat pool slots; padding on the null page), token_mask `[T] bool`, kv_lens / last `[S] int32`,
    cu_q_lens `[S + 1] int32`, page_indices `[S, pps] int32`, num_seqs `[1] int32` (S = the replica's slots,
    T = `budget`); `forward.Ragged`'s fields and the flat index of each piece's last token."""
    s_max, ps = sched.max_num_seqs, sched.alloc.page_size
    tok, pos, seq_of = (np.zeros(budget, np.int32) for _ in range(3))
    kv_lens, last = np.zeros(s_max, np.int32), np.zeros(s_max, np.int32)
    cu = np.zeros(s_max + 1, np.int32)
    tables = np.zeros((s_max, pps), np.int32)
    off = 0
    for i, pc in enumerate(pieces):
        ctx = pc.seq.context
        tok[off : off + pc.count] = ctx[pc.start : pc.start + pc.count]
        pos[off : off + pc.count] = np.arange(pc.start, pc.start + pc.count)
        seq_of[off : off + pc.count] = i
        kv_lens[i] = pc.start + pc.count
        tables[i] = sched.alloc.page_table([pc.seq.row], pps)[0]
        off += pc.count
        cu[i + 1 :] = off
        last[i] = off - 1
    real = np.arange(budget) < off
    page = tables[seq_of, np.minimum(pos // ps, pps - 1)]  # `kv_pool.token_slots` (real tokens fit their table)
    slots = np.where(real, page * ps + pos % ps, 0).astype(np.int32)
    return dict(
        tokens=tok[None],
        positions=pos[None],
        slots=slots,
        kv_lens=kv_lens,
        page_indices=tables,
        cu_q_lens=cu,
        num_seqs=np.asarray([len(pieces)], np.int32),
        token_mask=real[None],
        last=last,
    )


def first_logits(pieces: list[Piece], complete, s_max: int) -> tuple[np.ndarray, np.ndarray]:
    """(src, dst) `[S] int32` of `programs.place_logits` for one replica: the slot of every sample of each group
    whose prompt is now whole takes its prefilled sequence's last logits; unused entries drop (dst = S)."""
    src, dst = np.zeros(s_max, np.int32), np.full(s_max, s_max, np.int32)
    index, k = {id(pc.seq): i for i, pc in enumerate(pieces)}, 0
    for first, group in complete:
        for s in group:
            src[k], dst[k] = index[id(first)], s.slot
            k += 1
            if s is not first and not s.routes:  # a fork: the prompt's experts are its first sample's
                s.routes = list(first.routes)
    return src, dst


def page_copies(copies: list[list[tuple[int, int]]], s_max: int) -> np.ndarray | None:
    """The replicas' forked-page copies as `[D, C, 2] int32` (src, dst), C the longest list rounded up to a
    multiple of `s_max` (few program sizes), padded with (0, 0) (the null page onto itself); None when none."""
    most = max(len(c) for c in copies)
    if not most:
        return None
    pairs = np.zeros((len(copies), -(-most // s_max) * s_max, 2), np.int32)
    for r, c in enumerate(copies):
        if c:
            pairs[r, : len(c)] = c
    return pairs


def decode_batch_sizes(max_num_seqs: int, sizes=None) -> tuple[int, ...]:
    """The decode batch sizes the engine compiles, ascending, the largest `max_num_seqs`: a decode dispatch runs
    the smallest one that holds every replica's running sequences, so a batch of 16 sequences in 256 slots computes
    16 rows, not 256. `sizes`: vLLM's `cudagraph_capture_sizes` (here one jitted program each); those above
    `max_num_seqs` are dropped. None: powers of two from 8 (tpu-inference's padding of the request count) and
    `max_num_seqs`. Raises ValueError for a size < 1 or not an int."""
    if sizes is None:
        sizes = [1 << i for i in range(3, max(max_num_seqs, 1).bit_length())]
    sizes = list(sizes)
    if any(isinstance(x, bool) or not isinstance(x, (int, np.integer)) or x < 1 for x in sizes):
        raise ValueError(f"cudagraph_capture_sizes must be positive ints, got {sizes}")
    return tuple(sorted({int(x) for x in sizes if x < max_num_seqs} | {int(max_num_seqs)}))


def padded_batch_size(sizes: tuple[int, ...], running: int) -> int:
    """The smallest of `sizes` (ascending) >= `running` sequences (the largest when none is)."""
    return next((x for x in sizes if x >= running), sizes[-1])


def decode_inputs(sched: Scheduler, seqs: list[Seq], pps: int, size: int | None = None) -> tuple[np.ndarray, ...]:
    """One replica's decode batch of its running `seqs` (at most `size`, default the replica's `max_num_seqs`),
    in slot order, padded to `size`: idx (the slot of each entry, `max_num_seqs` for padding), pos, t, rows, limit
    `[size] int32`, done `[size] bool` (padding: done), tables `[size, pps] int32` (`programs.decode`'s
    per-replica arguments); rows are the sequences' sampling ids (`Seq.sample_row`, else `Seq.row`)."""
    s_max = sched.max_num_seqs
    size = s_max if size is None else size
    idx = np.full(size, s_max, np.int32)
    pos, t, rows = (np.zeros(size, np.int32) for _ in range(3))
    limit, done = np.ones(size, np.int32), np.ones(size, bool)
    tables = np.zeros((size, pps), np.int32)
    for i, s in enumerate(sorted(seqs, key=lambda s: s.slot)):
        row = s.row if s.sample_row is None else s.sample_row
        idx[i], pos[i], t[i], rows[i], limit[i] = s.slot, s.length, len(s.tokens), row, s.limit
        done[i] = False
        tables[i] = sched.alloc.page_table([s.row], pps)[0]
    return idx, pos, t, rows, limit, done, tables


def by_slot(compact: np.ndarray, idx: np.ndarray, s_max: int) -> np.ndarray:
    """A decode output `compact [size, ...]` of the entries of `decode_inputs`' `idx [size]` as `[s_max, ...]`
    by slot (zeros at slots without an entry)."""
    out = np.zeros((s_max, *compact.shape[1:]), compact.dtype)
    real = idx < s_max
    out[idx[real]] = compact[real]
    return out
