"""Continuous-batching scheduler of the paged engine (issue 56), host only: admission by free slots and pages,
chunked prefill within the token budget, forks after the prompt, page reservation for K steps, recompute
preemption of the youngest sequence when the pool is short, retirement, stop and resume; the allocator's
invariants hold after every call and nothing leaks."""

import numpy as np
import pytest

from jaxrl_post.rollout.paged.allocator import PageAllocator
from jaxrl_post.rollout.paged.scheduler import Scheduler, Seq


def _group(first_row, n, prompt_len, limit=8):
    prompt = np.arange(3, 3 + prompt_len, dtype=np.int32)
    return [Seq(row=first_row + j, prompt=prompt, limit=limit) for j in range(n)]


def _decode(sched, eos_after=None):
    """Pretend the device ran K steps: every running sequence emits K tokens (or up to its limit / eos_after)."""
    seqs = sched.schedule_decode()
    sched.alloc.check()
    s, k = sched.max_num_seqs, sched.k
    tokens, emitted, done = np.zeros((s, k), np.int32), np.zeros((s, k), bool), np.zeros(s, bool)
    for q in seqs:
        m = min(k, q.limit - len(q.tokens), (eos_after or 10**9) - len(q.tokens))
        emitted[q.slot, :m] = True
        tokens[q.slot, :m] = 7
        done[q.slot] = m < k or len(q.tokens) + m >= q.limit or len(q.tokens) + m >= (eos_after or 10**9)
    sched.decode_done(seqs, tokens, np.zeros((s, k)), np.zeros((s, k)), emitted, done)
    sched.alloc.check()
    return seqs


def test_admission_chunked_prefill_forks_and_retirement():
    a = PageAllocator(num_pages=64, page_size=4)
    sched = Scheduler(a, max_num_seqs=4, max_num_batched_tokens=8, steps_per_dispatch=4)
    sched.add(_group(0, 3, prompt_len=10))
    sched.add(_group(3, 2, prompt_len=3))
    pieces = sched.schedule_prefill()  # group 2 needs 2 slots, 1 is free: waits
    assert [(p.seq.row, p.start, p.count) for p in pieces] == [(0, 0, 8)] and len(sched.waiting) == 1
    assert sched.prefill_done(pieces) == ([], [])
    pieces = sched.schedule_prefill()
    assert [(p.seq.row, p.start, p.count) for p in pieces] == [(0, 8, 2)]
    complete, copies = sched.prefill_done(pieces)
    assert [[s.row for s in g] for _, g in complete] == [[0, 1, 2]]
    assert len(copies) == 2 and a.pages(1)[:2] == a.pages(0)[:2] and a.pages(1)[2] != a.pages(0)[2]
    a.check()
    _decode(sched)  # 10 + 4 tokens: each sample takes a page of its own
    assert [len(s.tokens) for s in sched.running] == [4, 4, 4]
    seqs = _decode(sched)  # limit 8: all three retire, their slots and pages come back
    assert all(s.done and len(s.tokens) == 8 for s in seqs) and not sched.running
    assert a.num_free == 63 and len(sched.free_slots) == 4
    pieces = sched.schedule_prefill()  # now the waiting group fits
    assert [p.seq.row for p in pieces] == [3]


def test_short_pool_preempts_the_youngest_and_resumes_it():
    a = PageAllocator(num_pages=9, page_size=4)  # 8 usable pages
    sched = Scheduler(a, max_num_seqs=4, max_num_batched_tokens=64, steps_per_dispatch=4)
    for i in range(3):
        sched.add(_group(i, 1, prompt_len=4, limit=12))
    sched.prefill_done(sched.schedule_prefill())
    assert [s.row for s in sched.running] == [0, 1, 2]  # 3 pages + headroom 1 each: all admitted
    _decode(sched)  # 8 tokens each: 6 pages
    _decode(sched)  # 12 each would need 9 pages: the youngest (row 2) is preempted
    assert sched.num_preemptions >= 1 and sched.waiting[0][0].row == 2
    resumed = sched.waiting[0][0]
    assert resumed.slot is None and resumed.prefilled == 0 and len(resumed.tokens) == 4
    while not sched.idle:
        pieces = sched.schedule_prefill()
        if pieces:
            assert all(p.seq.row == 2 and p.count == 8 for p in pieces)  # prompt + its 4 tokens recomputed
            sched.prefill_done(pieces)
        else:
            _decode(sched)
    assert sorted(len(s.tokens) for s in sched.finished) == [12, 12, 12] and a.num_free == 8


def test_stop_hands_back_unfinished_sequences_and_frees_everything():
    a = PageAllocator(num_pages=32, page_size=4)
    sched = Scheduler(a, max_num_seqs=2, max_num_batched_tokens=64, steps_per_dispatch=2)
    sched.add(_group(0, 2, prompt_len=5))
    sched.add(_group(2, 2, prompt_len=5))
    sched.prefill_done(sched.schedule_prefill())
    _decode(sched)
    out = sched.stop()
    assert sorted(s.row for s in out) == [0, 1, 2, 3] and [len(s.tokens) for s in out[:2]] == [2, 2]
    assert a.num_free == 31 and sched.idle and len(sched.free_slots) == 2
    a.check()


def test_admission_keeps_the_forks_of_groups_still_prefilling():
    # 6 usable pages of 4 tokens; prompts of 5 tokens take 2 pages and each fork copies the partly filled last one.
    # Group A (n 3) needs 2 + 3 headroom of 6: admitted, 4 left. Group B (n 2) alone would need 2 + 2 of 4, but A's
    # two forks still need 2 of them: B waits until A is forked (counting only B, both forks ran out of pages).
    a = PageAllocator(num_pages=7, page_size=4)
    sched = Scheduler(a, max_num_seqs=8, max_num_batched_tokens=64, steps_per_dispatch=4)
    sched.add(_group(0, 3, prompt_len=5))
    sched.add(_group(3, 2, prompt_len=5))
    pieces = sched.schedule_prefill()
    assert [p.seq.row for p in pieces] == [0] and len(sched.waiting) == 1
    _, copies = sched.prefill_done(pieces)
    assert len(copies) == 2 and a.num_free == 2
    a.check()


def test_a_pool_too_small_for_one_sequence_is_an_error():
    sched = Scheduler(PageAllocator(4, 4), max_num_seqs=2, max_num_batched_tokens=8, steps_per_dispatch=2)
    with pytest.raises(ValueError, match="needs 4 pages"):
        sched.add(_group(0, 1, prompt_len=8, limit=8))
