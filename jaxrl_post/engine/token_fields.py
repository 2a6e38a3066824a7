"""Fields through the packed layout (`packing.pack_batch`) and back (numpy): per-token fields `[M, T, ...]`
(routing replay's `routed_experts`), per-sequence results (`unpack_seq`), the packed token count.

`pack_tokens` lays a field out like `packing.pack_batch` lays out `input_ids`: entry `[i, t]` goes where token t
of sequence i went in the packed rows `[n, rows, L, ...]` (with shared prompts, a chunk's prompt entries are those
of the sequence that opened the chunk). `unpack_tokens` is its inverse on the real tokens (0 at padding; a
shared prompt's entries are given to every sequence of its chunk). Both take the plan of `packing.plan_batch`.
"""

from __future__ import annotations

import numpy as np

from jaxrl_post.engine.packing import PackSpec


def pack_tokens(x: np.ndarray, plan, spec: PackSpec) -> np.ndarray:
    """`x [M, T, ...]` (left-padded prompts, right-padded responses, as `input_ids`) -> `[n, rows, L, ...]`,
    0 at padding. `plan`: `packing.plan_batch` of the batch `x` belongs to."""
    x = np.asarray(x)
    place, p_len, r_len = plan
    p = x.shape[1] - spec.response_length
    out = np.zeros((spec.n_micro, spec.rows, spec.row_len) + x.shape[2:], x.dtype)
    for i, (k, row, p_off, r_off, _, _, sub) in enumerate(place):
        pl, rl = int(p_len[i]), int(r_len[i])
        if sub <= 1:  # the sequence that writes the (shared) prompt
            out[k, row, p_off : p_off + pl] = x[i, p - pl : p]
        out[k, row, r_off : r_off + rl] = x[i, p : p + rl]
    return out


def unpack_tokens(packed: np.ndarray, plan, spec: PackSpec, length: int) -> np.ndarray:
    """Inverse of `pack_tokens`: `[n, rows, L, ...]` -> `[M, length, ...]` (`length` = T = P + R), 0 at
    padding."""
    packed = np.asarray(packed)
    place, p_len, r_len = plan
    p = int(length) - spec.response_length
    out = np.zeros((len(place), int(length)) + packed.shape[3:], packed.dtype)
    for i, (k, row, p_off, r_off, _, _, _) in enumerate(place):
        pl, rl = int(p_len[i]), int(r_len[i])
        out[i, p - pl : p] = packed[k, row, p_off : p_off + pl]
        out[i, p : p + rl] = packed[k, row, r_off : r_off + rl]
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
