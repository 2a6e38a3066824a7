"""The figures quoted in README.md, docs/*.md and the colab/ notebooks' markdown cells, from one source.

`docs/figures.json` holds every quoted measurement (the default GRPO run's held-out accuracy before/after, its
wall time, the LoRA/bf16/DAPO/notebook runs' figures), grouped by the run that produced them, each group with
its command, date, commit and machine. A page quotes a figure inside an invisible span (an HTML comment pair,
hidden by GitHub, mkdocs and Jupyter):

    <!-- fig:default_run.val_after -->34.58%<!-- /fig -->        the figure in its own format ("pct")
    <!-- fig:default_run.wall_s:min -->11<!-- /fig -->            the same figure in another format
    <!-- fig:default_run.date -->2026-12-03<!-- /fig -->         a group's source field

    python scripts/figures.py check             # every span equals figures.json; exit 1 naming file:line
    python scripts/figures.py write             # rewrite every span from figures.json
    python scripts/figures.py from-run runs/grpo --time-v time.txt   # a finished default run -> figures.json

`from-run` reads the run directory's `metrics.jsonl` (the trainer's lines, verl metric names) and takes what
the directory does not hold (whole-run wall time, peak RSS) from `/usr/bin/time -v` output (`--time-v`) or
from `--wall-seconds` / `--peak-rss-gb`. tests/scripts/test_figures.py runs `check` on the repository.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import re
import statistics
import subprocess
import sys

REPO = pathlib.Path(__file__).resolve().parents[1]
FIGURES = "docs/figures.json"
SPAN = re.compile(r"<!-- fig:(?P<key>[\w.]+?)(?::(?P<fmt>\w+))? -->(?P<text>.*?)<!-- /fig -->")
OPEN = "<!-- fig:"
VAL_SUFFIX = "/reward/mean@1"  # the run's held-out greedy accuracy: val-core/<source>/reward/mean@1


def _min_s(seconds: float) -> str:
    m, s = divmod(round(seconds), 60)
    return f"{m} min {s} s"


FORMATS = {
    "pct": lambda v: f"{v:.2%}",  # 0.3458 -> 34.58%
    "f0": lambda v: f"{v:.0f}",
    "f1": lambda v: f"{v:.1f}",
    "f2": lambda v: f"{v:.2f}",
    "f3": lambda v: f"{v:.3f}",
    "min_s": _min_s,  # seconds -> "11 min 27 s"
    "min": lambda v: f"{v / 60:.0f}",  # seconds -> whole minutes
    "min1": lambda v: f"{v / 60:.1f}",  # seconds -> minutes, one decimal
    "str": str,
}
SOURCE_FIELDS = ("command", "date", "commit", "machine")


class FigureError(ValueError):
    """A span names a figure, group field or format that figures.json does not have."""


def load(root: pathlib.Path) -> dict:
    """docs/figures.json under `root` as a dict of groups (keys starting with '_' are comments)."""
    return json.loads((root / FIGURES).read_text(encoding="utf-8"))


def render(figures: dict, key: str, fmt: str | None = None) -> str:
    """The text a span `fig:key[:fmt]` must hold. Raises FigureError for an unknown group, figure or format."""
    group_name, _, name = key.partition(".")
    group = figures.get(group_name)
    if group_name.startswith("_") or not isinstance(group, dict) or not name:
        raise FigureError(f"no group {group_name!r} in {FIGURES} (groups: {', '.join(groups(figures))})")
    if name in SOURCE_FIELDS:
        return str(group[name])
    entry = group.get("figures", {}).get(name)
    if entry is None:
        raise FigureError(f"no figure {key!r} in {FIGURES} (in {group_name}: {', '.join(group.get('figures', {}))})")
    fmt = fmt or entry.get("format", "str")
    if fmt not in FORMATS:
        raise FigureError(f"{key}: unknown format {fmt!r} (formats: {', '.join(FORMATS)})")
    return FORMATS[fmt](entry["value"])


def groups(figures: dict) -> list[str]:
    return [k for k in figures if not k.startswith("_")]


def pages(root: pathlib.Path) -> list[pathlib.Path]:
    """README.md, docs/*.md (not CHANGELOG.md: history keeps its numbers) and colab/*.ipynb under `root`."""
    out = [root / "README.md", *sorted((root / "docs").glob("*.md")), *sorted((root / "colab").glob("*.ipynb"))]
    return [p for p in out if p.is_file()]


def _decode(text: str, notebook: bool) -> str:
    return json.loads(f'"{text}"') if notebook else text  # a notebook's line is a JSON string


def _encode(text: str, notebook: bool) -> str:
    return json.dumps(text, ensure_ascii=False)[1:-1] if notebook else text


def _code_cell_markers(path: pathlib.Path) -> list[int]:
    """Indices of a notebook's code cells that hold a span marker (spans belong in markdown cells)."""
    cells = json.loads(path.read_text(encoding="utf-8"))["cells"]
    src = ["".join(c["source"]) if isinstance(c["source"], list) else c["source"] for c in cells]
    return [i for i, (c, s) in enumerate(zip(cells, src)) if c["cell_type"] != "markdown" and OPEN in s]


def scan(root: pathlib.Path, figures: dict) -> tuple[list[dict], list[str]]:
    """Every span of every page: ({path, line, key, fmt, text, want}, problems). `problems` are lines
    `file:line: ...` for a span whose text differs from figures.json, an unknown key or format, a marker
    without its closing `<!-- /fig -->` on the same line, or a marker in a notebook's code cell."""
    spans, problems = [], []
    for path in pages(root):
        rel, notebook = path.relative_to(root).as_posix(), path.suffix == ".ipynb"
        if notebook:
            for i in _code_cell_markers(path):
                problems.append(f"{rel}: code cell {i} holds a {OPEN} marker (spans go in markdown cells)")
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            found = list(SPAN.finditer(line))
            if line.count(OPEN) != len(found):
                problems.append(f"{rel}:{n}: a {OPEN}...--> marker without its <!-- /fig --> on the same line")
            for m in found:
                text = _decode(m["text"], notebook)
                try:
                    want = render(figures, m["key"], m["fmt"])
                except FigureError as e:
                    problems.append(f"{rel}:{n}: fig:{m['key']}: {e}")
                    continue
                spans.append(dict(path=rel, line=n, key=m["key"], fmt=m["fmt"], text=text, want=want))
                if text != want:
                    problems.append(f"{rel}:{n}: fig:{m['key']} says {text!r}, {FIGURES} gives {want!r}")
    return spans, problems


def check(root: pathlib.Path) -> int:
    """Exit status 1 (printing each problem) when a span disagrees with figures.json, else 0."""
    spans, problems = scan(root, load(root))
    for p in problems:
        print(p, file=sys.stderr)
    if problems:
        print(f"{len(problems)} problem(s); `python scripts/figures.py write` rewrites the spans", file=sys.stderr)
        return 1
    print(f"{len(spans)} figures in {len({s['path'] for s in spans})} files agree with {FIGURES}")
    return 0


def write(root: pathlib.Path) -> int:
    """Rewrite every span's text from figures.json (files untouched when nothing changes). Returns the
    number of spans changed. Raises FigureError for a span naming an unknown figure (nothing written then)."""
    figures, edits = load(root), {}
    for path in pages(root):
        notebook, old = path.suffix == ".ipynb", path.read_text(encoding="utf-8")

        def sub(m, notebook=notebook):
            want = _encode(render(figures, m["key"], m["fmt"]), notebook)
            return m.group(0).replace(f"-->{m['text']}<!--", f"-->{want}<!--", 1)

        new = SPAN.sub(sub, old)
        if new != old:
            changed = sum(a != b for a, b in zip(SPAN.findall(old), SPAN.findall(new)))
            edits[path] = (new, changed)
    for path, (new, changed) in edits.items():
        path.write_text(new, encoding="utf-8")
        print(f"{path.relative_to(root).as_posix()}: {changed} figure(s) rewritten")
    return sum(c for _, c in edits.values())


def read_metrics(run_dir: pathlib.Path) -> list[dict]:
    """The rows of `run_dir/metrics.jsonl` (one dict per line). Raises FileNotFoundError without the file."""
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no metrics.jsonl (is {run_dir} a run directory?)")
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def run_figures(rows: list[dict], val_key: str | None = None) -> dict[str, float]:
    """The default-run figures of a finished run's metrics.jsonl rows.

    Returns {val_before, val_after (fractions), score_first5, score_last5 (mean `critic/score/mean` of the
    first/last 5 steps), response_length_first, response_length_last (`response_length/mean` of the first and
    last step), step_median_s, gen_median_s, update_median_s (medians of `timing_s/step|gen|update_actor`),
    val_before_s, val_after_s (`timing_s/testing` of those validations), step1_s (the first step), steps}.
    Raises ValueError when the run has no validation at step 0 or after its last step, or no training steps.
    """
    if val_key is None:
        keys = sorted({k for r in rows for k in r if k.startswith("val-core/") and k.endswith(VAL_SUFFIX)})
        if len(keys) != 1:
            raise ValueError(f"expected one val-core/.../reward/mean@1 key in metrics.jsonl, found {keys}: --val-key")
        val_key = keys[0]
    train = {r["step"]: r for r in rows if "critic/score/mean" in r}  # later lines of a step win
    if not train:
        raise ValueError("metrics.jsonl has no training steps (critic/score/mean)")
    steps = [train[s] for s in sorted(train)]
    before = [r for r in rows if r.get("step") == 0 and val_key in r]
    after = [r for r in rows if r.get("step") == steps[-1]["step"] and val_key in r]
    if not before or not after:
        raise ValueError(f"the run needs a validation at step 0 and after step {steps[-1]['step']} ({val_key})")

    def mean(rs, k):
        return statistics.fmean(r[k] for r in rs)

    def median(k):
        return statistics.median(r[k] for r in steps if k in r)

    return {
        "val_before": before[-1][val_key],
        "val_after": after[-1][val_key],
        "score_first5": mean(steps[:5], "critic/score/mean"),
        "score_last5": mean(steps[-5:], "critic/score/mean"),
        "response_length_first": steps[0]["response_length/mean"],
        "response_length_last": steps[-1]["response_length/mean"],
        "step_median_s": median("timing_s/step"),
        "gen_median_s": median("timing_s/gen"),
        "update_median_s": median("timing_s/update_actor"),
        "val_before_s": before[-1]["timing_s/testing"],
        "val_after_s": after[-1]["timing_s/testing"],
        "step1_s": steps[0]["timing_s/step"],
        "steps": len(steps),
    }


def parse_time_v(text: str) -> dict[str, float]:
    """`/usr/bin/time -v` output -> {wall_s, peak_rss_gb} (GB = 10^9 bytes). Raises ValueError if absent."""
    wall = re.search(r"Elapsed \(wall clock\) time.*?:\s*(?:(\d+):)?(\d+):([\d.]+)\s*$", text, re.M)
    rss = re.search(r"Maximum resident set size \(kbytes\):\s*(\d+)", text)
    if not wall or not rss:
        raise ValueError("not /usr/bin/time -v output (no 'Elapsed (wall clock) time' / 'Maximum resident set size')")
    h, m, s = wall.groups()
    return {"wall_s": int(h or 0) * 3600 + int(m) * 60 + float(s), "peak_rss_gb": int(rss[1]) * 1e3 / 1e9}


def _machine() -> str:
    cpu = re.search(r"^model name\s*:\s*(.+)$", pathlib.Path("/proc/cpuinfo").read_text(), re.M)
    return f"{os.cpu_count()}-core {cpu[1].strip() if cpu else 'CPU'}"


def _commit(root: pathlib.Path) -> str:
    out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True)
    return out.stdout.strip() or "unknown"


def from_run(root: pathlib.Path, run_dir: pathlib.Path, args: argparse.Namespace) -> dict:
    """Update figures.json's `args.group` (default `default_run`) from a finished run; returns the new group.
    Raises ValueError when the wall time / peak RSS are not given (the run directory does not hold them)."""
    figures = load(root)
    group = figures.setdefault(args.group, {"figures": {}})
    values = run_figures(read_metrics(run_dir), args.val_key)
    timed = parse_time_v(pathlib.Path(args.time_v).read_text()) if args.time_v else {}
    if args.wall_seconds is not None:
        timed["wall_s"] = args.wall_seconds
    if args.peak_rss_gb is not None:
        timed["peak_rss_gb"] = args.peak_rss_gb
    if set(timed) != {"wall_s", "peak_rss_gb"}:
        raise ValueError(
            "the whole-run wall time and peak RSS are not in the run directory: pass --time-v FILE "
            "(/usr/bin/time -v output of the run) or --wall-seconds and --peak-rss-gb"
        )
    values.update(timed)
    formats = {"val_before": "pct", "val_after": "pct", "score_first5": "f2", "score_last5": "f2", "steps": "f0"}
    formats |= {"response_length_first": "f1", "response_length_last": "f1", "wall_s": "min_s", "peak_rss_gb": "f1"}
    for k, v in values.items():
        entry = group["figures"].setdefault(k, {"format": formats.get(k, "f1" if k.endswith("median_s") else "f0")})
        entry["value"] = round(v, 6)
    mtime = (run_dir / "metrics.jsonl").stat().st_mtime
    group["date"] = args.date or datetime.datetime.fromtimestamp(mtime, datetime.UTC).strftime("%Y-%m-%d")
    group["commit"] = args.commit or _commit(root)
    group["machine"] = args.machine or _machine()
    if args.command:
        group["command"] = args.command
    group["produced_by"] = f"python scripts/figures.py from-run {run_dir}" + (" --time-v" if args.time_v else "")
    (root / FIGURES).write_text(json.dumps(figures, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    return group


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--root", default=str(REPO), help="the repository root (default: this checkout)")
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("check", help="every span equals figures.json (exit 1 naming file:line otherwise)")
    sub.add_parser("write", help="rewrite every span from figures.json")
    fr = sub.add_parser("from-run", help="update a group of figures.json from a finished run directory")
    fr.add_argument("run_dir")
    fr.add_argument("--group", default="default_run")
    fr.add_argument("--time-v", help="file with the run's `/usr/bin/time -v` output (wall time, peak RSS)")
    fr.add_argument("--wall-seconds", type=float, help="whole-run wall time in seconds (instead of --time-v)")
    fr.add_argument("--peak-rss-gb", type=float, help="peak RSS in GB (instead of --time-v)")
    fr.add_argument("--val-key", help="held-out accuracy key (default: the one val-core/.../reward/mean@1)")
    fr.add_argument("--date", help="default: metrics.jsonl's modification date (UTC)")
    fr.add_argument("--commit", help="default: git rev-parse --short HEAD")
    fr.add_argument("--machine", help="default: '<cores>-core <CPU model>' of this machine")
    fr.add_argument("--command", help="the command that made the run (default: keep the group's)")
    args = p.parse_args(argv)
    root = pathlib.Path(args.root)
    try:
        if args.cmd == "check":
            return check(root)
        if args.cmd == "write":
            n = write(root)
            print(f"{n} figure(s) rewritten from {FIGURES}")
            return 0
        group = from_run(root, pathlib.Path(args.run_dir), args)
        for k, e in group["figures"].items():
            print(f"{args.group}.{k} = {e['value']}")
        print(f"{FIGURES} updated; now `python scripts/figures.py write` and read the diff")
        return 0
    except (FigureError, ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
