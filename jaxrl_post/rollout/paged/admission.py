"""Which replica runs a waiting prompt group: the host side of the paged engine's data-parallel replicas.

Shared queue (the engine's default, `queue="shared"`): every replica's `Scheduler` reads one waiting queue. At each
admission boundary (before every dispatch) the queue's head group goes to the replica that can take it (a free
slot per sample, its prompt's pages plus headroom: `Scheduler.fits`) with the most free slots, ties to the most
free pages, then the lowest index; this repeats until the head fits no replica (first come, first served, as each
replica's own queue is). An admitted group stays on its replica (its samples share its prompt pages). A replica
that finishes early takes the next group instead of idling through the tail (vLLM's data-parallel engines each keep
their own queue behind a load balancer; SGLang's router balances on queue lengths; here one host loop runs every
replica, so a single queue is exact).

A preempted sequence goes back to the FRONT of the shared queue, not to its replica: recompute preemption frees all
of its pages (`PageAllocator.free`; with prefix caching its prompt's pages stay on its replica only while no one
needs them: they are the first taken when pages run short), so its replica holds little it could reuse, while the
replica that preempted it is, by construction, short of pages.
At the front it is readmitted before any new prompt, by whichever replica has room first.

Static (`queue="static"`, the baseline of `scripts/simulate_replicas.py`): groups are placed before the first
dispatch by `replicas.assign_groups` (count, then prompt tokens) into per-replica queues; preempted sequences wait on
their replica.

Tokens do not depend on the replica that runs a row: sampling keys are `fold_in(fold_in(key, t), row)` of the global
row (`programs.decode`).
"""

from __future__ import annotations

import collections

from jaxrl_post.rollout.paged.allocator import PageAllocator
from jaxrl_post.rollout.paged.prefix_cache import CachingPageAllocator, prefix_cache_stats
from jaxrl_post.rollout.paged.replicas import assign_groups
from jaxrl_post.rollout.paged.scheduler import Piece, Scheduler, Seq

QUEUES = ("shared", "static")


class ReplicaSchedulers:
    """The host `Scheduler`s of `replicas` data-parallel replicas, each over its own `PageAllocator(num_pages,
    page_size)` with `max_num_seqs` slots, and where their waiting groups come from (`queue`: "shared" or
    "static", module docstring). Counts per replica, for `PagedGenerator.last_stats`: decode slot-steps with a
    sequence in the slot (`busy`) and without (`idle`), `K` per slot and decode dispatch. prefix_caching: each
    replica's allocator shares full context pages by content (`prefix_cache.CachingPageAllocator`; a replica's
    cache holds its own pages only). Raises ValueError for another `queue`, and (`add`) for a group no replica's
    pool or slots can hold."""

    def __init__(
        self,
        replicas: int,
        num_pages: int,
        page_size: int,
        *,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        steps_per_dispatch: int,
        queue: str = "shared",
        prefix_caching: bool = False,
    ):
        if queue not in QUEUES:
            raise ValueError(f"replica queue must be one of {QUEUES}, got {queue!r}")
        self.queue = queue
        self.waiting = collections.deque() if queue == "shared" else None
        self.scheds = [
            Scheduler(
                (CachingPageAllocator if prefix_caching else PageAllocator)(num_pages, page_size),
                max_num_seqs=max_num_seqs,
                max_num_batched_tokens=max_num_batched_tokens,
                steps_per_dispatch=steps_per_dispatch,
                waiting=self.waiting,
            )
            for _ in range(replicas)
        ]
        self.busy, self.idle_steps = [0] * replicas, [0] * replicas

    def add(self, groups: list[list[Seq]]) -> None:
        """Queue prompt groups (a prompt's samples, or one resumed sequence each), in order."""
        if self.queue == "shared":
            for g in groups:
                self.scheds[0].add(g)  # checks the group against one replica's pool; queues it on the shared deque
            return
        for g, r in zip(groups, assign_groups([len(g[0].prompt) * len(g) for g in groups], len(self.scheds))):
            self.scheds[r].add(g)

    @property
    def idle(self) -> bool:
        return all(sc.idle for sc in self.scheds)

    def _admit(self) -> None:
        while self.waiting:
            group = self.waiting[0]
            fit = [r for r, sc in enumerate(self.scheds) if sc.fits(group)]
            if not fit:
                return
            best = min(fit, key=lambda r: (-len(self.scheds[r].free_slots), -self.scheds[r].alloc.num_free, r))
            self.scheds[best].admit(self.waiting.popleft())

    def schedule_prefill(self) -> list[list[Piece]]:
        """Admit waiting groups, then each replica's prefill chunk (`Scheduler.schedule_prefill`), by replica."""
        if self.queue == "shared":
            self._admit()
        return [sc.schedule_prefill() for sc in self.scheds]

    def schedule_decode(self) -> list[list[Seq]]:
        """Each replica's running sequences after reserving their next `K` tokens' pages (preempting where short;
        `Scheduler.schedule_decode`), by replica; counts the dispatch's busy and idle slot-steps."""
        out = [sc.schedule_decode() for sc in self.scheds]
        for r, (sc, seqs) in enumerate(zip(self.scheds, out)):
            self.busy[r] += len(seqs) * sc.k
            self.idle_steps[r] += (sc.max_num_seqs - len(seqs)) * sc.k
        return out

    def stop(self) -> list[Seq]:
        """Every unfinished sequence of every replica and of the waiting queue (`Scheduler.stop`), pages freed."""
        return [s for sc in self.scheds for s in sc.stop()]

    def drop_prefix_caches(self) -> None:
        """Every replica forgets its pages shared by content (`CachingPageAllocator.drop`; new weights)."""
        for sc in self.scheds:
            sc.alloc.drop()

    def stats(self) -> dict:
        """`replica_sequences` (sequences finished on each replica), `replica_busy_slot_steps`,
        `replica_idle_slot_steps`, `preemptions` (all replicas), `replica_queue`, and `prefix_cache_stats`."""
        return dict(
            **prefix_cache_stats([sc.alloc for sc in self.scheds]),
            replica_queue=self.queue,
            replica_sequences=[len(sc.finished) for sc in self.scheds],
            replica_busy_slot_steps=list(self.busy),
            replica_idle_slot_steps=list(self.idle_steps),
            preemptions=sum(sc.num_preemptions for sc in self.scheds),
        )
