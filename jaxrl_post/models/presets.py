"""Model presets: `ModelConfig`s of released checkpoints (values from their config.json files), by name."""

from __future__ import annotations

import dataclasses

from jaxrl_post.models.config import FULL, SLIDING, ModelConfig


def _llama(**kw) -> ModelConfig:
    return ModelConfig(family="llama", **kw)


# Values from the released checkpoints' config.json files.
smollm2_135m = _llama(
    vocab_size=49152,
    hidden_size=576,
    intermediate_size=1536,
    num_layers=30,
    num_heads=9,
    num_kv_heads=3,
    head_dim=64,
    rope_theta=100000.0,
    rms_norm_eps=1e-5,
    tie_word_embeddings=True,
    max_position_embeddings=8192,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=2,
)

llama3_2_1b = _llama(
    vocab_size=128256,
    hidden_size=2048,
    intermediate_size=8192,
    num_layers=16,
    num_heads=32,
    num_kv_heads=8,
    head_dim=64,
    rope_theta=500000.0,
    rms_norm_eps=1e-5,
    tie_word_embeddings=True,
    rope_scaling={
        "rope_type": "llama3",
        "factor": 32.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    },
    max_position_embeddings=131072,
    bos_token_id=128000,
    eos_token_id=128001,
)

qwen2_5_0_5b = ModelConfig(
    family="qwen2",
    vocab_size=151936,
    hidden_size=896,
    intermediate_size=4864,
    num_layers=24,
    num_heads=14,
    num_kv_heads=2,
    head_dim=64,
    rope_theta=1000000.0,
    rms_norm_eps=1e-6,
    tie_word_embeddings=True,
    qkv_bias=True,
    max_position_embeddings=32768,
    bos_token_id=151643,
    eos_token_id=151643,
)

qwen2_5_1_5b = dataclasses.replace(
    qwen2_5_0_5b, hidden_size=1536, intermediate_size=8960, num_layers=28, num_heads=12, num_kv_heads=2, head_dim=128
)

qwen2_5_7b = dataclasses.replace(
    qwen2_5_0_5b,
    vocab_size=152064,
    hidden_size=3584,
    intermediate_size=18944,
    num_layers=28,
    num_heads=28,
    num_kv_heads=4,
    head_dim=128,
    tie_word_embeddings=False,
)

qwen3_0_6b = ModelConfig(
    family="qwen3",
    vocab_size=151936,
    hidden_size=1024,
    intermediate_size=3072,
    num_layers=28,
    num_heads=16,
    num_kv_heads=8,
    head_dim=128,
    rope_theta=1000000.0,
    rms_norm_eps=1e-6,
    tie_word_embeddings=True,
    qk_norm=True,
    max_position_embeddings=40960,
    bos_token_id=151643,
    eos_token_id=151645,
)

qwen3_32b = dataclasses.replace(  # dense; the rollout memory plan's 32B (rollout/paged/plan.py)
    qwen3_0_6b,
    hidden_size=5120,
    intermediate_size=25600,
    num_layers=64,
    num_heads=64,
    num_kv_heads=8,
    tie_word_embeddings=False,
)

# Qwen3-30B-A3B / Qwen3-235B-A22B: every layer MoE (128 experts, top-8, norm_topk_prob), no dense MLP layers.
qwen3_30b_a3b = ModelConfig(
    family="qwen3_moe",
    vocab_size=151936,
    hidden_size=2048,
    intermediate_size=6144,
    num_layers=48,
    num_heads=32,
    num_kv_heads=4,
    head_dim=128,
    rope_theta=1000000.0,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
    qk_norm=True,
    max_position_embeddings=40960,
    bos_token_id=151643,
    eos_token_id=151645,
    num_experts=128,
    num_experts_per_tok=8,
    moe_intermediate_size=768,
    norm_topk_prob=True,
)

qwen3_235b_a22b = dataclasses.replace(
    qwen3_30b_a3b,
    hidden_size=4096,
    intermediate_size=12288,
    num_layers=94,
    num_heads=64,
    num_kv_heads=4,
    moe_intermediate_size=1536,
)

# Mixtral-8x7B: every layer MoE (8 experts of width 14336, top-2, renormalized).
mixtral_8x7b = ModelConfig(
    family="mixtral",
    vocab_size=32000,
    hidden_size=4096,
    intermediate_size=14336,
    num_layers=32,
    num_heads=32,
    num_kv_heads=8,
    head_dim=128,
    rope_theta=1000000.0,
    rms_norm_eps=1e-5,
    max_position_embeddings=32768,
    bos_token_id=1,
    eos_token_id=2,
    num_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=14336,
    norm_topk_prob=True,
)

# Qwen1.5-MoE-A2.7B (Qwen2MoeForCausalLM): 60 experts top-4 (not renormalized) + a gated shared expert, qkv bias.
qwen1_5_moe_a2_7b = ModelConfig(
    family="qwen2_moe",
    vocab_size=151936,
    hidden_size=2048,
    intermediate_size=5632,
    num_layers=24,
    num_heads=16,
    num_kv_heads=16,
    head_dim=128,
    rope_theta=1000000.0,
    rms_norm_eps=1e-6,
    qkv_bias=True,
    max_position_embeddings=8192,
    bos_token_id=151643,
    eos_token_id=151643,
    num_experts=60,
    num_experts_per_tok=4,
    moe_intermediate_size=1408,
    shared_expert_intermediate_size=5632,
)

# gpt-oss-20b (GptOssForCausalLM, its config.json): 24 layers alternating sliding (128) / full attention, 32 experts
# top-4 with biases and the clamped SwiGLU, attention sinks, YaRN x32 over a 4096-token original context.
gpt_oss_20b = ModelConfig(
    family="gpt_oss",
    vocab_size=201088,
    hidden_size=2880,
    intermediate_size=2880,
    num_layers=24,
    num_heads=64,
    num_kv_heads=8,
    head_dim=64,
    rope_theta=150000.0,
    rope_scaling=dict(
        rope_type="yarn",
        factor=32.0,
        beta_fast=32.0,
        beta_slow=1.0,
        truncate=False,
        original_max_position_embeddings=4096,
    ),
    rms_norm_eps=1e-5,
    qkv_bias=True,
    o_proj_bias=True,
    attention_sinks=True,
    sliding_window=128,
    layer_types=tuple("sliding_attention" if i % 2 == 0 else "full_attention" for i in range(24)),
    max_position_embeddings=131072,
    eos_token_id=200002,
    pad_token_id=199999,
    num_experts=32,
    num_experts_per_tok=4,
    moe_intermediate_size=2880,
    norm_topk_prob=True,
    router_aux_loss_coef=0.9,
    moe_bias=True,
    swiglu_limit=7.0,
)

_GEMMA = dict(
    norm_offset=1.0,
    embed_scale=True,
    post_norms=True,
    hidden_act="gelu_pytorch_tanh",
    tie_word_embeddings=True,
    rms_norm_eps=1e-6,
    bos_token_id=2,
    eos_token_id=1,
    pad_token_id=0,
)

gemma2_2b = ModelConfig(
    family="gemma2",
    vocab_size=256000,
    hidden_size=2304,
    intermediate_size=9216,
    num_layers=26,
    num_heads=8,
    num_kv_heads=4,
    head_dim=256,
    rope_theta=10000.0,
    query_pre_attn_scalar=256,
    attn_logit_softcap=50.0,
    final_logit_softcap=30.0,
    sliding_window=4096,
    layer_types=tuple(SLIDING if i % 2 == 0 else FULL for i in range(26)),
    max_position_embeddings=8192,
    **_GEMMA,
)

gemma3_1b = ModelConfig(
    family="gemma3",
    vocab_size=262144,
    hidden_size=1152,
    intermediate_size=6912,
    num_layers=26,
    num_heads=4,
    num_kv_heads=1,
    head_dim=256,
    rope_theta=1000000.0,
    rope_local_base_freq=10000.0,
    qk_norm=True,
    query_pre_attn_scalar=256,
    sliding_window=512,
    layer_types=tuple(SLIDING if (i + 1) % 6 else FULL for i in range(26)),
    max_position_embeddings=32768,
    **_GEMMA,
)

PRESETS: dict[str, ModelConfig] = {
    "smollm2_135m": smollm2_135m,
    "llama3_2_1b": llama3_2_1b,
    "qwen2_5_0_5b": qwen2_5_0_5b,
    "qwen2_5_1_5b": qwen2_5_1_5b,
    "qwen2_5_7b": qwen2_5_7b,
    "qwen3_0_6b": qwen3_0_6b,
    "qwen3_32b": qwen3_32b,
    "gemma2_2b": gemma2_2b,
    "gemma3_1b": gemma3_1b,
    "qwen3_30b_a3b": qwen3_30b_a3b,
    "qwen3_235b_a22b": qwen3_235b_a22b,
    "mixtral_8x7b": mixtral_8x7b,
    "qwen1_5_moe_a2_7b": qwen1_5_moe_a2_7b,
    "gpt_oss_20b": gpt_oss_20b,
}


def get_preset(name: str) -> ModelConfig:
    """Look up a preset by name (raises KeyError listing the valid names)."""
    key = name.replace("-", "_").replace(".", "_").lower()
    if key not in PRESETS:
        raise KeyError(f"unknown model preset {name!r}; valid: {sorted(PRESETS)}")
    return PRESETS[key]
