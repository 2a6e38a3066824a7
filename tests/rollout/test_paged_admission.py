"""Where the paged engine's data-parallel replicas get their prompt groups (issue 56), host only, no model: the
static assignment against the shared waiting queue on skewed workloads whose dispatch counts, slot-steps and
placements are worked out by hand below; a preempted sequence goes back to the shared queue's front and is
readmitted by the replica that has room; the allocators stay consistent and nothing leaks."""

import numpy as np
import pytest

from jaxrl_post.rollout.paged.admission import ReplicaSchedulers
from jaxrl_post.rollout.paged.scheduler import Seq


def _run(rs: ReplicaSchedulers) -> dict:
    """Drive `rs` as the engine's loop does, the device replaced by: every running sequence emits one token per
    step and is done at its `limit`. Returns dispatch counts, emitted tokens and the replica each row finished on."""
    out = dict(prefill=0, decode=0, emitted=0, finished_on={})
    while not rs.idle:
        pieces = rs.schedule_prefill()
        if any(pieces):
            for sc, pc in zip(rs.scheds, pieces):
                sc.prefill_done(pc)
            out["prefill"] += 1
            continue
        for r, (sc, seqs) in enumerate(zip(rs.scheds, rs.schedule_decode())):
            s, k = sc.max_num_seqs, sc.k
            emitted, done = np.zeros((s, k), bool), np.zeros(s, bool)
            for q in seqs:
                m = min(k, q.limit - len(q.tokens))
                emitted[q.slot, :m], done[q.slot] = True, len(q.tokens) + m >= q.limit
                out["finished_on"].update({q.row: r} if done[q.slot] else {})
            zeros = np.zeros((s, k))
            sc.decode_done(seqs, zeros.astype(np.int32), zeros, zeros, emitted, done)
            sc.alloc.check()
            out["emitted"] += int(emitted.sum())
        out["decode"] += 1
    assert all(sc.alloc.num_free == sc.alloc.num_pages - 1 for sc in rs.scheds)  # nothing leaked
    return out


def _groups(limits, prompt_len=4):
    return [
        [Seq(row=i, prompt=np.arange(3, 3 + prompt_len, dtype=np.int32), limit=lim)] for i, lim in enumerate(limits)
    ]


def _replicas(queue, *, d=2, slots=1, pages=64, k=1):
    return ReplicaSchedulers(
        d, pages, 4, max_num_seqs=slots, max_num_batched_tokens=64, steps_per_dispatch=k, queue=queue
    )


def test_shared_queue_refills_the_replica_that_finishes_early():
    # 2 replicas x 1 slot, K = 1, four prompts (n = 1) of equal length with response lengths 8, 1, 8, 1.
    # Static: by count, ties to index: rows 0, 2 on replica 0 and 1, 3 on replica 1; replica 0 decodes 8 + 8 = 16
    # steps while replica 1 is busy 1 + 1 of them: 16 decode dispatches, 32 slot-steps of which 18 busy.
    # Shared: rows 0 -> r0 and 1 -> r1 (ties to the lowest index); row 1 ends after decode 1, r1 takes row 2
    # (decodes 2-9); row 0 ends after decode 8, r0 takes row 3 (decode 9): 9 decode dispatches, every slot-step busy.
    # Both: 3 prefill dispatches (each admission boundary with a new group), 18 tokens.
    static, shared = _replicas("static"), _replicas("shared")
    static.add(_groups([8, 1, 8, 1]))
    shared.add(_groups([8, 1, 8, 1]))
    a, b = _run(static), _run(shared)
    assert (a["decode"], a["prefill"], a["emitted"]) == (16, 3, 18)
    assert (b["decode"], b["prefill"], b["emitted"]) == (9, 3, 18)
    assert a["finished_on"] == {0: 0, 1: 1, 2: 0, 3: 1} and b["finished_on"] == {0: 0, 1: 1, 2: 1, 3: 0}
    sa, sb = static.stats(), shared.stats()
    assert sa["replica_busy_slot_steps"] == [16, 2] and sa["replica_idle_slot_steps"] == [0, 14]
    assert sb["replica_busy_slot_steps"] == [9, 9] and sb["replica_idle_slot_steps"] == [0, 0]
    assert sa["replica_sequences"] == sb["replica_sequences"] == [2, 2]


def test_shared_queue_spreads_a_small_batch_over_four_replicas():
    # 4 replicas x 4 slots, K = 2, three groups of n = 2 with limits 4, 2, 6: the shared queue gives each group to the
    # replica with the most free slots (all 4, ties to the lowest index: replicas 0, 1, 2), not all to replica 0,
    # which would also have room for two of them; so 3 decode dispatches (limit 6 / K), as the static assignment.
    groups = [
        [Seq(row=2 * i + j, prompt=np.arange(3, 8, dtype=np.int32), limit=lim) for j in range(2)]
        for i, lim in enumerate([4, 2, 6])
    ]
    shared = _replicas("shared", d=4, slots=4, k=2)
    shared.add(groups)
    out = _run(shared)
    assert out["decode"] == 3 and out["prefill"] == 1 and out["emitted"] == 2 * (4 + 2 + 6)
    assert out["finished_on"] == {0: 0, 1: 0, 2: 1, 3: 1, 4: 2, 5: 2}
    st = shared.stats()
    assert st["replica_sequences"] == [2, 2, 2, 0]
    assert st["replica_busy_slot_steps"] == [2 * 2 * 2, 2 * 1 * 2, 3 * 2 * 2, 0]  # dispatches x seqs x K
    assert st["replica_idle_slot_steps"] == [3 * 4 * 2 - 8, 3 * 4 * 2 - 4, 3 * 4 * 2 - 12, 3 * 4 * 2]


@pytest.mark.parametrize(
    "queue, finished_on, decodes", [("shared", {0: 0, 1: 1, 2: 1}, 3), ("static", {0: 0, 1: 1, 2: 0}, 4)]
)
def test_a_preempted_sequence_goes_to_the_replica_with_room(queue, finished_on, decodes):
    # 2 replicas x 2 slots, pools of 4 usable pages of 4 tokens, K = 4, prompts of 4 tokens, limits 12, 4, 8.
    # Admission (both queues): row 0 -> r0, row 1 -> r1 (shared: most free slots), row 2 -> r0 (ties to the lowest
    # index; static: by count). Decode 1: 4 tokens each, row 1 ends. Decode 2: rows 0 and 2 need 3 pages each of
    # r0's 4, so row 2 (the youngest) is preempted with its 4 tokens; row 0 runs on (8 tokens, 3 pages).
    # Shared: row 2 goes to the shared queue's front; r0 has 1 free page for the 3 it needs, r1 (2 free slots,
    # 4 pages) readmits it: its 8-token context is prefilled again and decode 3 finishes rows 0 and 2.
    # Static: it waits on r0 until row 0 ends after decode 3, then decode 4 finishes it.
    rs = _replicas(queue, slots=2, pages=5, k=4)
    rs.add(_groups([12, 4, 8]))
    out = _run(rs)
    assert out["finished_on"] == finished_on and (out["decode"], out["prefill"], out["emitted"]) == (decodes, 2, 24)
    assert rs.stats()["preemptions"] == 1


def test_stop_hands_back_the_shared_queue_once():
    rs = _replicas("shared", slots=1)
    rs.add(_groups([5, 5, 5, 5]))
    for sc, pc in zip(rs.scheds, rs.schedule_prefill()):
        sc.prefill_done(pc)
    assert sorted(s.row for s in rs.stop()) == [0, 1, 2, 3] and rs.idle and not rs.waiting


def test_an_unknown_queue_is_an_error():
    with pytest.raises(ValueError, match="replica queue must be one of"):
        _replicas("stealing")
