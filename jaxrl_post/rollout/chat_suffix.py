"""The append-only observation suffix of a chat template (see `agent_loop`): the text that follows the model's
end-of-turn token when environment messages are appended, after checking that the template keeps what it rendered
before as a prefix."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["TemplateNotAppendOnlyError", "observation_suffix"]


class TemplateNotAppendOnlyError(ValueError):
    """The chat template renders an earlier part of the conversation differently once new messages follow, so
    appending observation tokens would not give the conversation the template describes."""


def _render(tokenizer, messages, add_generation_prompt, tools, kwargs) -> str:
    return tokenizer.apply_chat_template(
        list(messages), tokenize=False, add_generation_prompt=add_generation_prompt, tools=tools or None, **kwargs
    )


def observation_suffix(
    tokenizer,
    text_so_far: str,
    messages: Sequence[dict],
    assistant: dict,
    observations: Sequence[dict],
    stop_text: str,
    tools: list | None = None,
    template_kwargs: Mapping[str, Any] | None = None,
) -> tuple[str, str]:
    """The text to append after the model's stop token for `observations`, and the new full rendering.

    Args:
      text_so_far: the rendering of `messages` with the generation prompt (what the model's turn followed).
      messages: the conversation before the assistant turn; assistant: `{"role": "assistant", "content"}`.
      observations: the environment's messages; stop_text: the model's end-of-turn token as text.
    Returns: `(suffix, new_text)`: new_text = render(messages + [assistant] + observations, generation prompt),
      suffix = what follows `stop_text` at the end of the assistant turn in it.
    Raises:
      TemplateNotAppendOnlyError: the template does not keep `text_so_far` (or the rendered assistant turn) as a
        prefix, or the rendered assistant turn does not contain `stop_text`.
    """
    kw = dict(template_kwargs or {})
    with_asst = _render(tokenizer, [*messages, assistant], False, tools, kw)
    new_text = _render(tokenizer, [*messages, assistant, *observations], True, tools, kw)
    if not with_asst.startswith(text_so_far):
        raise TemplateNotAppendOnlyError(
            "the chat template is not append-only: adding the assistant turn changes the rendering of the "
            f"conversation before it (first difference at character {_first_diff(with_asst, text_so_far)}: "
            f"{with_asst[len(text_so_far) - 40 : len(text_so_far) + 40]!r}). Templates that rewrite earlier "
            "turns (e.g. Qwen3 dropping <think> blocks) cannot be used for multi-turn rollouts as they are"
        )
    if not new_text.startswith(with_asst):
        i = _first_diff(new_text, with_asst)
        raise TemplateNotAppendOnlyError(
            "the chat template is not append-only: adding the environment's messages changes the rendering of "
            f"the assistant turn before them (first difference at character {i}: {new_text[i - 40 : i + 40]!r} vs "
            f"{with_asst[i - 40 : i + 40]!r})"
        )
    turn = with_asst[len(text_so_far) :]
    _, sep, trailing = turn.rpartition(stop_text)
    if not sep:
        raise TemplateNotAppendOnlyError(
            f"the chat template renders the assistant turn without the model's stop token {stop_text!r} "
            f"(rendered turn: {turn[-80:]!r}); the observation cannot be appended after it"
        )
    return trailing + new_text[len(with_asst) :], new_text


def _first_diff(a: str, b: str) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n
