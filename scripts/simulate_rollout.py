"""Scheduler simulation of the paged rollout engine against today's dense design, with a bandwidth cost model
(issue 56). One TP group (its share of the batch) is simulated; numbers are per chip.

Paged: the REAL host code (`rollout/paged/scheduler.Scheduler` over `allocator.PageAllocator`, the engine's loop:
a prefill dispatch while sequences wait for their prompt, else `K` decode steps of the slot batch) with the model
replaced by known response lengths: a sequence emits its tokens and finishes at its length (EOS) or at R_max. The
pool holds the pages `plan.rollout_row` gives for `gpu_memory_utilization`.

Dense (today's `Generator` on an accelerator: one cache segment): the rows that fit the same memory at `P + R_max`
slots each (`dense_rows`, down to a power of two: the Generator's batch bucket), in waves; every step reads every
slot of the live batch, which halves (the real `decode.compaction_sizes`) once at most half of it is unfinished
(checked every step: optimistic for dense).

Cost of a decode step = (`step_bytes` + KV bytes read) / HBM bandwidth. `step_bytes` (weights, activations, logits:
everything but the pages) comes from XLA's `cost_analysis()` of the engine's decode program
(`plan.decode_program`, one step at the engine's slot count) compiled abstractly at 1 and 2 layers of the real
shapes, extrapolated linearly to all layers (`step_bytes_from_compile`: compiled in float32, weights counted at
bf16); a step of a smaller batch (the engine's padded decode batch, `dispatch.decode_batch_sizes`; the dense
engine's compacted rows) moves the weights once and the rest in proportion to its rows (`Cost.decode_bytes`).
KV read: paged, every scheduled slot reads `ceil(kv_len / page_size)` pages per step (the kernel's pages; a slot
that finished inside a dispatch keeps reading until it ends, a padding entry of the decode batch reads the null
page); dense, `size x (P + R_max)` slots. A prefill dispatch costs max(weights / bandwidth, 2 x params x tokens /
peak FLOP/s). No host time per dispatch unless `--host-ms`.

Bandwidth bound: the pool full of sequences at the distribution's token-weighted mean context (at most
`max_num_seqs`), every step's bytes at HBM bandwidth, no prefill and no tail.

Usage: python scripts/simulate_rollout.py [--plans 7b_v5p64,7b_8xh100] [--lengths FILE.json or DIR] [--lengths-max R]
       [--json out.json]
"""

from __future__ import annotations

if __name__ == "__main__":  # before jax is imported (only the cost model compiles, on the host)
    import os

    os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse
import dataclasses
import functools
import inspect
import json
import math
import os
import pathlib
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from jaxrl_post.models import get_preset
from jaxrl_post.rollout.decode import compaction_sizes
from jaxrl_post.rollout.paged import plan
from jaxrl_post.rollout.paged.allocator import PageAllocator
from jaxrl_post.rollout.paged.dispatch import decode_batch_sizes, padded_batch_size
from jaxrl_post.rollout.paged.scheduler import Scheduler, Seq

PEAK_FLOPS = {"v5p": 459e12, "h100": 989e12, "h200": 989e12}  # dense bf16 per chip


@dataclasses.dataclass(frozen=True)
class Cost:
    """Per chip: non-KV bytes of one decode step, KV bytes per token of context, HBM bandwidth (bytes/s), weights
    bytes and FLOPs per prefill token (2 x params), peak FLOP/s, host seconds per dispatch. `rows` > 0:
    `step_bytes` is at a batch of `rows` rows, and a step of `b` rows moves the weights once plus `b / rows` of the
    rest (activations and logits scale with the rows); 0: every step moves `step_bytes`."""

    step_bytes: float
    kv_token_bytes: float
    bandwidth: float
    weight_bytes: float
    prefill_flops_per_token: float
    peak_flops: float
    host_s: float = 0.0
    rows: int = 0

    def decode_bytes(self, steps: float, row_steps: float) -> float:
        """Non-KV bytes of `steps` decode steps whose batches hold `row_steps` rows in all."""
        if not self.rows:
            return steps * self.step_bytes
        return steps * self.weight_bytes + (self.step_bytes - self.weight_bytes) * row_steps / self.rows

    def prefill_s(self, tokens: int) -> float:
        return max(self.weight_bytes / self.bandwidth, tokens * self.prefill_flops_per_token / self.peak_flops)


def lognormal_lengths(count: int, mean: float, sigma: float, cap: int, seed: int = 0) -> np.ndarray:
    """`[count] int64` response lengths: a lognormal of mean `mean` (before capping) and log-sd `sigma`, rounded,
    clipped to [1, cap]."""
    mu = math.log(mean) - sigma**2 / 2
    x = np.random.default_rng(seed).lognormal(mu, sigma, count)
    return np.clip(np.rint(x), 1, cap).astype(np.int64)


def simulate_paged(prompt_len, lengths, n, *, max_response, num_pages, block_size, max_num_seqs, max_tokens, k, cost):
    """Run the real scheduler over prompts of `prompt_len` tokens with `n` samples each, sample `i` finishing after
    `lengths[i]` tokens (at most `max_response`). Returns a dict of totals (seconds, tokens, dispatches...)."""
    alloc = PageAllocator(num_pages, block_size)
    sched = Scheduler(alloc, max_num_seqs=max_num_seqs, max_num_batched_tokens=max_tokens, steps_per_dispatch=k)
    prompt = np.zeros(prompt_len, np.int32)
    for i in range(len(lengths) // n):
        sched.add([Seq(row=i * n + j, prompt=prompt, limit=max_response) for j in range(n)])
    target = np.minimum(np.asarray(lengths), max_response)
    t = decode_t = tail_t = 0.0
    out = dict(prefill_dispatches=0, decode_dispatches=0, emitted=0, kv_pages_read=0, running_slot_steps=0)
    out.update(tail_decode_steps=0, row_steps=0, tail_row_steps=0)
    while not sched.idle:
        in_tail = not sched.waiting and not sched.prefilling  # every sequence admitted and prefilled
        d = paged_dispatch(sched, target, k=k, cost=cost, max_num_seqs=max_num_seqs, block_size=block_size)
        dt = d["seconds"]
        if d["prefill"]:
            out["prefill_dispatches"] += 1
        else:
            out["decode_dispatches"] += 1
            out["emitted"] += d["emitted"]
            out["kv_pages_read"] += d["kv_pages_read"]
            out["running_slot_steps"] += d["running"] * k
            out["row_steps"] += d["rows"] * k
            out["tail_row_steps"] += d["rows"] * k if in_tail else 0
            decode_t += dt
            out["tail_decode_steps"] += k if in_tail else 0
        t += dt
        tail_t += dt if in_tail else 0.0
    steps = out["decode_dispatches"] * k
    return dict(
        out,
        seconds=t,
        decode_seconds=decode_t,
        tail_seconds=tail_t,
        decode_steps=steps,
        occupancy=out["emitted"] / max(1, steps * max_num_seqs),
        preemptions=sched.num_preemptions,
        tokens_per_s=out["emitted"] / t,
    )


def paged_dispatch(sched, target, *, k, cost, max_num_seqs, block_size) -> dict:
    """One dispatch of the engine's loop on `sched` (a prefill while sequences wait for their prompt, else `k`
    decode steps), the model replaced by `target [rows] int` response lengths (a sequence finishes at its target).
    Returns `{"seconds", "prefill", "emitted", "kv_pages_read", "running", "rows", "seqs"}` (`rows`: the decode
    batch, padding included; `seqs`: those decoded, with `emit` their tokens emitted, for callers that tag
    tokens)."""
    pieces = sched.schedule_prefill()
    if pieces:
        dt = cost.prefill_s(sum(p.count for p in pieces)) + cost.host_s
        sched.prefill_done(pieces)
        return dict(seconds=dt, prefill=True, emitted=0, kv_pages_read=0, running=0, rows=0, seqs=[], emit=[])
    seqs = sched.schedule_decode()
    lens = np.array([s.length for s in seqs])
    emit = np.array([min(k, target[s.row] - len(s.tokens)) for s in seqs])
    pages = sum(int(np.ceil((lens + np.minimum(j, emit) + 1) / block_size).sum()) for j in range(k))
    size = padded_batch_size(decode_batch_sizes(max_num_seqs), len(seqs))  # the engine's decode batch
    pages += (size - len(seqs)) * k  # its padding entries read the null page
    dt = (cost.decode_bytes(k, k * size) + pages * block_size * cost.kv_token_bytes) / cost.bandwidth + cost.host_s
    shape = (max_num_seqs, k)
    emitted = np.zeros(shape, bool)
    done = np.zeros(max_num_seqs, bool)
    for s, e in zip(seqs, emit):
        emitted[s.slot, :e] = True
        done[s.slot] = len(s.tokens) + e >= target[s.row]
    z = np.zeros(shape, np.float32)
    sched.decode_done(seqs, np.zeros(shape, np.int32), z, z, emitted, done)
    return dict(
        seconds=dt, prefill=False, emitted=int(emit.sum()), kv_pages_read=pages, running=len(seqs), rows=size,
        seqs=seqs, emit=[int(e) for e in emit],
    )  # fmt: skip


def retime(result: dict, cost: Cost, other: Cost) -> dict:
    """`simulate_paged`'s result under `other`, a cost with another `step_bytes` (the schedule does not depend on
    the cost: only each decode step's time changes)."""
    r = result
    d = other.decode_bytes(r["decode_steps"], r["row_steps"]) - cost.decode_bytes(r["decode_steps"], r["row_steps"])
    tail = other.decode_bytes(r["tail_decode_steps"], r["tail_row_steps"])
    tail -= cost.decode_bytes(r["tail_decode_steps"], r["tail_row_steps"])
    t = result["seconds"] + d / cost.bandwidth
    return dict(
        result,
        seconds=t,
        decode_seconds=result["decode_seconds"] + d / cost.bandwidth,
        tail_seconds=result["tail_seconds"] + tail / cost.bandwidth,
        tokens_per_s=result["emitted"] / t,
    )


def simulate_dense(prompt_len, lengths, *, max_response, rows, cost, min_rows=8):
    """Waves of `rows` rows (`P + R_max` slots each, one segment), compacted by `compaction_sizes`; returns totals."""
    lengths = np.minimum(np.asarray(lengths), max_response)
    t, steps, tail_t = 0.0, 0, 0.0
    slots = prompt_len + max_response
    for w in range(0, len(lengths), rows):
        wave = np.sort(lengths[w : w + rows])
        t += cost.prefill_s(len(wave) * prompt_len) + cost.host_s
        sizes = list(compaction_sizes(rows, 1, min_rows))
        size = sizes.pop(0)
        for step in range(int(wave[-1])):
            live = len(wave) - np.searchsorted(wave, step, side="right")
            while sizes and live <= sizes[0]:
                size = sizes.pop(0)
            dt = (cost.decode_bytes(1, size) + size * slots * cost.kv_token_bytes) / cost.bandwidth
            t += dt
            steps += 1
            if w + rows >= len(lengths):
                tail_t += dt
    return dict(seconds=t, decode_steps=steps, tail_seconds=tail_t, tokens_per_s=int(lengths.sum()) / t)


def bandwidth_bound(prompt_len, lengths, n, *, pool_tokens, max_num_seqs, block_size, cost):
    """Tokens/s with the pool full at the token-weighted mean context (module docstring)."""
    lengths = np.asarray(lengths, np.float64)
    ctx = prompt_len + (lengths + 1) / 2  # mean context over a sequence's tokens: P + (L + 1) / 2
    read = float((lengths * ctx).sum() / lengths.sum())  # token-weighted mean context read per step
    held = prompt_len / n + read - prompt_len + block_size / 2  # shared prompt pages, half a page of padding
    seqs = min(max_num_seqs, pool_tokens / held)
    return seqs * cost.bandwidth / (cost.decode_bytes(1, seqs) + seqs * read * cost.kv_token_bytes), seqs


def step_bytes_from_compile(cfg, slots: int, tp: int = 1) -> float:
    """Bytes one decode step reads and writes besides the KV pages, at `slots` slots, from XLA's `cost_analysis()`:
    the decode program compiled at 1 and 2 layers of `cfg`'s shapes (a tiny pool and table) and extrapolated to
    `cfg.num_layers`, divided by `tp` (weights and activations split). Compiled in float32 (XLA:CPU runs bf16
    dots on converted float32 copies of the weights, which its `bytes accessed` counts: 2x the bf16 weights at
    256 slots), then the weights counted at bf16: bytes - weights_f32 / 2."""
    return _step_bytes(cfg, slots) / tp


@functools.cache
def _step_bytes(cfg, slots: int) -> float:
    got = []
    for layers in (1, 2):
        c = dataclasses.replace(cfg, num_layers=layers)
        eng = plan.abstract_engine(
            c, "float32", scan_layers=False, max_num_seqs=slots, num_pages=slots + 1, steps_per_dispatch=1,
            max_model_len=16,
        )  # fmt: skip
        ca = plan.decode_program(eng, 8, 8, "float32").compile().cost_analysis()
        got.append(float((ca[0] if isinstance(ca, list) else ca)["bytes accessed"]) - c.num_params() * 2)
    return got[0] + (cfg.num_layers - 1) * (got[1] - got[0])


def run_plan(
    name: str,
    *,
    lengths=None,
    lengths_max=None,
    sigma=1.0,
    max_num_seqs=256,
    k=16,
    max_tokens=2048,
    host_ms=0.0,
    seed=0,
):
    """Simulate one `plan.ROLLOUT_PLANS` entry for its TP group's share of the batch, under two per-step costs:
    `cost_analysis` (XLA:CPU's bytes, `step_bytes_from_compile`: an upper estimate, XLA:CPU fuses less than
    XLA:TPU / XLA:GPU) and `weights` (the bf16 weights and the `[S, V]` float32 logits written and read: the
    floor). Returns one record per cost, per-chip tokens/s."""
    kw = dict(plan.ROLLOUT_PLANS[name])
    cfg = get_preset(kw.pop("preset"))
    row = plan.rollout_row(name, cfg, max_num_seqs=max_num_seqs, **kw)
    p = dict(inspect_defaults(plan.rollout_row), **kw)
    tp, groups, bs = p["tp"], p["chips"] // p["tp"], p["block_size"]
    n, count = p["n"], p["prompts"] * p["n"] // groups
    if lengths is None:
        lengths = lognormal_lengths(count, p["mean_response"], sigma, p["max_response"], seed)
        source = f"lognormal mean {p['mean_response']:g} sigma {sigma:g} capped at {p['max_response']}"
    else:
        lengths = np.resize(stretch_lengths(lengths, lengths_max, p["max_response"]), count)
        source = "logged lengths" + (f" x {p['max_response']}/{lengths_max}" if lengths_max else "")
    dev = plan.DEVICES[p["device"]]
    weights = row["weights_gb"] * 1e9
    floor = weights + 2 * max_num_seqs * cfg.vocab_size * 4 / tp
    costs = {
        name_: Cost(
            step_bytes=sb,
            kv_token_bytes=plan.kv_bytes_per_token(cfg, tp=tp),
            bandwidth=dev.bandwidth,
            weight_bytes=weights,
            prefill_flops_per_token=2 * cfg.num_params() / tp,
            peak_flops=PEAK_FLOPS[p["device"]],
            host_s=host_ms / 1e3,
            rows=max_num_seqs,
        )
        for name_, sb in (("cost_analysis", step_bytes_from_compile(cfg, max_num_seqs, tp)), ("weights", floor))
    }
    pl, first = p["prompt_len"], costs["cost_analysis"]
    paged0 = simulate_paged(
        pl, lengths, n, max_response=p["max_response"], num_pages=row["pages"], block_size=bs,
        max_num_seqs=max_num_seqs, max_tokens=max_tokens, k=k, cost=first,
    )  # fmt: skip
    rows = 1 << (int(row["dense_rows_per_group"]).bit_length() - 1)  # the Generator's power-of-two batch bucket
    out = []
    for cname, cost in costs.items():
        paged = retime(paged0, first, cost)
        dense = simulate_dense(pl, lengths, max_response=p["max_response"], rows=rows, cost=cost)
        bound, bound_seqs = bandwidth_bound(
            pl, lengths, n, pool_tokens=row["pages"] * bs, max_num_seqs=max_num_seqs, block_size=bs, cost=cost
        )
        out.append(
            dict(
                plan=name,
                cost=cname,
                device=row["device"],
                tp=tp,
                sequences_per_group=count,
                lengths=source,
                mean_length=float(np.mean(lengths)),
                max_num_seqs=max_num_seqs,
                pages=row["pages"],
                step_gb=cost.step_bytes / 1e9,
                paged=paged,
                dense=dict(dense, rows=rows),
                bound_tokens_per_s_chip=bound / tp,
                bound_seqs=bound_seqs,
                paged_tokens_per_s_chip=paged["tokens_per_s"] / tp,
                dense_tokens_per_s_chip=dense["tokens_per_s"] / tp,
                paged_vs_bound=paged["tokens_per_s"] / bound,
                paged_vs_dense=paged["tokens_per_s"] / dense["tokens_per_s"],
            )
        )
    return out


def inspect_defaults(fn) -> dict:
    """{parameter: default} of `fn`'s parameters that have one."""
    empty = inspect.Parameter.empty
    return {k: v.default for k, v in inspect.signature(fn).parameters.items() if v.default is not empty}


COLS = (
    ("plan", "{}"),
    ("cost", "{}"),
    ("step_gb", "{:.1f}"),
    ("max_num_seqs", "{}"),
    ("mean_length", "{:.0f}"),
    ("paged_tokens_per_s_chip", "{:.0f}"),
    ("dense_tokens_per_s_chip", "{:.0f}"),
    ("bound_tokens_per_s_chip", "{:.0f}"),
    ("paged_vs_bound", "{:.2f}"),
    ("paged_vs_dense", "{:.2f}"),
)


def table(rows: list[dict]) -> str:
    """Markdown table: tokens/s per chip, occupancy, steps, tail."""
    head = [c for c, _ in COLS] + ["occupancy", "decode steps (paged, dense)", "tail s (paged, dense)", "preempt"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        pg, de = r["paged"], r["dense"]
        cells = [f.format(r[c]) for c, f in COLS] + [
            f"{pg['occupancy']:.2f}",
            f"{pg['decode_steps']}, {de['decode_steps']}",
            f"{pg['tail_seconds']:.1f} of {pg['seconds']:.1f}, {de['tail_seconds']:.1f} of {de['seconds']:.1f}",
            str(pg["preemptions"]),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def read_lengths(path: str) -> list[int]:
    """Response lengths from `path`: a JSON list of ints, a `<step>.jsonl` file `trainer.rollout_data_dir` wrote
    (its rows' `response_length`), or that directory (every `*.jsonl` in it, in name order). Raises ValueError
    when nothing is found."""
    p = pathlib.Path(path)
    files = sorted(p.glob("*.jsonl")) if p.is_dir() else [p]
    if p.suffix == ".json":
        out = [int(x) for x in json.loads(p.read_text())]
    else:
        out = [int(json.loads(line)["response_length"]) for f in files for line in f.read_text().splitlines() if line]
    if not out:
        raise ValueError(f"{path}: no response lengths")
    return out


def stretch_lengths(lengths, lengths_max: int | None, max_response: int) -> np.ndarray:
    """`[N] int64`: logged `lengths` capped at `max_response`; with `lengths_max` (the logged run's R_max) first
    stretched by `max_response / lengths_max`, rounded up (the run's shape at the plan's R_max)."""
    x = np.asarray(lengths, np.float64)
    if lengths_max:
        x = np.ceil(x * max_response / lengths_max)
    return np.minimum(x, max_response).astype(np.int64)


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--plans", default="7b_v5p64,7b_8xh100,32b_v5p64_tp4", help="rollout/paged/plan.ROLLOUT_PLANS")
    ap.add_argument(
        "--lengths",
        default=None,
        help="response lengths of a real run: a JSON list, or trainer.rollout_data_dir's <step>.jsonl files (a file "
        "or the directory) with their response_length (else lognormal)",
    )
    ap.add_argument("--sigma", type=float, default=1.0, help="log-sd of the lognormal lengths")
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--k", type=int, default=16, help="decode steps per dispatch (rollout.num_scheduler_steps)")
    ap.add_argument("--host-ms", type=float, default=0.0, help="host time per dispatch")
    ap.add_argument("--json", default=None)
    ap.add_argument(
        "--lengths-max",
        type=int,
        default=None,
        help="the logged run's data.max_response_length: lengths become fractions of it, scaled to each plan's R_max",
    )
    a = ap.parse_args(argv)
    lengths = None if not a.lengths else read_lengths(a.lengths)
    rows = []
    for name in a.plans.split(","):
        got = run_plan(
            name,
            lengths=lengths,
            lengths_max=a.lengths_max,
            sigma=a.sigma,
            max_num_seqs=a.max_num_seqs,
            k=a.k,
            host_ms=a.host_ms,
        )
        rows += got
        print(json.dumps(got), flush=True)
    print(table(rows))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)
    return rows


if __name__ == "__main__":
    main()
