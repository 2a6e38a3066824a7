"""Prompt data: sources -> verl rows -> grain pipeline of left-padded prompt batches (DataProto).

Typical use (what the trainer does with `data.*` config keys):

    rows = load_rows("reasoning_gym:chain_sum", size=2000, seed=0, config={...}, prompt_format="plain")
    # or load_rows("../shared/data/gsm8k/train.jsonl"), load_rows("hf:openai/gsm8k:main"), ...
    loader = make_dataloader(rows, tokenizer, batch_size=data.train_batch_size,
                             max_prompt_length=data.max_prompt_length, seed=data.seed)
    batch = next(loader)            # DataProto: input_ids [B, P] int32 (left-padded), ...
    state = loader.get_state()      # -> checkpoint; later: loader.set_state(state)
"""

from jaxrl_post.data.pipeline import (
    PromptDataLoader,
    compute_position_ids,
    left_pad,
    make_dataloader,
    tokenize_prompt,
    tokenize_prompts,
)
from jaxrl_post.data.sources import (
    GSM8K_INSTRUCTION,
    PROMPT_FORMATS,
    MalformedRowError,
    Rows,
    gsm8k_rows,
    hf_rows,
    load_rows,
    normalize_row,
    read_verl_file,
    reasoning_gym_rows,
    tfds_rows,
    write_jsonl,
)

__all__ = [
    "GSM8K_INSTRUCTION",
    "MalformedRowError",
    "PROMPT_FORMATS",
    "PromptDataLoader",
    "Rows",
    "compute_position_ids",
    "gsm8k_rows",
    "hf_rows",
    "left_pad",
    "load_rows",
    "make_dataloader",
    "normalize_row",
    "read_verl_file",
    "reasoning_gym_rows",
    "tfds_rows",
    "tokenize_prompt",
    "tokenize_prompts",
    "write_jsonl",
]
