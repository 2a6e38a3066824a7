"""Driver: ours vs TRL, GRPO with the calculator tool (configs/grpo_tools.py), alternated in one sitting.

    python scripts/peers/run_grpo_tools_rounds.py --model-dir $MODEL_DIR --out $PERF [--rounds 2] [--steps 3]

`$MODEL_DIR`: SmolLM2-135M-Instruct as float32 safetensors for TRL (`/work/shared/peers/convert_gguf_to_hf.py`,
the dequantized GGUF that our side loads itself). Writes `$PERF/grpo_tools_rows.jsonl` (grpo_tools_rows.py: the
config's first prompts in our training order), then per round runs

- ours: `python -m jaxrl_post.main --config=configs/grpo_tools.py --config.trainer.total_training_steps=steps+1
  --config.trainer.val_before_train=False --config.trainer.val_at_end=False
  --config.trainer.default_local_dir=<a temp dir>`; step time = `timing_s/step` of its `metrics.jsonl`, the
  first step (compilation) dropped;
- TRL: `grpo_tools_trl.py --steps steps` on the same rows (its first step dropped too),

each a separate process under `/usr/bin/time -v` (peak RSS = its "Maximum resident set size"), with the 1-minute
load average at the start and end of each run. Every record goes to `$PERF/grpo_tools_results.jsonl` as it
arrives; the summary (median over runs of each run's median step time, median peak RSS, TRL / ours step time,
ours / TRL RSS) is printed as a table and as `SUMMARY {json}`.
"""

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

_HERE = os.path.dirname(os.path.abspath(__file__))
_REPO = os.path.dirname(os.path.dirname(_HERE))
_RSS = re.compile(r"Maximum resident set size \(kbytes\): (\d+)")


def ours_from_metrics(path: str) -> dict:
    """Step times of our run from its `metrics.jsonl`: the lines with `timing_s/step`, by step; the first
    (compilation) is the warm-up. `tool_call_frequency` = mean `tool_calls/mean` (calls per trajectory) over all
    steps, as TRL's `tools/call_frequency`; `num_turns_mean` = mean `num_turns/mean` (model + tool turns)."""
    by_step = {}
    with open(path) as f:
        for line in f:
            m = json.loads(line)
            if "timing_s/step" in m:
                by_step[int(m["step"])] = m
    recs = [by_step[k] for k in sorted(by_step)]
    timed = recs[1:]
    step_s = [round(float(m["timing_s/step"]), 3) for m in timed]
    calls = [float(m["tool_calls/mean"]) for m in recs if "tool_calls/mean" in m]
    turns = [float(m["num_turns/mean"]) for m in recs if "num_turns/mean" in m]
    return {
        "system": "jaxrl_post",
        "trainer": "grpo_tools",
        "timed_steps": len(timed),
        "warmup_step_s": round(float(recs[0]["timing_s/step"]), 3) if recs else None,
        "step_s": step_s,
        "step_s_median": round(statistics.median(step_s), 3) if step_s else None,
        "gen_s": [round(float(m.get("timing_s/gen", 0.0)), 3) for m in timed],
        "tool_call_frequency": round(sum(calls) / len(calls), 4) if calls else None,
        "num_turns_mean": round(sum(turns) / len(turns), 4) if turns else None,
    }


def parse_result(stdout: str) -> dict:
    """The last `RESULT {json}` line of a run's stdout ({} when there is none)."""
    out = {}
    for line in stdout.splitlines():
        if line.startswith("RESULT "):
            out = json.loads(line[7:])
    return out


def _timed(cmd: list[str], **kw) -> tuple[subprocess.CompletedProcess, dict]:
    la0, t0 = os.getloadavg()[0], time.perf_counter()
    p = subprocess.run(["/usr/bin/time", "-v", *cmd], capture_output=True, text=True, **kw)
    rec = {"cmd": " ".join(cmd), "rc": p.returncode, "load_start": round(la0, 2)}
    rec.update(load_end=round(os.getloadavg()[0], 2), wall_s=round(time.perf_counter() - t0, 1))
    m = _RSS.search(p.stderr)
    rec["rss_mb"] = round(int(m.group(1)) / 1024, 1) if m else None
    if p.returncode:
        rec["stderr_tail"] = p.stderr[-2000:]
    return p, rec


def ours_cmd(steps: int, run_dir: str, overrides=()) -> list[str]:
    """Our run: `steps` timed steps + 1 warm-up, no validation, metrics in `run_dir` (run from the repo root)."""
    cmd = [sys.executable, "-m", "jaxrl_post.main", "--config=configs/grpo_tools.py"]
    cmd += [f"--config.trainer.total_training_steps={steps + 1}", "--config.trainer.val_before_train=False"]
    return cmd + ["--config.trainer.val_at_end=False", f"--config.trainer.default_local_dir={run_dir}", *overrides]


def run_ours(a) -> dict:
    run_dir = tempfile.mkdtemp(prefix="grpo_tools_ours_")
    _, rec = _timed(ours_cmd(a.steps, run_dir, a.ours_override), cwd=_REPO)
    metrics = os.path.join(run_dir, "metrics.jsonl")
    if os.path.exists(metrics):
        rec.update(ours_from_metrics(metrics))
    else:
        rec["system"] = "jaxrl_post"
    shutil.rmtree(run_dir, ignore_errors=True)
    return rec


def run_trl(a, rows: str) -> dict:
    cmd = [sys.executable, os.path.join(_HERE, "grpo_tools_trl.py"), "--model-dir", a.model_dir, "--rows", rows]
    cmd += ["--steps", str(a.steps), "--threads", str(a.threads)]
    p, rec = _timed(cmd, cwd=_REPO)
    rec.update(parse_result(p.stdout))
    rec.setdefault("system", "trl")
    return rec


def summarize(records: list[dict]) -> dict:
    """Per system: median over its successful runs of each run's median step time and of peak RSS; with both:
    `speedup` = TRL step time / ours, `rss_ratio` = ours peak RSS / TRL's."""
    out = {}
    for system in ("jaxrl_post", "trl"):
        rs = [r for r in records if r["system"] == system and not r.get("rc") and r.get("step_s_median")]
        if rs:
            rss = [r["rss_mb"] for r in rs if r.get("rss_mb")]
            out[system] = {
                "step_s": float(statistics.median(r["step_s_median"] for r in rs)),
                "rss_mb": float(statistics.median(rss)) if rss else None,
                "runs": len(rs),
            }
    if "jaxrl_post" in out and "trl" in out:
        o, t = out["jaxrl_post"], out["trl"]
        out["speedup"] = round(t["step_s"] / o["step_s"], 3)
        out["rss_ratio"] = round(o["rss_mb"] / t["rss_mb"], 3) if o["rss_mb"] and t["rss_mb"] else None
    return out


def table(summary: dict) -> str:
    lines = ["| system | runs | median step s | peak RSS MB |", "|---|---|---|---|"]
    for system in ("jaxrl_post", "trl"):
        if system in summary:
            s = summary[system]
            rss = f"{s['rss_mb']:.0f}" if s["rss_mb"] else "-"
            lines.append(f"| {system} | {s['runs']} | {s['step_s']:.1f} | {rss} |")
    if "speedup" in summary:
        rr = f"{summary['rss_ratio']:.2f}x (ours / TRL)" if summary["rss_ratio"] else "-"
        lines.append(f"| TRL / ours | | {summary['speedup']:.2f}x faster (ours) | {rr} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model-dir", required=True, help="SmolLM2 float32 safetensors dir for TRL")
    ap.add_argument("--out", required=True)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=3, help="timed steps per run (after one warm-up step)")
    ap.add_argument("--threads", type=int, default=2, help="torch threads of the TRL run")
    ap.add_argument("--only", default="jaxrl_post,trl")
    ap.add_argument("--ours-override", action="append", default=[], help="extra --config.* flag for ours")
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    rows = os.path.join(a.out, "grpo_tools_rows.jsonl")
    env = dict(os.environ, PYTHONPATH=_REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    cmd = [sys.executable, os.path.join(_HERE, "grpo_tools_rows.py"), "--out", rows]
    subprocess.run([*cmd, "--prompts", str((a.steps + 1) * 4)], check=True, env=env, cwd=_REPO)
    results = os.path.join(a.out, "grpo_tools_results.jsonl")
    records = []
    for rnd in range(a.rounds):
        for system in a.only.split(","):
            rec = {"round": rnd, **(run_ours(a) if system == "jaxrl_post" else run_trl(a, rows))}
            records.append(rec)
            with open(results, "a") as f:
                f.write(json.dumps(rec) + "\n")
            print(json.dumps(rec), flush=True)
    s = summarize(records)
    print(table(s))
    print("SUMMARY " + json.dumps(s), flush=True)


if __name__ == "__main__":
    main()
