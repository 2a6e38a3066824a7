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
import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from jaxrl_post.chat import Chat, load_chat_model


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
    from jaxrl_post.engine.run.checkpoint import CheckpointError
    from jaxrl_post.runtime.log_noise import quiet_startup_noise

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
            print("(conversation cleared)", file=sys.stderr, flush=True)
            continue
        print(chat.reply(line), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
