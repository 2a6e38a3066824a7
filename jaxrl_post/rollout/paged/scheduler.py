"""Continuous batching on the host: a fixed batch of `max_num_seqs` slots, a prefill token budget
`max_num_batched_tokens` (chunked prefill), pages from a `PageAllocator` (vLLM's scheduler, simplified).

A prompt enters as a group of its `n` samples (one `Seq` each, row ids `i * n + j`). It is admitted when `n` slots
are free and the pool holds its prompt's pages (plus one page per sample of headroom, beyond the headroom of the
groups still prefilling); its first sample's prompt is prefilled (in chunks of the budget), then the other samples
fork it (`PageAllocator.fork`: full prompt pages shared, the partly filled last page copied). Running sequences
decode `K` steps per dispatch; before a dispatch each gets the pages its next `K` tokens need; when the pool runs
short the most recently admitted sequences are preempted (pages freed, re-queued at the front with their tokens so
far -- of the replicas' shared queue when there is one, `admission.py` -- recomputed by a prefill when readmitted,
vLLM's recompute preemption). A sequence retires at its first EOS or after `limit` tokens; its slot and pages go
back at once. The same re-queueing resumes sequences that a caller stopped at a dispatch boundary (`Seq.resumable`).
With an allocator that shares pages by content (`prefix_cache.CachingPageAllocator`) an admitted context's leading
pages may already hold its keys and values; its prefill then starts after them.
"""

from __future__ import annotations

import collections
import dataclasses

import numpy as np

from jaxrl_post.rollout.paged.allocator import PageAllocator


@dataclasses.dataclass
class Seq:
    """One sequence (a sample of a prompt). row: its output row and sampling key id; prompt `[P] int32`; limit:
    response tokens at most; tokens / log_probs / thresholds: its response so far; prefilled: tokens of its
    context (prompt + response) whose keys/values are in the pool; routes: an MoE model's experts of its first
    `sum(len(r) for r in routes)` context tokens, blocks `[n, M, k]` (routing replay, `PagedGenerator`); sample_row:
    its sampling key id when that differs from `row` (a multi-turn session's row among the turn's running rows,
    `session.py`), None: `row`."""

    row: int
    prompt: np.ndarray
    limit: int
    tokens: list = dataclasses.field(default_factory=list)
    log_probs: list = dataclasses.field(default_factory=list)
    thresholds: list = dataclasses.field(default_factory=list)
    prefilled: int = 0
    routes: list = dataclasses.field(default_factory=list)
    slot: int | None = None
    done: bool = False
    sample_row: int | None = None

    @property
    def context(self) -> np.ndarray:
        """Prompt and response tokens `[P + t] int32`."""
        return np.concatenate([self.prompt, np.asarray(self.tokens, np.int32)]).astype(np.int32)

    @property
    def length(self) -> int:
        return len(self.prompt) + len(self.tokens)


@dataclasses.dataclass
class Piece:
    """Prefill work of one dispatch: `count` context tokens of `seq` from position `start`."""

    seq: Seq
    start: int
    count: int


class Scheduler:
    """Host-side continuous-batching state. Raises ValueError when the pool cannot hold one longest sequence."""

    def __init__(
        self,
        alloc: PageAllocator,
        *,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        steps_per_dispatch: int,
        waiting: collections.deque | None = None,
    ):
        """waiting: a queue of groups shared with other replicas' schedulers (`admission.ReplicaSchedulers` admits
        from it; this scheduler then admits nothing itself, and its preempted sequences go to its front); None:
        a queue of its own."""
        self.alloc, self.k = alloc, int(steps_per_dispatch)
        self.max_num_seqs, self.budget = int(max_num_seqs), int(max_num_batched_tokens)
        self.shared = waiting is not None
        # groups; group[0] is prefilled
        self.waiting: collections.deque[list[Seq]] = collections.deque() if waiting is None else waiting
        self.prefilling: list[list[Seq]] = []
        self.running: list[Seq] = []  # admission order (preemption takes the last)
        self.free_slots = list(range(self.max_num_seqs - 1, -1, -1))
        self.finished: list[Seq] = []
        self.num_preemptions = 0

    def add(self, group: list[Seq], front: bool = False) -> None:
        """Queue a group of sequences with equal contexts (a prompt's samples, or one resumed sequence)."""
        need = self.alloc.pages_for(group[0].length + group[0].limit - len(group[0].tokens))
        if need > self.alloc.num_pages - 1 or len(group) > self.max_num_seqs:
            raise ValueError(
                f"a group of {len(group)} sequences of up to {group[0].length + group[0].limit} tokens needs "
                f"{need} pages and {len(group)} slots; the pool has {self.alloc.num_pages - 1} pages and "
                f"{self.max_num_seqs} slots (raise the page budget or max_num_seqs)"
            )
        (self.waiting.appendleft if front else self.waiting.append)(group)

    @property
    def idle(self) -> bool:
        return not (self.waiting or self.prefilling or self.running)

    # ------------------------------------------------------------------ prefill
    def fits(self, group: list[Seq]) -> bool:
        """Whether `group` can be admitted now: a free slot per sequence and its context's pages plus one page of
        headroom per sequence, beyond the headroom of the groups still prefilling (their forks copy a page each)."""
        if len(group) > len(self.free_slots):
            return False
        pages = self.alloc.context_pages(group[0].context) + len(group) + sum(len(g) for g in self.prefilling)
        return self.alloc.can_allocate(pages)

    def admit(self, group: list[Seq]) -> None:
        """Take `group` (taken off a waiting queue by the caller): its context's pages (leading pages shared by
        content are not prefilled again: `prefix_cache.py`), a slot per sequence."""
        done = self.alloc.allocate_context(group[0].row, group[0].context)
        for s in group:
            s.slot, s.prefilled = self.free_slots.pop(), done
        self.prefilling.append(group)

    def _admit(self) -> None:
        while self.waiting and self.fits(self.waiting[0]):
            self.admit(self.waiting.popleft())

    def schedule_prefill(self) -> list[Piece]:
        """Admit waiting groups (from its own queue; a shared queue's are admitted by `ReplicaSchedulers`), then
        pack the prefilling sequences' remaining context tokens into one budget of `max_num_batched_tokens` (at
        most `max_num_seqs` pieces), first admitted first."""
        if not self.shared:
            self._admit()
        pieces, left = [], self.budget
        for group in self.prefilling:
            s = group[0]
            if left == 0 or len(pieces) == self.max_num_seqs:
                break
            count = min(s.length - s.prefilled, left)
            pieces.append(Piece(s, s.prefilled, count))
            left -= count
        return pieces

    def prefill_done(self, pieces: list[Piece]) -> tuple[list[tuple[Seq, list[Seq]]], list[tuple[int, int]]]:
        """Record a prefill dispatch. Returns (groups whose context is now whole, as (prefilled sequence, all
        its samples): their slots take its last logits; (src, dst) page copies the forks need)."""
        complete, copies = [], []
        for piece in pieces:
            piece.seq.prefilled += piece.count
        for group in list(self.prefilling):
            first = group[0]
            if first.prefilled < first.length:
                continue
            self.prefilling.remove(group)
            for s in group[1:]:
                copy = self.alloc.fork(first.row, s.row)
                if copy is not None:
                    copies.append(copy)
                s.prefilled = first.prefilled
            self.running += group
            complete.append((first, group))
        return complete, copies

    # ------------------------------------------------------------------ decode
    def _preempt(self, seq: Seq) -> None:
        self.running.remove(seq)
        self.alloc.free(seq.row)
        self.free_slots.append(seq.slot)
        seq.slot, seq.prefilled = None, 0
        self.add([seq], front=True)
        self.num_preemptions += 1

    def schedule_decode(self) -> list[Seq]:
        """Reserve the pages of the next `K` tokens of every running sequence (capped at its limit), preempting
        the most recently admitted ones while the pool is short. Returns the running sequences."""
        for seq in list(self.running):
            if seq not in self.running:
                continue  # preempted for an older one
            target = min(seq.length + self.k, len(seq.prompt) + seq.limit)
            while not self.alloc.can_allocate(self.alloc.pages_for(target) - len(self.alloc.pages(seq.row))):
                victim = self.running[-1]
                self._preempt(victim)
                if victim is seq:
                    break
            if seq in self.running and self.alloc.length(seq.row) < target:
                self.alloc.append(seq.row, target - self.alloc.length(seq.row))
        return list(self.running)

    def decode_done(self, seqs: list[Seq], tokens, log_probs, thresholds, emitted, done) -> None:
        """Record a decode dispatch: `tokens / log_probs / thresholds / emitted [S, K]` by slot, `done [S] bool`.
        Retires finished sequences (pages and slot freed)."""
        for s in seqs:
            keep = np.asarray(emitted[s.slot], bool)
            s.tokens += [int(x) for x in tokens[s.slot][keep]]
            s.log_probs += [float(x) for x in log_probs[s.slot][keep]]
            s.thresholds += [float(x) for x in thresholds[s.slot][keep]]
            s.prefilled = s.length
            if done[s.slot]:
                s.done = True
                self.running.remove(s)
                self._retire_pages(s)
                self.free_slots.append(s.slot)
                s.slot = None
                self.finished.append(s)

    def _retire_pages(self, seq: Seq) -> None:
        """A finished sequence's pages: freed (a multi-turn session keeps them for the next turn, `session.py`)."""
        self.alloc.free(seq.row)

    def stop(self) -> list[Seq]:
        """Hand back every unfinished sequence (running, prefilling, waiting; their tokens so far) and free their
        pages and slots: at a dispatch boundary, to be resumed later (`add([seq])` each)."""
        out = []
        for s in list(self.running):
            self.running.remove(s)
            self.alloc.free(s.row)
            out.append(s)
        for group in self.prefilling:
            self.alloc.free(group[0].row)
            out += group
        for group in self.waiting:  # a shared queue: the first replica's `stop` hands its groups back
            out += group
        self.prefilling = []
        self.waiting.clear()
        self.alloc.drop()  # the call is over: no page is kept for sharing by content
        self.free_slots = list(range(self.max_num_seqs - 1, -1, -1))
        for s in out:
            s.slot, s.prefilled = None, 0
        return out
