"""The one row packer (`engine/row_packer.py`): hand-worked placements, invariants over random lengths, and the
placements of the three packers it replaced (copied below as they were on main at 24f35a8) reproduced exactly
for 500 random cases each: the RL mini-batch packer (`packing.plan_packing`), SFT's per-step first fit
(`sft_step._assign_rows`), DPO's (`dpo_step._place_rows`) and the dataset's best fit (`sft_step.best_fit_decreasing`).
"""

import bisect

import numpy as np
import pytest

from jaxrl_post.engine.packing import PackSpec, plan_packing
from jaxrl_post.engine.row_packer import GroupLimit, pack_rows

N_CASES = 500


# ------------------------------------------------------------------- the replaced packers, as they were (reference)
def old_assign_rows(lengths, n_rows, row_len, pack):  # sft_step._assign_rows
    order = [i for i in range(len(lengths)) if lengths[i] > 0]
    if not pack:
        return [[i] for i in order]
    order.sort(key=lambda i: -lengths[i])
    rows, free = [], []
    for i in order:
        for r, f in enumerate(free):
            if lengths[i] <= f:
                rows[r].append(i)
                free[r] -= lengths[i]
                break
        else:
            rows.append([i])
            free.append(row_len - lengths[i])
    return rows


def old_place_rows(lengths, row_len, pack, per_row):  # dpo_step._place_rows (empty items kept)
    order = list(range(len(lengths)))
    if not pack:
        return [[i] for i in order]
    order.sort(key=lambda i: -lengths[i])
    rows, free = [], []
    for i in order:
        for r, f in enumerate(free):
            if lengths[i] <= f:
                rows[r].append(i)
                free[r] -= lengths[i]
                break
        else:
            rows.append([i])
            free.append(row_len - lengths[i])
    return rows


def old_best_fit_decreasing(lengths, row_len):  # sft_step.best_fit_decreasing
    if lengths and max(lengths) > row_len:
        raise ValueError(f"an example of {max(lengths)} tokens does not fit a row of {row_len}")
    rows, frees, owners = [], [], []
    for i in sorted((i for i in range(len(lengths)) if lengths[i] > 0), key=lambda i: (-lengths[i], i)):
        k = bisect.bisect_left(frees, lengths[i])
        if k == len(frees):
            rows.append([i])
            r, free = len(rows) - 1, row_len - lengths[i]
        else:
            r, free = owners.pop(k), frees.pop(k) - lengths[i]
            rows[r].append(i)
        k = bisect.bisect_right(frees, free)
        frees.insert(k, free)
        owners.insert(k, r)
    return rows


def old_plan_packing(seq_lens, resp_lens, spec):  # packing.plan_packing with _check_shards and _first_slot
    seq_lens, resp_lens = np.asarray(seq_lens, np.int64), np.asarray(resp_lens, np.int64)
    if spec.shards < 1 or spec.rows % spec.shards or spec.slots % spec.shards:
        raise ValueError(f"{spec}: shards must be >= 1 and divide rows and slots (make_pack_spec)")
    n_rows = spec.n_micro * spec.rows
    if np.any(seq_lens > spec.row_len) or np.any(resp_lens > spec.block_slots):
        raise ValueError(f"a sequence is longer than a row ({spec.row_len} tokens) or a block's slots")
    row_used = np.zeros(n_rows, np.int64)
    row_open = np.zeros(n_rows, bool)
    row_micro = np.arange(n_rows) // spec.rows
    row_block = np.arange(n_rows) // spec.block_rows
    slots_used = np.zeros(spec.n_micro * spec.shards, np.int64)
    seqs_used = np.zeros(spec.n_micro, np.int64)
    place = np.zeros((len(seq_lens), 5), np.int64)
    for i in sorted(range(len(seq_lens)), key=lambda j: (-seq_lens[j], j)):
        n, r = seq_lens[i], resp_lens[i]
        row_ok = (slots_used[row_block] + r <= spec.block_slots) & (seqs_used[row_micro] < spec.seqs)
        fits = row_open & (row_used + n <= spec.row_len) & row_ok
        if not fits.any():
            fits = ~row_open & row_ok
            if not fits.any():
                raise ValueError(f"mini-batch of {len(seq_lens)} sequences does not fit {spec}")
        row = int(np.argmax(fits))
        k, b = row_micro[row], row_block[row]
        first = (int(b) % spec.shards) * spec.block_slots + int(slots_used[b])
        place[i] = (k, row % spec.rows, row_used[row], seqs_used[k], first)
        row_open[row] = True
        row_used[row] += n
        slots_used[b] += r
        seqs_used[k] += 1
    return place


# ------------------------------------------------------------------------------------------ random cases
def _lengths(rng, row_len: int, empty: bool) -> list[int]:
    """0 to 40 lengths in [0 or 1, row_len]; every third case from a few values only (many ties)."""
    n = int(rng.integers(0, 41))
    lo = 0 if empty else 1
    if rng.integers(3) == 0:
        return rng.choice(np.arange(lo, row_len + 1), size=min(3, row_len + 1 - lo)).tolist() * (n // 3 + 1)
    return rng.integers(lo, row_len + 1, size=n).tolist()


def _rl_case(rng):
    n_micro, rows = int(rng.integers(1, 5)), int(rng.choice([1, 2, 4]))
    shards = int(rng.choice([s for s in (1, 2, 4) if rows % s == 0]))
    row_len = int(rng.integers(4, 25))
    slots = shards * int(rng.integers(1, 13))
    spec = PackSpec(
        n_micro=n_micro,
        rows=rows,
        row_len=row_len,
        seqs=int(rng.integers(1, 9)),
        slots=slots,
        response_length=slots // shards,
        shards=shards,
    )
    m = int(rng.integers(0, 3 * n_micro * rows + 1))
    seq = rng.integers(1, row_len + 1, size=m)
    resp = np.minimum(rng.integers(0, slots // shards + 1, size=m), seq - 1)
    return seq, resp, spec


def _outcome(fn, *args):
    """("ok", the placement as lists) or ("error", the message)."""
    try:
        out = fn(*args)
    except ValueError as e:
        return ("error", str(e))
    return ("ok", np.asarray(out).tolist())


# ------------------------------------------------------------------------------------------ hand-worked cases
def test_first_fit_decreasing_by_hand():
    # rows of 8, lengths 3 5 4 2: longest first: 5 -> r0 @0, 4 -> r1 @0 (5 + 4 > 8), 3 -> r0 @5, 2 -> r1 @4
    plan = pack_rows([3, 5, 4, 2], 8)
    assert plan.row.tolist() == [0, 0, 1, 1] and plan.offset.tolist() == [5, 0, 0, 4]
    assert plan.order.tolist() == [1, 2, 0, 3] and plan.n_rows == 2
    assert plan.rows() == [[1, 0], [2, 3]]
    # first fit, not best fit (rows of 20): 13 -> r0, 11 -> r1, 8 -> r1 (r0 has 7), 5 -> r0, 3 -> r2, 1 -> r0
    assert pack_rows([3, 11, 8, 13, 5, 1], 20).rows() == [[3, 4, 5], [1, 2], [0]]
    # an empty item is placed (in the first open row, at its end) unless skip_empty: then row -1
    plan = pack_rows([0, 4, 0], 4)
    assert plan.rows() == [[1, 0, 2]] and plan.offset.tolist() == [4, 0, 4]
    plan = pack_rows([0, 4, 0], 4, skip_empty=True)
    assert plan.row.tolist() == [-1, 0, -1] and plan.rows() == [[1]]


def test_best_fit_decreasing_by_hand():
    # rows of 10, lengths 5 3 7 2 6 4 (and an empty one): 7 -> r0 (3 free), 6 -> r1 (4), 5 -> r2 (5), 4 -> r1 (the
    # fullest that fits: 4 free), 3 -> r0 (3 free), 2 -> r2 (5 free: the only one); the empty one is left out
    plan = pack_rows([5, 3, 7, 2, 6, 4, 0], 10, strategy="bfd", skip_empty=True)
    assert plan.rows() == [[2, 1], [4, 5], [0, 3]]
    assert plan.offset.tolist() == [0, 7, 0, 5, 0, 6, 0] and plan.row[6] == -1
    # best fit, not first fit (rows of 20): 13 -> r0 (7 free), 11 -> r1 (9), 8 -> r1 (1), 5 -> r0 (2), 3 -> r2
    # (17), then 1 -> r1 (1 free: the fullest that fits; first fit would take r0)
    assert pack_rows([3, 11, 8, 13, 5, 1], 20, strategy="bfd").rows() == [[3, 4], [1, 2, 5], [0]]
    # equal room: the row that reached it first, not the older row. Rows of 9: 6 -> r0 (3 free), 4 -> r1 (5),
    # 4 -> r1 (1), 2 -> r0 (1: now both have 1, r1 since before), 1 -> r1
    plan = pack_rows([6, 4, 4, 2, 1], 9, strategy="bfd")
    assert plan.rows() == [[0, 3], [1, 2, 4]] and plan.offset.tolist() == [0, 0, 4, 6, 8]


def test_group_limits_by_hand():
    # 4 rows of 8 in groups of 2 rows holding at most 2 items: 1 1 1 1 all fit row 0 by tokens, but group 0 is
    # full after two, so items 2 and 3 open row 2 (the first row of a group with room; row 1 is in group 0)
    plan = pack_rows([1, 1, 1, 1], 8, max_rows=4, limits=(GroupLimit(rows=2, cap=2),))
    assert plan.row.tolist() == [0, 0, 2, 2] and plan.offset.tolist() == [0, 1, 0, 1]
    assert plan.starts[0].tolist() == [0, 1, 0, 1] and plan.rows() == [[0, 1], [], [2, 3], []]
    # a weighted limit per row (groups of 1 row, at most 5 of the weight): lengths 4 3 2, weights 3 3 1
    # -> 4 (w3) -> r0, 3 (w3) -> r0 is full by weight (6 > 5) -> r1, 2 (w1) -> r0 (tokens 6 <= 8, weight 4 <= 5)
    plan = pack_rows([4, 3, 2], 8, max_rows=2, limits=(GroupLimit(rows=1, cap=5, weights=[3, 3, 1]),))
    assert plan.row.tolist() == [0, 1, 0] and plan.offset.tolist() == [0, 0, 4]
    assert plan.starts[0].tolist() == [0, 0, 3]  # weight used in the item's group before it joined


def test_errors():
    with pytest.raises(ValueError, match="an item of 11 tokens does not fit a row of 10"):
        pack_rows([3, 11], 10, strategy="bfd")
    with pytest.raises(ValueError, match="3 items do not fit 2 rows of 4"):
        pack_rows([3, 3, 3], 4, max_rows=2)
    with pytest.raises(ValueError, match="3 items do not fit 2 rows of 4"):
        pack_rows([3, 3, 3], 4, strategy="bfd", max_rows=2)
    with pytest.raises(ValueError, match="strategy='wrapped': must be one of"):
        pack_rows([1], 4, strategy="wrapped")
    with pytest.raises(ValueError, match="group limits need strategy='ffd'"):
        pack_rows([1], 4, strategy="bfd", max_rows=2, limits=(GroupLimit(1, 1),))
    with pytest.raises(ValueError, match="group limits need max_rows"):
        pack_rows([1], 4, limits=(GroupLimit(1, 1),))
    with pytest.raises(ValueError, match="negative length"):
        pack_rows([1, -1], 4)
    with pytest.raises(ValueError, match=r"needs rows >= 1 and weights of the 2 items \(got 1\)"):
        pack_rows([1, 1], 4, max_rows=2, limits=(GroupLimit(1, 9, weights=[1]),))
    with pytest.raises(ValueError, match="needs rows >= 1"):
        pack_rows([1, 1], 4, max_rows=2, limits=(GroupLimit(0, 9),))


# ------------------------------------------------------------------------------------------ invariants
@pytest.mark.parametrize("strategy", ["ffd", "bfd"])
def test_capacity_never_exceeded_every_item_placed_once(strategy):
    rng = np.random.default_rng(1)
    for _ in range(200):
        row_len = int(rng.integers(1, 33))
        lengths = _lengths(rng, row_len, empty=True)
        skip = bool(rng.integers(2))
        plan = pack_rows(lengths, row_len, strategy=strategy, skip_empty=skip)
        rows = plan.rows()
        placed = sorted(i for r in rows for i in r)
        assert placed == [i for i, n in enumerate(lengths) if n > 0 or not skip]  # each placed item once
        assert plan.row.tolist() == [next((r for r, m in enumerate(rows) if i in m), -1) for i in range(len(lengths))]
        for members in rows:
            assert members  # no empty row without max_rows
            assert sum(lengths[i] for i in members) <= row_len
            at = 0
            for i in members:  # offsets: the row's items back to back in placement order
                assert plan.offset[i] == at
                at += lengths[i]
        assert len(rows) >= -(-sum(lengths) // row_len)


def test_group_limits_never_exceeded():
    rng = np.random.default_rng(2)
    fitted = 0
    for _ in range(200):
        seq, resp, spec = _rl_case(rng)
        limits = (GroupLimit(spec.rows, spec.seqs), GroupLimit(spec.block_rows, spec.block_slots, resp))
        try:
            plan = pack_rows(seq, spec.row_len, max_rows=spec.n_micro * spec.rows, limits=limits)
        except ValueError:
            continue
        fitted += 1
        assert np.all(plan.row >= 0) and np.all(plan.row < spec.n_micro * spec.rows)
        assert np.all(np.bincount(plan.row, seq, minlength=1) <= spec.row_len)
        assert np.all(np.bincount(plan.row // spec.rows) <= spec.seqs)
        assert np.all(np.bincount(plan.row // spec.block_rows, resp, minlength=1) <= spec.block_slots)
    assert fitted > 50


# ------------------------------------------------------------------------------------------ == the old packers
def test_first_fit_equals_sft_assign_rows_and_dpo_place_rows():
    rng = np.random.default_rng(3)
    for _ in range(N_CASES):
        row_len = int(rng.integers(1, 65))
        lengths = _lengths(rng, row_len, empty=True)
        assert pack_rows(lengths, row_len, skip_empty=True).rows() == old_assign_rows(lengths, 99, row_len, True)
        assert pack_rows(lengths, row_len).rows() == old_place_rows(lengths, row_len, True, 1)


def test_best_fit_equals_best_fit_decreasing():
    rng = np.random.default_rng(4)
    for _ in range(N_CASES):
        row_len = int(rng.integers(1, 65))
        lengths = _lengths(rng, row_len, empty=True)
        assert pack_rows(lengths, row_len, strategy="bfd", skip_empty=True).rows() == old_best_fit_decreasing(
            lengths, row_len
        )


def test_plan_packing_equals_the_old_rl_packer():
    rng = np.random.default_rng(5)
    fitted = 0
    for _ in range(N_CASES):
        seq, resp, spec = _rl_case(rng)
        old, new = _outcome(old_plan_packing, seq, resp, spec), _outcome(plan_packing, seq, resp, spec)
        assert new == old, (seq.tolist(), resp.tolist(), spec)
        fitted += old[0] == "ok"
    assert N_CASES // 4 < fitted < N_CASES  # both outcomes are exercised
