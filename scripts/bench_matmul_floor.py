"""Benchmark: the matmul floor of one SFT/DPO training step, XLA:CPU (ours) against torch (TRL's), same shapes.

    python scripts/bench_matmul_floor.py [--model-dir DIR] [--tokens 1024] [--row-len 512] [--tokens-per-step 2048]
        [--reps 5] [--threads 2] [--out FILE]

Every matmul of one forward + backward of a Llama decoder over `--tokens` tokens (a micro-batch of rows of
`--row-len`), timed alone in float32 in each framework: per linear layer the forward `x @ W`, the input
gradient `g @ W.T` and the weight gradient `x.T @ g`; the attention core's `q @ k.T` and `p @ v` (dense causal,
all `row_len^2` scores) with their two gradients each; the LM head over all tokens. Each is timed as a plain
row-major product of its shape (the transposed operands of the backward are not modelled). The sum over one step
(`--tokens-per-step`, scaled from the micro-batch) is the time a step cannot go below with that framework's
matmul kernels and no other work at all: a trainer's measured step time minus this floor is its non-matmul
overhead. Prints a table and `RESULT {json}`; the model shape comes from `--model-dir`'s `config.json`
(default: SmolLM2-135M's).
"""

import argparse
import json
import os
import statistics
import time

SMOLLM2_135M = dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                    num_key_value_heads=3, vocab_size=49152)  # fmt: skip


def matmuls(cfg: dict, tokens: int, row_len: int) -> list[tuple[str, int, tuple[int, int, int], int]]:
    """(name, count per micro-batch, (m, k, n), batch) of every matmul in one forward + backward."""
    d, f, L = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    hd = d // cfg["num_attention_heads"]
    kv = cfg["num_key_value_heads"] * hd
    out = []
    for name, n_in, n_out, count in (("q/o", d, d, 2), ("k/v", d, kv, 2), ("gate/up", d, f, 2), ("down", f, d, 1)):
        out += [
            (f"{name} fwd", count * L, (tokens, n_in, n_out), 1),
            (f"{name} dx", count * L, (tokens, n_out, n_in), 1),
            (f"{name} dw", count * L, (n_in, tokens, n_out), 1),
        ]
    heads = (tokens // row_len) * cfg["num_attention_heads"]
    out += [
        ("attn qk fwd", L, (row_len, hd, row_len), heads),
        ("attn pv fwd", L, (row_len, row_len, hd), heads),
        ("attn dq/dk/dv", 3 * L, (row_len, row_len, hd), heads),  # ds k, ds.T q, p.T do
        ("attn dp", L, (row_len, hd, row_len), heads),  # do v.T
        ("lm_head fwd", 1, (tokens, d, cfg["vocab_size"]), 1),
        ("lm_head dx", 1, (tokens, cfg["vocab_size"], d), 1),
        ("lm_head dw", 1, (d, tokens, cfg["vocab_size"]), 1),
    ]
    return out


def _median_s(fn, reps: int) -> float:
    fn()  # compile / warm-up
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def time_jax(m: int, k: int, n: int, b: int, reps: int) -> float:
    import jax
    import jax.numpy as jnp

    lead = (b,) if b > 1 else ()  # a 2-D product for the linears (a [1, m, k] batch takes another XLA path)
    a = jnp.ones((*lead, m, k), jnp.float32) * 0.01
    w = jnp.ones((*lead, k, n), jnp.float32) * 0.01
    f = jax.jit(lambda a, w: jnp.matmul(a, w))
    return _median_s(lambda: f(a, w).block_until_ready(), reps)


def time_torch(m: int, k: int, n: int, b: int, reps: int) -> float:
    import torch

    lead = (b,) if b > 1 else ()
    a = torch.full((*lead, m, k), 0.01)
    w = torch.full((*lead, k, n), 0.01)
    with torch.no_grad():
        return _median_s(lambda: torch.matmul(a, w), reps)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model-dir", default=None, help="HF dir with config.json (default: SmolLM2-135M's shape)")
    ap.add_argument("--tokens", type=int, default=1024, help="tokens per micro-batch")
    ap.add_argument("--row-len", type=int, default=512)
    ap.add_argument("--tokens-per-step", type=int, default=2048)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2, help="torch threads (TRL peers: 2)")
    ap.add_argument("--out", default=None, help="append the JSON line to this file")
    a = ap.parse_args()
    cfg = dict(SMOLLM2_135M)
    if a.model_dir:
        with open(os.path.join(a.model_dir, "config.json")) as fh:
            cfg.update({k: v for k, v in json.load(fh).items() if k in SMOLLM2_135M})
    from jaxrl_post.runtime.platform_defaults import apply_host_defaults

    apply_host_defaults()  # XLA_FLAGS as `python -m jaxrl_post.main` sets them
    import torch

    torch.set_num_threads(a.threads)
    scale = a.tokens_per_step / a.tokens
    rows, tot = [], {"jax": 0.0, "torch": 0.0, "gflop": 0.0}
    for name, count, (m, k, n), b in matmuls(cfg, a.tokens, a.row_len):
        tj, tt = time_jax(m, k, n, b, a.reps), time_torch(m, k, n, b, a.reps)
        gflop = 2 * m * k * n * b / 1e9
        rows.append(dict(name=name, count=count, mkn=[m, k, n], batch=b, gflop=gflop, jax_s=tj, torch_s=tt))
        tot["jax"] += count * tj * scale
        tot["torch"] += count * tt * scale
        tot["gflop"] += count * gflop * scale
    print("| matmul | count | m x k x n (batch) | GFLOP | jax GF/s | torch GF/s |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        m, k, n = r["mkn"]
        print(
            f"| {r['name']} | {r['count']} | {m} x {k} x {n} ({r['batch']}) | {r['gflop']:.2f} | "
            f"{r['gflop'] / r['jax_s']:.0f} | {r['gflop'] / r['torch_s']:.0f} |"
        )
    print(
        f"\nper step of {a.tokens_per_step} tokens: {tot['gflop']:.0f} GFLOP of matmuls; floor jax "
        f"{tot['jax']:.2f} s ({tot['gflop'] / tot['jax']:.0f} GF/s), torch {tot['torch']:.2f} s "
        f"({tot['gflop'] / tot['torch']:.0f} GF/s)"
    )
    res = dict(
        bench="matmul_floor", tokens=a.tokens, row_len=a.row_len, tokens_per_step=a.tokens_per_step,
        threads=a.threads, floor_s={"jax": tot["jax"], "torch": tot["torch"]}, gflop_per_step=tot["gflop"],
        rows=rows,
    )  # fmt: skip
    print("RESULT " + json.dumps(res))
    if a.out:
        with open(a.out, "a") as fh:
            fh.write(json.dumps(res) + "\n")


if __name__ == "__main__":
    main()
