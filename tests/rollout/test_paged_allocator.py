"""Page allocator of the paged rollout engine (issue 56): random admit / fork / append / retire orders never leak
or double-free a page, reference counts equal page-table references, and every sequence reads back exactly its
own tokens through its page table (a shadow token store checks that forked samples never write a shared page)."""

import random

import numpy as np
import pytest

from jaxrl_post.rollout.paged.allocator import NULL_PAGE, OutOfPagesError, PageAllocator


class _Shadow:
    """Token store `[num_pages, page_size]` written through the allocator's page tables, and each sequence's
    expected tokens: what the device pool would hold."""

    def __init__(self, alloc: PageAllocator):
        self.a, self.store, self.want = alloc, np.full((alloc.num_pages, alloc.page_size), -1), {}

    def write(self, sid, start, tokens):
        pages, ps = self.a.pages(sid), self.a.page_size
        for i, tok in enumerate(tokens, start):
            self.store[pages[i // ps], i % ps] = tok

    def check(self):
        for sid, want in self.want.items():
            table = self.a.page_table([sid], len(self.a.pages(sid)))[0]
            got = self.store[table].reshape(-1)[: len(want)]
            assert list(got) == want, sid


def _random_run(seed: int, steps: int = 400) -> None:
    rng = random.Random(seed)
    a = PageAllocator(num_pages=rng.randint(2, 40), page_size=rng.choice([1, 2, 3, 4, 8]))
    sh, next_id, tok = _Shadow(a), 0, 0
    for _ in range(steps):
        op, live = rng.random(), list(sh.want)
        before = (a.num_free, a.refcount.copy())
        try:
            if op < 0.3 or not live:  # admit a prompt
                n = rng.randint(1, 3 * a.page_size + 1)
                a.allocate(next_id, n)
                sh.want[next_id] = list(range(tok, tok + n))
                sh.write(next_id, 0, sh.want[next_id])
                next_id, tok = next_id + 1, tok + n
            elif op < 0.5:  # a sample of a live sequence
                parent = rng.choice(live)
                copy = a.fork(parent, next_id)
                if copy is not None:
                    sh.store[copy[1]] = sh.store[copy[0]]
                sh.want[next_id] = list(sh.want[parent])
                next_id += 1
            elif op < 0.8:  # decode tokens
                sid, n = rng.choice(live), rng.randint(1, 2 * a.page_size)
                start = a.length(sid)
                a.append(sid, n)
                new = list(range(tok, tok + n))
                sh.want[sid] += new
                sh.write(sid, start, new)
                tok += n
            else:  # retire
                sid = rng.choice(live)
                a.free(sid)
                del sh.want[sid]
        except OutOfPagesError:
            assert a.num_free == before[0] and np.array_equal(a.refcount, before[1]), "a failed call changed state"
        a.check()
        sh.check()
        assert a.num_used + a.num_free == a.num_pages - 1
    for sid in list(sh.want):
        a.free(sid)
    a.check()
    assert a.num_free == a.num_pages - 1 and not a.refcount.any(), "pages leaked"


@pytest.mark.parametrize("seed", range(40))
def test_random_orders_never_leak_or_double_free(seed):
    _random_run(seed)


def test_fork_shares_full_pages_and_copies_the_partial_last_one():
    a = PageAllocator(num_pages=16, page_size=4)
    assert a.allocate("p", 10) == [1, 2, 3]  # pages 1, 2 full, page 3 holds 2 tokens
    assert a.fork("p", "s1") == (3, 4)  # last page copied into a fresh page
    assert a.pages("s1") == [1, 2, 4]
    assert list(a.refcount[:5]) == [0, 2, 2, 1, 1]
    a.allocate("q", 8)
    assert a.fork("q", "t") is None  # whole pages only: nothing to copy
    assert a.pages("t") == a.pages("q") and a.refcount[a.pages("q")].tolist() == [2, 2]
    a.free("p")
    assert list(a.refcount[:5]) == [0, 1, 1, 0, 1] and a.num_free == 16 - 1 - 5
    np.testing.assert_array_equal(a.page_table(["s1", None], 4), [[1, 2, 4, NULL_PAGE], [0, 0, 0, 0]])


def test_truncate_releases_the_pages_past_the_kept_tokens():
    """A multi-turn session's turn ends: the pages reserved past the last written token go back; shared pages keep
    their other holders' references."""
    a = PageAllocator(num_pages=16, page_size=4)
    a.allocate("p", 8)  # pages 1, 2: full, shared by the fork
    a.fork("p", "s")
    a.append("s", 11)  # 19 tokens: pages 1, 2 (shared) + 3, 4, 5
    assert a.pages("s") == [1, 2, 3, 4, 5]
    a.truncate("s", 13)  # 13 tokens need 4 pages: page 5 released
    assert a.pages("s") == [1, 2, 3, 4] and a.length("s") == 13 and a.refcount[5] == 0 and a.num_free == 11
    a.truncate("s", 8)  # back to the shared prompt: its own pages go, the shared ones stay referenced by "p"
    assert a.pages("s") == [1, 2] and a.refcount[1:5].tolist() == [2, 2, 0, 0]
    a.check()
    with pytest.raises(ValueError, match="cannot truncate"):
        a.truncate("s", 9)
    a.free("s")
    a.free("p")
    assert a.num_used == 0
    a.check()


def test_double_free_and_overflow_are_errors():
    a = PageAllocator(num_pages=4, page_size=2)
    a.allocate(0, 5)  # 3 pages: the whole pool
    with pytest.raises(OutOfPagesError):
        a.append(0, 2)
    with pytest.raises(OutOfPagesError):
        a.allocate(1, 1)
    assert a.num_free == 0 and a.length(0) == 5
    a.free(0)
    with pytest.raises(KeyError):
        a.free(0)
    a.allocate(2, 1)
    a.refcount[a.pages(2)[0]] = 0
    with pytest.raises(RuntimeError, match="double free"):
        a.free(2)
