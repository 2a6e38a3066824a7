"""A character-level ChatML tokenizer built in memory (no files, no downloads) for tiny test models.

`model.tokenizer_path = 'char'` selects it. Vocabulary (101 ids): `<|endoftext|>` 0, `<|im_start|>` 1 (BOS),
`<|im_end|>` 2 (EOS and pad), `<unk>` 3, then newline, tab and printable ASCII 32..126, one id per
character. The chat template is ChatML, the format SmolLM2/Qwen instruct models use.
"""

from __future__ import annotations

import functools

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<unk>")
CHARS = ("\n", "\t") + tuple(chr(i) for i in range(32, 127))
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@functools.lru_cache(maxsize=1)
def build_char_tokenizer():
    """`transformers.PreTrainedTokenizerFast`, character level, ChatML template (cached per process)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(SPECIAL_TOKENS + CHARS)}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tk.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=tk,
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        pad_token="<|im_end|>",
        unk_token="<unk>",
        additional_special_tokens=["<|endoftext|>"],
    )
    tok.chat_template = CHAT_TEMPLATE
    return tok
