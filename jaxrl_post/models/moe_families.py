"""The mixture-of-experts families' Hugging Face layouts: config.json fields and tensor names (used by config.py
and hf_io.py; the block itself is `models/moe.py`).

- `qwen3_moe` (`Qwen3MoeForCausalLM`): the reference layout (`models/moe.py`).
- `mixtral` (`MixtralForCausalLM`): every layer MoE, experts `intermediate_size` wide, the top-k always
  renormalized (`norm_topk_prob`), no q/k norm; tensors `block_sparse_moe.gate` and
  `block_sparse_moe.experts.<j>.w1` (gate) / `w3` (up) / `w2` (down).
- `qwen2_moe` (`Qwen2MoeForCausalLM`): Qwen3-MoE's routing plus a shared expert (`shared_expert_intermediate_size`)
  scaled by `sigmoid(x @ shared_expert_gate)`, qkv bias (`qkv_bias`), no q/k norm.
"""

from __future__ import annotations

import re
from typing import Any

MOE_FAMILIES = ("qwen3_moe", "qwen2_moe", "mixtral")
_MIXTRAL_TO_OURS = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
_OURS_TO_MIXTRAL = {v: k for k, v in _MIXTRAL_TO_OURS.items()}
_MIXTRAL_EXPERT = re.compile(r"^(model\.layers\.\d+)\.block_sparse_moe\.experts\.(\d+)\.(w1|w2|w3)\.weight$")
_OUR_EXPERT = re.compile(r"^(model\.layers\.\d+)\.mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


def moe_fields_from_hf(family: str, cfg: dict) -> dict[str, Any]:
    """`ModelConfig` fields of an MoE family from its transformers config dict (HF names; Mixtral's
    `num_local_experts` -> `num_experts`, its `intermediate_size` -> `moe_intermediate_size`). {} for a dense family.

    Raises NotImplementedError naming a field this decoder does not implement (Mixtral `router_jitter_noise` > 0 or
    `sliding_window`, Qwen2-MoE `use_sliding_window`, Qwen3-MoE `attention_bias`)."""
    if family not in MOE_FAMILIES:
        return {}
    common = dict(
        num_experts_per_tok=cfg["num_experts_per_tok"],
        router_aux_loss_coef=cfg.get("router_aux_loss_coef", 0.001),
        output_router_logits=bool(cfg.get("output_router_logits", False)),
    )
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
