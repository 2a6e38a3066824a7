"""Host-side page allocator of the paged KV cache: a fixed pool of pages, per-sequence page tables and reference
counts, so the `n` samples of a prompt share the prompt's full pages (vLLM's block manager / prefix sharing).

A sequence's token `i` lives in slot `i % page_size` of page `table[i // page_size]`. Page 0 is the null page:
never handed out, it pads page tables (`page_table`), and the device writes of idle slots land there.
"""

from __future__ import annotations

import dataclasses

import numpy as np

NULL_PAGE = 0


class OutOfPagesError(RuntimeError):
    """Raised when an allocation needs more free pages than the pool has (callers check `can_allocate` first)."""


@dataclasses.dataclass
class _Seq:
    pages: list[int]
    length: int  # tokens held (slots written or reserved)


class PageAllocator:
    """A pool of `num_pages` pages of `page_size` token slots (page 0 reserved as the null page).

    Sequences are keyed by any hashable id. Every page handed out has a reference count: the number of
    sequences whose page table holds it; it returns to the free list when the count drops to 0.

    Raises ValueError: `num_pages < 2` or `page_size < 1`.
    """

    def __init__(self, num_pages: int, page_size: int):
        if num_pages < 2 or page_size < 1:
            raise ValueError(
                f"need num_pages >= 2 (page 0 is the null page) and page_size >= 1, got {num_pages}, {page_size}"
            )
        self.num_pages, self.page_size = int(num_pages), int(page_size)
        self.refcount = np.zeros(self.num_pages, np.int32)
        self._free = list(range(self.num_pages - 1, NULL_PAGE, -1))  # pop() hands out low pages first
        self._seqs: dict = {}

    # ------------------------------------------------------------------ queries
    @property
    def num_free(self) -> int:
        """Pages on the free list."""
        return len(self._free)

    @property
    def num_used(self) -> int:
        """Pages with a reference count > 0."""
        return int(np.count_nonzero(self.refcount))

    def pages_for(self, num_tokens: int) -> int:
        """Pages that hold `num_tokens` tokens: ceil(num_tokens / page_size)."""
        return -(-int(num_tokens) // self.page_size)

    def can_allocate(self, num_pages: int) -> bool:
        return num_pages <= len(self._free)

    def __contains__(self, seq_id) -> bool:
        return seq_id in self._seqs

    def length(self, seq_id) -> int:
        """Tokens held by `seq_id`. Raises KeyError for an unknown id."""
        return self._seqs[seq_id].length

    def pages(self, seq_id) -> list[int]:
        """The page table of `seq_id` (a copy). Raises KeyError for an unknown id."""
        return list(self._seqs[seq_id].pages)

    def page_table(self, seq_ids, max_pages: int) -> np.ndarray:
        """Page tables `[len(seq_ids), max_pages] int32`, padded with the null page; None in `seq_ids` is an idle
        slot (all null). Raises ValueError when a sequence holds more than `max_pages` pages."""
        out = np.full((len(seq_ids), max_pages), NULL_PAGE, np.int32)
        for i, sid in enumerate(seq_ids):
            if sid is None:
                continue
            pages = self._seqs[sid].pages
            if len(pages) > max_pages:
                raise ValueError(f"sequence {sid!r} holds {len(pages)} pages, the page table has {max_pages}")
            out[i, : len(pages)] = pages
        return out

    # ------------------------------------------------------------------ changes
    def _take(self, k: int) -> list[int]:
        if k > len(self._free):
            raise OutOfPagesError(f"need {k} free pages, {len(self._free)} of {self.num_pages - 1} are free")
        got = [self._free.pop() for _ in range(k)]
        self.refcount[got] += 1
        return got

    def _release(self, pages: list[int]) -> None:
        for p in pages:
            if self.refcount[p] <= 0:
                raise RuntimeError(f"page {p} released with reference count {self.refcount[p]} (double free)")
            self.refcount[p] -= 1
            if self.refcount[p] == 0:
                self._free.append(p)

    def allocate(self, seq_id, num_tokens: int) -> list[int]:
        """A new sequence holding `num_tokens` tokens: fresh pages for them. Returns its page table.
        Raises KeyError when `seq_id` exists, OutOfPagesError when the pool is short (nothing changes then)."""
        if seq_id in self._seqs:
            raise KeyError(f"sequence {seq_id!r} already holds pages")
        pages = self._take(self.pages_for(num_tokens))
        self._seqs[seq_id] = _Seq(pages, int(num_tokens))
        return list(pages)

    def context_pages(self, tokens: np.ndarray) -> int:
        """Pages that admitting a context `tokens [T]` (`allocate_context`) takes from the pool: ceil(T / page_size)
        here; fewer with pages shared by content (`prefix_cache.CachingPageAllocator`)."""
        return self.pages_for(len(tokens))

    def allocate_context(self, seq_id, tokens: np.ndarray) -> int:
        """`allocate(seq_id, len(tokens))` for a sequence whose context is `tokens [T]`. Returns the tokens whose
        keys and values its pages already hold: 0 here (`prefix_cache.CachingPageAllocator` reuses pages by
        content). Raises as `allocate`."""
        self.allocate(seq_id, len(tokens))
        return 0

    def drop(self) -> None:
        """Forget pages kept for sharing by content (none here; `prefix_cache.CachingPageAllocator.drop`)."""

    def append(self, seq_id, num_tokens: int = 1) -> list[int]:
        """Grow `seq_id` by `num_tokens` slots, taking new pages past its last one. Returns the new pages.
        Raises OutOfPagesError when the pool is short (nothing changes then)."""
        seq = self._seqs[seq_id]
        new = self._take(self.pages_for(seq.length + num_tokens) - len(seq.pages))
        seq.pages += new
        seq.length += int(num_tokens)
        return new

    def fork(self, parent, child) -> tuple[int, int] | None:
        """`child` starts as a copy of `parent`: it shares every full page of `parent` (reference count + 1), and
        a partly filled last page is copied into a fresh page, as the child writes its own tokens there.
        Returns `(src, dst)`: the page whose contents the device must copy, or None when the last page is full.
        Raises KeyError (unknown parent / existing child), OutOfPagesError (nothing changes then)."""
        if child in self._seqs:
            raise KeyError(f"sequence {child!r} already holds pages")
        seq = self._seqs[parent]
        partial = seq.length % self.page_size != 0
        shared = seq.pages[:-1] if partial else list(seq.pages)
        copy = self._take(1) if partial else []
        self.refcount[shared] += 1
        self._seqs[child] = _Seq(shared + copy, seq.length)
        return (seq.pages[-1], copy[0]) if partial else None

    def truncate(self, seq_id, num_tokens: int) -> None:
        """Shrink `seq_id` to its first `num_tokens` tokens (<= its length): pages past them are released (slots
        reserved for tokens that were never written, e.g. after a multi-turn session's turn ends).
        Raises KeyError for an unknown id, ValueError when `num_tokens` exceeds the length."""
        seq = self._seqs[seq_id]
        if not 0 <= num_tokens <= seq.length:
            raise ValueError(f"cannot truncate sequence {seq_id!r} of {seq.length} tokens to {num_tokens}")
        keep = self.pages_for(num_tokens)
        self._release(seq.pages[keep:])
        seq.pages, seq.length = seq.pages[:keep], int(num_tokens)

    def free(self, seq_id) -> None:
        """Retire `seq_id`: drop its references; pages no one references go back to the free list.
        Raises KeyError for an unknown (or already freed) id."""
        seq = self._seqs.pop(seq_id)
        self._release(seq.pages)

    def check(self) -> None:
        """Assert the invariants (tests): each page's reference count equals the page tables that hold it, the
        free list holds exactly the unreferenced pages once each, the null page is never handed out, and every
        sequence has the pages its length needs. Raises AssertionError."""
        counts = np.zeros(self.num_pages, np.int32)
        for sid, seq in self._seqs.items():
            assert len(seq.pages) == self.pages_for(seq.length), (sid, len(seq.pages), seq.length)
            assert len(set(seq.pages)) == len(seq.pages), (sid, seq.pages)
            np.add.at(counts, seq.pages, 1)
        assert counts[NULL_PAGE] == 0 and self.refcount[NULL_PAGE] == 0, "null page handed out"
        assert np.array_equal(counts, self.refcount), "reference counts differ from page-table references"
        assert len(set(self._free)) == len(self._free), "a page is on the free list twice"
        assert sorted(self._free) == [p for p in range(1, self.num_pages) if counts[p] == 0], "free list != unused"
