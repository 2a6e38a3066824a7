"""Decoder architecture as data: one frozen dataclass covers Llama, Qwen2/2.5, Qwen3, Gemma 2, Gemma 3 and the
mixture-of-experts families Qwen3-MoE, Qwen2-MoE, Mixtral and GPT-OSS (their HF fields: `models/moe_families.py`).

The families differ only in fields (qkv bias, q/k norm, norm offset, embedding scale, post norms,
soft-capping, sliding-window layers, rope bases). `ModelConfig.from_hf_config` reads a transformers
`config.json` (v4 `rope_theta`/`rope_scaling` or v5 `rope_parameters` layout) and `to_hf_config` writes one
that `transformers.AutoConfig` / `AutoModelForCausalLM` load.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

from jaxrl_post.models.moe_families import moe_fields_from_hf, moe_fields_to_hf
from jaxrl_post.models.mxfp4 import check_quantization_config

# family -> (HF model_type, HF architecture class)
HF_ARCH = {
    "llama": ("llama", "LlamaForCausalLM"),
    "qwen2": ("qwen2", "Qwen2ForCausalLM"),
    "qwen3": ("qwen3", "Qwen3ForCausalLM"),
    "gemma2": ("gemma2", "Gemma2ForCausalLM"),
    "gemma3": ("gemma3_text", "Gemma3ForCausalLM"),
    "qwen3_moe": ("qwen3_moe", "Qwen3MoeForCausalLM"),
    "qwen2_moe": ("qwen2_moe", "Qwen2MoeForCausalLM"),
    "mixtral": ("mixtral", "MixtralForCausalLM"),
    "gpt_oss": ("gpt_oss", "GptOssForCausalLM"),
}
_MODEL_TYPE_TO_FAMILY = {mt: fam for fam, (mt, _) in HF_ARCH.items()}
_MODEL_TYPE_TO_FAMILY.update({"mistral": "llama", "gemma3": "gemma3"})

FULL, SLIDING = "full_attention", "sliding_attention"
SUPPORTED_ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn")


def _freeze(x: Any) -> Any:
    """dict -> sorted tuple of (key, value) pairs, list -> tuple (so the config is hashable)."""
    if isinstance(x, dict):
        return tuple(sorted((k, _freeze(v)) for k, v in x.items()))
    if isinstance(x, list):
        return tuple(_freeze(v) for v in x)
    return x


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Architecture of a decoder-only transformer (hashable; safe as a static jit argument).

    `rope_scaling` (dict or None; stored as a sorted tuple of pairs, read back with `rope_scaling_dict`)
    applies to full-attention layers; sliding layers use `rope_local_base_freq` (unscaled) when it is set
    (Gemma 3), else the same rope as full layers. `layer_types[i]` is 'full_attention' or
    'sliding_attention'; `None` means every layer is full. `norm_offset` is 1.0 for Gemma's `x * (1 + w)`
    RMSNorm, 0.0 for Llama's `x * w`. `embed_scale` multiplies embeddings by sqrt(hidden_size) (Gemma), in
    the compute dtype. `query_pre_attn_scalar`: scores are scaled by its -1/2 power (default head_dim).
    `o_proj_bias`: the output projection has a bias (HF GPT-OSS's `attention_bias` biases q/k/v/o: `qkv_bias`
    and this). `attention_sinks`: one learned logit per query head joins every softmax denominator and is dropped
    after it (GPT-OSS's `self_attn.sinks`; no HF config field, the model type implies it).

    Mixture of experts (HF Qwen3-MoE names; `num_experts = 0`: dense): layer i is an MoE block (`models/moe.py`)
    iff `is_moe_layer(i)`: `num_experts > 0`, i not in `mlp_only_layers` and `(i + 1) % decoder_sparse_step == 0`;
    other layers keep the dense MLP of width `intermediate_size`. Each token goes to `num_experts_per_tok` of
    `num_experts` experts of width `moe_intermediate_size`; `norm_topk_prob` renormalizes the chosen
    probabilities to sum 1. `router_aux_loss_coef` weights the load-balancing loss when `output_router_logits`.
    `shared_expert_intermediate_size` > 0 adds Qwen2-MoE's sigmoid-gated shared expert to every MoE layer.
    `moe_capacity_factor` (not an HF field; None: dropless) caps the tokens an expert takes per sequence
    (`moe.capacity_keep`). GPT-OSS: `moe_bias` (router and expert biases, the fused `gate_up_proj` layout;
    `family='gpt_oss'` only) and the clamped SwiGLU of the experts when `swiglu_limit` is set (`swiglu_alpha`).
    """

    family: str = "llama"
    vocab_size: int = 32000
    hidden_size: int = 512
    intermediate_size: int = 1376
    num_layers: int = 4
    num_heads: int = 8
    num_kv_heads: int = 8
    head_dim: int = 64
    rope_theta: float = 10000.0
    rope_scaling: Any = None
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    qk_norm: bool = False
    norm_offset: float = 0.0
    embed_scale: bool = False
    post_norms: bool = False
    attn_logit_softcap: float | None = None
    final_logit_softcap: float | None = None
    sliding_window: int | None = None
    layer_types: tuple[str, ...] | None = None
    rope_local_base_freq: float | None = None
    query_pre_attn_scalar: float | None = None
    hidden_act: str = "silu"
    max_position_embeddings: int = 4096
    bos_token_id: int | None = None
    eos_token_id: Any = None  # int, tuple of ints or None
    pad_token_id: int | None = None
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    router_aux_loss_coef: float = 0.001
    output_router_logits: bool = False
    shared_expert_intermediate_size: int = 0
    moe_capacity_factor: float | None = None
    o_proj_bias: bool = False
    attention_sinks: bool = False
    moe_bias: bool = False
    swiglu_alpha: float = 1.702
    swiglu_limit: float | None = None
    dtype: str = "float32"  # default compute dtype
    param_dtype: str = "float32"  # default parameter dtype

    def __post_init__(self):
        rs = self.rope_scaling
        if rs and not isinstance(rs, dict):  # tuple/list of (key, value) pairs, e.g. from asdict + JSON
            rs = dict(rs)
        object.__setattr__(self, "rope_scaling", _freeze(rs) if rs else None)
        if self.layer_types is not None:
            object.__setattr__(self, "layer_types", tuple(self.layer_types))
            if len(self.layer_types) != self.num_layers:
                raise ValueError(f"layer_types has {len(self.layer_types)} entries, num_layers={self.num_layers}")
            bad = set(self.layer_types) - {FULL, SLIDING}
            if bad:
                raise ValueError(f"unknown layer types {sorted(bad)}; expected {FULL!r} or {SLIDING!r}")
            if SLIDING in self.layer_types and not self.sliding_window:
                raise ValueError("layer_types has sliding_attention layers but sliding_window is not set")
        if isinstance(self.eos_token_id, list):
            object.__setattr__(self, "eos_token_id", tuple(self.eos_token_id))
        if self.family not in HF_ARCH:
            raise ValueError(f"unknown family {self.family!r}; expected one of {sorted(HF_ARCH)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}")
        rope_type = self.rope_scaling_dict.get("rope_type", "default")
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise NotImplementedError(f"rope_type {rope_type!r} not supported; supported: {SUPPORTED_ROPE_TYPES}")
        if self.hidden_act not in ("silu", "gelu_pytorch_tanh", "gelu_new", "gelu"):
            raise NotImplementedError(f"hidden_act {self.hidden_act!r} not supported")
        object.__setattr__(self, "mlp_only_layers", tuple(int(i) for i in self.mlp_only_layers or ()))
        if self.num_experts:
            e, k = self.num_experts, self.num_experts_per_tok
            if not 1 <= k <= e or self.moe_intermediate_size < 1 or self.decoder_sparse_step < 1:
                raise ValueError(
                    f"MoE config: need 1 <= num_experts_per_tok ({k}) <= num_experts ({e}), "
                    f"moe_intermediate_size >= 1 ({self.moe_intermediate_size}), decoder_sparse_step >= 1 "
                    f"({self.decoder_sparse_step})"
                )
        cf = self.moe_capacity_factor
        if cf is not None and (not self.num_experts or not cf > 0):
            raise ValueError(f"moe_capacity_factor={cf}: needs an MoE model and a value > 0 (None: dropless)")
        if self.moe_bias and self.family != "gpt_oss":
            raise ValueError(f"moe_bias: router/expert biases are GPT-OSS's layout; family={self.family!r}")

    # ----------------------------------------------------------------- derived
    @property
    def rope_scaling_dict(self) -> dict:
        return {k: (list(v) if isinstance(v, tuple) else v) for k, v in (self.rope_scaling or ())}

    def is_sliding(self, layer: int) -> bool:
        return self.layer_types is not None and self.layer_types[layer] == SLIDING

    def layer_rope(self, layer: int) -> tuple[float, dict]:
        """(rope base, rope scaling dict) of one layer."""
        if self.is_sliding(layer) and self.rope_local_base_freq is not None:
            return float(self.rope_local_base_freq), {}
        return float(self.rope_theta), self.rope_scaling_dict

    def is_moe_layer(self, layer: int) -> bool:
        """Whether layer `layer` is a mixture-of-experts block (HF Qwen3-MoE's rule)."""
        return (
            self.num_experts > 0 and layer not in self.mlp_only_layers and (layer + 1) % self.decoder_sparse_step == 0
        )

    @property
    def moe_layers(self) -> tuple[int, ...]:
        """Indices of the MoE layers, in order (their routes are `[..., len(moe_layers), k]`)."""
        return tuple(i for i in range(self.num_layers) if self.is_moe_layer(i))

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        if self.eos_token_id is None:
            return ()
        return tuple(self.eos_token_id) if isinstance(self.eos_token_id, tuple) else (int(self.eos_token_id),)

    def replace(self, **kw) -> ModelConfig:
        return dataclasses.replace(self, **kw)

    def num_params(self, active: bool = False) -> int:
        """Parameter count (embedding counted once when tied); active: per token (the routed experts only)."""
        d, f, k = self.hidden_size, self.intermediate_size, self.head_dim
        attn = d * k * (2 * self.num_heads + 2 * self.num_kv_heads) + self.o_proj_bias * d
        attn += self.attention_sinks * self.num_heads
        if self.qkv_bias:
            attn += k * (self.num_heads + 2 * self.num_kv_heads)
        if self.qk_norm:
            attn += 2 * k
        norms = d * (4 if self.post_norms else 2)
        n_moe = len(self.moe_layers)
        experts = self.num_experts_per_tok if active else self.num_experts
        moe = d * self.num_experts + 3 * d * self.moe_intermediate_size * experts
        if self.shared_expert_intermediate_size:
            moe += 3 * d * self.shared_expert_intermediate_size + d
        if self.moe_bias:  # router [E], gate_up [E, 2F], down [E, D]
            moe += self.num_experts + (2 * self.moe_intermediate_size + d) * experts
        emb = self.vocab_size * d * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * (attn + norms) + (self.num_layers - n_moe) * 3 * d * f + n_moe * moe + emb + d

    # ---------------------------------------------------------------- HF I/O
    @classmethod
    def from_hf_config(cls, cfg: dict | str | os.PathLike | Any, **overrides) -> ModelConfig:
        """Build from a transformers config: dict, path to config.json / its directory, or a PretrainedConfig.

        Raises NotImplementedError for unsupported model types or features (e.g. Llama `attention_bias`).
        """
        if isinstance(cfg, (str, os.PathLike)):
            p = os.path.join(cfg, "config.json") if os.path.isdir(cfg) else cfg
            with open(p) as f:
                cfg = json.load(f)
        elif not isinstance(cfg, dict):
            cfg = cfg.to_dict()
        cfg = dict(cfg)
        if cfg.get("model_type") == "gemma3" and "text_config" in cfg:  # multimodal wrapper: text part only
            text = dict(cfg["text_config"] or {})
            text.setdefault("model_type", "gemma3_text")
            for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
                if key in cfg and key not in text:
                    text[key] = cfg[key]
            cfg = text
        model_type = cfg.get("model_type", "llama")
        family = _MODEL_TYPE_TO_FAMILY.get(model_type)
        if family is None:
            raise NotImplementedError(
                f"model_type {model_type!r} not supported; supported: {sorted(_MODEL_TYPE_TO_FAMILY)}"
            )
        check_quantization_config(family, cfg.get("quantization_config"))  # gpt-oss's mxfp4: dequantized on load
        if family == "llama" and (cfg.get("attention_bias") or cfg.get("mlp_bias")):
            raise NotImplementedError("Llama attention_bias/mlp_bias checkpoints are not supported")
        gemma = family.startswith("gemma")
        hidden, heads = cfg["hidden_size"], cfg["num_attention_heads"]
        num_layers = cfg["num_hidden_layers"]
        head_dim = cfg.get("head_dim") or hidden // heads

        # rope: v5 `rope_parameters` (flat, or nested by layer type for Gemma 3) or v4 `rope_theta`/`rope_scaling`
        rp = cfg.get("rope_parameters") or {}
        if FULL in rp or SLIDING in rp:
            full = dict(rp.get(FULL) or {})
            local = dict(rp.get(SLIDING) or {})
        else:
            full, local = dict(rp), {}
        legacy = dict(cfg.get("rope_scaling") or {})
        if legacy and not full.get("rope_type", full.get("type")):
            full.update(legacy)
        default_theta = {"gemma3": 1e6, "gpt_oss": 150000.0}.get(family, 10000.0)
        rope_theta = full.pop("rope_theta", cfg.get("rope_theta", default_theta))
        rope_type = full.pop("rope_type", full.pop("type", "default"))
        full.pop("type", None)
        if float(full.pop("partial_rotary_factor", cfg.get("partial_rotary_factor") or 1.0)) != 1.0:
            raise NotImplementedError("partial rotary embeddings (partial_rotary_factor < 1) are not supported")
        scaling = None
        if rope_type not in (None, "default"):
            scaling = {"rope_type": rope_type, **full}
            if rope_type == "llama3":
                scaling.setdefault("original_max_position_embeddings", cfg.get("max_position_embeddings"))
        local_base = None
        if family == "gemma3":
            if local.get("rope_type", "default") != "default":
                raise NotImplementedError("scaled rope on Gemma 3 sliding layers is not supported")
            local_base = local.get("rope_theta", cfg.get("rope_local_base_freq", 10000.0))

        layer_types = cfg.get("layer_types")
        sliding_window = cfg.get("sliding_window")
        if layer_types is None:
            if family == "gemma2":
                layer_types = [SLIDING if i % 2 == 0 else FULL for i in range(num_layers)]
            elif family == "gemma3":
                pattern = cfg.get("sliding_window_pattern", cfg.get("_sliding_window_pattern", 6))
                layer_types = [SLIDING if (i + 1) % pattern else FULL for i in range(num_layers)]
            elif family in ("qwen2", "qwen3", "qwen3_moe") and cfg.get("use_sliding_window"):
                mwl = cfg.get("max_window_layers", num_layers)
                layer_types = [SLIDING if i >= mwl else FULL for i in range(num_layers)]
        if layer_types is not None and SLIDING not in layer_types:
            layer_types = None
        if layer_types is None:
            sliding_window = None
        if gemma and cfg.get("use_bidirectional_attention"):
            raise NotImplementedError("bidirectional Gemma attention is not supported")

        kw = dict(
            family=family,
            vocab_size=cfg["vocab_size"],
            hidden_size=hidden,
            intermediate_size=cfg["intermediate_size"],
            num_layers=num_layers,
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=head_dim,
            rope_theta=float(rope_theta),
            rope_scaling=scaling,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            tie_word_embeddings=cfg.get("tie_word_embeddings", gemma),
            qkv_bias=bool(family == "qwen2" or (gemma and cfg.get("attention_bias"))),
            qk_norm=family in ("qwen3", "gemma3", "qwen3_moe"),
            norm_offset=1.0 if gemma else 0.0,
            embed_scale=gemma,
            post_norms=gemma,
            # transformers' Gemma 3 attention ignores attn_logit_softcapping; so do we
            attn_logit_softcap=cfg.get("attn_logit_softcapping") if family == "gemma2" else None,
            final_logit_softcap=cfg.get("final_logit_softcapping") if gemma else None,
            sliding_window=sliding_window,
            layer_types=layer_types,
            rope_local_base_freq=local_base,
            query_pre_attn_scalar=cfg.get("query_pre_attn_scalar") if gemma else None,
            hidden_act=cfg.get("hidden_activation") or cfg.get("hidden_act") or "silu",
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_id=cfg.get("eos_token_id"),
            pad_token_id=cfg.get("pad_token_id"),
        )
        kw.update(moe_fields_from_hf(family, cfg))
        if gemma and kw["hidden_act"] == "gelu":  # HF Gemma maps legacy exact gelu to the tanh approximation
            kw["hidden_act"] = "gelu_pytorch_tanh"
        kw.update(overrides)
        return cls(**kw)

    def to_hf_config(self) -> dict:
        """transformers config dict (both the v5 `rope_parameters` and the v4 rope keys are written)."""
        model_type, arch = HF_ARCH[self.family]
        if self.attn_logit_softcap is not None and self.family != "gemma2":
            raise ValueError(
                f"transformers' {arch} has no attention logit soft-capping; cannot export "
                f"attn_logit_softcap={self.attn_logit_softcap}"
            )
        if self.final_logit_softcap is not None and not self.family.startswith("gemma"):
            raise ValueError(f"transformers' {arch} has no final logit soft-capping")
        eos = list(self.eos_token_id) if isinstance(self.eos_token_id, tuple) else self.eos_token_id
        out: dict[str, Any] = dict(
            architectures=[arch],
            model_type=model_type,
            vocab_size=self.vocab_size,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_layers,
            num_attention_heads=self.num_heads,
            num_key_value_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            rms_norm_eps=self.rms_norm_eps,
            tie_word_embeddings=self.tie_word_embeddings,
            max_position_embeddings=self.max_position_embeddings,
            bos_token_id=self.bos_token_id,
            eos_token_id=eos,
            pad_token_id=self.pad_token_id,
            torch_dtype=self.param_dtype,
            use_cache=True,
        )
        scaling = self.rope_scaling_dict or None
        full = {"rope_type": "default", **(scaling or {}), "rope_theta": self.rope_theta}
        out["rope_theta"] = self.rope_theta
        out["rope_scaling"] = scaling
        if self.family in ("gemma2", "gemma3"):
            out["hidden_activation"] = self.hidden_act
            qpas = self.query_pre_attn_scalar or self.head_dim
            out["query_pre_attn_scalar"] = int(qpas) if float(qpas).is_integer() else qpas
            out["attn_logit_softcapping"] = self.attn_logit_softcap
            out["final_logit_softcapping"] = self.final_logit_softcap
            out["attention_bias"] = self.qkv_bias
            out["sliding_window"] = self.sliding_window
            out["layer_types"] = list(self.layer_types or [FULL] * self.num_layers)
        else:
            out["hidden_act"] = self.hidden_act
            out["attention_bias"] = False if self.family == "llama" else self.qkv_bias
            if self.family == "llama":
                out["mlp_bias"] = False
        if self.family == "gemma3":
            local = self.rope_local_base_freq if self.rope_local_base_freq is not None else self.rope_theta
            out["rope_local_base_freq"] = local
            out["rope_parameters"] = {FULL: full, SLIDING: {"rope_type": "default", "rope_theta": local}}
            out["use_bidirectional_attention"] = False
        else:
            out["rope_parameters"] = full
        out.update(moe_fields_to_hf(self))
        if self.family in ("qwen2", "qwen3", "qwen3_moe"):
            sliding = self.layer_types is not None
            out["use_sliding_window"] = sliding
            out["sliding_window"] = self.sliding_window if sliding else None
            out["layer_types"] = list(self.layer_types or [FULL] * self.num_layers)
            if sliding:
                first = list(self.layer_types).index(SLIDING)
                if any(t != SLIDING for t in self.layer_types[first:]):
                    raise ValueError("Qwen sliding layers must be the trailing layers (max_window_layers)")
                out["max_window_layers"] = first
            else:
                out["max_window_layers"] = self.num_layers
        return out
