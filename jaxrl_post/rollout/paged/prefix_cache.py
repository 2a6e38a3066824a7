"""Content-addressed sharing of full prompt pages between sequences of one engine call (vLLM's automatic prefix
caching): prompts that start with the same tokens (a chat template's system prompt, a few-shot preamble) reuse the
pages holding that prefix's keys and values, and prefill only from the first token after them.

Keys: page j of a context is keyed by `sha256(key of page j - 1, its page_size token ids)` (`page_keys`), a hash
chain as vLLM's block hashes, so a key names the whole prefix up to the end of its page, not only the page's own
tokens. Only FULL pages get keys; a context's last, partly filled page is never shared by content (a prompt's `n`
samples still share it by `PageAllocator.fork`, which copies it).

When a page may be shared (`CachingPageAllocator`):

- A sequence admitted with a context (prompt, or prompt + response when a preempted or resumed sequence is
  recomputed) looks its full pages up in order and takes every leading hit (reference count + 1), at most the pages
  inside its first `length - 1` tokens (vLLM's cap: at least one token is prefilled, for the next-token logits);
  its other pages are fresh, and every full page of its context is then registered under its key (a key already
  registered keeps its page).
- A registered page is written by the prefill of the sequence that registered it. A sequence that reuses it is
  admitted after that one, and the scheduler packs prefill chunks first admitted first, a later sequence's piece
  only after every earlier one's remaining context (`Scheduler.schedule_prefill`): so the dispatch that first reads
  a shared page is the one that writes it or a later one, and within a dispatch every layer writes the chunk's
  keys and values into the pool before its attention reads the pool (`forward._attention`), as a piece reads its
  own earlier tokens of the same chunk. No sequence ever writes a shared page: a page is registered only when it is
  full, and a sequence writes at positions past its context only.
- A page no sequence holds any more stays registered and off the free list ("cold", least recently released
  first); fresh pages come from the free list first, then cold pages are evicted (key dropped) oldest first
  (`_take`). `can_allocate` / `num_free` count cold pages as free, so the scheduler preempts a running sequence
  (or a multi-turn session evicts a kept trajectory) only when free and cold pages together are short.
- The keys hold for one set of weights: the allocator lives for one `generate` call (or one multi-turn session)
  and `drop` forgets every key (cold pages go back to the free list), which the engine does when its weights
  version changes (`PagedGenerator.update_weights`) and when a call stops.

Counts (vLLM's `PrefixCacheStats` names): `queries` (context tokens looked up at admission), `hits` (tokens whose
pages were reused), `evictions` (cold pages handed out again).
"""

from __future__ import annotations

import collections
import hashlib

import numpy as np

from jaxrl_post.rollout.paged.allocator import OutOfPagesError, PageAllocator, _Seq

_ROOT = b"jaxrl_post.paged.prefix"


def page_keys(tokens: np.ndarray, page_size: int) -> list[bytes]:
    """Keys of the full pages of `tokens [T] int` (T // page_size of them): key j = sha256(key j - 1, the page's
    token ids as int64 bytes), key -1 a fixed root."""
    toks = np.asarray(tokens, np.int64)
    keys, parent = [], _ROOT
    for j in range(len(toks) // page_size):
        parent = hashlib.sha256(parent + toks[j * page_size : (j + 1) * page_size].tobytes()).digest()
        keys.append(parent)
    return keys


class CachingPageAllocator(PageAllocator):
    """`PageAllocator` whose full context pages are shared by content (module docstring). Raises as it does."""

    def __init__(self, num_pages: int, page_size: int):
        super().__init__(num_pages, page_size)
        self._page_of: dict[bytes, int] = {}  # key -> registered page
        self._key_of: dict[int, bytes] = {}  # registered page -> key
        self._cold: collections.OrderedDict[int, None] = collections.OrderedDict()  # registered, unreferenced
        self.queries = self.hits = self.evictions = 0

    # ------------------------------------------------------------------ pool
    @property
    def num_free(self) -> int:
        """Pages that can be handed out: the free list and the cold registered pages."""
        return len(self._free) + len(self._cold)

    @property
    def num_cached(self) -> int:
        """Registered pages (held by sequences or cold)."""
        return len(self._key_of)

    def can_allocate(self, num_pages: int) -> bool:
        return num_pages <= len(self._free) + len(self._cold)

    def _take(self, k: int) -> list[int]:
        if k > self.num_free:
            raise OutOfPagesError(f"need {k} free pages, {self.num_free} of {self.num_pages - 1} are free")
        got = [self._free.pop() for _ in range(min(k, len(self._free)))]
        while len(got) < k:  # evict the least recently released registered pages
            page, _ = self._cold.popitem(last=False)
            del self._page_of[self._key_of.pop(page)]
            self.evictions += 1
            got.append(page)
        self.refcount[got] += 1
        return got

    def _release(self, pages: list[int]) -> None:
        for p in pages:
            if self.refcount[p] <= 0:
                raise RuntimeError(f"page {p} released with reference count {self.refcount[p]} (double free)")
            self.refcount[p] -= 1
            if self.refcount[p] == 0:
                if p in self._key_of:
                    self._cold[p] = None
                else:
                    self._free.append(p)

    # ------------------------------------------------------------------ contexts
    def _hits(self, keys: list[bytes], length: int) -> list[int]:
        """Registered pages of the leading `keys`, at most the full pages inside the first `length - 1` tokens."""
        out = []
        for key in keys[: max(length - 1, 0) // self.page_size]:
            page = self._page_of.get(key)
            if page is None:
                break
            out.append(page)
        return out

    def context_pages(self, tokens: np.ndarray) -> int:
        """Pages that admitting a context `tokens [T]` takes from the free and cold pages: its fresh pages plus the
        cold pages among its hits."""
        hits = self._hits(page_keys(tokens, self.page_size), len(tokens))
        return self.pages_for(len(tokens)) - len(hits) + sum(p in self._cold for p in hits)

    def allocate_context(self, seq_id, tokens: np.ndarray) -> int:
        """A new sequence holding the context `tokens [T]`: its leading registered pages reused (reference count
        + 1), fresh pages for the rest, every full page registered. Returns the tokens whose keys and values its
        pages already hold (a multiple of page_size; the prefill starts there). Raises KeyError when `seq_id`
        exists, OutOfPagesError when the pool is short (nothing changes then)."""
        if seq_id in self._seqs:
            raise KeyError(f"sequence {seq_id!r} already holds pages")
        n = len(tokens)
        keys = page_keys(tokens, self.page_size)
        hits = self._hits(keys, n)
        need = self.pages_for(n) - len(hits)
        if need + sum(p in self._cold for p in hits) > self.num_free:
            raise OutOfPagesError(f"need {need} free pages, {self.num_free} of {self.num_pages - 1} are free")
        for p in hits:  # held first: `_take` must not evict them
            self._cold.pop(p, None)
        self.refcount[hits] += 1
        fresh = self._take(need)
        pages = hits + fresh
        self._seqs[seq_id] = _Seq(pages, int(n))
        for key, page in zip(keys[len(hits) :], pages[len(hits) :]):
            if key not in self._page_of:
                self._page_of[key], self._key_of[page] = page, key
        self.queries += n
        self.hits += len(hits) * self.page_size
        return len(hits) * self.page_size

    def drop(self) -> None:
        """Forget every key (new weights, or the call is over): cold pages go back to the free list; pages that
        sequences hold stay theirs, no longer shareable."""
        self._free += list(self._cold)
        self._cold.clear()
        self._page_of.clear()
        self._key_of.clear()

    def check(self) -> None:
        """`PageAllocator.check` with cold pages counted as unreferenced, and the key maps one-to-one with every
        cold page registered. Raises AssertionError."""
        counts = np.zeros(self.num_pages, np.int32)
        for sid, seq in self._seqs.items():
            assert len(seq.pages) == self.pages_for(seq.length), (sid, len(seq.pages), seq.length)
            assert len(set(seq.pages)) == len(seq.pages), (sid, seq.pages)
            np.add.at(counts, seq.pages, 1)
        assert counts[0] == 0 and self.refcount[0] == 0, "null page handed out"
        assert np.array_equal(counts, self.refcount), "reference counts differ from page-table references"
        unused = [p for p in range(1, self.num_pages) if counts[p] == 0]
        assert sorted(self._free + list(self._cold)) == unused, "free + cold pages != unused pages"
        assert all(p in self._key_of for p in self._cold), "a cold page without a key"
        assert {self._page_of[k] for k in self._key_of.values()} == set(self._key_of), "key maps differ"


def prefix_cache_stats(allocs: list[PageAllocator]) -> dict:
    """Counts of the replicas' allocators, summed (0 without sharing by content): `prefix_cache_queries`
    (context tokens looked up at admission), `prefix_cache_hits` (tokens not prefilled: their pages were reused;
    vLLM's names), `prefix_cache_evictions` (cold pages handed out again)."""
    get = lambda name: sum(int(getattr(a, name, 0)) for a in allocs)
    return dict(
        prefix_cache_queries=get("queries"), prefix_cache_hits=get("hits"), prefix_cache_evictions=get("evictions")
    )
