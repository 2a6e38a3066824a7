"""Benchmark: one actor update (optimizer step on a 64-response mini-batch), packed vs padded, alternating.

    python scripts/bench_update.py [--model smollm2-135m-instruct] [--prompt-len 56] [--response-len 128]
        [--batch 64] [--micro 16] [--rounds 3] [--dtype float32] [--entropy-coeff 0] [--response-range 40-128]
        [--variants padded,packed,shared] [--n 8] [--prompt-range 45-52] [--seqs-per-row 2]
        [--out /tmp/bench_update.json]

The mini-batch is GRPO-shaped: prompts of 45-52 real tokens left-padded to `--prompt-len` (the benchmark's
max_prompt_length 56, or 128), each repeated `--n` times (the samples of a prompt; default 8), responses of
40-128 real tokens (uniform; `--response-range`) right-padded to `--response-len`,
random token ids (the cost does not depend on them), one on-policy update (ratio 1, no KL), as the
trainer's `update` boundary with `model.use_remove_padding` True (packed: `packed_steps`) and False (padded:
`steps.make_actor_update`, micro-batches of `--micro` responses); `shared`: packed with
`model.pack_shared_prompts` (one prompt copy per row chunk). The packed micro-batch has the padded
one's token budget (`--micro` rows of prompt-len + response-len tokens), so both bound memory alike.

Both functions are compiled ahead of time first (`jit(...).lower(...).compile()`: compile_s = trace and
lower (trace_s) + XLA compile; the first call is timed apart, first_call_s), then called alternately
(padded, packed, padded, ...) `--rounds` times each; every timed call records the 1-minute load average
before and after (the machine may be shared). Reported per variant: best / median seconds, real tokens/s
(prompt + response tokens that are not padding, divided by the update time) and MFU on real tokens:
`metrics.transformer_flops_per_sequence` (training, per real sequence length) / time / peak, where peak is a
square float32 `jnp.dot` measured in the same run (`bench_forward.matmul_peak`). The losses of the two
variants are checked to agree (1e-4).
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

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(_HERE))
sys.path.insert(0, _HERE)

from bench_forward import machine_info, matmul_peak  # noqa: E402

from jaxrl_post.engine import packed_steps, packing, steps, token_fields  # noqa: E402
from jaxrl_post.models import PRESETS, init_model, load_pretrained  # noqa: E402
from jaxrl_post.rl import metrics as metrics_lib  # noqa: E402
from jaxrl_post.rl import ppo_update  # noqa: E402


def loadavg() -> float:
    return round(os.getloadavg()[0], 2)


def make_batch(
    m: int, p: int, r: int, vocab: int, r_range: tuple[int, int], seed: int = 0, n: int = 1, p_range=(45, 52)
) -> dict[str, np.ndarray]:
    """GRPO-like mini-batch: prompts of `p_range` (default 45-52) real tokens (left-padded to p), responses of
    `r_range` (min, max; 1 <= min <= max <= r) real tokens right-padded to r; each prompt repeated `n` times
    (the `rollout.n` samples of a prompt)."""
    rng = np.random.default_rng(seed)
    p_len = np.repeat(rng.integers(min(p_range[0], p), min(p_range[1], p) + 1, -(-m // n)), n)[:m]
    r_len = rng.integers(r_range[0], r_range[1] + 1, m)
    am = np.concatenate([np.arange(p)[None] >= p - p_len[:, None], np.arange(r)[None] < r_len[:, None]], 1)
    am = am.astype(np.int32)
    ids = rng.integers(3, vocab, (m, p + r))
    ids[:, :p] = np.repeat(ids[::n, :p], n, 0)[:m]
    ids = (ids * am).astype(np.int32)
    rmask = am[:, p:].copy()
    return dict(
        input_ids=ids,
        attention_mask=am,
        position_ids=np.maximum(np.cumsum(am, 1) - 1, 0).astype(np.int32),
        responses=ids[:, p:].copy(),
        loss_mask=rmask,
        advantages=(rng.normal(size=(m, 1)) * rmask).astype(np.float32),
    )


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--prompt-len", type=int, default=56)
    ap.add_argument("--response-len", type=int, default=128)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--micro", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--entropy-coeff", type=float, default=0.0)
    ap.add_argument(
        "--variants",
        default="padded,packed",
        help="comma-separated subset of padded,packed,shared (packed, shared prompts)",
    )
    ap.add_argument("--n", type=int, default=8, help="samples per prompt (rollout.n): sequences sharing a prompt")
    ap.add_argument("--seqs-per-row", type=int, default=2, help="model.seqs_per_packed_row (row_len = k (P + R))")
    ap.add_argument(
        "--response-range",
        default=None,
        help="MIN-MAX real response tokens (uniform; default 40-response_len), e.g. 10-30 for the default run's"
        " short answers",
    )
    ap.add_argument("--prompt-range", default="45-52", help="MIN-MAX real prompt tokens (uniform, per prompt)")
    ap.add_argument("--out", default=os.path.join(tempfile.gettempdir(), "bench_update.json"))
    args = ap.parse_args(argv)
    r = args.response_len
    try:  # checked before the model loads
        r_range = tuple(int(v) for v in args.response_range.split("-")) if args.response_range else (min(40, r), r)
        if len(r_range) != 2 or not 1 <= r_range[0] <= r_range[1] <= r:
            raise ValueError
    except ValueError:
        ap.error(f"--response-range {args.response_range!r}: want MIN-MAX with 1 <= MIN <= MAX <= --response-len {r}")

    try:
        model, _ = load_pretrained(args.model, dtype=args.dtype)
        source = args.model
    except Exception as e:  # package missing: same shapes, same cost
        print(f"load_pretrained({args.model!r}) failed ({type(e).__name__}: {e}); random smollm2_135m preset")
        model, source = init_model(PRESETS["smollm2_135m"], dtype=args.dtype), "random smollm2_135m"
    cfg = model.config
    m, p = args.batch, args.prompt_len
    p_range = tuple(int(v) for v in args.prompt_range.split("-"))
    batch = make_batch(m, p, r, cfg.vocab_size, r_range, n=args.n, p_range=p_range)
    rows, row_len = packing.micro_geometry(
        micro_batch_size=args.micro,
        use_dynamic_bsz=False,
        max_token_len_per_gpu=None,
        seq_len=p + r,
        seqs_per_row=args.seqs_per_row,
        dp=1,
        n_seqs=m,
    )
    spec = packing.make_pack_spec(m, rows, p, r, row_len=row_len)
    t = time.perf_counter()
    packed_np = dict({k: batch[k] for k in ("loss_mask", "advantages", "responses")}, **packing.pack_batch(batch, spec))
    pack_s = time.perf_counter() - t
    shared_np = dict(
        {k: batch[k] for k in ("loss_mask", "advantages", "responses")},
        **packing.pack_batch(batch, packing.make_pack_spec(m, rows, p, r, row_len=row_len, share_prompts=True)),
    )
    real = batch["attention_mask"].sum(1)
    n_real, n_padded = int(real.sum()), m * (p + r)
    used_micro = int(np.sum(np.any(packed_np["segment_ids"] != 0, axis=(1, 2))))

    graphdef, params, rest = steps.split_model(model)
    tx = steps.make_optimizer(steps.OptimConfig(lr=1e-6, weight_decay=0.0))
    loss_cfg = ppo_update.ActorLossConfig(on_policy=True, entropy_coeff=args.entropy_coeff)
    fns = {
        "padded": jax.jit(
            ppo_update.make_actor_update(steps.padded_layout(n_micro=m // args.micro), graphdef, rest, tx, loss_cfg),
            donate_argnums=(0, 1),
        ),
        "packed": jax.jit(
            ppo_update.make_actor_update(packed_steps.PACKED, graphdef, rest, tx, loss_cfg), donate_argnums=(0, 1)
        ),
        "shared": jax.jit(
            ppo_update.make_actor_update(packed_steps.PACKED, graphdef, rest, tx, loss_cfg), donate_argnums=(0, 1)
        ),
    }
    fns = {k: v for k, v in fns.items() if k in args.variants.split(",")}
    inputs = {
        "padded": {k: jnp.asarray(v) for k, v in batch.items()},
        "packed": jax.tree.map(jnp.asarray, packed_np),
        "shared": jax.tree.map(jnp.asarray, shared_np),
    }
    computed = {"padded": n_padded, "packed": n_real, "shared": token_fields.packed_token_count(shared_np)}
    # One params / optimizer-state chain shared by both variants (the cost does not depend on the values):
    # halves the resident AdamW state on a memory-tight machine.
    res = {name: dict(times=[], loads=[]) for name in fns}
    state = (params, jax.jit(tx.init)(params))
    for name in list(fns):
        t0 = time.perf_counter()
        lowered = fns[name].lower(*state, inputs[name])  # trace + lower to StableHLO
        t1 = time.perf_counter()
        fns[name] = lowered.compile()  # XLA compile
        t2 = time.perf_counter()
        out = jax.block_until_ready(fns[name](*state, inputs[name]))
        t3 = time.perf_counter()
        res[name].update(trace_s=round(t1 - t0, 2), compile_s=round(t2 - t0, 2), first_call_s=round(t3 - t2, 2))
        res[name]["loss"] = float(out[2]["loss"])
        state = out[:2]
        print(
            f"  {name}: trace + lower {t1 - t0:.1f} s, XLA compile {t2 - t1:.1f} s, first call {t3 - t2:.1f} s",
            flush=True,
        )
    peak = matmul_peak()
    for _ in range(args.rounds):
        for name, fn in fns.items():
            la = loadavg()
            t = time.perf_counter()
            out = jax.block_until_ready(fn(*state, inputs[name]))
            res[name]["times"].append(round(time.perf_counter() - t, 3))
            res[name]["loads"].append((la, loadavg()))
            state = out[:2]
            print(f"  {name}: {res[name]['times'][-1]:.2f} s (load {la} -> {res[name]['loads'][-1][1]})", flush=True)
    flops = sum(metrics_lib.transformer_flops_per_sequence(cfg, int(n), training=True) for n in real)
    rows = []
    for name, v in res.items():
        best, med = min(v["times"]), float(np.median(v["times"]))
        rows.append(
            dict(
                variant=name,
                best_s=best,
                median_s=round(med, 3),
                all_s=v["times"],
                tokens_per_s_real=round(n_real / med, 1),
                tokens_per_s_real_best=round(n_real / best, 1),
                mfu_real=round(flops / med / peak, 4),
                compile_s=v["compile_s"],
                trace_s=v["trace_s"],
                first_call_s=v["first_call_s"],
                tokens_computed=computed[name],
                loads=v["loads"],
            )
        )
    speedup = rows[0]["median_s"] / rows[-1]["median_s"]
    rec = dict(
        model=source,
        dtype=args.dtype,
        batch=m,
        prompt_len=p,
        response_len=r,
        response_real_range=r_range,
        n=args.n,
        micro=args.micro,
        packed_rows=f"{spec.rows} x {spec.row_len}",
        entropy_coeff=args.entropy_coeff,
        tokens_real=n_real,
        tokens_padded=n_padded,
        padding_waste=round(n_padded / n_real, 2),
        packed_micro_batches_used=f"{used_micro}/{spec.n_micro}",
        pack_host_s=round(pack_s, 4),
        matmul_peak_gflops=round(peak / 1e9, 1),
        machine=machine_info(),
        speedup_median=round(speedup, 2),
        load_start_end=(rows[0]["loads"][0][0], rows[-1]["loads"][-1][1]),
        results=rows,
    )
    print(f"{source} {args.dtype}: {m} x (P {p} + R {r}) = {n_padded} padded tokens, {n_real} real")
    print(
        f"packed: {spec.rows} rows x {spec.row_len} per micro-batch, used {used_micro}/{spec.n_micro}; "
        f"peak {peak / 1e9:.1f} GFLOP/s"
    )
    print(f"{'variant':8} {'best s':>8} {'median s':>9} {'real tok/s':>11} {'MFU(real)':>10} {'compile s':>10}")
    for row in rows:
        print(
            f"{row['variant']:8} {row['best_s']:8.3f} {row['median_s']:9.3f} {row['tokens_per_s_real']:11.1f} "
            f"{row['mfu_real']:10.3f} {row['compile_s']:10.1f}"
        )
    print(f"speedup (median) {speedup:.2f}x; load {rec['load_start_end']}")
    print(json.dumps(rec))
    with open(args.out, "a") as f:
        f.write(json.dumps(rec) + "\n")


if __name__ == "__main__":
    main()
