"""Benchmark (issue 58, "when a device is lent"): the MoE experts' grouped matmuls at Qwen3-30B-A3B expert shapes,
`jax.lax.ragged_dot` against the Pallas megablox `gmm` (TPU) and a dense per-expert batched matmul.

    python scripts/bench_grouped_matmul.py [--tokens 4096,16384] [--reps 10] [--routing uniform,skewed] [--json F]
    python scripts/bench_grouped_matmul.py --tiny    # toy shapes on CPU, megablox in Pallas interpret mode (tests)

One expert MLP (`moe.MoE.experts` without the routing): tokens x k assignments sorted by expert, `x @ gate_e`,
`x @ up_e`, silu-gated, `@ down_e`, bf16 with float32 accumulation, D 2048, E 128 experts of F 768, top-8 (tiny:
D 64, E 8 of F 32, top-2). Per implementation, the forward and the forward + backward (gradients of x and the three
weight stacks), jitted, timed after a warm-up call (median of `--reps`):

- `ragged_dot`: `grouped_matmul(impl='ragged_dot')` (XLA's lowering; any platform);
- `megablox`: `grouped_matmul(impl='megablox')`, the TPU kernel (default tiles `GMM_TILING`); skipped off TPU except
  under --tiny (interpret mode: its time means nothing there);
- `dense_per_expert`: every expert runs a padded block of C rows, C = the largest group (dropless, static per
  routing): `einsum('ECD,EDF->ECF')`; FLOPs `E * C` rows instead of tokens x k.

Routing: `uniform` (k distinct experts per token, uniform) or `skewed` (expert popularity ~ 1 / rank). Reported per
row: time, TFLOP/s and MFU on the active parameters' FLOPs (2 * tokens * k * 3 * D * F forward, 3x that for forward +
backward; the dense path's padding counts as waste, not FLOPs), against the bf16 peak of `accelerator_check.peak_flops`,
and each implementation's largest difference from ragged_dot (forward output and gradients, relative to the largest
ragged_dot value). Prints a table and `RESULT {json}`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(_HERE))
sys.path.insert(0, _HERE)  # accelerator_check

from jaxrl_post.models.grouped_matmul import grouped_matmul  # noqa: E402

QWEN3_30B_A3B = dict(d=2048, f=768, e=128, k=8)
TINY = dict(d=64, f=32, e=8, k=2)
IMPLS = ("ragged_dot", "megablox", "dense_per_expert")


def routing(tokens: int, e: int, k: int, kind: str, seed: int = 0) -> np.ndarray:
    """`[tokens, k]` int32 distinct experts per token: 'uniform', or 'skewed' (popularity ~ 1 / rank)."""
    rng = np.random.default_rng(seed)
    p = np.full(e, 1.0 / e) if kind == "uniform" else (1.0 / np.arange(1, e + 1)) / np.sum(1.0 / np.arange(1, e + 1))
    return np.stack([rng.choice(e, size=k, replace=False, p=p) for _ in range(tokens)]).astype(np.int32)


def expert_mlp(impl: str, sizes, capacity: int, interpret: bool):
    """fn(xs `[M, D]` sorted by expert, gate/up `[E, D, F]`, down `[E, F, D]`) -> `[M, D]` bf16."""
    if impl == "dense_per_expert":
        e = sizes.shape[0]
        starts = jnp.cumsum(sizes) - sizes
        rows = starts[:, None] + jnp.arange(capacity)[None]  # [E, C] rows of each expert's block
        valid = jnp.arange(capacity)[None] < sizes[:, None]

        def fn(xs, gate, up, down):
            blocks = jnp.where(valid[..., None], xs[jnp.minimum(rows, xs.shape[0] - 1)], 0)  # [E, C, D]
            dot = lambda a, w, s: jnp.einsum(s, a, w, preferred_element_type=jnp.float32).astype(a.dtype)
            h = jax.nn.silu(dot(blocks, gate, "ECD,EDF->ECF")) * dot(blocks, up, "ECD,EDF->ECF")
            y = dot(h, down, "ECF,EFD->ECD")
            out = jnp.zeros_like(xs).at[jnp.where(valid, rows, xs.shape[0]).reshape(-1)]
            return out.set(y.reshape(e * capacity, -1), mode="drop")

        return fn

    def fn(xs, gate, up, down):
        gmm = lambda a, w: grouped_matmul(a, w, sizes, impl=impl, interpret=interpret)
        return gmm(jax.nn.silu(gmm(xs, gate)) * gmm(xs, up), down)

    return fn


def _median_time(fn, args, reps: int) -> float:
    jax.block_until_ready(fn(*args))  # compile + warm-up
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def bench(shape: dict, tokens: int, kind: str, reps: int, impls, interpret: bool, peak: float) -> list[dict]:
    d, f, e, k = shape["d"], shape["f"], shape["e"], shape["k"]
    flat = routing(tokens, e, k, kind).reshape(-1)
    order = np.argsort(flat, kind="stable")
    counts = np.bincount(flat, minlength=e)
    sizes = jnp.asarray(counts, jnp.int32)
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.standard_normal((tokens, d)), jnp.bfloat16)
    xs = x[jnp.asarray(order // k)]  # [tokens * k, D] sorted by expert
    w = lambda *s: jnp.asarray(0.02 * rng.standard_normal(s), jnp.bfloat16)
    weights = (w(e, d, f), w(e, d, f), w(e, f, d))
    flops = 2 * tokens * k * 3 * d * f
    rows, ref = [], None
    for impl in impls:
        fn = expert_mlp(impl, sizes, int(counts.max()), interpret)
        fwd = jax.jit(fn)
        loss = lambda *a, fn=fn: jnp.sum(fn(*a).astype(jnp.float32) ** 2)
        bwd = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))
        out = [fwd(xs, *weights), *bwd(xs, *weights)]
        if ref is None:
            ref = out
        diff = max(float(jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32)))) / max(
            float(jnp.max(jnp.abs(b.astype(jnp.float32)))), 1e-30) for a, b in zip(out, ref))  # fmt: skip
        row = dict(impl=impl, tokens=tokens, routing=kind, max_group=int(counts.max()), rel_diff_vs_ragged_dot=diff)
        for name, f_, mult in (("fwd", fwd, 1), ("fwd_bwd", bwd, 3)):
            t = _median_time(f_, (xs, *weights), reps)
            row[f"{name}_ms"] = 1e3 * t
            row[f"{name}_tflops"] = mult * flops / t / 1e12
            row[f"{name}_mfu"] = mult * flops / t / peak
        rows.append(row)
    return rows


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", default="4096,16384", help="tokens per call (each goes to k experts)")
    ap.add_argument("--routing", default="uniform,skewed", help="uniform and/or skewed expert popularity")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--tiny", action="store_true", help="toy shapes on CPU, megablox in interpret mode (tests)")
    ap.add_argument("--json", default=None, help="also write the records here")
    args = ap.parse_args(argv)
    dev = jax.devices()[0]
    tpu = dev.platform == "tpu"
    shape = TINY if args.tiny else QWEN3_30B_A3B
    tokens = [16] if args.tiny else [int(t) for t in args.tokens.split(",")]
    impls = [i for i in IMPLS if i != "megablox" or tpu or args.tiny]
    if args.tiny:
        peak, source = 1e12, "nominal (tiny)"
    else:
        from accelerator_check import peak_flops

        peak, source = peak_flops(dev)
    print(f"device {dev.device_kind} ({dev.platform}); bf16 peak {peak / 1e12:.0f} TFLOP/s ({source}); shape {shape}")
    rows = []
    for n in tokens:
        for kind in args.routing.split(","):
            rows += bench(shape, n, kind, 1 if args.tiny else args.reps, impls, args.tiny, peak)
    head = ("impl", "tokens", "routing", "max_group", "fwd_ms", "fwd_mfu", "fwd_bwd_ms", "fwd_bwd_mfu", "rel_diff")
    print(" ".join(f"{h:>16}" for h in head))
    for r in rows:
        vals = [r["impl"], r["tokens"], r["routing"], r["max_group"], f"{r['fwd_ms']:.3f}", f"{r['fwd_mfu']:.3f}"]
        vals += [f"{r['fwd_bwd_ms']:.3f}", f"{r['fwd_bwd_mfu']:.3f}", f"{r['rel_diff_vs_ragged_dot']:.1e}"]
        print(" ".join(f"{v:>16}" for v in vals))
    result = dict(device=dev.device_kind, platform=dev.platform, peak_bf16=peak, shape=shape, rows=rows)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(result, fh)
    print("RESULT " + json.dumps(result))
    return rows


if __name__ == "__main__":
    main()
