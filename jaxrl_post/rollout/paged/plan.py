"""Memory plan of the paged engine (issue 56): KV pages from `gpu_memory_utilization`, resident sequences and bytes
per chip against the dense `Generator`'s rows, and the decode program's own memory from XLA's buffer assignment,
compiled abstractly (no weights, no accelerator).

`rollout_row` is arithmetic on the model's shapes (nominal HBM sizes in `DEVICES`); `decode_memory` compiles the
engine's real decode program (`programs.decode`) with `jax.ShapeDtypeStruct` arguments and returns
`compiled.memory_analysis()`. Both feed `scripts/memory_plan.py --rollout` (docs/performance.md, "Rollout memory").
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxrl_post.models import get_preset
from jaxrl_post.models.config import ModelConfig
from jaxrl_post.models.decoder import Transformer
from jaxrl_post.rollout.paged import forward, programs
from jaxrl_post.rollout.paged.engine import PagedGenerator
from jaxrl_post.rollout.paged.kv_pool import pool_bytes
from jaxrl_post.rollout.sampling import SamplingParams

GB = 1e9


@dataclasses.dataclass(frozen=True)
class Device:
    """Nominal HBM bytes and bandwidth (bytes/s) of one chip."""

    name: str
    hbm: float
    bandwidth: float


DEVICES = {
    "v5p": Device("TPU v5p", 95e9, 2.76e12),
    "h100": Device("H100 SXM", 80e9, 3.35e12),
    "h200": Device("H200", 141e9, 4.8e12),
}


def kv_bytes_per_token(cfg: ModelConfig, dtype="bfloat16", tp: int = 1) -> int:
    """KV bytes one token holds per chip: keys and values of every layer, the kv heads split over `tp` chips
    (replicated when `tp` exceeds them)."""
    heads = max(1, cfg.num_kv_heads // tp)
    return cfg.num_layers * 2 * heads * cfg.head_dim * np.dtype(dtype).itemsize


def rollout_row(
    name: str,
    cfg: ModelConfig,
    device: str,
    *,
    chips: int,
    tp: int = 1,
    gpu_memory_utilization: float = 0.9,
    block_size: int = 16,
    prompts: int = 512,
    n: int = 16,
    prompt_len: int = 1024,
    max_response: int = 16384,
    mean_response: float = 5000.0,
    max_num_seqs: int = 256,
    dtype: str = "bfloat16",
) -> dict:
    """One plan: per chip, weights (`tp`-sharded), the page pool (`gpu_memory_utilization` x HBM - weights - the
    slots' float32 logits), its pages and the sequences it holds at the mean length (prompt pages shared by the `n`
    samples, half a page of padding each) against the dense engine's rows of `prompt_len + max_response` slots."""
    dev = DEVICES[device]
    w = cfg.num_params() * np.dtype(dtype).itemsize / tp
    logits = max_num_seqs * cfg.vocab_size * 4
    pool = gpu_memory_utilization * dev.hbm - w - logits
    per_tok = kv_bytes_per_token(cfg, dtype, tp)
    pages = int(pool // (per_tok * block_size))
    held = prompt_len / n + mean_response + block_size / 2  # tokens a paged sequence holds at the mean length
    paged_seqs = pages * block_size / held  # per TP group (each chip holds its heads of every page)
    dense_rows = pool / (per_tok * (prompt_len + max_response))
    groups = chips // tp
    return dict(
        plan=name,
        model=f"{cfg.num_params() / 1e9:.1f}B, {cfg.num_layers} layers",
        device=f"{chips} x {dev.name}",
        tp=tp,
        gpu_memory_utilization=gpu_memory_utilization,
        batch=f"{prompts} x {n}, P {prompt_len}, R max {max_response} mean {mean_response:g}",
        weights_gb=w / GB,
        pool_gb=pool / GB,
        kv_per_token_kib=per_tok / 1024,
        pages=pages,
        paged_seqs_per_group=paged_seqs,
        dense_rows_per_group=dense_rows,
        paged_vs_dense=paged_seqs / dense_rows,
        paged_seqs_total=min(paged_seqs * groups, prompts * n),
        dense_rows_total=min(dense_rows * groups, prompts * n),
        dense_cache_gb_total=per_tok * tp * prompts * n * (prompt_len + max_response) / GB,
    )


def abstract_engine(cfg: ModelConfig, dtype="bfloat16", scan_layers: bool = True, **engine_kw) -> PagedGenerator:
    """A `PagedGenerator` over an abstract model (`nnx.eval_shape`: shapes only) with its weights read
    (`update_weights`; scanned layers stacked abstractly)."""
    make = lambda: Transformer(
        cfg, rngs=nnx.Rngs(0), dtype=jnp.dtype(dtype), param_dtype=jnp.dtype(dtype), scan_layers=False
    )
    model = nnx.eval_shape(make)
    eng = PagedGenerator(model, scan_layers=False, **engine_kw)
    eng.update_weights()
    if scan_layers:
        eng.scan_layers = True
        eng._graphdefs, eng._stacked = nnx.eval_shape(lambda: forward.stack_layers(make()))
    return eng


def decode_program(eng: PagedGenerator, prompt_len: int, max_new_tokens: int, cache_dtype="bfloat16"):
    """The engine's decode program (`programs.decode`, sampling at temperature 1, `eng.steps_per_dispatch`
    steps) lowered with abstract arguments of the shapes `PagedGenerator._decode` passes for prompts of
    `prompt_len` tokens and `max_new_tokens`, one replica: the pool `[1, L, num_pages, page_size, 2N, K]`,
    `[1, S, V]` logits, `[1, S]` batch vectors and `[1, S, table_pages]` page tables (every slot running: the
    largest decode batch). Returns the `jax.stages.Lowered`."""
    cfg, s = eng.model.config, eng.max_num_seqs
    pps = eng.table_pages(prompt_len, max_new_tokens)
    sds = jax.ShapeDtypeStruct
    kv = sds((1, cfg.num_layers, eng.num_pages, eng.page_size, 2 * cfg.num_kv_heads, cfg.head_dim), cache_dtype)
    vec = lambda dt: sds((1, s), dt)  # one replica
    args = (kv, sds((1, s, cfg.vocab_size), jnp.float32), *(vec(jnp.int32) for _ in range(5)), vec(jnp.bool_))
    key = jax.eval_shape(lambda: jax.random.key(0))
    params = SamplingParams(max_new_tokens=1, temperature=1.0, eos_token_ids=(0,), pad_token_id=0)
    return programs.decode.lower(
        eng._graphdef,
        eng._state,
        eng._graphdefs,
        eng._stacked,
        *args,
        sds((1, s, pps), jnp.int32),
        key,
        impl=eng.impl,
        params=params,
        steps=eng.steps_per_dispatch,
    )


def decode_memory(lowered) -> dict:
    """Bytes of `lowered.compile().memory_analysis()`: arguments, outputs, aliased (donated), temporaries."""
    ma = lowered.compile().memory_analysis()
    return dict(
        arguments=ma.argument_size_in_bytes,
        outputs=ma.output_size_in_bytes,
        aliased=ma.alias_size_in_bytes,
        temps=ma.temp_size_in_bytes,
    )


def engine_pool_bytes(eng: PagedGenerator, cache_dtype="bfloat16") -> int:
    """Bytes of the engine's page pool."""
    c = eng.model.config
    return pool_bytes(c.num_layers, eng.num_pages, eng.page_size, c.num_kv_heads, c.head_dim, cache_dtype)


# The rollout rows of `scripts/memory_plan.py --rollout` (issue 56): 512 prompts x 16 samples, prompts <= 1k; 7B
# with R_max 16k (mean ~5k), 32B with R_max 32k (mean ~10k, assumed); vLLM's gpu_memory_utilization default 0.9.
ROLLOUT_PLANS = {
    "7b_v5p64": dict(preset="qwen2_5_7b", device="v5p", chips=32, tp=1),
    "7b_8xh100": dict(preset="qwen2_5_7b", device="h100", chips=8, tp=1),
    "32b_v5p64_tp1": dict(preset="qwen3_32b", device="v5p", chips=32, tp=1, max_response=32768, mean_response=10000),
    "32b_v5p64_tp4": dict(preset="qwen3_32b", device="v5p", chips=32, tp=4, max_response=32768, mean_response=10000),
    "32b_8xh100_tp4": dict(preset="qwen3_32b", device="h100", chips=8, tp=4, max_response=32768, mean_response=10000),
}
ROLLOUT_COLS = (
    ("plan", "plan", "{}"),
    ("device", "chips", "{}"),
    ("tp", "TP", "{}"),
    ("batch", "batch", "{}"),
    ("weights_gb", "weights GB/chip", "{:.1f}"),
    ("pool_gb", "KV pool GB/chip", "{:.1f}"),
    ("kv_per_token_kib", "KV KiB/token/chip", "{:.0f}"),
    ("pages", "pages", "{}"),
    ("paged_seqs_per_group", "paged seqs / TP group", "{:.0f}"),
    ("dense_rows_per_group", "dense rows / TP group", "{:.0f}"),
    ("paged_vs_dense", "paged / dense", "{:.2f}"),
    ("paged_seqs_total", "paged seqs, all chips", "{:.0f}"),
    ("dense_cache_gb_total", "dense cache GB (whole batch)", "{:.0f}"),
)


def rollout_rows(names=None, gpu_memory_utilization: float = 0.9) -> list[dict]:
    """`rollout_row` of each plan of `ROLLOUT_PLANS` (all by default)."""
    out = []
    for name in names or ROLLOUT_PLANS:
        kw = dict(ROLLOUT_PLANS[name])
        out.append(rollout_row(name, get_preset(kw.pop("preset")), gpu_memory_utilization=gpu_memory_utilization, **kw))
    return out


def rollout_table(rows: list[dict]) -> str:
    """Markdown table of `rollout_rows`."""
    head = "| " + " | ".join(h for _, h, _ in ROLLOUT_COLS) + " |"
    body = ["| " + " | ".join(f.format(r[k]) for k, _, f in ROLLOUT_COLS) + " |" for r in rows]
    return "\n".join([head, "|" + "---|" * len(ROLLOUT_COLS), *body])
