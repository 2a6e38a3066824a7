"""The mixture-of-experts families' Hugging Face layouts: config.json fields and tensor names (used by config.py
and hf_io.py; the block itself is `models/moe.py`).

- `qwen3_moe` (`Qwen3MoeForCausalLM`): the reference layout (`models/moe.py`).
- `mixtral` (`MixtralForCausalLM`): every layer MoE, experts `intermediate_size` wide, the top-k always
  renormalized (`norm_topk_prob`), no q/k norm; tensors `block_sparse_moe.gate` and
  `block_sparse_moe.experts.<j>.w1` (gate) / `w3` (up) / `w2` (down).
- `qwen2_moe` (`Qwen2MoeForCausalLM`): Qwen3-MoE's routing plus a shared expert (`shared_expert_intermediate_size`)
  scaled by `sigmoid(x @ shared_expert_gate)`, qkv bias (`qkv_bias`), no q/k norm.
- `gpt_oss` (`GptOssForCausalLM`): every layer MoE; a router with a bias whose top-k logits are softmaxed (= the
  softmax's top-k renormalized: `norm_topk_prob`); experts with biases (`moe_bias`) and the clamped SwiGLU
  (`swiglu_alpha`, `swiglu_limit`), stored as transformers does: `mlp.experts.gate_up_proj` `[E, D, 2F]` with gate
  and up interleaved (columns 0, 2, ... gate; 1, 3, ... up), `down_proj` `[E, F, D]` (ours as they are); q/k/v/o
  biases, attention sinks, alternating sliding / full layers, YaRN rope. The released mxfp4 checkpoints
  (`quantization_config`, `*_blocks` / `*_scales` experts) are dequantized on load (`mxfp4`); bf16/float32 load as
  they are.
"""

from __future__ import annotations

import re
from typing import Any

MOE_FAMILIES = ("qwen3_moe", "qwen2_moe", "mixtral", "gpt_oss")
FUSED_EXPERTS = ("gpt_oss",)  # families whose expert tensors are stored as our params (no per-expert stacking)
_GPT_OSS_EXPERT_PARAMS = ("router_bias", "gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias")
_MIXTRAL_TO_OURS = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
_OURS_TO_MIXTRAL = {v: k for k, v in _MIXTRAL_TO_OURS.items()}
_MIXTRAL_EXPERT = re.compile(r"^(model\.layers\.\d+)\.block_sparse_moe\.experts\.(\d+)\.(w1|w2|w3)\.weight$")
_OUR_EXPERT = re.compile(r"^(model\.layers\.\d+)\.mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


def moe_fields_from_hf(family: str, cfg: dict) -> dict[str, Any]:
    """`ModelConfig` fields of an MoE family from its transformers config dict (HF names; Mixtral's
    `num_local_experts` -> `num_experts`, its `intermediate_size` -> `moe_intermediate_size`). {} for a dense family.

    Raises NotImplementedError naming a field this decoder does not implement (Mixtral `router_jitter_noise` > 0 or
    `sliding_window`, Qwen2-MoE `use_sliding_window`, Qwen3-MoE `attention_bias`, GPT-OSS `attention_bias` false)."""
    if family not in MOE_FAMILIES:
        return {}
    common = dict(
        num_experts_per_tok=cfg["num_experts_per_tok"],
        router_aux_loss_coef=cfg.get("router_aux_loss_coef", 0.001),
        output_router_logits=bool(cfg.get("output_router_logits", False)),
    )
    if family == "gpt_oss":
        return _gpt_oss_from_hf(cfg, common)
    if family == "mixtral":
        if cfg.get("router_jitter_noise"):
            raise NotImplementedError("Mixtral router_jitter_noise > 0 (router input noise) is not supported")
        if cfg.get("sliding_window"):
            raise NotImplementedError("Mixtral sliding_window (sliding-window attention) is not supported")
        e = cfg.get("num_local_experts", cfg.get("num_experts", 0))
        return dict(common, num_experts=e, moe_intermediate_size=cfg["intermediate_size"], norm_topk_prob=True)
    common.update(
        num_experts=cfg.get("num_experts", cfg.get("num_local_experts", 0)),
        moe_intermediate_size=cfg["moe_intermediate_size"],
        norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
        decoder_sparse_step=cfg.get("decoder_sparse_step", 1),
        mlp_only_layers=tuple(cfg.get("mlp_only_layers") or ()),
    )
    if family == "qwen3_moe":
        if cfg.get("attention_bias"):
            raise NotImplementedError("Qwen3-MoE attention_bias checkpoints are not supported")
        return common
    if cfg.get("use_sliding_window"):
        raise NotImplementedError("Qwen2-MoE use_sliding_window (sliding-window attention) is not supported")
    shared = cfg.get("shared_expert_intermediate_size", 0)
    return dict(common, shared_expert_intermediate_size=shared, qkv_bias=bool(cfg.get("qkv_bias", True)))


def _gpt_oss_from_hf(cfg: dict, common: dict) -> dict[str, Any]:
    if not cfg.get("attention_bias", True):
        raise NotImplementedError("GPT-OSS attention_bias=False (no q/k/v/o biases) is not supported")
    out = dict(
        common,
        num_experts=cfg.get("num_local_experts", cfg.get("num_experts", 0)),
        moe_intermediate_size=cfg["intermediate_size"],
        norm_topk_prob=True,
        qkv_bias=True,
        o_proj_bias=True,
        attention_sinks=True,
        moe_bias=True,
        swiglu_alpha=float(cfg.get("swiglu_alpha", 1.702)),
        swiglu_limit=float(cfg.get("swiglu_limit", 7.0)),
    )
    if cfg.get("layer_types") is None and cfg.get("sliding_window"):  # transformers' default: even layers sliding
        n = cfg["num_hidden_layers"]
        out.update(layer_types=["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(n)])
        out.update(sliding_window=cfg["sliding_window"])
    return out


def _gpt_oss_to_hf(c, common: dict) -> dict[str, Any]:
    want = dict(qkv_bias=True, o_proj_bias=True, attention_sinks=True, moe_bias=True, norm_topk_prob=True)
    bad = [f"{k}={getattr(c, k)}" for k, v in want.items() if getattr(c, k) != v]
    if bad or c.moe_layers != tuple(range(c.num_layers)) or c.swiglu_limit is None or c.qk_norm:
        raise ValueError(
            f"transformers' GptOss has {want}, an MoE block in every layer, swiglu_limit set and no q/k norm; "
            f"this config differs ({', '.join(bad) or 'layers / swiglu_limit / qk_norm'})"
        )
    return dict(
        common,
        num_local_experts=c.num_experts,
        intermediate_size=c.moe_intermediate_size,
        attention_bias=True,
        attention_dropout=0.0,
        swiglu_alpha=c.swiglu_alpha,
        swiglu_limit=c.swiglu_limit,
        sliding_window=c.sliding_window,
        layer_types=list(c.layer_types or ["full_attention"] * c.num_layers),
    )


def moe_fields_to_hf(c) -> dict[str, Any]:
    """The config.json fields of `c`'s MoE family (transformers' names; merged over the dense ones by
    `ModelConfig.to_hf_config`). Raises ValueError for what the family's transformers class cannot express."""
    if c.family not in MOE_FAMILIES:
        if c.num_experts:
            raise ValueError(f"family {c.family!r} has no mixture-of-experts layers; use family='qwen3_moe'")
        return {}
    if c.shared_expert_intermediate_size and c.family != "qwen2_moe":
        raise ValueError(f"transformers' {c.family} has no shared expert; use family='qwen2_moe'")
    common = dict(
        num_experts_per_tok=c.num_experts_per_tok,
        router_aux_loss_coef=c.router_aux_loss_coef,
        output_router_logits=c.output_router_logits,
    )
    if c.family == "gpt_oss":
        return _gpt_oss_to_hf(c, common)
    if c.family == "mixtral":
        if not c.norm_topk_prob or c.moe_layers != tuple(range(c.num_layers)) or c.layer_types is not None:
            raise ValueError(
                "transformers' Mixtral has an MoE block in every layer, always renormalizes the top-k "
                "(norm_topk_prob=True) and has no sliding layers; this config differs"
            )
        return dict(
            common,
            num_local_experts=c.num_experts,
            intermediate_size=c.moe_intermediate_size,
            router_jitter_noise=0.0,
            sliding_window=None,
        )
    out = dict(
        common,
        num_experts=c.num_experts,
        moe_intermediate_size=c.moe_intermediate_size,
        norm_topk_prob=c.norm_topk_prob,
        decoder_sparse_step=c.decoder_sparse_step,
        mlp_only_layers=list(c.mlp_only_layers),
    )
    if c.family == "qwen2_moe":
        if c.layer_types is not None:
            raise ValueError("Qwen2-MoE export with sliding layers is not supported")
        out.update(shared_expert_intermediate_size=c.shared_expert_intermediate_size, qkv_bias=c.qkv_bias)
    return out


def shared_expert_params(prefix: str, path: tuple, t: tuple) -> dict[str, tuple]:
    """`hf_io.param_map` entries of one MoE layer's shared expert (Qwen2-MoE): the dense-MLP projections
    `mlp.shared_expert.<proj>.weight` `[out, in]` and the gate `mlp.shared_expert_gate.weight` `[1, D]`, both
    transposed (`t`) into `mlp.shared_expert.<proj>.kernel` / `mlp.shared_expert_gate` `[D, 1]`."""
    out = {f"{prefix}mlp.shared_expert_gate.weight": (path + ("mlp", "shared_expert_gate"), *t)}
    for name in ("gate_proj", "up_proj", "down_proj"):
        out[f"{prefix}mlp.shared_expert.{name}.weight"] = (path + ("mlp", "shared_expert", name, "kernel"), *t)
    return out


def moe_layer_params(config, prefix: str, path: tuple, t: tuple) -> dict[str, tuple]:
    """`hf_io.param_map` entries of one MoE layer besides its stacked experts: the router `mlp.gate.weight` `[E, D]`
    (transposed, `t`) and Qwen2-MoE's shared expert; for GPT-OSS all its MoE tensors (`gpt_oss_params`)."""
    if config.family in FUSED_EXPERTS:
        return gpt_oss_params(prefix, path, t)
    out = {f"{prefix}mlp.gate.weight": (path + ("mlp", "router"), *t)}
    if config.shared_expert_intermediate_size:
        out.update(shared_expert_params(prefix, path, t))
    return out


def gpt_oss_params(prefix: str, path: tuple, t: tuple) -> dict[str, tuple]:
    """`hf_io.param_map` entries of one GPT-OSS MoE layer: router `mlp.router.weight` `[E, D]` (transposed, `t`) and
    `mlp.router.bias`, and the expert tensors `mlp.experts.<gate_up_proj|down_proj>[_bias]`, which are our params'
    layouts as they are (`moe.MoE`)."""
    ident = (lambda w: w, lambda w: w)
    out = {f"{prefix}mlp.router.weight": (path + ("mlp", "router"), *t)}
    for ours in _GPT_OSS_EXPERT_PARAMS:
        name = "router.bias" if ours == "router_bias" else f"experts.{ours}"
        out[f"{prefix}mlp.{name}"] = (path + ("mlp", ours), *ident)
    return out


def hf_to_ours_name(family: str, name: str) -> str:
    """A checkpoint tensor name -> the Qwen-MoE names `param_map` uses (Mixtral: `block_sparse_moe.gate` ->
    `mlp.gate`, `block_sparse_moe.experts.<j>.w1/w3/w2` -> `mlp.experts.<j>.gate_proj/up_proj/down_proj`;
    transformers' in-memory `mlp.*` names pass unchanged)."""
    if family != "mixtral":
        return name
    m = _MIXTRAL_EXPERT.match(name)
    if m:
        return f"{m.group(1)}.mlp.experts.{m.group(2)}.{_MIXTRAL_TO_OURS[m.group(3)]}.weight"
    return name.replace(".block_sparse_moe.gate.", ".mlp.gate.")


def ours_to_hf_name(family: str, name: str) -> str:
    """Inverse of `hf_to_ours_name` on export (the names the family's checkpoints on the hub use)."""
    if family != "mixtral":
        return name
    m = _OUR_EXPERT.match(name)
    if m:
        return f"{m.group(1)}.block_sparse_moe.experts.{m.group(2)}.{_OURS_TO_MIXTRAL[m.group(3)]}.weight"
    return name.replace(".mlp.gate.", ".block_sparse_moe.gate.")
