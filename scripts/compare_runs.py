"""Several runs' `metrics.jsonl` side by side: one PNG with the score, the held-out accuracy, the step time and the
staleness of every run, and a table (markdown on stdout, JSON with `--json`) of what each run reached.

Usage: python scripts/compare_runs.py WORKDIR [WORKDIR ...] [--labels a,b,c] [--out compare.png] [--json out.json]
       [--window 10]

Per run (`summarize`): held-out accuracy at the first and the last validation (every `val-core/.../mean@k` key;
the first key when there are several), the mean training score over the last `--window` steps, the median step
time (`timing_s/step`, step 1 and its compiles left out), the sum of the step times, and the largest staleness
seen (`async/staleness/max`, 0 for a synchronous run). Example: the synchronous / one-step-off / fully
asynchronous comparison in docs/async.md.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # plot_metrics, a script beside this one
from plot_metrics import load_metrics

SCORE = "critic/score/mean"
STEP = "timing_s/step"
STALE = "async/staleness/max"


def _val_key(series: dict[str, dict[int, float]]) -> str | None:
    keys = sorted(k for k in series if k.startswith("val-core/") and "/mean@" in k)
    return keys[0] if keys else None


def summarize(series: dict[str, dict[int, float]], window: int = 10) -> dict[str, float | str | None]:
    """What one run reached: `val_key`, `val_first` / `val_last` (step of each in `val_first_step` /
    `val_last_step`), `score_last` (mean of the last `window` steps' `critic/score/mean`), `step_s_median` (steps
    after the first), `steps_s_total`, `staleness_max`, `steps`. A value the run did not log is None.

    Raises:
      ValueError: the run logged no training score (not a training run's metrics.jsonl)."""
    if not series.get(SCORE):
        raise ValueError(f"no {SCORE} logged: not the metrics of an RL training run")
    out: dict[str, float | str | None] = {"steps": float(max(series[SCORE]))}
    vk = _val_key(series)
    out["val_key"] = vk
    val = sorted(series.get(vk, {}).items()) if vk else []
    out["val_first_step"], out["val_first"] = (float(val[0][0]), val[0][1]) if val else (None, None)
    out["val_last_step"], out["val_last"] = (float(val[-1][0]), val[-1][1]) if val else (None, None)
    scores = [v for _, v in sorted(series[SCORE].items())][-window:]
    out["score_last"] = sum(scores) / len(scores)
    times = [v for s, v in sorted(series.get(STEP, {}).items()) if s > 1 and math.isfinite(v)]
    out["step_s_median"] = statistics.median(times) if times else None
    out["steps_s_total"] = sum(v for v in series.get(STEP, {}).values() if math.isfinite(v)) or None
    out["staleness_max"] = max(series[STALE].values()) if series.get(STALE) else 0.0
    return out


def _fmt(v, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def table(rows: dict[str, dict]) -> str:
    """The markdown table of `summarize` results, one line per run label."""
    lines = [
        "| run | steps | held-out before | held-out after | score, last steps | median step s | sum of steps s | "
        "max staleness |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for label, r in rows.items():
        lines.append(
            f"| {label} | {_fmt(r['steps'], '.0f')} | {_fmt(r['val_first'], '.2%')} | {_fmt(r['val_last'], '.2%')} "
            f"| {_fmt(r['score_last'], '.3f')} | {_fmt(r['step_s_median'], '.1f')} | "
            f"{_fmt(r['steps_s_total'], '.0f')} | {_fmt(r['staleness_max'], '.0f')} |"
        )
    return "\n".join(lines)


def plot(runs: dict[str, dict[str, dict[int, float]]], out: str) -> None:
    """One PNG: training score, held-out accuracy, step time and staleness per step, one line per run."""
    fig, axes = plt.subplots(2, 2, figsize=(13, 8))
    panels = (
        (axes[0, 0], lambda s: SCORE, "training score (critic/score/mean)"),
        (axes[0, 1], _val_key, "held-out accuracy"),
        (axes[1, 0], lambda s: STEP, "step time (s)"),
        (axes[1, 1], lambda s: STALE, "staleness, max over the batch (versions)"),
    )
    for ax, key_of, title in panels:
        for label, s in runs.items():
            key = key_of(s)
            pts = sorted(s.get(key, {}).items()) if key else []
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], label=label, marker="o" if len(pts) < 5 else None)
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        if ax.get_lines():
            ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("workdirs", nargs="+", help="run working directories holding metrics.jsonl")
    ap.add_argument("--labels", default=None, help="comma-separated names, one per run (default: directory names)")
    ap.add_argument("--out", default="compare.png", help="the PNG to write")
    ap.add_argument("--json", default=None, help="also write the per-run summary as JSON here")
    ap.add_argument("--window", type=int, default=10, help="steps averaged for the final training score")
    args = ap.parse_args(argv)
    labels = args.labels.split(",") if args.labels else [os.path.basename(os.path.abspath(w)) for w in args.workdirs]
    if args.window < 1:
        print(f"error: --window {args.window}: must be >= 1 (steps averaged for the final score)", file=sys.stderr)
        return 2
    if len(labels) != len(args.workdirs):
        print(f"error: --labels names {len(labels)} runs, {len(args.workdirs)} were given", file=sys.stderr)
        return 2
    runs, rows = {}, {}
    for label, w in zip(labels, args.workdirs, strict=True):
        path = os.path.join(w, "metrics.jsonl")
        try:
            runs[label] = load_metrics(path)
            rows[label] = summarize(runs[label], args.window)
        except (OSError, ValueError) as e:
            print(f"error: {path}: {e}", file=sys.stderr)
            return 2
    plot(runs, args.out)
    print(table(rows))
    print(args.out)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
