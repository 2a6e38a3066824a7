"""The paged engine's data-parallel replicas, static assignment against the shared waiting queue (issue 56): the
REAL host code (`rollout/paged/admission.ReplicaSchedulers` over one `Scheduler` / `PageAllocator` per replica, the
engine's loop: a prefill dispatch when any replica has prompt work, else `K` decode steps of every replica's slots)
with the model replaced by per-row response lengths (a sequence is done at its `limit`), on a long-tailed workload.

Every dispatch is one SPMD program over all replicas, so a decode dispatch costs the same whatever each replica's
slots hold: decode dispatches measure decode time, and a replica with idle slots (or none running) wastes them.
Reported per system: decode and prefill dispatches, slot utilization (tokens emitted / (decode steps x replicas x
`max_num_seqs`)), decode dispatches after the last admission (tail), busy fraction of the least and most busy
replica (its decode slot-steps with a sequence), preemptions, and stalled decodes: prefill dispatches x replicas
that had running sequences but no prompt work (they wait for the others' prefill; mixed prefill + decode dispatches
would run them).

Workloads (seeded): `iid`, response lengths a lognormal (mean `--mean`, log-sd `--sigma`) capped at `--max-response`;
`grouped`, the same with a per-prompt factor (hard prompts are long for all their `n` samples: log-sd `--sigma`
split evenly between prompt and sample). Prompt lengths uniform in [32, 256].

Usage: python scripts/simulate_replicas.py [--prompts 128] [--n 8] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from jaxrl_post.rollout.paged.admission import ReplicaSchedulers
from jaxrl_post.rollout.paged.scheduler import Seq


def workload(name: str, prompts: int, n: int, *, mean: float, sigma: float, cap: int, seed: int = 0):
    """(prompt lengths `[prompts] int64`, response lengths `[prompts * n] int64`, row `i * n + j`)."""
    rng = np.random.default_rng(seed)
    prompt_lens = rng.integers(32, 257, prompts)
    mu = math.log(mean) - sigma**2 / 2
    if name == "iid":
        logs = rng.normal(mu, sigma, prompts * n)
    elif name == "grouped":
        s = sigma / math.sqrt(2)
        logs = np.repeat(rng.normal(mu, s, prompts), n) + rng.normal(0.0, s, prompts * n)
    else:
        raise ValueError(f"unknown workload {name!r}")
    return prompt_lens, np.clip(np.rint(np.exp(logs)), 1, cap).astype(np.int64)


def simulate(
    prompt_lens,
    lengths,
    n: int,
    *,
    queue: str,
    replicas: int,
    slots: int,
    pages: int,
    page_size: int,
    k: int,
    budget: int,
) -> dict:
    """Run the engine's host loop over the workload; returns the counts (module docstring)."""
    rs = ReplicaSchedulers(
        replicas, pages, page_size, max_num_seqs=slots, max_num_batched_tokens=budget, steps_per_dispatch=k, queue=queue
    )
    rs.add(
        [
            [Seq(row=i * n + j, prompt=np.zeros(p, np.int32), limit=int(lengths[i * n + j])) for j in range(n)]
            for i, p in enumerate(prompt_lens)
        ]
    )
    prefill = decode = emitted = tail = stalled = 0
    while not rs.idle:
        pieces = rs.schedule_prefill()
        if any(pieces):
            for sc, pc in zip(rs.scheds, pieces):
                sc.prefill_done(pc)
            prefill += 1
            stalled += sum(1 for sc, pc in zip(rs.scheds, pieces) if not pc and sc.running)
            continue
        in_tail = not rs.waiting and all(not sc.waiting and not sc.prefilling for sc in rs.scheds)
        for sc, seqs in zip(rs.scheds, rs.schedule_decode()):
            em, done = np.zeros((slots, k), bool), np.zeros(slots, bool)
            for q in seqs:
                m = min(k, q.limit - len(q.tokens))
                em[q.slot, :m], done[q.slot] = True, len(q.tokens) + m >= q.limit
            zeros = np.zeros((slots, k))
            sc.decode_done(seqs, zeros.astype(np.int32), zeros, zeros, em, done)
            emitted += int(em.sum())
        decode += 1
        tail += in_tail
    st = rs.stats()
    assert emitted == int(lengths.sum()) and sum(st["replica_sequences"]) == len(lengths)
    busy = np.asarray(st["replica_busy_slot_steps"]) / (decode * k * slots)
    return dict(
        queue=queue,
        replicas=replicas,
        decode_dispatches=decode,
        prefill_dispatches=prefill,
        slot_utilization=emitted / (decode * k * replicas * slots),
        tail_decode_dispatches=tail,
        replica_busy_min=float(busy.min()),
        replica_busy_max=float(busy.max()),
        preemptions=st["preemptions"],
        stalled_decodes=stalled,
        replica_sequences=st["replica_sequences"],
    )


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=int, default=128)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--mean", type=float, default=300.0)
    ap.add_argument("--sigma", type=float, default=1.0)
    ap.add_argument("--max-response", type=int, default=2048)
    ap.add_argument("--max-num-seqs", type=int, default=32)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--k", type=int, default=16)
    ap.add_argument("--budget", type=int, default=512)
    ap.add_argument("--tight-pages", type=int, default=400, help="a pool short of pages (preemptions), per replica")
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    for name in ("prompts", "n", "max_response", "max_num_seqs", "page_size", "k", "budget"):
        if getattr(a, name) < 1:
            ap.error(f"--{name.replace('_', '-')}: must be >= 1, got {getattr(a, name)}")
    if a.mean <= 0 or a.sigma < 0:
        ap.error(f"--mean must be > 0 and --sigma >= 0, got {a.mean}, {a.sigma}")
    longest = -(-(256 + a.max_response) // a.page_size) + 1  # a 256-token prompt's longest sequence + the null page
    if a.tight_pages < longest:
        ap.error(
            f"--tight-pages: must hold one longest sequence ({longest} pages of {a.page_size}), got {a.tight_pages}"
        )
    ample = a.max_num_seqs * -(-(256 + a.max_response) // a.page_size) + 1  # every slot its longest sequence
    rows = []
    for wl in ("iid", "grouped"):
        prompt_lens, lengths = workload(wl, a.prompts, a.n, mean=a.mean, sigma=a.sigma, cap=a.max_response)
        for pool, pages in (("ample", ample), ("tight", a.tight_pages)):
            for d in (2, 4):
                for queue in ("static", "shared"):
                    r = simulate(
                        prompt_lens,
                        lengths,
                        a.n,
                        queue=queue,
                        replicas=d,
                        slots=a.max_num_seqs,
                        pages=pages,
                        page_size=a.page_size,
                        k=a.k,
                        budget=a.budget,
                    )
                    rows.append(dict(workload=wl, pool=pool, pages=pages, **r))
    print(
        "| workload | pool | replicas | queue | decode dispatches | prefill dispatches | slot utilization | "
        "tail decode dispatches | replica busy (min, max) | preemptions | stalled decodes |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['workload']} | {r['pool']} ({r['pages']}) | {r['replicas']} | {r['queue']} | "
            f"{r['decode_dispatches']} | {r['prefill_dispatches']} | {r['slot_utilization']:.0%} | "
            f"{r['tail_decode_dispatches']} | {r['replica_busy_min']:.0%}, {r['replica_busy_max']:.0%} | "
            f"{r['preemptions']} | {r['stalled_decodes']} |"
        )
    if a.json:
        with open(a.json, "w") as f:
            json.dump(dict(args=vars(a), rows=rows), f, indent=1)
    return rows


if __name__ == "__main__":
    main()
