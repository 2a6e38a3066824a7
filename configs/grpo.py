"""GRPO (verl's `algorithm.adv_estimator=grpo`, no critic) configs.

Variants (`--config=configs/grpo.py:VARIANT`):
  (default)  SmolLM2-135M-Instruct on a reasoning-gym task, 11-12 min on a 2-core CPU (docs/results.md).
  gsm8k      GSM8K (raw jsonl, verl's prompt suffix) from `<repo>/../shared/data/gsm8k` (or data.*_files).
  lora       the default run with LoRA (rank 16, alpha 32, all linear projections; higher lr): only the adapters
             and their AdamW moments are trained and checkpointed, the reference is the base model.
  tiny       random 2-layer llama, a deterministic toy reward; a few steps in well under a minute (tests).
  moe_tiny   `tiny` with a random 2-layer Qwen3-MoE (4 experts, top-2; docs/moe.md).
  mixtral_tiny / qwen2_moe_tiny / gpt_oss_tiny   the same on the other MoE families: Mixtral, Qwen2-MoE (a shared
             expert, qkv bias), GPT-OSS (biased experts, clamped SwiGLU, sinks, sliding / full layers, YaRN).
  async      `tiny`, fully asynchronous: paged rollout, partial rollout, staleness <= 2, token IS (docs/async.md).
"""

import os
import sys

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _REPO not in sys.path:  # config files are loaded by path; make `configs.*` importable from anywhere
    sys.path.insert(0, _REPO)

from configs import base

GSM8K_DIR = os.path.normpath(os.path.join(_REPO, "..", "shared", "data", "gsm8k"))
TINY_REWARD = os.path.join(_REPO, "configs", "tiny_reward.py")


def _default(c):
    # Sized for a 2-core CPU (11-12 min): 4 prompts x 8 samples = 32 responses of <= 48 tokens per step, one
    # on-policy optimizer step per training step, greedy accuracy on 200 held-out problems before/after.
    c.trainer.experiment_name = "grpo_smollm2_rg"
    c.trainer.default_local_dir = "runs/grpo"
    c.data.train_files = "reasoning_gym:basic_arithmetic"
    c.data.val_files = "reasoning_gym:basic_arithmetic"
    c.data.train_batch_size = 4
    c.data.max_prompt_length = 56  # SmolLM2 chat prompts of this task: 45-48 tokens
    c.data.max_response_length = 48
    c.rollout.n = 8
    c.rollout.temperature = 1.0
    # Small packed micro-batches (2 rows of 2 x 104 tokens here): on a CPU their activations stay in cache, so
    # the update ran 1.15x faster than at 8 (scripts/bench_update.py, docs/performance.md) and needs less
    # memory; on an accelerator raise these (or use actor.use_dynamic_bsz with a token budget).
    c.rollout.log_prob_micro_batch_size = 4
    c.ref.log_prob_micro_batch_size = 4
    c.actor.ppo_mini_batch_size = 4  # prompts (32 responses): one mini-batch per step -> exactly on-policy
    c.actor.ppo_micro_batch_size = 4
    c.actor.optim.lr = 1e-5
    c.actor.optim.lr_warmup_steps = 2
    c.actor.optim.weight_decay = 0.0
    c.reward_model.num_workers = 2
    c.trainer.total_training_steps = 30
    return c


def _lora(c):
    # LoRA on the default task: adapters train at a ~10x higher lr than full fine-tuning (their update is
    # scaled by alpha / rank and starts at 0); the checkpoint holds the adapters only (a few MB).
    _default(c)
    c.trainer.experiment_name = "grpo_smollm2_rg_lora"
    c.trainer.default_local_dir = "runs/grpo_lora"
    c.model.lora_rank = 16
    c.model.lora_alpha = 32.0
    c.model.target_modules = "all-linear"
    c.actor.optim.lr = 1e-4
    return c


def _gsm8k(c):
    # GSM8K with verl's prompt suffix; a 135M model is not expected to learn it on a CPU: this variant shows
    # the pipeline on real data (reward, response length, step time). Validation is off by default (200
    # greedy 256-token answers take minutes); turn it on with --config.trainer.val_before_train=True.
    c.trainer.experiment_name = "grpo_smollm2_gsm8k"
    c.trainer.default_local_dir = "runs/grpo_gsm8k"
    c.data.train_files = os.path.join(GSM8K_DIR, "train.jsonl")
    c.data.val_files = os.path.join(GSM8K_DIR, "test.jsonl")
    c.data.max_val_samples = 200
    c.data.train_batch_size = 4
    c.data.max_prompt_length = 160  # SmolLM2 chat prompts: median 102, 99th percentile 174 tokens
    c.data.max_response_length = 256
    c.rollout.n = 4
    c.rollout.log_prob_micro_batch_size = 4
    c.ref.log_prob_micro_batch_size = 4
    c.actor.ppo_mini_batch_size = 4  # prompts (16 responses): one on-policy optimizer step per step
    c.actor.ppo_micro_batch_size = 4
    c.actor.optim.lr = 1e-6
    c.actor.optim.weight_decay = 0.0
    c.reward_model.num_workers = 2
    c.trainer.total_training_steps = 3
    c.trainer.val_before_train = False
    c.trainer.val_at_end = False
    return c


def tiny(c):
    """Random tiny llama + toy reward; exercises old log-probs (2 mini-batches) and the KL loss path."""
    c.trainer.experiment_name = "grpo_tiny"
    c.trainer.default_local_dir = "runs/grpo_tiny"
    c.model.random_init = True
    c.model.preset = "smollm2_135m"
    c.model.tokenizer_path = "char"  # in-memory character-level ChatML tokenizer (101 ids)
    c.model.arch.vocab_size = 128
    c.model.arch.hidden_size = 64
    c.model.arch.intermediate_size = 128
    c.model.arch.num_layers = 2
    c.model.arch.num_heads = 4
    c.model.arch.num_kv_heads = 2
    c.model.arch.head_dim = 16
    c.data.reasoning_gym.size = 64
    c.data.reasoning_gym.val_size = 16  # one validation batch of 16 = the training generate batch (4 x 4)
    c.data.train_batch_size = 4
    c.data.max_prompt_length = 192  # characters
    c.data.max_response_length = 12
    c.rollout.n = 4
    c.actor.ppo_mini_batch_size = 2  # prompts (8 responses): 2 mini-batches per step -> old log-probs recomputed
    c.actor.ppo_micro_batch_size = 4
    c.actor.use_kl_loss = True
    c.actor.kl_loss_coef = 0.01
    c.actor.entropy_coeff = 0.001
    c.actor.optim.lr = 1e-3
    c.rollout.log_prob_micro_batch_size = 8
    c.ref.log_prob_micro_batch_size = 8
    c.critic.ppo_mini_batch_size = 2  # prompts (8 responses)
    c.critic.ppo_micro_batch_size = 4
    c.critic.forward_micro_batch_size = 8
    c.custom_reward_function.path = TINY_REWARD
    c.custom_reward_function.name = "compute_score"
    c.reward_model.num_workers = 0  # score in-process (no worker start-up)
    c.trainer.total_training_steps = 2
    c.trainer.progress_bar = False
    return c


def moe_tiny(c):
    """`tiny` on a random Qwen3-MoE: 2 MoE layers of 4 experts (top-2, norm_topk_prob), 32 wide."""
    tiny(c)
    c.trainer.experiment_name = "grpo_moe_tiny"
    c.trainer.default_local_dir = "runs/grpo_moe_tiny"
    c.model.preset = "qwen3_30b_a3b"
    c.model.arch.num_experts = 4
    c.model.arch.num_experts_per_tok = 2
    c.model.arch.moe_intermediate_size = 32  # the dense tiny's intermediate_size 128 = 4 experts x 32
    return c


def _family_tiny(c, name: str, preset: str, **arch):
    """`moe_tiny`'s sizes on another MoE family's preset (4 experts of width 32, top-2, 2 layers)."""
    moe_tiny(c)
    c.trainer.experiment_name = f"grpo_{name}"
    c.trainer.default_local_dir = f"runs/grpo_{name}"
    c.model.preset = preset
    for key, value in arch.items():
        c.model.arch[key] = value
    return c


def mixtral_tiny(c):
    """`moe_tiny` on a random Mixtral (every layer MoE, top-k renormalized, no q/k norm)."""
    return _family_tiny(c, "mixtral_tiny", "mixtral_8x7b")


def qwen2_moe_tiny(c):
    """`moe_tiny` on a random Qwen2-MoE (qkv bias, a sigmoid-gated shared expert of width 64)."""
    return _family_tiny(c, "qwen2_moe_tiny", "qwen1_5_moe_a2_7b", shared_expert_intermediate_size=64)


def gpt_oss_tiny(c):
    """`moe_tiny` on a random GPT-OSS: router and expert biases, the clamped SwiGLU, attention sinks, a sliding
    (window 8) then a full layer, YaRN rope."""
    return _family_tiny(
        c, "gpt_oss_tiny", "gpt_oss_20b", sliding_window=8, layer_types=("sliding_attention", "full_attention")
    )


def async_tiny(c):
    """`tiny` trained fully asynchronously (docs/async.md): two generation batches of 2 prompts per step, a batch in
    flight across each weight update (partial rollout on the paged engine), groups at most 2 versions old, the
    rollout log-probs as the behaviour policy with token-level truncated IS (decoupled PPO)."""
    tiny(c)
    c.trainer.experiment_name = "grpo_async_tiny"
    c.trainer.default_local_dir = "runs/grpo_async_tiny"
    c.trainer.total_training_steps = 4
    c.rollout.name = "paged"
    c.rollout.max_num_seqs = 8
    c.rollout.max_num_batched_tokens = 256
    c.rollout.num_scheduler_steps = 4
    c.async_training.mode = "fully_async"
    c.async_training.staleness_threshold = 2
    c.async_training.trigger_parameter_sync_step = 1
    c.async_training.require_batches = 2
    c.async_training.partial_rollout = True
    c.async_training.partial_rollout_dispatches = 2
    c.algorithm.rollout_correction.rollout_is = "token"
    c.algorithm.rollout_correction.rollout_is_threshold = 2.0
    return c


def get_config(arg=None):
    c = base.get_base_config()
    c.algorithm.adv_estimator = "grpo"
    c.critic.enable = False
    variant = arg or "default"
    fns = {
        "default": _default,
        "gsm8k": _gsm8k,
        "lora": _lora,
        "tiny": tiny,
        "moe_tiny": moe_tiny,
        "mixtral_tiny": mixtral_tiny,
        "qwen2_moe_tiny": qwen2_moe_tiny,
        "gpt_oss_tiny": gpt_oss_tiny,
        "async": async_tiny,
    }
    if variant not in fns:
        raise ValueError(f"configs/grpo.py: unknown variant {variant!r}; valid: {sorted(fns)}")
    return fns[variant](c)
