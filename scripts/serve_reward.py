"""Serve a reward function over HTTP for `reward_model.remote.url` (schema: docs/reward_service.md).

Usage:
  python scripts/serve_reward.py                                         # default_compute_score (by data_source)
  python scripts/serve_reward.py --reward_fn configs/tiny_reward.py:compute_score --port 8000
  python scripts/serve_reward.py --reward_fn my_reward.py --host 0.0.0.0 --port 8000   # name: compute_score
  python scripts/serve_reward.py --judge_path smollm2-135m-instruct --judge_max_new_tokens 16   # a judge model

Then train with `--config.reward_model.remote.url=http://HOST:PORT/get_reward`. The server listens on
127.0.0.1 (loopback) unless `--host` says otherwise; it has no authentication, so expose it only on a
trusted network. `--port 0` picks a free port. The first line on stdout is
`serving <description> on http://HOST:PORT/get_reward` (tests read the port from it).
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def load_reward_fn(spec: str | None):
    """'path.py[:name]' -> (the function, a description); None -> default_compute_score.

    Raises: FileNotFoundError / ImportError / AttributeError / TypeError as `load_custom_reward_fn`."""
    from jaxrl_post.rewards import default_compute_score, load_custom_reward_fn

    if not spec:
        return default_compute_score, "default_compute_score"
    path, _, name = spec.partition(":")
    fn = load_custom_reward_fn(path, name or "compute_score")
    return fn, f"{fn.name} from {fn.path}"


def load_judge(args):
    """A `GenerativeJudge` of the model at `--judge_path` (built-in template, greedy, our Generator)."""
    from jaxrl_post.models import load_pretrained
    from jaxrl_post.rewards.judge import GenerativeJudge

    model, tokenizer = load_pretrained(args.judge_path, dtype=args.judge_dtype)
    if tokenizer is None:
        raise ValueError(f"no tokenizer files beside {args.judge_path}")
    judge = GenerativeJudge(model, tokenizer, max_new_tokens=args.judge_max_new_tokens)
    return judge, f"generative judge {args.judge_path}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reward_fn", default=None, help="path.py[:name] (custom_reward_function's path and name)")
    parser.add_argument("--judge_path", default=None, help="serve a generative judge: its model path (instead)")
    parser.add_argument("--judge_dtype", default="bfloat16", help="the judge's dtype")
    parser.add_argument("--judge_max_new_tokens", type=int, default=32, help="verdict length limit (tokens)")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    parser.add_argument("--port", type=int, default=8000, help="port (0: a free one)")
    args = parser.parse_args(argv)
    if args.judge_path and args.reward_fn:
        print("serve_reward: pass --reward_fn or --judge_path, not both", file=sys.stderr)
        return 2
    try:
        fn, what = load_judge(args) if args.judge_path else load_reward_fn(args.reward_fn)
    except (ImportError, AttributeError, TypeError, ValueError, OSError, RuntimeError, KeyError) as e:
        flag = f"--judge_path={args.judge_path!r}" if args.judge_path else f"--reward_fn={args.reward_fn!r}"
        print(f"serve_reward: {flag}: {type(e).__name__}: {e}", file=sys.stderr)
        return 2
    from jaxrl_post.rewards.server import make_reward_server

    server = make_reward_server(fn, args.host, args.port)
    host, port = server.server_address[:2]
    print(f"serving {what} on http://{host}:{port}/get_reward", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
