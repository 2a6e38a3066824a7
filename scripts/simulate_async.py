"""Event simulation of the asynchronous-training step timeline (issue 57) on two device sets of equal size.

Driven by the real code: generation runs the paged engine's `Scheduler` over a `PageAllocator`, dispatch by
dispatch (`simulate_rollout.paged_dispatch`, the model replaced by known response lengths), scored groups go
through the real `GroupQueue`, the trainer admits them with the real staleness rule (`staleness.is_fresh`; stale
groups are `GroupQueue.drop`ped) and the producer runs ahead by `AsyncSettings.ahead_chunks`.

Workload: `2 x share` prompts of `n` samples per step, one device set = one device's worth (m data-parallel
replicas per set behave as one: replicas are taken as identical, the slowest replica's tail is not modelled).
Modes:
  sync: colocated. Each of the two devices generates its `share` prompts (the step waits for the slower one),
    then each trains its half: `train_s`.
  one_step_off: device 0 generates, device 1 trains. Batch t + 1 is generated under version t while step t
    trains batch t; the trainer alone trains the whole batch: `2 x train_s` (linear data-parallel scaling).
  fully_async: staleness_threshold 2, trigger_parameter_sync_step 1, partial rollout. The rollout admits a
    group whenever the queue and the groups in flight leave room (capacity `(1 + ahead_chunks)` batches); at a
    weight publication the engine stops at its dispatch boundary (`Scheduler.stop`) and resumes every unfinished
    sequence under the new weights (re-prefilling its context). A group's version is that of its oldest token.

Costs (`simulate_rollout.Cost`): a decode dispatch of K steps costs K x a measured per-step time, plus the pages
it reads at HBM bandwidth (accelerator only), a prefill max(weights / bandwidth, FLOPs / peak). Not modelled:
the weight publication's transfer, reward and old-log-prob time beyond what the measured training figure holds,
host time per dispatch.

Usage: python scripts/simulate_async.py [--platform cpu,h200] [--steps 40] [--json out.json]
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # simulate_rollout, a script beside this one

from simulate_rollout import Cost, lognormal_lengths, paged_dispatch

from jaxrl_post.models import get_preset
from jaxrl_post.rl.async_training.queue import GroupQueue, ScoredGroup
from jaxrl_post.rl.async_training.settings import AsyncSettings
from jaxrl_post.rl.async_training.staleness import STALE, is_fresh
from jaxrl_post.rollout.paged import plan
from jaxrl_post.rollout.paged.allocator import PageAllocator
from jaxrl_post.rollout.paged.scheduler import Scheduler, Seq


@dataclasses.dataclass(frozen=True)
class Workload:
    """Per device set: `share` prompts of `n` samples per device per step (a step trains `2 x share` groups);
    prompts of `prompt_len` tokens; response lengths lognormal(`mean`, `sigma`) capped at `max_response`;
    engine: `max_num_seqs` slots, `k` decode steps per dispatch, pages of `block_size`, `num_pages`;
    `train_s`: seconds one device trains its `share` prompts (a step of the colocated run)."""

    share: int = 8
    n: int = 8
    prompt_len: int = 56
    max_response: int = 128
    mean: float = 34.0
    sigma: float = 1.0
    max_num_seqs: int = 128
    k: int = 8
    block_size: int = 16
    num_pages: int = 4096
    max_tokens: int = 2048
    train_s: float = 30.1
    seed: int = 0

    def lengths(self, group_id: int) -> np.ndarray:
        """`[n] int64` response lengths of group `group_id` (the same in every mode)."""
        return lognormal_lengths(self.n, self.mean, self.sigma, self.max_response, seed=self.seed * 100003 + group_id)


def settings(mode: str, w: Workload) -> AsyncSettings:
    """The real `AsyncSettings` of `mode` (fully_async: staleness 2, publish every step, partial rollout)."""
    one = mode == "one_step_off"
    return AsyncSettings(
        mode=mode, staleness_threshold=1 if one else (0 if mode == "sync" else 2), trigger_parameter_sync_step=1,
        require_batches=1, partial_rollout=mode == "fully_async", partial_rollout_dispatches=0,
        train_batch_size=2 * w.share, n=w.n,
    )  # fmt: skip


class Rollout:
    """One rollout device: the real scheduler, the groups in flight, and each sequence's version (that of its
    first token). `run_dispatch()` advances one dispatch and returns the groups it finished."""

    def __init__(self, w: Workload, cost: Cost):
        self.w, self.cost = w, cost
        self.sched = Scheduler(
            PageAllocator(w.num_pages, w.block_size), max_num_seqs=w.max_num_seqs, max_num_batched_tokens=w.max_tokens,
            steps_per_dispatch=w.k,
        )  # fmt: skip
        self.target: dict[int, int] = {}  # row -> response length
        self.version: dict[int, int] = {}  # row -> version of its first token
        self.left: dict[int, int] = {}  # group id -> unfinished samples
        self.weights = 0  # the version the rollout holds
        self.busy_s = 0.0
        self.swaps = self.resumed = 0

    @property
    def in_flight(self) -> int:
        return len(self.left)

    def add_group(self, gid: int) -> None:
        n, prompt = self.w.n, np.zeros(self.w.prompt_len, np.int32)
        for j, length in enumerate(self.w.lengths(gid)):
            self.target[gid * n + j] = int(length)
        self.sched.add([Seq(row=gid * n + j, prompt=prompt, limit=self.w.max_response) for j in range(n)])
        self.left[gid] = n

    def swap(self, version: int, partial: bool) -> None:
        """Take the weights of `version`; with `partial`, stop at this dispatch boundary and resume every
        unfinished sequence (its context prefilled again under the new weights)."""
        self.weights, self.swaps = version, self.swaps + 1
        if partial:
            stopped = self.sched.stop()
            self.resumed += len(stopped)
            for s in stopped:
                self.sched.add([s])

    def run_dispatch(self) -> tuple[float, list[ScoredGroup]]:
        d = paged_dispatch(
            self.sched, self.target, k=self.w.k, cost=self.cost, max_num_seqs=self.w.max_num_seqs,
            block_size=self.w.block_size,
        )  # fmt: skip
        for s, e in zip(d["seqs"], d["emit"]):
            if e > 0 and len(s.tokens) - e <= 0:  # its first tokens came from this dispatch
                self.version.setdefault(s.row, self.weights)
        done = []
        for s in self.sched.finished:
            self.version.setdefault(s.row, self.weights)
            gid = s.row // self.w.n
            self.left[gid] -= 1
            if self.left[gid] == 0:
                del self.left[gid]
                v = min(self.version[gid * self.w.n + j] for j in range(self.w.n))
                done.append(ScoredGroup(gid, v, {}, {}, {}))
        self.sched.finished.clear()
        self.busy_s += d["seconds"]
        return d["seconds"], sorted(done, key=lambda g: g.group_id)


def generate_alone(w: Workload, cost: Cost, first: int, groups: int, version: int = 0) -> tuple[float, list]:
    """Seconds one device takes to generate groups `first .. first + groups - 1` from an empty engine, and them."""
    ro = Rollout(w, cost)
    ro.weights = version
    for gid in range(first, first + groups):
        ro.add_group(gid)
    got = []
    while not ro.sched.idle:
        got += ro.run_dispatch()[1]
    return ro.busy_s, got


def simulate_sync(w: Workload, cost: Cost, steps: int) -> dict:
    """Colocated: each device generates its `share` prompts, the step waits for the slower one, then both train
    (`train_s`). Idle: a device waiting for the other's generation."""
    b = 2 * w.share
    queue, t, ends, waits, gens = GroupQueue(b), 0.0, [], 0.0, []
    hist: collections.Counter = collections.Counter()
    for step in range(steps):
        times = []
        for dev in range(2):
            secs, got = generate_alone(w, cost, step * b + dev * w.share, w.share, version=step)
            times.append(secs)
            for g in got:
                queue.put(g)
        batch = [queue.get() for _ in range(b)]
        for g in batch:
            if not is_fresh(g.version, step, 0):
                raise AssertionError(f"sync: group {g.group_id} of version {g.version} at step {step}")
            hist[step - g.version] += 1
        queue.mark_trained(batch)
        gens.append(max(times))
        waits += 2 * max(times) - sum(times)
        t += max(times) + w.train_s
        ends.append(t)
    idle = waits / 2 / t
    return _summary("sync", ends, queue, hist, rollout_idle=idle, trainer_idle=idle, generation_s=float(np.mean(gens)),
                    train_s=w.train_s, swaps=steps, resumed=0)  # fmt: skip


def simulate_split(mode: str, w: Workload, cost: Cost, steps: int) -> dict:
    """Device 0 generates, device 1 trains (`2 x train_s` a step). The rollout runs dispatch by dispatch; the
    trainer's events (a step ends: version + 1, published; a step starts: `train_batch_size` fresh groups in the
    queue, stale ones dropped) are taken in time order between dispatches."""
    st = settings(mode, w)
    b, thr, train = st.train_batch_size, st.staleness_threshold, 2 * w.train_s
    cap = (1 + st.ahead_chunks) * b  # groups queued + in flight
    queue, arrivals, ro = GroupQueue(cap), collections.deque(), Rollout(w, cost)
    hist: collections.Counter = collections.Counter()
    version, train_end, train_free, tr, next_gid, ends = 0, None, 0.0, 0.0, 0, []
    while len(ends) < steps:
        while True:  # the trainer's events up to the rollout's clock
            if train_end is not None and train_end <= tr:
                version, train_free, train_end = version + 1, train_end, None
                ends.append(train_free)
                continue
            fresh = [i for i, v in enumerate(queue.peek_versions()) if is_fresh(v, version, thr)]
            if train_end is None and len(fresh) >= b and len(ends) < steps:
                start = max(train_free, arrivals[fresh[b - 1]])
                batch = []
                while len(batch) < b:  # FIFO; a stale group on the way is dropped (groups finish out of order)
                    g = queue.get()
                    arrivals.popleft()
                    if is_fresh(g.version, version, thr):
                        batch.append(g)
                    else:
                        queue.drop(g, STALE)
                hist.update(version - g.version for g in batch)
                queue.mark_trained(batch)
                train_end = start + train
                continue
            break
        if len(ends) == steps:
            break
        if ro.weights < version and st.publishes_after(version) and (st.partial_rollout or ro.sched.idle):
            ro.swap(version, st.partial_rollout)
        if st.partial_rollout:  # streaming: a group whenever the queue and the groups in flight leave room
            while ro.in_flight + len(queue) < cap:
                ro.add_group(next_gid)
                next_gid += 1
        elif ro.sched.idle and ro.weights >= max(0, next_gid // b - 1) and len(queue) + b <= cap:
            for _ in range(b):  # one_step_off: batch j under version j - 1 (batches 0 and 1 under version 0)
                ro.add_group(next_gid)
                next_gid += 1
        if ro.sched.idle:
            if train_end is None:
                raise RuntimeError(f"{mode}: rollout and trainer both wait (queue {len(queue)}, cap {cap})")
            tr = max(tr, train_end)
            continue
        dt, done = ro.run_dispatch()
        tr += dt
        for g in done:
            queue.put(g)
            arrivals.append(tr)
    total = ends[-1]
    return _summary(mode, ends, queue, hist, rollout_idle=1 - min(ro.busy_s, total) / total,
                    trainer_idle=1 - steps * train / total, generation_s=None, train_s=train, swaps=ro.swaps,
                    resumed=ro.resumed)  # fmt: skip


def _summary(mode, ends, queue, hist, **kw) -> dict:
    """Steady-state step time: the mean over the steps after the first two (all steps when fewer than 4)."""
    warm = 2 if len(ends) >= 4 else 0
    step_s = (ends[-1] - (ends[warm - 1] if warm else 0.0)) / (len(ends) - warm)
    return dict(
        mode=mode, step_s=step_s, steps_per_hour=3600 / step_s, steps=len(ends), total_s=ends[-1],
        staleness_hist={int(k): int(v) for k, v in sorted(hist.items())},
        dropped={r: len(ids) for r, ids in queue.dropped.items()}, produced=queue.produced,
        trained=len(queue.trained), queued=len(queue), **kw,
    )  # fmt: skip


def costs(platform: str, w: Workload) -> tuple[Cost, float, str]:
    """`(Cost, train_s, source)` of `platform` for `w` from the measurements in docs/ (module-level constants)."""
    cfg = get_preset("smollm2_135m")
    if platform not in PLATFORMS:
        raise ValueError(f"error: --platform: unknown {platform!r} (one of {', '.join(PLATFORMS)})")
    if platform == "cpu":
        step_s = CPU_GEN_S / CPU_DECODE_STEPS
        cost = Cost(step_bytes=step_s, kv_token_bytes=0.0, bandwidth=1.0, weight_bytes=0.0,
                    prefill_flops_per_token=0.0, peak_flops=1.0)  # fmt: skip
        return cost, CPU_TRAIN_S, CPU_SOURCE
    dev = plan.DEVICES["h200"]
    step_s = H200_ROWS / H200_ROLLOUT_TOKENS_PER_S
    cost = Cost(step_bytes=step_s * dev.bandwidth, kv_token_bytes=plan.kv_bytes_per_token(cfg),
                bandwidth=dev.bandwidth, weight_bytes=2 * cfg.num_params(),
                prefill_flops_per_token=2 * cfg.num_params(), peak_flops=989e12)  # fmt: skip
    if platform == "h200_tokens":
        tokens = w.share * w.n * (w.prompt_len + float(np.mean([w.lengths(g).mean() for g in range(256)])))
        return cost, tokens / H200_UPDATE_TOKENS_PER_S, H200_TOKENS_SOURCE
    return cost, H200_UPDATE_S * H200_TRAIN_SHARE, H200_SOURCE


# docs/performance.md, `scripts/bench_grpo_step.py --steps 3 --micro 4` (SmolLM2-135M float32, 8 prompts x 8,
# <= 128 new tokens): generation 18.5 s (the dense Generator; taken as 128 decode steps), update 30.1 s.
CPU_GEN_S, CPU_DECODE_STEPS, CPU_TRAIN_S = 18.5, 128, 30.1
CPU_SOURCE = "this CPU: decode step 18.5 s / 128 steps, update 30.1 s per 8 prompts x 8 (docs/performance.md)"
# docs/accelerators.md, one H200: SmolLM2-135M shapes, bf16 rollout 69,400 tokens/s at 128 rows (one token per row
# per decode step); packed update 0.316 s for 16 prompts x 8, scaled to a device's 8 prompts x 8 (x 0.5).
H200_ROWS, H200_ROLLOUT_TOKENS_PER_S, H200_UPDATE_S, H200_TRAIN_SHARE = 128, 69400.0, 0.316, 0.5
H200_SOURCE = "H200: decode step 128 / 69,400 tokens/s + KV pages, update 0.316 s x 0.5 (docs/accelerators.md)"
# the same, the update at its measured 106,000 tokens/s on the device's real (prompt + response) tokens instead
H200_UPDATE_TOKENS_PER_S = 106000.0
H200_TOKENS_SOURCE = "H200: as h200, update = a device's prompt + response tokens / 106,000 tokens/s"
PLATFORMS = ("cpu", "h200", "h200_tokens")


def run(platform: str, steps: int, w: Workload | None = None, cost: Cost | None = None) -> dict:
    """All three modes on `platform` (or on `w` and `cost` as given), with the goals of issue 57 checked."""
    source = "given"
    if cost is None:
        w = w or Workload()
        cost, train_s, source = costs(platform, w)
        w = dataclasses.replace(w, train_s=train_s)
    b = 2 * w.share
    gen_split = float(np.mean([generate_alone(w, cost, s * b, b)[0] for s in range(steps)]))
    rows = [simulate_sync(w, cost, steps)] + [
        simulate_split(m, w, cost, steps) for m in ("one_step_off", "fully_async")
    ]
    sync = rows[0]
    for r in rows:
        r["vs_sync"] = r["steps_per_hour"] / sync["steps_per_hour"]
    bound = max(gen_split, 2 * w.train_s)
    return dict(
        platform=platform, source=source, workload=dataclasses.asdict(w), generation_split_s=gen_split,
        train_split_s=2 * w.train_s, modes=rows,
        one_step_off_vs_bound=rows[1]["step_s"] / bound, goal_one_step_off=rows[1]["step_s"] <= 1.1 * bound,
        goal_fully_async=rows[2]["vs_sync"] >= 1.8, fully_async_ceiling=sync["step_s"] / (2 * w.train_s),
    )  # fmt: skip


def table(results: list[dict]) -> str:
    head = ["platform", "mode", "step s", "steps/h", "vs sync", "rollout idle", "trainer idle", "staleness", "dropped"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for res in results:
        for r in res["modes"]:
            cells = [res["platform"], r["mode"], f"{r['step_s']:.3g}", f"{r['steps_per_hour']:.0f}",
                     f"{r['vs_sync']:.2f}", f"{r['rollout_idle']:.0%}", f"{r['trainer_idle']:.0%}",
                     json.dumps(r["staleness_hist"]), str(sum(r["dropped"].values()))]  # fmt: skip
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--platform", default="cpu,h200,h200_tokens", help="cpu, h200, h200_tokens (the measured figures used)"
    )
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--sigma", type=float, default=1.0, help="log-sd of the lognormal response lengths")
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    unknown = [p for p in a.platform.split(",") if p not in PLATFORMS]
    if unknown:
        ap.error(f"--platform: unknown {', '.join(unknown)} (each one of {', '.join(PLATFORMS)})")
    if a.steps < 1 or a.sigma < 0:
        ap.error(f"--steps must be >= 1 and --sigma >= 0, got {a.steps}, {a.sigma}")
    results = [run(p, a.steps, Workload(sigma=a.sigma)) for p in a.platform.split(",")]
    print(table(results))
    for r in results:
        print(
            f"{r['platform']}: {r['source']}; one device generates a step's batch in {r['generation_split_s']:.3g} s,"
            f" trains it in {r['train_split_s']:.3g} s; one_step_off / max(G, T) = {r['one_step_off_vs_bound']:.2f}"
            f" (goal <= 1.1: {r['goal_one_step_off']}); fully_async {r['modes'][2]['vs_sync']:.2f}x sync (goal"
            f" >= 1.8: {r['goal_fully_async']}; ceiling sync step / trainer step {r['fully_async_ceiling']:.2f})"
        )
    if a.json:
        with open(a.json, "w") as f:
            json.dump(results, f, indent=1)
    return results


if __name__ == "__main__":
    main()
