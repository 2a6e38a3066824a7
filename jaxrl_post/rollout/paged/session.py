"""Multi-turn sessions on the paged engine: a trajectory's pages stay in the pool between its turns, and each turn
prefills only what was appended since (prefix caching across turns, as vLLM's and SGLang's prefix caches keep a
finished request's KV and a follow-up request reuses it).

`AgentLoop` (`rollout/agent_loop.py`) drives one `PagedSession` per `generate` call with a `PagedGenerator`
and `enable_prefix_caching=True`, through the interface of the dense `turn_cache.TurnCache`
(`turn(rows, appended, limits, params, seed)`):

- **Turn 1**: every trajectory's prompt. Trajectories with equal prompts (a prompt's `rollout.n` samples) form a
  group: its first sequence's prompt is prefilled once and the others fork its pages (`PageAllocator.fork`), as in
  `PagedGenerator.generate`. Groups are placed on the engine's data-parallel replicas before the first dispatch
  by `replicas.assign_groups` (the engine's `replica_queue="static"`, not its shared queue: a trajectory's kept
  pages tie it to its replica), and a trajectory stays on its replica for every turn, each replica admitting from
  its own queue.
- **A turn ends** for a trajectory at its end-of-turn token or its limit: its slot goes back, its pages stay (the
  reservation past its last token is released, `PageAllocator.truncate`).
- **Turn k > 1**: the tokens the environment appended (observation, template suffix, next assistant header) are
  prefilled, in chunks of `max_num_batched_tokens`, into the trajectory's pages after its kept context, then it
  decodes on with the turn's limit (its remaining budget). A trajectory that no longer runs has its pages freed.
- **A short pool**: before a running sequence is preempted, the pages of trajectories outside a slot (their turn
  ended, or their next turn waits for admission) are evicted, oldest first; an evicted or preempted trajectory's
  whole context is prefilled again when it is admitted next (vLLM's recompute), so the tokens do not change.

Sampling keys equal the dense path's: a turn samples with `jax.random.key(seed)` of the turn's seed, and row j of
the turn's running rows draws step t with `fold_in(fold_in(key, t), j)` (`Seq.sample_row` = j, t the tokens of
this turn), as `Generator.generate` on the running rows and `TurnCache` do; so with a fixed seed the trajectories
equal the dense agent loop's, on any replica and whatever was preempted. The engine's programs are reused as they
are (one prefill chunk and one decode program per engine shape: nothing compiles per turn); the page tables are
`PagedGenerator.table_pages(P, R)` wide for the whole call.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses

import jax
import numpy as np

from jaxrl_post.rollout.paged.allocator import PageAllocator
from jaxrl_post.rollout.paged.prefix_cache import CachingPageAllocator, prefix_cache_stats
from jaxrl_post.rollout.paged.replicas import assign_groups
from jaxrl_post.rollout.paged.scheduler import Scheduler, Seq
from jaxrl_post.rollout.sampling import SamplingParams

__all__ = ["PagedSession"]


class _TurnScheduler(Scheduler):
    """A replica's `Scheduler` whose finished sequences keep their pages (`kept`: trajectory ids outside a slot
    that hold pages, oldest first); a sequence whose id holds pages is admitted onto them (only its new context
    tokens are prefilled); kept pages are evicted before a running sequence is preempted."""

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self.kept: collections.OrderedDict = collections.OrderedDict()
        self.num_evictions = 0

    def _retire_pages(self, seq: Seq) -> None:
        self.alloc.truncate(seq.row, seq.length)  # drop the pages reserved past its last token
        self.kept[seq.row] = None

    def release(self, tid) -> None:
        """Free the pages of trajectory `tid` (it ended), if it holds any."""
        self.kept.pop(tid, None)
        if tid in self.alloc:
            self.alloc.free(tid)

    def _evict(self, pages: int) -> None:
        """Free kept trajectories' pages, oldest first, until `pages` pages are free (cold pages shared by content
        count: they go first, `prefix_cache.py`) or none is left to evict."""
        for tid in list(self.kept):
            if self.alloc.can_allocate(pages):
                return
            self.release(tid)
            self.num_evictions += 1

    def fits(self, group: list[Seq]) -> bool:
        """`Scheduler.fits` for a group whose first sequence may hold its context so far (only its new tokens
        need pages), after evicting kept trajectories (not its own), oldest first, until it fits or none is left.
        The pages are counted again after each eviction: an evicted trajectory's pages that the group would share
        by content turn cold, and then count against the pool (`prefix_cache.py`)."""
        first = group[0]
        if len(group) > len(self.free_slots):
            return False
        while True:
            if first.row in self.alloc:
                new = self.alloc.pages_for(first.length) - len(self.alloc.pages(first.row))
            else:  # its first turn, or evicted / preempted: pages shared by content count
                new = self.alloc.context_pages(first.context)
            if self.alloc.can_allocate(new + len(group) + sum(len(g) for g in self.prefilling)):
                return True
            victim = next((tid for tid in self.kept if tid != first.row), None)
            if victim is None:
                return False
            self.release(victim)
            self.num_evictions += 1

    def admit(self, group: list[Seq]) -> None:
        """`Scheduler.admit`; a first sequence that holds its context so far is admitted onto its pages, and only
        the tokens after them are prefilled."""
        first = group[0]
        if first.row in self.alloc:
            self.kept.pop(first.row, None)
            done = self.alloc.length(first.row)
            self.alloc.append(first.row, first.length - done)
        else:
            done = self.alloc.allocate_context(first.row, first.context)
        for s in group:
            s.slot, s.prefilled = self.free_slots.pop(), done
        self.prefilling.append(group)

    def schedule_decode(self) -> list[Seq]:
        need = 0
        for s in self.running:
            target = min(s.length + self.k, len(s.prompt) + s.limit)
            need += max(0, self.alloc.pages_for(target) - len(self.alloc.pages(s.row)))
        self._evict(need)
        return super().schedule_decode()


class PagedSession:
    """The trajectories of one multi-turn rollout on a `PagedGenerator` (module docstring).

    Args:
      engine: the `PagedGenerator` (its model's current params are read once, here; its sizes are per replica).
      prompt_len: P, the longest prompt (the page tables hold P + R tokens: `engine.table_pages(P, R)`).
      max_new_tokens: R, the response budget over all turns.

    Raises ValueError: `P + R` exceeds the engine's `max_model_len`.
    """

    def __init__(self, engine, prompt_len: int, max_new_tokens: int):
        self.engine = engine
        self.p, self.r = int(prompt_len), int(max_new_tokens)
        self.pps = engine.table_pages(self.p, self.r)
        self.num_pages = engine.num_pages or engine.max_num_seqs * self.pps + 1
        engine.update_weights()
        self.version = engine.weights_version  # pages shared by content hold for these weights only
        alloc = CachingPageAllocator if engine.prefix_caching else PageAllocator
        self.scheds = [
            _TurnScheduler(
                alloc(self.num_pages, engine.page_size),
                max_num_seqs=engine.max_num_seqs,
                max_num_batched_tokens=engine.max_num_batched_tokens,
                steps_per_dispatch=engine.steps_per_dispatch,
            )
            for _ in range(engine.replicas)
        ]
        self.replica_of: dict = {}  # trajectory id -> its replica (while it runs)
        self.assigned = [0] * engine.replicas  # trajectories placed on each replica
        self.context: dict = {}  # trajectory id -> its token ids so far (prompt, responses, observations)
        self.kv = self.logits = None
        self.prefill_tokens = 0  # context tokens prefilled (prompts once per group, appended, recomputed)
        self.stats = {"prefill_dispatches": 0, "decode_dispatches": 0, "decode_slot_steps": 0, "decode_row_steps": 0}
        self.stats["emitted"] = 0

    def _mesh(self):
        mesh = self.engine.mesh
        return contextlib.nullcontext() if mesh is None else jax.set_mesh(mesh)

    def turn(self, rows, appended, limits, params: SamplingParams, seed: int):
        """One turn of the running trajectories (`TurnCache.turn`'s contract).

        Args:
          rows: trajectory ids (hashable) of the running trajectories; row j samples with sampling id j.
          appended: per row, the token ids added since its last turn (the first turn: its prompt); non-empty.
          limits: per row, the most tokens it may generate this turn (>= 1).
          params: `SamplingParams` (max_new_tokens is ignored: `limits` bound the turn).
          seed: the turn's sampling seed.
        Returns: (tokens `[A, n] int32`, exists `[A, n] bool`: up to and including the end-of-turn token, at most
          limits[j] tokens, log_probs `[A, n] float32`) for the A = len(rows) rows, n = max(limits).
        Raises ValueError: no row, an empty `appended`, or a context longer than the page tables.
        """
        if not rows or not all(len(x) for x in appended):
            raise ValueError("PagedSession.turn needs at least one row and appended tokens for every row")
        live = set(rows)
        for tid in [t for t in self.replica_of if t not in live]:  # trajectories that ended: pages freed
            self.scheds[self.replica_of.pop(tid)].release(tid)
            del self.context[tid]
        seqs = []
        for j, (tid, x, lim) in enumerate(zip(rows, appended, limits)):
            ctx = self.context.setdefault(tid, [])
            ctx += [int(i) for i in x]
            if len(ctx) + int(lim) > self.pps * self.engine.page_size:
                raise ValueError(f"row {j}: {len(ctx)} context + {lim} new tokens exceed the page tables")
            seqs.append(Seq(row=tid, prompt=np.asarray(ctx, np.int32), limit=int(lim), sample_row=j))
        self._queue(seqs)
        key = jax.random.key(seed)
        static = dataclasses.replace(params, seed=0, max_new_tokens=1)  # slots carry their limits: one program
        eng, scheds = self.engine, self.scheds
        with self._mesh():
            if self.kv is None:
                self.kv, self.logits = eng.device_state(self.num_pages)
            while not all(sc.idle for sc in scheds):
                if eng.weights_version != self.version:  # new weights: no page computed by the old ones is shared
                    for sc in scheds:
                        sc.alloc.drop()
                    self.version = eng.weights_version
                pieces = [sc.schedule_prefill() for sc in scheds]
                if any(pieces):
                    self.prefill_tokens += sum(pc.count for pcs in pieces for pc in pcs)
                    self.kv, self.logits = eng._prefill(self.kv, self.logits, scheds, pieces, self.pps)
                    self.stats["prefill_dispatches"] += 1
                else:
                    self.kv, self.logits = eng._decode(self.kv, self.logits, self, self.pps, key, static, self.stats)
                    self.stats["decode_dispatches"] += 1
        n = max(int(x) for x in limits)
        tokens = np.full((len(seqs), n), params.pad_token_id, np.int32)
        exists = np.zeros((len(seqs), n), bool)
        logps = np.zeros((len(seqs), n), np.float32)
        for j, s in enumerate(seqs):
            k = len(s.tokens)
            tokens[j, :k], exists[j, :k], logps[j, :k] = s.tokens, True, s.log_probs
            self.context[s.row] += s.tokens
        for sc in scheds:
            sc.finished = []
        return tokens, exists, logps

    def schedule_decode(self) -> list[list[Seq]]:
        """Each replica's running sequences after reserving their next `K` tokens' pages (`PagedGenerator._decode`
        reads `scheds` and this, as `admission.ReplicaSchedulers`')."""
        return [sc.schedule_decode() for sc in self.scheds]

    def _queue(self, seqs: list[Seq]) -> None:
        """Queue the turn's sequences on their replicas, in row order: a continuing trajectory alone on its
        replica; new ones grouped by equal prompts (at most `max_num_seqs` a group), groups spread by
        `assign_groups`."""
        groups: dict[tuple, list[Seq]] = {}
        for s in seqs:
            if s.row not in self.replica_of:
                groups.setdefault(tuple(s.prompt.tolist()), []).append(s)
        cap = self.engine.max_num_seqs
        new = [g[i : i + cap] for g in groups.values() for i in range(0, len(g), cap)]
        where = assign_groups([len(g[0].prompt) * len(g) for g in new], len(self.scheds))
        first_of, members = {}, set()
        for g, rep in zip(new, where):
            first_of[id(g[0])] = g
            for s in g:
                self.replica_of[s.row] = rep
                self.assigned[rep] += 1
                members.add(id(s))
        for s in seqs:
            if id(s) in first_of:
                self.scheds[self.replica_of[s.row]].add(first_of[id(s)])
            elif id(s) not in members:
                self.scheds[self.replica_of[s.row]].add([s])

    def close(self) -> dict:
        """Free every trajectory's pages (the call is over). Returns the session's counts: prefill / decode
        dispatches, decode slot steps, emitted tokens, preemptions, evictions, pages of a replica's pool, the
        trajectories assigned to each replica, and `prefix_cache_stats`."""
        for tid, rep in self.replica_of.items():
            self.scheds[rep].release(tid)
        for sc in self.scheds:
            sc.alloc.drop()
        self.replica_of, self.context = {}, {}
        return dict(
            self.stats,
            **prefix_cache_stats([sc.alloc for sc in self.scheds]),
            preemptions=sum(sc.num_preemptions for sc in self.scheds),
            evictions=sum(sc.num_evictions for sc in self.scheds),
            num_pages=self.num_pages,
            replica_trajectories=list(self.assigned),
        )
