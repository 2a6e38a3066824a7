"""DPO configs for `jaxrl_post.sft.dpo.DPOTrainer` (`trainer_type = 'dpo'`).

    python -m jaxrl_post.main --config=configs/dpo.py                      # tiny: seconds on a CPU
    python -m jaxrl_post.main --config=configs/dpo.py:smollm2 --config.data.train_files=pairs.jsonl

Variants (`--config=configs/dpo.py:VARIANT`):
  (default)  = tiny.
  tiny       random 2-layer llama with the character tokenizer on `configs/data/dpo_tiny.jsonl` (32 generated
             arithmetic pairs, prompt "a+b=", chosen the sum, rejected a wrong sum).
  smollm2    SmolLM2-135M-Instruct (GGUF alias) on your pairs (`data.train_files`, TRL's prompt / chosen /
             rejected rows, plain or conversational), LoRA off, beta 0.1, sigmoid loss.
  rg_pairs   smollm2 on `runs/pairs/{train,val}.jsonl`: pairs from the model's own samples on the GRPO default
             task (scripts/make_preference_pairs.py), lr 2e-6, rows of 128 tokens.

The `model.*` and `trainer.*` sections are `configs/sft.py`'s (same meanings); `data.*` follows TRL's
`DPOConfig` lengths (`max_length`, `max_prompt_length`, truncation); `dpo.*` has TRL's `DPOConfig` names.
"""

import os
import sys

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _REPO not in sys.path:  # config files are loaded by path; make `configs.*` importable from anywhere
    sys.path.insert(0, _REPO)

import ml_collections as mlc

from configs import base, sft

TINY_PAIRS = os.path.join(_REPO, "configs", "data", "dpo_tiny.jsonl")
_SFT_ONLY_DATA = ("format", "messages_key", "prompt_key", "response_key")


def get_base_dpo_config() -> mlc.ConfigDict:
    """The DPO ConfigDict with its defaults (every variant starts here)."""
    c = sft.get_base_sft_config()
    c.trainer_type = "dpo"  # main.py dispatch: 'rl' | 'sft' | 'dpo' (DPOTrainer)
    d = c.data
    for k in _SFT_ONLY_DATA:
        del d[k]
    d.train_files = TINY_PAIRS  # comma-separated .jsonl / .json / .parquet of prompt / chosen / rejected rows
    d.val_files = base._opt_str(None)  # held-out pairs: val/loss, val/rewards/*; None = off
    d.max_length = 512  # tokens of prompt + chosen and of prompt + rejected (TRL max_length)
    d.max_prompt_length = base._opt_int(None)  # tokens of the prompt (None = only max_length bounds it)
    d.truncation = (
        "error"  # longer pairs: error | keep_start (cut the completions' ends) | keep_end (the prompt's start)
    )
    d.train_batch_size = 16  # pairs per optimizer step, global
    d.micro_batch_size = 4  # pairs per accumulated micro-batch, global (packed: rows of 2 * max_length tokens)
    # model.use_remove_padding (True): chosen and rejected share one prompt copy, pairs packed per row
    # per_step: each step packs its train_batch_size pairs into rows (first-fit decreasing). bfd: the whole dataset
    # packed once into rows of 2 * max_length (best-fit decreasing), rows shuffled each epoch; train_batch_size and
    # micro_batch_size then count packed rows (full rows: less padding, a varying number of pairs per step)
    d.packing_strategy = "per_step"  # per_step | bfd (needs model.use_remove_padding=True)

    c.dpo = mlc.ConfigDict()
    c.dpo.beta = 0.1  # TRL beta: strength of the KL regularization to the reference (IPO: its tau)
    c.dpo.loss_type = "sigmoid"  # sigmoid (DPO; cDPO with label_smoothing) | robust | ipo
    c.dpo.label_smoothing = 0.0  # sigmoid: cDPO's eps; robust: the label flip probability, in [0, 0.5)
    c.dpo.precompute_ref_log_probs = False  # reference log-probs once per dataset (True) or per step (False)

    c.optim.lr = 5e-7  # TRL DPOConfig default learning rate
    c.trainer.experiment_name = "dpo"
    c.trainer.default_local_dir = "runs/dpo"
    c.trainer.val_before_train = True
    return c


def tiny(c):
    """Random tiny llama, character tokenizer, the generated pairs (seconds on a CPU)."""
    c = sft.tiny(c)
    c.trainer.experiment_name = "dpo_tiny"
    c.trainer.default_local_dir = "runs/dpo_tiny"
    c.data.train_files = TINY_PAIRS
    c.data.val_files = None  # (sft.tiny's rows are not pairs)
    c.data.max_length = 16  # characters: "a+b=" + answer + <|im_end|>
    c.data.train_batch_size = 8
    c.data.micro_batch_size = 4
    c.dpo.beta = 0.1
    c.optim.lr = 1e-3
    c.trainer.total_training_steps = 4
    c.trainer.save_freq = 2
    c.trainer.val_before_train = True  # val/loss = log 2 at step 0 (the policy is its reference)
    return c


def smollm2(c):
    c.trainer.experiment_name = "dpo_smollm2"
    c.trainer.default_local_dir = "runs/dpo_smollm2"
    c.model.dtype = "float32"
    c.data.train_files = ""  # required: --config.data.train_files=pairs.jsonl
    c.data.max_length = 512
    c.data.train_batch_size = 8
    c.data.micro_batch_size = 2
    c.data.max_val_samples = 64
    c.optim.lr = 5e-7
    c.optim.lr_warmup_steps_ratio = 0.1
    c.optim.weight_decay = 0.0
    c.trainer.total_epochs = 1
    c.trainer.test_freq = 25
    c.trainer.save_freq = 50
    return c


def rg_pairs(c):
    # DPO on pairs from SmolLM2's own samples on the GRPO default task (chosen right, rejected wrong), made by
    # scripts/make_preference_pairs.py into runs/pairs/ (docs/sft_dpo.md "DPO on the model's own samples").
    smollm2(c)
    c.trainer.experiment_name = "dpo_smollm2_rg"
    c.trainer.default_local_dir = "runs/dpo_rg"
    c.data.train_files = "runs/pairs/train.jsonl"
    c.data.val_files = "runs/pairs/val.jsonl"
    c.data.max_length = 128  # chat prompt 45-48 tokens + a response of <= 48
    c.optim.lr = 2e-6
    c.trainer.test_freq = 10
    return c


def get_config(arg=None):
    c = get_base_dpo_config()
    variant = arg or "tiny"
    fns = {"tiny": tiny, "smollm2": smollm2, "rg_pairs": rg_pairs}
    if variant not in fns:
        raise ValueError(f"configs/dpo.py: unknown variant {variant!r}; valid: {sorted(fns)}")
    return fns[variant](c)
