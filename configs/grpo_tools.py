"""GRPO with multi-turn tool use (verl's `rollout.multi_turn`; docs/agents.md).

Variants (`--config=configs/grpo_tools.py:VARIANT`):
  (default)  SmolLM2-135M-Instruct learns to call a calculator on reasoning-gym multiplications of two factors
             (`min_digits=2, max_digits=3`: reasoning-gym's digit range, not every factor's; 9 of the 64 validation
             problems have a one-digit factor): the model writes `<tool_call>{"name": "calculator", ...}</tool_call>`,
             the tool's result comes back as a `tool` message (not trained), and the model answers in
             `<answer></answer>` tags in its own turn (the reward reads the last tag: a number that only appears in the
             tool output earns nothing). SmolLM2's template ignores `tools=`, so the tool list goes into the system
             prompt (Qwen2.5's Hermes tool prompt).
  tiny       random 2-layer llama with the character tokenizer (configs/grpo.py:tiny's model) and the calculator on
             reasoning-gym multiplications (generated, no download), the toy reward; 2 steps (tests, smoke runs).
             The tool list in the system prompt is ~1,000 characters (one token each), hence max_prompt_length 1088.
  guess      the number-guessing game (`GuessNumberEnv`): feedback "too low / too high" every turn, reward 1 on a
             correct guess (`guess_number_score` reads the turn scores).
"""

import os
import sys

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _REPO not in sys.path:  # config files are loaded by path; make `configs.*` importable from anywhere
    sys.path.insert(0, _REPO)

from configs import base, grpo

SYSTEM_PROMPT = (
    "You are a careful assistant. Use the calculator tool for arithmetic: call it, read its result, then give the "
    "final answer inside <answer></answer> tags."
)


def _default(c):
    c.trainer.experiment_name = "grpo_tools_smollm2"
    c.trainer.default_local_dir = "runs/grpo_tools"
    c.data.train_files = "reasoning_gym:basic_arithmetic"
    c.data.val_files = "reasoning_gym:basic_arithmetic"
    rg = c.data.reasoning_gym.config
    rg.min_terms, rg.max_terms, rg.min_digits, rg.max_digits = 2, 2, 2, 3
    rg.operators = ("*",)
    c.data.reasoning_gym.prompt_format = "answer_tag"
    c.data.reasoning_gym.val_size = 64
    c.data.system_prompt = SYSTEM_PROMPT
    c.data.train_batch_size = 4
    c.data.max_prompt_length = 320  # the rendered prompt with the tool list: 281-283 SmolLM2 tokens
    c.data.max_response_length = 192  # every turn of a trajectory: calls, tool results, answer
    c.rollout.n = 8
    c.rollout.multi_turn.enable = True
    c.rollout.multi_turn.tools = "calculator"
    c.rollout.multi_turn.max_assistant_turns = 3
    c.rollout.multi_turn.max_parallel_calls = 1
    c.rollout.log_prob_micro_batch_size = 4
    c.ref.log_prob_micro_batch_size = 4
    c.actor.ppo_mini_batch_size = 4
    c.actor.ppo_micro_batch_size = 4
    c.actor.optim.lr = 1e-5
    c.actor.optim.lr_warmup_steps = 2
    c.actor.optim.weight_decay = 0.0
    c.trainer.total_training_steps = 30
    return c


def _guess(c):
    _default(c)
    c.trainer.experiment_name = "grpo_guess_smollm2"
    c.trainer.default_local_dir = "runs/grpo_guess"
    c.data.system_prompt = None
    c.data.max_prompt_length = 128
    c.data.max_response_length = 256
    c.rollout.multi_turn.env = "guess_number"
    c.rollout.multi_turn.max_assistant_turns = 6
    c.custom_reward_function.path = os.path.join(_REPO, "jaxrl_post", "rollout", "environments.py")
    c.custom_reward_function.name = "guess_number_score"
    return c


def _tiny(c):
    _default(c)  # the calculator task (multiplications, answer tags, the tool prompt) on the tiny model
    grpo.tiny(c)
    c.trainer.experiment_name = "grpo_tools_tiny"
    c.trainer.default_local_dir = "runs/grpo_tools_tiny"
    # characters: the system prompt with the calculator's schema (Hermes tool prompt) and the question: 1,014
    c.data.max_prompt_length = 1088
    c.data.max_response_length = 32  # every turn of a trajectory (a random model rarely writes a tool call)
    c.data.train_batch_size = 2
    c.actor.ppo_mini_batch_size = 2  # prompts (8 responses): one on-policy update per step
    c.actor.ppo_micro_batch_size = 8
    c.actor.use_kl_loss = False  # no reference forward over the long prompts
    c.model.seqs_per_packed_row = 1  # rows of one 1,120-token sequence: attention costs row_len^2
    c.rollout.multi_turn.max_assistant_turns = 2
    return c


def get_config(arg=None):
    c = base.get_base_config()
    c.algorithm.adv_estimator = "grpo"
    c.critic.enable = False
    variant = arg or "default"
    fns = {"default": _default, "tiny": _tiny, "guess": _guess}
    if variant not in fns:
        raise ValueError(f"configs/grpo_tools.py: unknown variant {variant!r}; valid: {sorted(fns)}")
    return fns[variant](c)
