"""Paged rollout engine vs the dense `Generator` on this CPU (issue 56): tokens/s of whole `generate` calls.

SmolLM2-135M's shape (`models.presets.smollm2_135m`) with random weights (no download), float32, temperature 1.0,
left-padded random prompts of 16-40 tokens. Workloads:

- `equal`: every row runs to `max_new_tokens` (no EOS): the dense engine's best case (no tail, no compaction).
- `tail`: the last `V / mean_len` vocabulary ids are EOS ids, so with near-uniform random logits each step stops a
  row with probability ~1/mean_len: geometric lengths capped at `max_new_tokens` (printed), more sequences than the
  paged engine's slots.

Each engine gets one warm-up call per workload (compile; its time is printed), then the systems alternate
(dense, paged, dense, paged, ...) `--reps` times; tokens/s = response tokens that exist / wall seconds, median of
the reps. `uptime`'s load average is recorded before and after (the machine is shared). The fraction of rows
whose tokens the two engines agree on is reported (1.0 expected: same per-row keys).

Usage: python scripts/bench_paged.py [--workloads equal,tail] [--reps 2] [--json out.json]
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
}


def _uptime() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


def _prompts(b: int, vocab: int, seed: int = 0):
    from jaxrl_post.protocol import DataProto

    rng = np.random.default_rng(seed)
    lens = rng.integers(16, 41, b)
    p = int(lens.max())
    ids, mask = np.zeros((b, p), np.int32), np.zeros((b, p), np.int32)
    for i, n in enumerate(lens):
        ids[i, p - n :], mask[i, p - n :] = rng.integers(3, vocab, n), 1
    return DataProto.from_dict({"input_ids": ids, "attention_mask": mask})


def run(workloads, reps: int) -> dict:
    from jaxrl_post.models import init_model
    from jaxrl_post.models.presets import smollm2_135m
    from jaxrl_post.rollout import Generator, SamplingParams
    from jaxrl_post.rollout.paged.engine import PagedGenerator

    cfg = dataclasses.replace(smollm2_135m, eos_token_id=None)
    model = init_model(cfg, seed=0)
    v = cfg.vocab_size
    out = {"uptime_before": _uptime(), "model": "smollm2_135m shape, random weights, float32", "workloads": {}}
    for name in workloads:
        w = WORKLOADS[name]
        eos = () if w["mean_len"] is None else tuple(range(v - v // w["mean_len"], v))
        params = SamplingParams(max_new_tokens=w["max_new_tokens"], temperature=1.0, eos_token_ids=eos, pad_token_id=0)
        dp = _prompts(w["prompts"], v - v // 8)  # prompt ids below every EOS id
        engines = {
            "dense": Generator(model),
            "paged": PagedGenerator(
                model, max_num_seqs=w["slots"], max_num_batched_tokens=256, page_size=16, steps_per_dispatch=16
            ),
        }
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
        a, b = results["dense"].batch, results["paged"].batch
        rec["rows_with_equal_tokens"] = float(np.mean(np.all(a["responses"] == b["responses"], axis=1)))
        lengths = a["response_attention_mask"].sum(1)
        rec["tokens"] = int(lengths.sum())
        rec["lengths"] = {"mean": float(lengths.mean()), "max": int(lengths.max()), "rows": len(lengths)}
        rec["tokens_per_s"] = {k: round(rec["tokens"] / float(np.median(s)), 1) for k, s in rec["s"].items()}
        rec["paged_over_dense"] = round(rec["tokens_per_s"]["paged"] / rec["tokens_per_s"]["dense"], 3)
        rec["paged_stats"] = engines["paged"].last_stats
        rec["dense_stats"] = engines["dense"].last_decode_stats
        out["workloads"][name] = rec
        print(json.dumps({name: {k: rec[k] for k in ("lengths", "tokens_per_s", "compile_call_s", "s")}}), flush=True)
    out["uptime_after"] = _uptime()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workloads", default="equal,tail")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    res = run(args.workloads.split(","), args.reps)
    print(f"load: {res['uptime_before']}")
    print(
        f"{'workload':9s} {'rows':>5s} {'mean len':>8s} {'tokens':>7s} {'dense tok/s':>11s} {'paged tok/s':>11s} "
        f"{'paged/dense':>11s} {'compile+call s (dense, paged)':>30s}"
    )
    for name, r in res["workloads"].items():
        c = r["compile_call_s"]
        print(
            f"{name:9s} {r['lengths']['rows']:5d} {r['lengths']['mean']:8.1f} {r['tokens']:7d} "
            f"{r['tokens_per_s']['dense']:11.1f} {r['tokens_per_s']['paged']:11.1f} {r['paged_over_dense']:11.3f} "
            f"{c['dense']:>14.1f}, {c['paged']:.1f}"
        )
    print(f"load: {res['uptime_after']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1, default=str)


if __name__ == "__main__":
    main()
