"""Paged rollout engine vs the dense `Generator` on this CPU (issue 56): tokens/s of whole `generate` calls.

SmolLM2-135M's shape (`models.presets.smollm2_135m`) with random weights (no download), float32, temperature 1.0,
left-padded random prompts of 16-40 tokens. Engines: `dense` (`Generator`), `paged` (`PagedGenerator`, layers
unrolled: its CPU default; its decode batch follows the running sequences, `cudagraph_capture_sizes` None),
`paged_scan` (layers scanned over stacked params) and `paged_fixed` (unrolled, one decode batch of all
`max_num_seqs` slots: `cudagraph_capture_sizes=(slots,)`, the engine before the decode batch followed the running
sequences). Workloads:

- `equal`: every row runs to `max_new_tokens` (no EOS): the dense engine's best case (no tail, no compaction).
- `tail`: the last `V / mean_len` vocabulary ids are EOS ids, so with near-uniform random logits each step stops a
  row with probability ~1/mean_len: geometric lengths capped at `max_new_tokens` (printed), more sequences than the
  paged engine's slots.
- `few`: `tail`'s lengths for 2 prompts x 8 samples in vLLM's default 256 slots (a fully-async generation batch,
  scripts/compare_async_modes.sh): 16 sequences, most slots idle.

Each engine gets one warm-up call per workload (compile; its time is printed), then the systems alternate
(dense, paged, paged_scan, dense, ...) `--reps` times; tokens/s = response tokens that exist / wall seconds, median
of the reps. `uptime`'s load average is recorded before and after (the machine is shared). The fraction of rows
whose tokens each engine shares with the dense one is reported (1.0 expected: same per-row keys).

Usage: python scripts/bench_paged.py [--workloads equal,tail,few] [--engines dense,paged,paged_fixed] [--reps 2]
       [--json out.json]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import numpy as np

WORKLOADS = {  # prompts, n, max_new_tokens, paged slots, mean length (None: no EOS)
    "equal": dict(prompts=8, n=4, max_new_tokens=48, slots=32, mean_len=None),
    "tail": dict(prompts=12, n=4, max_new_tokens=160, slots=16, mean_len=32),
    "few": dict(prompts=2, n=8, max_new_tokens=64, slots=256, mean_len=32),
}
ENGINES = ("dense", "paged", "paged_scan", "paged_fixed")


def _uptime() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


def _prompts(b: int, vocab: int, seed: int = 0):
    from jaxrl_post.batch.protocol import DataProto

    rng = np.random.default_rng(seed)
    lens = rng.integers(16, 41, b)
    p = int(lens.max())
    ids, mask = np.zeros((b, p), np.int32), np.zeros((b, p), np.int32)
    for i, n in enumerate(lens):
        ids[i, p - n :], mask[i, p - n :] = rng.integers(3, vocab, n), 1
    return DataProto.from_dict({"input_ids": ids, "attention_mask": mask})


def _engines(model, slots: int, names) -> dict:
    """The engines `names` (of `ENGINES`) for `slots` paged slots."""
    from jaxrl_post.rollout import Generator
    from jaxrl_post.rollout.paged.engine import PagedGenerator

    paged = dict(max_num_seqs=slots, max_num_batched_tokens=256, page_size=16, steps_per_dispatch=16)
    make = {
        "dense": lambda: Generator(model),
        "paged": lambda: PagedGenerator(model, **paged, scan_layers=False),
        "paged_scan": lambda: PagedGenerator(model, **paged, scan_layers=True),
        "paged_fixed": lambda: PagedGenerator(model, **paged, scan_layers=False, cudagraph_capture_sizes=(slots,)),
    }
    return {k: make[k]() for k in names}


def run(workloads, reps: int, engine_names=ENGINES) -> dict:
    from jaxrl_post.models import init_model
    from jaxrl_post.models.presets import smollm2_135m
    from jaxrl_post.rollout import SamplingParams

    cfg = dataclasses.replace(smollm2_135m, eos_token_id=None)
    model = init_model(cfg, seed=0)
    v = cfg.vocab_size
    out = {"uptime_before": _uptime(), "model": "smollm2_135m shape, random weights, float32", "workloads": {}}
    for name in workloads:
        w = WORKLOADS[name]
        eos = () if w["mean_len"] is None else tuple(range(v - v // w["mean_len"], v))
        params = SamplingParams(max_new_tokens=w["max_new_tokens"], temperature=1.0, eos_token_ids=eos, pad_token_id=0)
        dp = _prompts(w["prompts"], v - v // 8)  # prompt ids below every EOS id
        engines = _engines(model, w["slots"], engine_names)
        rec = {"config": w, "compile_call_s": {}, "s": {k: [] for k in engines}, "tokens": None}
        for k, eng in engines.items():
            t = time.perf_counter()
            eng.generate(dp, params, n=w["n"])
            rec["compile_call_s"][k] = round(time.perf_counter() - t, 2)
        results = {}
        for _ in range(reps):
            for k, eng in engines.items():
                t = time.perf_counter()
                results[k] = eng.generate(dp, params, n=w["n"])
                rec["s"][k].append(round(time.perf_counter() - t, 3))
        a = results["dense"].batch
        rec["rows_with_equal_tokens"] = {
            k: float(np.mean(np.all(a["responses"] == r.batch["responses"], axis=1))) for k, r in results.items()
        }
        lengths = a["response_attention_mask"].sum(1)
        rec["tokens"] = int(lengths.sum())
        rec["lengths"] = {"mean": float(lengths.mean()), "max": int(lengths.max()), "rows": len(lengths)}
        rec["tokens_per_s"] = {k: round(rec["tokens"] / float(np.median(s)), 1) for k, s in rec["s"].items()}
        rec["over_dense"] = {k: round(v / rec["tokens_per_s"]["dense"], 3) for k, v in rec["tokens_per_s"].items()}
        rec["paged_stats"] = {k: e.last_stats for k, e in engines.items() if k != "dense"}
        rec["dense_stats"] = engines["dense"].last_decode_stats
        out["workloads"][name] = rec
        print(json.dumps({name: {k: rec[k] for k in ("lengths", "tokens_per_s", "compile_call_s", "s")}}), flush=True)
    out["uptime_after"] = _uptime()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workloads", default="equal,tail,few")
    ap.add_argument("--engines", default=",".join(ENGINES), help="dense (always run) and any of the others")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    names = ["dense"] + [e for e in args.engines.split(",") if e and e != "dense"]
    if bad := [e for e in names if e not in ENGINES]:
        sys.exit(f"error: --engines: unknown {bad}; valid: {', '.join(ENGINES)}")
    res = run(args.workloads.split(","), args.reps, names)
    print(f"load: {res['uptime_before']}")
    for name, r in res["workloads"].items():
        print(f"{name}: {r['lengths']['rows']} rows, mean length {r['lengths']['mean']:.1f}, {r['tokens']} tokens")
        print(f"  {'engine':11s} {'tok/s':>7s} {'/ dense':>7s} {'compile + 1st call s':>20s} {'equal rows':>10s}")
        for k, v in r["tokens_per_s"].items():
            eq = r["rows_with_equal_tokens"][k]
            print(f"  {k:11s} {v:7.1f} {r['over_dense'][k]:7.3f} {r['compile_call_s'][k]:20.1f} {eq:10.2f}")
    print(f"load: {res['uptime_after']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1, default=str)


if __name__ == "__main__":
    main()
