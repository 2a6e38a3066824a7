"""First vs second start of a main job with the persistent compilation cache (issue 56 item 5).

Runs `python -m jaxrl_post.main --config=CONFIG` (default `configs/grpo.py:tiny`) `--starts` times in fresh
processes that share one new, empty cache directory (`--config.trainer.compilation_cache_dir`), each in its own
fresh run directory (no resume), and first once with the cache off (`''`) as the reference. Each process sums
JAX's own monitoring events (`jax.monitoring`):

- `backend_compile_s`: `/jax/core/compile/backend_compile_duration`, XLA compilation, or loading the program
  from the cache on a hit: what the cache saves;
- `trace_lower_s`: `/jax/core/compile/jaxpr_trace_duration` + `jaxpr_to_mlir_module_duration`: tracing and
  lowering, which every start pays (the cache key is computed from the lowered program);
- `cache_hits`, `cache_requests`: `/jax/compilation_cache/cache_hits`, `compile_requests_use_cache`;

and the process's wall time. Prints one JSON object per start and the ratios of start k to the first cached start.

Usage: python scripts/bench_compile_cache.py [--config configs/grpo.py:tiny] [--starts 2] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# The child: JAX monitoring listeners, then the main job; the totals go to $BENCH_OUT at exit.
CHILD = """
import atexit, collections, json, os, sys
import jax.monitoring as m
tot = collections.Counter()
m.register_event_duration_secs_listener(lambda name, secs, **kw: tot.update({name: secs}))
m.register_event_listener(lambda name, **kw: tot.update({name: 1}))
atexit.register(lambda: open(os.environ["BENCH_OUT"], "w").write(json.dumps(dict(tot))))
from jaxrl_post.main import run
run(sys.argv)
"""
EVENTS = {
    "backend_compile_s": ("/jax/core/compile/backend_compile_duration",),
    "trace_lower_s": ("/jax/core/compile/jaxpr_trace_duration", "/jax/core/compile/jaxpr_to_mlir_module_duration"),
    "cache_hits": ("/jax/compilation_cache/cache_hits",),
    "cache_requests": ("/jax/compilation_cache/compile_requests_use_cache",),
}


def start(config: str, cache_dir: str, run_dir: str, extra: list[str]) -> dict:
    """One main job in a fresh process; the summed events and its wall seconds."""
    out = os.path.join(run_dir, "events.json")
    env = dict(os.environ, BENCH_OUT=out, JAX_PLATFORMS=os.environ.get("JAX_PLATFORMS", "cpu"))
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    env.pop("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", None)
    argv = [
        f"--config={config}",
        f"--config.trainer.compilation_cache_dir={cache_dir}",
        f"--config.trainer.default_local_dir={run_dir}",
        *extra,
    ]
    t0 = time.perf_counter()
    p = subprocess.run([sys.executable, "-c", CHILD, *argv], cwd=REPO, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if p.returncode != 0:
        raise SystemExit(f"error: the main job failed (rc {p.returncode}):\n{p.stderr[-3000:]}")
    with open(out) as f:
        tot = json.load(f)
    row = {k: round(sum(tot.get(e, 0) for e in names), 3) for k, names in EVENTS.items()}
    return {**row, "wall_s": round(wall, 2)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="configs/grpo.py:tiny")
    ap.add_argument("--starts", type=int, default=2, help="starts with the cache (the first one fills it)")
    ap.add_argument("--json", default=None)
    ap.add_argument("overrides", nargs="*", help="more --config.KEY=VALUE arguments (after --)")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench_compile_cache_") as tmp:
        cache = os.path.join(tmp, "xla")
        rows = [{"start": "no cache", **start(a.config, "", os.path.join(tmp, "run_off"), a.overrides)}]
        for k in range(a.starts):
            rows.append(
                {"start": f"cached {k + 1}", **start(a.config, cache, os.path.join(tmp, f"run{k}"), a.overrides)}
            )
            rows[-1]["cache_files"] = len(os.listdir(cache))
        first = rows[1]
        for r in rows[2:]:
            r["backend_compile_ratio"] = round(r["backend_compile_s"] / max(first["backend_compile_s"], 1e-9), 3)
            r["wall_ratio"] = round(r["wall_s"] / first["wall_s"], 3)
        for r in rows:
            print(json.dumps(r))
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"config": a.config, "load_average": os.getloadavg(), "starts": rows}, f, indent=1)


if __name__ == "__main__":
    main()
