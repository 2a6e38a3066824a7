"""Chat with a checkpoint or an exported / pretrained model, sampled by our own rollout `Generator` (the
library half of `scripts/chat.py`; see `jaxrl_post.api`)."""

from __future__ import annotations

import os

from jaxrl_post.batch.protocol import DataProto
from jaxrl_post.engine.run import checkpoint as ckpt
from jaxrl_post.export import load_actor
from jaxrl_post.models import load_pretrained
from jaxrl_post.models.tokenizer import apply_chat_template
from jaxrl_post.rl.builders import eos_and_pad, load_tokenizer
from jaxrl_post.rollout import Generator, SamplingParams


def _is_checkpoint(path: str) -> bool:

    if not os.path.isdir(path):
        return False
    _, step = ckpt.parse_step_dir(path)
    return (
        step is not None
        or bool(ckpt.list_complete_steps(path))
        or bool(ckpt.list_complete_steps(ckpt.checkpoint_dir(path)))
    )


def load_chat_model(model: str, *, tokenizer: str | None = None, step: int | None = None):
    """(Transformer, tokenizer, label) for `model`: a run directory, its `checkpoints/` directory or a
    `global_step_<N>` directory (the actor params, as `export.load_actor`; a LoRA checkpoint merged onto its
    base), or anything `models.load_pretrained` accepts (an HF directory, a .gguf file, an installed alias).
    `tokenizer` replaces the model's own tokenizer; `step` picks a checkpoint step (default: the latest).

    Raises:
      CheckpointError: a checkpoint path with nothing complete, no model metadata, or a reward model (see
        `export.load_actor`).
      FileNotFoundError / ValueError: what `models.load_pretrained` raises for a bad path or name.
      ValueError: no tokenizer found (pass `--tokenizer`).
    """

    if _is_checkpoint(model):
        m, tok, n = load_actor(model, step=step)
        label = f"{model} (step {n})"
    else:
        m, tok = load_pretrained(model)
        label = model
    if tokenizer:
        tok = load_tokenizer(tokenizer)
    if tok is None:
        raise ValueError(f"{model} has no tokenizer files; pass --tokenizer=<HF dir | .gguf | alias>")
    return m, tok, label


class Chat:
    """A conversation: `reply(text)` appends the user turn, samples the answer and appends it.

    Args:
      model: the `Transformer`, as `load_chat_model` returns it.
      tokenizer: its tokenizer (with a chat template, or plain text is used).
      max_new_tokens: response length R (a reply is cut there).
      temperature: sampling temperature (`rollout.SamplingParams`; 0: greedy).
      top_p: nucleus sampling mass (1.0: off).
      top_k: top-k sampling (-1: off).
      seed: base seed; turn i samples with seed + i.
      system: optional system message.
    """

    def __init__(
        self, model, tokenizer, *, max_new_tokens=256, temperature=0.7, top_p=1.0, top_k=-1, seed=0, system=None
    ):

        self.tokenizer = tokenizer
        eos, pad = eos_and_pad(tokenizer)
        self.params = SamplingParams(
            max_new_tokens=int(max_new_tokens),
            temperature=float(temperature),
            top_k=int(top_k),
            top_p=float(top_p),
            do_sample=float(temperature) > 0,
            eos_token_ids=eos,
            pad_token_id=pad,
            seed=int(seed),
        )
        self.generator = Generator(model=model, compact_min_rows=None)
        self.system = system
        self.reset()

    def reset(self) -> None:
        self.messages = [{"role": "system", "content": self.system}] if self.system else []
        self.turn = 0

    def prompt_ids(self) -> list[int]:
        """Token ids of the conversation so far with the assistant header (plain text without a template)."""

        if getattr(self.tokenizer, "chat_template", None):
            return apply_chat_template(self.tokenizer, self.messages, add_generation_prompt=True)
        text = "\n".join(m["content"] for m in self.messages)
        return [int(i) for i in self.tokenizer(text)["input_ids"]]

    def reply(self, text: str) -> str:
        """The model's answer to the user turn `text` (special tokens and the end-of-turn token removed)."""
        import numpy as np

        self.messages.append({"role": "user", "content": text})
        ids = np.asarray([self.prompt_ids()], np.int32)
        batch = DataProto.from_dict(tensors={"input_ids": ids, "attention_mask": np.ones_like(ids)})
        out = self.generator.generate(batch, self.params, seed=self.params.seed + self.turn)
        n = int(np.asarray(out.batch["response_attention_mask"])[0].sum())
        resp = [int(t) for t in np.asarray(out.batch["responses"])[0, :n]]
        answer = self.tokenizer.decode(resp, skip_special_tokens=True)
        self.messages.append({"role": "assistant", "content": answer})
        self.turn += 1
        return answer
