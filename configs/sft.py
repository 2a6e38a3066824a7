"""SFT (supervised fine-tuning) configs for `jaxrl_post.sft.trainer.SFTTrainer` (`trainer_type = 'sft'`).

    python -m jaxrl_post.main --config=configs/sft.py:gsm8k

Variants (`--config=configs/sft.py:VARIANT`):
  (default)  = gsm8k.
  gsm8k      SmolLM2-135M-Instruct on the GSM8K train solutions (`question` -> `answer`, verl's SFT keys) from
             `<repo>/../shared/data/gsm8k`, held-out loss on the test split; the result, exported to
             `runs/sft_gsm8k/huggingface/`, is a model source for RL (`--config.model.path=runs/sft_gsm8k`).
  tools      warm start for configs/grpo_tools.py: SmolLM2-135M-Instruct on whole calculator trajectories (system
             + tool prompt, question, `<tool_call>`, the tool's result, `<answer>`) written by
             `python scripts/make_tool_sft_data.py --out-dir runs/tool_sft`; loss on the two assistant turns. The
             result is the RL model source `--config.model.path=runs/sft_tools` (docs/agents.md).
  tiny       random 2-layer llama with the character tokenizer on `configs/data/sft_tiny.jsonl` (64 generated
             additions, `question` "What is a+b?" -> `answer` "a+b=c\n#### c", GSM8K's keys and answer rule) and
             `configs/data/sft_tiny_val.jsonl` (16 other ones); seconds on a CPU (tests, smoke runs). Rows of your
             own: --config.data.train_files=... --config.data.val_files=... (data.max_length is 96 characters).

The `model.*` and `trainer.*` sections are `configs/base.py`'s (same meanings; the RL-only keys removed);
`data.*` and `optim.*` follow verl's `sft_trainer.yaml` (batch sizes count examples, global).
"""

import os
import sys

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _REPO not in sys.path:  # config files are loaded by path; make `configs.*` importable from anywhere
    sys.path.insert(0, _REPO)

import ml_collections as mlc

from configs import base

GSM8K_DIR = os.path.normpath(os.path.join(_REPO, "..", "shared", "data", "gsm8k"))
TINY_ROWS = os.path.join(_REPO, "configs", "data", "sft_tiny.jsonl")
TINY_VAL_ROWS = os.path.join(_REPO, "configs", "data", "sft_tiny_val.jsonl")

_RL_ONLY_MODEL = ("seqs_per_packed_row", "pack_shared_prompts")
_RL_ONLY_TRAINER = ("critic_warmup", "device_peak_flops")


def get_base_sft_config() -> mlc.ConfigDict:
    """The SFT ConfigDict with its defaults (every variant starts here)."""
    b = base.get_base_config()
    c = mlc.ConfigDict()
    c.trainer_type = "sft"  # main.py dispatch: 'rl' (RLTrainer, the default when absent) | 'sft' (SFTTrainer)

    c.model = b.model  # as configs/base.py; model.use_remove_padding = packing (many examples per row)
    for k in _RL_ONLY_MODEL:
        del c.model[k]

    c.data = mlc.ConfigDict()
    c.data.train_files = os.path.join(GSM8K_DIR, "train.jsonl")  # comma-separated .jsonl / .json / .parquet
    c.data.val_files = base._opt_str(os.path.join(GSM8K_DIR, "test.jsonl"))  # held-out loss; None = off
    c.data.format = "auto"  # auto | messages | prompt_completion | prompt_response (data/sft.py)
    c.data.messages_key = "messages"  # conversational rows: list of {role, content}; loss on assistant turns
    c.data.prompt_key = "question"  # verl SFT: prompt column (a user turn through the chat template)
    c.data.response_key = "answer"  # verl SFT: response column (+ eos; the trained tokens)
    c.data.max_length = 1024  # tokens per example (and per packed row)
    c.data.truncation = "error"  # longer examples: error | right (keep the first max_length tokens)
    c.data.filter_overlong = False  # skip (and count) examples longer than max_length instead
    c.data.skip_malformed = False  # skip (and count) malformed rows instead of raising
    c.data.train_batch_size = 32  # examples per optimizer step, global
    c.data.micro_batch_size = 8  # rows per accumulated micro-batch, global (examples; packed: rows of max_length)
    c.data.shuffle = True  # shuffle the examples every epoch
    c.data.seed = 1  # seed of the shuffle
    # per_step: each step packs its train_batch_size examples (first-fit decreasing; batch sizes count examples).
    # bfd: TRL packing_strategy='bfd': the whole dataset packed once into rows of max_length (best-fit
    # decreasing), the rows shuffled each epoch; train_batch_size / micro_batch_size then count packed rows.
    c.data.packing_strategy = "per_step"  # per_step | bfd (needs model.use_remove_padding=True)
    c.data.max_val_samples = base._opt_int(256)  # first k held-out examples (None = all)

    c.optim = base._optim(1e-5)  # AdamW (verl sft `optim.*`)
    c.optim.clip_grad = 1.0  # clip_by_global_norm threshold (verl sft `optim.clip_grad`)

    c.trainer = b.trainer
    for k in _RL_ONLY_TRAINER:
        del c.trainer[k]
    c.trainer.experiment_name = "sft"
    c.trainer.default_local_dir = "runs/sft"
    c.trainer.val_before_train = True
    c.trainer.save_freq = 50
    c.trainer.export_hf = True  # write <default_local_dir>/huggingface/ after the last step (an RL model.path)
    return c


def _gsm8k(c):
    c.trainer.experiment_name = "sft_smollm2_gsm8k"
    c.trainer.default_local_dir = "runs/sft_gsm8k"
    c.model.dtype = "float32"
    c.data.max_length = 576  # SmolLM2 chat template + GSM8K train solution: median 203, p99 424, max 569 tokens
    c.data.train_batch_size = 16
    c.data.micro_batch_size = 4
    c.data.max_val_samples = 64
    c.optim.lr = 1e-5
    c.optim.lr_warmup_steps_ratio = 0.1
    c.optim.warmup_style = "cosine"
    c.optim.weight_decay = 0.0
    c.trainer.total_training_steps = 50
    c.trainer.test_freq = 25
    return c


def _tools(c):
    from configs import grpo_tools

    c.trainer.experiment_name = "sft_smollm2_tools"
    c.trainer.default_local_dir = "runs/sft_tools"
    c.model.path = grpo_tools.get_config().model.path  # the model the GRPO run starts from
    c.model.dtype = "float32"
    c.data.train_files = os.path.join("runs", "tool_sft", "train.jsonl")
    c.data.val_files = os.path.join("runs", "tool_sft", "val.jsonl")
    c.data.format = "messages"
    c.data.max_length = 384  # the default 512 + 64 trajectories: 332-350 SmolLM2 tokens (the prompt: 283 at most)
    c.data.train_batch_size = 16
    c.data.micro_batch_size = 4
    c.data.max_val_samples = 64
    c.optim.lr = 2e-5
    c.optim.lr_warmup_steps_ratio = 0.1
    c.optim.warmup_style = "cosine"
    c.optim.weight_decay = 0.0
    c.trainer.total_epochs = 2  # 512 rows / 16 = 32 steps per epoch
    c.trainer.test_freq = 16
    c.trainer.save_freq = 32
    return c


def tiny(c):
    """Random tiny llama, character tokenizer, the generated addition rows shipped in configs/data/."""
    c.trainer.experiment_name = "sft_tiny"
    c.trainer.default_local_dir = "runs/sft_tiny"
    c.model.random_init = True
    c.model.preset = "smollm2_135m"
    c.model.tokenizer_path = "char"
    c.model.arch.vocab_size = 128
    c.model.arch.hidden_size = 32
    c.model.arch.intermediate_size = 64
    c.model.arch.num_layers = 2
    c.model.arch.num_heads = 4
    c.model.arch.num_kv_heads = 2
    c.model.arch.head_dim = 8
    c.data.train_files = TINY_ROWS
    c.data.val_files = TINY_VAL_ROWS
    c.data.max_length = 96  # characters (char tokenizer): the rows above are 55-62 with the chat template
    c.data.train_batch_size = 4
    c.data.micro_batch_size = 2
    c.data.max_val_samples = None
    c.optim.lr = 1e-3
    c.optim.weight_decay = 0.0
    c.trainer.total_training_steps = 3
    c.trainer.val_before_train = False
    c.trainer.progress_bar = False
    c.trainer.save_freq = 2
    return c


def get_config(arg=None):
    c = get_base_sft_config()
    variant = arg or "gsm8k"
    fns = {"gsm8k": _gsm8k, "tools": _tools, "tiny": tiny}
    if variant not in fns:
        raise ValueError(f"configs/sft.py: unknown variant {variant!r}; valid: {sorted(fns)}")
    return fns[variant](c)
