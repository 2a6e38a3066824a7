"""PNG plots of a run's `metrics.jsonl`: score/accuracy, response length, KL, entropy, clip fraction and
the step-time breakdown.

Usage: python scripts/plot_metrics.py WORKDIR [--out DIR]   (default DIR: WORKDIR/plots)

Writes `overview.png` (all panels) and one PNG per panel (`score.png`, `response_length.png`, `kl.png`,
`entropy.png`, `clip_fraction.png`, `timing.png`); a panel whose metrics are absent from the run is
skipped. One file holds one run (the trainer moves an earlier run's file aside and truncates on resume);
if the steps in a file go backwards anyway (two runs in one file), only the last run is plotted and a
note on stderr says which lines.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from collections import defaultdict
from collections.abc import Iterable

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

TIMING_PARTS = (
    "gen",
    "gen_max",
    "reward",
    "old_log_prob",
    "ref",
    "values",
    "adv",
    "update_critic",
    "update_actor",
    "testing",
)


class MetricsFileError(ValueError):
    """A metrics.jsonl this script cannot plot: a line that is not a JSON object, or none of the plotted metrics
    (`main` prints it as one `error:` line)."""


def read_rows(path: str) -> list[tuple[int, dict]]:
    """`(line number, row)` for every non-empty line of a metrics.jsonl.

    Raises:
      FileNotFoundError: no such file. MetricsFileError: a line is not a JSON object (names file and line).
    """
    rows = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise MetricsFileError(f"{path}:{lineno}: not a JSON line ({e})") from e
            if not isinstance(row, dict):
                raise MetricsFileError(f"{path}:{lineno}: not a JSON object")
            rows.append((lineno, row))
    return rows


def split_runs(rows: list[tuple[int, dict]]) -> list[list[tuple[int, dict]]]:
    """Split rows where the step goes backwards: each part is one run.

    The trainer keeps one run per file (an earlier run's file is moved aside, a resumed run drops the
    lines after the step it resumed from), so a step going backwards means two runs were written into
    one file (e.g. by an older version of the trainer, or by concatenating files).
    """
    runs: list[list[tuple[int, dict]]] = []
    prev = None
    for lineno, row in rows:
        step = int(row.get("step", lineno))
        if prev is None or step < prev:
            runs.append([])
        runs[-1].append((lineno, row))
        prev = step
    return runs


def load_metrics(path: str, *, note=None) -> dict[str, dict[int, float]]:
    """`{metric: {step: value}}` of the last run in a metrics.jsonl (later lines win; non-numeric values
    dropped). Two runs are never merged: when the steps go backwards, only the last run is read and
    `note` (default: print to stderr) is told which lines were plotted.

    Raises:
      FileNotFoundError: no such file. MetricsFileError: a line is not a JSON object (names file and line).
    """
    runs = split_runs(read_rows(path))
    if len(runs) > 1:
        first, last = runs[-1][0], runs[-1][-1]
        prev_step = int(runs[-2][-1][1].get("step", runs[-2][-1][0]))
        msg = (
            f"note: {path} holds {len(runs)} runs (the step goes back from {prev_step} to "
            f"{int(first[1].get('step', first[0]))} at line {first[0]}); plotting only the last run "
            f"(lines {first[0]}-{last[0]}); runs are never merged"
        )
        (note or (lambda m: print(m, file=sys.stderr)))(msg)
    series: dict[str, dict[int, float]] = defaultdict(dict)
    for lineno, row in runs[-1] if runs else []:
        step = int(row.get("step", lineno))
        for k, v in row.items():
            if k == "step" or isinstance(v, bool):
                continue
            try:
                series[k][step] = float(v)  # 'nan'/'inf' strings too
            except (TypeError, ValueError):
                continue
    return dict(series)


def _xy(series: dict[str, dict[int, float]], key: str) -> tuple[list[int], list[float]]:
    pts = sorted(series.get(key, {}).items())
    return [p[0] for p in pts], [p[1] for p in pts]


def _lines(ax, series, keys: Iterable[str], *, marker=None) -> int:
    n = 0
    for k in keys:
        x, y = _xy(series, k)
        if x and any(math.isfinite(v) for v in y):
            ax.plot(x, y, label=k, marker=marker or ("o" if len(x) < 30 else None), markersize=3)
            n += 1
    return n


def _panel_score(ax, s) -> bool:
    """The score (left axis) and validation means. When the reward function returns extra keys
    (`reward/extra/<k>/mean`, e.g. the rule accuracy `acc` logged beside a reward model's score), those and
    the validation means of the extras go on a right axis, so an RM score (any scale) and the true accuracy
    share one plot: reward hacking shows as the two parting."""
    n = _lines(ax, s, ["critic/score/mean"])
    x, lo = _xy(s, "critic/score/min")
    _, hi = _xy(s, "critic/score/max")
    if x and len(lo) == len(hi):
        ax.fill_between(x, lo, hi, alpha=0.15, label="score min..max")
    val = sorted(k for k in s if k.startswith("val-core/") and ("/mean@" in k or k.endswith("/mean")))
    extras = sorted(k for k in s if k.startswith("reward/extra/") and k.endswith("/mean"))
    names = {k.split("/")[2] for k in extras}
    val_extra = [k for k in val if any(f"/{name}/" in k for name in names)]
    n += _lines(ax, s, [k for k in val if k not in val_extra], marker="s")
    ax.set_title("score / validation accuracy")
    if extras:
        ax2 = ax.twinx()
        m = _lines(ax2, s, extras, marker="^") + _lines(ax2, s, val_extra, marker="D")
        for line in ax2.get_lines():
            line.set_linestyle("--")
        ax2.set_ylabel("extra reward keys (dashed)")
        ax2.legend(fontsize=7, loc="upper right")
        n += m
        ax.set_title("score (left) / extra reward keys (right, dashed)")
    return n > 0


def _panel_length(ax, s) -> bool:
    n = _lines(ax, s, ["response_length/mean", "response_length/max", "response_length/min"])
    x, y = _xy(s, "response_length/clip_ratio")
    if x:
        ax2 = ax.twinx()
        ax2.plot(x, y, color="gray", linestyle="--", label="clip_ratio (right axis)")
        ax2.set_ylabel("clip ratio")
        ax2.set_ylim(0, 1.05)
        ax2.legend(fontsize=7, loc="upper right")
        n += 1
    ax.set_title("response length (tokens)")
    return n > 0


def _panel_kl(ax, s) -> bool:
    n = _lines(ax, s, ["actor/ppo_kl", "actor/kl_loss", "actor/reward_kl_penalty"])
    ax.set_title("KL")
    return n > 0


def _panel_entropy(ax, s) -> bool:
    n = _lines(ax, s, ["actor/entropy"])
    ax.set_title("policy entropy")
    return n > 0


def _panel_clip(ax, s) -> bool:
    n = _lines(ax, s, ["actor/pg_clipfrac", "actor/pg_clipfrac_lower", "critic/vf_clipfrac"])
    ax.set_title("clip fraction")
    return n > 0


def _panel_timing(ax, s) -> bool:
    steps = sorted(s.get("timing_s/step", {}))
    if not steps:
        return False
    bottom = [0.0] * len(steps)
    for part in TIMING_PARTS:
        vals = [s.get(f"timing_s/{part}", {}).get(st, 0.0) for st in steps]
        vals = [v if math.isfinite(v) else 0.0 for v in vals]
        if any(vals):
            ax.bar(steps, vals, bottom=bottom, label=part, width=0.8)
            bottom = [b + v for b, v in zip(bottom, vals)]
    total = [s["timing_s/step"][st] for st in steps]
    other = [max(t - b, 0.0) for t, b in zip(total, bottom)]
    if any(o > 1e-3 for o in other):
        ax.bar(steps, other, bottom=bottom, label="other", width=0.8, color="lightgray")
    ax.plot(steps, total, color="black", marker=".", linewidth=1, label="step")
    ax.set_title("step time breakdown (s)")
    return True


PANELS = (
    ("score", _panel_score),
    ("response_length", _panel_length),
    ("kl", _panel_kl),
    ("entropy", _panel_entropy),
    ("clip_fraction", _panel_clip),
    ("timing", _panel_timing),
)


def plot_workdir(workdir: str, out_dir: str | None = None) -> list[str]:
    """Write the PNGs for `workdir/metrics.jsonl`; returns the written paths (overview first).

    Raises:
      FileNotFoundError: no `workdir/metrics.jsonl`. MetricsFileError: a malformed line, or none of the plotted
      metrics. OSError: `out_dir` cannot be written.
    """
    path = os.path.join(workdir, "metrics.jsonl")
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path} not found: pass the run working directory (trainer.default_local_dir)")
    series = load_metrics(path)
    out_dir = out_dir or os.path.join(workdir, "plots")
    os.makedirs(out_dir, exist_ok=True)
    written = []
    fig, axes = plt.subplots(2, 3, figsize=(16, 8.5))
    shown = 0
    for ax, (_, fn) in zip(axes.flat, PANELS):
        if fn(ax, series):
            ax.set_xlabel("step")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7, loc="best")
            shown += 1
        else:
            ax.set_axis_off()
    if not shown:
        plt.close(fig)
        raise MetricsFileError(
            f"{path} has none of the plotted metrics (critic/score/*, response_length/*, actor/*, timing_s/*)"
        )
    fig.suptitle(os.path.basename(os.path.abspath(workdir)))
    fig.tight_layout()
    p = os.path.join(out_dir, "overview.png")
    fig.savefig(p, dpi=110)
    plt.close(fig)
    written.append(p)
    for name, fn in PANELS:
        fig, ax = plt.subplots(figsize=(7, 4.5))
        if fn(ax, series):
            ax.set_xlabel("step")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7, loc="best")
            fig.tight_layout()
            p = os.path.join(out_dir, f"{name}.png")
            fig.savefig(p, dpi=110)
            written.append(p)
        plt.close(fig)
    return written


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("workdir", help="run working directory holding metrics.jsonl")
    ap.add_argument("--out", default=None, help="output directory (default: WORKDIR/plots)")
    args = ap.parse_args(argv)
    try:
        written = plot_workdir(args.workdir, args.out)
    except (OSError, MetricsFileError) as e:  # no run there, a malformed file, an unwritable --out: the user's to fix
        print(f"error: {e}", file=sys.stderr)
        return 2
    for p in written:
        print(p)
    return 0


if __name__ == "__main__":
    sys.exit(main())
