"""Chat with a trained checkpoint or an exported / pretrained model, with our own sampler (no torch).

Usage:
  python scripts/chat.py --model=runs/grpo                        # latest checkpoint of a run, interactive
  python scripts/chat.py --model=runs/grpo/checkpoints/global_step_30 --prompt="What is 17 * 23?"
  python scripts/chat.py --model=exported/ --temperature=0.7 --top-p=0.9
  python scripts/chat.py --model=smollm2-135m-instruct --prompt="Hi"

`--model` is a run directory, its `checkpoints/` directory or a `global_step_<N>` directory (the actor params
are read, as `scripts/export_hf.py` does; a LoRA checkpoint is merged onto its base), or anything
`models.load_pretrained` accepts (an HF directory, a .gguf file, an installed alias). Prompts are rendered
with the tokenizer's chat template (`models.tokenizer.apply_chat_template`; a tokenizer without one gets the
plain text) and sampled by `rollout.Generator` (the trainer's rollout; greedy with `--temperature=0`).
`--prompt` answers once and exits; otherwise each line read is one user turn of a conversation (an empty
line or EOF ends it; `/reset` starts over).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def _is_checkpoint(path: str) -> bool:
    from jaxrl_post.trainer import checkpoint as ckpt

    if not os.path.isdir(path):
        return False
    _, step = ckpt.parse_step_dir(path)
    return (
        step is not None
        or bool(ckpt.list_complete_steps(path))
        or bool(ckpt.list_complete_steps(ckpt.checkpoint_dir(path)))
    )


def load_chat_model(model: str, *, tokenizer: str | None = None, step: int | None = None):
    """(Transformer, tokenizer, label) for `--model` (see the module docstring).

    Raises:
      CheckpointError: a checkpoint path with nothing complete, or no model metadata.
      FileNotFoundError / ValueError: what `models.load_pretrained` raises for a bad path or name.
      ValueError: no tokenizer found (pass `--tokenizer`).
    """
    from jaxrl_post.trainer.builders import load_tokenizer

    if _is_checkpoint(model):
        here = os.path.join(os.path.dirname(os.path.abspath(__file__)), "export_hf.py")
        spec = importlib.util.spec_from_file_location("_jaxrl_post_export_hf", here)
        export_hf = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(export_hf)
        m, tok, n = export_hf.load_actor(model, step=step)
        label = f"{model} (step {n})"
    else:
        from jaxrl_post.models import load_pretrained

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
      model / tokenizer: as `load_chat_model` returns them.
      max_new_tokens: response length R (a reply is cut there).
      temperature / top_p / top_k: sampling (`rollout.SamplingParams`; temperature 0: greedy).
      seed: base seed; turn i samples with seed + i.
      system: optional system message.
    """

    def __init__(
        self, model, tokenizer, *, max_new_tokens=256, temperature=0.7, top_p=1.0, top_k=-1, seed=0, system=None
    ):
        from jaxrl_post.rollout import Generator, SamplingParams
        from jaxrl_post.trainer.builders import eos_and_pad

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
        from jaxrl_post.models.tokenizer import apply_chat_template

        if getattr(self.tokenizer, "chat_template", None):
            return apply_chat_template(self.tokenizer, self.messages, add_generation_prompt=True)
        text = "\n".join(m["content"] for m in self.messages)
        return [int(i) for i in self.tokenizer(text)["input_ids"]]

    def reply(self, text: str) -> str:
        """The model's answer to the user turn `text` (special tokens and the end-of-turn token removed)."""
        import numpy as np

        from jaxrl_post.protocol import DataProto

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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "--model", required=True, help="run dir / checkpoints dir / global_step_<N> dir, HF dir, .gguf, alias"
    )
    ap.add_argument("--prompt", default=None, help="answer this one prompt and exit (default: interactive)")
    ap.add_argument("--step", type=int, default=None, help="checkpoint step (default: the latest complete one)")
    ap.add_argument("--tokenizer", default=None, help="tokenizer to use instead of the model's")
    ap.add_argument("--system", default=None, help="system message")
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--temperature", type=float, default=0.7, help="0: greedy")
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--top-k", type=int, default=-1)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    from jaxrl_post.log_noise import quiet_startup_noise
    from jaxrl_post.trainer.checkpoint import CheckpointError

    quiet_startup_noise()
    try:
        model, tok, label = load_chat_model(args.model, tokenizer=args.tokenizer, step=args.step)
    except (CheckpointError, FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    chat = Chat(
        model,
        tok,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        system=args.system,
    )
    if args.prompt is not None:
        print(chat.reply(args.prompt), flush=True)
        return 0
    print(f"chatting with {label}; an empty line ends, /reset starts over", file=sys.stderr, flush=True)
    while True:
        try:
            line = input("> ")
        except EOFError:
            break
        if not line.strip():
            break
        if line.strip() == "/reset":
            chat.reset()
            continue
        print(chat.reply(line), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
