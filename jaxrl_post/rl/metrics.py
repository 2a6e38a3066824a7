"""Host-side step metrics with verl's names (numpy only; no jit).

Names follow verl's `trainer/ppo/metric_utils.py` (`compute_data_metrics`, `compute_timing_metrics`,
`compute_throughout_metrics`) and its FLOPs counter (`perf/mfu/actor`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from jaxrl_post.runtime import row_stats

# Dense peak FLOP/s per device (bf16 where the chip has it) used for `perf/mfu/*`, keyed by a lower-cased
# substring of `jax.Device.device_kind`. `trainer.device_peak_flops` overrides it.
_PEAK_FLOPS = (
    ("v6 lite", 918e12),
    ("v6e", 918e12),
    ("v5p", 459e12),
    ("v5 lite", 197e12),
    ("v5e", 197e12),
    ("v4", 275e12),
    ("v3", 123e12),
    ("h200", 989e12),
    ("h100", 989e12),
    ("a100", 312e12),
    ("l4", 121e12),
)


def cpu_peak_flops_per_core() -> float:
    """float32 peak of one core from /proc/cpuinfo: FLOPs/cycle (64 with AVX-512: 2 FMA units x 16 lanes x 2,
    32 with AVX2+FMA, 8 otherwise) x clock (GHz in the model name, else `cpu MHz`, else 2.5 GHz). An estimate:
    vCPUs may be hyper-threads and turbo clocks differ."""
    import re

    flags, ghz = "", 0.0
    try:
        with open("/proc/cpuinfo") as f:
            text = f.read()
        m = re.search(r"^flags\s*:(.*)$", text, re.M)
        flags = m.group(1) if m else ""
        m = re.search(r"@\s*([\d.]+)\s*GHz", text)
        if m:
            ghz = float(m.group(1))
        else:
            m = re.search(r"^cpu MHz\s*:\s*([\d.]+)", text, re.M)
            ghz = float(m.group(1)) / 1000 if m else 0.0
    except OSError:
        pass
    per_cycle = 64 if " avx512f" in flags else 32 if (" avx2" in flags and " fma" in flags) else 8
    return per_cycle * (ghz or 2.5) * 1e9


def device_peak_flops(device: Any = None, override: float | None = None) -> float:
    """Peak FLOP/s of one device (`override` wins; CPUs: cores x `cpu_peak_flops_per_core()`, an estimate)."""
    if override:
        return float(override)
    import os

    import jax

    device = device or jax.devices()[0]
    kind = str(getattr(device, "device_kind", "")).lower()
    for key, flops in _PEAK_FLOPS:
        if key in kind:
            return flops
    if device.platform == "cpu":
        return (os.cpu_count() or 1) * cpu_peak_flops_per_core()
    return 100e12


def _stats(prefix: str, x: np.ndarray, out: dict[str, float]) -> None:
    if x.size == 0:
        x = np.zeros((1,), np.float32)
    out[f"{prefix}/mean"] = float(np.mean(x))
    out[f"{prefix}/max"] = float(np.max(x))
    out[f"{prefix}/min"] = float(np.min(x))


def _masked(x: np.ndarray, mask: np.ndarray) -> np.ndarray:
    return np.asarray(x, np.float64)[np.asarray(mask) > 0]


def compute_data_metrics(
    batch: Mapping[str, Any],
    *,
    use_critic: bool,
    max_prompt_length: int | None = None,
    max_response_length: int | None = None,
) -> dict[str, float]:
    """verl's data metrics of one training batch.

    Args:
      batch: numpy-convertible arrays: `token_level_scores [B,R]`, `token_level_rewards [B,R]`,
        `advantages [B,R]`, `returns [B,R]`, `loss_mask [B,R]` (the model's tokens: advantage, return and
        value statistics), `response_attention_mask [B,R]` (the tokens that exist: lengths; defaults to
        `loss_mask`), `attention_mask [B,P+R]`,
        `responses [B,R]`; `values [B,R]` when `use_critic`.
      use_critic: add `critic/values/*` and `critic/vf_explained_var`.
      max_prompt_length/max_response_length: for the `clip_ratio` metrics (default: the padded widths).

    Returns:
      `critic/score/{mean,max,min}` (per-sequence sum of scores), `critic/rewards/*` (after KL),
      `critic/advantages/*`, `critic/returns/*` (over valid response tokens), `critic/values/*`,
      `critic/vf_explained_var` (verl: 1 - Var[returns - values] / (Var[returns] + 1e-5), valid
      tokens; NaN when the returns are constant, where it is undefined),
      `response_length/{mean,max,min,clip_ratio}`, `prompt_length/{mean,max,min,clip_ratio}`.
    """
    g = lambda k: np.asarray(batch[k])
    loss_mask = g("loss_mask").astype(np.float64)
    exists = g("response_attention_mask" if "response_attention_mask" in batch else "loss_mask")
    r = loss_mask.shape[-1]
    attention_mask = g("attention_mask")
    prompt_mask = attention_mask[:, : attention_mask.shape[-1] - r]
    out: dict[str, float] = {}
    _stats("critic/score", g("token_level_scores").astype(np.float64).sum(-1), out)
    _stats("critic/rewards", g("token_level_rewards").astype(np.float64).sum(-1), out)
    _stats("critic/advantages", _masked(g("advantages"), loss_mask), out)
    _stats("critic/returns", _masked(g("returns"), loss_mask), out)
    if use_critic:
        values = _masked(g("values"), loss_mask)
        returns = _masked(g("returns"), loss_mask)
        _stats("critic/values", values, out)
        var_r = np.var(returns) if returns.size else 0.0
        # undefined (NaN, console "n/a") for constant returns: verl's eps would report 1 - 0/1e-5 = 1
        ev = 1.0 - np.var(returns - values) / (var_r + 1e-5) if var_r > 0 else np.nan
        out["critic/vf_explained_var"] = float(ev)
    resp_len = exists.astype(np.float64).sum(-1)
    max_r = max_response_length or r
    _stats("response_length", resp_len, out)
    out["response_length/clip_ratio"] = float(np.mean(resp_len >= max_r))
    prompt_len = prompt_mask.astype(np.float64).sum(-1)
    max_p = max_prompt_length or prompt_mask.shape[-1]
    _stats("prompt_length", prompt_len, out)
    out["prompt_length/clip_ratio"] = float(np.mean(prompt_len >= max_p))
    return out


def data_metric_moments(
    batch: Mapping[str, Any],
    *,
    use_critic: bool,
    max_prompt_length: int | None = None,
    max_response_length: int | None = None,
) -> dict[str, np.ndarray]:
    """The per-process half of `compute_data_metrics` (process-local rows): `row_stats.moments` (`[5] float64`)
    of every quantity it averages, over this process's rows of `batch` (same arrays and arguments). Combine
    every process's with `row_stats.allreduce_moments`, then `data_metrics_from_moments`."""
    g = lambda k: np.asarray(batch[k])
    loss_mask = g("loss_mask").astype(np.float64)
    exists = g("response_attention_mask" if "response_attention_mask" in batch else "loss_mask")
    r = loss_mask.shape[-1]
    prompt_mask = g("attention_mask")[:, : g("attention_mask").shape[-1] - r]
    resp_len = exists.astype(np.float64).sum(-1)
    prompt_len = prompt_mask.astype(np.float64).sum(-1)
    out = {
        "critic/score": row_stats.moments(g("token_level_scores").astype(np.float64).sum(-1)),
        "critic/rewards": row_stats.moments(g("token_level_rewards").astype(np.float64).sum(-1)),
        "critic/advantages": row_stats.moments(_masked(g("advantages"), loss_mask)),
        "critic/returns": row_stats.moments(_masked(g("returns"), loss_mask)),
        "response_length": row_stats.moments(resp_len),
        "response_length/clip_ratio": row_stats.moments(resp_len >= (max_response_length or r)),
        "prompt_length": row_stats.moments(prompt_len),
        "prompt_length/clip_ratio": row_stats.moments(prompt_len >= (max_prompt_length or prompt_mask.shape[-1])),
    }
    if use_critic:
        values, returns = _masked(g("values"), loss_mask), _masked(g("returns"), loss_mask)
        out["critic/values"] = row_stats.moments(values)
        out["critic/returns-values"] = row_stats.moments(returns - values)
    return out


def data_metrics_from_moments(m: Mapping[str, np.ndarray], use_critic: bool) -> dict[str, float]:
    """`compute_data_metrics`'s metrics from the moments of all rows (`data_metric_moments`, combined): the same
    keys and values up to float64 summation order (variances from sums of squares)."""
    out: dict[str, float] = {}
    names = ["critic/score", "critic/rewards", "critic/advantages", "critic/returns"]
    names += ["critic/values"] if use_critic else []
    for name in [*names, "response_length", "prompt_length"]:
        out[f"{name}/mean"], out[f"{name}/max"], out[f"{name}/min"] = row_stats.stats_of(m[name])
        if name == "critic/values":
            var_r = row_stats.var(m["critic/returns"])
            ev = 1.0 - row_stats.var(m["critic/returns-values"]) / (var_r + 1e-5) if var_r > 0 else np.nan
            out["critic/vf_explained_var"] = float(ev)
    for name in ("response_length/clip_ratio", "prompt_length/clip_ratio"):
        out[name] = row_stats.mean(m[name])
    return out


def compute_timing_metrics(
    timing_s: Mapping[str, float], num_prompt_tokens: int, num_response_tokens: int
) -> dict[str, float]:
    """`timing_s/{name}` and verl's `timing_per_token_ms/{name}` (gen per response token, rest per token)."""
    out = {f"timing_s/{k}": float(v) for k, v in timing_s.items()}
    total = max(num_prompt_tokens + num_response_tokens, 1)
    for k, v in timing_s.items():
        if k == "step":
            continue
        denom = max(num_response_tokens, 1) if k == "gen" else total
        out[f"timing_per_token_ms/{k}"] = 1000.0 * float(v) / denom
    return out


def compute_throughput_metrics(total_num_tokens: int, step_time_s: float, n_devices: int) -> dict[str, float]:
    """`perf/total_num_tokens`, `perf/time_per_step`, `perf/throughput` (tokens / s / device)."""
    return {
        "perf/total_num_tokens": float(total_num_tokens),
        "perf/time_per_step": float(step_time_s),
        "perf/throughput": float(total_num_tokens) / max(step_time_s, 1e-9) / max(n_devices, 1),
    }


def transformer_flops_per_sequence(model_config: Any, seq_len: int, *, training: bool) -> float:
    """FLOPs of one forward (x3 with backward) pass over one sequence of `seq_len` tokens.

    Dense: 2 FLOPs per matmul weight per token (q/k/v/o, gated MLP with 3 matrices, LM head); attention:
    `4 * L * H * K * T^2` (QK^T and AV, full square as verl's FlopsCounter). Embedding lookups are free.
    """
    c = model_config
    d, hk, kv = c.hidden_size, c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    per_layer = d * hk + 2 * d * kv + hk * d + 3 * d * c.intermediate_size
    dense = 2.0 * (c.num_layers * per_layer + d * c.vocab_size) * seq_len
    attn = 4.0 * c.num_layers * hk * float(seq_len) ** 2
    return (dense + attn) * (3.0 if training else 1.0)


def compute_mfu(
    model_config: Any, seq_lens: np.ndarray, n_passes: int, seconds: float, n_devices: int, peak_flops: float
) -> float:
    """Model FLOPs utilisation of `n_passes` training passes over sequences of `seq_lens` (valid tokens)."""
    flops = sum(transformer_flops_per_sequence(model_config, int(t), training=True) for t in seq_lens)
    return float(flops * n_passes / max(seconds, 1e-9) / (peak_flops * max(n_devices, 1)))


def reduce_metrics(metrics_list: list[Mapping[str, Any]]) -> dict[str, float]:
    """Mean over a list of metric dicts (one per mini-batch update), as verl's `reduce_metrics`."""
    out: dict[str, list[float]] = {}
    for m in metrics_list:
        for k, v in m.items():
            out.setdefault(k, []).append(float(np.asarray(v)))
    return {k: float(np.mean(v)) for k, v in out.items()}
