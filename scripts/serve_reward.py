"""Serve a reward function over HTTP for `reward_model.remote.url` (schema: docs/reward_service.md).

Usage:
  python scripts/serve_reward.py                                         # default_compute_score (by data_source)
  python scripts/serve_reward.py --reward_fn configs/tiny_reward.py:compute_score --port 8000
  python scripts/serve_reward.py --reward_fn my_reward.py --host 0.0.0.0 --port 8000   # name: compute_score

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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reward_fn", default=None, help="path.py[:name] (custom_reward_function's path and name)")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    parser.add_argument("--port", type=int, default=8000, help="port (0: a free one)")
    args = parser.parse_args(argv)
    try:
        fn, what = load_reward_fn(args.reward_fn)
    except (FileNotFoundError, ImportError, AttributeError, TypeError) as e:
        print(f"serve_reward: --reward_fn={args.reward_fn!r}: {e}", file=sys.stderr)
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
